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
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ResponseError
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.cluster_client import SlotRoutedClient
from taskiq_atomic_claim.harness.drill_app import events_stream
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_errors import describe, is_outage
from tests.receiver import start_as_the_receiver_does
from tests.test_cluster import drill_env, pending
from tests.topologies import (
    HOST,
    ClusterNode,
    Consumer,
    DrillWorkers,
    EventLog,
    LocalCluster,
    StartedBrokers,
    binary_for,
    bounded,
    message,
    need,
    unexpiring_keys,
)
from tests.topology_app import TASK_NAME

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


def orphan_on(node: ClusterNode, stream: str, body: str) -> str:
    """An entry read by a consumer that then died (one step: no live
    consumer reads it first)."""
    with SyncRedis(host=HOST, port=node.port) as client:
        pipe = client.pipeline(transaction=True)
        pipe.xadd(stream, {"data": body})
        pipe.xreadgroup("taskiq", "ghost", {stream: ">"}, count=1)
        pipe.execute()
    return body


class MovingSlot(NamedTuple):
    """A fresh stream, its slot, the slot's primary and the one it is to move
    to, and a started broker consuming the stream."""

    stream: str
    slot: int
    source: ClusterNode
    target: ClusterNode
    broker: AtomicRedisStreamClusterBroker

    @classmethod
    async def start(
        cls, cluster: LocalCluster, brokers: StartedBrokers, prefix: str
    ) -> MovingSlot:
        stream = f"{prefix}-{uuid.uuid4().hex[:8]}"
        source = cluster.node_for(stream)
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
        target = other_primary(cluster, source)
        return cls(stream, key_slot(stream.encode()), source, target, broker)


def kick_asking(target: ClusterNode, stream: str, tag: str, count: int) -> set[str]:
    """Kicks sent to the migration's target, each after ASKING on the same
    connection, as an ASK redirection is followed."""
    bodies = {f"{stream}/{tag}-{number}" for number in range(count)}
    with SyncRedis(host=HOST, port=target.port) as client:
        for body in sorted(bodies):
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.xadd(stream, {"data": body})
            pipe.execute()
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


@bounded(30)
async def test_reads_and_script_calls_follow_an_ask_on_one_connection(
    cluster: LocalCluster,
) -> None:
    # The stream moved, its slot not handed over yet: the source answers
    # ASK. redis-py sends ASKING on one pooled connection and the command on
    # the next; with two idle connections to the target, never the same one.
    stream = f"asked-{uuid.uuid4().hex[:8]}"
    slot = key_slot(stream.encode())
    source = cluster.node_for(stream)
    target = other_primary(cluster, source)
    redis = RedisCluster.from_url(cluster.url, reinitialize_steps=0)
    client = SlotRoutedClient(redis)
    try:
        await redis.xgroup_create(stream, "g", id="0", mkstream=True)
        entry_id = await redis.xadd(stream, {"data": "x"})
        cluster.begin_migration(slot, source, target)
        assert cluster.migrate_keys(slot, source, target) == 1
        node = redis.get_node(host=HOST, port=target.port)
        assert node is not None
        await asyncio.gather(
            *(redis.execute_command("PING", target_nodes=node) for _ in range(2))
        )
        read = await client.xreadgroup("g", "c", {stream: ">"}, count=10)
        assert [[entry[0] for entry in entries] for _, entries in read] == [[entry_id]]
        pending_count = "return redis.call('XPENDING', KEYS[1], ARGV[1])[1]"
        assert await client.execute_command("EVAL", pending_count, 1, stream, "g") == 1
    finally:
        cluster.finish_migration(slot, target)
        await redis.aclose()


