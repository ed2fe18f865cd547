"""Kicks through outages, and never twice where the server can tell a resend.

On Redis >= 8.6 every kick carries its task id as the XADD's idempotency id
(IDMP): a resend, by the broker or by a caller with the same task id, adds
nothing. Elsewhere a kick retries only what certainly did not write, and
raises ``UncertainKickError`` on an ambiguous failure. Restarts run on
servers of this module's own, with AOF (appendfsync always), so an entry
whose XADD was answered survives the SIGKILL.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from taskiq import (
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqMessage,
    TaskiqResult,
)
from taskiq.exceptions import SendTaskError

from taskiq_atomic_claim import AtomicRedisStreamBroker, UncertainKickError
from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    ServerBinary,
    find_binaries,
    free_port,
)
from taskiq_atomic_claim.sentinel_broker import AtomicRedisStreamSentinelBroker
from tests.conftest import Server, server_command
from tests.topologies import (
    HOST,
    LocalCluster,
    LocalSentinels,
    binary_for,
    bounded,
    message,
    need,
    wait_until,
)

_BINARIES = {binary.label: binary for binary in find_binaries()}
# One server that has IDMP, one that has not.
KICK_SERVERS = ("redis-8.6.3", "redis-7.0.15")
AOF = ("--appendonly", "yes", "--appendfsync", "always")
CONCURRENCY, AFTER_FAULT, MAX_KICKS = 8, 5, 5000
# For a kick to a stopped server: its XADD times out after 1 s (reads block
# less), and it is patient enough to be resent where that is safe.
STALLED: dict[str, Any] = {
    "kick_patience": 10,
    "socket_timeout": 1.0,
    "xread_block": 100,
}


def binary(label: str) -> ServerBinary:
    found = _BINARIES.get(label)
    if found is None:
        pytest.skip(f"no {label} server binary found (see embedded_server.py)")
    return found


@pytest.fixture(params=KICK_SERVERS)
def aof_server(request: pytest.FixtureRequest) -> Iterator[LocalServer]:
    with LocalServer(binary(request.param), AOF) as server:
        yield server


def idempotent(binary: ServerBinary) -> bool:
    """Whether the server has idempotent XADD (Redis >= 8.6), from its
    version: not from the broker's own detection, which is under test."""
    major, minor = (int(part) for part in binary.version.split(".")[:2])
    return binary.flavor == "redis" and (major, minor) >= (8, 6)


async def entries_per_task(url: str, stream: str) -> collections.Counter[str]:
    """How many entries each task id (the message body here) has."""
    client = Redis.from_url(url)
    try:
        entries: list[Any] = await server_command(client, "XRANGE", stream, "-", "+")
    finally:
        await client.aclose()
    return collections.Counter(
        bytes(dict(fields)[b"data"]).decode() for _, fields in entries
    )


async def kick_all(
    broker: Any, queue: str, fault: Callable[[], object]
) -> tuple[dict[str, float], dict[str, BaseException]]:
    """Kick CONCURRENCY at a time while ``fault`` runs in a thread, and on
    until each kicker has sent AFTER_FAULT kicks after it ended (so kicks
    straddle the whole outage however fast the machine), at most MAX_KICKS:
    the accepted ones with the seconds each took, and the ones that raised
    with their error."""
    accepted: dict[str, float] = {}
    failed: dict[str, BaseException] = {}
    numbers = iter(range(MAX_KICKS))
    fault_done = asyncio.Event()

    async def kicker() -> None:
        after = 0
        for number in numbers:
            if fault_done.is_set():
                after += 1
                if after > AFTER_FAULT:
                    return
            body = f"{queue}-{number}"
            started = time.monotonic()
            try:
                await broker.kick(message(body, queue))
            except Exception as error:
                failed[body] = error
            else:
                accepted[body] = time.monotonic() - started
            await asyncio.sleep(0.01)

    async def run_fault() -> None:
        try:
            await asyncio.to_thread(fault)
        finally:
            fault_done.set()

    await asyncio.gather(run_fault(), *(kicker() for _ in range(CONCURRENCY)))
    sent = len(accepted) + len(failed)
    assert sent < MAX_KICKS, f"{MAX_KICKS} kicks did not outlast the fault"
    return accepted, failed


