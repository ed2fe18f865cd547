"""The server behind a worker's URL changes version under it: a restart on
another binary (or a failover to another replica) during a rollback or an
upgrade. The worker goes on consuming and reclaiming, on the path the new
server has: XREADGROUP ... CLAIM on Redis >= 8.4, the Lua claim elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from taskiq import AckableMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.embedded_server import LocalServer, ServerBinary
from taskiq_atomic_claim.server_info import LUA_CLAIM, NATIVE_CLAIM
from tests.conftest import assert_every_key_expires
from tests.test_broker import die, message, receive
from tests.topologies import binary_for, need

IDLE_MS, INTERVAL_MS = 2000, 200
# Data survives the swap: 7.0 cannot read 8.6's RDB (format 13), but it
# replays 8.6's append-only file written as commands.
PERSISTENT = ("--appendonly", "yes", "--aof-use-rdb-preamble", "no")


@pytest.fixture
def redis_7() -> ServerBinary:
    return need(binary_for(7), "Redis 7")


@pytest.fixture
def redis_8() -> ServerBinary:
    binary = need(binary_for(8), "Redis 8")
    if tuple(int(part) for part in binary.version.split(".")[:2]) < (8, 4):
        pytest.skip(f"Redis {binary.version} has no XREADGROUP CLAIM")
    return binary


@pytest.fixture
def persistent_server(request: pytest.FixtureRequest) -> Iterator[LocalServer]:
    with LocalServer(request.getfixturevalue(request.param), PERSISTENT) as local:
        yield local


async def produce(local: LocalServer, body: str) -> None:
    """A plain XADD, as a producer on any server writes: the brokers' kicks
    on Redis 8.6 write XADD ... IDMP and XCFGSET, which 7.0 cannot replay
    from the append-only file (no server replays a newer one's commands)."""
    async with Redis.from_url(local.url) as producer:
        await producer.xadd("taskiq", {"data": message(body).message})


def swap_binary(local: LocalServer, binary: ServerBinary) -> None:
    """Stop the server; start ``binary`` on the same port and directory."""
    local.stop()
    local.binary = binary
    local.start()


async def broker(
    local: LocalServer, name: str, **kwargs: Any
) -> AtomicRedisStreamBroker:
    started = AtomicRedisStreamBroker(
        local.url,
        consumer_name=name,
        idle_timeout=IDLE_MS,
        claim_interval=INTERVAL_MS,
        xread_block=200,
        **kwargs,
    )
    await started.startup()
    return started


class Consuming:
    """A listener run as a worker runs it: one task iterating it throughout
    (a timed-out ``__anext__`` would close the generator). While ``reads``
    is clear, a delivered message's task "runs": the listener stays
    suspended where it yielded, reading nothing."""

    def __init__(self, listener: AsyncGenerator[AckableMessage, None]) -> None:
        self.delivered: asyncio.Queue[AckableMessage] = asyncio.Queue()
        self.reads = asyncio.Event()
        self.reads.set()
        self.task = asyncio.ensure_future(self._run(listener))

    async def _run(self, listener: AsyncGenerator[AckableMessage, None]) -> None:
        async for delivered in listener:
            await self.delivered.put(delivered)
            await self.reads.wait()

    async def next(self, timeout: float) -> AckableMessage | None:
        """The next delivery; None after ``timeout``; raises what ended listen()."""
        getting = asyncio.ensure_future(self.delivered.get())
        await asyncio.wait(
            [getting, self.task], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if getting.done():
            return getting.result()
        getting.cancel()
        if self.task.done():
            self.task.result()
            raise AssertionError("listen() ended")
        return None

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def acked(consuming: Consuming, count: int) -> list[bytes]:
    """The next ``count`` deliveries' bodies, each acked."""
    received: list[bytes] = []
    for _ in range(count):
        delivered = await consuming.next(IDLE_MS / 1000 + 5)
        assert delivered is not None, f"only {received} delivered"
        received.append(delivered.data)
        await maybe_awaitable(delivered.ack())
    return received


@pytest.mark.parametrize("during", ["read", "task"])
@pytest.mark.parametrize(
    ("persistent_server", "then", "path_before"),
    [("redis_8", "redis_7", NATIVE_CLAIM), ("redis_7", "redis_8", LUA_CLAIM)],
    ids=["8.6-to-7.0", "7.0-to-8.6"],
    indirect=["persistent_server"],
)
async def test_a_worker_keeps_consuming_and_reclaiming_when_the_server_changes(
    persistent_server: LocalServer,
    then: str,
    path_before: str,
    during: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # During a read the worker sees the connection drop. During a task, a
    # client told to retry connection errors (redis-py's retry_on_error)
    # reconnects unseen: only the server's refusal of a command tells.
    local = persistent_server
    dead = await broker(local, "dead")
    retrying = {"retry_on_error": [RedisConnectionError]} if during == "task" else {}
    alive = await broker(local, "alive", **retrying)
    try:
        await produce(local, "orphan")
        dead_listener = dead.listen()
        assert await receive(dead_listener, 2) is not None
        await die(dead, dead_listener)
        consuming = Consuming(alive.listen())
        # Nothing is idle long enough yet: the read only chooses the path.
        assert await consuming.next(INTERVAL_MS / 1000) is None
        assert alive.atomic.path.reclaim_path == path_before
        if during == "task":
            consuming.reads.clear()
            await produce(local, "running")
            assert await acked(consuming, 1) == [b"running"]

        caplog.set_level(logging.INFO, "taskiq.atomic_claim")
        caplog.clear()
        swap_binary(local, request.getfixturevalue(then))
        await produce(local, "after")
        consuming.reads.set()
        assert sorted(await acked(consuming, 2)) == [b"after", b"orphan"]
        assert alive.metrics.snapshot()["claimed"] == 1
        async with Redis.from_url(local.url) as admin:
            assert (await admin.xpending("taskiq", "taskiq"))["pending"] == 0
            await assert_every_key_expires(admin)
        await consuming.stop()

        if path_before == NATIVE_CLAIM:
            # The new server has no CLAIM: the Lua claim reclaimed the orphan.
            assert alive.atomic.path.reclaim_path == LUA_CLAIM
        # A server swap is an ordinary operation: no traceback; one warning
        # says the server changed where the path did.
        assert not [r for r in caplog.records if r.exc_info], caplog.text
        changed = [r for r in caplog.records if "server changed" in r.getMessage()]
        assert len(changed) == int(alive.atomic.path.reclaim_path != path_before), (
            caplog.text
        )
        assert all(r.levelno == logging.WARNING for r in changed)
    finally:
        await dead.shutdown()
        await alive.shutdown()
