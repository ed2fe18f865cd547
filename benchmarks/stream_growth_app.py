"""The taskiq app of ``benchmarks.stream_growth``, run under ``taskiq
worker``: the broker named by ``TAC_GROWTH_KIND`` ("atomic" or "upstream",
taskiq-redis's) at its defaults, on ``TAC_GROWTH_URL``, with a task that
does nothing."""

from __future__ import annotations

import os

from taskiq import AsyncBroker
from taskiq_redis import RedisStreamBroker

from taskiq_atomic_claim import AtomicRedisStreamBroker

TASK_NAME = "benchmarks.stream_growth_app.nothing"
QUEUE = "growth"
_URL = os.environ.get("TAC_GROWTH_URL", "redis://127.0.0.1:6379")

broker: AsyncBroker = (
    RedisStreamBroker(_URL, queue_name=QUEUE)
    if os.environ.get("TAC_GROWTH_KIND") == "upstream"
    else AtomicRedisStreamBroker(_URL, queue_name=QUEUE)
)


@broker.task(task_name=TASK_NAME)
async def nothing(number: int) -> None:
    del number