async def kick_through(
    broker: Any, queue: str, fault: Callable[[], object], url: Callable[[], str]
) -> tuple[dict[str, float], dict[str, BaseException], collections.Counter[str]]:
    """Kicks while ``fault`` runs (see kick_all); then the broker is shut
    down and the entries per task id counted on the server ``url`` names."""
    try:
        accepted, failed = await kick_all(broker, queue, fault)
    finally:
        await broker.shutdown()
    counts = await entries_per_task(url(), queue)
    print(
        f"\n{queue}: {len(accepted)} kicks accepted, {len(failed)} raised,"
        f" {sum(counts.values())} entries"
    )
    return accepted, failed, counts


async def kick_past_maxlen(broker: Any, queue: str, url: str) -> list[str]:
    """Kicks a, b, c, d, e with ``broker`` (maxlen 3, exact), then a again,
    whose entry is trimmed by then; the broker is shut down. The letters
    left in the stream."""
    try:
        for letter in [*"abcde", "a"]:
            await broker.kick(message(letter, queue))
    finally:
        await broker.shutdown()
    client = Redis.from_url(url)
    try:
        entries: list[Any] = await server_command(client, "XRANGE", queue, "-", "+")
    finally:
        await client.aclose()
    return [bytes(dict(fields)[b"data"]).decode() for _, fields in entries]


def left_after_maxlen(idempotent: bool) -> list[str]:
    """What kick_past_maxlen leaves. Where the server has IDMP (Redis 8.6,
    which has ACKED too) MAXLEN ... ACKED trims (no group exists to need
    these) and the stream remembers a trimmed entry's task id, so resending
    it adds nothing. Elsewhere in the suite (no ACKED) maxlen is not sent:
    nothing is trimmed and the resend is added."""
    return ["c", "d", "e"] if idempotent else ["a", "b", "c", "d", "e", "a"]


def check_enqueued(
    counts: collections.Counter[str],
    accepted: dict[str, float],
    failed: dict[str, BaseException],
    exactly_once: bool,
) -> None:
    missing = [body for body in accepted if counts[body] == 0]
    assert not missing, f"accepted kicks not enqueued: {missing}"
    if exactly_once:
        assert not failed, failed
        twice = {body: n for body, n in counts.items() if n > 1}
        assert not twice, f"enqueued more than once: {twice}"
    else:
        wrong = {
            b: e for b, e in failed.items() if not isinstance(e, UncertainKickError)
        }
        assert not wrong, f"failures other than an uncertain kick: {wrong}"


def kick_log(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """The kicks' outage lines: (when one started, when one ended)."""
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "taskiq.atomic_claim" and r.getMessage().startswith("kicks:")
    ]
    started = [line for line in lines if "retrying" in line]
    return started, [line for line in lines if "reachable again" in line]


