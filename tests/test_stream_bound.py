"""At defaults the stream stays bounded: real ``taskiq worker`` processes
drain thousands of tasks and the stream keeps about what is waiting and in
flight; a second, lagging consumer group loses nothing meanwhile.

The trim is the same script on every server (its matrix tests are in
``test_stream_trim``); these run on one server (``ONE_SERVER_MODULES``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.replies import text
from tests.conftest import Server
from tests.stream_bound_app import TASK_NAME, events_of, taskiq_workers

TASKS, WORKERS, KICK_BATCH = 5000, 2, 100
# What a drained stream may keep: the last node XTRIM ... ~ leaves (at most
# stream-node-max-entries, 100 by default) and the last-delivered entry.
SLACK = 101


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.2)
    return await check()


async def test_thousands_of_tasks_drained_at_defaults_leave_a_short_stream(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    queue = "bound-drain"
    producer = AtomicRedisStreamBroker(server.url, queue_name=queue)
    await producer.startup()
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, producer, {})
    longest = 0
    try:
        with taskiq_workers(server.url, queue, WORKERS, tmp_path) as logs:
            for first in range(0, TASKS, KICK_BATCH):
                runs = range(first, first + KICK_BATCH)
                await asyncio.gather(*(kicker.kiq(f"run-{n}") for n in runs))
                longest = max(longest, await redis.xlen(queue))

            async def all_ran() -> bool:
                return len(await events_of(redis, queue)) >= TASKS

            assert await wait_until(all_ran, 60), logs()

            async def short() -> bool:
                return await redis.xlen(queue) <= SLACK

            await wait_until(short, 10)
            left = await redis.xlen(queue)
            print(
                f"\n{server.label}: {TASKS} tasks drained by {WORKERS} workers;"
                f" stream longest while kicking {longest}, after {left}"
            )
            assert left <= SLACK, logs()
            assert (await redis.xpending(queue, "taskiq"))["pending"] == 0
    finally:
        await producer.shutdown()


LAGGING_TASKS, READ, ACKED = 1000, 300, 100


async def test_a_lagging_consumer_group_loses_nothing(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    """Group "audit" reads 300 of 1000 entries and acks 100 while workers
    run them all: the trim keeps every entry audit has not acked."""
    queue = "bound-lagging"
    producer = AtomicRedisStreamBroker(server.url, queue_name=queue)
    await producer.startup()
    await redis.xgroup_create(queue, "audit", id="$")
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, producer, {})
    try:
        await asyncio.gather(*(kicker.kiq(f"run-{n}") for n in range(LAGGING_TASKS)))
        entries: Any = await redis.xrange(queue)
        ids = [text(entry_id) for entry_id, _ in entries]
        await redis.xreadgroup("audit", "reader", {queue: ">"}, count=READ)
        await redis.xack(queue, "audit", *ids[:ACKED])
        with taskiq_workers(server.url, queue, 1, tmp_path) as logs:

            async def all_ran() -> bool:
                return len(await events_of(redis, queue)) >= LAGGING_TASKS

            assert await wait_until(all_ran, 30), logs()

            async def trimmed() -> bool:
                return await redis.xlen(queue) < LAGGING_TASKS

            assert await wait_until(trimmed, 10), "the trim never ran"
            kept: Any = await redis.xrange(queue, ids[ACKED])
            assert [text(entry_id) for entry_id, _ in kept] == ids[ACKED:]

            # Audit catches up: the next trim (after the next task read)
            # takes everything but the last node.
            await redis.xreadgroup("audit", "reader", {queue: ">"})
            await redis.xack(queue, "audit", *ids[ACKED:])
            await kicker.kiq("after")

            async def short() -> bool:
                return await redis.xlen(queue) <= SLACK

            assert await wait_until(short, 10), await redis.xlen(queue)
    finally:
        await producer.shutdown()
