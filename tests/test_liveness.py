"""Liveness is the process, not its event loop: a task that blocks its
worker's loop is never run elsewhere while that process lives, and a
SIGKILLed worker's task runs again within seconds at the defaults. Real
``taskiq worker`` processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.doctor import Liveness, consumer_liveness
from taskiq_atomic_claim.admin.inspection import inspect_stream
from taskiq_atomic_claim.harness.drill import Events
from taskiq_atomic_claim.harness.drill_app import TASK_NAME, events_stream
from taskiq_atomic_claim.keys import PREFIX
from taskiq_atomic_claim.settings import DEFAULT_IDLE_TIMEOUT_MS
from tests.conftest import Server, server_command, with_user
from tests.liveness_app import BLOCKING_TASK
from tests.proxies import CuttingProxy
from tests.test_broker import message
from tests.test_faults import via
from tests.test_started_semantics import stopped_at_exit, taskiq_worker

# What the defaults promise (README): a killed worker's task runs again
# within this many seconds.
DEFAULT_RECOVERY_S = 10.0


class LivenessQueue:
    def __init__(
        self, server: Server, redis: Redis, log_dir: Path, idle_timeout: int | None
    ) -> None:
        self.name = f"taskiq-atomic-claim-drill-{uuid.uuid4().hex[:8]}"
        self.url = server.url
        self.log_dir = log_dir
        self.idle_timeout = idle_timeout
        self.events = Events(redis, events_stream(self.name))
        self.kicker = AtomicRedisStreamBroker(server.url, queue_name=self.name)

    def worker(self, name: str, url: str = "") -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "TAC_TEST_URL": url or self.url,
            "TAC_TEST_EVENTS_URL": self.url,
            "TAC_TEST_QUEUE": self.name,
            "TAC_TEST_WORKER": name,
            "TAC_TEST_IDLE_TIMEOUT": str(self.idle_timeout or ""),
        }
        return taskiq_worker(
            "tests.liveness_app:broker", self.log_dir / f"{name}.log", env
        )

    async def kick(self, task: str, *args: Any) -> None:
        kicker: AsyncKicker[Any, Any] = AsyncKicker(task, self.kicker, {})
        await kicker.kiq(*args)

    async def ready(self, *workers: str) -> None:
        deadline = time.monotonic() + 60
        for name in workers:
            seen = await self.events.wait_for("ready", deadline, worker=name)
            assert seen is not None, f"worker {name} never started"

    def starts(self, run_id: str) -> list[str]:
        return [
            worker
            for _, event, run, worker in self.events.seen
            if (event, run) == ("started", run_id)
        ]


@contextlib.asynccontextmanager
async def liveness_queue(
    server: Server, redis: Redis, log_dir: Path, idle_timeout: int | None = None
) -> AsyncIterator[LivenessQueue]:
    queue = LivenessQueue(server, redis, log_dir, idle_timeout)
    # Before the first kick: a worker's startup creates the group at "$".
    await redis.xgroup_create(queue.name, "taskiq", id="0", mkstream=True)
    try:
        yield queue
    finally:
        await queue.kicker.shutdown()


async def test_a_task_blocking_its_loop_past_idle_timeout_runs_once(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # A sync client inside an async task: the loop stands still five times
    # idle_timeout, while an idle worker beside it claims every 250 ms.
    idle_ms = 1000
    async with liveness_queue(server, redis, tmp_path, idle_ms) as queue:
        with stopped_at_exit() as workers:
            workers += [queue.worker("one"), queue.worker("two")]
            await queue.ready("one", "two")
            await queue.kick(BLOCKING_TASK, "blocker", 5 * idle_ms / 1000)
            deadline = time.monotonic() + 30
            finished = await queue.events.wait_for("finished", deadline, "blocker")
            assert finished is not None, "the blocking task never finished"
            # Room for a wrong second start.
            await queue.events.wait_for("never", time.monotonic() + 2 * idle_ms / 1000)
        assert len(queue.starts("blocker")) == 1, queue.starts("blocker")
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0


@pytest.mark.parametrize("looking", [False, True], ids=["any", "the fleet's looker"])
async def test_a_killed_workers_task_runs_again_within_seconds_at_defaults(
    server: Server, redis: Redis, tmp_path: Path, looking: bool
) -> None:
    # No reclaim setting in the app: what a user who only swapped the class
    # gets. The survivor is idle when its peer dies.
    async with liveness_queue(server, redis, tmp_path) as queue:
        with stopped_at_exit() as workers:
            workers += [queue.worker("one"), queue.worker("two")]
            await queue.ready("one", "two")
            await queue.kick(TASK_NAME, "victim", 60.0)
            deadline = time.monotonic() + 30
            assert await queue.events.wait_for("started", deadline, "victim")
            [doomed] = queue.starts("victim")
            process = workers[["one", "two"].index(doomed)]
            if looking:
                # The doomed worker is the one its fleet's gate lets look (or
                # claim through its reads), as if it had got there first, for
                # the rest of one claim interval: the survivor must take over.
                [gate] = [key async for key in redis.scan_iter(f"{PREFIX}:gate:*")]
                [entry] = await redis.xpending_range(queue.name, "taskiq", "-", "+", 1)
                await redis.set(
                    gate, entry["consumer"], px=DEFAULT_IDLE_TIMEOUT_MS // 4
                )
            os.killpg(process.pid, signal.SIGKILL)
            killed = time.monotonic()
            survivor = "two" if doomed == "one" else "one"
            rerun = await queue.events.wait_for(
                "started", killed + 3 * DEFAULT_RECOVERY_S, "victim", survivor
            )
        assert rerun is not None, "the killed worker's task never ran again"
        print(f"recovery at defaults on {server.label}: {rerun - killed:.2f} s")
        assert rerun - killed <= DEFAULT_RECOVERY_S, rerun - killed


async def test_after_an_outage_longer_than_idle_timeout_a_live_task_runs_once(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # A failover or a restart as the workers see it, at the defaults: every
    # connection cut, none taken for longer than idle_timeout, while the
    # server keeps the pending list, so the running task's entry looks idle
    # when they are back. The claimer is back first; the holder's
    # heartbeat a second later.
    upstream = urlsplit(server.url).port
    assert upstream is not None
    async with (
        liveness_queue(server, redis, tmp_path) as queue,
        CuttingProxy(upstream) as holder_link,
        CuttingProxy(upstream) as claimer_link,
    ):
        with stopped_at_exit() as workers:
            workers.append(queue.worker("holder", via(server.url, holder_link.port)))
            await queue.ready("holder")
            await queue.kick(TASK_NAME, "long", 30.0)
            deadline = time.monotonic() + 30
            assert await queue.events.wait_for("started", deadline, "long")
            workers.append(queue.worker("claimer", via(server.url, claimer_link.port)))
            await queue.ready("claimer")
            holder_link.cut()
            claimer_link.cut()
            cut_at = time.monotonic()
            # The claimer's retries come 50 ms after the cut, then doubling
            # (backoff.py): 6.35 s on, one of them finds the link back.
            await asyncio.sleep(6.0 - (time.monotonic() - cut_at))
            claimer_link.restore()
            await asyncio.sleep(1.5)
            holder_link.restore()
            idle_s = DEFAULT_IDLE_TIMEOUT_MS / 1000
            # Long enough for the claimer to take the entry and report it.
            await queue.events.wait_for("never", time.monotonic() + 1.5 * idle_s)
        assert queue.starts("long") == ["holder"], queue.starts("long")


async def test_operators_see_a_live_worker_alive_and_a_killed_one_not(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # What inspect, doctor and the page read: the worker's own alive key,
    # not its idle time (Redis 7.0 lists a consumer blocked in an empty read
    # as idle for as long as it waits). Idle 1 s, so a killed worker's key
    # lapses soon.
    idle_ms = 1000
    async with liveness_queue(server, redis, tmp_path, idle_ms) as queue:
        with stopped_at_exit() as workers:
            workers.append(queue.worker("one"))
            await queue.ready("one")
            # A consumer of the group from its first delivery on.
            await queue.kick(TASK_NAME, "short", 0.1)
            deadline = time.monotonic() + 30
            assert await queue.events.wait_for("finished", deadline, "short")
            await asyncio.sleep(3 * idle_ms / 1000)
            [(name, live)] = (await consumer_states(redis, queue.name, idle_ms)).items()
            assert live == Liveness.LIVE
            os.killpg(workers[0].pid, signal.SIGKILL)
            await asyncio.sleep(1.5 * idle_ms / 1000)
            assert (await consumer_states(redis, queue.name, idle_ms)) == {
                name: Liveness.QUIET
            }


async def consumer_states(
    redis: Redis, stream: str, idle_ms: int
) -> dict[str, Liveness]:
    view = await inspect_stream(redis, stream, "taskiq")
    [group] = view.groups
    return {c.name: consumer_liveness(c, idle_ms) for c in group.consumers}


async def test_a_shutdown_whose_hand_back_is_refused_still_stops_the_thread(
    server: Server, redis: Redis
) -> None:
    user, password = f"handback-{uuid.uuid4().hex[:6]}", "handback-password"
    await server_command(
        redis, "ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all"
    )
    consumer = f"liveness-{uuid.uuid4().hex[:6]}"
    broker = AtomicRedisStreamBroker(
        with_user(server.url, user, password),
        queue_name=f"handback-{uuid.uuid4().hex[:6]}",
        consumer_name=consumer,
        idle_timeout=1000,
        xread_block=100,
    )
    try:
        await broker.startup()
        await broker.kick(message("held"))
        # Read and held, never started: the shutdown hands it back.
        assert await asyncio.wait_for(broker.listen().__anext__(), 5)
        assert len(liveness_threads(consumer)) == 1
        await server_command(redis, "ACL", "SETUSER", user, "-fcall", "-evalsha")
        with contextlib.suppress(Exception):
            await broker.shutdown()
        assert liveness_threads(consumer) == [], "the thread outlived the broker"
    finally:
        await server_command(redis, "ACL", "DELUSER", user)


def liveness_threads(consumer: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"liveness {consumer}"]


async def test_the_liveness_thread_runs_while_listening_and_stops_with_the_broker(
    server: Server, redis: Redis
) -> None:
    consumer = f"liveness-{uuid.uuid4().hex[:6]}"
    broker = AtomicRedisStreamBroker(
        server.url, consumer_name=consumer, idle_timeout=1000, xread_block=100
    )
    await broker.startup()
    try:
        assert liveness_threads(consumer) == [], "before listen(): no thread"
        reading = asyncio.ensure_future(broker.listen().__anext__())
        await asyncio.sleep(0.3)
        assert len(liveness_threads(consumer)) == 1
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
    finally:
        await broker.shutdown()
    assert liveness_threads(consumer) == [], "the thread outlived the broker"
