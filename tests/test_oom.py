"""Out of memory (``maxmemory`` reached, ``noeviction``), real ``taskiq
worker`` processes keep running what they read: each task runs once, every
ack lands, and new tasks flow once memory is back. Producers' kicks are
refused meanwhile (XADD): retried for kick_patience, then the producer's
error to handle.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.drill import Worker
from tests.conftest import Server
from tests.oom_app import TASK_NAME
from tests.test_faults import out_of_memory
from tests.test_started_semantics import REPO

APP = "tests.oom_app:broker"
IDLE_MS, INTERVAL_MS = 1000, 200
# Longer than twice idle_timeout: only heartbeats keep them owned.
TASK_S = 2.5


def reported(reports: Path, event: str) -> Counter[str]:
    """How often each run reported ``event``."""
    if not reports.exists():
        return Counter()
    lines = reports.read_text(encoding="utf-8").splitlines()
    return Counter(line.split(" ")[1] for line in lines if line.split(" ")[0] == event)


def ready_workers(reports: Path) -> set[str]:
    if not reports.exists():
        return set()
    lines = reports.read_text(encoding="utf-8").splitlines()
    return {line.split(" ")[2] for line in lines if line.startswith("ready ")}


def app_worker(
    server: Server,
    queue: str,
    reports: Path,
    name: str,
    idle_ms: int,
    *args: str,
) -> Worker:
    """A ``taskiq worker`` of ``tests.oom_app``, logging to ``<name>.log``
    beside ``reports``."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TAC_TEST_URL": server.url,
        "TAC_TEST_QUEUE": queue,
        "TAC_TEST_WORKER": name,
        "TAC_TEST_REPORTS": str(reports),
        "TAC_TEST_IDLE_TIMEOUT": str(idle_ms),
        "TAC_TEST_CLAIM_INTERVAL": str(INTERVAL_MS),
    }
    return Worker(env, reports.parent / f"{name}.log", args, APP)


async def kick(kicker: AtomicRedisStreamBroker, run_id: str, seconds: float) -> None:
    """Kick a task of ``tests.oom_app`` that runs ``seconds``."""
    task: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker, {})
    await task.kiq(run_id, seconds)


async def until(check: Any, seconds: float) -> bool:
    """Poll ``check()`` until true or ``seconds`` passed (bounded)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def test_workers_finish_their_tasks_out_of_memory_each_once(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    queue = f"taskiq-atomic-claim-drill-oom-{uuid.uuid4().hex[:8]}"
    reports = tmp_path / "reports"
    await redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
    kicker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    runs = {f"job-{n}" for n in range(6)}
    workers: list[Worker] = []
    try:
        for name in ("w0", "w1"):
            args = ("--max-async-tasks", "2")
            workers.append(app_worker(server, queue, reports, name, IDLE_MS, *args))
        assert await until(lambda: len(ready_workers(reports)) == 2, 60)
        for run_id in sorted(runs):
            await kick(kicker, run_id, TASK_S)
        async with out_of_memory(redis):
            # Four slots: two rounds of TASK_S, with a margin.
            finished = await until(
                lambda: set(reported(reports, "finished")) >= runs, 30
            )
            # Long enough for a refused ack to give up (idle_timeout / 2)
            # and its entry to go idle.
            await asyncio.sleep(2 * IDLE_MS / 1000)
            pending_out_of_memory = (await redis.xpending(queue, "taskiq"))["pending"]
        not_run = runs - set(reported(reports, "finished"))
        assert finished, f"not run out of memory: {sorted(not_run)}"
        # A task left pending would be reclaimed and run again by now.
        await asyncio.sleep(3 * IDLE_MS / 1000 + 1)
        await kick(kicker, "after-oom", TASK_S)
        assert await until(lambda: "after-oom" in reported(reports, "finished"), 30)
    finally:
        for worker in workers:
            worker.stop()
        await kicker.shutdown()
    started = reported(reports, "started")
    assert {run: n for run, n in started.items() if n != 1} == {}, "ran twice"
    assert set(started) == runs | {"after-oom"}
    assert pending_out_of_memory == 0, "acks refused out of memory"
    assert (await redis.xpending(queue, "taskiq"))["pending"] == 0
    await redis.delete(queue)
