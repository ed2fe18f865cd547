"""Dead letters under key names of earlier releases, found and moved.

Earlier releases named a group's dead-letter stream after ``{stream}`` alone,
so streams ``s`` and ``{s}`` shared one (``keys.legacy_slot_anchor``). Every
dead letter records its stream and group, so each one can be moved to the key
its pair has now; the key an entry sits in does not need to be decoded.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from taskiq_atomic_claim.admin.inspection import MAX_SCAN_CALLS, SCAN_COUNT, text
from taskiq_atomic_claim.keys import PREFIX, StreamKeys
from taskiq_atomic_claim.operations import MIGRATE_DEAD_LETTERS
from taskiq_atomic_claim.scripts import ScriptRunner

DEAD_LETTER_PATTERN = f"{PREFIX}:dead:*"
MIGRATE_BATCH = 100
# A key is checked by its first entries: one written the old way shows at once.
SAMPLE = 100
MAX_PAGES = 1_000_000 // MIGRATE_BATCH


@dataclass(frozen=True)
class Misplaced:
    key: str
    # Of the first SAMPLE entries, how many belong in another key.
    sampled: int


def recorded_pair(fields: dict[Any, Any]) -> StreamKeys | None:
    """The stream and group a dead letter records; None if it records none."""
    stream = fields.get(b"dead_letter_stream")
    group = fields.get(b"dead_letter_group")
    if stream is None or group is None:
        return None
    return StreamKeys(text(stream), text(group))


def home(fields: dict[Any, Any]) -> str | None:
    """The dead-letter key of the pair an entry records; None if it records none."""
    pair = recorded_pair(fields)
    return None if pair is None else pair.dead_letters


def _elsewhere(key: str, entries: list[Any]) -> list[tuple[str, str]]:
    """(id, target) of each entry that belongs in another key."""
    moves = []
    for entry_id, fields in entries:
        target = home(fields)
        if target is not None and target != key:
            moves.append((text(entry_id), target))
    return moves


async def find_misplaced_dead_letters(client: Any) -> tuple[list[Misplaced], bool]:
    """Dead-letter streams holding entries of another pair; True when cut."""
    found: list[Misplaced] = []
    cursor: Any = 0
    for _ in range(MAX_SCAN_CALLS):
        cursor, keys = await client.scan(
            cursor, match=DEAD_LETTER_PATTERN, count=SCAN_COUNT, _type="stream"
        )
        for raw in keys:
            key = text(raw)
            moves = _elsewhere(key, await client.xrange(key, count=SAMPLE))
            if moves:
                found.append(Misplaced(key, len(moves)))
        if int(cursor) == 0:
            return sorted(found, key=lambda m: m.key), False
    return sorted(found, key=lambda m: m.key), True


async def migrate_dead_letters(runner: ScriptRunner, client: Any, key: str) -> int:
    """Move every entry of ``key`` that belongs elsewhere; returns how many.

    Each batch is one atomic script call (added there, deleted here), so an
    interrupted migration leaves every entry in exactly one of the two keys.
    """
    moved = 0
    start = "-"
    for _ in range(MAX_PAGES):
        entries = await client.xrange(key, min=start, count=MIGRATE_BATCH)
        if not entries:
            break
        by_target: dict[str, list[str | int]] = defaultdict(list)
        for entry_id, target in _elsewhere(key, entries):
            by_target[target].append(entry_id)
        for target, ids in by_target.items():
            moved += await runner.call(client, MIGRATE_DEAD_LETTERS, [key, target], ids)
        # Entries that stay are skipped next time: resume after the last one.
        start = "(" + text(entries[-1][0])
    return moved
