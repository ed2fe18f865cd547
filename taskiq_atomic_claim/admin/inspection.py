"""What a consumer group looks like right now: the data behind ``inspect``.

``inspect_server`` reads, never writes. Per stream and consumer group it
reports the pending-entries list (PEL) with each consumer's share, the lease
and cursor keys of ``lua/claim.lua`` with their remaining lifetimes, the
dead-letter count and the workers' count of reclaims (``reclaim_count.py``);
once per server, the state of this release's script library. Without
explicit streams it discovers them with a bounded ``SCAN ... TYPE stream``;
this package's own dead-letter streams are not listed as streams, they are
reported with their group.

The JSON form and its documented shape: ``inspection_json.py``.

Names are decoded as UTF-8; bytes that are not UTF-8 appear as ``\\xNN``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import MovedError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.gauges import (
    ConsumerReading,
    GroupGauges,
    group_gauges,
    read_group,
    read_stream,
)
from taskiq_atomic_claim.keys import PREFIX, StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LIBRARY, ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo

# Discovery: SCAN calls of COUNT keys each, and a wall-clock bound.
SCAN_COUNT = 1000
MAX_SCAN_CALLS = 10_000
MAX_STREAMS = 1000
SCAN_DEADLINE_S = 30.0
DEAD_LETTER_PREFIX = f"{PREFIX}:dead:"


# A consumer as read (gauges.py reads for inspect, serve and the gauges).
ConsumerView = ConsumerReading


@dataclass(frozen=True)
class KeyView:
    """A coordination key: its value and remaining lifetime, None when absent."""

    key: str
    value: str | None
    ttl_ms: int | None


@dataclass(frozen=True)
class GroupView:
    name: str
    exists: bool
    pending: int
    last_delivered_id: str | None
    lag: int | None
    oldest_pending_idle_ms: int | None
    pel_scanned: int
    pel_scan_complete: bool
    # All of the group's; ``consumers`` may list fewer (``consumer_limit``).
    consumer_count: int
    last_read_idle_ms: int | None  # the most recently active of all of them
    consumers: list[ConsumerView]
    lease: KeyView
    cursor: KeyView
    dead_letters_key: str
    dead_letters: int
    gauges: GroupGauges  # the same reading, as the gauges export it
    entries_read: int | None = None  # delivered since the group was made
    # Entries reclaimed lately, as the workers counted them (0: none, or
    # the count lapsed); serve's history draws its rate.
    reclaimed: int = 0


@dataclass(frozen=True)
class StreamView:
    name: str
    type: str
    length: int
    groups: list[GroupView]


@dataclass(frozen=True)
class LibraryView:
    name: str
    version: str
    mode: str
    state: str
    other_versions: list[str]


@dataclass(frozen=True)
class Inspection:
    server: ServerInfo
    library: LibraryView
    streams: list[StreamView]
    discovered: bool
    truncated: bool = False


def redis_version(info: Any) -> str:
    """``redis_version`` of an ``INFO server`` reply: the compatibility level
    ACL rules key on (Valkey reports 7.2.4 there). ``ServerInfo.from_info``
    has the real product and version."""
    return str(info.get("redis_version", "unknown")) if isinstance(info, dict) else "?"


async def discover_streams(client: Redis) -> tuple[list[str], bool]:
    """Stream keys on the server, bounded; True when the bound cut the list."""
    found: set[str] = set()
    cursor: Any = 0
    deadline = time.monotonic() + SCAN_DEADLINE_S
    for _ in range(MAX_SCAN_CALLS):
        cursor, keys = await client.scan(cursor, count=SCAN_COUNT, _type="stream")
        for key in keys:
            name = text(key)
            if not name.startswith(DEAD_LETTER_PREFIX):
                found.add(name)
        if int(cursor) == 0:
            return sorted(found)[:MAX_STREAMS], len(found) > MAX_STREAMS
        if len(found) > MAX_STREAMS or time.monotonic() > deadline:
            break
    return sorted(found)[:MAX_STREAMS], True


async def _key_view(client: ScriptClient, key: str, value: Any) -> KeyView:
    """``key`` read as ``value``, with its lifetime."""
    if value is None:
        return KeyView(key, None, None)
    ttl = int(await client.execute_command("PTTL", key))
    # -2: expired between the two calls; -1: no expiry (claim.lua never
    # leaves one, but something else might write the key).
    return KeyView(key, text(value), None if ttl == -2 else ttl)


def _count(value: Any) -> int:
    """A count key's value; 0 when absent or not a count (written by
    something else)."""
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def _first_consumers(
    consumers: list[ConsumerView], limit: int | None
) -> list[ConsumerView]:
    """By name; past ``limit``, only those holding the most, then idle longest
    (a dead consumer holding entries is what a reader looks for)."""
    if limit is not None and len(consumers) > limit:
        consumers = sorted(consumers, key=lambda c: (-c.pending, -c.idle_ms))[:limit]
    return sorted(consumers, key=lambda c: c.name)


# Alive keys read per MGET: each call's reply stays bounded.
ALIVE_CHUNK = 1000


async def _mget(client: ScriptClient, keys: list[str]) -> list[Any]:
    """MGET of keys of one slot; from a client of one Cluster primary (the
    CLI's --cluster reports), at the primary the slot is on."""
    try:
        found: list[Any] = await client.execute_command("MGET", *keys)
    except MovedError as moved:
        pool = getattr(client, "connection_pool", None)
        if pool is None:
            raise
        there = Redis(
            connection_pool=ConnectionPool(
                connection_class=pool.connection_class,
                **{**pool.connection_kwargs, "host": moved.host, "port": moved.port},
            )
        )
        try:
            found = await there.mget(keys)
        finally:
            await there.connection_pool.disconnect()
    return found


async def _with_liveness(
    client: ScriptClient, keys: StreamKeys, consumers: list[ConsumerReading]
) -> list[ConsumerReading]:
    """The consumers, each marked alive or not by its worker's alive key
    (the group's slot: on Cluster too, one MGET per chunk)."""
    marked: list[ConsumerReading] = []
    for first in range(0, len(consumers), ALIVE_CHUNK):
        chunk = consumers[first : first + ALIVE_CHUNK]
        found = await _mget(client, [keys.alive(consumer.name) for consumer in chunk])
        marked += [
            dataclasses.replace(consumer, alive=value is not None)
            for consumer, value in zip(chunk, found, strict=True)
        ]
    return marked


async def inspect_stream(
    client: ScriptClient,
    stream: str,
    group: str | None,
    consumer_limit: int | None = None,
) -> StreamView:
    """One stream and its groups (only ``group`` when given), read through
    ``execute_command`` alone: a Cluster's client reads it too."""
    found = await read_stream(client, stream)
    names = [group] if group is not None else sorted(found.groups)
    groups = []
    for name in names:
        keys = StreamKeys(stream, name)
        # One slot: one read of the three, on Cluster too.
        lease_value, cursor_value, reclaimed = await client.execute_command(
            "MGET", keys.lease, keys.cursor, keys.reclaimed
        )
        lease = await _key_view(client, keys.lease, lease_value)
        cursor = await _key_view(client, keys.cursor, cursor_value)
        reading = await read_group(client, stream, name, found.groups.get(name))
        reading = dataclasses.replace(
            reading, consumers=await _with_liveness(client, keys, reading.consumers)
        )
        groups.append(
            GroupView(
                name=name,
                exists=reading.exists,
                pending=reading.pending,
                last_delivered_id=reading.last_delivered_id,
                lag=reading.lag,
                oldest_pending_idle_ms=reading.oldest_pending_idle_ms,
                pel_scanned=reading.pel_scanned,
                pel_scan_complete=reading.pel_scanned >= reading.pending,
                consumer_count=len(reading.consumers),
                last_read_idle_ms=reading.last_read_idle_ms,
                consumers=_first_consumers(reading.consumers, consumer_limit),
                lease=lease,
                cursor=cursor,
                dead_letters_key=keys.dead_letters,
                dead_letters=reading.dead_letters,
                gauges=group_gauges(found, reading),
                entries_read=reading.entries_read,
                reclaimed=_count(reclaimed),
            )
        )
    return StreamView(stream, found.type, found.length, groups)


async def inspect_server(
    client: Redis,
    streams: list[str] | None = None,
    group: str | None = None,
    runner: ScriptRunner | None = None,
    consumer_limit: int | None = None,
) -> Inspection:
    """Everything ``inspect`` shows; streams None discovers them.
    ``consumer_limit`` bounds the consumers listed per group (the page's
    reads stay bounded with thousands of them)."""
    runner = runner or ScriptRunner()
    server = await runner.probe_server(client)
    status = await runner.status(client)
    library = LibraryView(
        name=LIBRARY.name,
        version=LIBRARY.version,
        mode=status.mode.value,
        state=status.state.value,
        other_versions=list(status.other_versions),
    )
    truncated = False
    discovered = streams is None
    if streams is None:
        streams, truncated = await discover_streams(client)
    views = [
        await inspect_stream(client, stream, group, consumer_limit)
        for stream in streams
    ]
    if discovered and group is not None:
        # A discovered stream without that group is someone else's.
        views = [
            view for view in views if any(candidate.exists for candidate in view.groups)
        ]
    return Inspection(
        server=server,
        library=library,
        streams=views,
        discovered=discovered,
        truncated=truncated,
    )


def plural(count: int, word: str) -> str:
    if count == 1:
        return f"{count} {word}"
    return f"{count} {word[:-1]}ies" if word.endswith("y") else f"{count} {word}s"


def duration(ms: int | None) -> str:
    """Milliseconds for people: 840 ms, 12.3 s, 4.0 min, 2.5 h, 3.1 d."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms} ms"
    seconds = ms / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"
