"""``taskiq-atomic-claim``: load and check the server-side library; the crash drill."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from taskiq_atomic_claim import __version__
from taskiq_atomic_claim.dead_letters import list_dead_letters, requeue_dead_letters
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import LIBRARY, LibraryState, ScriptRunner

PROG = "taskiq-atomic-claim"


class CommandError(Exception):
    """A failure to report as one line, without a traceback."""


def _client(url: str) -> Redis:
    try:
        return Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
    except ValueError as error:
        raise CommandError(f"bad --url {url!r}: {error}") from None


async def _load(url: str) -> int:
    async with _client(url) as client:
        mode = await ScriptRunner().load(client)
    print(
        f"loaded {LIBRARY.name} ({len(LIBRARY.scripts)} operations:"
        f" {', '.join(LIBRARY.scripts)}) as {mode.value} on {url}"
        f" [taskiq-atomic-claim {__version__}]"
    )
    return 0


async def _check(url: str) -> int:
    async with _client(url) as client:
        status = await ScriptRunner().status(client)
    others = (
        f"; other versions present: {', '.join(status.other_versions)}"
        if (status.other_versions)
        else ""
    )
    print(f"{LIBRARY.name} as {status.mode.value}: {status.state.value}{others}")
    if status.state is not LibraryState.CURRENT:
        print(f"run: {PROG} load --url URL", file=sys.stderr)
        return 1
    return 0


async def _dead_letters(url: str, keys: StreamKeys, count: int) -> int:
    async with _client(url) as client:
        total = await client.exists(keys.dead_letters) and await client.xlen(
            keys.dead_letters
        )
        letters = await list_dead_letters(client, keys, count)
    print(f"{total} dead letters in {keys.dead_letters}")
    for letter in letters:
        data = letter.fields.get(b"data", b"")
        print(
            f"{letter.id}  original {letter.original_id}  deliveries"
            f" {letter.deliveries}  reason: {letter.reason}  {len(data)} bytes of data"
        )
    if total > len(letters):
        print(f"... {total - len(letters)} more (--count)")
    return 0


async def _requeue(url: str, keys: StreamKeys, ids: list[str] | None) -> int:
    async with _client(url) as client:
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


def _drill(url: str | None, rounds: int, broker: str) -> int:
    # Imported here: the drill pulls in taskiq's worker machinery.
    from taskiq_atomic_claim.drill import main_drill  # noqa: PLC0415
    from taskiq_atomic_claim.embedded_server import (  # noqa: PLC0415
        LocalServer,
        default_binary,
    )

    if url is not None:
        _client(url)  # validates the URL before any worker starts
        report = main_drill(url, rounds, broker)
    else:
        try:
            binary = default_binary()
        except RuntimeError as error:
            raise CommandError(str(error)) from None
        print(f"no --url: starting an embedded {binary.label} on loopback")
        with LocalServer(binary) as server:
            report = main_drill(server.url, rounds, broker)
    for number, result in enumerate(report.rounds, 1):
        if result.recovered:
            print(
                f"round {number}: SIGKILLed worker's task re-run by a fresh worker"
                f" {result.kill_to_rerun_s:.2f} s after the kill"
                f" ({result.delivery_to_rerun_s:.2f} s after first delivery)"
            )
        else:
            print(f"round {number}: task NOT recovered")
    print(report.summary())
    return 0 if report.recovered == len(report.rounds) else 1


def _rounds(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be 1..100, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Set up and check the server-side claim library used by"
            " AtomicRedisStreamBroker, or run the crash drill."
        ),
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    load = commands.add_parser(
        "load",
        help="load the library on the server (idempotent)",
        description="Load this release's claim library on the server. Safe to"
        " repeat; other releases' libraries are left in place.",
    )
    load.add_argument("--url", required=True, help="redis:// or rediss:// URL")

    check = commands.add_parser(
        "check",
        help="exit 1 if the library is missing or outdated",
        description="Exit 0 when this release's library is on the server,"
        " 1 when it is missing or only other versions are, 2 on errors.",
    )
    check.add_argument("--url", required=True, help="redis:// or rediss:// URL")

    def stream_options(command: argparse.ArgumentParser) -> None:
        command.add_argument("--url", required=True, help="redis:// or rediss:// URL")
        command.add_argument("--queue", default="taskiq", help="stream (queue_name)")
        command.add_argument("--group", default="taskiq", help="consumer group")

    dead = commands.add_parser(
        "dead-letters",
        help="list the entries a consumer group gave up on",
        description="List dead letters: entries delivered more than"
        " max_deliveries times, or without a data field.",
    )
    stream_options(dead)
    dead.add_argument("--count", type=_rounds, default=20, help="how many (1..100)")

    requeue = commands.add_parser(
        "requeue",
        help="put dead letters back on their stream",
        description="Re-add chosen dead letters (or all) to their stream as new"
        " entries, atomically per batch.",
    )
    stream_options(requeue)
    chosen = requeue.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--id", action="append", dest="ids", help="dead letter id")
    chosen.add_argument("--all", action="store_true", help="every dead letter")

    drill = commands.add_parser(
        "drill",
        help="SIGKILL a worker mid-task and time the recovery",
        description="Start real `taskiq worker` processes, SIGKILL one mid-task"
        " on an idle queue, and time until a fresh worker re-runs the task."
        " Without --url an embedded server is started on loopback.",
    )
    drill.add_argument("--url", help="server to use (default: an embedded one)")
    drill.add_argument("--rounds", type=_rounds, default=3, help="kills (1..100)")
    drill.add_argument(
        "--broker",
        choices=("atomic", "upstream"),
        default="atomic",
        help="atomic: this package; upstream: taskiq-redis's RedisStreamBroker",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "drill":
        return _drill(args.url, args.rounds, args.broker)
    if args.command == "load":
        return asyncio.run(_load(args.url))
    if args.command == "check":
        return asyncio.run(_check(args.url))
    keys = StreamKeys(args.queue, args.group)
    if args.command == "requeue":
        return asyncio.run(_requeue(args.url, keys, args.ids))
    return asyncio.run(_dead_letters(args.url, keys, args.count))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CommandError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    except (RedisError, OSError) as error:
        print(f"{PROG}: error: {type(error).__name__}: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
