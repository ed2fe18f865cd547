"""When and how much the listen loop claims: one call for several
streams, a full batch claimed again at once, claims bounded by what the
worker reads, a backlog shared by the fleet, non-holders waiting out the
lease they were told about. Counts, never timings, decide."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq import AckableMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.server_info import read_server_info
from taskiq_atomic_claim.settings import ClaimSettings
from tests.conftest import Server

GROUP = "taskiq"
DAY_MS = 86_400_000


@pytest.fixture
async def lua_path(redis: Redis) -> None:
    """These count the Lua claim's calls: where reads reclaim there are none
    (test_native_claim covers that path)."""
    server = await read_server_info(redis)
    if server.native_claim:
        pytest.skip(f"{server.name}: reads reclaim (XREADGROUP CLAIM), no claim calls")


@pytest.fixture
async def make_broker(server: Server, lua_path: None) -> AsyncIterator[Any]:
    started: list[AtomicRedisStreamBroker] = []

    async def make(**kwargs: Any) -> AtomicRedisStreamBroker:
        kwargs.setdefault("xread_block", 200)
        broker = AtomicRedisStreamBroker(server.url, **kwargs)
        await broker.startup()
        started.append(broker)
        return broker

    yield make
    for broker in started:
        await broker.atomic.heartbeat.stop()
        await broker.shutdown()


async def orphan(redis: Redis, stream: str, count: int) -> None:
    """``count`` entries read by a consumer that died a day ago."""
    await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for number in range(count):
        await redis.xadd(stream, {"data": f"{stream}-{number}".encode()})
    read: Any = await redis.xreadgroup(GROUP, "dead", {stream: ">"}, count=count)
    ids = [entry_id for entry_id, _ in read[0][1]]
    await redis.xclaim(stream, GROUP, "dead", 0, ids, idle=DAY_MS, justid=True)


async def script_calls(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
        for name in ("fcall", "evalsha")
    )


async def take(
    listener: AsyncGenerator[AckableMessage, None], count: int, within_s: float
) -> list[AckableMessage]:
    """Up to ``count`` messages, acked, or fewer if ``within_s`` runs out."""
    taken: list[AckableMessage] = []

    async def pull() -> None:
        while len(taken) < count:
            message = await listener.__anext__()
            taken.append(message)
            await maybe_awaitable(message.ack())

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(pull(), within_s)
    return taken


def test_the_default_claim_interval_scales_with_idle_timeout() -> None:
    settings = ClaimSettings.from_broker_arguments(600_000, None, 100, None)
    assert settings.claim_interval == 150_000
    # Non-holders come back while a holder's death still leaves the next
    # holder time to claim within idle_timeout + claim_interval.
    assert settings.lease + settings.skip_wait <= settings.idle_timeout


async def test_one_script_call_claims_every_stream(
    make_broker: Any, redis: Redis
) -> None:
    for stream in ("one", "two", "three"):
        await orphan(redis, stream, 2)
    broker = await make_broker(
        queue_name="one",
        additional_streams={"two": ">", "three": ">"},
        consumer_name="live",
    )
    async with broker.atomic.connection.connect() as client:
        await broker.atomic.scripts.load(client)
        before = await script_calls(redis)
        batch = await broker.atomic.claims.claim_all(client)
    assert await script_calls(redis) == before + 1
    assert sorted({stream for stream, _, _ in batch}) == ["one", "three", "two"]
    assert len(batch) == 6


async def test_a_claimer_with_a_full_batch_claims_again_before_the_interval(
    make_broker: Any, redis: Redis
) -> None:
    await orphan(redis, "jobs", 30)
    # One claim per minute, ten entries per claim: only claiming again at
    # once after a full batch gets all 30 within the test's bound.
    broker = await make_broker(
        queue_name="jobs",
        idle_timeout=120_000,
        claim_interval=60_000,
        unacknowledged_batch_size=10,
        consumer_name="live",
    )
    taken = await take(broker.listen(), 30, within_s=20)
    assert len(taken) == 30


async def test_claims_never_exceed_what_the_worker_reads_at_once(
    make_broker: Any, redis: Redis
) -> None:
    await orphan(redis, "jobs", 40)
    broker = await make_broker(
        queue_name="jobs",
        idle_timeout=120_000,
        unacknowledged_batch_size=100,
        xread_count=5,
        consumer_name="live",
    )
    listener = broker.listen()
    held = []
    for _ in range(12):
        message = await asyncio.wait_for(listener.__anext__(), 10)
        # Held: delivered by claims and not yet acked, this one included.
        held.append(len(broker.atomic.in_flight))
        await maybe_awaitable(message.ack())
    assert max(held) <= 5
    assert (
        await redis.xpending(  # the rest waits for whoever has room
            "jobs", GROUP
        )
        and (await redis.xpending("jobs", GROUP))["pending"] >= 40 - 12 - 5
    )


async def test_two_workers_share_a_mass_recovery(
    make_broker: Any, redis: Redis
) -> None:
    await orphan(redis, "jobs", 60)
    # The fleet's gate lets one worker look; its full batch opens the gate,
    # so the other joins at its next try (within two claim intervals).
    workers = [
        await make_broker(
            queue_name="jobs",
            idle_timeout=120_000,
            claim_interval=500,
            xread_count=5,
            consumer_name=name,
        )
        for name in ("a", "b")
    ]

    async def work(broker: AtomicRedisStreamBroker) -> int:
        done = 0
        listener = broker.listen()
        while await redis.xpending("jobs", GROUP) and done < 60:
            try:
                message = await asyncio.wait_for(listener.__anext__(), 2)
            except asyncio.TimeoutError:
                break
            await asyncio.sleep(0.01)  # the task runs
            await maybe_awaitable(message.ack())
            done += 1
            if (await redis.xpending("jobs", GROUP))["pending"] == 0:
                break
        return done

    done = await asyncio.wait_for(asyncio.gather(*map(work, workers)), 60)
    assert sum(done) == 60
    assert min(done) > 0


async def test_a_non_holder_makes_no_claim_while_the_lease_it_was_told_of_lives(
    make_broker: Any, redis: Redis
) -> None:
    await redis.xgroup_create("jobs", GROUP, id="0", mkstream=True)
    holder = await make_broker(
        queue_name="jobs",
        idle_timeout=60_000,
        claim_interval=100,
        unacknowledged_lock_timeout=30,
        consumer_name="holder",
    )
    async with holder.atomic.connection.connect() as client:
        assert not (await holder.atomic.claims.claim(client, "jobs")).skipped
    # Idle since, so the fleet's check sends the claim.
    lost = await redis.xadd("jobs", {"data": b"orphan"})
    await redis.xreadgroup(GROUP, "dead", {"jobs": ">"})
    await redis.xclaim("jobs", GROUP, "dead", 0, [lost], idle=DAY_MS, justid=True)
    other = await make_broker(
        queue_name="jobs",
        idle_timeout=60_000,
        claim_interval=100,
        unacknowledged_lock_timeout=30,
        consumer_name="other",
    )
    # Ten claim intervals of listening: one claim, told of 30 s of lease
    # (the broker's own count of claims skipped for a lease: its script
    # calls include the stream trim's too).
    assert await take(other.listen(), 1, within_s=1.0) == []
    assert other.metrics.snapshot()["lease_skips"] == 1


async def test_a_worker_holding_nothing_claims_what_one_read_takes(
    make_broker: Any, redis: Redis
) -> None:
    # As the read that reclaims on Redis >= 8.4 does: a fast drain must not
    # pay a claim call per few entries.
    await orphan(redis, "jobs", 40)
    broker = await make_broker(
        queue_name="jobs", idle_timeout=120_000, xread_count=25, consumer_name="live"
    )
    listener = broker.listen()
    message = await asyncio.wait_for(listener.__anext__(), 10)
    assert len(broker.atomic.in_flight) == 25
    await maybe_awaitable(message.ack())


async def test_a_scan_cut_short_goes_on_before_the_interval(
    make_broker: Any, redis: Redis
) -> None:
    # 250 entries a live worker runs (not idle), then one orphan: with ten
    # per claim XAUTOCLAIM scans 100 PEL entries a call, so only going on at
    # once reaches the orphan before the next claim interval (a minute).
    await redis.xgroup_create("jobs", GROUP, id="0", mkstream=True)
    for number in range(250):
        await redis.xadd("jobs", {"data": f"busy-{number}".encode()})
    await redis.xreadgroup(GROUP, "busy", {"jobs": ">"}, count=250)
    lost = await redis.xadd("jobs", {"data": b"orphan"})
    await redis.xreadgroup(GROUP, "dead", {"jobs": ">"}, count=1)
    await redis.xclaim("jobs", GROUP, "dead", 0, [lost], idle=DAY_MS, justid=True)
    broker = await make_broker(
        queue_name="jobs",
        idle_timeout=120_000,
        claim_interval=60_000,
        unacknowledged_batch_size=10,
        consumer_name="live",
    )
    taken = await take(broker.listen(), 1, within_s=20)
    assert [message.data for message in taken] == [b"orphan"]


async def test_an_idle_fleet_looks_once_per_interval_and_claims_nothing(
    make_broker: Any, redis: Redis
) -> None:
    """One consumer of the fleet looks each claim interval (the gate), with a
    plain XPENDING: no claim script runs while nothing is idle, however
    many workers listen."""
    await redis.xgroup_create("jobs", GROUP, id="0", mkstream=True)
    brokers = [
        await make_broker(
            queue_name="jobs",
            idle_timeout=4000,
            claim_interval=500,
            consumer_name=f"w{number}",
        )
        for number in range(4)
    ]
    await redis.config_resetstat()
    listening = [take(broker.listen(), 1, within_s=2.0) for broker in brokers]
    assert await asyncio.gather(*listening) == [[]] * 4
    stats = await redis.info("commandstats")
    assert "cmdstat_xautoclaim" not in stats
    # Four looks in 2 s (one per interval, fleet-wide) and the trims' own:
    # without the gate each worker would look each interval (16).
    assert stats.get("cmdstat_xpending", {"calls": 0})["calls"] <= 10
