"""Every server-side operation in ``lua/``, declared once: its keys and reply.

Callers pass one of these to ``ScriptRunner.call``, which refuses a call with
the wrong number of keys before any round trip. At import each declaration is
checked against its Lua file's header (the ``KEYS[n]`` lines), and every Lua
file must be declared here, so the two cannot drift apart.

Replies are typed as redis-py returns them: ids are ``bytes`` or ``str``
depending on the client's ``decode_responses``, hence ``Any`` inside lists.
"""

from __future__ import annotations

from typing import Any

from taskiq_atomic_claim.scripts import LIBRARY, Operation, ScriptLibrary

# XACK's reply: 1 if the entry was pending, else 0.
ACK: Operation[int] = Operation("ack", ("stream", "started"))
# ["claimed", cursor, entries, trimmed ids, dead-lettered ids] or
# ["skipped", holder, lease ttl ms]; parsed by ``claim.py``.
CLAIM: Operation[list[Any]] = Operation(
    "claim", ("stream", "lease", "cursor", "dead_letters", "started"), repeated=True
)
# The entry's delivery count (handed back if below the bound), or -1.
DECLINE: Operation[int] = Operation("decline", ("stream",))
# [dead-letter id], or [] when the entry was already gone.
DEAD_LETTER: Operation[list[Any]] = Operation(
    "dead_letter", ("stream", "dead_letters", "started")
)
# -1 when the consumer still has pending entries, else XGROUP DELCONSUMER's.
DELETE_IDLE_CONSUMER: Operation[int] = Operation("delete_idle_consumer", ("stream",))
# [next start, [dropped id, ...]]: pending entries whose data was gone.
DROP_TRIMMED: Operation[list[Any]] = Operation("drop_trimmed", ("stream", "started"))
# The ids the caller no longer owns.
HAND_BACK: Operation[list[Any]] = Operation("hand_back", ("stream", "started"))
# How many dead letters moved.
MIGRATE_DEAD_LETTERS: Operation[int] = Operation(
    "migrate_dead_letters", ("old_dead_letters", "new_dead_letters")
)
# [[dead-letter id, new stream id], ...]
REQUEUE_DEAD_LETTERS: Operation[list[Any]] = Operation(
    "requeue_dead_letters", ("dead_letters", "stream")
)
# The ids the caller no longer owns.
SET_IDLE: Operation[list[Any]] = Operation("set_idle", ("stream",))
# How many starts were recorded.
START: Operation[int] = Operation("start", ("started",))

OPERATIONS: tuple[Operation[Any], ...] = (
    ACK,
    CLAIM,
    DEAD_LETTER,
    DECLINE,
    DELETE_IDLE_CONSUMER,
    DROP_TRIMMED,
    HAND_BACK,
    MIGRATE_DEAD_LETTERS,
    REQUEUE_DEAD_LETTERS,
    SET_IDLE,
    START,
)


def check_declarations(
    library: ScriptLibrary, operations: tuple[Operation[Any], ...] = OPERATIONS
) -> None:
    """Raise unless ``operations`` and the library's Lua files match: the
    same names, and each with the key count its header declares."""
    declared = {operation.name: operation for operation in operations}
    if set(declared) != set(library.scripts):
        raise RuntimeError(
            "lua/ and operations.py disagree: undeclared"
            f" {sorted(set(library.scripts) - set(declared))}, without a Lua"
            f" file {sorted(set(declared) - set(library.scripts))}"
        )
    for name, script in library.scripts.items():
        if script.repeated_keys != declared[name].repeated:
            raise RuntimeError(
                f"lua/{name}.lua and operations.py disagree on whether its keys"
                " come in a group per item"
            )
        if script.num_keys != declared[name].num_keys:
            raise RuntimeError(
                f"lua/{name}.lua declares {script.num_keys} KEYS, operations.py"
                f" {declared[name].num_keys} ({', '.join(declared[name].keys)})"
            )


check_declarations(LIBRARY)
