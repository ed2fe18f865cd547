"""Bad configuration is refused at construction, before any connection; the
bounds are exactly what real servers accept."""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.sentinel_broker import AtomicRedisStreamSentinelBroker
from taskiq_atomic_claim.settings import (
    MAX_EXPIRY_MS,
    MAX_IDLE_TIMEOUT_MS,
    MAX_REDIS_INT,
    is_stream_id,
)
from tests.conftest import Server

# Nothing listens here: a check that connected would fail differently.
NOWHERE = "redis://127.0.0.1:1"

REFUSED = [
    ({"additional_streams": {"x": "not-an-id"}}, "additional_streams['x']"),
    ({"additional_streams": {"x": "$"}}, "additional_streams['x']"),
    ({"additional_streams": {"x": -1}}, "additional_streams['x']"),
    ({"consumer_id": "not-an-id"}, "consumer_id"),
    ({"consumer_id": ">"}, "consumer_id"),
    ({"consumer_id": "1-2-3"}, "consumer_id"),
    ({"consumer_id": str(2**64)}, "consumer_id"),
    ({"idle_timeout": 2**63}, "idle_timeout"),
    ({"idle_timeout": MAX_IDLE_TIMEOUT_MS + 1}, "idle_timeout"),
    ({"unacknowledged_lock_timeout": 1e16}, "unacknowledged_lock_timeout"),
    ({"unacknowledged_lock_timeout": float("nan")}, "unacknowledged_lock_timeout"),
    ({"xread_count": 10**30}, "xread_count"),
    ({"xread_count": MAX_REDIS_INT + 1}, "xread_count"),
    ({"maxlen": MAX_REDIS_INT + 1}, "maxlen"),
    # Default xread_block 2000 ms (claim interval idle_timeout / 4): reads block 2 s.
    ({"socket_timeout": 1}, "socket_timeout"),
    # At defaults a read blocks up to claim_interval, 1250 ms.
    ({"socket_timeout": 1.75}, "socket_timeout"),
    ({"socket_timeout": 0.3, "claim_interval": 200}, "socket_timeout"),
    ({"socket_timeout": "5"}, "socket_timeout"),
]


@pytest.mark.parametrize(("kwargs", "parameter"), REFUSED)
def test_bad_configuration_is_refused_naming_the_parameter(
    kwargs: dict[str, Any], parameter: str
) -> None:
    with pytest.raises(ValueError, match=r"must be") as raised:
        AtomicRedisStreamBroker(NOWHERE, **kwargs)
    assert str(raised.value).startswith(parameter), raised.value


@pytest.mark.parametrize(("kwargs", "parameter"), REFUSED)
def test_cluster_and_sentinel_brokers_refuse_the_same(
    kwargs: dict[str, Any], parameter: str
) -> None:
    with pytest.raises(ValueError, match=r"must be"):
        AtomicRedisStreamClusterBroker(NOWHERE, **kwargs)
    with pytest.raises(ValueError, match=r"must be"):
        AtomicRedisStreamSentinelBroker([("127.0.0.1", 1)], "mymaster", **kwargs)


def test_consumers_are_named_by_host_and_process_unless_named() -> None:
    host, pid = re.escape(socket.gethostname()), os.getpid()
    for make in (
        lambda **kw: AtomicRedisStreamBroker(NOWHERE, **kw),
        lambda **kw: AtomicRedisStreamClusterBroker(NOWHERE, **kw),
        lambda **kw: AtomicRedisStreamSentinelBroker([("127.0.0.1", 1)], "m", **kw),
    ):
        first, second = make().consumer_name, make().consumer_name
        assert re.fullmatch(rf"{host}-{pid}-[0-9a-f]{{6}}", first), first
        assert first != second
        assert make(consumer_name="worker-1").consumer_name == "worker-1"


def test_socket_timeout_above_the_longest_read_is_accepted() -> None:
    AtomicRedisStreamBroker(NOWHERE, socket_timeout=1.8)
    AtomicRedisStreamBroker(NOWHERE, socket_timeout=0.65, claim_interval=100)
    AtomicRedisStreamBroker(NOWHERE, socket_timeout=0.65, xread_block=100)


def test_idle_timeout_below_a_second_warns_about_the_unit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="taskiq.atomic_claim"):
        AtomicRedisStreamBroker(NOWHERE, idle_timeout=60)
    assert "idle_timeout=60 is in milliseconds" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="taskiq.atomic_claim"):
        AtomicRedisStreamBroker(NOWHERE, idle_timeout=1000)
    assert "milliseconds" not in caplog.text


CANDIDATE_IDS: list[str | int] = [
    "0",
    "0-0",
    "5",
    "5-1",
    "1700000000000-3",
    str(2**64 - 1),
    f"{2**64 - 1}-{2**64 - 1}",
    str(2**64),
    f"1-{2**64}",
    ">",
    "-",
    "+",
    "*",
    "5-*",
    "1.5",
    "",
    "not-an-id",
    "1-2-3",
    7,
]


async def test_start_ids_accepted_are_exactly_what_the_server_accepts(
    redis: Redis,
) -> None:
    await redis.xadd("s", {"a": "1"})
    for candidate in CANDIDATE_IDS:
        try:
            await redis.xgroup_create("s", "g", id=candidate)
        except ResponseError:
            server_accepts = False
        else:
            server_accepts = True
            await redis.xgroup_destroy("s", "g")
        assert is_stream_id(candidate) == server_accepts, candidate


async def test_the_largest_accepted_values_work_on_the_server(
    server: Server, redis: Redis
) -> None:
    """Upper bounds come from the server: at each bound a real claim cycle,
    lease and cursor included, and a read succeed."""
    broker = AtomicRedisStreamBroker(
        server.url,
        idle_timeout=MAX_IDLE_TIMEOUT_MS,
        claim_interval=MAX_IDLE_TIMEOUT_MS - 1,
        unacknowledged_lock_timeout=MAX_EXPIRY_MS // 1000,
        xread_count=MAX_REDIS_INT,
        maxlen=MAX_REDIS_INT,
        consumer_id=str(2**64 - 1),
        additional_streams={"extra": ">"},
    )
    await broker.startup()
    try:
        async with Redis(connection_pool=broker.connection_pool) as client:
            # The cursor's TTL is the largest PX the broker ever sends.
            assert broker.atomic.settings.cursor_ttl <= MAX_EXPIRY_MS
            for stream in broker.atomic.streams:
                outcome = await broker.atomic.claims.claim(client, stream)
                assert not outcome.skipped
            await broker.atomic.reads.read(client, {"extra": ">"}, next_claim=0)
            assert await redis.pttl(next(iter(await redis.keys("*lease*")))) > 0
    finally:
        await broker.shutdown()
