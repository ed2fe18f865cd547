"""AtomicRedisStreamSentinelBroker behind real local Sentinels.

One master, one replica and three sentinels (quorum 2), all started from the
local Redis 7 binary (``tests/topologies.py``); the tests of reclaim and
failover also on Redis 8 (``on_both``). A test that fails over gets a setup
of its own: Sentinel refuses a second failover of the same master for twice
the failover timeout. Measured times are printed (``pytest -s``).
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
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim.harness.drill_app import events_stream
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LIBRARY, _library_name
from taskiq_atomic_claim.sentinel_broker import AtomicRedisStreamSentinelBroker
from taskiq_atomic_claim.server_info import (
    NATIVE_CLAIM,
    ScriptingUnavailableError,
    ServerInfo,
)
from tests.receiver import start_as_the_receiver_does
from tests.test_cli import cli
from tests.topologies import (
    HOST,
    NO_SCRIPTS_PASSWORD,
    NO_SCRIPTS_USER,
    Consumer,
    DrillWorkers,
    EventLog,
    LocalSentinels,
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
RECLAIM_BOUND_S = (IDLE_MS + INTERVAL_MS) / 1000 + 2.0

REDIS_7 = binary_for(7)
REDIS_62 = binary_for(6)
REDIS_8 = binary_for(8)

# What a setup runs on (a test's param), with the name a skip gives.
SENTINEL_SERVERS = {
    "redis-7": (REDIS_7, "Redis 7"),
    "redis-8": (REDIS_8, "Redis 8 (.ci/build-redis 8.6.3)"),
}


def on_both(setup: str) -> pytest.MarkDecorator:
    """Run the test on Redis 7 (Lua claim) and on Redis 8, where the reads
    reclaim (XREADGROUP ... CLAIM, >= 8.4) and the listen loop never calls
    claim_streams. Only tests where 8 runs other code take it: the reclaim
    itself and its acks; a reclaim across a failover, where only the reads
    follow the master; a blocked CLAIM read on a demoted master; a SIGKILLed
    worker's rerun, screened for max_deliveries by the reads. The rest
    (construction, the CLI, 6.2's script reload, the reads' master check
    between rare claims, which 7 already exercises) take the same code on
    both. About 20 s more on CI (four setups of ~2 s, ~8 s of tests)."""
    return pytest.mark.parametrize(setup, list(SENTINEL_SERVERS), indirect=True)


def local_sentinels(request: pytest.FixtureRequest) -> LocalSentinels:
    chosen = request.config.getoption("--server")
    if chosen and not any(name.startswith(f"{request.param}.") for name in chosen):
        pytest.skip(f"--server {' '.join(chosen)} leaves out {request.param}")
    binary, what = SENTINEL_SERVERS[request.param]
    return LocalSentinels(need(binary, what))


# Redis 7 unless the test says otherwise (on_both): one param for all, so
# the shared setup is not started twice.
@pytest.fixture(scope="module", params=["redis-7"])
def sentinels(request: pytest.FixtureRequest) -> Iterator[LocalSentinels]:
    """Shared by the tests that do not fail over."""
    with local_sentinels(request) as started:
        yield started


@pytest.fixture(params=["redis-7"])
def own_sentinels(request: pytest.FixtureRequest) -> Iterator[LocalSentinels]:
    with local_sentinels(request) as started:
        yield started


@pytest.fixture(scope="module")
def events_server() -> Iterator[LocalServer]:
    with LocalServer(need(REDIS_7, "Redis 7")) as server:
        yield server


class Brokers(StartedBrokers):
    """Sentinel brokers started for one test; all shut down at its end."""

    async def __call__(
        self, setup: LocalSentinels, queue: str, name: str, **kwargs: Any
    ) -> AtomicRedisStreamSentinelBroker:
        kwargs.setdefault("idle_timeout", IDLE_MS)
        kwargs.setdefault("claim_interval", INTERVAL_MS)
        kwargs.setdefault("xread_block", 500)
        broker = AtomicRedisStreamSentinelBroker(
            setup.addresses,
            setup.master_name,
            queue_name=queue,
            consumer_name=name,
            consumer_id="0",
            **kwargs,
        )
        return await self.start(broker)


@pytest.fixture
async def make_broker() -> AsyncIterator[Brokers]:
    async with Brokers() as brokers:
        yield brokers


async def kick(broker: Any, queue: str, count: int, tag: str) -> set[str]:
    bodies = {f"{tag}-{number}" for number in range(count)}
    for body in sorted(bodies):
        await broker.kick(message(body, queue))
    return bodies


def master_client(setup: LocalSentinels) -> SyncRedis:
    return SyncRedis(host=HOST, port=setup.master_port())


def pending_on_master(setup: LocalSentinels, queue: str) -> int:
    with master_client(setup) as client:
        summary: Any = client.xpending(queue, "taskiq")
    return int(summary["pending"])


async def drained(setup: LocalSentinels, queue: str, timeout: float = 15) -> bool:
    """Whether the group's PEL on the current master empties in time. After a
    failover, entries claimed or acked on the old master in its last moments
    are pending again on the new one, and run once more: wait for that."""
    for _ in range(int(timeout / 0.1)):
        if await asyncio.to_thread(pending_on_master, setup, queue) == 0:
            return True
        await asyncio.sleep(0.1)
    return False


def expected_path(setup: LocalSentinels) -> str:
    return ServerInfo("Redis", setup.binary.version).reclaim_path


def reset_command_stats(setup: LocalSentinels) -> None:
    for server in setup.servers:
        with SyncRedis(host=HOST, port=server.port) as client:
            client.config_resetstat()


def assert_claims_took_the_servers_path(
    setup: LocalSentinels, *, idle_found: bool = True
) -> None:
    """Since the servers started (or ``reset_command_stats``), the brokers
    claimed on the path the servers' version allows, seen on every server,
    whichever was master: only the Lua claim calls XAUTOCLAIM (counted in
    INFO commandstats from inside a function too; replicas get XCLAIM). On
    Redis >= 8.4 not once, so a test cannot pass on the Lua path there.
    Without ``idle_found`` nothing was idle, so the Lua path's look for idle
    entries sent no claim either."""
    calls = 0
    for server in setup.servers:
        with SyncRedis(host=HOST, port=server.port) as client:
            stats: Any = client.info("commandstats")
        calls += int(stats.get("cmdstat_xautoclaim", {}).get("calls", 0))
    if expected_path(setup) == NATIVE_CLAIM:
        assert calls == 0, "Redis >= 8.4: the reads reclaim, no claim script"
    elif idle_found:
        assert calls > 0, "the Lua claim reclaims"


def replicate(setup: LocalSentinels) -> float:
    master = setup.master_port()
    replicas = [s.port for s in setup.servers if s.port != master and s.process]
    return wait_replicated(master, replicas)


# Construction: no server needed.


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"idle_timeout": 1000, "claim_interval": 1000}, "claim_interval"),
        ({"unacknowledged_batch_size": 0}, "unacknowledged_batch_size"),
        ({"max_deliveries": 0}, "max_deliveries"),
        ({"xread_count": 0}, "xread_count"),
        ({"consumer_group_name": ""}, "consumer_group_name"),
        ({"master_name": ""}, "master_name"),
    ],
)
def test_arguments_are_checked_as_the_standalone_broker_checks_them(
    kwargs: dict[str, Any], names: str
) -> None:
    kwargs.setdefault("master_name", "m")
    with pytest.raises(ValueError, match=names):
        AtomicRedisStreamSentinelBroker([(HOST, 1)], **kwargs)


def test_parent_arguments_keep_their_positions() -> None:
    broker = AtomicRedisStreamSentinelBroker(
        [(HOST, 1)], "m", 1, "jobs", "workers", "me", "0", False, 3000
    )
    assert (broker.master_name, broker.queue_name) == ("m", "jobs")
    assert (broker.consumer_group_name, broker.consumer_name) == ("workers", "me")
    assert (broker.consumer_id, broker.mkstream, broker.block) == ("0", False, 3000)
    assert broker.atomic.settings.idle_timeout == 5000


# On the shared setup.


@bounded(30)
async def test_startup_refuses_a_master_that_runs_no_scripts_for_this_user(
    sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    # As the standalone broker does: at start-up, not at the first ack.
    refused = pytest.raises(ScriptingUnavailableError, match="refused for this user")
    with user_without_scripting([sentinels.master_port()]), refused:
        await make_broker(
            sentinels,
            "noscripts",
            "refused",
            username=NO_SCRIPTS_USER,
            password=NO_SCRIPTS_PASSWORD,
        )


@on_both("sentinels")
@bounded(60)
async def test_a_dead_consumers_entries_are_reclaimed_through_sentinel(
    sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    reset_command_stats(sentinels)
    queue = f"reclaim-{uuid.uuid4().hex[:6]}"
    first = await make_broker(sentinels, queue, "first")
    second = await make_broker(sentinels, queue, "second")
    bodies = await kick(first, queue, 5, "a")
    doomed = Consumer(first, ack=False)
    assert await doomed.wait_for(bodies, 10)
    await doomed.die()
    died = time.monotonic()

    survivor = Consumer(second)
    recovered = await survivor.wait_for(bodies, RECLAIM_BOUND_S + 1)
    assert recovered is not None, sorted(bodies - set(survivor.bodies))
    print(f"\nsentinel: 5 entries reclaimed {recovered - died:.2f} s after the kill")
    assert recovered - died <= RECLAIM_BOUND_S
    await survivor.stop()
    assert pending_on_master(sentinels, queue) == 0
    assert second.atomic.path.reclaim_path == expected_path(sentinels)
    assert second.metrics.snapshot()["claimed"] == len(bodies)
    assert_claims_took_the_servers_path(sentinels)
    assert unexpiring_keys([sentinels.master_port()]) == []


@bounded(60)
async def test_a_consumed_stream_is_trimmed_through_sentinel(
    sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    """200 entries fill several nodes, so XTRIM ... ~ has some to remove."""
    queue = f"trim-{uuid.uuid4().hex[:6]}"
    broker = await make_broker(sentinels, queue, "trimmer")
    bodies = await kick(broker, queue, 200, "t")
    consumer = Consumer(broker)
    assert await consumer.wait_for(bodies, 20)

    def length() -> int:
        with master_client(sentinels) as client:
            return int(client.xlen(queue))

    for _ in range(100):
        if length() < 200:
            break
        await asyncio.sleep(0.1)
    await consumer.stop()
    assert length() < 200
    assert unexpiring_keys([sentinels.master_port()]) == []


def connections_received(port: int) -> int:
    with SyncRedis(host=HOST, port=port) as client:
        stats: Any = client.info("stats")
    # Less this look-up's own connection.
    return int(stats["total_connections_received"]) - 1


@bounded(60)
async def test_a_broker_keeps_its_connections_across_tasks(
    sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    """Start records, heartbeats and acks reuse the broker's pooled
    connections to the master: the count of new connections does not grow
    with the tasks run."""
    tasks = 40
    queue = f"pooled-{uuid.uuid4().hex[:6]}"
    broker = await make_broker(sentinels, queue, "pooled")
    master = sentinels.master_port()
    sentinel_ports = [sentinel.port for sentinel in sentinels.sentinels]
    # Kicks open a client each, as the parent's do: counted out.
    bodies = await kick(broker, queue, tasks, "t")
    before = connections_received(master)
    sentinels_before = sum(map(connections_received, sentinel_ports))
    listener = broker.listen()
    delivered = [await anext(listener) for _ in range(tasks)]
    finish = asyncio.Event()
    # One ack at a time: concurrent calls may each need a connection of
    # their own, once.
    one_at_a_time = asyncio.Lock()

    async def run(received: Any) -> None:
        await start_as_the_receiver_does(broker, received)
        await finish.wait()
        async with one_at_a_time:
            await received.ack()

    running = [asyncio.create_task(run(received)) for received in delivered]
    # Running past three heartbeats (one every idle_timeout / 3).
    await asyncio.sleep(IDLE_MS / 1000 * 1.2)
    finish.set()
    await asyncio.gather(*running)
    await listener.aclose()
    new = connections_received(master) - before
    to_sentinels = sum(map(connections_received, sentinel_ports)) - sentinels_before
    print(
        f"\n{tasks} tasks read, started, heartbeated, acked: {new} new"
        f" connections to the master, {to_sentinels} to the sentinels"
    )
    assert {text(received.data) for received in delivered} == bodies
    assert pending_on_master(sentinels, queue) == 0
    assert broker.metrics.snapshot()["heartbeats"] >= 2
    # A few: the listen loop's blocking read beside the concurrent calls.
    assert new <= 5
    # At most one to each sentinel from the broker's look-ups and one from
    # the liveness thread's own Sentinel client (its own loop: it shares no
    # connection with the broker's); none per task.
    assert to_sentinels <= 2 * len(sentinel_ports)


# Failovers: each on a setup of its own.


@on_both("own_sentinels")
@bounded(120)
async def test_forced_failover_mid_run_nothing_lost(
    own_sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    setup = own_sentinels
    queue = "failover"
    doomed_broker = await make_broker(setup, queue, "doomed")
    survivor_broker = await make_broker(setup, queue, "survivor")
    before = await kick(doomed_broker, queue, 10, "before")
    doomed = Consumer(doomed_broker, ack=False)
    assert await doomed.wait_for(before, 10)
    await doomed.die()
    # What was written before the failover must be on the replica, or the
    # failover itself would lose it.
    await asyncio.to_thread(replicate, setup)

    survivor = Consumer(survivor_broker)
    old_master = setup.master_port()
    started = time.monotonic()
    new_master, took = await asyncio.to_thread(setup.failover)
    after = await kick(survivor_broker, queue, 10, "after")
    everything = before | after
    done = await survivor.wait_for(everything, 30)
    assert done is not None, sorted(everything - set(survivor.bodies))
    with SyncRedis(host=HOST, port=old_master) as client:
        old_role = client.execute_command("ROLE")[0].decode()
    assert await drained(setup, queue)
    await survivor.stop()

    after_at = [t for t, body in survivor.received if body in after]
    print(
        f"\nSENTINEL FAILOVER: sentinels named the new master {took:.2f} s after"
        f" the command; entries kicked after it handled by"
        f" {max(after_at) - started:.2f} s, all {len(everything)} by"
        f" {done - started:.2f} s (old master still {old_role});"
        f" {len(survivor.bodies) - len(set(survivor.bodies))} duplicates;"
        f" library reloads {survivor_broker.atomic.scripts.reloads}"
    )
    # The loop left the old master within a claim interval, not when the
    # sentinels demoted it: entries kicked to the new master were handled
    # while the old one was still a master.
    assert old_role == "master"
    with SyncRedis(host=HOST, port=new_master) as client:
        libraries = [_library_name(e) for e in client.execute_command("FUNCTION LIST")]
    assert LIBRARY.name in libraries
    assert survivor_broker.atomic.path.reclaim_path == expected_path(setup)
    assert survivor_broker.metrics.snapshot()["claimed"] >= len(before)
    assert_claims_took_the_servers_path(setup)
    assert unexpiring_keys([new_master]) == []


@bounded(60)
async def test_a_connection_held_across_a_failover_moves_in_one_connect(
    own_sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    # A connection busy when the pool learned of the new master (a blocked
    # read) goes back to it still on the old one; its next command must
    # reach the new master through one look-up and one connect, not retry
    # the old address from inside its own handshake.
    setup = own_sentinels
    broker = await make_broker(setup, "held", "holder")
    async with broker.atomic.connection.connect() as client:
        pool = client.connection_pool
        held = await pool.get_connection()
        try:
            await held.send_command("PING")
            await held.read_response()
            old_master = setup.master_port()
            new_master, _ = await asyncio.to_thread(setup.failover)
            await pool.get_master_address()
            old_before = connections_received(old_master)
            await held.send_command("ROLE")
            role = await held.read_response()
        finally:
            await pool.release(held)
    # Retrying the old address from inside each handshake opened dozens
    # (until RecursionError). The three sentinels reconfiguring it open
    # theirs meanwhile (a command and a pub/sub link each, at most): 14 - 11
    # in a loaded run here.
    assert connections_received(old_master) - old_before <= 7
    assert (held.host, held.port) == (HOST, new_master)
    assert text(role[0]) == "master"


@on_both("own_sentinels")
@bounded(120)
async def test_a_read_blocked_on_a_demoted_master_reconnects(
    own_sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    # A claim interval longer than the whole test: only the UNBLOCKED reply
    # (not the once-per-claim-interval check) can move the loop. On Redis 8
    # the blocked read is XREADGROUP ... CLAIM, which the server also wakes
    # when an entry turns idle: demotion must still unblock it.
    setup = own_sentinels
    queue = "unblocked"
    broker = await make_broker(
        setup,
        queue,
        "blocked",
        idle_timeout=60_000,
        claim_interval=30_000,
        xread_block=30_000,
        socket_timeout=60,
    )
    consumer = Consumer(broker)
    assert await consumer.wait_for(await kick(broker, queue, 1, "first"), 10)
    await asyncio.to_thread(replicate, setup)
    old_master = setup.master_port()
    new_master, _ = await asyncio.to_thread(setup.failover)
    # Demote the old master now, as the sentinels would some seconds later:
    # the read blocked on it gets UNBLOCKED.
    with SyncRedis(host=HOST, port=old_master) as client:
        client.execute_command("REPLICAOF", HOST, new_master)
    later = await kick(broker, queue, 1, "later")
    handled = await consumer.wait_for(later, 15)
    assert handled is not None, consumer.bodies
    assert not consumer.task.done()
    await consumer.stop()
    assert broker.atomic.path.reclaim_path == expected_path(setup)
    assert_claims_took_the_servers_path(setup, idle_found=False)


@bounded(120)
async def test_reads_leave_a_replaced_master_between_rare_claims(
    own_sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    # Claims 30 s apart (as idle_timeout / 4 makes them) and the old master
    # left running: only the reads' own master check moves the loop before
    # the sentinels demote the old master (~10 s) or the next claim (30 s).
    setup = own_sentinels
    queue = "rare-claims"
    broker = await make_broker(
        setup, queue, "reader", idle_timeout=120_000, claim_interval=30_000
    )
    consumer = Consumer(broker)
    assert await consumer.wait_for(await kick(broker, queue, 1, "first"), 10)
    await asyncio.to_thread(replicate, setup)
    await asyncio.to_thread(setup.failover)
    later = await kick(broker, queue, 1, "later")
    handled = await consumer.wait_for(later, 5)
    assert handled is not None, consumer.bodies
    await consumer.stop()


@bounded(120)
async def test_a_busy_worker_heartbeats_and_acks_on_the_new_master(
    own_sentinels: LocalSentinels, make_broker: Brokers
) -> None:
    # Every slot busy: listen() is parked and never checks the master. The
    # heartbeat and the ack must still reach the new master, not the old
    # one, which keeps taking writes until the sentinels demote it (~10 s)
    # and whose writes are then thrown away.
    setup = own_sentinels
    queue = "busy"
    broker = await make_broker(setup, queue, "busy")
    await kick(broker, queue, 1, "long")
    listener = broker.listen()
    delivered: Any = await anext(listener)
    finish = asyncio.Event()

    async def run() -> None:
        await start_as_the_receiver_does(broker, delivered)
        await finish.wait()
        await delivered.ack()

    running = asyncio.create_task(run())
    await asyncio.to_thread(replicate, setup)
    new_master, _ = await asyncio.to_thread(setup.failover)
    # Three idle_timeouts: a heartbeat landing anywhere else lets the entry
    # turn idle on the new master.
    with SyncRedis(host=HOST, port=new_master) as client:
        idle_ms: list[int] = []
        for _ in range(15):
            await asyncio.sleep(IDLE_MS / 5000)
            [entry] = client.xpending_range(queue, "taskiq", "-", "+", 10)
            idle_ms.append(int(entry["time_since_delivered"]))
    print(f"\nidle ms on the new master after a failover: {idle_ms}")
    assert max(idle_ms[5:]) < IDLE_MS, idle_ms
    finish.set()
    await running
    await listener.aclose()
    assert pending_on_master(setup, queue) == 0


DRILL_IDLE_MS, DRILL_INTERVAL_MS = 2000, 500
DRILL_BOUND_S = (DRILL_IDLE_MS + DRILL_INTERVAL_MS) / 1000 + 2.0


async def _drill(
    setup: LocalSentinels,
    events_server: LocalServer,
    tmp_path: Path,
    *,
    failover: bool,
    at_defaults: bool = False,
) -> float:
    """A worker SIGKILLed while it runs a task, a fresh one started (while
    a forced failover runs, with ``failover``): seconds from the kill to the
    task's start in the fresh worker."""
    queue = f"drill-{uuid.uuid4().hex[:8]}"
    run = "round-0"
    env = {
        "TAC_TOPOLOGY": "sentinel",
        "TAC_TOPOLOGY_NODES": ",".join(f"{h}:{p}" for h, p in setup.addresses),
        "TAC_TOPOLOGY_MASTER": setup.master_name,
        "TAC_DRILL_QUEUE": queue,
        # Empty: no reclaim setting in the workers' app.
        "TAC_DRILL_IDLE_TIMEOUT": "" if at_defaults else str(DRILL_IDLE_MS),
        "TAC_DRILL_CLAIM_INTERVAL": "" if at_defaults else str(DRILL_INTERVAL_MS),
        "TAC_DRILL_EVENTS_URL": events_server.url,
    }
    events = EventLog(events_server.url, events_stream(queue))
    kicker = AtomicRedisStreamSentinelBroker(
        setup.addresses, setup.master_name, queue_name=queue
    )
    try:
        with master_client(setup) as client:
            client.xgroup_create(queue, "taskiq", id="0", mkstream=True)
        with DrillWorkers(env, tmp_path) as workers:
            workers.start("doomed")
            assert await events.wait_for("ready", 30, worker="doomed"), workers.log(
                "doomed"
            )
            task: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker, {})
            await task.kiq(run, 1.0)
            delivered = await events.wait_for("started", 15, run, "doomed")
            assert delivered is not None, workers.log("doomed")
            if failover:
                await asyncio.to_thread(replicate, setup)
            workers.kill("doomed")
            killed = time.monotonic()
            if failover:
                # The replacement starts while the failover runs: it may
                # first reach the old master and must follow the sentinels
                # from there.
                running = asyncio.create_task(asyncio.to_thread(setup.failover))
            workers.start("fresh")
            if failover:
                _, took = await running
                print(f"\nsentinel drill: new master named {took:.2f} s after")
            rerun = await events.wait_for("started", 40, run, "fresh")
            assert rerun is not None, workers.log("fresh")
            finished = await events.wait_for("finished", 15, run, "fresh")
            assert finished is not None, workers.log("fresh")
            assert await drained(setup, queue), workers.log("fresh")
        assert_claims_took_the_servers_path(setup)
        print(
            f"\nsentinel drill: SIGKILL -> rerun {rerun - killed:.2f} s"
            f" (first delivery -> rerun {rerun - delivered:.2f} s)"
        )
        return rerun - killed
    finally:
        await kicker.shutdown()
        await events.aclose()


