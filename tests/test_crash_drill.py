"""End to end: a real `taskiq worker --ack-type when_executed`, SIGKILLed mid-task."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim.drill import run_drill
from tests.conftest import Server

IDLE_MS, INTERVAL_MS = 2000, 500
# Worker start-up overlaps the idle wait; the margin covers a slow machine.
BOUND_S = (IDLE_MS + INTERVAL_MS) / 1000 + 1.5


@pytest.mark.parametrize(
    "plant_legacy_lock", [False, True], ids=["clean", "legacy-lock"]
)
async def test_killed_workers_task_runs_again_on_an_idle_queue(
    server: Server, redis: Redis, tmp_path: Path, plant_legacy_lock: bool
) -> None:
    report = await run_drill(
        server.url,
        rounds=1,
        idle_timeout=IDLE_MS,
        claim_interval=INTERVAL_MS,
        log_dir=tmp_path,
        plant_legacy_lock=plant_legacy_lock,
    )
    [result] = report.rounds
    assert result.recovered, report.summary()
    assert result.kill_to_rerun_s is not None
    assert result.kill_to_rerun_s <= BOUND_S, report.summary()
    # The drill cleans up after itself; nothing of it is left pending.
    assert [key async for key in redis.scan_iter("taskiq-atomic-claim-drill-*")] == []
