"""AtomicRedisStreamClusterBroker on a real local Redis Cluster.

A 3-primary cluster, each primary with one replica, started from the local
Redis 7 binary (``tests/topologies.py``). Tests that kill a node get a
cluster of their own; the others share one per module. Measured times are
printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis as AsyncRedis
from redis.crc import key_slot
from redis.exceptions import ClusterCrossSlotError, RedisClusterException
from taskiq.kicker import AsyncKicker
from taskiq_redis import RedisStreamClusterBroker

from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.cluster_client import SlotRoutedClient, _age, slot_groups
from taskiq_atomic_claim.harness.drill_app import events_stream
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LIBRARY, LoadMode, _library_name
from taskiq_atomic_claim.server_info import NATIVE_CLAIM, ScriptingUnavailableError
from tests.test_cli import cli
from tests.test_native_claim import commands_seen
from tests.topologies import (
    HOST,
    NO_SCRIPTS_PASSWORD,
    NO_SCRIPTS_USER,
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
    user_without_scripting,
    wait_replicated,
)
from tests.topology_app import TASK_NAME

IDLE_MS, INTERVAL_MS = 1000, 200
# Reclaim happens one idle_timeout after delivery, at the next claim cycle;
# the margin covers a loaded 2-core machine.
RECLAIM_BOUND_S = (IDLE_MS + INTERVAL_MS) / 1000 + 2.0

REDIS_7 = binary_for(7)
REDIS_62 = binary_for(6)
VALKEY_8 = binary_for(8, "valkey")
REDIS_8 = binary_for(8)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Shared by the tests that leave every node running."""
    with LocalCluster(need(REDIS_7, "Redis 7")) as started:
        yield started


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    """For a test that kills a node."""
    with LocalCluster(need(REDIS_7, "Redis 7")) as started:
        yield started


@pytest.fixture(scope="module")
def events_server() -> Iterator[LocalServer]:
    with LocalServer(need(REDIS_7, "Redis 7")) as server:
        yield server


def spread_streams(cluster: LocalCluster, prefix: str) -> list[str]:
    """One stream name per primary, the first on the cluster's startup node."""
    by_primary: dict[int, str] = {}
    for number in range(10_000):
        name = f"{prefix}-{number}"
        by_primary.setdefault(cluster.node_for(name).port, name)
        if len(by_primary) == len(cluster.primaries):
            break
    first = cluster.primaries[0].port
    return [by_primary[first]] + [s for p, s in by_primary.items() if p != first]


class Brokers(StartedBrokers):
    """Cluster brokers started for one test; all shut down at its end."""

    async def __call__(
        self, cluster: LocalCluster, streams: list[str], name: str, **kwargs: Any
    ) -> AtomicRedisStreamClusterBroker:
        kwargs.setdefault("idle_timeout", IDLE_MS)
        kwargs.setdefault("claim_interval", INTERVAL_MS)
        kwargs.setdefault("xread_block", 500)
        broker = AtomicRedisStreamClusterBroker(
            kwargs.pop("url", cluster.url),
            queue_name=streams[0],
            additional_streams={stream: ">" for stream in streams[1:]},
            consumer_name=name,
            # Messages kicked before a listener starts count too.
            consumer_id="0",
            **kwargs,
        )
        return await self.start(broker)


@pytest.fixture
async def make_broker() -> AsyncIterator[Brokers]:
    async with Brokers() as brokers:
        yield brokers


async def kick_all(
    broker: Any, streams: list[str], per_stream: int, tag: str
) -> set[str]:
    bodies = set()
    for stream in streams:
        for number in range(per_stream):
            body = f"{stream}/{tag}-{number}"
            await broker.kick(message(body, stream))
            bodies.add(body)
    return bodies


async def pending(broker: AtomicRedisStreamClusterBroker, stream: str) -> int:
    summary: Any = await broker.redis.xpending(stream, broker.consumer_group_name)
    return int(summary["pending"])


async def drained(
    broker: AtomicRedisStreamClusterBroker, streams: list[str], timeout: float = 15
) -> bool:
    """Whether the group's PEL on every stream empties in time (an ack sent
    to a primary just before it died is lost with it, and the entry runs
    once more)."""
    for _ in range(int(timeout / 0.1)):
        if all([await pending(broker, stream) == 0 for stream in streams]):
            return True
        await asyncio.sleep(0.1)
    return False


def libraries_on(node: ClusterNode) -> list[str]:
    with node_client(node) as client:
        listing: Any = client.execute_command("FUNCTION LIST")
    return [_library_name(entry) for entry in listing]


def node_client(node: ClusterNode) -> SyncRedis:
    return SyncRedis(host=HOST, port=node.port, decode_responses=True)


# Construction: no server needed.