@bounded(90)
async def test_kicks_ride_out_a_restart_with_aof(
    aof_server: LocalServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
    queue = "kicks-restart"
    broker = AtomicRedisStreamBroker(aof_server.url, queue_name=queue, kick_patience=10)

    def restart() -> None:
        time.sleep(0.5)
        aof_server.stop()  # SIGKILL
        time.sleep(1.0)
        aof_server.start()

    accepted, failed, counts = await kick_through(
        broker, queue, restart, lambda: aof_server.url
    )
    rode_out = [body for body, took in accepted.items() if took > 0.5]
    assert rode_out, "no kick was in flight during the restart"
    check_enqueued(counts, accepted, failed, exactly_once=idempotent(aof_server.binary))
    # One outage, however many kicks waited it out: one line each way.
    started, ended = kick_log(caplog)
    assert len(started) == 1, started
    assert "a kick still failing after 10 s raises" in started[0]
    assert len(ended) == 1, ended


@bounded(60)
async def test_an_ambiguous_failure_is_resent_only_where_idempotent(
    aof_server: LocalServer,
) -> None:
    # A stopped server takes the XADD into its socket and answers nothing:
    # the kick times out not knowing whether it was added (it is, once the
    # server runs again).
    queue = "kicks-ambiguous"
    broker = AtomicRedisStreamBroker(aof_server.url, queue_name=queue, **STALLED)
    await broker.kick(message("before", queue))
    assert aof_server.process is not None
    pid = aof_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        kick = asyncio.create_task(broker.kick(message("stalled", queue)))
        # Until the XADD timed out: the kick raised, or waits to resend.
        deadline = time.monotonic() + 10
        while not (kick.done() or broker.atomic.kicker.backoff.failing):
            assert time.monotonic() < deadline, "the stalled XADD never timed out"
            await asyncio.sleep(0.02)
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        if idempotent(aof_server.binary):
            await kick
        else:
            with pytest.raises(UncertainKickError, match="may have been added"):
                await kick
    finally:
        await broker.shutdown()
    counts = await entries_per_task(aof_server.url, queue)
    # Sent before the timeout, it was added once the server ran again;
    # on 8.6 the resends added nothing more.
    assert counts["stalled"] == 1, counts


async def test_a_second_kick_with_the_same_task_id(
    server: Server, redis: Redis
) -> None:
    queue = "kicks-twice"
    broker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    task = broker.register_task(lambda: None, task_name="twice")
    try:
        for _ in range(2):
            await task.kicker().with_task_id("same-id").kiq()
    finally:
        await broker.shutdown()
    entries = await server_command(redis, "XRANGE", queue, "-", "+")
    expected = 1 if server.info.idempotent_add else 2
    assert len(entries) == expected
    if server.info.idempotent_add:
        info = await redis.xinfo_stream(queue)
        assert info["idmp-duration"] == 100  # idempotency_window's default


@pytest.mark.parametrize(
    "retry",
    [
        SimpleRetryMiddleware(default_retry_count=3),
        SmartRetryMiddleware(default_retry_count=3, default_delay=0),
    ],
    ids=["simple", "smart"],
)
async def test_a_retry_middlewares_kick_is_enqueued_on_every_server(
    server: Server, redis: Redis, retry: SimpleRetryMiddleware | SmartRetryMiddleware
) -> None:
    # taskiq's retry middlewares kick a failed task again with its own task
    # id (with_task_id) and the retry's number in label _retries: a new
    # kick, which idempotency must not take for a resend of the first.
    queue = "kicks-retried"
    broker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    retry.set_broker(broker)
    task = broker.register_task(lambda: None, task_name="flaky")
    try:
        await task.kicker().with_task_id("flaky-1").kiq()
        failed = TaskiqResult(is_err=True, return_value=None, execution_time=0.1)
        # The first run failed; the same retry sent twice (a resend) is one.
        for _ in range(2):
            first = TaskiqMessage(
                task_id="flaky-1",
                task_name="flaky",
                labels={"retry_on_error": True},
                args=[],
                kwargs={},
            )
            await retry.on_error(first, failed, RuntimeError("flaky"))
    finally:
        await broker.shutdown()
    entries = await server_command(redis, "XRANGE", queue, "-", "+")
    retries = [
        broker.formatter.loads(bytes(dict(fields)[b"data"])).labels.get("_retries")
        for _, fields in entries
    ]
    expected = [None, "1"] if server.info.idempotent_add else [None, "1", "1"]
    assert retries == expected


async def test_a_resend_after_maxlen_trimmed_its_entry(
    server: Server, redis: Redis
) -> None:
    queue = "kicks-maxlen"
    broker = AtomicRedisStreamBroker(
        server.url, queue_name=queue, maxlen=3, approximate=False
    )
    left = await kick_past_maxlen(broker, queue, server.admin_url)
    assert left == left_after_maxlen(server.info.idempotent_add)


async def test_zero_patience_raises_at_once_as_taskiq_redis_does() -> None:
    broker = AtomicRedisStreamBroker(
        f"redis://127.0.0.1:{free_port()}", kick_patience=0
    )
    task = broker.register_task(lambda: None, task_name="nowhere")
    with pytest.raises(SendTaskError):
        await task.kiq()  # nothing listens on the port
    await broker.shutdown()
    assert broker.atomic.kicker.backoff.attempts == 0


@bounded(30)
async def test_a_kick_past_its_patience_raises_taskiqs_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
    broker = AtomicRedisStreamBroker(
        f"redis://127.0.0.1:{free_port()}", kick_patience=0.3
    )
    task = broker.register_task(lambda: None, task_name="nowhere")
    try:
        # Nothing listens on the port: three kicks retry, then each raises.
        results = await asyncio.gather(
            *(task.kiq() for _ in range(3)), return_exceptions=True
        )
    finally:
        await broker.shutdown()
    for result in results:
        assert isinstance(result, SendTaskError), results
        assert isinstance(result.__cause__, RedisConnectionError), result.__cause__
    assert broker.atomic.kicker.backoff.attempts > 3, "the kicks never retried"
    started, ended = kick_log(caplog)
    assert len(started) == 1, started  # one outage, three kicks: one line
    assert not ended


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("kick_patience", -1),
        ("kick_patience", "5"),
        ("kick_patience", True),
        ("idempotency_window", 0),
        ("idempotency_window", 86_401),
        ("idempotency_window", 1.5),
    ],
)
@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: AtomicRedisStreamBroker("redis://127.0.0.1:1", **kw),
        lambda **kw: AtomicRedisStreamSentinelBroker([("127.0.0.1", 1)], "m", **kw),
        lambda **kw: AtomicRedisStreamClusterBroker("redis://127.0.0.1:1", **kw),
    ],
    ids=["standalone", "sentinel", "cluster"],
)
def test_bad_kick_arguments_are_refused_naming_them(
    make: Callable[..., Any], argument: str, value: Any
) -> None:
    # At construction, before any connection (nothing listens on port 1).
    with pytest.raises(ValueError, match=f"^{argument} must be .*, got {value!r}$"):
        make(**{argument: value})


