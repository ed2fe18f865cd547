"""``dead-letters``, ``requeue`` and ``delete``: list what a group gave up on,
put it back or drop it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim.admin.dead_letters import (
    DeadLetter,
    chosen_dead_letter_ids,
    chosen_dead_letters,
    delete_dead_letters,
    entry_time,
    find_dead_letter_queues,
    list_dead_letters,
    preview,
    requeue_dead_letters,
    unknown_pair,
)
from taskiq_atomic_claim.admin.inspection import plural
from taskiq_atomic_claim.admin.report_json import (
    dead_letters_queue_json,
    dead_letters_to_json,
)
from taskiq_atomic_claim.cli.arguments import CommandError, rounds, valid_name
from taskiq_atomic_claim.cli.servers import (
    Target,
    add_server_options,
    add_stream_options,
    connected,
    heading,
    on_each_target,
    print_json,
    resolve_targets,
    server_of,
)
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
    add_server_options(dead)
    dead.add_argument(
        "--queue",
        type=valid_name("--queue"),
        help="stream (queue_name); default: every stream with dead letters",
    )
    dead.add_argument(
        "--group",
        type=valid_name("--group"),
        help="consumer group; default: taskiq with --queue, else every group",
    )
    dead.add_argument(
        "--count", type=rounds, default=20, help="how many per queue (1..100)"
    )
    dead.add_argument(
        "--after",
        metavar="ID",
        help="the page after this dead letter id (with --queue; --json gives"
        " next_after)",
    )
    dead.add_argument(
        "--json", action="store_true", help="stable JSON (see admin/report_json.py)"
    )
    dead.set_defaults(run=run_list)

    requeue = commands.add_parser(
        "requeue",
        help="put dead letters back on their stream",
        description="Re-add chosen dead letters (by id, by task name, or all)"
        " to their stream as new entries, atomically per batch. --dry-run"
        " lists them and changes nothing.",
    )
    _add_choice_options(requeue)
    requeue.set_defaults(run=run_requeue)

    delete = commands.add_parser(
        "delete",
        help="delete dead letters for good",
        description="Delete chosen dead letters (by id, by task name, or all)"
        " from the group's dead-letter stream. --dry-run lists them and"
        " changes nothing.",
    )
    _add_choice_options(delete)
    delete.set_defaults(run=run_delete)


def _add_choice_options(command: argparse.ArgumentParser) -> None:
    add_stream_options(command)
    chosen = command.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--id", action="append", dest="ids", help="dead letter id")
    chosen.add_argument(
        "--task", metavar="NAME", help="every dead letter of this task name"
    )
    chosen.add_argument("--all", action="store_true", help="every dead letter")
    command.add_argument(
        "--dry-run",
        action="store_true",
        help="list what it would act on; change nothing",
    )


def run_list(args: argparse.Namespace) -> int:
    return asyncio.run(_dead_letters(args))


def run_requeue(args: argparse.Namespace) -> int:
    return asyncio.run(_change(args, "requeue"))


def run_delete(args: argparse.Namespace) -> int:
    return asyncio.run(_change(args, "delete"))


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


@dataclass(frozen=True)
class _Page:
    keys: StreamKeys
    total: int
    letters: list[DeadLetter]
    more: bool  # others follow this page


async def _pages(client: Redis, args: argparse.Namespace) -> tuple[list[_Page], bool]:
    """A page per queue: the named one, or every one with dead letters
    (True when their discovery was cut)."""
    if args.queue is not None:
        named = StreamKeys(args.queue, args.group or "taskiq")
        await require_known(client, named)
        queues, cut = [named], False
    else:
        queues, cut = await find_dead_letter_queues(client, args.group)
    pages = []
    for keys in queues:
        total = await client.exists(keys.dead_letters) and await client.xlen(
            keys.dead_letters
        )
        letters = await list_dead_letters(client, keys, args.count + 1, args.after)
        pages.append(
            _Page(keys, total, letters[: args.count], len(letters) > args.count)
        )
    return pages, cut


def _print_page(page: _Page, named: bool) -> None:
    where = "" if named else f" (queue {page.keys.stream!r}, group {page.keys.group!r})"
    print(f"{page.total} dead letters in {page.keys.dead_letters}{where}")
    for letter in page.letters:
        print(_describe(letter))
    if page.more:
        print(f"... more: --after {page.letters[-1].id} (or --count)")


async def _dead_letters(args: argparse.Namespace) -> int:
    if args.after is not None and args.queue is None:
        raise CommandError("--after pages through one queue: add --queue")
    if args.queue is not None:
        keys = StreamKeys(args.queue, args.group or "taskiq")
        targets = [await server_of(args, keys)]
    else:
        targets = await resolve_targets(args)

    async def as_json(client: Redis, target: Target) -> tuple[dict[str, Any], bool]:
        pages, cut = await _pages(client, args)
        queues = [
            dead_letters_queue_json(p.keys, p.total, p.letters, p.more) for p in pages
        ]
        discovered = args.queue is None
        return dead_letters_to_json(queues, target.where, discovered, cut), True

    async def listing(client: Redis, target: Target) -> bool:
        pages, cut = await _pages(client, args)
        heading(target)
        for page in pages:
            _print_page(page, named=args.queue is not None)
        if not pages:
            print("no dead letters in any stream")
        if cut:
            print("(the scan for dead-letter streams stopped at its bound)")
        return True

    if args.json:
        return await print_json(args, targets, as_json)
    return await on_each_target(targets, listing, "listed")


async def require_known(client: Redis, keys: StreamKeys) -> None:
    """A mistyped --queue or --group is an error, not an empty success."""
    problem = await unknown_pair(client, keys)
    if problem is not None:
        raise CommandError(f"{problem}: check --queue and --group")


async def _change(args: argparse.Namespace, verb: str) -> int:
    """``requeue`` or ``delete`` the chosen dead letters (or, with
    --dry-run, list them)."""
    keys = StreamKeys(args.queue, args.group)
    async with connected((await server_of(args, keys)).options) as client:
        await require_known(client, keys)
        task = args.task if not args.ids else None
        if args.dry_run:
            ids = []
            async for letter in chosen_dead_letters(client, keys, args.ids, task):
                print(f"would {verb} {_describe(letter)}")
                ids.append(letter.id)
        else:
            ids = await chosen_dead_letter_ids(client, keys, args.ids, task)
        if args.task is not None and not ids:
            print(f"no dead letters of task {args.task!r} in {keys.dead_letters}")
            return 1
        if args.dry_run:
            where = f"to {keys.stream}" if verb == "requeue" else "for good"
            print(
                f"{plural(len(ids), 'dead letter')} would be {verb}d {where}"
                " (dry run: nothing changed)"
            )
            done = ids
        elif verb == "requeue":
            moved = await requeue_dead_letters(ScriptRunner(), client, keys, ids)
            for old, new in moved:
                print(f"requeued {old} -> {keys.stream} {new}")
            print(f"{len(moved)} requeued to {keys.stream}")
            done = [old for old, _ in moved]
        else:
            deleted = await delete_dead_letters(client, keys, ids)
            for entry_id in ids:
                print(f"deleted {entry_id}")
            print(f"{deleted} deleted from {keys.dead_letters}")
            done = ids
    missing = sorted(set(args.ids or ()) - set(done))
    if missing:
        print(
            f"not dead letters of {keys.stream}: {', '.join(missing)}", file=sys.stderr
        )
        return 1
    return 0
