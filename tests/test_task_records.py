"""A task's start and ack as a worker sends them on a standalone server
(pipelined): what reaches the server, and when."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from urllib.parse import urlsplit

import pytest
import redis as sync_redis
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import TaskiqMessage
from taskiq.utils import maybe_awaitable

from benchmarks.counting_proxy import TurnCountingProxy
from taskiq_atomic_claim import pipelined as pipelined_module
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.pipelined import FORGET_AFTER_S, PipelinedCalls
from taskiq_atomic_claim.receiver_hooks import StartRecorder
from tests.conftest import Server
from tests.receiver import start_as_the_receiver_does
from tests.test_broker import message
from tests.test_faults import FreezingProxy, via
from tests.test_reliability import started

KEYS = StreamKeys("taskiq", "taskiq")
PARSED = TaskiqMessage(task_id="t", task_name="t", labels={}, args=[], kwargs={})


async def until(check: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await check():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.02)
    return False


async def test_an_idle_workers_start_costs_its_task_no_turn_of_the_loop(
    server: Server, redis: Redis
) -> None:
    broker = await started(server)
    try:
        for body in ("first", "second"):
            await broker.kick(message(body))
        listener = broker.listen()

        async def start(delivered: object) -> list[str]:
            """As the receiver's callback does, with another callback
            ready to run beside it."""
            broker.atomic.in_flight.loaded(delivered.data)  # type: ignore[attr-defined]
            recorder = next(
                m for m in broker.middlewares if isinstance(m, StartRecorder)
            )
            ran: list[str] = []
            asyncio.get_running_loop().call_soon(ran.append, "another callback")
            await recorder.pre_execute(PARSED)
            return list(ran)  # what ran before the task could run

        first = await asyncio.wait_for(listener.__anext__(), 5)
        await asyncio.create_task(start(first))
        await maybe_awaitable(first.ack())  # the pipeline is idle again
        second = await asyncio.wait_for(listener.__anext__(), 5)
        assert await asyncio.create_task(start(second)) == []
        entry_id = second.data.entry_id  # type: ignore[attr-defined]

        async def counted() -> bool:
            return await redis.hget(KEYS.started, entry_id) == b"1"

        assert await until(counted, 5)
        assert await redis.pttl(KEYS.started) > 0
        # A listpack would be scanned by every start (see task_records).
        assert await redis.object("encoding", KEYS.started) == b"hashtable"
        await maybe_awaitable(second.ack())

        async def forgotten() -> bool:
            return not await redis.hexists(KEYS.started, entry_id)

        # Acked counts go in bulk, at the latest FORGET_AFTER_S later.
        assert await until(forgotten, FORGET_AFTER_S + 5)
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()


async def lone_start(server: Server) -> tuple[PipelinedCalls, Redis, socket.socket]:
    """A connected pipeline with nothing owed and no start written lately
    (so the next start is written alone), and its socket."""
    if not sys.platform.startswith("linux"):
        pytest.skip("TCP_CORK is Linux's")
    client = Redis.from_url(server.url)
    pipelined = PipelinedCalls(client)
    await asyncio.wait_for(pipelined.ack("none", "s", "g", "0-1", False), 5)
    await asyncio.sleep(pipelined_module.START_GATHER_S * 2)
    link = pipelined._link
    assert link is not None
    sock = link.transport.get_extra_info("socket")
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        await client.aclose()
        pytest.skip("corking is for TCP")
    return pipelined, client, sock


def corked(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK))


async def test_an_idle_workers_start_is_pushed_once_its_task_has_begun(
    server: Server, redis: Redis
) -> None:
    """Written alone, a start is held in the kernel (corked: its send does
    not wake the server before the task runs) until the loop next turns,
    after the task's first step; then it goes out."""
    pipelined, client, sock = await lone_start(server)
    try:
        refused: list[Exception] = []
        assert pipelined.start(KEYS.started, 60_000, "1-1", refused.append) is None
        assert corked(sock)
        await asyncio.sleep(0)
        assert not corked(sock)
        await pipelined.settled()
        assert refused == []
        assert await redis.hget(KEYS.started, "1-1") == b"1"
    finally:
        await client.aclose()


async def test_a_held_start_goes_out_while_its_task_blocks_the_loop(
    server: Server, redis: Redis
) -> None:
    """A task that never lets the loop turn (stuck in sync code) still has
    its start counted: the kernel sends corked bytes within 200 ms."""
    pipelined, client, sock = await lone_start(server)
    try:
        refused: list[Exception] = []
        assert pipelined.start(KEYS.started, 60_000, "2-1", refused.append) is None
        assert corked(sock)
        with sync_redis.Redis.from_url(server.admin_url) as observer:
            deadline = time.monotonic() + 5
            while observer.hget(KEYS.started, "2-1") is None:
                assert time.monotonic() < deadline, "held while the loop was blocked"
                time.sleep(0.02)  # noqa: ASYNC251  the task blocking the loop
        await pipelined.settled()
        assert refused == []
    finally:
        await client.aclose()


