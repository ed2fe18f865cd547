"""A taskiq app for tests/test_edges.py, run by ``taskiq worker``.

Configured from the environment; no startup handler of its own, so the
broker's startup is the first thing to meet the server. ``note(run_id,
seconds)`` sleeps, then adds the run id to the queue's ``:done`` stream.
"""

from __future__ import annotations

import asyncio
import os

from redis.asyncio import Redis

from taskiq_atomic_claim import AtomicRedisStreamBroker

NOTE_TASK = "tests.edges_app.note"

URL = os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379")
# Where tasks note their runs: the admin's URL, whatever the worker's user.
NOTES_URL = os.environ.get("TAC_TEST_NOTES_URL", URL)
QUEUE = os.environ.get("TAC_TEST_QUEUE", "edges")

broker = AtomicRedisStreamBroker(
    URL,
    queue_name=QUEUE,
    consumer_name=os.environ.get("TAC_TEST_WORKER", "worker"),
    idle_timeout=int(os.environ.get("TAC_TEST_IDLE_TIMEOUT", "2000")),
    claim_interval=int(os.environ.get("TAC_TEST_CLAIM_INTERVAL", "400")),
    max_deliveries=int(os.environ.get("TAC_TEST_MAX_DELIVERIES", "2")),
    xread_block=int(os.environ.get("TAC_TEST_XREAD_BLOCK", "500")),
)
notes = Redis.from_url(NOTES_URL)


def done_stream(queue: str) -> str:
    return f"{queue}:done"


@broker.task(task_name=NOTE_TASK)
async def note(run_id: str, seconds: float = 0.0) -> None:
    await asyncio.sleep(seconds)
    await notes.xadd(done_stream(QUEUE), {"run": run_id})
