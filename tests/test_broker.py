"""AtomicRedisStreamBroker against real servers: the parent's behaviours and reclaim."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq import AckableMessage
from taskiq.message import BrokerMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from tests.conftest import Server

IDLE_MS, INTERVAL_MS = 400, 100


def message(body: str, queue: str | None = None) -> BrokerMessage:
    labels = {"queue_name": queue} if queue else {}
    return BrokerMessage(
        task_id=body, task_name="t", message=body.encode(), labels=labels
    )


@pytest.fixture
async def make_broker(server: Server, redis: Redis) -> AsyncIterator[Any]:
    started: list[AtomicRedisStreamBroker] = []

    async def make(**kwargs: Any) -> AtomicRedisStreamBroker:
        kwargs.setdefault("idle_timeout", IDLE_MS)
        kwargs.setdefault("claim_interval", INTERVAL_MS)
        kwargs.setdefault("xread_block", 200)
        broker = AtomicRedisStreamBroker(server.url, **kwargs)
        await broker.startup()
        started.append(broker)
        return broker

    yield make
    for broker in started:
        await broker.shutdown()


async def die(broker: AtomicRedisStreamBroker, listener: Any) -> None:
    """What SIGKILL does in-process: no more reads, no more heartbeats, no ack."""
    await listener.aclose()
    await broker.atomic.heartbeat.stop()


async def receive(
    listener: AsyncGenerator[AckableMessage, None], timeout: float
) -> AckableMessage | None:
    try:
        return await asyncio.wait_for(listener.__anext__(), timeout)
    except asyncio.TimeoutError:
        return None


async def test_one_of_two_listeners_gets_a_message(make_broker: Any) -> None:
    first = await make_broker(consumer_name="first")
    second = await make_broker(consumer_name="second")
    listeners = [first.listen(), second.listen()]
    waits = [asyncio.ensure_future(listener.__anext__()) for listener in listeners]
    await asyncio.sleep(0.1)
    await first.kick(message("only-once"))
    done, pending = await asyncio.wait(
        waits, timeout=2, return_when=asyncio.FIRST_COMPLETED
    )
    assert len(done) == 1
    received = done.pop().result()
    assert received.data == b"only-once"
    await maybe_awaitable(received.ack())
    # Acked at once, so the other listener has nothing to read or reclaim
    # for longer than idle_timeout plus a claim cycle.
    done, pending = await asyncio.wait(pending, timeout=(IDLE_MS + INTERVAL_MS) / 500)
    assert not done
    for listener_wait in pending:
        listener_wait.cancel()


async def test_maxlen_trims_only_what_the_group_acked(
    make_broker: Any, redis: Redis, server: Server
) -> None:
    broker = await make_broker(maxlen=5, approximate=False)
    for number in range(10):
        await broker.kick(message(f"m{number}"))
    if not server.info.acked_trimming:
        # MAXLEN here would trim unread entries: not sent (the workers' trim
        # bounds the stream instead).
        assert await redis.xlen(broker.queue_name) == 10
        return
    # Redis >= 8.2 (MAXLEN ... ACKED): only what the group acked goes.
    assert await redis.xlen(broker.queue_name) == 10
    listener = broker.listen()
    for _ in range(10):
        received = await receive(listener, 2)
        assert received is not None
        await maybe_awaitable(received.ack())
    await broker.kick(message("after"))
    assert await redis.xlen(broker.queue_name) == 5


async def test_ack_removes_the_message_from_the_pel(
    make_broker: Any, redis: Redis
) -> None:
    broker = await make_broker()
    await broker.kick(message("ack-me"))
    received = await receive(broker.listen(), 2)
    assert received is not None
    assert (await redis.xpending(broker.queue_name, "taskiq"))["pending"] == 1
    await maybe_awaitable(received.ack())
    assert (await redis.xpending(broker.queue_name, "taskiq"))["pending"] == 0


async def test_idle_queue_reclaims_a_dead_consumers_message(
    make_broker: Any, redis: Redis
) -> None:
    dead = await make_broker(consumer_name="dead")
    alive = await make_broker(consumer_name="alive")
    await dead.kick(message("orphan"))
    # No later than the delivery, whose idle time the claim waits out
    # (taken after die(), a slow stop made a correct claim look early).
    kicked = time.monotonic()
    dead_listener = dead.listen()
    assert await receive(dead_listener, 2) is not None
    await die(dead, dead_listener)

    reclaimed = await receive(alive.listen(), (IDLE_MS + INTERVAL_MS) / 1000 + 2)
    assert reclaimed is not None, "an idle queue must still reclaim"
    assert reclaimed.data == b"orphan"
    assert time.monotonic() - kicked >= IDLE_MS / 1000
    assert alive.metrics.snapshot()["claimed"] == 1
    await maybe_awaitable(reclaimed.ack())
    assert (await redis.xpending(alive.queue_name, "taskiq"))["pending"] == 0


async def test_additional_streams_are_reclaimed_too(
    make_broker: Any, redis: Redis
) -> None:
    streams = {"extra": ">"}
    dead = await make_broker(consumer_name="dead", additional_streams=streams)
    alive = await make_broker(consumer_name="alive", additional_streams=streams)
    await dead.kick(message("side", queue="extra"))
    dead_listener = dead.listen()
    assert await receive(dead_listener, 2) is not None
    await die(dead, dead_listener)

    reclaimed = await receive(alive.listen(), (IDLE_MS + INTERVAL_MS) / 1000 + 2)
    assert reclaimed is not None
    assert reclaimed.data == b"side"
    await maybe_awaitable(reclaimed.ack())
    assert (await redis.xpending("extra", "taskiq"))["pending"] == 0


async def test_a_leftover_taskiq_redis_lock_does_not_block_reclaim(
    make_broker: Any, redis: Redis, planted_keys: set[str]
) -> None:
    # What taskiq-redis 1.1.2 leaves when killed inside its autoclaim lock.
    legacy = "autoclaim:taskiq:taskiq"
    await redis.set(legacy, "token-of-a-dead-worker")
    planted_keys.add(legacy)
    dead = await make_broker(consumer_name="dead")
    alive = await make_broker(consumer_name="alive")
    await dead.kick(message("still-recovered"))
    dead_listener = dead.listen()
    assert await receive(dead_listener, 2) is not None
    await die(dead, dead_listener)

    reclaimed = await receive(alive.listen(), (IDLE_MS + INTERVAL_MS) / 1000 + 2)
    assert reclaimed is not None
    assert reclaimed.data == b"still-recovered"
    await maybe_awaitable(reclaimed.ack())
    assert await redis.pttl(legacy) == -1, "a foreign key is left as it was"


async def test_busy_worker_keeps_its_message_until_idle_timeout(
    make_broker: Any,
) -> None:
    owner = await make_broker(consumer_name="owner", idle_timeout=5_000)
    other = await make_broker(consumer_name="other", idle_timeout=5_000)
    await owner.kick(message("mine"))
    received = await receive(owner.listen(), 2)
    assert received is not None
    assert await receive(other.listen(), 1.0) is None
    await maybe_awaitable(received.ack())


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("idle_timeout", 0),
        ("idle_timeout", -5),
        ("idle_timeout", 1.5),
        ("claim_interval", 0),
        ("claim_interval", 400),
        ("claim_interval", 10_000),
        ("unacknowledged_batch_size", 0),
        ("unacknowledged_batch_size", 10_001),
        ("unacknowledged_lock_timeout", 0),
        ("unacknowledged_lock_timeout", -1.0),
        ("unacknowledged_lock_timeout", float("nan")),
        ("xread_block", -1),
        ("xread_count", 0),
        ("maxlen", 0),
        ("queue_name", ""),
        ("consumer_group_name", ""),
        ("consumer_name", ""),
        ("additional_streams", ["extra"]),
    ],
)
def test_bad_settings_raise_value_error_naming_the_parameter(
    argument: str, value: object
) -> None:
    kwargs: dict[str, Any] = {"idle_timeout": IDLE_MS, argument: value}
    with pytest.raises(ValueError, match=argument):
        AtomicRedisStreamBroker("redis://127.0.0.1:1", **kwargs)


async def test_a_lease_kept_from_taskiq_redis_does_not_stretch_the_rerun_bound(
    make_broker: Any,
) -> None:
    # unacknowledged_lock_timeout=60 (seconds, taskiq-redis's unit) with a
    # 400 ms idle_timeout: the worker holding the lease dies, and another
    # re-runs its tasks within idle_timeout + claim_interval, not 60 s.
    holder = await make_broker(consumer_name="holder", unacknowledged_lock_timeout=60)
    rival = await make_broker(consumer_name="rival", unacknowledged_lock_timeout=60)
    for number in range(3):
        await holder.kick(message(f"m{number}"))
    listener = holder.listen()
    assert [await receive(listener, 2) for _ in range(3)] != [None] * 3
    await die(holder, listener)
    died = time.monotonic()
    rival_listener = rival.listen()
    reran: list[AckableMessage] = []
    while len(reran) < 3:
        delivered = await receive(rival_listener, died + 5 - time.monotonic())
        if delivered is None:
            break
        reran.append(delivered)
    took = time.monotonic() - died
    print(f"\nlease kept at 60 s: {len(reran)} re-run {took:.2f} s after the kill")
    assert len(reran) == 3
    assert took <= (IDLE_MS + INTERVAL_MS) / 1000 + 1.0


def test_a_lease_longer_than_idle_timeout_is_cut_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "taskiq.atomic_claim"):
        broker = AtomicRedisStreamBroker(
            "redis://127.0.0.1:1",
            idle_timeout=3000,
            claim_interval=750,
            unacknowledged_lock_timeout=60,
        )
    assert broker.atomic.settings.lease == 3000
    [warning] = caplog.records
    assert "unacknowledged_lock_timeout" in warning.message
    assert "idle_timeout + claim_interval (3.75 s)" in warning.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, "taskiq.atomic_claim"):
        within = AtomicRedisStreamBroker(
            "redis://127.0.0.1:1", idle_timeout=3000, unacknowledged_lock_timeout=3
        )
    assert within.atomic.settings.lease == 3000
    assert caplog.records == []


def test_defaults_follow_the_parent_but_idle_timeout() -> None:
    # idle_timeout keeps its meaning and unit; its default is 5 s, not
    # taskiq-redis's 10 min (a thread keeps a live process's entries).
    broker = AtomicRedisStreamBroker("redis://127.0.0.1:1")
    assert broker.idle_timeout == 5000
    assert broker.atomic.settings.claim_interval == 1250
    assert broker.atomic.settings.lease == 1250
    assert broker.unacknowledged_batch_size == 100
    short = AtomicRedisStreamBroker("redis://127.0.0.1:1", idle_timeout=1_000)
    assert short.atomic.settings.claim_interval == 250
    lock = AtomicRedisStreamBroker(
        "redis://127.0.0.1:1", unacknowledged_lock_timeout=2.5
    )
    assert lock.atomic.settings.lease == 2_500
