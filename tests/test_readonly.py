"""A demoted primary (a failover's old primary, ``REPLICAOF``): real
``taskiq worker`` processes keep running what they hold, each task runs once,
every ack lands once the server is a primary again, and new tasks flow.
Producers' kicks are refused meanwhile (XADD): that is the producer's error
to handle, and a refused kick never runs.

Whichever way a server reclaims (the claim script, or on Redis >= 8.4 the
reads themselves), the checks are the same: what ran, what is pending, what
was dead-lettered.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import ReadOnlyError
from taskiq.exceptions import SendTaskError

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.drill import Worker
from taskiq_atomic_claim.keys import StreamKeys
from tests.conftest import Server
from tests.test_faults import read_only
from tests.test_oom import (
    INTERVAL_MS,
    app_worker,
    kick,
    ready_workers,
    reported,
    until,
)

IDLE_MS = 4000
HEARTBEAT_S = IDLE_MS / 3000
ACK_PATIENCE_S = IDLE_MS / 2000
# Longer than a heartbeat interval (a beat is refused), shorter than an
# ack's patience (a refused ack must land once it is over).
DEMOTED_S = 1.6
# Longer than twice idle_timeout: only heartbeats keep them owned.
TASK_S = 2 * IDLE_MS / 1000 + 0.5
# The tasks finish this long after the demotion begins: their acks are
# refused for the rest of it.
FINISH_INTO_DEMOTION_S = 0.6
# Past it, an entry left pending (an ack dropped) is reclaimed and run again.
RECLAIM_S = IDLE_MS / 1000 + 2 * INTERVAL_MS / 1000 + 1
SLOTS = 4
GROUP = "taskiq"


@pytest.fixture
async def queue(redis: Redis) -> AsyncIterator[str]:
    name = f"taskiq-atomic-claim-drill-readonly-{uuid.uuid4().hex[:8]}"
    await redis.xgroup_create(name, GROUP, id="0", mkstream=True)
    yield name
    await redis.delete(name)


@pytest.fixture
async def workers(
    server: Server, queue: str, tmp_path: Path
) -> AsyncIterator[list[Worker]]:
    """Two ready workers, ``SLOTS`` tasks each at once; stopped after."""
    reports = tmp_path / "reports"
    started = []
    try:
        for name in ("w0", "w1"):
            args = ("--max-async-tasks", str(SLOTS))
            started.append(app_worker(server, queue, reports, name, IDLE_MS, *args))
        assert await until(lambda: len(ready_workers(reports)) == 2, 60)
        yield started
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture
async def kicker(server: Server, queue: str) -> AsyncIterator[AtomicRedisStreamBroker]:
    # No patience: kicks during the demotion are refused, not ridden out
    # (test_kicks covers that), so some are refused and must never run.
    broker = AtomicRedisStreamBroker(server.url, queue_name=queue, kick_patience=0)
    yield broker
    await broker.shutdown()


def logged(tmp_path: Path, *texts: str) -> bool:
    """Whether any worker's log has a line with every one of ``texts``."""
    return any(
        all(text in line for text in texts)
        for log in tmp_path.glob("w*.log")
        for line in log.read_text(errors="replace").splitlines()
    )


def assert_alive(workers: list[Worker], reports: Path) -> None:
    """Both workers run, and neither's worker process died: taskiq starts a
    new one, which reports ready again."""
    assert [w.process.poll() for w in workers] == [None, None], "a worker exited"
    lines = reports.read_text(encoding="utf-8").splitlines()
    ready = Counter(line.split(" ")[2] for line in lines if line.startswith("ready "))
    assert ready == {"w0": 1, "w1": 1}, "a worker process died and was restarted"


async def assert_settled(redis: Redis, queue: str) -> None:
    """Nothing pending, nothing dead-lettered."""
    assert (await redis.xpending(queue, GROUP))["pending"] == 0
    dead_letters = StreamKeys(queue, GROUP).dead_letters
    assert await redis.xlen(dead_letters) == 0, "dead letters written"


