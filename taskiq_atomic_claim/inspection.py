"""What a consumer group looks like right now: the data behind ``inspect``.

``inspect_server`` reads, never writes. Per stream and consumer group it
reports the pending-entries list (PEL) with each consumer's share, the lease
and cursor keys of ``lua/claim.lua`` with their remaining lifetimes, and the
dead-letter count; once per server, the state of this release's script
library. Without explicit streams it discovers them with a bounded
``SCAN ... TYPE stream``; this package's own dead-letter streams are not
listed as streams, they are reported with their group.

JSON shape (``inspection_to_json``), format 1. Durations are integer
milliseconds; ``null`` means unknown or absent. New keys may be added within
format 1; existing keys keep their names, types and meaning::

    {
      "format": 1,
      "node": "127.0.0.1:6379",  # where it was read (host:port, or the URL)
      "server": {
        "version": "9.1.2",      # the real version (Valkey's, not its
                                 # redis_version compatibility field)
        "product": "Redis" | "Valkey",
        "name": "Valkey 9.1.2",
        "functions": true,       # FUNCTION/FCALL (else cached scripts)
        "scripting": true,       # scripts run for this connection
        "scripting_problem": "" | "FCALL refused for this user (...)",
        "native_claim": false,   # XREADGROUP ... CLAIM (Redis >= 8.4)
        "acked_trimming": false, # XADD/XTRIM ACKED, XACKDEL (Redis >= 8.2)
        "reclaim_path": "lua claim script",  # what this release uses here
        "trimming": "MAXLEN (trims pending entries too)"
      },
      "library": {
        "name": "taskiq_atomic_claim_<version>",  # what this release loads
        "version": "<version>",
        "mode": "function library" | "cached scripts",
        "state": "current" | "missing" | "outdated",
        "other_versions": ["taskiq_atomic_claim_<other>", ...]
      },
      "discovery": {
        "discovered": true,      # false: streams were named with --queue
        "truncated": false       # true: the SCAN bound was hit; list incomplete
      },
      "streams": [{
        "stream": "taskiq",
        "type": "stream",        # TYPE of the key: "stream", "none", ...
        "length": 12,            # XLEN; 0 when the key is absent
        "groups": [{
          "group": "taskiq",
          "exists": true,        # false only for a --group the stream lacks
          "pending": 3,          # PEL size (XPENDING)
          "last_delivered_id": "1700000000000-0" | null,
          "lag": 0 | null,       # entries not yet delivered (Redis >= 7)
          "oldest_pending_idle_ms": 61000 | null,
          "pel_scanned": 3,      # PEL entries read for the idle times
          "pel_scan_complete": true,  # false: idle times are lower bounds
          "consumers": [{
            "name": "worker-1",
            "pending": 2,
            "idle_ms": 120,      # since the consumer last talked to the server
            "oldest_pending_idle_ms": 61000 | null
          }],
          "lease": {"key": "...", "holder": "worker-1" | null, "ttl_ms": 840 | null},
          "cursor": {"key": "...", "value": "0-0" | null, "ttl_ms": 1800 | null},
          "dead_letters": {"key": "...", "count": 0}
        }]
      }]
    }

With ``--cluster`` the CLI prints one such object per primary, in a list,
and an ``error`` in place of a primary it could not read::

    {"format": 1, "nodes": [{"format": 1, "node": "10.0.0.1:6379", ...},
                            {"node": "10.0.0.2:6379", "error": "ConnectionError: ..."}]}

Names are decoded as UTF-8; bytes that are not UTF-8 appear as ``\\xNN``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from taskiq_atomic_claim.keys import PREFIX, StreamKeys
from taskiq_atomic_claim.scripts import LIBRARY, ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo

FORMAT = 1
# One XPENDING call per group: idle times come from at most this many entries.
PEL_SCAN_LIMIT = 1000
# Discovery: SCAN calls of COUNT keys each, and a wall-clock bound.
SCAN_COUNT = 1000
MAX_SCAN_CALLS = 10_000
MAX_STREAMS = 1000
SCAN_DEADLINE_S = 30.0
DEAD_LETTER_PREFIX = f"{PREFIX}:dead:"


def text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None else text(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class ConsumerView:
    name: str
    pending: int
    idle_ms: int
    oldest_pending_idle_ms: int | None


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
    consumers: list[ConsumerView]
    lease: KeyView
    cursor: KeyView
    dead_letters_key: str
    dead_letters: int


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


async def server_version(client: Any) -> str:
    """``redis_version``: the compatibility level ACL rules key on (Valkey
    reports 7.2.4 there). ``ServerInfo`` has the real product and version."""
    info = await client.execute_command("INFO", "server")
    return str(info.get("redis_version", "unknown")) if isinstance(info, dict) else "?"


async def discover_streams(client: Any) -> tuple[list[str], bool]:
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


async def _key_view(client: Any, key: str) -> KeyView:
    value = await client.get(key)
    if value is None:
        return KeyView(key, None, None)
    ttl = int(await client.pttl(key))
    # -2: expired between the two calls; -1: no expiry (claim.lua never
    # leaves one, but something else might write the key).
    return KeyView(key, text(value), None if ttl == -2 else ttl)


async def _group_view(
    client: Any, stream: str, group: str, info: dict[str, Any] | None
) -> GroupView:
    keys = StreamKeys(stream, group)
    lease = await _key_view(client, keys.lease)
    cursor = await _key_view(client, keys.cursor)
    dead = int(await client.xlen(keys.dead_letters))
    if info is None:
        return GroupView(
            name=group,
            exists=False,
            pending=0,
            last_delivered_id=None,
            lag=None,
            oldest_pending_idle_ms=None,
            pel_scanned=0,
            pel_scan_complete=True,
            consumers=[],
            lease=lease,
            cursor=cursor,
            dead_letters_key=keys.dead_letters,
            dead_letters=dead,
        )
    pending = int(info.get("pending", 0))
    oldest: dict[str, int] = {}
    scanned: list[dict[str, Any]] = []
    if pending:
        scanned = await client.xpending_range(
            stream, group, min="-", max="+", count=PEL_SCAN_LIMIT
        )
    for entry in scanned:
        name = text(entry["consumer"])
        idle = int(entry["time_since_delivered"])
        oldest[name] = max(idle, oldest.get(name, idle))
    consumers = [
        ConsumerView(
            name=text(raw["name"]),
            pending=int(raw.get("pending", 0)),
            idle_ms=int(raw.get("idle", 0)),
            oldest_pending_idle_ms=oldest.get(text(raw["name"])),
        )
        for raw in await client.xinfo_consumers(stream, group)
    ]
    return GroupView(
        name=group,
        exists=True,
        pending=pending,
        last_delivered_id=_optional_text(info.get("last-delivered-id")),
        lag=_optional_int(info.get("lag")),
        oldest_pending_idle_ms=max(oldest.values()) if oldest else None,
        pel_scanned=len(scanned),
        pel_scan_complete=len(scanned) >= pending,
        consumers=sorted(consumers, key=lambda c: c.name),
        lease=lease,
        cursor=cursor,
        dead_letters_key=keys.dead_letters,
        dead_letters=dead,
    )


async def inspect_stream(client: Any, stream: str, group: str | None) -> StreamView:
    kind = text(await client.type(stream))
    infos: dict[str, dict[str, Any]] = {}
    length = 0
    if kind == "stream":
        length = int(await client.xlen(stream))
        for raw in await client.xinfo_groups(stream):
            infos[text(raw["name"])] = raw
    names = [group] if group is not None else sorted(infos)
    groups = [
        await _group_view(client, stream, name, infos.get(name)) for name in names
    ]
    return StreamView(stream, kind, length, groups)


async def inspect_server(
    client: Any,
    streams: list[str] | None = None,
    group: str | None = None,
    runner: ScriptRunner | None = None,
) -> Inspection:
    """Everything ``inspect`` shows; streams None discovers them."""
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
    views = [await inspect_stream(client, stream, group) for stream in streams]
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


def _server_json(server: ServerInfo) -> dict[str, Any]:
    return {
        "version": server.version,
        "product": server.product,
        "name": server.name,
        "functions": server.functions,
        "scripting": server.scripting,
        "scripting_problem": server.scripting_problem,
        "native_claim": server.native_claim,
        "acked_trimming": server.acked_trimming,
        "reclaim_path": server.reclaim_path,
        "trimming": server.trimming_policy,
    }


def _key_json(view: KeyView, value_name: str) -> dict[str, Any]:
    return {"key": view.key, value_name: view.value, "ttl_ms": view.ttl_ms}


def inspection_to_json(
    inspection: Inspection, node: str | None = None
) -> dict[str, Any]:
    """The documented JSON shape (module docstring), as plain data; ``node``
    is where it was read (``host:port``), when known."""
    where = {} if node is None else {"node": node}
    return {
        "format": FORMAT,
        **where,
        "server": _server_json(inspection.server),
        "library": {
            "name": inspection.library.name,
            "version": inspection.library.version,
            "mode": inspection.library.mode,
            "state": inspection.library.state,
            "other_versions": inspection.library.other_versions,
        },
        "discovery": {
            "discovered": inspection.discovered,
            "truncated": inspection.truncated,
        },
        "streams": [
            {
                "stream": stream.name,
                "type": stream.type,
                "length": stream.length,
                "groups": [
                    {
                        "group": group.name,
                        "exists": group.exists,
                        "pending": group.pending,
                        "last_delivered_id": group.last_delivered_id,
                        "lag": group.lag,
                        "oldest_pending_idle_ms": group.oldest_pending_idle_ms,
                        "pel_scanned": group.pel_scanned,
                        "pel_scan_complete": group.pel_scan_complete,
                        "consumers": [
                            {
                                "name": consumer.name,
                                "pending": consumer.pending,
                                "idle_ms": consumer.idle_ms,
                                "oldest_pending_idle_ms": (
                                    consumer.oldest_pending_idle_ms
                                ),
                            }
                            for consumer in group.consumers
                        ],
                        "lease": _key_json(group.lease, "holder"),
                        "cursor": _key_json(group.cursor, "value"),
                        "dead_letters": {
                            "key": group.dead_letters_key,
                            "count": group.dead_letters,
                        },
                    }
                    for group in stream.groups
                ],
            }
            for stream in inspection.streams
        ],
    }


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


def _lease_text(lease: KeyView) -> str:
    if lease.value is None:
        return "lease free"
    left = "no expiry!" if lease.ttl_ms == -1 else f"{duration(lease.ttl_ms)} left"
    return f"lease held by {lease.value!r} ({left})"


def _cursor_text(cursor: KeyView) -> str:
    if cursor.value is None:
        return "cursor 0-0 (scan starts over)"
    return f"cursor {cursor.value} ({duration(cursor.ttl_ms)} left)"


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent
        + "  ".join(
            cell.ljust(width) for cell, width in zip(row, widths, strict=True)
        ).rstrip()
        for row in rows
    ]


def render_inspection(inspection: Inspection) -> str:
    """The readable form ``inspect`` prints without ``--json``."""
    library = inspection.library
    others = (
        f"; other versions: {', '.join(library.other_versions)}"
        if library.other_versions
        else ""
    )
    lines = [
        inspection.server.describe(),
        f"library {library.name} as {library.mode}: {library.state}{others}",
    ]
    if not inspection.streams:
        lines.append("no streams found" if inspection.discovered else "no streams")
    for stream in inspection.streams:
        lines.append("")
        kind = "" if stream.type == "stream" else f" (key is {stream.type})"
        lines.append(f"stream {stream.name!r}{kind}: {plural(stream.length, 'entry')}")
        if not stream.groups:
            lines.append("  no consumer groups")
        for group in stream.groups:
            if not group.exists:
                lines.append(f"  group {group.name!r}: does not exist")
            else:
                lag = "" if group.lag is None else f", lag {group.lag}"
                bound = "" if group.pel_scan_complete else " or more"
                lines.append(
                    f"  group {group.name!r}: {group.pending} pending{lag}, oldest"
                    f" idle {duration(group.oldest_pending_idle_ms)}{bound}"
                )
            lines.append(
                f"    {_lease_text(group.lease)}; {_cursor_text(group.cursor)};"
                f" {plural(group.dead_letters, 'dead letter')}"
            )
            if group.consumers:
                rows = [["consumer", "pending", "idle", "oldest pending idle"]]
                rows += [
                    [
                        repr(consumer.name),
                        str(consumer.pending),
                        duration(consumer.idle_ms),
                        duration(consumer.oldest_pending_idle_ms),
                    ]
                    for consumer in group.consumers
                ]
                lines += _table(rows, "    ")
    if inspection.truncated:
        lines.append("")
        lines.append(
            "(stream discovery stopped at its bound; name streams with --queue)"
        )
    return "\n".join(lines)