def test_a_stream_whose_hashed_part_has_a_brace_keeps_its_keys_in_its_slot() -> None:
    # The first {...} pair is empty, so Redis hashes the whole name, which
    # cannot stand between braces: the keys carry a stand-in tag instead.
    stream = "a{}b{c}"
    assert StreamKeys(stream, "taskiq").colocated()
    AtomicRedisStreamClusterBroker("redis://127.0.0.1:1", queue_name=stream)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"idle_timeout": 1000, "claim_interval": 1000}, "claim_interval"),
        ({"unacknowledged_batch_size": 0}, "unacknowledged_batch_size"),
        ({"unacknowledged_lock_timeout": -1}, "unacknowledged_lock_timeout"),
        ({"max_deliveries": 0}, "max_deliveries"),
        ({"xread_count": 0}, "xread_count"),
        ({"xread_block": -1}, "xread_block"),
        ({"queue_name": ""}, "queue_name"),
    ],
)
def test_arguments_are_checked_as_the_standalone_broker_checks_them(
    kwargs: dict[str, Any], names: str
) -> None:
    with pytest.raises(ValueError, match=names):
        AtomicRedisStreamClusterBroker("redis://127.0.0.1:1", **kwargs)


def test_parent_arguments_keep_their_positions() -> None:
    broker = AtomicRedisStreamClusterBroker(
        "redis://127.0.0.1:1", "jobs", 10, "workers", "me", "0", False, 3000
    )
    assert (broker.queue_name, broker.consumer_group_name) == ("jobs", "workers")
    assert (broker.consumer_name, broker.consumer_id, broker.block) == ("me", "0", 3000)
    assert broker.mkstream is False
    assert broker.atomic.settings.idle_timeout == 5000
    assert broker.atomic.reads.count == 100


def test_the_oldest_primary_by_its_real_version_decides_the_features() -> None:
    # Valkey reports redis_version 7.2.4 for compatibility: its real version
    # is what counts. A version that cannot be read counts as the oldest.
    valkey_81 = {"redis_version": "7.2.4", "valkey_version": "8.1.1"}
    redis_74 = {"redis_version": "7.4.2"}
    assert min([valkey_81, redis_74], key=_age) is redis_74
    assert min([redis_74, {"redis_version": "?"}], key=_age) == {"redis_version": "?"}


# On the shared cluster.