@bounded(60)
async def test_a_slot_left_migrating_stops_no_listen_and_drops_no_ack(
    cluster: LocalCluster, brokers: StartedBrokers, caplog: pytest.LogCaptureFixture
) -> None:
    moving = await MovingSlot.start(cluster, brokers, "stalled")
    stream, slot, source, target, broker = moving
    # Each task's start is recorded, as under taskiq's receiver: the start
    # hash is one more key of the ack.
    consumer = Consumer(broker, start=True, detached_acks=True)
    assert await consumer.wait_for(await kick(broker, stream, "before", 5), 10)
    # A dead consumer's entry, idle within the migration: the fleet's look
    # finds it, so a claim meets the migrating slot.
    ghost = orphan_on(source, stream, f"{stream}/ghost")

    cluster.begin_migration(slot, source, target)
    migrating = time.monotonic()
    during = await kick(broker, stream, "during", 20)
    # Reads go on while the slot migrates, held well past the acks' patience
    # (idle_timeout / 2). Claims are refused all along (their lease and
    # cursor keys are on neither node); acks land, as every key they touch,
    # the stream and the started hash (which outlives its counts), is still
    # on the source.
    delivered = await consumer.wait_for(during, 3.0)
    assert delivered is not None, sorted(during - set(consumer.bodies))
    await asyncio.sleep(max(0.0, migrating + 3.0 - time.monotonic()))
    assert not consumer.task.done()
    assert any("hash slot migrating" in r.getMessage() for r in caplog.records)

    # The keys moved, the slot not yet handed over: the source answers ASK
    # for all of them (kicks here follow it as a cluster client should).
    moved = await asyncio.to_thread(cluster.migrate_keys, slot, source, target)
    keys_moved = time.monotonic()
    asked = kick_asking(target, stream, "asked", 10)
    asked_delivered = await consumer.wait_for(asked, 3.0)
    assert asked_delivered is not None, sorted(asked - set(consumer.bodies))
    # Two idle timeouts: heartbeats must reach the moved stream too.
    await asyncio.sleep(max(0.0, keys_moved + 2 * IDLE_MS / 1000 - time.monotonic()))
    assert not consumer.task.done()
    cluster.finish_migration(slot, target)
    finished = time.monotonic()

    acked = await drained(broker, stream, 15)
    assert acked is not None
    assert ghost in consumer.bodies
    after = await kick(broker, stream, "after", 5)
    assert await consumer.wait_for(after, 10)
    # Two idle timeouts and claim cycles: an entry whose ack was dropped
    # during the migration would be reclaimed and delivered again by now.
    await asyncio.sleep(2 * (IDLE_MS + INTERVAL_MS) / 1000)
    await consumer.stop()
    twice = sorted({b for b in consumer.bodies if consumer.bodies.count(b) > 1})
    print(
        f"\nslot migrating 3 s: {len(during)} entries kicked during it delivered"
        f" {delivered - migrating:.2f} s in; {moved} keys moved, then"
        f" {len(asked)} kicked delivered {asked_delivered - keys_moved:.2f} s"
        f" after; all acked {acked - finished:.2f} s after the slot moved;"
        f" run twice: {twice}"
    )
    assert twice == []
    assert await pending(broker, stream) == 0
    assert unexpiring_keys([node.port for node in cluster.primaries]) == []


