"""Server gauges read through each broker's own connection: on a real Redis
Cluster the worker's client is ``SlotRoutedClient``, not redis-py's
``Redis``, and the gauges must still move. And a reading that fails in a
way nobody foresaw is logged once and retried, not the end of the gauges.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis, RedisCluster

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.gauges import PREFIX, ServerGauges
from taskiq_atomic_claim.keys import StreamKeys
from tests.conftest import Server
from tests.test_oom import until
from tests.topologies import LocalCluster, binary_for, message, need

GROUP = "taskiq"


def gauge(name: str, stream: str) -> float | None:
    return REGISTRY.get_sample_value(PREFIX + name, {"stream": stream, "group": GROUP})


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # No replicas: nothing here fails over, and three nodes start faster.
    with LocalCluster(need(binary_for(7), "Redis 7"), replicas=0) as started:
        yield started


async def test_a_cluster_worker_reads_its_gauges(cluster: LocalCluster) -> None:
    queue = f"taskiq-atomic-claim-cluster-gauges-{uuid.uuid4().hex[:8]}"
    broker = AtomicRedisStreamClusterBroker(cluster.url, queue_name=queue)
    broker.add_middlewares(ServerGauges(interval=0.2))
    broker.is_worker_process = True  # as `taskiq worker` sets it
    reader = RedisCluster.from_url(cluster.url)
    try:
        await broker.startup()
        await broker.kick(message("held", queue))
        # A consumer takes the entry and never acks it: one pending.
        await reader.xreadgroup(GROUP, "holder", {queue: ">"}, count=1)
        await reader.xadd(StreamKeys(queue, GROUP).dead_letters, {"data": b"{}"})
        moved = await until(
            lambda: gauge("pending", queue) == 1 and gauge("dead_letters", queue) == 1,
            30,
        )
        assert moved, {
            name: gauge(name, queue)
            for name in ("stream_length", "pending", "consumers", "dead_letters")
        }
        assert gauge("stream_length", queue) == 1
        assert gauge("consumers", queue) == 1
        age = gauge("oldest_pending_age_seconds", queue)
        assert age is not None and age >= 0
        assert gauge("lag", queue) == 0
    finally:
        await broker.shutdown()
        await reader.delete(queue, StreamKeys(queue, GROUP).dead_letters)
        await reader.aclose()


class FailingFirst(ServerGauges):
    """Readings fail, twice the same unforeseen way, before the server's."""

    def __init__(self) -> None:
        super().__init__(interval=0.05)
        self.failures = 2

    async def refresh(self) -> None:
        if self.failures:
            self.failures -= 1
            raise ValueError("a reply no parser expected")
        await super().refresh()


async def test_an_unforeseen_failure_is_logged_once_and_retried(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    queue = f"taskiq-atomic-claim-gauges-fail-{uuid.uuid4().hex[:8]}"
    broker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    middleware = FailingFirst()
    broker.add_middlewares(middleware)
    broker.is_worker_process = True
    caplog.set_level(logging.WARNING, logger="taskiq.atomic_claim")
    try:
        await broker.startup()
        await broker.kick(message("held", queue))
        assert await until(lambda: gauge("stream_length", queue) == 1, 30)
    finally:
        await broker.shutdown()
        await redis.delete(queue)
    lines = [r.getMessage() for r in caplog.records]
    lines = [line for line in lines if "server gauges" in line]
    assert lines == [
        "server gauges not read: ValueError: a reply no parser expected",
        "server gauges read again",
    ]
