"""``dead-letters`` and ``requeue``: list what a group gave up on, put it back."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from taskiq_atomic_claim.admin.dead_letters import (
    DeadLetter,
    dead_letter_ids_of_task,
    entry_time,
    list_dead_letters,
    preview,
    requeue_dead_letters,
)
from taskiq_atomic_claim.admin.inspection import plural
from taskiq_atomic_claim.cli.arguments import rounds
from taskiq_atomic_claim.cli.servers import add_stream_options, connected, server_of
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import ScriptRunner


def add_parser(commands: Any) -> None:
    dead = commands.add_parser(
        "dead-letters",
        help="list the entries a consumer group gave up on",
        description="List dead letters (entries delivered more than"
        " max_deliveries times, or without a data field): task name and id,"
        " the start of the arguments, reason, deliveries, and when.",
    )
    add_stream_options(dead)
    dead.add_argument("--count", type=rounds, default=20, help="how many (1..100)")
    dead.set_defaults(run=run_list)

    requeue = commands.add_parser(
        "requeue",
        help="put dead letters back on their stream",
        description="Re-add chosen dead letters (by id, by task name, or all)"
        " to their stream as new entries, atomically per batch.",
    )
    add_stream_options(requeue)
    chosen = requeue.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--id", action="append", dest="ids", help="dead letter id")
    chosen.add_argument(
        "--task", metavar="NAME", help="every dead letter of this task name"
    )
    chosen.add_argument("--all", action="store_true", help="every dead letter")
    requeue.set_defaults(run=run_requeue)


def run_list(args: argparse.Namespace) -> int:
    return asyncio.run(_dead_letters(args))


def run_requeue(args: argparse.Namespace) -> int:
    return asyncio.run(_requeue(args))


def _when(entry_id: str) -> str:
    return f"{entry_time(entry_id):%Y-%m-%d %H:%M:%S} UTC"


def _describe(letter: DeadLetter) -> str:
    """Two lines: what the task was and why and when it died."""
    task = letter.task()
    if task is not None:
        what = f"task {task.name}  id {task.task_id}  args ({preview(task.arguments)})"
    elif b"data" in letter.fields:
        what = f"not a taskiq JSON message: {preview(repr(letter.data))}"
    else:
        what = f"fields {preview(repr(letter.fields))}"
    sent = f", sent {_when(letter.original_id)}" if letter.original_id else ""
    return (
        f"{letter.id}  {what}\n    {letter.reason} after"
        f" {plural(letter.deliveries, 'delivery')}; dead since {_when(letter.id)}"
        f"{sent} (original {letter.original_id or '?'})"
    )


async def _dead_letters(args: argparse.Namespace) -> int:
    keys = StreamKeys(args.queue, args.group)
    async with connected((await server_of(args, keys)).options) as client:
        total = await client.exists(keys.dead_letters) and await client.xlen(
            keys.dead_letters
        )
        letters = await list_dead_letters(client, keys, args.count)
    print(f"{total} dead letters in {keys.dead_letters}")
    for letter in letters:
        print(_describe(letter))
    if total > len(letters):
        print(f"... {total - len(letters)} more (--count)")
    return 0


async def _requeue(args: argparse.Namespace) -> int:
    keys = StreamKeys(args.queue, args.group)
    ids: list[str] | None = args.ids
    async with connected((await server_of(args, keys)).options) as client:
        if args.task is not None:
            ids = await dead_letter_ids_of_task(client, keys, args.task)
            if not ids:
                print(f"no dead letters of task {args.task!r} in {keys.dead_letters}")
                return 1
        moved = await requeue_dead_letters(ScriptRunner(), client, keys, ids)
    for old, new in moved:
        print(f"requeued {old} -> {keys.stream} {new}")
    print(f"{len(moved)} requeued to {keys.stream}")
    missing = sorted(set(ids or ()) - {old for old, _ in moved})
    if missing:
        print(
            f"not dead letters of {keys.stream}: {', '.join(missing)}", file=sys.stderr
        )
        return 1
    return 0