@on_both("own_sentinels")
@bounded(120)
async def test_crash_drill_across_a_forced_failover(
    own_sentinels: LocalSentinels, events_server: LocalServer, tmp_path: Path
) -> None:
    took = await _drill(own_sentinels, events_server, tmp_path, failover=True)
    assert took <= DRILL_BOUND_S


@on_both("sentinels")
@bounded(120)
async def test_crash_drill_at_defaults(
    sentinels: LocalSentinels, events_server: LocalServer, tmp_path: Path
) -> None:
    # What a user who only swapped the class gets, on either path.
    took = await _drill(
        sentinels, events_server, tmp_path, failover=False, at_defaults=True
    )
    assert took <= 10.0


@pytest.fixture
def sentinels_62() -> Iterator[LocalSentinels]:
    with LocalSentinels(need(REDIS_62, "Redis 6.2")) as started:
        yield started


@pytest.mark.slow
@bounded(120)
async def test_redis_62_failover_reloads_cached_scripts_if_missing(
    sentinels_62: LocalSentinels, make_broker: Brokers
) -> None:
    setup = sentinels_62
    queue = "scripts"
    doomed_broker = await make_broker(setup, queue, "doomed")
    survivor_broker = await make_broker(setup, queue, "survivor")
    bodies = await kick(doomed_broker, queue, 5, "a")
    doomed = Consumer(doomed_broker, ack=False)
    assert await doomed.wait_for(bodies, 10)
    await doomed.die()
    await asyncio.to_thread(replicate, setup)
    survivor = Consumer(survivor_broker)
    new_master, _ = await asyncio.to_thread(setup.failover)
    reloads = survivor_broker.atomic.scripts.reloads
    # 6.2 may or may not have replicated SCRIPT LOAD; either way, gone now.
    with SyncRedis(host=HOST, port=new_master) as client:
        client.execute_command("SCRIPT", "FLUSH")
    for _ in range(100):
        if survivor_broker.atomic.scripts.reloads > reloads:
            break
        await asyncio.sleep(0.05)
    assert survivor_broker.atomic.scripts.reloads > reloads
    assert await survivor.wait_for(bodies, 20)
    later = await kick(survivor_broker, queue, 2, "later")
    assert await survivor.wait_for(later, 10)
    assert await drained(setup, queue)
    await survivor.stop()


