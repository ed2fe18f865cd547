"""A taskiq app for tests/test_liveness.py, run by ``taskiq worker``.

The broker is built as a user who swaps the class would build it: no
reclaim setting at all, unless ``TAC_TEST_IDLE_TIMEOUT`` is set. Besides the
drill's ``work`` task (which reports "ready", "started" and "finished") it
has ``block_loop``, which blocks the worker's event loop with ``time.sleep``,
as a sync client called inside an async task does.
"""

from __future__ import annotations

import os
import time
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.drill_app import add_drill_task, events_stream

BLOCKING_TASK = "tests.liveness_app.block_loop"

URL = os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("TAC_TEST_QUEUE", "taskiq-atomic-claim-drill-liveness")
WORKER = os.environ.get("TAC_TEST_WORKER", "worker")

settings: dict[str, Any] = {}
if os.environ.get("TAC_TEST_IDLE_TIMEOUT"):
    settings["idle_timeout"] = int(os.environ["TAC_TEST_IDLE_TIMEOUT"])
broker = AtomicRedisStreamBroker(URL, queue_name=QUEUE, **settings)
# The events may go straight to the server while the broker goes through a
# proxy that cuts it off.
events = Redis.from_url(os.environ.get("TAC_TEST_EVENTS_URL") or URL)
add_drill_task(broker, events, QUEUE, WORKER)


@broker.task(task_name=BLOCKING_TASK)
async def block_loop(run_id: str, seconds: float) -> None:
    stream = events_stream(QUEUE)
    await events.xadd(stream, {"event": "started", "run": run_id, "worker": WORKER})
    time.sleep(seconds)  # noqa: ASYNC251 (the point: the loop is blocked)
    await events.xadd(stream, {"event": "finished", "run": run_id, "worker": WORKER})