async def blocked_read_on(node: ClusterNode, timeout: float) -> bool:
    """Whether an XREADGROUP blocks on ``node`` within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    with SyncRedis(host=HOST, port=node.port) as client:
        while time.monotonic() < deadline:
            clients = client.client_list()
            if any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in clients):
                return True
            await asyncio.sleep(0.02)
    return False


@bounded(60)
async def test_a_reshard_is_logged_in_our_words_once_each_way(
    cluster: LocalCluster, brokers: StartedBrokers, caplog: pytest.LogCaptureFixture
) -> None:
    # The stream's slot migrates and its keys move under a listening
    # consumer: claims are refused (one line each way), and a read blocked
    # on the stream when MIGRATE deletes it on the source is no lost group.
    caplog.set_level(logging.INFO, logger="taskiq.atomic_claim")
    moving = await MovingSlot.start(cluster, brokers, "worded")
    stream, slot, source, target, broker = moving
    consumer = Consumer(broker, start=True, detached_acks=True)
    assert await consumer.wait_for(await kick(broker, stream, "before", 3), 10)
    cluster.begin_migration(slot, source, target)
    try:
        assert await blocked_read_on(source, 5.0)
        await asyncio.to_thread(cluster.migrate_keys, slot, source, target)
        asked = kick_asking(target, stream, "asked", 4)
        assert await consumer.wait_for(asked, 5.0), sorted(asked)
    finally:
        cluster.finish_migration(slot, target)
    after = await kick(broker, stream, "after", 3)
    assert await consumer.wait_for(after, 10)
    assert await drained(broker, stream, 10) is not None
    await consumer.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "caused error" in line], lines
    assert not [line for line in lines if "is gone" in line], lines
    began = sum(f"Cannot claim on stream {stream!r}" in line for line in lines)
    ended = sum(f"Claiming on stream {stream!r} again" in line for line in lines)
    assert began == ended <= 1, lines


@bounded(30)
async def test_a_call_refused_in_a_transaction_is_named_in_our_words(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # A start record is a transaction; redis-py words a refusal inside one
    # "Command # 1 (HINCRBY ...) of pipeline caused error: 137 127.0.0.1:7001"
    # (the ASK's code stripped). The broker's lines name the fault instead.
    key = f"started-{uuid.uuid4().hex[:8]}"
    slot = key_slot(key.encode())
    source = cluster.node_for(key)
    target = other_primary(cluster, source)
    redis = RedisCluster.from_url(cluster.url)
    try:
        await redis.hset(key, "pad", "x")
        cluster.begin_migration(slot, source, target)
        assert cluster.migrate_keys(slot, source, target) == 1
        with pytest.raises(ResponseError) as refused:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.execute_command("HINCRBY", key, "1-0", 1)
                await pipe.execute()
    finally:
        cluster.finish_migration(slot, target)
        await redis.delete(key)
        await redis.aclose()
    error = refused.value
    assert "of pipeline caused error" in str(error), error
    # ASK, or MOVED once redis-py's retry went to the target unasked.
    assert describe(error).startswith("hash slot migrating between primaries ("), (
        describe(error)
    )
    assert f" {slot} {HOST}:" in describe(error), describe(error)
    caplog.set_level(logging.WARNING, logger="taskiq.atomic_claim")
    Backoff("acks of consumer c").failed(error)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "hash slot migrating" in line, line
    assert f" {slot} {HOST}:" in line, line
    assert "caused error" not in line, line


@bounded(60)
async def test_a_dead_letter_refused_by_a_migrating_slot_stops_no_heartbeat(
    cluster: LocalCluster, brokers: StartedBrokers
) -> None:
    # A task that ended without its ack is dead-lettered by the heartbeat,
    # a call the migrating slot refuses (the dead-letter stream is not
    # there): the other entries must be heartbeated all the same.
    moving = await MovingSlot.start(cluster, brokers, "dropped")
    stream, slot, source, target, broker = moving
    cluster.begin_migration(slot, source, target)
    try:
        await kick(broker, stream, "x", 2)
        listener = broker.listen()
        dropped = await asyncio.wait_for(listener.__anext__(), 5)
        held = await asyncio.wait_for(listener.__anext__(), 5)
        # The receiver's callbacks: one ends without acking, one runs on.
        await asyncio.create_task(start_as_the_receiver_does(broker, dropped))
        running = asyncio.Event()

        async def run_held() -> None:
            await start_as_the_receiver_does(broker, held)
            await running.wait()
            acked = held.ack()
            if acked is not None:
                await acked

        callback = asyncio.create_task(run_held())
        await asyncio.sleep(3 * IDLE_MS / 1000)
        entries: Any = await broker.redis.xpending_range(stream, "taskiq", "-", "+", 10)
        idle = {
            text(entry["message_id"]): entry["time_since_delivered"]
            for entry in entries
        }
        held_id = held.data.entry_id  # type: ignore[attr-defined]
        assert idle[held_id] < IDLE_MS, idle
    finally:
        await asyncio.to_thread(cluster.migrate_keys, slot, source, target)
        cluster.finish_migration(slot, target)
    running.set()
    await callback
    assert await drained(broker, stream, 10) is not None
    dead = StreamKeys(stream, "taskiq").dead_letters
    assert await broker.redis.xlen(dead) == 1
    await listener.aclose()


# A real reshard of the queue's slot under load, with `taskiq worker`s.

TASKS, FILLER_KEYS = 300, 60


@pytest.fixture(scope="module")
def events_server() -> Iterator[LocalServer]:
    with LocalServer(need(REDIS_7, "Redis 7")) as server:
        yield server


async def produce(kicker: Any, runs: list[str], per_second: float) -> int:
    """Kick one task per run, paced; returns how many kicks were refused
    and sent again (a kick redis-py gave up on was never written)."""
    task: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker, {})
    retried = 0
    for run in runs:
        for _ in range(50):
            try:
                await task.kiq(run, 0.02)
                break
            except Exception as error:
                if not is_outage(error):
                    raise
                retried += 1
                await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"kick of {run} refused 50 times")
        await asyncio.sleep(1 / per_second)
    return retried


@bounded(120)
async def test_a_slot_resharded_key_by_key_under_load_restarts_no_worker(
    cluster: LocalCluster, events_server: LocalServer, tmp_path: Path
) -> None:
    # A hash tag: the filler keys share the queue's slot, so the migration
    # moves keys for a few seconds, the queue's own among them.
    tag = uuid.uuid4().hex[:8]
    queue = f"reshard-{{{tag}}}"
    slot = key_slot(queue.encode())
    source = cluster.node_for(queue)
    target = other_primary(cluster, source)
    with SyncRedis(host=HOST, port=source.port) as client:
        for number in range(FILLER_KEYS):
            client.set(f"{{{tag}}}:filler:{number}", number, ex=600)
    env = drill_env(source, queue, events_server)
    events = EventLog(events_server.url, events_stream(queue))
    kicker = AtomicRedisStreamClusterBroker(cluster.url, queue_name=queue)
    runs = [f"run-{number}" for number in range(TASKS)]
    workers_named = ["w1", "w2"]
    try:
        await kicker.redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
        with DrillWorkers(env, tmp_path) as workers:
            for name in workers_named:
                workers.start(name)
            for name in workers_named:
                ready = await events.wait_for("ready", 30, worker=name)
                assert ready is not None, workers.log(name)
            producer = asyncio.create_task(produce(kicker, runs, 100))
            await asyncio.sleep(0.5)
            cluster.begin_migration(slot, source, target)
            started = time.monotonic()
            moved = await asyncio.to_thread(
                cluster.migrate_keys, slot, source, target, 0.05
            )
            cluster.finish_migration(slot, target)
            migrated = time.monotonic() - started
            retried = await producer
            for run in runs:
                finished = await events.wait_for("finished", 30, run)
                assert finished is not None, (run, workers.log("w1"))
            # Once nothing is pending no task can run again.
            assert await drained(kicker, queue, 15) is not None
            # Reads whatever was reported after the last wait.
            await events.wait_for("nothing", 0.5)
            alive = [workers.processes[name].poll() is None for name in workers_named]
            logs = {name: workers.log(name) for name in workers_named}
        seen = events.events.seen
        starts = Counter(run for _, event, run, _ in seen if event == "started")
        readies = Counter(worker for _, event, _, worker in seen if event == "ready")
        twice = sorted(run for run, count in starts.items() if count > 1)
        print(
            f"\nreshard under load: {moved} keys moved one by one in"
            f" {migrated:.2f} s while {TASKS} tasks ran; kicks sent again"
            f" {retried}; tasks run twice {len(twice)}; worker starts"
            f" {dict(readies)}"
        )
        assert alive == [True, True], logs
        assert readies == dict.fromkeys(workers_named, 1), logs
        assert twice == [], logs
        assert set(starts) == set(runs)
        assert unexpiring_keys([node.port for node in cluster.primaries]) == []
    finally:
        await kicker.shutdown()
        await events.aclose()
