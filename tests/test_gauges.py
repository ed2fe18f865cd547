"""Server gauges: every series exists at 0 from a worker's start and moves
under a real workload, served by taskiq's PrometheusMiddleware from a real
``taskiq worker`` process."""

from __future__ import annotations

import asyncio
import math
import os
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.acl import worker_acl_rule
from taskiq_atomic_claim.gauges import (
    GAUGES,
    PEL_SCAN_LIMIT,
    PREFIX,
    ServerGauges,
    next_gap,
    read_group,
    read_group_gauges,
)
from taskiq_atomic_claim.harness.drill import Worker
from taskiq_atomic_claim.harness.embedded_server import free_port
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import COUNTERS
from taskiq_atomic_claim.operations import set_idle_call
from taskiq_atomic_claim.scripts import ScriptRunner
from tests.conftest import Server, acl_log_entries, server_command, with_user
from tests.test_oom import until
from tests.test_reliability import cancel_swallowing_connection

GROUP = "taskiq"
USER = "tac-gauges-worker"
PASSWORD = "tac-gauges-worker-password"


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(sample name, stream) to value; {} while nothing answers yet."""
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as reply:
            body = reply.read().decode()
    except OSError:
        return {}
    return {
        (sample.name, sample.labels.get("stream", "")): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name.startswith(PREFIX)
    }


async def scraped(
    port: int, check: Callable[[dict[tuple[str, str], float]], bool]
) -> dict[tuple[str, str], float]:
    """The first scrape passing ``check`` within 60 s; {} if none did."""
    found: dict[tuple[str, str], float] = {}

    def passes() -> bool:
        found.update(scrape(port))
        return check(found)

    return found if await until(passes, 60) else {}


@pytest.fixture
async def queue(redis: Redis) -> AsyncIterator[str]:
    name = f"taskiq-atomic-claim-gauges-{uuid.uuid4().hex[:8]}"
    yield name
    await redis.delete(name, StreamKeys(name, GROUP).dead_letters)


async def _longest_idle_of_every_entry(redis: Redis, queue: str) -> int:
    entries = await redis.xpending_range(queue, GROUP, "-", "+", 10_000)
    return max(int(entry["time_since_delivered"]) for entry in entries)


async def test_oldest_pending_reads_the_whole_pel(redis: Redis, queue: str) -> None:
    """A dead consumer's entries idle behind more than the scanned part of
    the PEL held by a live one: the gauge sees them."""
    await redis.xgroup_create(queue, GROUP, id="0", mkstream=True)
    async with redis.pipeline(transaction=False) as pipe:
        for n in range(1500):
            pipe.xadd(queue, {"data": str(n)})
        await pipe.execute()
    live: Any = await redis.xreadgroup(GROUP, "live", {queue: ">"}, count=1200)
    dead: Any = await redis.xreadgroup(GROUP, "dead", {queue: ">"}, count=300)
    assert len(live[0][1]) == 1200 > PEL_SCAN_LIMIT and len(dead[0][1]) == 300
    dead_ids = [entry_id.decode() for entry_id, _ in dead[0][1]]

    fresh = await read_group_gauges(redis, queue, GROUP)
    assert fresh.pending == 1500
    assert fresh.oldest_pending_idle_ms is not None
    assert fresh.oldest_pending_idle_ms < 10_000

    async def set_idle(idle_ms: int, ids: list[str]) -> None:
        call = set_idle_call(
            stream=queue,
            group=GROUP,
            consumer="dead",
            idle_ms=idle_ms,
            orphans="o",
            entry_ids=ids,
        )
        assert await ScriptRunner().run(redis, call) == []  # all still its own

    # One entry in the middle idler still: found by the search, not the
    # first probe.
    await set_idle(20_000, dead_ids)
    await set_idle(45_000, [dead_ids[150]])
    gauges = await read_group_gauges(redis, queue, GROUP)
    assert gauges.oldest_pending_idle_ms is not None
    assert gauges.oldest_pending_idle_ms >= 45_000
    assert gauges.oldest_pending_idle_ms <= await _longest_idle_of_every_entry(
        redis, queue
    )
    assert gauges.values()["oldest_pending_age_seconds"] >= 45.0

    # Idler and idler further on, more than the search follows one by one:
    # it doubles, then halves, onto the idlest.
    for n in range(12):
        await set_idle(50_000 + 1000 * n, [dead_ids[200 + n]])
    gauges = await read_group_gauges(redis, queue, GROUP)
    assert gauges.oldest_pending_idle_ms is not None
    assert gauges.oldest_pending_idle_ms >= 61_000
    assert gauges.oldest_pending_idle_ms <= await _longest_idle_of_every_entry(
        redis, queue
    )

    # The consumer holding it is named (doctor's stale-pending names it).
    reading = await read_group(
        redis, queue, GROUP, (await redis.xinfo_groups(queue))[0]
    )
    by_name = {c.name: c for c in reading.consumers}
    assert (by_name["dead"].oldest_pending_idle_ms or 0) >= 61_000
    assert (by_name["live"].oldest_pending_idle_ms or 0) < 10_000
    assert reading.pel_scanned == PEL_SCAN_LIMIT


def test_reading_takes_at_most_a_fifth_of_the_time() -> None:
    assert next_gap(15.0, 1.0) == 14.0  # the interval, end to end
    assert next_gap(2.0, 1.0) == 4.0  # a slow read spaces the next one out
    assert next_gap(2.0, 0.0) == 2.0


def test_bad_interval_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="interval must be > 0"):
        ServerGauges(interval=0)
    with pytest.raises(TypeError, match="interval must be seconds"):
        ServerGauges(interval="15")  # type: ignore[arg-type]


async def test_a_worker_exports_every_gauge_at_zero_then_they_move(
    server: Server, redis: Redis, queue: str, tmp_path: Path
) -> None:
    # The worker logs in with the documented rule for a worker with gauges.
    version = str((await redis.info("server"))["redis_version"])
    rule = worker_acl_rule([queue], GROUP, version, gauges=True)
    await server_command(
        redis, "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", *rule
    )
    await server_command(redis, "ACL", "LOG", "RESET")
    port = free_port()
    env = {
        **os.environ,
        "TAC_TEST_URL": with_user(server.admin_url, USER, PASSWORD),
        "TAC_TEST_QUEUE": queue,
        "TAC_TEST_METRICS_DIR": str(tmp_path / "metrics"),
        "TAC_TEST_METRICS_PORT": str(port),
    }
    worker = Worker(env, tmp_path / "worker.log", app="tests.gauges_app:broker")
    kicker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    try:
        idle = await scraped(
            port,
            lambda s: (
                (PREFIX + "dead_letters", queue) in s
                and (PREFIX + "claimed_total", queue) in s
            ),
        )
        assert idle, (tmp_path / "worker.log").read_text(errors="replace")
        for name in GAUGES:
            assert (PREFIX + name, queue) in idle, name
        for name in COUNTERS:
            stream = "*" if name == "script_reloads" else queue
            assert idle[(f"{PREFIX}{name}_total", stream)] == 0, name
        assert idle[(PREFIX + "pending", queue)] == 0
        assert idle[(PREFIX + "dead_letters", queue)] == 0
        assert idle[(PREFIX + "oldest_pending_age_seconds", queue)] == 0

        hold = kicker.register_task(lambda seconds: None, "tests.gauges_app.hold")
        for _ in range(3):
            await hold.kiq(4.0)
        await redis.xadd(StreamKeys(queue, GROUP).dead_letters, {"data": b"{}"})
        busy = await scraped(
            port,
            lambda s: (
                s.get((PREFIX + "pending", queue)) == 3
                and s.get((PREFIX + "dead_letters", queue)) == 1
            ),
        )
        assert busy, scrape(port)
        assert busy[(PREFIX + "consumers", queue)] == 1
        assert busy[(PREFIX + "last_read_age_seconds", queue)] < 5
        assert busy[(PREFIX + "stream_length", queue)] == 3
        assert busy[(PREFIX + "oldest_pending_age_seconds", queue)] > 0
        lag = busy[(PREFIX + "lag", queue)]
        assert lag == 0 or (server.major < 7 and math.isnan(lag))
    finally:
        worker.stop()
        await kicker.shutdown()
        log = acl_log_entries(await server_command(redis, "ACL", "LOG"))
        await server_command(redis, "ACL", "DELUSER", USER)
    assert [entry for entry in log if entry["username"] == USER] == []


async def test_a_cancel_swallowed_inside_a_reading_still_stops_the_gauges(
    server: Server, redis: Redis, queue: str
) -> None:
    connection_class, swallowed = cancel_swallowing_connection()
    broker = AtomicRedisStreamBroker(
        server.url, queue_name=queue, connection_class=connection_class
    )
    broker.is_worker_process = True
    gauges = ServerGauges(interval=0.05)
    broker.add_middlewares(gauges)
    await broker.startup()
    stopping: asyncio.Future[None] | None = None
    try:
        # The server holds every command for a second: the next reading
        # waits in its read, where the shutdown's cancel lands.
        await server_command(redis, "CLIENT", "PAUSE", "1000", "ALL")
        await asyncio.sleep(0.3)
        stopping = asyncio.ensure_future(gauges.shutdown())
        # The reading ends once the pause does; then the loop must stop.
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert swallowed, "the cancel did not land in a read: nothing was tested"
        # Without the guard the loop sleeps on and the shutdown waits forever.
        assert done
    finally:
        await server_command(redis, "CLIENT", "UNPAUSE")
        if stopping is not None and not stopping.done():
            stopping.cancel()
        await broker.shutdown()
