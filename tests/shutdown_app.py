"""A taskiq app for tests/test_shutdown.py, run by ``taskiq worker``.

Configured from the environment. Its worker reports to the drill's events
stream: "ready" (its consumer name and process id as the run), then
"started" and "finished" per task, and "shutting-down" when its shutdown
handler starts; that handler then takes ``TAC_TEST_SHUTDOWN_S`` seconds, as
one closing pools or flushing metrics does. A task sleeps ``seconds`` or
until its ``gate`` key exists, and at most ``TAC_TEST_SLEEP_CAP_S``, so a
second worker reruns a long task quickly.
"""

from __future__ import annotations

import asyncio
import os
import time

from redis.asyncio import Redis
from taskiq import TaskiqEvents, TaskiqState

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.drill_app import events_stream

TASK = "tests.shutdown_app.work"

URL = os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("TAC_TEST_QUEUE", "taskiq-atomic-claim-shutdown")
WORKER = os.environ.get("TAC_TEST_WORKER", "worker")
SHUTDOWN_S = float(os.environ.get("TAC_TEST_SHUTDOWN_S", "0"))
SLEEP_CAP_S = float(os.environ.get("TAC_TEST_SLEEP_CAP_S", "3600"))

broker = AtomicRedisStreamBroker(
    URL,
    queue_name=QUEUE,
    idle_timeout=int(os.environ.get("TAC_TEST_IDLE_TIMEOUT", "3000")),
    claim_interval=int(os.environ.get("TAC_TEST_CLAIM_INTERVAL", "300")),
    max_deliveries=int(os.environ.get("TAC_TEST_MAX_DELIVERIES", "1")),
    xread_block=500,
)
events = Redis.from_url(URL)


async def report(event: str, run_id: str) -> None:
    fields = {"event": event, "run": run_id, "worker": WORKER}
    await events.xadd(events_stream(QUEUE), fields)  # type: ignore[arg-type]


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def ready(_: TaskiqState) -> None:
    await report("ready", f"{broker.consumer_name} {os.getpid()}")


@broker.on_event(TaskiqEvents.WORKER_SHUTDOWN)
async def slow_shutdown(_: TaskiqState) -> None:
    await report("shutting-down", "")
    await asyncio.sleep(SHUTDOWN_S)


@broker.task(task_name=TASK)
async def work(run_id: str, seconds: float, gate: str = "") -> None:
    await report("started", run_id)
    until = time.monotonic() + min(seconds, SLEEP_CAP_S)
    while time.monotonic() < until:
        if gate and await events.exists(gate):
            break
        await asyncio.sleep(0.05)
    await report("finished", run_id)