@bounded(60)
async def test_an_ambiguous_cluster_kick_is_sent_once_where_not_idempotent() -> None:
    # redis-py's cluster client resends a command it routed itself after a
    # timeout or a lost connection; a resent XADD without IDMP is a second
    # entry. The kick must be sent once and raise instead.
    with LocalCluster(need(binary_for(7), "Redis 7"), 1, 0) as cluster:
        queue = "kicks-cluster-ambiguous"
        broker = AtomicRedisStreamClusterBroker(
            cluster.url, queue_name=queue, **STALLED
        )
        node = cluster.primaries[0].server
        assert node.process is not None
        try:
            await broker.kick(message("before", queue))
            os.kill(node.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(UncertainKickError, match="may have been added"):
                    await broker.kick(message("stalled", queue))
            finally:
                os.kill(node.process.pid, signal.SIGCONT)
        finally:
            await broker.shutdown()
        # Sent before the timeout, it was added once the server ran again.
        counts = await entries_per_task(node.url, queue)
        assert counts["stalled"] == 1, counts


@pytest.mark.parametrize("major", [8, 7])
@bounded(120)
async def test_kicks_ride_out_a_sentinel_failover(major: int) -> None:
    server_binary = need(binary_for(major), f"Redis {major}")
    with LocalSentinels(server_binary) as setup:
        # Without it the old master takes writes until the sentinels demote
        # it, and drops them then: 64 of 300 accepted kicks were lost here.
        # With it, it refuses them (NOREPLICAS) once its replica left. (Set
        # on the old master only: the new one takes writes before the old
        # one has synced as its replica.)
        with SyncRedis(host=HOST, port=setup.master.port) as admin:
            admin.config_set("min-replicas-to-write", 1)
        queue = "kicks-failover"
        broker = AtomicRedisStreamSentinelBroker(
            setup.addresses, setup.master_name, queue_name=queue, kick_patience=20
        )

        def failover() -> None:
            time.sleep(0.3)
            # Planned, as an operator does one: writes paused on the old
            # master until its replica has them all. Unplanned, a write the
            # old master acked in the moment its replica was promoted is
            # lost with the replication stream (asynchronous replication:
            # 1 kick in 4 of 21 runs here, under load).
            with SyncRedis(host=HOST, port=setup.master.port) as old:
                old.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
                try:
                    wait_until("the replica has every write", caught_up, 10)
                    setup.failover()
                finally:
                    old.execute_command("CLIENT", "UNPAUSE")

        def caught_up() -> bool:
            with SyncRedis(host=HOST, port=setup.master.port) as old:
                written = old.info("replication")["master_repl_offset"]
            with SyncRedis(host=HOST, port=setup.replicas[0].port) as replica:
                return bool(replica.info("replication")["slave_repl_offset"] >= written)

        def master_url() -> str:
            return f"redis://{HOST}:{setup.master_port()}"

        accepted, failed, counts = await kick_through(
            broker, queue, failover, master_url
        )
        check_enqueued(counts, accepted, failed, exactly_once=idempotent(server_binary))
        # maxlen (and ACKED on 8.6) beside IDMP, on the new master.
        trimmed = AtomicRedisStreamSentinelBroker(
            setup.addresses,
            setup.master_name,
            queue_name=f"{queue}-maxlen",
            maxlen=3,
            approximate=False,
        )
        left = await kick_past_maxlen(trimmed, f"{queue}-maxlen", master_url())
        assert left == left_after_maxlen(idempotent(server_binary))


@bounded(120)
async def test_kicks_ride_out_a_cluster_failover() -> None:
    server_binary = need(binary_for(8), "Redis 8.6")
    with LocalCluster(server_binary) as cluster:
        queue = "kicks-cluster"
        broker = AtomicRedisStreamClusterBroker(
            cluster.url, queue_name=queue, kick_patience=20
        )
        primary = cluster.node_for(queue)
        replica = cluster.replica_for(primary)

        def failover() -> None:
            time.sleep(0.3)
            # Coordinated: the primary stops taking writes until its
            # replica has them all, so none is lost; kicks meanwhile wait
            # or are redirected (MOVED) and retried.
            with SyncRedis(host=HOST, port=replica.port) as admin:
                admin.execute_command("CLUSTER FAILOVER")
            cluster.wait_promoted(replica)

        async def resend() -> None:
            # A caller's resend of a task id already kicked, from elsewhere.
            other = AtomicRedisStreamClusterBroker(cluster.url, queue_name=queue)
            try:
                await other.kick(message(f"{queue}-0", queue))
            finally:
                await other.shutdown()

        def failover_and_resend() -> None:
            failover()
            asyncio.run(resend())

        accepted, failed, counts = await kick_through(
            broker, queue, failover_and_resend, lambda: replica.server.url
        )
        check_enqueued(counts, accepted, failed, exactly_once=idempotent(server_binary))
        # maxlen (and ACKED) beside IDMP, in the queue's hash slot: on the
        # promoted node.
        bounded_queue = f"{{{queue}}}-maxlen"
        trimmed = AtomicRedisStreamClusterBroker(
            cluster.url, queue_name=bounded_queue, maxlen=3, approximate=False
        )
        left = await kick_past_maxlen(trimmed, bounded_queue, replica.server.url)
        assert left == left_after_maxlen(idempotent(server_binary))