@bounded(30)
async def test_startup_refuses_a_cluster_that_runs_no_scripts_for_this_user(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    # As the standalone broker does: at start-up, not at the first ack.
    credentials = f"{NO_SCRIPTS_USER}:{NO_SCRIPTS_PASSWORD}@"
    refused = pytest.raises(ScriptingUnavailableError, match="refused for this user")
    with user_without_scripting([node.port for node in cluster.nodes]), refused:
        await make_broker(
            cluster,
            spread_streams(cluster, "noscripts"),
            "refused",
            url=cluster.url.replace("redis://", f"redis://{credentials}", 1),
        )


@bounded(60)
async def test_startup_refuses_a_cluster_where_one_primary_runs_no_scripts(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    # Every ack on that primary's slots would fail: refused at start-up,
    # naming the node, whichever primary it is.
    credentials = f"{NO_SCRIPTS_USER}:{NO_SCRIPTS_PASSWORD}@"
    url = cluster.url.replace("redis://", f"redis://{credentials}", 1)
    ports = [node.port for node in cluster.nodes]
    for denying in cluster.primaries:
        others = [port for port in ports if port != denying.port]
        refused = pytest.raises(
            ScriptingUnavailableError, match="refused for this user"
        )
        with user_without_scripting(ports, scripting_on=others), refused as caught:
            await make_broker(
                cluster, spread_streams(cluster, "onenode"), "refused", url=url
            )
        assert f"(primary {HOST}:{denying.port})" in str(caught.value), caught.value


@bounded(30)
async def test_upstream_broker_cannot_even_read_streams_in_different_slots(
    cluster: LocalCluster,
) -> None:
    streams = spread_streams(cluster, f"upstream-{uuid.uuid4().hex[:6]}")
    assert len(slot_groups({stream: ">" for stream in streams})) == 3
    broker = RedisStreamClusterBroker(
        cluster.url,
        queue_name=streams[0],
        additional_streams={stream: ">" for stream in streams[1:]},
    )
    await broker.startup()
    try:
        # CROSSSLOT, from the server or from redis-py before sending.
        crossslot = (ClusterCrossSlotError, RedisClusterException)
        with pytest.raises(crossslot, match=r"same (key )?slot"):
            await broker.listen().__anext__()
    finally:
        await broker.shutdown()


@bounded(60)
async def test_streams_on_three_primaries_are_read_and_reclaimed(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    streams = spread_streams(cluster, f"spread-{uuid.uuid4().hex[:6]}")
    first = await make_broker(cluster, streams, "first")
    second = await make_broker(cluster, streams, "second")
    bodies = await kick_all(first, streams, 3, "a")

    doomed = Consumer(first, ack=False)
    assert await doomed.wait_for(bodies, 10), doomed.bodies
    await doomed.die()
    died = time.monotonic()

    survivor = Consumer(second)
    recovered = await survivor.wait_for(bodies, RECLAIM_BOUND_S + 1)
    assert recovered is not None, sorted(set(bodies) - set(survivor.bodies))
    print(f"\n3 primaries: 9 entries reclaimed {recovered - died:.2f} s after the kill")
    assert recovered - died <= RECLAIM_BOUND_S
    await survivor.stop()

    for stream in streams:
        assert await pending(second, stream) == 0
    for primary in cluster.primaries:
        assert LIBRARY.name in libraries_on(primary)
    assert unexpiring_keys([node.port for node in cluster.primaries]) == []


@bounded(60)
async def test_streams_on_three_primaries_are_trimmed_once_consumed(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    """The trim's keys share the stream's slot: one script call per stream,
    on its primary. 200 entries fill several nodes, so XTRIM ... ~ has some
    to remove."""
    streams = spread_streams(cluster, f"trim-{uuid.uuid4().hex[:6]}")
    broker = await make_broker(cluster, streams, "trimmer")
    bodies = await kick_all(broker, streams, 200, "t")
    consumer = Consumer(broker)
    assert await consumer.wait_for(bodies, 20), len(consumer.bodies)

    async def lengths() -> list[int]:
        return [int(await broker.redis.xlen(stream)) for stream in streams]

    for _ in range(100):
        if max(await lengths()) < 200:
            break
        await asyncio.sleep(0.1)
    await consumer.stop()
    assert max(await lengths()) < 200, await lengths()
    assert unexpiring_keys([node.port for node in cluster.primaries]) == []


async def commands_on(node: ClusterNode, seconds: float) -> list[list[str]]:
    """Every command ``node`` runs for ``seconds`` (MONITOR), as tokens."""
    async with AsyncRedis(host=HOST, port=node.port) as client:
        return await commands_seen(client, seconds)


async def idle_fleet_commands(
    cluster: LocalCluster, make_broker: Brokers, workers: int
) -> list[list[list[str]]]:
    """What each primary runs in 2 s while ``workers`` idle consumers
    (idle_timeout 4 s, a claim each 500 ms) listen to a stream on each."""
    streams = spread_streams(cluster, f"gated-{uuid.uuid4().hex[:6]}")
    brokers = [
        await make_broker(
            cluster, streams, f"w{n}", idle_timeout=4000, claim_interval=500
        )
        for n in range(workers)
    ]
    consumers = [Consumer(broker) for broker in brokers]
    await asyncio.sleep(0.5)  # past the first claims, due at startup
    seen = await asyncio.gather(*(commands_on(node, 2.0) for node in cluster.primaries))
    for consumer in consumers:
        await consumer.stop()
    return list(seen)


@bounded(60)
async def test_an_idle_fleet_looks_once_per_slot_per_interval(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    """A gate per slot (its key in that slot): one consumer of the fleet
    looks at a slot's streams each claim interval, with a plain XPENDING,
    and with nothing idle no claim script runs, however many workers
    listen."""
    for node_commands in await idle_fleet_commands(cluster, make_broker, 4):
        fcalls = [c[1] for c in node_commands if c[0].upper() == "FCALL"]
        claims = [name for name in fcalls if name.endswith("_claim")]
        looks = [c for c in node_commands if c[0].upper() == "XPENDING"]
        # Without the gate: 4 workers x 4 intervals claim on each slot (16).
        assert claims == [], claims
        # One look per interval, fleet-wide (4 in 2 s), and the trims' own.
        assert len(looks) <= 10, looks


@bounded(60)
async def test_entries_read_while_the_consumer_is_busy_are_heartbeated(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    # A read on another slot completes while nothing pulls from listen();
    # its entry must be heartbeated from then on, or a claimer would take it
    # from a live worker after idle_timeout.
    streams = spread_streams(cluster, f"busy-{uuid.uuid4().hex[:6]}")
    # A long claim interval: the reads started with the first delivery
    # block until the next claim, which gives the second kick time to land.
    busy = await make_broker(cluster, streams, "busy", claim_interval=900)
    claimer = await make_broker(cluster, streams, "claimer")
    listener = busy.listen()
    await busy.kick(message("first", streams[0]))
    received = await asyncio.wait_for(listener.__anext__(), 5)
    assert received.data == b"first"
    await busy.kick(message("second", streams[1]))

    hungry = Consumer(claimer)
    await asyncio.sleep(3 * IDLE_MS / 1000)
    assert hungry.bodies == []
    await hungry.stop()
    assert busy.atomic.in_flight[streams[1]]
    later = await asyncio.wait_for(listener.__anext__(), 5)
    assert later.data == b"second"
    for delivered in (received, later):
        acked = delivered.ack()
        if acked is not None:
            await acked
    await listener.aclose()


@bounded(60)
async def test_a_library_flushed_from_one_primary_is_loaded_again(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    streams = spread_streams(cluster, f"flush-{uuid.uuid4().hex[:6]}")
    broker = await make_broker(cluster, streams, "only")
    consumer = Consumer(broker)
    assert await consumer.wait_for(await kick_all(broker, streams, 1, "a"), 10)
    assert (
        await broker.atomic.scripts.mode(SlotRoutedClient(broker.redis))
        is LoadMode.FUNCTIONS
    )
    reloads = broker.atomic.scripts.reloads

    flushed = cluster.node_for(streams[1])
    with node_client(flushed) as client:
        client.execute_command("FUNCTION FLUSH")
    assert LIBRARY.name not in libraries_on(flushed)
    # The next claim cycle on that primary finds the library gone.
    for _ in range(100):
        if broker.atomic.scripts.reloads > reloads:
            break
        await asyncio.sleep(0.05)
    assert broker.atomic.scripts.reloads > reloads
    assert await consumer.wait_for(await kick_all(broker, streams, 1, "b"), 10)
    assert LIBRARY.name in libraries_on(flushed)
    await consumer.stop()


@bounded(60)
async def test_dead_letters_stay_in_the_slot_of_their_stream(
    cluster: LocalCluster, make_broker: Brokers
) -> None:
    streams = spread_streams(cluster, f"dead-{uuid.uuid4().hex[:6]}")
    first = await make_broker(cluster, streams, "first", max_deliveries=1)
    second = await make_broker(cluster, streams, "second", max_deliveries=1)
    bodies = await kick_all(first, streams, 1, "a")
    # Each task starts and its worker dies: one crash while running.
    doomed = Consumer(first, ack=False, start=True)
    assert await doomed.wait_for(bodies, 10)
    await doomed.die()

    survivor = Consumer(second)
    deadline = time.monotonic() + RECLAIM_BOUND_S + 2
    dead_keys = [StreamKeys(stream, "taskiq").dead_letters for stream in streams]
    while time.monotonic() < deadline:
        lengths = [await second.redis.xlen(key) for key in dead_keys]
        if lengths == [1, 1, 1]:
            break
        await asyncio.sleep(0.1)
    assert lengths == [1, 1, 1]
    assert survivor.bodies == []
    for stream, key in zip(streams, dead_keys, strict=True):
        assert key_slot(key.encode()) == key_slot(stream.encode())
        assert await pending(second, stream) == 0
    await survivor.stop()


# A real `taskiq worker`, SIGKILLed mid-task on an idle queue.

DRILL_IDLE_MS, DRILL_INTERVAL_MS = 2000, 500
# As the standalone drill: worker start-up overlaps the idle wait.
DRILL_BOUND_S = (DRILL_IDLE_MS + DRILL_INTERVAL_MS) / 1000 + 2.0


def drill_env(
    startup: ClusterNode, queue: str, events_server: LocalServer
) -> dict[str, str]:
    """``tests.topology_app``'s settings for a worker on ``queue``."""
    return {
        "TAC_TOPOLOGY": "cluster",
        "TAC_TOPOLOGY_NODES": f"{HOST}:{startup.port}",
        "TAC_DRILL_QUEUE": queue,
        "TAC_DRILL_IDLE_TIMEOUT": str(DRILL_IDLE_MS),
        "TAC_DRILL_CLAIM_INTERVAL": str(DRILL_INTERVAL_MS),
        "TAC_DRILL_EVENTS_URL": events_server.url,
    }


async def _drill_round(
    cluster: LocalCluster,
    events_server: LocalServer,
    tmp_path: Path,
    kill_primary: bool,
    at_defaults: bool = False,
) -> dict[str, float]:
    queue = f"drill-{uuid.uuid4().hex[:8]}"
    run = "round-0"
    env = drill_env(cluster.primaries[0], queue, events_server)
    if at_defaults:
        env["TAC_DRILL_IDLE_TIMEOUT"] = env["TAC_DRILL_CLAIM_INTERVAL"] = ""
    events = EventLog(events_server.url, events_stream(queue))
    kicker = AtomicRedisStreamClusterBroker(cluster.url, queue_name=queue)
    times: dict[str, float] = {}
    try:
        # Before the first kick: a worker's start-up creates the group at
        # "$", which would skip a message sent just before.
        await kicker.redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
        with DrillWorkers(env, tmp_path) as workers:
            workers.start("doomed")
            ready = await events.wait_for("ready", 30, worker="doomed")
            assert ready is not None, workers.log("doomed")
            task: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker, {})
            await task.kiq(run, 1.0)
            delivered = await events.wait_for("started", 15, run, "doomed")
            assert delivered is not None, workers.log("doomed")
            victim = cluster.node_for(queue)
            if kill_primary:
                # What the doomed worker's delivery wrote must be on the
                # replica, or the failover itself would lose it.
                await asyncio.to_thread(
                    wait_replicated,
                    victim.port,
                    [cluster.replica_for(victim).port],
                )
            workers.kill("doomed")
            killed = time.monotonic()
            if kill_primary:
                cluster.kill(victim)
            fresh_env = {}
            if kill_primary:
                # Its only startup node must be alive.
                alive = next(n for n in cluster.primaries if n.alive)
                fresh_env["TAC_TOPOLOGY_NODES"] = f"{HOST}:{alive.port}"
            workers.start("fresh", **fresh_env)
            if kill_primary:
                replica = cluster.replica_for(victim)
                times["promoted"] = await asyncio.to_thread(
                    cluster.wait_promoted, replica
                )
            rerun = await events.wait_for("started", 40, run, "fresh")
            assert rerun is not None, workers.log("fresh")
            finished = await events.wait_for("finished", 15, run, "fresh")
            assert finished is not None, workers.log("fresh")
            assert await drained(kicker, [queue]), workers.log("fresh")
            times["kill_to_rerun"] = rerun - killed
            times["delivery_to_rerun"] = rerun - delivered
    finally:
        await kicker.shutdown()
        await events.aclose()
    return times


@bounded(90)
async def test_crash_drill_on_the_cluster_broker(
    cluster: LocalCluster, events_server: LocalServer, tmp_path: Path
) -> None:
    times = await _drill_round(cluster, events_server, tmp_path, kill_primary=False)
    print(
        f"\ncluster drill: SIGKILL -> rerun {times['kill_to_rerun']:.2f} s"
        f" (first delivery -> rerun {times['delivery_to_rerun']:.2f} s)"
    )
    assert times["kill_to_rerun"] <= DRILL_BOUND_S


@bounded(90)
@pytest.mark.parametrize("topology", ["cluster", "redis_8_cluster"])
async def test_crash_drill_on_the_cluster_broker_at_defaults(
    topology: str,
    events_server: LocalServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    # No reclaim setting in the workers' app: what the README promises, on
    # the Lua path (Redis 7) and where reads reclaim (Redis 8).
    cluster = request.getfixturevalue(topology)
    times = await _drill_round(
        cluster, events_server, tmp_path, kill_primary=False, at_defaults=True
    )
    rerun = times["kill_to_rerun"]
    print(f"\ncluster drill at defaults: SIGKILL -> rerun {rerun:.2f} s")
    assert rerun <= 10.0


# Failover: these kill a primary, so each has a cluster of its own.


@bounded(120)
async def test_crash_drill_across_a_primary_failover(
    own_cluster: LocalCluster, events_server: LocalServer, tmp_path: Path
) -> None:
    times = await _drill_round(own_cluster, events_server, tmp_path, kill_primary=True)
    promoted = times["promoted"]
    print(
        f"\ncluster drill across failover: replica promoted {promoted:.2f} s after"
        f" the kill; SIGKILL -> rerun {times['kill_to_rerun']:.2f} s"
        f" (first delivery -> rerun {times['delivery_to_rerun']:.2f} s)"
    )
    # The claim waits for the promotion, then for the loop's outage backoff,
    # which doubles and so can add up to the outage's length (capped at 5 s).
    bound = max(DRILL_IDLE_MS / 1000, promoted + min(promoted, 5.0))
    assert times["kill_to_rerun"] <= bound + DRILL_INTERVAL_MS / 1000 + 2.0


@bounded(120)
async def test_primary_killed_mid_run_claims_continue_nothing_lost(
    own_cluster: LocalCluster, make_broker: Brokers
) -> None:
    cluster = own_cluster
    streams = spread_streams(cluster, "failover")
    doomed_broker = await make_broker(cluster, streams, "doomed")
    survivor_broker = await make_broker(cluster, streams, "survivor")
    # The victim is the survivor client's default node: redis-py asks that
    # node for the keys of FCALL and XREADGROUP, so losing it is the worst
    # case for a client that is not told to refresh its view.
    default = survivor_broker.redis.get_default_node()
    victim = next(node for node in cluster.primaries if node.port == default.port)
    victim_stream = next(s for s in streams if cluster.node_for(s) is victim)
    replica = cluster.replica_for(victim)
    # A worker of another group that reads only the victim's stream: all its
    # commands go to the victim's slot, none reaches a live node and learns
    # of the failover from a CLUSTERDOWN reply.
    solo_broker = await make_broker(
        cluster, [victim_stream], "solo", consumer_group_name="solo"
    )
    assert solo_broker.redis.get_default_node().port == victim.port

    before = await kick_all(doomed_broker, streams, 4, "before")
    doomed = Consumer(doomed_broker, ack=False)
    assert await doomed.wait_for(before, 10)
    await doomed.die()
    for primary in cluster.primaries:
        await asyncio.to_thread(
            wait_replicated, primary.port, [cluster.replica_for(primary).port]
        )

    # Producers are other processes: the survivor's own client only reads,
    # claims and acks, so nothing else refreshes its view of the cluster.
    producer = await make_broker(cluster, streams, "producer")
    survivor = Consumer(survivor_broker)
    solo = Consumer(solo_broker)
    solo_before = {b for b in before if b.startswith(victim_stream + "/")}
    assert await solo.wait_for(solo_before, 10)
    # Not blocked on the victim when it dies (busy with a task, say): the
    # first command it sends afterwards goes to the dead node.
    await solo.stop()
    killed = time.monotonic()
    cluster.kill(victim)
    solo = Consumer(solo_broker)
    # Streams on the live primaries keep flowing while the victim is down.
    others = [stream for stream in streams if stream != victim_stream]
    during = await kick_all(producer, others, 2, "during")
    promoted = await asyncio.to_thread(cluster.wait_promoted, replica)
    after = await kick_all(producer, streams, 2, "after")

    everything = before | during | after
    done = await survivor.wait_for(everything, 30)
    assert done is not None, sorted(everything - set(survivor.bodies))
    assert await drained(survivor_broker, streams)
    await survivor.stop()
    on_victim = {body for body in everything if body.startswith(victim_stream + "/")}
    solo_after = on_victim - solo_before
    solo_done = await solo.wait_for(solo_after, 15)
    assert solo_done is not None, sorted(solo_after - set(solo.bodies))
    assert await drained(solo_broker, [victim_stream])
    await solo.stop()

    def first_seen(bodies: set[str]) -> float:
        return min(t for t, body in survivor.received if body in bodies) - killed

    elsewhere = everything - on_victim
    print(
        f"\nprimary killed: replica promoted {promoted:.2f} s after the kill;"
        f" first entry on the live primaries handled at {first_seen(elsewhere):.2f} s,"
        f" first on the failed-over slot at {first_seen(on_victim):.2f} s,"
        f" all {len(everything)} by {done - killed:.2f} s;"
        f" {len(survivor.bodies) - len(set(survivor.bodies))} duplicates;"
        f" library reloads {survivor_broker.atomic.scripts.reloads};"
        f" the single-stream worker had its stream back at {solo_done - killed:.2f} s"
    )
    # Functions replicate: the promoted replica already had the library.
    assert LIBRARY.name in libraries_on(replica)
    live = [
        node.port for node in cluster.nodes if node.alive and node.role() == "master"
    ]
    assert unexpiring_keys(live) == []


@pytest.fixture
def lasting_outage_cluster() -> Iterator[LocalCluster]:
    """No replicas and a node timeout longer than any test: a killed primary
    stays down with its slots still assigned to it, as in the seconds
    (15 by default) before a production cluster fails one over."""
    with LocalCluster(
        need(REDIS_7, "Redis 7"), replicas=0, node_timeout=120_000
    ) as started:
        yield started


@pytest.fixture
def cluster_62() -> Iterator[LocalCluster]:
    with LocalCluster(need(REDIS_62, "Redis 6.2"), replicas=0) as started:
        yield started


@pytest.fixture
def redis_8_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(need(REDIS_8, "Redis 8"), replicas=0) as started:
        yield started


@pytest.fixture
def valkey_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(need(VALKEY_8, "Valkey 8")) as started:
        yield started


# The topology fixture comes first in these signatures, so it is torn down
# after the brokers.


@bounded(120)
async def test_a_primary_down_without_failover_stops_only_its_own_streams(
    lasting_outage_cluster: LocalCluster, make_broker: Brokers
) -> None:
    cluster = lasting_outage_cluster
    streams = spread_streams(cluster, "partial")
    broker = await make_broker(cluster, streams, "only")
    consumer = Consumer(broker)
    assert await consumer.wait_for(await kick_all(broker, streams, 1, "a"), 10)
    # Not the startup node: the client must still reach the others.
    victim = cluster.node_for(streams[1])
    cluster.kill(victim)
    killed = time.monotonic()
    alive = [s for s in streams if cluster.node_for(s) is not victim]
    for round_number in range(3):
        bodies = await kick_all(broker, alive, 1, f"down-{round_number}")
        handled = await consumer.wait_for(bodies, 10)
        assert handled is not None, sorted(bodies - set(consumer.bodies))
        print(
            f"\none primary down: round {round_number} on the other primaries"
            f" handled {handled - killed:.2f} s after the kill"
        )
        await asyncio.sleep(1.0)
    assert not consumer.task.done()
    await consumer.stop()

    # inspect names the dead primary and still reports the others.
    run = cli("inspect", "--cluster", "--json", "--url", cluster.url)
    assert run.returncode == 1, run.stdout + run.stderr
    nodes = {node["node"]: node for node in json.loads(run.stdout)["nodes"]}
    dead = f"{HOST}:{victim.port}"
    assert "Error" in nodes.pop(dead)["error"]
    assert len(nodes) == len(cluster.primaries) - 1
    assert all("streams" in node for node in nodes.values())


# Other servers.


async def _reclaim_round(
    cluster: LocalCluster, make_broker: Brokers, prefix: str, flush: bool
) -> AtomicRedisStreamClusterBroker:
    streams = spread_streams(cluster, prefix)
    first = await make_broker(cluster, streams, "first")
    second = await make_broker(cluster, streams, "second")
    bodies = await kick_all(first, streams, 2, "a")
    doomed = Consumer(first, ack=False)
    assert await doomed.wait_for(bodies, 10)
    await doomed.die()
    if flush:
        for node in cluster.primaries:
            with node_client(node) as client:
                client.execute_command("SCRIPT FLUSH")
    survivor = Consumer(second)
    assert await survivor.wait_for(bodies, RECLAIM_BOUND_S + 1)
    await survivor.stop()
    for stream in streams:
        assert await pending(second, stream) == 0
    # Each reclaim counted once, in its stream's slot (reclaim_count.py).
    counted = {}
    for node in cluster.primaries:
        with node_client(node) as client:
            for key in client.keys("taskiq-atomic-claim:reclaimed:*"):
                counted[text(key)] = int(client.get(key))
    group = second.consumer_group_name
    expected = {StreamKeys(stream, group).reclaimed: 2 for stream in streams}
    assert counted == expected
    return second


@bounded(90)
async def test_redis_62_cluster_claims_with_cached_scripts(
    cluster_62: LocalCluster, make_broker: Brokers
) -> None:
    # SCRIPT FLUSH on every primary after the first broker's claims loaded
    # them: the survivor's claims load them on every primary again.
    broker = await _reclaim_round(cluster_62, make_broker, "scripts", flush=True)
    assert await broker.atomic.scripts.mode(SlotRoutedClient(broker.redis)) is (
        LoadMode.SCRIPTS
    )
    shas = [script.sha for script in LIBRARY.scripts.values()]
    for node in cluster_62.primaries:
        with node_client(node) as client:
            assert all(client.script_exists(*shas))
    # The survivor had run none before the flush: its first load, no reload.
    assert broker.atomic.scripts.reloads == 0


@bounded(60)
async def test_an_idle_redis_8_fleet_reads_with_claim_once_per_slot_per_interval(
    redis_8_cluster: LocalCluster, make_broker: Brokers
) -> None:
    """Where reads reclaim, the gate is per slot too: one consumer of the
    fleet reads a slot's streams with CLAIM each claim interval; the
    others' reads are plain, as taskiq-redis's are."""
    for node_commands in await idle_fleet_commands(redis_8_cluster, make_broker, 6):
        reads = [c for c in node_commands if c[0].upper() == "XREADGROUP"]
        claiming = [c for c in reads if "CLAIM" in (t.upper() for t in c)]
        # 6 workers reading each slot every 500 ms (xread_block): ~24 reads,
        # every one of them claiming without the gate; one claiming read
        # per 500 ms interval fleet-wide, two where the gate changes hands
        # as its key lapses: at most 8.
        assert len(reads) >= 12, reads
        assert len(claiming) <= 8, f"{len(claiming)} of {len(reads)} reads claim"


@bounded(90)
async def test_redis_8_cluster_reclaims_through_its_reads(
    redis_8_cluster: LocalCluster, make_broker: Brokers
) -> None:
    # Every primary has XREADGROUP ... CLAIM: no claim script, no lease or
    # cursor key on any of them.
    for node in redis_8_cluster.primaries:
        with node_client(node) as client:
            client.config_resetstat()
    broker = await _reclaim_round(redis_8_cluster, make_broker, "native", flush=False)
    assert broker.atomic.path.reclaim_path == NATIVE_CLAIM
    for node in redis_8_cluster.primaries:
        with node_client(node) as client:
            assert client.keys("taskiq-atomic-claim:lease:*") == []
            assert client.keys("taskiq-atomic-claim:cursor:*") == []
            assert "cmdstat_xautoclaim" not in client.info("commandstats")


@pytest.mark.slow
@bounded(90)
async def test_valkey_cluster_reads_and_reclaims(
    valkey_cluster: LocalCluster, make_broker: Brokers
) -> None:
    broker = await _reclaim_round(valkey_cluster, make_broker, "valkey", flush=False)
    assert await broker.atomic.scripts.mode(SlotRoutedClient(broker.redis)) is (
        LoadMode.FUNCTIONS
    )


def test_load_and_check_reach_every_primary(cluster: LocalCluster) -> None:
    ports = [node.port for node in cluster.primaries]
    for port in ports:
        with SyncRedis(port=port) as node:
            node.execute_command("FUNCTION", "FLUSH")
    assert cli("check", "--cluster", "--url", cluster.url).returncode == 1

    loaded = cli("load", "--cluster", "--url", cluster.url)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert f"{len(ports)}/{len(ports)} primaries loaded" in loaded.stdout
    assert all(f":{port}" in loaded.stdout for port in ports)

    with SyncRedis(port=ports[1]) as node:
        node.execute_command("FUNCTION", "FLUSH")
    one_missing = cli("check", "--cluster", "--url", cluster.url)
    assert one_missing.returncode == 1
    assert f"127.0.0.1:{ports[1]}: missing" in one_missing.stdout
    assert f"{len(ports) - 1}/{len(ports)} primaries current" in one_missing.stdout
    assert cli("load", "--cluster", "--url", cluster.url).returncode == 0
    assert cli("check", "--cluster", "--url", cluster.url).returncode == 0


def _sections(stdout: str) -> dict[int, str]:
    """The per-primary sections of a ``--cluster`` report, by port."""
    sections: dict[int, str] = {}
    port = None
    for line in stdout.splitlines():
        if line.startswith("== primary "):
            port = int(line.split()[2].rsplit(":", 1)[1])
            sections[port] = ""
        elif port is not None:
            sections[port] += line + "\n"
    return sections


def _grouped_streams(cluster: LocalCluster, prefix: str, group: str) -> list[str]:
    """One stream per primary, each with one entry pending for ``w1``."""
    streams = spread_streams(cluster, f"{prefix}-{uuid.uuid4().hex[:6]}")
    for stream in streams:
        with node_client(cluster.node_for(stream)) as client:
            client.xgroup_create(stream, group, id="0", mkstream=True)
            client.xadd(stream, {"data": "x"})
            client.xreadgroup(group, "w1", {stream: ">"})
    return streams


def test_inspect_reports_each_primary_and_its_own_streams(
    cluster: LocalCluster,
) -> None:
    streams = _grouped_streams(cluster, "seen", "ops")
    ports = sorted(node.port for node in cluster.primaries)

    table = cli("inspect", "--cluster", "--url", cluster.url)
    assert table.returncode == 0, table.stdout + table.stderr
    sections = _sections(table.stdout)
    assert sorted(sections) == ports
    for stream in streams:
        owner = cluster.node_for(stream).port
        assert [port for port in ports if f"stream {stream!r}" in sections[port]] == [
            owner
        ]
    assert f"{len(ports)}/{len(ports)} primaries inspected" in table.stdout

    named = cli(
        "inspect",
        "--cluster",
        "--url",
        cluster.url,
        "--json",
        "--group",
        "ops",
        *[f"--queue={stream}" for stream in streams],
    )
    assert named.returncode == 0, named.stderr
    report = json.loads(named.stdout)
    assert list(report) == ["format", "nodes"]
    assert report["format"] == 1
    assert sorted(node["node"] for node in report["nodes"]) == [
        f"{HOST}:{port}" for port in ports
    ]
    for node in report["nodes"]:
        port = int(node["node"].rsplit(":", 1)[1])
        assert node["library"]["name"] == LIBRARY.name
        held = [view["stream"] for view in node["streams"]]
        # A named stream is read on the primary that serves its slot only.
        assert held == [s for s in streams if cluster.node_for(s).port == port]
        for view in node["streams"]:
            (group,) = view["groups"]
            assert group["pending"] == 1
            assert [c["name"] for c in group["consumers"]] == ["w1"]


def test_doctor_finds_and_fixes_on_each_primary(cluster: LocalCluster) -> None:
    streams = _grouped_streams(cluster, "doc", "ops")
    lock = f"autoclaim:{streams[1]}:ops"
    lock_node = cluster.node_for(lock)
    flushed = next(node for node in cluster.primaries if node is not lock_node)
    scope = [
        "--cluster",
        "--url",
        cluster.url,
        "--group",
        "ops",
        "--lock-expiry-ms",
        "2000",
        # The consumer the setup left holding an entry is not this test's
        # subject: never judged dead within it, however slow the machine.
        "--idle-timeout-ms",
        "600000",
        *[f"--queue={stream}" for stream in streams],
    ]
    try:
        # Only what the test breaks is unhealthy, whatever ran before it.
        loaded = cli("load", "--cluster", "--url", cluster.url)
        assert loaded.returncode == 0, loaded.stdout + loaded.stderr
        with node_client(lock_node) as client:
            client.set(lock, "killed-1.1.2-worker")
        with node_client(flushed) as client:
            client.execute_command("FUNCTION FLUSH")

        found = cli("doctor", *scope)
        assert found.returncode == 1, found.stdout + found.stderr
        sections = _sections(found.stdout)
        assert f"[legacy-lock] {lock}:" in sections[lock_node.port]
        assert "[library]" in sections[flushed.port]
        assert "[library]" not in sections[lock_node.port]
        # The advice names commands that work on a cluster.
        assert "run `taskiq-atomic-claim load --cluster --url URL`" in found.stdout
        assert f"/{len(cluster.primaries)} primaries healthy" in found.stdout

        fixed = cli("doctor", "--fix", *scope)
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        total = len(cluster.primaries)
        assert f"{total}/{total} primaries healthy" in fixed.stdout
        with node_client(lock_node) as client:
            assert 0 < int(client.pttl(lock)) <= 2000
        assert LIBRARY.name in libraries_on(flushed)
        assert cli("doctor", *scope).returncode == 0
    finally:
        with node_client(lock_node) as client:
            client.delete(lock)


def test_dead_letters_and_requeue_go_to_the_streams_primary(
    cluster: LocalCluster,
) -> None:
    # Not on the startup node, which --url names.
    stream = spread_streams(cluster, f"dl-{uuid.uuid4().hex[:6]}")[1]
    keys = StreamKeys(stream, "ops")
    owner = cluster.node_for(stream)
    with node_client(owner) as client:
        client.xadd(
            keys.dead_letters,
            {
                "data": "t",
                "dead_letter_id": "1-1",
                "dead_letter_deliveries": "6",
                "dead_letter_reason": "max_deliveries exceeded",
            },
        )
    scope = ["--url", cluster.url, f"--queue={stream}", "--group", "ops"]
    elsewhere = cli("dead-letters", *scope)
    assert elsewhere.returncode == 2
    assert "Traceback" not in elsewhere.stderr
    assert "--cluster" in elsewhere.stderr

    listed = cli("dead-letters", "--cluster", *scope)
    assert listed.returncode == 0, listed.stderr
    assert f"1 dead letters in {keys.dead_letters}" in listed.stdout
    requeued = cli("requeue", "--cluster", *scope, "--all")
    assert requeued.returncode == 0, requeued.stderr
    assert f"1 requeued to {stream}" in requeued.stdout
    with node_client(owner) as client:
        assert client.xlen(stream) == 1
        assert client.xlen(keys.dead_letters) == 0
