"""``acl``: print the ACL SETUSER line a worker needs."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from taskiq_atomic_claim.admin.acl import worker_acl_rule
from taskiq_atomic_claim.admin.inspection import redis_version
from taskiq_atomic_claim.cli.arguments import CommandError, valid_name
from taskiq_atomic_claim.cli.servers import ConnectionOptions, connected
from taskiq_atomic_claim.server_info import AckedDeletionUnavailableError, ServerInfo

# The rule printed when neither --url nor --server-version says the version.
DEFAULT_SERVER_VERSION = "7.2"


def add_parser(commands: Any) -> None:
    acl = commands.add_parser(
        "acl",
        help="print the ACL SETUSER line a worker needs",
        description="Print the minimal ACL rule for a worker of these streams"
        " and group. Give --url to read the server version, or --server-version.",
    )
    acl.add_argument("--url", help="read the server version from this server")
    acl.add_argument(
        "--server-version",
        help=f"e.g. 6.2, 7.0, 7.2 (default {DEFAULT_SERVER_VERSION})",
    )
    acl.add_argument(
        "--queue",
        type=valid_name("--queue"),
        action="append",
        dest="queues",
        help="queue_name, then each additional stream (repeatable; default taskiq)",
    )
    acl.add_argument(
        "--group", type=valid_name("--group"), default="taskiq", help="consumer group"
    )
    acl.add_argument("--user", type=valid_name("--user"), default="taskiq-worker")
    acl.add_argument(
        "--result-backend-prefix",
        metavar="PREFIX",
        help="also the keys and commands of taskiq-redis's RedisAsyncResultBackend"
        " with this prefix_str",
    )
    acl.add_argument(
        "--delete-acked",
        action="store_true",
        help="for a broker with delete_acked=True: also XACKDEL (Redis >= 8.2)",
    )
    acl.add_argument(
        "--gauges",
        action="store_true",
        help="for a worker with the ServerGauges middleware: also XLEN and"
        " XINFO CONSUMERS",
    )
    acl.add_argument(
        "--no-reload",
        action="store_true",
        help="leave out FUNCTION LOAD / SCRIPT LOAD: run `load` after every"
        " restart or flush instead",
    )
    acl.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = None if args.url is None else ConnectionOptions(args.url)
    return asyncio.run(
        _acl(
            options,
            args.server_version,
            args.queues or ["taskiq"],
            args.group,
            args.user,
            not args.no_reload,
            args.result_backend_prefix,
            args.delete_acked,
            args.gauges,
        )
    )


def _cli_argument(value: str) -> str:
    """One argument as redis-cli reads it: quoted when it must be."""
    if value and all(c.isprintable() and c not in " \"'\\" for c in value):
        return value
    escaped = "".join(
        c
        if c.isprintable() and c not in '"\\'
        else ("\\" + c if c in '"\\' else "".join(f"\\x{b:02x}" for b in c.encode()))
        for c in value
    )
    return f'"{escaped}"'


async def _acl(
    options: ConnectionOptions | None,
    version: str | None,
    streams: list[str],
    group: str,
    user: str,
    reload: bool,
    result_backend_prefix: str | None = None,
    delete_acked: bool = False,
    gauges: bool = False,
) -> int:
    if options is not None:
        async with connected(options) as client:
            info = await client.execute_command("INFO", "server")
        version = redis_version(info)
        server = ServerInfo.from_info(info)
        if delete_acked:
            # Valkey reports redis_version 7.2.4: name the real product.
            try:
                server.require_acked_deletion()
            except AckedDeletionUnavailableError as error:
                raise CommandError(str(error)) from None
    if version is None:
        if delete_acked:
            # The refused version is one the user never gave: say so.
            raise CommandError(
                "--delete-acked needs XACKDEL (Redis >= 8.2), and with neither"
                " --url nor --server-version given the server version defaults"
                f" to {DEFAULT_SERVER_VERSION}, which has none: give --url to read"
                " the server's version, or --server-version"
            )
        version = DEFAULT_SERVER_VERSION
    try:
        rule = worker_acl_rule(
            streams,
            group,
            version,
            reload=reload,
            result_backend_prefix=result_backend_prefix,
            delete_acked=delete_acked,
            gauges=gauges,
        )
    except ValueError as error:
        raise CommandError(str(error)) from None
    results = (
        f", results under {result_backend_prefix + ':'!r}"
        if result_backend_prefix is not None
        else ""
    )
    acks = ", delete_acked=True" if delete_acked else ""
    print(
        f"# a worker of queue {streams[0]!r}, group {group!r}{results}{acks} on a"
        f" {version} server; replace CHANGE-ME with its password"
    )
    words = ["ACL", "SETUSER", user, "reset", "on", ">CHANGE-ME", *rule]
    print(" ".join(_cli_argument(word) for word in words))
    return 0
