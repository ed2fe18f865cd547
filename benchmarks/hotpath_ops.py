"""Server time of one task's start and ack, per wire format, in one run.

``python -m benchmarks.hotpath_ops --server redis-7.0.15``: ``tasks``
entries read into one consumer's pending list, then every entry started and
acked the way a worker sends them, pipelined ``batch`` tasks per write (as
concurrent tasks share one), per format:

- ``task_records``: this package's (``task_records.py``): the start
  ``MULTI HINCRBY.. PEXPIRE EXEC`` (one transaction per batch), the ack
  ``XACK <ids>`` and ``HDEL <ids>`` (one each per batch);
- ``xack_only``: one ``XACK`` per task, what taskiq-redis sends.

Outer commands only from INFO commandstats (EXEC's usec holds what it ran,
which commandstats also lists on their own lines): multi, exec, xack, hdel
(HINCRBY and PEXPIRE run only inside EXEC here). The read is the same for
every format and left out.
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
from taskiq_atomic_claim.task_records import Command, ack_commands, start_commands

STREAM, STARTED, GROUP = "ops-stream", "ops-started", "g"
TTL_MS = 86_400_000
FORMATS = ("task_records", "xack_only")
_OUTER = {"multi", "exec", "xack", "hdel"}


async def _fill(client: Redis, tasks: int) -> list[str]:
    await client.delete(STREAM, STARTED)
    await client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    async with client.pipeline(transaction=False) as pipe:
        for _ in range(tasks):
            pipe.xadd(STREAM, {"data": b"x" * 200})
        await pipe.execute()
    read: Any = await client.xreadgroup(GROUP, "c", {STREAM: ">"}, count=tasks)
    return [entry_id.decode() for entry_id, _ in read[0][1]]


def _commands(fmt: str, ids: list[str]) -> list[Command]:
    if fmt == "xack_only":
        return [("XACK", STREAM, GROUP, entry_id) for entry_id in ids]
    return [
        ("MULTI",),
        *start_commands(STARTED, TTL_MS, ids),
        ("EXEC",),
        *ack_commands(STREAM, STARTED, GROUP, ids, delete_acked=False),
    ]


async def _usec_per_task(client: Redis, fmt: str, tasks: int, batch: int) -> float:
    ids = await _fill(client, tasks)
    await client.config_resetstat()
    connection: Any = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        for first in range(0, tasks, batch):
            commands = _commands(fmt, ids[first : first + batch])
            await connection.send_packed_command(connection.pack_commands(commands))
            for _ in commands:
                await connection.read_response()
    finally:
        await client.connection_pool.release(connection)
    stats = stat_bases(await client.info("commandstats"))
    await client.delete(STREAM, STARTED)
    return sum(usec for name, (_, usec) in stats.items() if name in _OUTER) / tasks


async def measure(
    server: str, tasks: int, batches: list[int], reps: int
) -> dict[str, Any]:
    local = LocalServer(choose_binary(server)).start()
    figures: dict[str, list[float]] = {}
    try:
        client = Redis.from_url(local.url)
        for _ in range(reps):
            for batch in batches:
                for fmt in FORMATS:
                    usec = await _usec_per_task(client, fmt, tasks, batch)
                    figures.setdefault(f"{fmt}, batch {batch}", []).append(usec)
        await client.aclose()
    finally:
        local.stop()
    return {
        "server": server,
        "tasks": tasks,
        "reps": reps,
        "usec_per_task_median": {k: round(p50(v), 2) for k, v in figures.items()},
        "usec_per_task_each": {k: [round(x, 2) for x in v] for k, v in figures.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotpath_ops")
    parser.add_argument("--server", required=True)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(measure(args.server, args.tasks, args.batch, args.reps))
    print(json.dumps(result, indent=1))
