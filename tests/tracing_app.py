"""A taskiq app traced with OpenTelemetry, for tests/test_tracing.py, run by
``taskiq worker``: taskiq's ``OpenTelemetryMiddleware`` and an SDK tracer
provider that writes every finished span as one JSON line to the file
``TAC_TEST_SPANS`` names. ``crash_once`` SIGKILLs its worker the first time
it runs (a mark in Redis says so), ``crash_always`` every time.
"""

from __future__ import annotations

import os
import signal

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from redis.asyncio import Redis
from taskiq.middlewares.opentelemetry_middleware import OpenTelemetryMiddleware

from taskiq_atomic_claim import AtomicRedisStreamBroker

CRASH_ONCE = "tests.tracing_app.crash_once"
CRASH_ALWAYS = "tests.tracing_app.crash_always"

URL = os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("TAC_TEST_QUEUE", "taskiq-atomic-claim-tracing")


def one_line(span: ReadableSpan) -> str:
    return str(span.to_json(indent=None)) + "\n"


spans = open(os.environ.get("TAC_TEST_SPANS", os.devnull), "a", encoding="utf-8")  # noqa: SIM115
provider = TracerProvider()
provider.add_span_processor(
    SimpleSpanProcessor(ConsoleSpanExporter(out=spans, formatter=one_line))
)
trace.set_tracer_provider(provider)

broker = AtomicRedisStreamBroker(
    URL, queue_name=QUEUE, idle_timeout=1000, max_deliveries=2
).with_middlewares(OpenTelemetryMiddleware())
marks = Redis.from_url(URL)


@broker.task(task_name=CRASH_ONCE)
async def crash_once(mark: str) -> str:
    if await marks.set(mark, 1, nx=True, ex=60):
        os.kill(os.getpid(), signal.SIGKILL)
    return "ran"


@broker.task(task_name=CRASH_ALWAYS)
async def crash_always() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
