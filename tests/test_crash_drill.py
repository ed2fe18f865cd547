"""End to end: a real `taskiq worker --ack-type when_executed`, SIGKILLed mid-task."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim.harness.drill import drill_queue, run_drill, running_workers
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
    if server.local is not None:  # a server whose binary the suite knows
        binary = server.local.binary
        named = {"redis": "Redis", "valkey": "Valkey"}[binary.flavor]
        assert f", on {named} {binary.version}: recovered" in report.summary()
    assert result.kill_to_rerun_s is not None
    assert result.kill_to_rerun_s <= BOUND_S, report.summary()
    # The drill cleans up after itself; nothing of it is left pending.
    assert [key async for key in redis.scan_iter("taskiq-atomic-claim-drill-*")] == []


async def finished_runs(redis: Redis, events_stream: str) -> set[str]:
    entries: Any = await redis.xrange(events_stream)
    return {
        fields[b"run"].decode()
        for _, fields in entries
        if fields[b"event"] == b"finished"
    }


async def test_long_task_on_a_live_worker_runs_exactly_once(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    idle_ms = 1000
    async with drill_queue(server.url, idle_ms, 200, log_dir=tmp_path) as drill:
        with running_workers() as workers:
            for name in ("one", "two"):
                workers.append(drill.worker(name))
            deadline = time.monotonic() + 30
            for name in ("one", "two"):
                assert await drill.events.wait_for("ready", deadline, worker=name)
            # Three idle_timeouts long, while the other worker claims every 200 ms.
            await drill.kick("long", 3 * idle_ms / 1000)
            assert await drill.events.wait_for("finished", deadline, "long")
            await asyncio.sleep(idle_ms / 1000)  # room for a wrong second run
        events: Any = await redis.xrange(drill.events.stream)
        starts = [f for _, f in events if f[b"event"] == b"started"]
        assert len(starts) == 1, starts


async def test_sigterm_with_a_backlog_hands_work_back_without_waiting(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # A rolling restart: the leaving worker had prefetched a backlog it never
    # starts. With idle_timeout 60 s, anything it did not hand back would
    # wait a minute; handed back, the replacement runs it at once.
    idle_ms = 60_000
    runs = [f"job-{n}" for n in range(4)]
    async with drill_queue(server.url, idle_ms, 500, log_dir=tmp_path) as drill:
        with running_workers() as workers:
            leaving = drill.worker("leaving", "--max-async-tasks", "1")
            workers.append(leaving)
            deadline = time.monotonic() + 40
            assert await drill.events.wait_for("ready", deadline, worker="leaving")
            for run_id in runs:
                await drill.kick(run_id, 0.5)
            assert await drill.events.wait_for("started", deadline, runs[0], "leaving")
            workers.append(drill.worker("replacement"))
            assert await drill.events.wait_for("ready", deadline, worker="replacement")
            leaving.stop()  # SIGTERM, waits for a graceful exit
            until = time.monotonic() + 20
            while time.monotonic() < until:
                done = await finished_runs(redis, drill.events.stream)
                if done >= set(runs):
                    break
                await asyncio.sleep(0.2)
            assert done >= set(runs), f"not run before idle_timeout: {set(runs) - done}"
            # A task's ack follows its finish: wait for the last ones before
            # the workers are killed (still far below idle_timeout).
            while time.monotonic() < until:
                if (await redis.xpending(drill.queue, "taskiq"))["pending"] == 0:
                    break
                await asyncio.sleep(0.1)
        pending = await redis.xpending(drill.queue, "taskiq")
        assert pending["pending"] == 0
