"""What a start costs the server while many run: the started hash's encoding.

``python -m benchmarks.started_hash --server redis-7.0.15``: ``tasks``
starts, each one transaction as an idle worker sends it, with ``in_flight``
tasks running at once and the counts of acked ones forgotten
``forget_batch`` at a time (``pipelined.py``'s FORGET_BATCH), per format:

- ``task_records``: this package's start (``task_records.start_commands``):
  ``HINCRBY`` then ``HSETNX`` of the field that keeps the hash a hash table,
  then ``PEXPIRE``;
- ``listpack``: the same without the ``HSETNX``: the server keeps a hash
  this small a listpack, which every ``HINCRBY`` scans.

Per task, from INFO commandstats: the outer commands (MULTI, EXEC, which
holds the transaction's commands, and the forgetting HDEL), and HINCRBY per
call; medians of ``reps``. The acks' XACK is the same for both and left out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from redis.asyncio import Redis

from benchmarks.cli import choose_binary
from benchmarks.server_cpu import stat_bases
from benchmarks.stats import p50
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.task_records import (
    Command,
    count_start_command,
    forget_command,
    start_commands,
)

STARTED = "bench-started"
TTL_MS = 86_400_000
FORMATS = ("task_records", "listpack")


def _start(fmt: str, entry_id: str) -> list[Command]:
    if fmt == "listpack":
        return [count_start_command(STARTED, entry_id), ("PEXPIRE", STARTED, TTL_MS)]
    return start_commands(STARTED, TTL_MS, [entry_id])


async def _run(
    client: Redis, fmt: str, tasks: int, in_flight: int, forget_batch: int
) -> dict[str, Any]:
    await client.delete(STARTED)
    await client.config_resetstat()
    running: list[str] = []
    acked: list[str] = []
    for n in range(tasks):
        entry_id = f"1700000000000-{n}"
        async with client.pipeline(transaction=True) as pipe:
            for command in _start(fmt, entry_id):
                pipe.execute_command(*command)
            await pipe.execute()
        running.append(entry_id)
        if len(running) > in_flight:
            acked.append(running.pop(0))
            if len(acked) >= forget_batch:
                await client.execute_command(*forget_command(STARTED, acked))
                acked = []
    stats = stat_bases(await client.info("commandstats"))
    encoding = await client.object("encoding", STARTED)
    outer = sum(stats.get(name, (0, 0))[1] for name in ("multi", "exec", "hdel"))
    calls, usec = stats.get("hincrby", (0, 0))
    return {
        "outer_usec_per_task": outer / tasks,
        "hincrby_usec_per_call": usec / max(calls, 1),
        "encoding": encoding.decode() if isinstance(encoding, bytes) else encoding,
    }


async def measure(
    url: str, tasks: int, in_flight: int, forget_batch: int, reps: int
) -> dict[str, Any]:
    client = Redis.from_url(url)
    try:
        runs: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in FORMATS}
        for rep in range(reps):
            order = FORMATS if rep % 2 == 0 else FORMATS[::-1]
            for fmt in order:
                runs[fmt].append(
                    await _run(client, fmt, tasks, in_flight, forget_batch)
                )
    finally:
        await client.aclose()
    return {
        fmt: {
            "outer_usec_per_task": round(
                p50([r["outer_usec_per_task"] for r in each]), 2
            ),
            "hincrby_usec_per_call": round(
                p50([r["hincrby_usec_per_call"] for r in each]), 2
            ),
            "encoding": each[-1]["encoding"],
        }
        for fmt, each in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=None)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--forget-batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    binary = choose_binary(args.server)
    with LocalServer(binary) as server:
        figures = asyncio.run(
            measure(
                server.url, args.tasks, args.in_flight, args.forget_batch, args.reps
            )
        )
    print(json.dumps({"server": str(binary), **figures}, indent=2))


if __name__ == "__main__":
    main()