def test_load_and_check_through_sentinel_act_on_the_master(
    sentinels: LocalSentinels,
) -> None:
    where = [f"--sentinel=127.0.0.1:{port}" for _, port in sentinels.addresses]
    args = [*where, "--master", sentinels.master_name, "--url", "redis://unused:1"]
    with SyncRedis(port=sentinels.master.port) as master:
        master.execute_command("FUNCTION", "FLUSH")
    assert cli("check", *args).returncode == 1
    loaded = cli("load", *args)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert f":{sentinels.master.port}" in loaded.stdout
    assert cli("check", *args).returncode == 0
    assert cli("load", "--sentinel=127.0.0.1:1", "--url", "redis://x:1").returncode == 2


def test_inspect_and_doctor_through_sentinel_act_on_the_master(
    sentinels: LocalSentinels,
) -> None:
    stream = f"seen-{uuid.uuid4().hex[:6]}"
    port = sentinels.master_port()
    with SyncRedis(port=port) as master:
        master.xgroup_create(stream, "ops", id="0", mkstream=True)
        master.xadd(stream, {"data": "x"})
        master.xreadgroup("ops", "w1", {stream: ">"})
        master.execute_command("FUNCTION", "FLUSH")
    # No --url: the sentinels say where the master is.
    args = [
        *[f"--sentinel=127.0.0.1:{p}" for _, p in sentinels.addresses],
        "--master",
        sentinels.master_name,
        f"--queue={stream}",
        "--group",
        "ops",
    ]
    table = cli("inspect", *args)
    assert table.returncode == 0, table.stdout + table.stderr
    assert f"master {sentinels.master_name!r} at 127.0.0.1:{port}" in table.stdout
    assert f"stream {stream!r}" in table.stdout

    report = json.loads(cli("inspect", "--json", *args).stdout)
    assert report["node"] == f"127.0.0.1:{port}"
    assert [view["stream"] for view in report["streams"]] == [stream]
    assert report["streams"][0]["groups"][0]["pending"] == 1

    # The consumer the setup left holding an entry is not this test's
    # subject: never judged dead within it, however slow the machine.
    args += ["--idle-timeout-ms", "600000"]
    found = cli("doctor", *args)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "[library]" in found.stdout
    assert "load --sentinel HOST:PORT --master NAME`" in found.stdout
    fixed = cli("doctor", "--fix", *args)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    with SyncRedis(port=port) as master:
        listing = master.execute_command("FUNCTION", "LIST")
    assert LIBRARY.name in [_library_name(entry) for entry in listing]


def test_sentinel_options_must_come_whole() -> None:
    missing_master = cli("inspect", "--sentinel=127.0.0.1:1")
    assert missing_master.returncode == 2
    assert "--master" in missing_master.stderr
    neither = cli("doctor")
    assert neither.returncode == 2
    assert "--url" in neither.stderr and "--sentinel" in neither.stderr
    both = cli("inspect", "--cluster", "--sentinel=127.0.0.1:1", "--master", "m")
    assert both.returncode == 2
    assert "--cluster" in both.stderr
