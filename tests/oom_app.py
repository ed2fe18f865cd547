"""A taskiq app for tests/test_oom.py and tests/test_readonly.py, run by
``taskiq worker``.

Its task reports each start and end to a file, not to the server: out of
memory or demoted, the server refuses the writes a report would need.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from taskiq import TaskiqEvents, TaskiqState

from taskiq_atomic_claim import AtomicRedisStreamBroker

TASK_NAME = "tests.oom_app.work"

WORKER = os.environ.get("TAC_TEST_WORKER", "worker")
REPORTS = Path(os.environ.get("TAC_TEST_REPORTS", "oom-reports"))

broker = AtomicRedisStreamBroker(
    os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379"),
    queue_name=os.environ.get("TAC_TEST_QUEUE", "taskiq-atomic-claim-drill-oom"),
    idle_timeout=int(os.environ.get("TAC_TEST_IDLE_TIMEOUT", "1000")),
    claim_interval=int(os.environ.get("TAC_TEST_CLAIM_INTERVAL", "200")),
    xread_block=500,
)


def report(event: str, run_id: str = "") -> None:
    # One short line per write in append mode: lines of several processes
    # never interleave.
    with REPORTS.open("a", encoding="utf-8") as reports:
        reports.write(f"{event} {run_id} {WORKER}\n")


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def ready(_: TaskiqState) -> None:
    report("ready")


@broker.task(task_name=TASK_NAME)
async def work(run_id: str, seconds: float) -> None:
    report("started", run_id)
    await asyncio.sleep(seconds)
    report("finished", run_id)
