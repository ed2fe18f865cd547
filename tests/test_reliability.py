"""Heartbeats, hand-back and server faults, each on real servers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from taskiq import AckableMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import set_idle_call
from taskiq_atomic_claim.scripts import LIBRARY, LoadMode
from taskiq_atomic_claim.stream_setup import StreamTypeError
from tests.conftest import Server, server_command
from tests.receiver import start_as_the_receiver_does
from tests.test_broker import die, message, receive

IDLE_MS, INTERVAL_MS = 600, 100


async def started(server: Server, **kwargs: Any) -> AtomicRedisStreamBroker:
    kwargs.setdefault("idle_timeout", IDLE_MS)
    kwargs.setdefault("claim_interval", INTERVAL_MS)
    kwargs.setdefault("xread_block", 200)
    broker = AtomicRedisStreamBroker(server.url, **kwargs)
    await broker.startup()
    return broker


async def group_recreated(redis: Redis) -> None:
    """Wait (bounded) until a broker has recreated the stream and its group."""
    for _ in range(100):
        if await redis.exists("taskiq") and await redis.xinfo_groups("taskiq"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the broker never recreated its consumer group")


async def blocked_in_xreadgroup(redis: Redis) -> None:
    """Wait (bounded) until a client is blocked in XREADGROUP, so a fault
    injected next lands inside the blocked read, not before it."""
    for _ in range(250):
        for client in await redis.client_list():
            if client.get("cmd") == "xreadgroup" and "b" in client.get("flags", ""):
                return
        await asyncio.sleep(0.02)
    raise AssertionError("no client ever blocked in XREADGROUP")


async def kill_other_connections(redis: Redis) -> None:
    await redis.client_setname("test-admin")
    for client in await redis.client_list():
        if client["name"] != "test-admin":
            await redis.client_kill_filter(_id=client["id"])


async def test_heartbeat_keeps_a_long_task_from_being_reclaimed(
    server: Server, redis: Redis
) -> None:
    owner = await started(server, consumer_name="owner")
    rival = await started(server, consumer_name="rival")
    try:
        await owner.kick(message("long"))
        task = await receive(owner.listen(), 2)
        assert task is not None
        # The rival claims every 100 ms for three idle_timeouts.
        assert await receive(rival.listen(), 3 * IDLE_MS / 1000) is None
        [entry] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
        assert entry["consumer"] == b"owner"
        assert entry["times_delivered"] == 1, "heartbeats must not count"
        assert owner.metrics.snapshot()["heartbeats"] >= 3
        await maybe_awaitable(task.ack())
        assert owner.atomic.in_flight["taskiq"] == set()
    finally:
        await owner.shutdown()
        await rival.shutdown()


async def test_a_heartbeat_step_that_fails_every_time_leaves_the_idle_reset(
    server: Server,
    redis: Redis,
    planted_keys: set[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Dead-lettering fails at every beat (its key holds a string: WRONGTYPE);
    # the running task beside it must still be kept from being reclaimed.
    owner = await started(server, consumer_name="owner")
    rival = await started(server, consumer_name="rival")
    dead_letters = StreamKeys("taskiq", "taskiq").dead_letters
    await redis.set(dead_letters, "not a stream")
    planted_keys.add(dead_letters)
    finish = asyncio.Event()

    async def run(delivered: AckableMessage, until: asyncio.Event | None) -> None:
        await start_as_the_receiver_does(owner, delivered)
        if until is not None:
            await until.wait()
            await maybe_awaitable(delivered.ack())

    try:
        await owner.kick(message("dropped"))
        await owner.kick(message("long"))
        listener = owner.listen()
        dropped, long = await receive(listener, 2), await receive(listener, 2)
        assert dropped is not None and long is not None
        # Its callback ends without an ack: the heartbeat dead-letters it.
        await asyncio.create_task(run(dropped, None))
        running = asyncio.create_task(run(long, finish))
        with caplog.at_level(logging.WARNING, "taskiq.atomic_claim"):
            assert await receive(rival.listen(), 3 * IDLE_MS / 1000) is None
        assert "WRONGTYPE" in caplog.text
        pending = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
        assert [entry["consumer"] for entry in pending] == [b"owner", b"owner"]
        finish.set()
        await running
    finally:
        await owner.shutdown()
        await rival.shutdown()


async def test_buffered_deliveries_are_heartbeated_too(
    server: Server, redis: Redis
) -> None:
    # XREADGROUP hands over a batch; those not yet pulled are in flight too.
    owner = await started(server, consumer_name="owner")
    rival = await started(server, consumer_name="rival")
    try:
        for number in range(3):
            await owner.kick(message(f"m{number}"))
        listener = owner.listen()
        first = await receive(listener, 2)
        assert first is not None
        assert len(owner.atomic.in_flight["taskiq"]) == 3
        assert await receive(rival.listen(), 2 * IDLE_MS / 1000) is None
    finally:
        await owner.shutdown()
        await rival.shutdown()


async def test_shutdown_hands_unacked_deliveries_back_at_once(
    server: Server, redis: Redis
) -> None:
    leaving = await started(server, consumer_name="leaving", idle_timeout=30_000)
    staying = await started(server, consumer_name="staying", idle_timeout=30_000)
    try:
        for number in range(3):
            await leaving.kick(message(f"m{number}"))
        assert await receive(leaving.listen(), 2) is not None
        assert await leaving.atomic.heartbeat.hand_back() == 3
        assert leaving.metrics.snapshot()["handed_back"] == 3
        begun = time.monotonic()
        listener = staying.listen()
        taken = [await receive(listener, 2) for _ in range(3)]
        assert all(taken), "handed-back entries are claimable before idle_timeout"
        assert time.monotonic() - begun < 30
        for item in taken:
            assert item is not None
            await maybe_awaitable(item.ack())
        pending = await redis.xpending("taskiq", "taskiq")
        assert pending["pending"] == 0
    finally:
        await leaving.shutdown()
        await staying.shutdown()


async def test_hand_back_leaves_entries_another_consumer_took(
    server: Server, redis: Redis
) -> None:
    broker = await started(server, consumer_name="slow")
    try:
        await broker.kick(message("contested"))
        assert await receive(broker.listen(), 2) is not None
        [entry_id] = broker.atomic.in_flight["taskiq"]
        await broker.atomic.heartbeat.stop()
        await redis.xclaim("taskiq", "taskiq", "thief", 0, [entry_id], justid=True)
        await broker.atomic.heartbeat.hand_back()
        [entry] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
        assert entry["consumer"] == b"thief"
        assert int(entry["time_since_delivered"]) < IDLE_MS
    finally:
        await broker.shutdown()


async def restarted_empty_after_one_message(
    broker: AtomicRedisStreamBroker, server: Server, redis: Redis
) -> tuple[AsyncGenerator[AckableMessage, None], asyncio.Future[AckableMessage]]:
    """One message read and acked, then the server restarted without
    persistence (scripts, functions, stream and group all gone) and the group
    recreated by the listener: the listener, and its next read under way."""
    assert server.local is not None
    listener = broker.listen()
    await broker.kick(message("before"))
    before = await receive(listener, 2)
    assert before is not None
    await maybe_awaitable(before.ack())
    server.restart()
    await redis.connection_pool.disconnect()  # the test's own client
    nxt = asyncio.ensure_future(listener.__anext__())
    await group_recreated(redis)
    return listener, nxt


async def test_server_restart_without_persistence_mid_run(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    if server.local is None:
        pytest.skip("needs a server this suite started")
    broker = await started(server)
    try:
        caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
        _, nxt = await restarted_empty_after_one_message(broker, server, redis)
        await broker.kick(message("after"))
        after = await asyncio.wait_for(nxt, 10)
        assert after.data == b"after"
        await maybe_awaitable(after.ack())
        gone = [r for r in caplog.records if "is gone" in r.getMessage()]
        assert len(gone) == 1, [r.getMessage() for r in caplog.records]
    finally:
        await broker.shutdown()


async def test_a_start_right_after_a_server_restart_is_counted(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker's pool keeps a connection per call it made at once (reads,
    # acks, starts, heartbeats). A restart closes them all; each one used
    # again failed its first call, and a start failing so went uncounted:
    # a task that crashes its worker at once (the soak's poison) ran
    # max_deliveries + 1 times.
    if server.local is None:
        pytest.skip("needs a server this suite started")
    broker = await started(server, max_deliveries=5)
    try:
        async with broker.atomic.connection.connect() as client:
            await asyncio.gather(*(client.type("taskiq") for _ in range(6)))
        caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
        listener, nxt = await restarted_empty_after_one_message(broker, server, redis)
        kicker = AtomicRedisStreamBroker(server.url)  # connections of its own
        await kicker.kick(message("after"))
        await kicker.shutdown()
        after = await asyncio.wait_for(nxt, 10)
        # As the receiver does, it reads on while the task starts: the read
        # holds the connection that is known to be good.
        reading = asyncio.ensure_future(listener.__anext__())
        await asyncio.sleep(0.1)
        async with broker.atomic.connection.connect() as client:
            # Calls already in flight as the task starts (acks, a heartbeat)
            # hold the connections used since the restart.
            await asyncio.gather(
                *(client.type("taskiq") for _ in range(3)),
                asyncio.create_task(start_as_the_receiver_does(broker, after)),
                return_exceptions=True,
            )
        warnings = [r.getMessage() for r in caplog.records if "start" in r.getMessage()]
        entry_id = after.data.entry_id  # type: ignore[attr-defined]
        started_hash = StreamKeys("taskiq", "taskiq").started
        assert await redis.hget(started_hash, entry_id) == b"1", warnings
        await maybe_awaitable(after.ack())
        reading.cancel()
    finally:
        await broker.shutdown()


async def test_a_start_waits_out_a_write_pause_and_is_recorded_before_its_task(
    server: Server, redis: Redis
) -> None:
    # Writes paused on the server (a failover's CLIENT PAUSE): the start
    # waits for its reply, so once the task may run its start is counted.
    broker = await started(server, max_deliveries=5)
    try:
        listener = broker.listen()
        await broker.kick(message("first"))
        await broker.kick(message("second"))
        first = await receive(listener, 2)
        second = await receive(listener, 2)
        assert first is not None and second is not None
        await maybe_awaitable(first.ack())
        await server_command(redis, "CLIENT", "PAUSE", "1000", "WRITE")
        paused_at = time.monotonic()
        await asyncio.wait_for(start_as_the_receiver_does(broker, second), 5)
        assert time.monotonic() - paused_at > 0.5, "ran before the pause ended"
        started_hash = StreamKeys("taskiq", "taskiq").started
        entry_id = second.data.entry_id  # type: ignore[attr-defined]
        assert await redis.hget(started_hash, entry_id) == b"1"
        await maybe_awaitable(second.ack())
    finally:
        await broker.shutdown()


async def test_the_first_load_of_the_library_is_no_reload(
    server: Server, redis: Redis
) -> None:
    # On Redis 8.6 the reads reclaim, so the first script a worker calls
    # (here its first ack) is what loads the library.
    await server_command(redis, "SCRIPT", "FLUSH")
    if server.info.functions:
        await server_command(redis, "FUNCTION", "FLUSH")
    broker = await started(server, consumer_name="alive")
    try:
        await broker.kick(message("first"))
        delivered = await receive(broker.listen(), 2)
        assert delivered is not None
        await maybe_awaitable(delivered.ack())
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert broker.atomic.scripts.reloads == 0
        assert broker.metrics.snapshot()["script_reloads"] == 0
    finally:
        await broker.shutdown()


async def test_script_flush_mid_run_is_transparent(
    server: Server, redis: Redis
) -> None:
    dead = await started(server, consumer_name="dead")
    alive = await started(server, consumer_name="alive")
    try:
        listener = alive.listen()
        # Mid-run: the worker has run the library (its ack) before it is lost.
        await alive.kick(message("first"))
        first = await receive(listener, 2)
        assert first is not None
        await maybe_awaitable(first.ack())
        await dead.kick(message("orphan"))
        dead_listener = dead.listen()
        assert await receive(dead_listener, 2) is not None
        await die(dead, dead_listener)
        await server_command(redis, "SCRIPT", "FLUSH")
        if await alive.atomic.scripts.mode(redis) is LoadMode.FUNCTIONS:
            await server_command(redis, "FUNCTION", "FLUSH")
        reclaimed = await receive(listener, (IDLE_MS + INTERVAL_MS) / 1000 + 2)
        assert reclaimed is not None
        await maybe_awaitable(reclaimed.ack())
        # Where reads reclaim (Redis >= 8.4) the reclaim ran no script; the
        # sweep for trimmed entries, due once per idle_timeout, is the first
        # that finds the library gone. Let it fall due before the next read.
        await asyncio.sleep(IDLE_MS / 1000 + 0.1)
        await alive.kick(message("after"))
        after = await receive(listener, 2)
        assert after is not None
        await maybe_awaitable(after.ack())
        assert alive.atomic.scripts.reloads >= 1
        assert (
            alive.metrics.snapshot()["script_reloads"] == alive.atomic.scripts.reloads
        )
    finally:
        await dead.shutdown()
        await alive.shutdown()


async def library_loads(redis: Redis, functions: bool) -> int:
    """Loads of the library the server ran since its stats were reset
    (6.2: one SCRIPT LOAD per operation, counted under SCRIPT)."""
    stats = await redis.info("commandstats")
    if functions:
        return int(stats.get("cmdstat_function|load", {}).get("calls", 0))
    calls = int(
        stats.get("cmdstat_script", stats.get("cmdstat_script|load", {})).get(
            "calls", 0
        )
    )
    return calls // len(LIBRARY.scripts)


async def test_concurrent_calls_after_a_flush_reload_the_library_once(
    server: Server, redis: Redis
) -> None:
    # Every script call in flight sees the library missing at once; the
    # acks (plain commands) need no library and land regardless.
    tasks = 40
    broker = await started(server, consumer_name="alive")
    try:
        listener = broker.listen()
        for number in range(tasks):
            await broker.kick(message(f"m{number}"))
        delivered = [await receive(listener, 2) for _ in range(tasks)]
        await maybe_awaitable(delivered[0].ack())  # type: ignore[union-attr]
        # A connection each, open already, as after a while of traffic.
        async with broker.atomic.connection.connect() as client:
            await asyncio.gather(*(client.type("taskiq") for _ in range(tasks)))
        await server_command(redis, "SCRIPT", "FLUSH")
        if server.info.functions:
            await server_command(redis, "FUNCTION", "FLUSH")
        await redis.config_resetstat()

        async def heartbeat_call() -> None:
            async with broker.atomic.connection.connect() as client:
                await broker.atomic.scripts.run(
                    client,
                    set_idle_call(
                        stream="taskiq",
                        group="taskiq",
                        consumer="alive",
                        idle_ms=0,
                        orphans="o",
                        entry_ids=["0-1"],
                    ),
                )

        await asyncio.gather(
            *(heartbeat_call() for _ in range(tasks)),
            *(maybe_awaitable(m.ack()) for m in delivered[1:] if m is not None),
        )
        loads = await library_loads(redis, server.info.functions)
        print(f"\n{tasks} concurrent script calls after a flush: {loads} loads")
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert loads == 1
        assert broker.atomic.scripts.reloads == 1
    finally:
        await broker.shutdown()


async def test_killed_connections_do_not_end_listen(
    server: Server, redis: Redis
) -> None:
    broker = await started(server)
    try:
        listener = broker.listen()
        nxt = asyncio.ensure_future(listener.__anext__())
        await asyncio.sleep(0.3)
        await kill_other_connections(redis)
        await broker.kick(message("after-kill"))
        received = await asyncio.wait_for(nxt, 10)
        assert received.data == b"after-kill"
        await maybe_awaitable(received.ack())
    finally:
        await broker.shutdown()


async def test_an_outage_is_one_log_line_and_listen_survives(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    if server.local is None:
        pytest.skip("needs a server this suite started")
    broker = await started(server)
    try:
        listener = broker.listen()
        nxt = asyncio.ensure_future(listener.__anext__())
        await asyncio.sleep(0.2)
        caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
        server.local.stop()
        await asyncio.sleep(1.5)
        server.local.start()
        await redis.connection_pool.disconnect()  # the test's own client
        await group_recreated(redis)
        await broker.kick(message("back"))
        received = await asyncio.wait_for(nxt, 15)
        assert received.data == b"back"
        await maybe_awaitable(received.ack())
        lines = [r.getMessage() for r in caplog.records]
        listen_outages = [
            line for line in lines if "consumer" in line and "unreachable" in line
        ]
        assert len(listen_outages) == 1, lines
        assert any("reachable again" in line for line in lines), lines
    finally:
        await broker.shutdown()


async def test_a_stream_key_of_another_type_fails_startup_naming_it(
    server: Server, redis: Redis
) -> None:
    await redis.set("taskiq", "not a stream", px=60_000)
    broker = AtomicRedisStreamBroker(server.url, idle_timeout=IDLE_MS)
    try:
        with pytest.raises(StreamTypeError, match="'taskiq' holds a string"):
            await broker.startup()
    finally:
        await broker.shutdown()


async def test_ack_rides_out_a_dropped_connection(server: Server, redis: Redis) -> None:
    # Found by the soak: an ack that failed once left the entry pending and
    # heartbeated forever by a worker that would never ack it again.
    broker = await started(server)
    try:
        await broker.kick(message("ack-after-drop"))
        received = await receive(broker.listen(), 2)
        assert received is not None
        await kill_other_connections(redis)
        await maybe_awaitable(received.ack())
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert broker.atomic.in_flight["taskiq"] == set()
    finally:
        await broker.shutdown()


async def test_an_ack_that_cannot_reach_the_server_stops_the_heartbeat(
    server: Server, redis: Redis
) -> None:
    if server.local is None:
        pytest.skip("needs a server this suite started")
    broker = await started(server, idle_timeout=300, claim_interval=100)
    try:
        await broker.kick(message("unackable"))
        received = await receive(broker.listen(), 2)
        assert received is not None
        server.local.stop()
        await maybe_awaitable(
            received.ack()
        )  # gives up without raising (test_faults.py)
        # Not acked, so it must become reclaimable: no heartbeat may hold it.
        assert broker.atomic.in_flight["taskiq"] == set()
    finally:
        server.local.start()
        await redis.connection_pool.disconnect()
        await broker.shutdown()


async def test_a_server_demoted_under_a_blocked_read_does_not_end_listen(
    server: Server, redis: Redis
) -> None:
    # REPLICAOF (a failover done by hand) answers blocked reads with UNBLOCKED.
    if server.local is None:
        pytest.skip("needs a server this suite started")
    broker = await started(
        server, xread_block=2000, idle_timeout=5000, claim_interval=1000
    )
    try:
        with LocalServer(server.local.binary) as other:
            listener = broker.listen()
            nxt = asyncio.ensure_future(listener.__anext__())
            await blocked_in_xreadgroup(redis)
            await server_command(redis, "REPLICAOF", "127.0.0.1", str(other.port))
            await asyncio.sleep(0.5)
            assert not nxt.done(), "listen() must ride out UNBLOCKED"
            await server_command(redis, "REPLICAOF", "NO", "ONE")
        await group_recreated(redis)
        await broker.kick(message("after-demotion"))
        received = await asyncio.wait_for(nxt, 15)
        assert received.data == b"after-demotion"
        await maybe_awaitable(received.ack())
    finally:
        await broker.shutdown()


def cancel_swallowing_connection() -> tuple[type[Connection], list[int]]:
    """Fault injection: the first cancel that lands in a read is swallowed
    and the read returns an empty reply, as redis-py 8.1 has been seen to do
    on Python 3.11. Returns the class and a list that grows per swallow."""
    swallowed: list[int] = []

    class CancelSwallowingConnection(Connection):
        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().read_response(*args, **kwargs)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)
                return None

    return CancelSwallowingConnection, swallowed


async def test_a_cancel_swallowed_inside_a_read_still_stops_listen(
    server: Server, redis: Redis
) -> None:
    connection_class, swallowed = cancel_swallowing_connection()
    broker = await started(
        server,
        connection_class=connection_class,
        idle_timeout=60_000,
        claim_interval=30_000,
        xread_block=5000,
    )
    try:
        waiting = asyncio.ensure_future(broker.listen().__anext__())
        await blocked_in_xreadgroup(redis)  # past the first claim
        waiting.cancel()
        done, _ = await asyncio.wait({waiting}, timeout=3)
        assert swallowed, "the cancel did not land in a read: nothing was tested"
        # Without the guard the loop reads on and the canceller waits forever.
        assert done and waiting.cancelled()
    finally:
        await broker.shutdown()


async def test_an_entry_taskiq_holds_is_not_yielded_again_when_reclaimed_from_self(
    server: Server, redis: Redis
) -> None:
    # A heartbeat delayed past idle_timeout (a stalled event loop) lets this
    # consumer's own claim take back an entry taskiq is still running: it is
    # ours again, and it must not be handed to taskiq a second time.
    owner = await started(server, consumer_name="owner")
    try:
        await owner.kick(message("long"))
        listener = owner.listen()
        task = await receive(listener, 2)
        assert task is not None
        await owner.atomic.heartbeat.stop()
        # Idle past idle_timeout, so the next claim takes it (from itself).
        await asyncio.sleep(2 * IDLE_MS / 1000)
        assert await receive(listener, 3 * INTERVAL_MS / 1000) is None
        [entry] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
        assert entry["consumer"] == b"owner"
        assert entry["times_delivered"] == 2, "the claim did take it back"
        await maybe_awaitable(task.ack())
        assert await redis.xpending_range("taskiq", "taskiq", "-", "+", 10) == []
    finally:
        await owner.shutdown()
