"""Find a task by id or name: where it is now and what happened to it.

``find_tasks`` reads, never writes, and is bounded: the newest
``scan_entries`` entries of each stream (XREVRANGE in batches) and the
newest ``scan_entries`` dead letters of each group, stopping at ``limit``
matches. A task older than that is not found; the answer says how far it
looked. The message is taskiq's (JSON by default: ``task_id``,
``task_name``, ``args``, ``kwargs``), read as dead letters are read.

Per match, per consumer group, it is one of:

- ``waiting``: in the stream, not yet delivered to the group;
- ``pending``: delivered and not acked: which consumer holds it, for how
  long, how many times it was delivered (XPENDING) and how many of its
  starts were not followed by an ack (the started hash, ``task_records.py``:
  crashes while it ran);
- ``acked``: delivered and acked (done, or dead-lettered: then it is
  found in the dead letters too), still in the stream;
- ``dead``: in the group's dead-letter stream, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim.admin.dead_letters import DeadLetter, TaskSummary, parse
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text

SCAN_ENTRIES = 10_000
SCAN_BATCH = 500
MAX_MATCHES = 50


@dataclass(frozen=True)
class FoundTask:
    place: str  # waiting, pending, acked or dead
    stream: str
    group: str
    entry_id: str  # in the stream, or in the dead-letter stream when dead
    task: TaskSummary | None
    consumer: str | None = None  # pending: who holds it
    held_ms: int | None = None  # pending: since its last delivery
    deliveries: int | None = None  # pending: XPENDING's count; dead: recorded
    crashes: int | None = None  # pending: starts not followed by an ack
    reason: str | None = None  # dead: why
    original_id: str | None = None  # dead: its id in the stream


@dataclass(frozen=True)
class TaskSearch:
    query: str
    found: list[FoundTask]
    scanned_entries: int  # newest entries read per stream, at most
    scanned_dead_letters: int  # newest dead letters read per group, at most
    cut: bool  # stopped at MAX_MATCHES


def _matches(task: TaskSummary | None, query: str) -> bool:
    return task is not None and query in (task.task_id, task.name)


def _summary(entry_id: Any, fields: Any) -> TaskSummary | None:
    return parse(entry_id, fields).task()


async def _newest(
    client: Redis, key: str, scan: int
) -> list[tuple[str, dict[Any, Any]]]:
    """Up to ``scan`` newest entries of ``key``, newest first."""
    read: list[tuple[str, dict[Any, Any]]] = []
    end = "+"
    while len(read) < scan:
        batch = await client.xrevrange(
            key, max=end, count=min(SCAN_BATCH, scan - len(read))
        )
        if not batch:
            break
        read += [(text(entry_id), dict(fields or {})) for entry_id, fields in batch]
        end = "(" + read[-1][0]
    return read


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def _where(
    client: Redis, keys: StreamKeys, entry_id: str, last_delivered: str | None
) -> dict[str, Any]:
    if last_delivered is None or _id(entry_id) > _id(last_delivered):
        return {"place": "waiting"}
    held = await client.xpending_range(keys.stream, keys.group, entry_id, entry_id, 1)
    if not held:
        return {"place": "acked"}
    crashes = await client.hget(keys.started, entry_id)
    return {
        "place": "pending",
        "consumer": text(held[0]["consumer"]),
        "held_ms": int(held[0]["time_since_delivered"]),
        "deliveries": int(held[0]["times_delivered"]),
        "crashes": int(crashes or 0),
    }


async def find_tasks(
    client: Redis,
    groups: list[tuple[str, str, str | None]],
    query: str,
    scan_entries: int = SCAN_ENTRIES,
    limit: int = MAX_MATCHES,
) -> TaskSearch:
    """Tasks whose id or name is ``query``, in each (stream, group,
    last-delivered id) of ``groups``: waiting, pending or acked in the stream,
    or dead-lettered."""
    found: list[FoundTask] = []
    by_stream: dict[str, list[tuple[str, str | None]]] = {}
    for stream, group, last in groups:
        by_stream.setdefault(stream, []).append((group, last))
    for stream, its_groups in by_stream.items():
        await _in_stream(client, stream, its_groups, query, scan_entries, found)
        if len(found) >= limit:
            return TaskSearch(query, found[:limit], scan_entries, 0, True)
    for stream, its_groups in by_stream.items():
        for group, _ in its_groups:
            keys = StreamKeys(stream, group)
            await _in_dead_letters(client, keys, query, scan_entries, found)
            if len(found) >= limit:
                return TaskSearch(
                    query, found[:limit], scan_entries, scan_entries, True
                )
    return TaskSearch(query, found, scan_entries, scan_entries, False)


async def _in_stream(
    client: Redis,
    stream: str,
    groups: list[tuple[str, str | None]],
    query: str,
    scan: int,
    found: list[FoundTask],
) -> None:
    needle = query.encode()
    for entry_id, fields in await _newest(client, stream, scan):
        if needle not in fields.get(b"data", b""):
            continue  # cheap: most entries are not parsed at all
        task = _summary(entry_id, fields)
        if not _matches(task, query):
            continue
        for group, last in groups:
            where = await _where(client, StreamKeys(stream, group), entry_id, last)
            found.append(FoundTask(stream=stream, group=group, entry_id=entry_id,
                                   task=task, **where))  # fmt: skip


async def _in_dead_letters(
    client: Redis, keys: StreamKeys, query: str, scan: int, found: list[FoundTask]
) -> None:
    needle = query.encode()
    for entry_id, fields in await _newest(client, keys.dead_letters, scan):
        if needle not in fields.get(b"data", b""):
            continue
        letter: DeadLetter = parse(entry_id, fields)
        task = letter.task()
        if not _matches(task, query):
            continue
        found.append(
            FoundTask(
                "dead",
                keys.stream,
                keys.group,
                letter.id,
                task,
                deliveries=letter.deliveries,
                reason=letter.reason,
                original_id=letter.original_id or None,
            )
        )


def task_search_to_json(search: TaskSearch) -> dict[str, Any]:
    """``serve``'s ``GET /api/tasks?q=``."""
    return {
        "query": search.query,
        "scanned_entries": search.scanned_entries,
        "scanned_dead_letters": search.scanned_dead_letters,
        "cut": search.cut,
        "found": [
            {
                "place": f.place,
                "stream": f.stream,
                "group": f.group,
                "id": f.entry_id,
                "at_ms": int(f.entry_id.partition("-")[0]),
                "task": None if f.task is None else f.task.name,
                "task_id": None if f.task is None else f.task.task_id,
                "arguments": None if f.task is None else f.task.arguments,
                "consumer": f.consumer,
                "held_ms": f.held_ms,
                "deliveries": f.deliveries,
                "crashes": f.crashes,
                "reason": f.reason,
                "original_id": f.original_id,
            }
            for f in search.found
        ],
    }
