"""``load`` and ``check``: put this release's library on the server, or say
whether it is there."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim import __version__
from taskiq_atomic_claim.cli.arguments import PROG, CommandError
from taskiq_atomic_claim.cli.servers import (
    Target,
    add_server_options,
    on_each_target,
    reach,
    resolve_targets,
)
from taskiq_atomic_claim.scripts import LIBRARY, LibraryState, ScriptRunner
from taskiq_atomic_claim.server_info import read_server_info


def add_parser(commands: Any) -> None:
    load = commands.add_parser(
        "load",
        help="load the library on the server (idempotent)",
        description="Load this release's claim library on the server. Safe to"
        " repeat; other releases' libraries are left in place.",
    )
    add_server_options(load)
    load.set_defaults(run=run_load)

    check = commands.add_parser(
        "check",
        help="exit 1 if the library is missing or outdated",
        description="Exit 0 when this release's library is on the server,"
        " 1 when it is missing or only other versions are, 2 on errors.",
    )
    add_server_options(check)
    check.set_defaults(run=run_check)


def run_load(args: argparse.Namespace) -> int:
    return asyncio.run(_load(args))


def run_check(args: argparse.Namespace) -> int:
    return asyncio.run(_check(args))


async def _load(args: argparse.Namespace) -> int:
    async def load(client: Redis, target: Target) -> bool:
        unsupported = (await read_server_info(client)).unsupported()
        if unsupported:
            raise CommandError(f"{target.where}: {unsupported}")
        mode = await ScriptRunner().load(client)
        print(
            f"loaded {LIBRARY.name} ({len(LIBRARY.scripts)} operations:"
            f" {', '.join(LIBRARY.scripts)}) as {mode.value} on {target.where}"
            f" [taskiq-atomic-claim {__version__}]"
        )
        return True

    return await on_each_target(await resolve_targets(args), load, "loaded")


async def _check(args: argparse.Namespace) -> int:
    targets = await resolve_targets(args)

    async def check(client: Redis, target: Target) -> bool:
        runner = ScriptRunner()
        server = await runner.probe_server(client)
        unsupported = server.unsupported()
        if unsupported:
            raise CommandError(f"{target.where}: {unsupported}")
        status = await runner.status(client)
        others = (
            f"; other versions present: {', '.join(status.other_versions)}"
            if status.other_versions
            else ""
        )
        where = f" on {target.where}" if len(targets) > 1 else ""
        print(server.describe())
        print(
            f"{LIBRARY.name} as {status.mode.value}{where}:"
            f" {status.state.value}{others}"
        )
        return status.state is LibraryState.CURRENT and not server.scripting_problem

    code = await on_each_target(targets, check, "current")
    if code:
        print(f"run: {PROG} load {reach(args)}", file=sys.stderr)
    return code
