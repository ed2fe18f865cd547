"""What a stream keeps after its tasks ran: length and server memory after
``tasks`` tasks drained at defaults by ``workers`` real ``taskiq worker``
processes, this package's broker beside taskiq-redis's (1.2.4 here).

Each (server, broker) gets a fresh server on loopback (its own binary from
``find_binaries``), a producer kicking in batches while the workers drain,
then a settle of ``settle_s`` (the workers' last trim). Printed per run:
the stream's length, ``used_memory`` above the server's before the kicks,
``MEMORY USAGE`` of the stream key, and the time the drain took.

    python -m benchmarks.stream_growth [--tasks N] [--server LABEL ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq import AsyncBroker
from taskiq.kicker import AsyncKicker
from taskiq_redis import RedisStreamBroker

from benchmarks.stream_growth_app import QUEUE, TASK_NAME
from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.embedded_server import LocalServer, find_binaries

REPO_ROOT = Path(__file__).resolve().parent.parent
KINDS = ("atomic", "upstream")
KICK_BATCH = 500
MAX_TASKS = 1_000_000
DRAIN_TIMEOUT_S = 600.0


@contextlib.contextmanager
def workers(kind: str, url: str, count: int) -> Iterator[None]:
    script = Path(sys.executable).with_name("taskiq")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "taskiq"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "TAC_GROWTH_KIND": kind,
        "TAC_GROWTH_URL": url,
    }
    argv = [
        *command, "worker", "benchmarks.stream_growth_app:broker",
        "--ack-type", "when_executed", "--workers", "1", "--log-level", "ERROR",
    ]  # fmt: skip
    processes = [
        subprocess.Popen(
            argv,
            env=env,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def _fields(reply: Any) -> dict[str, Any]:
    return {
        (k.decode() if isinstance(k, bytes) else k): v for k, v in dict(reply).items()
    }


async def drained(client: Redis) -> bool:
    """Every entry delivered to the group and acked."""
    stream = _fields(await client.xinfo_stream(QUEUE))
    (group,) = [_fields(g) for g in await client.xinfo_groups(QUEUE)]
    last = stream["last-generated-id"]
    return group["pending"] == 0 and group["last-delivered-id"] == last


async def used_memory(client: Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def one_run(kind: str, url: str, tasks: int, count: int, settle_s: float) -> str:
    client = Redis.from_url(url)
    cls = RedisStreamBroker if kind == "upstream" else AtomicRedisStreamBroker
    producer: AsyncBroker = cls(url, queue_name=QUEUE)
    await producer.startup()  # the group, at "$"
    base = await used_memory(client)
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, producer, {})
    started = time.monotonic()
    try:
        with workers(kind, url, count):
            for first in range(0, tasks, KICK_BATCH):
                last = min(tasks, first + KICK_BATCH)
                await asyncio.gather(*(kicker.kiq(n) for n in range(first, last)))
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while not await drained(client):
                if time.monotonic() > deadline:
                    return f"{kind}: not drained within {DRAIN_TIMEOUT_S:g} s"
                await asyncio.sleep(0.1)
            took = time.monotonic() - started
            await asyncio.sleep(settle_s)
            length = await client.xlen(QUEUE)
            memory = await used_memory(client) - base
            # The stream key alone: on Redis >= 8.6 it also holds the task
            # ids kicks remember for idempotency_window (IDMP).
            key = int(await client.memory_usage(QUEUE) or 0)
    finally:
        await producer.shutdown()
        await client.aclose()
    return (
        f"{kind:9} stream length {length:>9,}  used_memory +{memory / 2**20:7.2f}"
        f" MiB, the stream key {key / 2**20:7.2f} MiB  (drained in {took:.1f} s)"
    )


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--server", action="append", default=[])
    args = parser.parse_args(argv)
    if not 1 <= args.tasks <= MAX_TASKS:
        parser.error(f"--tasks must be 1..{MAX_TASKS}")
    binaries = [b for b in find_binaries() if not args.server or b.label in args.server]
    for binary in binaries:
        print(f"{binary.label}: {args.tasks:,} tasks, {args.workers} workers")
        for kind in KINDS:
            with LocalServer(binary) as server:
                line = await one_run(
                    kind, server.url, args.tasks, args.workers, args.settle
                )
            print(f"  {line}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
