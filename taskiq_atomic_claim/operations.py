"""Every server-side operation in ``lua/``, declared once: its keys, its
ARGV, its reply, and whether it runs out of memory.

Each operation has one function here, ``<name>_call``, taking its keys by
role and its arguments by name (keyword-only), and returning an
``OperationCall`` typed by the operation's reply: the one place its ARGV
order is written, so a swapped argument is a type error or a wrong name,
not a silent misuse. ``ScriptRunner.run`` (awaited) and
``PipelinedCalls.call`` (pipelined) take that value. A test checks every
function's KEYS and ARGV against its Lua file's header; at import
``scripts.py`` checks each declaration's key count against it, and every
Lua file must be declared here, so the two cannot drift apart.

Out of memory (``maxmemory`` reached, ``noeviction``: producers outpacing
consumers) kicks are refused; what workers do with what they already read
must go on, or acks give up and finished tasks run again. So every operation
of a worker is ``allow_oom``: each frees memory, keeps it as it is, or grows
it by a bound set by the tasks in flight, not by traffic (see each one). The
operator's moves of dead letters back onto streams are refused like kicks,
and re-creating a vanished group as XGROUP CREATE is (the listen loop waits
for memory).
A task's start and ack are plain commands, not operations here
(``task_records.py``): out of memory the ack runs, the start's transaction
is refused and its task runs uncounted.

Replies are typed as redis-py returns them: ids are ``bytes`` or ``str``
depending on the client's ``decode_responses``, hence ``Any`` inside lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

ReplyT = TypeVar("ReplyT")


@dataclass(frozen=True)
class Operation(Generic[ReplyT]):
    """A server-side operation, ``lua/<name>.lua``: what its KEYS are, and
    (as the type parameter) what it replies. Called through its
    ``<name>_call`` function."""

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
# refused, a crashed worker's tasks wait for memory. Its lease, cursor and
# reclaimed count are three small expiring keys; a dead-lettered copy is one
# per entry that crashed max_deliveries workers, acked (deleted with
# delete_acked) at once.
CLAIM: Operation[list[Any]] = Operation(
    "claim",
    ("stream", "lease", "cursor", "dead_letters", "started", "reclaimed"),
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
# [own, others]: own -1 when the caller's consumer still has pending entries,
# else XGROUP DELCONSUMER's; others, how many idle empty ones went with it.
# Frees memory.
LEAVE_GROUP: Operation[list[Any]] = Operation(
    "leave_group", ("stream",), allow_oom=True
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
# -1 when the group exists already, else how many entries it adopted.
# Creates a group, as XGROUP CREATE does: refused out of memory like it.
RECREATE_GROUP: Operation[int] = Operation("recreate_group", ("stream", "started"))
# [[dead-letter id, new stream id], ...]. Adds entries to the stream, as a
# kick does: refused out of memory.
REQUEUE_DEAD_LETTERS: Operation[list[Any]] = Operation(
    "requeue_dead_letters", ("dead_letters", "stream")
)
# XCFGSET's "OK". A kick's: refused out of memory, as the kick would be.
SET_IDEMPOTENCY: Operation[Any] = Operation("set_idempotency", ("stream",))
# The ids the caller no longer owns. The heartbeat: keeps memory as it is.
SET_IDLE: Operation[list[Any]] = Operation("set_idle", ("stream",), allow_oom=True)

# [trimmed, bound]: trimmed -1 when another call trimmed within the interval.
# Out of memory too: it frees memory (its gate is one small expiring key).
TRIM_CONSUMED: Operation[list[Any]] = Operation(
    "trim_consumed", ("stream", "trim_gate"), allow_oom=True
)

OPERATIONS: tuple[Operation[Any], ...] = (
    CLAIM,
    DEAD_LETTER,
    DECLINE,
    DELETE_IDLE_CONSUMER,
    DROP_TRIMMED,
    HAND_BACK,
    LEAVE_GROUP,
    RECREATE_GROUP,
    REQUEUE_DEAD_LETTERS,
    SET_IDEMPOTENCY,
    SET_IDLE,
    TRIM_CONSUMED,
)


class OperationCall(Generic[ReplyT]):
    """One call of an operation, bound to its keys and ARGV, typed by its
    reply; built by the operation's ``<name>_call`` function. A wrong key
    count is refused here, before any round trip."""

    __slots__ = ("args", "keys", "operation")

    def __init__(
        self,
        operation: Operation[ReplyT],
        keys: tuple[str, ...],
        args: tuple[str | int, ...],
    ) -> None:
        operation.check_keys(keys)
        self.operation = operation
        self.keys = keys
        self.args = args

    def __repr__(self) -> str:
        return f"OperationCall({self.operation.name!r}, {self.keys!r}, {self.args!r})"


class ClaimKeys(NamedTuple):
    """The keys ``claim`` takes for one stream, by role."""

    stream: str
    lease: str
    cursor: str
    dead_letters: str
    started: str
    reclaimed: str


def _flag(value: bool) -> int:
    # The scripts test ARGV against "1": an int, never a bool (redis-py
    # refuses bools).
    return 1 if value else 0


def claim_call(
    *,
    keys: Sequence[ClaimKeys],
    group: str,
    consumer: str,
    min_idle_ms: int,
    lease_ms: int,
    cursor_ttl_ms: int,
    max_deliveries: int,
    delete_acked: bool,
    reclaimed_ttl_ms: int,
    counts: Sequence[int],
) -> OperationCall[list[Any]]:
    """``keys`` and ``counts``: one each per stream, in the same order."""
    if len(counts) != len(keys):
        raise TypeError(
            f"claim takes one count per stream: {len(keys)} streams,"
            f" {len(counts)} counts"
        )
    return OperationCall(
        CLAIM,
        tuple(key for of_stream in keys for key in of_stream),
        (
            group,
            consumer,
            min_idle_ms,
            lease_ms,
            cursor_ttl_ms,
            max_deliveries,
            _flag(delete_acked),
            reclaimed_ttl_ms,
            *counts,
        ),
    )


def dead_letter_call(
    *,
    stream: str,
    dead_letters: str,
    started: str,
    group: str,
    entry_id: str,
    reason: str,
    delete_acked: bool,
    deliveries: int | None = None,
) -> OperationCall[list[Any]]:
    """``deliveries``: the count to record, else the PEL's."""
    extra = () if deliveries is None else (deliveries,)
    return OperationCall(
        DEAD_LETTER,
        (stream, dead_letters, started),
        (group, entry_id, reason, _flag(delete_acked), *extra),
    )


