"""``inspect``: streams, groups, consumers, leases and dead letters, as text
or as the documented JSON (``admin/inspection_json.py``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim.admin.inspection import (
    Inspection,
    KeyView,
    duration,
    inspect_server,
    plural,
)
from taskiq_atomic_claim.admin.inspection_json import inspection_to_json
from taskiq_atomic_claim.cli.servers import (
    Target,
    add_scope_options,
    heading,
    on_each_target,
    print_json,
    resolve_targets,
)


def add_parser(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="show streams, groups, consumers, leases and dead letters",
        description="Show per stream and consumer group: pending entries per"
        " consumer and their idle times, the claim lease and cursor, dead"
        " letters, and the library on the server. Read-only.",
    )
    add_scope_options(inspect)
    inspect.add_argument(
        "--json", action="store_true", help="stable JSON (see the inspection module)"
    )
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_inspect(args))


async def _inspect(args: argparse.Namespace) -> int:
    targets = await resolve_targets(args, args.queues)

    async def inspect(client: Redis, target: Target) -> bool:
        inspection = await inspect_server(client, target.streams, args.group)
        heading(target)
        print(render_inspection(inspection) + ("\n" if len(targets) > 1 else ""))
        return True

    async def as_json(client: Redis, target: Target) -> tuple[dict[str, Any], bool]:
        inspection = await inspect_server(client, target.streams, args.group)
        return inspection_to_json(inspection, node=target.where), True

    if args.json:
        return await print_json(args, targets, as_json)
    return await on_each_target(targets, inspect, "inspected")


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
                lines.append(
                    f"  group {group.name!r}: {group.pending} pending{lag}, oldest"
                    f" idle {duration(group.oldest_pending_idle_ms)}"
                )
            lines.append(
                f"    {_lease_text(group.lease)}; {_cursor_text(group.cursor)};"
                f" {plural(group.dead_letters, 'dead letter')};"
                f" {group.reclaimed} reclaimed"
            )
            if group.consumers:
                rows = [["consumer", "pending", "idle", "oldest pending idle"]]
                rows += [
                    [
                        repr(consumer.name),
                        str(consumer.pending),
                        duration(consumer.idle_ms),
                        duration(consumer.oldest_pending_idle_ms)
                        + ("" if group.pel_scan_complete else "+"),
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
