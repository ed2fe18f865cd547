"""Every server-side operation in ``lua/``, declared once: its keys, its
reply, and whether it runs out of memory.

Callers pass one of these to ``ScriptRunner.call``, which refuses a call with
the wrong number of keys before any round trip. At import ``scripts.py``
checks each declaration against its Lua file's header (the ``KEYS[n]``
lines), and every Lua file must be declared here, so the two cannot drift
apart.

Out of memory (``maxmemory`` reached, ``noeviction``: producers outpacing
consumers) kicks are refused; what workers do with what they already read
must go on, or acks give up and finished tasks run again. So every operation
of a worker is ``allow_oom``: each frees memory, keeps it as it is, or grows
it by a bound set by the tasks in flight, not by traffic (see each one). The
operator's moves of dead letters back onto streams are refused like kicks.
A task's start and ack are plain commands, not operations here
(``task_records.py``): out of memory the ack runs, the start's transaction
is refused and its task runs uncounted.

Replies are typed as redis-py returns them: ids are ``bytes`` or ``str``
depending on the client's ``decode_responses``, hence ``Any`` inside lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

ReplyT = TypeVar("ReplyT")


@dataclass(frozen=True)
class Operation(Generic[ReplyT]):
    """A server-side operation, ``lua/<name>.lua``: what its KEYS are, and
    (as the type parameter) what it replies."""

    name: str
    keys: tuple[str, ...]  # what KEYS[1], KEYS[2], ... are, for error messages
    # The keys come as one group per item (e.g. per stream), any number of
    # groups: KEYS[n*i+1..n*i+n].
    repeated: bool = False
    # Runs when the server is out of memory (maxmemory reached under
    # noeviction): registered with the allow-oom flag. Redis/Valkey >= 7
    # refuse a function without it as a whole, even one that only frees
    # memory. (Redis 6.2 has no flags: there a script only has its first
    # write refused, and only one that may grow memory.)
    allow_oom: bool = False

    @property
    def num_keys(self) -> int:
        return len(self.keys)

    def check_keys(self, keys: Sequence[str]) -> None:
        """A wrong key count is a bug in the caller: say so before any round
        trip (the script would index past KEYS or take an ARGV for a key)."""
        if self.repeated:
            if keys and len(keys) % self.num_keys == 0:
                return
            raise TypeError(
                f"operation {self.name!r} takes groups of {self.num_keys} keys"
                f" ({', '.join(self.keys)}), got {len(keys)}"
            )
        if len(keys) != self.num_keys:
            raise TypeError(
                f"operation {self.name!r} takes {self.num_keys} keys"
                f" ({', '.join(self.keys)}), got {len(keys)}"
            )


# ["claimed", cursor, entries, trimmed ids, [[dead-lettered id, data], ...]] or
# ["skipped", holder, lease ttl ms]; parsed by ``claim.py``.
# Out of memory too: where reads reclaim (Redis >= 8.4) they do anyway, and
# refused, a crashed worker's tasks wait for memory. Its lease and cursor
# are two small expiring keys; a dead-lettered copy is one per entry that
# crashed max_deliveries workers, acked (deleted with delete_acked) at once.
CLAIM: Operation[list[Any]] = Operation(
    "claim",
    ("stream", "lease", "cursor", "dead_letters", "started"),
    repeated=True,
    allow_oom=True,
)
# The entry's delivery count (handed back if below the bound), or -1.
# Out of memory too: a hand-back changes an existing PEL entry, adds nothing.
DECLINE: Operation[int] = Operation("decline", ("stream",), allow_oom=True)
# [dead-letter id, its data field or None], or [] when the entry was already gone.
# Out of memory too: in place of the ack of an entry taskiq cannot run; the
# heartbeat runs it first, so refused it would stop the heartbeat too.
DEAD_LETTER: Operation[list[Any]] = Operation(
    "dead_letter", ("stream", "dead_letters", "started"), allow_oom=True
)
# -1 when the consumer still has pending entries, else XGROUP DELCONSUMER's.
# Frees memory.
DELETE_IDLE_CONSUMER: Operation[int] = Operation(
    "delete_idle_consumer", ("stream",), allow_oom=True
)
# [next start, [dropped id, ...]]: pending entries whose data was gone.
# Frees memory.
DROP_TRIMMED: Operation[list[Any]] = Operation(
    "drop_trimmed", ("stream", "started"), allow_oom=True
)
# The ids the caller no longer owns. Keeps or frees memory.
HAND_BACK: Operation[list[Any]] = Operation(
    "hand_back", ("stream", "started"), allow_oom=True
)
# [[dead-letter id, new stream id], ...]. Adds entries to the stream, as a
# kick does: refused out of memory.
REQUEUE_DEAD_LETTERS: Operation[list[Any]] = Operation(
    "requeue_dead_letters", ("dead_letters", "stream")
)
# XCFGSET's "OK". A kick's: refused out of memory, as the kick would be.
SET_IDEMPOTENCY: Operation[Any] = Operation("set_idempotency", ("stream",))
# The ids the caller no longer owns. The heartbeat: keeps memory as it is.
SET_IDLE: Operation[list[Any]] = Operation("set_idle", ("stream",), allow_oom=True)

OPERATIONS: tuple[Operation[Any], ...] = (
    CLAIM,
    DEAD_LETTER,
    DECLINE,
    DELETE_IDLE_CONSUMER,
    DROP_TRIMMED,
    HAND_BACK,
    REQUEUE_DEAD_LETTERS,
    SET_IDEMPOTENCY,
    SET_IDLE,
)
