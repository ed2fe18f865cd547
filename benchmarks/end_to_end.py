"""Part 6: SIGKILL -> re-run time, with the project's crash drill.

``taskiq_atomic_claim.harness.drill.run_drill`` starts a real ``taskiq worker``,
SIGKILLs it the moment a task starts, starts a replacement and times how
long until the replacement runs the task again. It is reused unchanged for
both brokers ("atomic" and taskiq-redis 1.2.4's "upstream") and two queues:

- idle: nothing else is sent (the drill as written);
- busy: a filler task is kicked every ``_FILL_EVERY_S`` on the same queue
  during the drill, so reads keep returning messages. 1.2.4 only runs its
  claim step after a read returned something; this is the case where it can
  recover at all.

The drill names its queue itself, so the filler finds it on the server
(this suite's own server, where only the drill creates such a stream).
An upstream worker on an idle queue never reclaims; each such round is
bounded by ``give_up_s`` and reported as not recovered within it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker
from taskiq_redis import RedisStreamBroker

from benchmarks.config import Mode
from benchmarks.stats import p50, percentile
from taskiq_atomic_claim.harness.drill import DrillReport, run_drill
from taskiq_atomic_claim.harness.drill_app import TASK_NAME

_FILL_EVERY_S = 0.1
_DRILL_QUEUES = "taskiq-atomic-claim-drill-*"


async def _find_drill_queue(client: Redis, deadline: float) -> str | None:
    while time.monotonic() < deadline:
        async for key in client.scan_iter(
            match=_DRILL_QUEUES, _type="stream", count=100
        ):
            name: str = key.decode()
            if not name.endswith(":drill-events"):
                return name
        await asyncio.sleep(0.02)
    return None


async def _fill(url: str, stop: asyncio.Event, max_seconds: float) -> int:
    """Kick filler tasks onto the drill's queue until told to stop."""
    deadline = time.monotonic() + max_seconds
    client = Redis.from_url(url)
    try:
        queue = await _find_drill_queue(client, time.monotonic() + 30)
    finally:
        await client.aclose()
    if queue is None:
        return 0
    kicker_broker = RedisStreamBroker(url, queue_name=queue)
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker_broker, {})
    sent = 0
    try:
        max_fills = int(max_seconds / _FILL_EVERY_S) + 1
        while not stop.is_set() and sent < max_fills and time.monotonic() < deadline:
            await kicker.kiq(f"filler-{sent}", 0.0)
            sent += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), _FILL_EVERY_S)
    finally:
        await kicker_broker.shutdown()
    return sent


async def _drill(
    url: str, broker: str, queue: str, rounds: int, mode_args: dict[str, Any]
) -> tuple[DrillReport, int]:
    with tempfile.TemporaryDirectory(prefix="tac-bench-drill-") as logs:
        drill = run_drill(
            url, rounds=rounds, broker_kind=broker, log_dir=Path(logs), **mode_args
        )
        if queue == "idle":
            return await drill, 0
        stop = asyncio.Event()
        # Bounded: a round cannot outlast a few give-up periods.
        filler = asyncio.create_task(
            _fill(url, stop, rounds * (mode_args["give_up_after"] * 3 + 10))
        )
        try:
            report = await drill
        finally:
            stop.set()
            fills = await asyncio.wait_for(filler, 30)
        return report, fills


def _row(
    report: DrillReport, broker: str, queue: str, fills: int, give_up_s: float
) -> dict[str, Any]:
    times = report.kill_to_rerun()
    bound_s = (report.idle_timeout + report.claim_interval) / 1000 + 0.25
    return {
        "broker": "atomic" if broker == "atomic" else "upstream_1_2_4",
        "queue": queue,
        "kills": len(report.rounds),
        "recovered": report.recovered,
        "not_recovered_within_s": give_up_s
        if report.recovered < len(report.rounds)
        else None,
        "p50_s": round(p50(times), 3) if times else None,
        "p99_s": round(percentile(times, 99), 3) if times else None,
        "max_s": round(max(times), 3) if times else None,
        "idle_timeout_ms": report.idle_timeout,
        "claim_interval_ms": report.claim_interval,
        "bound_s": round(bound_s, 3),
        "filler_tasks": fills,
    }


async def _run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    args = {
        "idle_timeout": mode.e2e_idle_timeout,
        "claim_interval": mode.e2e_claim_interval,
        "give_up_after": mode.e2e_give_up_s,
    }
    rows = []
    for broker in ("atomic", "upstream"):
        for queue in ("idle", "busy"):
            rounds = mode.e2e_rounds
            if (broker, queue) == ("upstream", "idle"):
                rounds = mode.e2e_upstream_idle_rounds
            log(f"end to end: {broker} broker, {queue} queue, {rounds} kills")
            report, fills = await _drill(url, broker, queue, rounds, args)
            rows.append(_row(report, broker, queue, fills, mode.e2e_give_up_s))
    return rows


def run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    return asyncio.run(_run(url, mode, log))
