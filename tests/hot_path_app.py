"""A taskiq app for tests/test_hot_path.py, run by ``taskiq worker``.

Configured from the environment: its one task notes each run of its
argument in a local file (no server round trip: a stalled server must not
hide a run), then sleeps a little.
"""

from __future__ import annotations

import asyncio
import os

from taskiq_atomic_claim import AtomicRedisStreamBroker

TASK_NAME = "tests.hot_path_app.noted"

pool_size = os.environ.get("TAC_TEST_POOL_SIZE", "")
broker = AtomicRedisStreamBroker(
    os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379"),
    queue_name=os.environ.get("TAC_TEST_QUEUE", "taskiq-hot-path"),
    idle_timeout=int(os.environ.get("TAC_TEST_IDLE_TIMEOUT", "2000")),
    max_connection_pool_size=int(pool_size) if pool_size else None,
    xread_block=500,
)
RUNS_FILE = os.environ.get("TAC_TEST_RUNS_FILE", "")


@broker.task(task_name=TASK_NAME)
async def noted(run_id: str, seconds: float) -> None:
    with open(RUNS_FILE, "a", encoding="utf-8") as runs:  # noqa: ASYNC230
        runs.write(f"{run_id}\n")
    await asyncio.sleep(seconds)
