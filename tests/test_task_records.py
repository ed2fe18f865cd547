"""A task's start and ack as a worker sends them (``task_calls.py``): what
reaches the server, and when."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis
from taskiq import TaskiqMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.receiver_hooks import StartRecorder
from tests.conftest import Server
from tests.receiver import start_as_the_receiver_does
from tests.test_broker import message
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


async def test_a_start_is_on_the_server_before_its_task_runs(
    server: Server, redis: Redis
) -> None:
    broker = await started(server)
    try:
        for body in ("first", "second"):
            await broker.kick(message(body))
        listener = broker.listen()

        async def start(delivered: object) -> list[object]:
            """As the receiver's callback does, with another callback
            ready to run beside it."""
            broker.atomic.in_flight.loaded(delivered.data)  # type: ignore[attr-defined]
            recorder = next(
                m for m in broker.middlewares if isinstance(m, StartRecorder)
            )
            await recorder.pre_execute(PARSED)
            entry_id = delivered.data.entry_id  # type: ignore[attr-defined]
            return [await redis.hget(KEYS.started, entry_id)]

        first = await asyncio.wait_for(listener.__anext__(), 5)
        assert await asyncio.create_task(start(first)) == [b"1"]
        await maybe_awaitable(first.ack())
        second = await asyncio.wait_for(listener.__anext__(), 5)
        assert await asyncio.create_task(start(second)) == [b"1"]
        entry_id = second.data.entry_id  # type: ignore[attr-defined]
        assert await redis.pttl(KEYS.started) > 0
        # A listpack would be scanned by every start (see task_records).
        assert await redis.object("encoding", KEYS.started) == b"hashtable"
        await maybe_awaitable(second.ack())
        # Forgotten with the ack.
        assert not await redis.hexists(KEYS.started, entry_id)
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()


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


async def exec_calls(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_exec", {}).get("calls", 0))


async def test_starts_made_together_go_out_as_one_transaction(
    server: Server, redis: Redis
) -> None:
    broker = await started(server)
    try:
        for body in ("a", "b", "c"):
            await broker.kick(message(body))
        listener = broker.listen()
        delivered = [await asyncio.wait_for(listener.__anext__(), 5) for _ in "abc"]
        before = await exec_calls(redis)
        await asyncio.gather(
            *(
                asyncio.create_task(start_as_the_receiver_does(broker, each))
                for each in delivered
            )
        )
        assert await exec_calls(redis) - before == 1
        ids = [each.data.entry_id for each in delivered]  # type: ignore[attr-defined]
        assert await redis.hmget(KEYS.started, ids) == [b"1"] * 3
        await asyncio.gather(*(maybe_awaitable(each.ack()) for each in delivered))
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()
