"""A crash's re-run says so in its trace, and dead-lettering leaves a span
event in the task's trace: real ``taskiq worker`` processes traced with
taskiq's OpenTelemetryMiddleware, which SIGKILL themselves (taskiq starts
another)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker
from taskiq.middlewares.opentelemetry_middleware import OpenTelemetryMiddleware

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.keys import StreamKeys
from tests.conftest import Server
from tests.test_started_semantics import stopped_at_exit, taskiq_worker
from tests.tracing_app import CRASH_ALWAYS, CRASH_ONCE


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def until(check: Any, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        await asyncio.sleep(0.2)
    return check()


async def test_a_rerun_and_a_dead_letter_show_in_the_trace(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    queue = f"taskiq-atomic-claim-tracing-{uuid.uuid4().hex[:8]}"
    spans = tmp_path / "spans.jsonl"
    await redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
    # The producer traces its sends: the labels carry the trace.
    kicker = AtomicRedisStreamBroker(server.url, queue_name=queue).with_middlewares(
        OpenTelemetryMiddleware(tracer_provider=TracerProvider())
    )
    env = {
        **os.environ,
        "TAC_TEST_URL": server.url,
        "TAC_TEST_QUEUE": queue,
        "TAC_TEST_SPANS": str(spans),
    }
    try:
        with stopped_at_exit() as workers:
            workers.append(
                taskiq_worker(
                    "tests.tracing_app:broker",
                    tmp_path / "worker.log",
                    env,
                    "--max-fails",
                    "50",
                )
            )
            once: AsyncKicker[Any, Any] = AsyncKicker(CRASH_ONCE, kicker, {})
            await once.kiq(f"tracing-mark-{uuid.uuid4().hex[:8]}")

            def rerun() -> list[dict[str, Any]]:
                return [
                    s
                    for s in read_spans(spans)
                    if s["attributes"].get("taskiq_atomic_claim.redelivered")
                ]

            [span] = await until(rerun, 60)
            assert span["attributes"]["taskiq_atomic_claim.crashes"] == 1
            assert span["attributes"]["taskiq_atomic_claim.deliveries"] >= 2

            always: AsyncKicker[Any, Any] = AsyncKicker(CRASH_ALWAYS, kicker, {})
            await always.kiq()

            def dead() -> list[dict[str, Any]]:
                return [s for s in read_spans(spans) if s["name"] == "dead-letter"]

            [dead_span] = await until(dead, 60)
    finally:
        await kicker.shutdown()
    [event] = dead_span["events"]
    assert event["name"] == "dead_lettered"
    assert "max_deliveries" in event["attributes"]["reason"]
    # In the trace its send started: the traceparent the send put in the
    # message's labels.
    letters: Any = await redis.xrange(StreamKeys(queue, "taskiq").dead_letters)
    [(_, fields)] = letters
    labels = json.loads(fields[b"data"])["labels"]
    trace_id = labels["traceparent"].split("-")[1]
    assert dead_span["context"]["trace_id"] == f"0x{trace_id}"