async def until_settled(redis: Redis, queue: str, seconds: float) -> bool:
    """Poll until nothing is pending, or ``seconds`` passed (bounded)."""
    deadline = time.monotonic() + seconds
    while (await redis.xpending(queue, GROUP))["pending"]:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def test_tasks_finishing_while_demoted_run_once_and_their_acks_land(
    redis: Redis,
    queue: str,
    workers: list[Worker],
    kicker: AtomicRedisStreamBroker,
    tmp_path: Path,
) -> None:
    assert HEARTBEAT_S < DEMOTED_S < ACK_PATIENCE_S, "the settings miss the point"
    reports = tmp_path / "reports"
    runs = {f"job-{n}" for n in range(SLOTS)}
    for run_id in sorted(runs):
        await kick(kicker, run_id, TASK_S)
    # Every task has a slot, whichever worker read it.
    assert await until(lambda: bool(reported(reports, "started")), 10)
    first_started = time.monotonic()
    assert await until(lambda: set(reported(reports, "started")) >= runs, 10)
    await asyncio.sleep(
        max(0.0, first_started + TASK_S - FINISH_INTO_DEMOTION_S - time.monotonic())
    )
    async with read_only(redis):
        await asyncio.sleep(DEMOTED_S)
        finished_while_demoted = set(reported(reports, "finished"))
        pending_while_demoted = (await redis.xpending(queue, GROUP))["pending"]
    promoted = time.monotonic()
    assert_alive(workers, reports)
    assert finished_while_demoted >= runs, "not finished while demoted"
    assert pending_while_demoted == len(runs), "acks not refused while demoted"
    # An ack that gave up would leave its entry pending.
    assert await until_settled(redis, queue, ACK_PATIENCE_S + 1)
    after = {"after-0", "after-1"}
    for run_id in sorted(after):
        await kick(kicker, run_id, 0.2)
    assert await until(lambda: set(reported(reports, "finished")) >= after, 15)
    # Long enough for an entry a worker stopped holding to be run again.
    await asyncio.sleep(max(0.0, promoted + RECLAIM_S - time.monotonic()))
    assert_alive(workers, reports)
    started = reported(reports, "started")
    assert {run: n for run, n in started.items() if n != 1} == {}, "ran twice"
    assert set(started) == runs | after
    await assert_settled(redis, queue)
    # The fault reached them: heartbeats and acks failed. (How the first
    # failure of an outage reads varies: a demotion may close connections.)
    assert logged(tmp_path, "heartbeat ", "retrying with backoff")
    assert logged(tmp_path, "acks of consumer ", "retrying with backoff")


async def test_kicks_refused_while_demoted_never_run_the_accepted_run_once(
    redis: Redis,
    queue: str,
    workers: list[Worker],
    kicker: AtomicRedisStreamBroker,
    tmp_path: Path,
) -> None:
    reports = tmp_path / "reports"
    accepted: list[str] = []
    refused: list[str] = []

    async def produce(seconds: float) -> None:
        # Bounded in count and time.
        stop = time.monotonic() + seconds
        for n in range(200):
            if time.monotonic() > stop:
                return
            run_id = f"kick-{n}"
            try:
                await kick(kicker, run_id, 0.2)
            except SendTaskError as error:
                if not isinstance(error.__cause__, ReadOnlyError):
                    raise
                refused.append(run_id)
            else:
                accepted.append(run_id)
            await asyncio.sleep(0.05)

    producer = asyncio.create_task(produce(0.5 + DEMOTED_S + 0.5))
    try:
        await asyncio.sleep(0.5)
        async with read_only(redis):
            await asyncio.sleep(DEMOTED_S)
        promoted = time.monotonic()
        await asyncio.wait_for(producer, 10)
    finally:
        producer.cancel()
    assert refused, "no kick refused while demoted"
    assert accepted, "no kick accepted"
    assert await until(lambda: set(reported(reports, "finished")) >= set(accepted), 15)
    await asyncio.sleep(max(0.0, promoted + RECLAIM_S - time.monotonic()))
    assert_alive(workers, reports)
    started = reported(reports, "started")
    assert {run: n for run, n in started.items() if n != 1} == {}, "ran twice"
    assert set(started) == set(accepted), "a refused kick ran"
    await assert_settled(redis, queue)