def decline_call(
    *, stream: str, group: str, consumer: str, idle_ms: int, bound: int, entry_id: str
) -> OperationCall[int]:
    return OperationCall(
        DECLINE, (stream,), (group, consumer, idle_ms, bound, entry_id)
    )


def delete_idle_consumer_call(
    *, stream: str, group: str, consumer: str
) -> OperationCall[int]:
    return OperationCall(DELETE_IDLE_CONSUMER, (stream,), (group, consumer))


def leave_group_call(
    *, stream: str, group: str, consumer: str, min_idle_ms: int
) -> OperationCall[list[Any]]:
    return OperationCall(LEAVE_GROUP, (stream,), (group, consumer, min_idle_ms))


def drop_trimmed_call(
    *,
    stream: str,
    started: str,
    group: str,
    min_idle_ms: int,
    count: int,
    start: str,
    consumer: str,
) -> OperationCall[list[Any]]:
    return OperationCall(
        DROP_TRIMMED,
        (stream, started),
        (group, min_idle_ms, count, start, consumer),
    )


def hand_back_call(
    *,
    stream: str,
    started: str,
    group: str,
    consumer: str,
    idle_ms: int,
    n_started: int,
    entry_ids: Sequence[str],
) -> OperationCall[list[Any]]:
    """``n_started``: the first that many of ``entry_ids`` had a start
    recorded here."""
    return OperationCall(
        HAND_BACK,
        (stream, started),
        (group, consumer, idle_ms, n_started, *entry_ids),
    )


def requeue_dead_letters_call(
    *, dead_letters: str, stream: str, dead_letter_ids: Sequence[str]
) -> OperationCall[list[Any]]:
    return OperationCall(
        REQUEUE_DEAD_LETTERS, (dead_letters, stream), tuple(dead_letter_ids)
    )


def set_idempotency_call(
    *, stream: str, duration_s: int, maxsize: int
) -> OperationCall[Any]:
    return OperationCall(SET_IDEMPOTENCY, (stream,), (duration_s, maxsize))


def set_idle_call(
    *,
    stream: str,
    group: str,
    consumer: str,
    idle_ms: int,
    orphans: str,
    entry_ids: Sequence[str],
) -> OperationCall[list[Any]]:
    return OperationCall(
        SET_IDLE, (stream,), (group, consumer, idle_ms, orphans, *entry_ids)
    )


def recreate_group_call(
    *, stream: str, started: str, group: str, start: str, orphans: str, mkstream: bool
) -> OperationCall[int]:
    return OperationCall(
        RECREATE_GROUP, (stream, started), (group, start, orphans, _flag(mkstream))
    )


def trim_consumed_call(
    *, stream: str, trim_gate: str, interval_ms: int, keep_from_ms: int, limit: int
) -> OperationCall[list[Any]]:
    """``keep_from_ms``: 0, or the time (ms since the epoch) from which
    entries are kept whether acked or not."""
    return OperationCall(
        TRIM_CONSUMED, (stream, trim_gate), (interval_ms, keep_from_ms, limit)
    )
