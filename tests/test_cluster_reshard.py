"""A hash slot moving between primaries (a reshard) under a listening
worker, on a real local Redis Cluster of the Redis 7 binary.

While a slot migrates, the source refuses a call whose keys it holds only
some of (TRYAGAIN) and redirects what it lacks to the target (ASK), where a
call whose keys are not all there is refused too: the claim and ack scripts,
whose lease, cursor and start keys mostly do not exist, are refused until
the slot has moved. Reads, heartbeats and start records (one key each) go on.
Nothing of that may end ``listen()``, drop an ack, or run a task twice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis.crc import key_slot

from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from tests.test_cluster import pending
from tests.topologies import (
    ClusterNode,
    Consumer,
    LocalCluster,
    StartedBrokers,
    binary_for,
    bounded,
    message,
    need,
    unexpiring_keys,
)

REDIS_7 = binary_for(7)
IDLE_MS, INTERVAL_MS = 1000, 200


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # No replicas: a reshard moves slots between primaries only.
    with LocalCluster(need(REDIS_7, "Redis 7"), replicas=0) as started:
        yield started


@pytest.fixture
async def brokers() -> AsyncIterator[StartedBrokers]:
    async with StartedBrokers() as started:
        yield started


def other_primary(cluster: LocalCluster, node: ClusterNode) -> ClusterNode:
    return next(primary for primary in cluster.primaries if primary is not node)


async def kick(broker: Any, stream: str, tag: str, count: int) -> set[str]:
    bodies = {f"{stream}/{tag}-{number}" for number in range(count)}
    for body in sorted(bodies):
        await broker.kick(message(body, stream))
    return bodies


async def drained(
    broker: AtomicRedisStreamClusterBroker, stream: str, timeout: float
) -> float | None:
    """When the group's PEL emptied, or None after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pending(broker, stream) == 0:
            return time.monotonic()
        await asyncio.sleep(0.05)
    return None


@bounded(60)
async def test_a_slot_left_migrating_stops_no_listen_and_drops_no_ack(
    cluster: LocalCluster, brokers: StartedBrokers
) -> None:
    stream = f"stalled-{uuid.uuid4().hex[:8]}"
    slot = key_slot(stream.encode())
    source = cluster.node_for(stream)
    target = other_primary(cluster, source)
    broker = await brokers.start(
        AtomicRedisStreamClusterBroker(
            cluster.url,
            queue_name=stream,
            consumer_name="only",
            consumer_id="0",
            idle_timeout=IDLE_MS,
            claim_interval=INTERVAL_MS,
            xread_block=500,
        )
    )
    # Each task's start is recorded, as under taskiq's receiver: the start
    # hash is one more key of the ack that may sit on either node.
    consumer = Consumer(broker, start=True, detached_acks=True)
    assert await consumer.wait_for(await kick(broker, stream, "before", 5), 10)

    cluster.begin_migration(slot, source, target)
    migrating = time.monotonic()
    during = await kick(broker, stream, "during", 20)
    # Reads go on while the slot migrates; claims and most acks are refused
    # all along, held well past the acks' patience (idle_timeout / 2).
    delivered = await consumer.wait_for(during, 3.0)
    assert delivered is not None, sorted(during - set(consumer.bodies))
    await asyncio.sleep(max(0.0, migrating + 3.0 - time.monotonic()))
    assert not consumer.task.done()
    assert await pending(broker, stream) > 0
    moved = await asyncio.to_thread(cluster.migrate_keys, slot, source, target)
    cluster.finish_migration(slot, target)
    finished = time.monotonic()

    acked = await drained(broker, stream, 15)
    assert acked is not None
    after = await kick(broker, stream, "after", 5)
    assert await consumer.wait_for(after, 10)
    # Two idle timeouts and claim cycles: an entry whose ack was dropped
    # during the migration would be reclaimed and delivered again by now.
    await asyncio.sleep(2 * (IDLE_MS + INTERVAL_MS) / 1000)
    await consumer.stop()
    twice = sorted({b for b in consumer.bodies if consumer.bodies.count(b) > 1})
    print(
        f"\nslot migrating 3 s: {len(during)} entries kicked during it delivered"
        f" {delivered - migrating:.2f} s in; {moved} keys moved; all acked"
        f" {acked - finished:.2f} s after it ended; run twice: {twice}"
    )
    assert twice == []
    assert await pending(broker, stream) == 0
    assert unexpiring_keys([node.port for node in cluster.primaries]) == []
