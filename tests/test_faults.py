"""Server faults never kill the heartbeat, end listen() or flood the log.

Each fault is real: the server is put out of memory (``maxmemory 1`` with
``noeviction``), demoted (``REPLICAOF`` a master that does not answer, so it
keeps its data and refuses writes), kept busy by a long script (BUSY),
stopped, or cut off by a loopback proxy
that stops forwarding while holding its connections open (a half-open TCP
connection). Faults go through the admin connection (the ``redis`` fixture);
the workers log in as the restricted worker user.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError
from taskiq import AckableMessage

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.group_recovery import GroupCreationError
from taskiq_atomic_claim.harness.embedded_server import free_port
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import requeue_dead_letters_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from tests.conftest import (
    LUA_PATH,
    NATIVE_PATH,
    Server,
    per_path,
    server_command,
    with_user,
)
from tests.proxies import FreezingProxy
from tests.test_broker import message, receive

LOGGER = "taskiq.atomic_claim"
FAULT_S = 1.5


async def started(server: Server, url: str | None = None, **kwargs: Any) -> Any:
    kwargs.setdefault("idle_timeout", 600)
    kwargs.setdefault("claim_interval", 100)
    kwargs.setdefault("xread_block", 200)
    broker = AtomicRedisStreamBroker(url or server.url, **kwargs)
    await broker.startup()
    return broker


@contextlib.asynccontextmanager
async def out_of_memory(redis: Redis) -> AsyncIterator[None]:
    """Every command that may grow memory is refused with OOM."""
    saved = await redis.config_get("maxmemory*")
    await redis.config_set("maxmemory-policy", "noeviction")
    await redis.config_set("maxmemory", 1)
    try:
        yield
    finally:
        await redis.config_set("maxmemory", str(saved["maxmemory"]))
        await redis.config_set("maxmemory-policy", str(saved["maxmemory-policy"]))


@contextlib.asynccontextmanager
async def read_only(redis: Redis) -> AsyncIterator[None]:
    """A replica of a master that never answers: its data stays, writes fail
    with READONLY (a failover's demoted primary, without the resync)."""
    await redis.replicaof("127.0.0.1", free_port())
    try:
        yield
    finally:
        await redis.replicaof("NO", "ONE")


# Counts until SCRIPT KILL: it writes nothing, so it can be killed.
_BUSY_LOOP = "local n = 0 for i = 1, tonumber(ARGV[1]) do n = n + 1 end return n"


@contextlib.asynccontextmanager
async def busy(redis: Redis) -> AsyncIterator[None]:
    """A script runs past lua-time-limit: other clients get BUSY."""
    saved = await redis.config_get("lua-time-limit")
    await redis.config_set("lua-time-limit", 100)
    # On a connection of its own from the pool; SCRIPT KILL on another.
    script = asyncio.ensure_future(redis.eval(_BUSY_LOOP, 0, 10**12))
    try:
        await asyncio.sleep(0.2)  # past lua-time-limit: BUSY from here on
        yield
    finally:
        for _ in range(50):
            with contextlib.suppress(ResponseError):  # NOTBUSY: not started yet
                await redis.script_kill()
                break
            await asyncio.sleep(0.1)
        with contextlib.suppress(ResponseError):  # "Script killed by user"
            await script
        await redis.config_set("lua-time-limit", str(saved["lua-time-limit"]))


# Error replies to every write. (Out of memory, workers' operations run:
# see the tests below.)
FAULTS = {"readonly": read_only, "busy": busy}


def outage_lines(caplog: pytest.LogCaptureFixture, who: str) -> list[str]:
    """Lines saying an outage of ``who`` (e.g. "heartbeat owner") began."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER
        and r.getMessage().startswith(who + ":")
        and "again after" not in r.getMessage()
    ]


async def acked(delivered: AckableMessage) -> None:
    outcome = delivered.ack()
    if outcome is not None:
        await outcome


async def kicked_and_received(
    broker: Any, waiting: asyncio.Future[Any], body: str
) -> None:
    """Kick ``body``; the waiting ``listen()`` must yield it. Acks it."""
    await broker.kick(message(body))
    received = await asyncio.wait_for(waiting, 10)
    assert received.data == body.encode()
    await received.ack()


async def until_logged(
    caplog: pytest.LogCaptureFixture, who: str, timeout: float = 5
) -> None:
    """Wait (bounded) until the fault reached ``who``: its outage began."""
    deadline = time.monotonic() + timeout
    while not outage_lines(caplog, who):
        if time.monotonic() > deadline:
            raise AssertionError(f"the fault did not reach {who} in {timeout} s")
        await asyncio.sleep(0.05)


class Workers:
    """Brokers and waiting ``listen()`` calls a test starts; all are stopped
    after it, so none reads on into the next test."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.brokers: list[AtomicRedisStreamBroker] = []
        self.waits: list[asyncio.Future[AckableMessage]] = []

    async def start(self, url: str | None = None, **kwargs: Any) -> Any:
        broker = await started(self.server, url, **kwargs)
        self.brokers.append(broker)
        return broker

    def next_message(
        self, broker: AtomicRedisStreamBroker
    ) -> asyncio.Future[AckableMessage]:
        wait = asyncio.ensure_future(broker.listen().__anext__())
        self.waits.append(wait)
        return wait

    async def stop(self) -> None:
        for wait in self.waits:
            wait.cancel()
        if self.waits:
            await asyncio.wait(self.waits, timeout=5)
        for broker in self.brokers:
            await broker.shutdown()


@pytest.fixture
async def workers(server: Server) -> AsyncIterator[Workers]:
    started_here = Workers(server)
    yield started_here
    await started_here.stop()


async def a_long_task_and_a_rival(
    workers: Workers, idle_ms: int
) -> tuple[Any, AckableMessage, asyncio.Future[AckableMessage]]:
    """An owner running a long task, and a rival's waiting ``listen()``
    (claiming every 100 ms) that must never get it."""
    owner = await workers.start(consumer_name="owner", idle_timeout=idle_ms)
    rival = await workers.start(consumer_name="rival", idle_timeout=idle_ms)
    await owner.kick(message("long"))
    task = await asyncio.wait_for(workers.next_message(owner), 5)
    return owner, task, workers.next_message(rival)


# The heartbeat's calls are the same on every server; the rival's claim
# differs by path.
@per_path(LUA_PATH, NATIVE_PATH)
@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_the_heartbeat_survives_an_error_reply(
    workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    # Heartbeats every 1.5 s; the fault (1.5 s from the first failed beat)
    # plus the beat interval before and a retry after it fit in idle_timeout
    # with a second to spare.
    idle_ms = 4500
    owner, task, rival_next = await a_long_task_and_a_rival(workers, idle_ms)
    caplog.set_level(logging.WARNING, LOGGER)
    async with FAULTS[fault](redis):
        await until_logged(caplog, "heartbeat owner")
        await asyncio.sleep(FAULT_S)
    beats = owner.metrics.snapshot()["heartbeats"]
    # The rival claims every 100 ms all the while.
    done, _ = await asyncio.wait({rival_next}, timeout=idle_ms / 1000 + 1.5)
    if done:
        stolen = rival_next.result()  # raises what ended the rival's listen
        pytest.fail(f"the long task was delivered twice: {stolen.data!r}")
    assert owner.metrics.snapshot()["heartbeats"] > beats, "heartbeat died"
    [entry] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
    assert entry["consumer"] == b"owner"
    assert entry["times_delivered"] == 1
    await acked(task)
    # The fault reached the heartbeat (a write) and was logged once.
    lines = outage_lines(caplog, "heartbeat owner")
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_shutdown_that_cannot_hand_back_logs_it_and_raises_nothing(
    workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    broker = await workers.start(consumer_name="leaving")
    await broker.kick(message("held"))
    assert await asyncio.wait_for(workers.next_message(broker), 5) is not None
    caplog.set_level(logging.WARNING, LOGGER)
    async with FAULTS[fault](redis):
        await broker.shutdown()  # raises nothing
    lines = [r.getMessage() for r in caplog.records if "hand back" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    # Still pending, owned by the leaver: reclaimed once idle_timeout passed.
    [entry] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
    assert entry["consumer"] == b"leaving"


async def test_out_of_memory_does_not_end_listen(
    workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # (BUSY is not tried here: a read blocked when a script starts stays
    # blocked until it ends; the heartbeat test meets BUSY.)
    # Reads and claims run out of memory: the loop sees no fault at all.
    broker = await workers.start(consumer_name="worker")
    nxt = workers.next_message(broker)
    await asyncio.sleep(0.3)
    caplog.set_level(logging.WARNING, LOGGER)
    async with out_of_memory(redis):
        await asyncio.sleep(FAULT_S)
        assert not nxt.done(), nxt.exception()
    await kicked_and_received(broker, nxt, "after-oom")
    lines = outage_lines(caplog, "consumer worker")
    assert lines == [], [r.getMessage() for r in caplog.records]


async def test_out_of_memory_requeueing_dead_letters_is_refused(redis: Redis) -> None:
    # The operator's move adds to the stream as a kick does: refused alike.
    keys = StreamKeys("taskiq", "taskiq")
    dead = text(await redis.xadd(keys.dead_letters, {"data": b"x"}))
    async with out_of_memory(redis):
        with pytest.raises(ResponseError, match="maxmemory"):
            await ScriptRunner().run(
                redis,
                requeue_dead_letters_call(
                    dead_letters=keys.dead_letters,
                    stream=keys.stream,
                    dead_letter_ids=[dead],
                ),
            )
    assert await redis.xlen(keys.dead_letters) == 1


async def test_an_ack_out_of_memory_acks_for_real(
    workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # An ack frees memory: refused, it would give up after idle_timeout / 2
    # and leave a finished task pending, to run again once memory is back.
    idle_ms = 1500
    broker = await workers.start(consumer_name="worker", idle_timeout=idle_ms)
    await broker.kick(message("finished-during-oom"))
    task = await asyncio.wait_for(workers.next_message(broker), 5)
    caplog.set_level(logging.WARNING, LOGGER)
    async with out_of_memory(redis):
        await acked(task)
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    assert outage_lines(caplog, "acks of consumer worker") == []
    # Claims every 100 ms: a pending entry would be back after idle_timeout.
    again = workers.next_message(broker)
    done, _ = await asyncio.wait({again}, timeout=idle_ms / 1000 + 1.5)
    if done:
        pytest.fail(f"acked out of memory, delivered again: {again.result().data!r}")


@per_path(LUA_PATH, NATIVE_PATH)
async def test_the_heartbeat_keeps_a_long_task_owned_out_of_memory(
    workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Out of memory for more than twice idle_timeout; the rival claims every
    # 100 ms (where reads reclaim, every read reclaims).
    idle_ms = 1500
    owner, task, rival_next = await a_long_task_and_a_rival(workers, idle_ms)
    caplog.set_level(logging.WARNING, LOGGER)
    async with out_of_memory(redis):
        beats = owner.metrics.snapshot()["heartbeats"]
        done, _ = await asyncio.wait({rival_next}, timeout=2.5 * idle_ms / 1000)
        beats_out_of_memory = owner.metrics.snapshot()["heartbeats"] - beats
    if not done:
        done, _ = await asyncio.wait({rival_next}, timeout=idle_ms / 1000 + 1.5)
    if done:
        stolen = rival_next.result()  # raises what ended the rival's listen
        pytest.fail(f"the long task was delivered twice: {stolen.data!r}")
    # A beat every idle_timeout / 3: five in 2.5 idle_timeouts, two at least
    # on a loaded machine.
    assert beats_out_of_memory >= 2, beats_out_of_memory
    assert outage_lines(caplog, "heartbeat owner") == []
    [entry] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
    assert entry["consumer"] == b"owner"
    assert entry["times_delivered"] == 1
    await acked(task)


async def xgroup_calls(redis: Redis) -> int:
    """XGROUP calls the server has run (6.2: all XGROUP; 7+: per subcommand)."""
    stats = await redis.info("commandstats")
    return sum(
        int(counts["calls"])
        for name, counts in stats.items()
        if name.startswith("cmdstat_xgroup")
    )


async def test_a_missing_group_that_cannot_heal_is_backed_off(
    workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # mkstream=False and no stream: recreating the group fails every time.
    broker = await workers.start(consumer_name="worker", mkstream=False)
    caplog.set_level(logging.WARNING, LOGGER)
    caplog.clear()  # start-up's own warnings (idle_timeout's unit) aside
    tries_before = await xgroup_calls(redis)
    nxt = workers.next_message(broker)
    await asyncio.sleep(3)
    assert not nxt.done(), nxt.exception()
    tries = await xgroup_calls(redis) - tries_before
    # Backing off from 50 ms, doubling: a handful of tries in 3 s, not
    # thousands, and one warning.
    print(f"missing group: {tries} recreation tries in 3 s")
    assert 1 <= tries <= 20, tries
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    # Healed from outside: the loop picks the group up again.
    await redis.xgroup_create("taskiq", "taskiq", id="0", mkstream=True)
    await kicked_and_received(broker, nxt, "healed")


NO_XGROUP_USER, NO_XGROUP_PASSWORD = "no-xgroup", "no-xgroup-password"


@pytest.fixture
async def no_xgroup_user(server: Server, redis: Redis) -> AsyncIterator[str]:
    """A user that may run everything but XGROUP; its URL. Tests take the
    right away from a live connection with ``deny_xgroup``."""
    await server_command(
        redis, "ACL", "SETUSER", NO_XGROUP_USER, "reset", "on",
        f">{NO_XGROUP_PASSWORD}", "~*", "&*", "+@all",
    )  # fmt: skip
    try:
        yield with_user(server.url, NO_XGROUP_USER, NO_XGROUP_PASSWORD)
    finally:
        await server_command(redis, "ACL", "DELUSER", NO_XGROUP_USER)


async def deny_xgroup(redis: Redis) -> None:
    await server_command(redis, "ACL", "SETUSER", NO_XGROUP_USER, "-xgroup")


async def test_a_group_the_user_may_not_create_fails_startup(
    server: Server, redis: Redis, no_xgroup_user: str
) -> None:
    await deny_xgroup(redis)
    broker = AtomicRedisStreamBroker(no_xgroup_user, idle_timeout=600)
    try:
        with pytest.raises(GroupCreationError, match=r"NOPERM|permission"):
            await broker.startup()
    finally:
        await broker.shutdown()


async def test_a_group_the_user_may_not_recreate_ends_listen(
    workers: Workers, redis: Redis, no_xgroup_user: str
) -> None:
    # Deleted while the worker runs, and the worker may not create it:
    # listen() raises the refusal instead of retrying for ever.
    broker = await workers.start(no_xgroup_user, consumer_name="worker")
    await deny_xgroup(redis)
    await redis.xgroup_destroy("taskiq", "taskiq")
    await redis.xadd("taskiq", {"data": "x"})
    with pytest.raises(GroupCreationError, match=r"NOPERM|permission") as raised:
        await asyncio.wait_for(workers.next_message(broker), 10)
    assert isinstance(raised.value.__cause__, NoPermissionError)


async def test_acks_giving_up_in_an_outage_log_one_line_and_raise_nothing(
    server: Server, workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    if server.local is None:
        pytest.skip("needs a server this suite started")
    broker = await workers.start(consumer_name="worker")
    for number in range(5):
        await broker.kick(message(f"m{number}"))
    listener = broker.listen()
    received = [await receive(listener, 2) for _ in range(5)]
    caplog.set_level(logging.WARNING, LOGGER)
    server.local.stop()
    try:
        # As taskiq's receiver runs them: one task per message, nobody
        # awaiting their outcome ("Task exception was never retrieved").
        acks = [asyncio.ensure_future(acked(m)) for m in received if m is not None]
        done, _ = await asyncio.wait(acks, timeout=10)
        assert len(done) == 5
        assert [a.exception() for a in acks] == [None] * 5
        lines = outage_lines(caplog, "acks of consumer worker")
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        # Not acked, so claimable again: no heartbeat may hold them.
        assert broker.atomic.in_flight["taskiq"] == set()
    finally:
        server.local.start()
        await redis.connection_pool.disconnect()
        await listener.aclose()


def via(url: str, port: int) -> str:
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    host = f"127.0.0.1:{port}"
    return urlunsplit(
        parts._replace(netloc=f"{credentials}@{host}" if credentials else host)
    )


# The frozen read is the loop's: it differs by path, not by server.
@per_path(LUA_PATH, NATIVE_PATH)
async def test_a_half_open_connection_is_noticed_without_socket_timeout(
    server: Server, workers: Workers, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = urlsplit(server.admin_url).port
    assert upstream is not None
    block_ms, idle_ms, interval_ms = 1000, 3000, 1000
    # A reply may take a read's block plus this margin (REPLY_MARGIN_S).
    margin_s = 5.0
    async with FreezingProxy(upstream) as proxy:
        # socket_timeout None: redis-py alone would wait for ever.
        broker = await workers.start(
            via(server.url, proxy.port),
            socket_timeout=None,
            consumer_name="worker",
            idle_timeout=idle_ms,
            claim_interval=interval_ms,
            xread_block=block_ms,
        )
        kicker = await workers.start(consumer_name="kicker")
        nxt = workers.next_message(broker)
        await asyncio.sleep(0.5)  # blocked in XREADGROUP
        caplog.set_level(logging.WARNING, LOGGER)
        proxy.freeze()
        frozen_at = time.monotonic()
        # If served to the frozen read, its reply never arrives: the entry
        # waits in the worker's pending list, unheartbeated, to be reclaimed.
        await kicker.kick(message("during-freeze"))
        await until_logged(caplog, "consumer worker", block_ms / 1000 + margin_s + 2)
        noticed = time.monotonic() - frozen_at
        received = await asyncio.wait_for(nxt, (idle_ms + interval_ms) / 1000 + 5)
        recovered = time.monotonic() - frozen_at
        assert received.data == b"during-freeze"
        await acked(received)
        lines = outage_lines(caplog, "consumer worker")
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        print(
            f"half-open: noticed after {noticed:.1f} s, task run after"
            f" {recovered:.1f} s"
        )
