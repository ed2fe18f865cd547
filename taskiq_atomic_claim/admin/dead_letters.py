"""Dead letters: entries a consumer group gave up on, listed and requeued for
people to decide. Moving an entry there is the runtime's
(``taskiq_atomic_claim.dead_letters``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from redis.asyncio import Redis
from taskiq import TaskiqFormatter
from taskiq.formatters.json_formatter import JSONFormatter

from taskiq_atomic_claim.admin.inspection import MAX_SCAN_CALLS, SCAN_COUNT
from taskiq_atomic_claim.keys import PREFIX, StreamKeys
from taskiq_atomic_claim.operations import requeue_dead_letters_call
from taskiq_atomic_claim.replies import text as _text
from taskiq_atomic_claim.scripts import ScriptRunner

METADATA_PREFIX = b"dead_letter_"
REQUEUE_BATCH = 100
# How much of a message's arguments (or raw data) a listing shows.
PREVIEW_CHARS = 60
MAX_DEAD_LETTERS_SCANNED = 1_000_000
DEAD_LETTER_PATTERN = f"{PREFIX}:dead:*"


def recorded_pair(fields: dict[Any, Any]) -> StreamKeys | None:
    """The stream and group a dead letter records; None if it records none."""
    stream = fields.get(b"dead_letter_stream")
    group = fields.get(b"dead_letter_group")
    if stream is None or group is None:
        return None
    return StreamKeys(_text(stream), _text(group))


@dataclass(frozen=True)
class DeadLetter:
    id: str
    original_id: str
    deliveries: int
    reason: str
    fields: dict[bytes, bytes]

    @property
    def data(self) -> bytes:
        return self.fields.get(b"data", b"")

    def task(self, formatter: TaskiqFormatter | None = None) -> TaskSummary | None:
        """What the message asked for, read with the broker's formatter
        (taskiq's default, JSON); None when it does not parse."""
        try:
            message = (formatter or JSONFormatter()).loads(self.data)
        except Exception:  # a formatter may raise anything on bad input
            return None
        arguments = ", ".join(
            [repr(arg) for arg in message.args]
            + [f"{name}={value!r}" for name, value in message.kwargs.items()]
        )
        return TaskSummary(message.task_name, message.task_id, arguments)


@dataclass(frozen=True)
class TaskSummary:
    name: str
    task_id: str
    arguments: str  # as a call would spell them: 1, 'a', key='v'


def entry_time(entry_id: str) -> datetime:
    """When a stream entry was added: the milliseconds part of its id."""
    return datetime.fromtimestamp(int(entry_id.partition("-")[0]) / 1000, timezone.utc)


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse(entry_id: Any, fields: Mapping[Any, Any] | None) -> DeadLetter:
    # Admin clients read bytes (no decode_responses); an entry has fields.
    fields = fields or {}
    return DeadLetter(
        id=_text(entry_id),
        original_id=_text(fields.get(b"dead_letter_id", b"")),
        deliveries=int(fields.get(b"dead_letter_deliveries", b"0")),
        reason=_text(fields.get(b"dead_letter_reason", b"")),
        fields={k: v for k, v in fields.items() if not k.startswith(METADATA_PREFIX)},
    )


async def list_dead_letters(
    client: Redis, keys: StreamKeys, count: int = 100, after: str | None = None
) -> list[DeadLetter]:
    """The first ``count`` dead letters, or the ``count`` after id ``after``."""
    start = "-" if after is None else "(" + after
    entries = await client.xrange(keys.dead_letters, min=start, count=count)
    return [parse(entry_id, fields) for entry_id, fields in entries or []]


async def find_dead_letter_queues(
    client: Redis, group: str | None = None
) -> tuple[list[StreamKeys], bool]:
    """Every stream and group (only ``group``, if given) with dead letters,
    as their dead-letter streams record them; True when the scan was cut."""
    found: set[StreamKeys] = set()
    cursor: Any = 0
    for _ in range(MAX_SCAN_CALLS):
        cursor, keys = await client.scan(
            cursor, match=DEAD_LETTER_PATTERN, count=SCAN_COUNT, _type="stream"
        )
        for key in keys:
            first = await client.xrange(key, count=1)
            pair = recorded_pair(first[0][1] or {}) if first else None
            if pair is not None and group in (None, pair.group):
                found.add(pair)
        if int(cursor) == 0:
            return sorted(found, key=lambda k: (k.stream, k.group)), False
    return sorted(found, key=lambda k: (k.stream, k.group)), True


async def unknown_pair(client: Redis, keys: StreamKeys) -> str | None:
    """Why ``keys`` names no queue and group of this server (a mistyped
    ``--queue`` or ``--group``); None when the stream has the group, or when
    the pair has dead letters (its stream may be gone since)."""
    if await client.exists(keys.dead_letters):
        return None
    kind = _text(await client.type(keys.stream))
    if kind == "none":
        return (
            f"no queue {keys.stream!r} on this server: no such stream, no dead letters"
        )
    if kind != "stream":
        return f"{keys.stream!r} holds a {kind}, not a queue's stream"
    groups = sorted(_text(g["name"]) for g in await client.xinfo_groups(keys.stream))
    if keys.group in groups:
        return None
    named = ", ".join(repr(g) for g in groups) or "none"
    return f"queue {keys.stream!r} has no group {keys.group!r} (its groups: {named})"


async def chosen_dead_letters(
    client: Redis,
    keys: StreamKeys,
    ids: list[str] | None = None,
    task_name: str | None = None,
    formatter: TaskiqFormatter | None = None,
) -> AsyncIterator[DeadLetter]:
    """The dead letters of these ids (those that exist), else of calls of
    ``task_name``, else all of them: what a requeue or delete acts on. One
    batch at a time: a million payloads are never held at once."""
    if ids is not None:
        for wanted in dict.fromkeys(ids):
            exact = await client.xrange(keys.dead_letters, wanted, wanted)
            for entry_id, fields in exact or []:
                yield parse(entry_id, fields)
        return
    start = "-"
    for _ in range(MAX_DEAD_LETTERS_SCANNED // REQUEUE_BATCH):
        entries = (
            await client.xrange(keys.dead_letters, min=start, count=REQUEUE_BATCH) or []
        )
        for entry_id, fields in entries:
            letter = parse(entry_id, fields)
            if task_name is None:
                yield letter
                continue
            task = letter.task(formatter)
            if task is not None and task.name == task_name:
                yield letter
        if len(entries) < REQUEUE_BATCH:
            break
        start = "(" + _text(entries[-1][0])  # exclusive: after the last one read


async def chosen_dead_letter_ids(
    client: Redis,
    keys: StreamKeys,
    ids: list[str] | None = None,
    task_name: str | None = None,
    formatter: TaskiqFormatter | None = None,
) -> list[str]:
    """The ids ``chosen_dead_letters`` finds."""
    chosen = chosen_dead_letters(client, keys, ids, task_name, formatter)
    return [letter.id async for letter in chosen]


async def requeue_dead_letters(
    runner: ScriptRunner,
    client: Redis,
    keys: StreamKeys,
    ids: list[str] | None = None,
) -> list[tuple[str, str]]:
    """Re-add dead letters (all when ``ids`` is None) to their stream.

    Returns (dead-letter id, new stream id) pairs. Each batch is one atomic
    script call, so an entry is never both requeued and still dead, or neither.
    """
    moved: list[tuple[str, str]] = []
    if ids is not None:
        batches = [
            ids[i : i + REQUEUE_BATCH] for i in range(0, len(ids), REQUEUE_BATCH)
        ]
        for batch in batches:
            moved += await _requeue(runner, client, keys, batch)
        return moved
    # Bounded: each pass removes what it read, so the stream only shrinks.
    for _ in range(1_000_000 // REQUEUE_BATCH):
        entries = await client.xrange(keys.dead_letters, count=REQUEUE_BATCH)
        if not entries:
            break
        moved += await _requeue(
            runner, client, keys, [_text(entry_id) for entry_id, _ in entries]
        )
    return moved


async def _requeue(
    runner: ScriptRunner, client: Redis, keys: StreamKeys, ids: list[str]
) -> list[tuple[str, str]]:
    reply = await runner.run(
        client,
        requeue_dead_letters_call(
            dead_letters=keys.dead_letters, stream=keys.stream, dead_letter_ids=ids
        ),
    )
    return [(_text(old), _text(new)) for old, new in reply]


async def dead_letters_page(
    client: Redis, keys: StreamKeys, before: str | None = None, count: int = 50
) -> list[DeadLetter]:
    """Newest first, at most ``count``, older than the id ``before`` (None:
    from the newest): one XREVRANGE, however long the stream."""
    end = "+" if before is None else "(" + before  # exclusive
    entries = await client.xrevrange(keys.dead_letters, max=end, count=count)
    return [parse(entry_id, fields) for entry_id, fields in entries or []]


async def delete_dead_letters(client: Redis, keys: StreamKeys, ids: list[str]) -> int:
    """Drop these dead letters for good; how many existed. Each batch is
    one XDEL: an id either is deleted or was not there (requeued since)."""
    deleted = 0
    for i in range(0, len(ids), REQUEUE_BATCH):
        deleted += int(
            await client.xdel(keys.dead_letters, *ids[i : i + REQUEUE_BATCH])
        )
    return deleted
