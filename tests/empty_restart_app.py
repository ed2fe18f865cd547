"""The taskiq app of ``test_empty_restart``, run under ``taskiq worker``.

The drill's broker and task on the queue server ``TAC_DRILL_URL``; the task
reports to an events stream on ``TAC_DRILL_EVENTS_URL``, another server, so
the queue server's empty restart cannot take the reports with it.
"""

from __future__ import annotations

import os

from redis.asyncio import Redis

from taskiq_atomic_claim.harness.drill_app import add_drill_task, build_broker

TASK_NAME = "tests.empty_restart_app.work"
_QUEUE = os.environ.get("TAC_DRILL_QUEUE", "taskiq-atomic-claim-drill")

broker = build_broker(
    os.environ.get("TAC_DRILL_URL", "redis://127.0.0.1:6379"),
    _QUEUE,
    int(os.environ.get("TAC_DRILL_IDLE_TIMEOUT", "2000")),
    int(os.environ.get("TAC_DRILL_CLAIM_INTERVAL", "500")),
    "atomic",
    consumer_name=os.environ.get("TAC_DRILL_WORKER"),
)
add_drill_task(
    broker,
    Redis.from_url(os.environ.get("TAC_DRILL_EVENTS_URL", "redis://127.0.0.1:6379")),
    _QUEUE,
    os.environ.get("TAC_DRILL_WORKER", f"worker-{os.getpid()}"),
    TASK_NAME,
)