async def test_a_lone_start_never_answered_fails_its_connection(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corked start has a reply deadline like any write: a connection
    that went half-open fails within the margin, and the start hears it
    may not have counted."""
    monkeypatch.setattr(pipelined_module, "REPLY_MARGIN_S", 0.3)
    upstream = urlsplit(server.admin_url).port
    assert upstream is not None
    async with FreezingProxy(upstream) as proxy:
        client = Redis.from_url(via(server.url, proxy.port))
        try:
            pipelined = PipelinedCalls(client)
            await asyncio.wait_for(pipelined.ack("none", "s", "g", "0-1", False), 5)
            # The ack's deadline timer has run out: none is armed.
            await asyncio.sleep(0.5)
            proxy.freeze()
            refused: list[Exception] = []
            assert pipelined.start(KEYS.started, 60_000, "3-1", refused.append) is None
            await asyncio.sleep(1.0)
            assert [type(error) for error in refused] == [RedisTimeoutError]
            assert pipelined._link is None  # failed, replaced at the next write
        finally:
            await client.aclose()


async def xack_calls(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_xack", {}).get("calls", 0))


async def test_acks_made_together_go_out_as_one_xack(
    server: Server, redis: Redis
) -> None:
    broker = await started(server)
    try:
        for body in ("a", "b", "c"):
            await broker.kick(message(body))
        listener = broker.listen()
        delivered = [await asyncio.wait_for(listener.__anext__(), 5) for _ in "abc"]
        for each in delivered:
            await asyncio.create_task(start_as_the_receiver_does(broker, each))
        before = await xack_calls(redis)
        await asyncio.gather(*(maybe_awaitable(each.ack()) for each in delivered))
        assert await xack_calls(redis) - before == 1
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()


async def test_an_ack_held_for_company_goes_out_with_the_next_start(
    server: Server, redis: Redis
) -> None:
    """One write for both: held alone, the ack would go out in a write of
    its own ACK_AFTER_S later."""
    await redis.delete("taskiq-held")
    await redis.xgroup_create("taskiq-held", "g", id="0", mkstream=True)
    entry_id = "1-1"
    await redis.xadd("taskiq-held", {"data": b"x"}, id=entry_id)
    await redis.xreadgroup("g", "c", {"taskiq-held": ">"})
    if server.local is None:
        pytest.skip("turns are counted by a proxy to a server this suite started")
    async with TurnCountingProxy(server.local.port) as proxy:
        client = Redis.from_url(proxy.url)
        try:
            pipelined = PipelinedCalls(client)
            # Connected first: the handshake's turns are not counted.
            await asyncio.wait_for(pipelined.ack("none", "s", "g", "0-1", False), 5)
            proxy.reset()
            acked = asyncio.create_task(
                pipelined.ack("taskiq-held", KEYS.started, "g", entry_id, False)
            )
            await asyncio.sleep(0)  # the ack is held
            refused: list[Exception] = []
            assert pipelined.start(KEYS.started, 60_000, "9-9", refused.append) is None
            assert await asyncio.wait_for(acked, 5) == 1
            # Counted before the acked counts are forgotten (FORGET_AFTER_S).
            assert proxy.turns == 1
            assert refused == []
            assert await redis.hget(KEYS.started, "9-9") == b"1"
        finally:
            await client.aclose()


async def test_starts_made_together_under_load_share_one_write(
    server: Server, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start made within START_GATHER_S of the last write of starts waits
    for company, even with no reply owed; the first of a lull goes at once
    (in the kernel when ``start`` returns). The window is widened here so
    the test does not race it."""
    if server.local is None:
        pytest.skip("turns are counted by a proxy to a server this suite started")
    gather_s = 0.3
    monkeypatch.setattr(pipelined_module, "START_GATHER_S", gather_s)
    await redis.delete(KEYS.started)
    async with TurnCountingProxy(server.local.port) as proxy:
        client = Redis.from_url(proxy.url)
        try:
            pipelined = PipelinedCalls(client)
            # Connected first: the handshake's turns are not counted.
            await asyncio.wait_for(pipelined.ack("none", "s", "g", "0-1", False), 5)
            await asyncio.sleep(gather_s)
            proxy.reset()
            refused: list[Exception] = []
            first_at = time.monotonic()
            assert pipelined.start(KEYS.started, 60_000, "1-1", refused.append) is None
            await asyncio.sleep(0.05)  # its reply is in: nothing is owed
            later = [
                pipelined.start(KEYS.started, 60_000, f"{n}-1", refused.append)
                for n in range(2, 6)
            ]
            assert all(written is not None for written in later)
            await asyncio.wait_for(asyncio.gather(*later), 5)  # type: ignore[arg-type]
            assert time.monotonic() - first_at >= gather_s * 0.9
            turns = proxy.turns
            await pipelined.settled()  # and the first ack's count forgotten
            assert turns == 2
            assert refused == []
            counts = await redis.hmget(KEYS.started, [f"{n}-1" for n in range(1, 6)])
            assert counts == [b"1"] * 5
        finally:
            await client.aclose()
