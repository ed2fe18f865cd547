"""A taskiq app for tests/test_gauges.py, run by ``taskiq worker``: taskiq's
PrometheusMiddleware serves the server gauges this worker reads."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from taskiq.middlewares.prometheus_middleware import PrometheusMiddleware

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.gauges import ServerGauges

broker = AtomicRedisStreamBroker(
    os.environ["TAC_TEST_URL"],
    queue_name=os.environ["TAC_TEST_QUEUE"],
    idle_timeout=60_000,
    xread_block=500,
)
broker.add_middlewares(
    PrometheusMiddleware(
        metrics_path=Path(os.environ["TAC_TEST_METRICS_DIR"]),
        server_port=int(os.environ["TAC_TEST_METRICS_PORT"]),
        server_addr="127.0.0.1",
    ),
    ServerGauges(interval=0.2),
)


@broker.task(task_name="tests.gauges_app.hold")
async def hold(seconds: float) -> None:
    await asyncio.sleep(seconds)
