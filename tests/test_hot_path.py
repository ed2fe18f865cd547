"""The per-task path (start record, ack, reads) with real ``taskiq worker``
processes: no finished task runs again in a live worker whatever the order
in which replies arrive, and ``max_connection_pool_size`` keeps taskiq-redis's
meaning. Also: the package uses no private name of redis-py."""

from __future__ import annotations

import ast
import asyncio
import collections
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from tests.conftest import Server
from tests.hot_path_app import TASK_NAME
from tests.proxies import ReplyDelayingProxy
from tests.test_broker import message
from tests.test_faults import via
from tests.test_reliability import started
from tests.test_started_semantics import stop_gracefully, stopped_at_exit, taskiq_worker

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "taskiq_atomic_claim"


def worker(
    server: Server,
    queue: str,
    tmp_path: Path,
    *extra: str,
    pool_size: int | None = None,
) -> Any:
    env = {
        **os.environ,
        "TAC_TEST_URL": server.url,
        "TAC_TEST_QUEUE": queue,
        "TAC_TEST_RUNS_FILE": str(tmp_path / "runs.txt"),
        "TAC_TEST_POOL_SIZE": "" if pool_size is None else str(pool_size),
    }
    return taskiq_worker(
        "tests.hot_path_app:broker", tmp_path / "worker.log", env, *extra
    )


async def kick_all(server: Server, queue: str, runs: list[str], seconds: float) -> None:
    kicker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    try:
        task: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker, {})
        for start in range(0, len(runs), 200):
            await asyncio.gather(
                *(task.kiq(r, seconds) for r in runs[start : start + 200])
            )
    finally:
        await kicker.shutdown()


def runs_seen(tmp_path: Path) -> collections.Counter[str]:
    path = tmp_path / "runs.txt"
    return collections.Counter(path.read_text().split() if path.exists() else [])


async def wait_for_runs(tmp_path: Path, runs: list[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if set(runs) <= set(runs_seen(tmp_path)):
            return
        await asyncio.sleep(0.2)


async def test_a_live_worker_never_runs_a_finished_task_again_after_stalls(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # The server stops serving writes (CLIENT PAUSE, as FAILOVER does) for
    # longer than idle_timeout while one worker drains short tasks: its own
    # reads (XREADGROUP ... CLAIM on Redis >= 8.4) reclaim entries whose
    # acks are still in flight. Each finished task ran once.
    queue = f"taskiq-hot-path-{uuid.uuid4().hex[:8]}"
    await redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
    runs = [f"r{n}" for n in range(6000)]
    await kick_all(server, queue, runs, 0.01)
    with stopped_at_exit() as workers:
        workers.append(worker(server, queue, tmp_path))
        await wait_for_runs(tmp_path, runs[:1], 30)
        for _ in range(3):
            await asyncio.sleep(0.5)
            await redis.execute_command(  # type: ignore[no-untyped-call]
                "CLIENT", "PAUSE", 3000, "WRITE"
            )
            await asyncio.sleep(3.0)
        await wait_for_runs(tmp_path, runs, 20)
        stop_gracefully(workers[-1])
    seen = runs_seen(tmp_path)
    twice = sorted(r for r, n in seen.items() if n > 1)
    assert twice == [], f"{len(twice)} tasks ran twice in a live worker: {twice[:10]}"
    assert set(runs) <= set(seen), f"never ran: {len(set(runs) - set(seen))}"


@pytest.mark.parametrize("pool_size", [1, 2])
async def test_a_worker_runs_every_task_at_any_pool_size(
    server: Server, redis: Redis, tmp_path: Path, pool_size: int
) -> None:
    # taskiq-redis's BlockingConnectionPool of max_connection_pool_size
    # connections: reads, starts, acks and heartbeats share it.
    queue = f"taskiq-hot-path-{uuid.uuid4().hex[:8]}"
    await redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
    runs = [f"p{n}" for n in range(40)]
    await kick_all(server, queue, runs[:20], 0.05)
    with stopped_at_exit() as workers:
        workers.append(worker(server, queue, tmp_path, pool_size=pool_size))
        await wait_for_runs(tmp_path, runs[:20], 20)
        # And again once it sits idle, blocked in its read.
        await asyncio.sleep(1.0)
        await kick_all(server, queue, runs[20:], 0.05)
        await wait_for_runs(tmp_path, runs, 20)
        stop_gracefully(workers[-1])
    seen = runs_seen(tmp_path)
    assert set(runs) <= set(seen), f"never ran: {sorted(set(runs) - set(seen))}"
    assert (await redis.xpending(queue, "taskiq"))["pending"] == 0


# redis-py names that are private (or, like PipelineCommand, internals of
# its pipelines), which the package must not touch.
_PRIVATE_REDIS_NAMES = {"PipelineCommand"}
# Public despite the underscore: namedtuple's API.
_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _private_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "redis":
                parts = node.module.split(".")
                names = [alias.name for alias in node.names]
                found += [
                    f"from {node.module} import {name}"
                    for name in names
                    if name.startswith("_") or name in _PRIVATE_REDIS_NAMES
                ]
                if any(p.startswith("_") for p in parts):
                    found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "redis"
                and any(p.startswith("_") for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute):
            if (
                node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in _NAMEDTUPLE_API
            ):
                found.append(f".{node.attr}")
        elif isinstance(node, ast.Name) and node.id in _PRIVATE_REDIS_NAMES:
            found.append(node.id)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
        ):
            found.append(f"{node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_package_uses_no_private_name_of_redis_py() -> None:
    # Any attribute starting with "_" read off an object: the package's own
    # objects keep their private state under names without a leading
    # underscore read from outside, so every hit is a foreign private.
    hits = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        own = {
            n.attr
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id in ("self", "cls")
        }
        uses = [u for u in _private_uses(path.read_text()) if u.lstrip(".") not in own]
        if uses:
            hits[str(path.relative_to(REPO))] = sorted(set(uses))
    assert hits == {}, f"private redis-py names: {hits}"


def test_the_private_name_check_finds_what_it_looks_for() -> None:
    source = (
        "from redis.asyncio.cluster import PipelineCommand\n"
        "from redis._parsers import Encoder\n"
        "def f(connection, node):\n"
        "    connection._reader.read()\n"
        "    return getattr(node, '_free', ())\n"
    )
    assert sorted(_private_uses(source)) == sorted(
        [
            "from redis.asyncio.cluster import PipelineCommand",
            "from redis._parsers import ...",
            "._reader",
            "getattr(..., '_free')",
        ]
    )


async def test_an_entry_acked_while_a_claiming_read_was_in_flight_is_not_yielded(
    server: Server, redis: Redis
) -> None:
    # The read runs on the server before the ack and reclaims the entry
    # (idle past idle_timeout), but its reply arrives after the ack's.
    if not server.info.native_claim or server.local is None:
        pytest.skip("reads reclaim on Redis >= 8.4; a proxy needs a local server")
    broker = await started(server, idle_timeout=60_000)
    try:
        await broker.kick(message("once"))
        delivered = await asyncio.wait_for(broker.listen().__anext__(), 5)
        entry_id = delivered.data.entry_id  # type: ignore[attr-defined]
        await redis.xclaim(
            "taskiq", "taskiq", broker.consumer_name, 0, [entry_id], idle=120_000,
            justid=True,
        )  # fmt: skip
        async with ReplyDelayingProxy(server.local.port, 0.5) as proxy:
            slow = Redis.from_url(via(server.url, proxy.port))
            try:
                await slow.ping()  # connected: the read goes out at once
                listener = broker.atomic.listener
                read = asyncio.create_task(
                    listener.held(listener.native_reads.step(slow, {"taskiq": ">"}))
                )
                # The read (reply held 0.5 s) and the start counts of what it
                # reclaimed (HMGET, 0.5 s more) run by the server; the ack
                # lands between the two replies.
                await asyncio.sleep(0.75)
                await maybe_awaitable(delivered.ack())
                assert not read.done()
                got, kept = await asyncio.wait_for(read, 10)
            finally:
                await slow.aclose()
        assert [e for _, e, _ in got] == [entry_id], "nothing was tested"
        returned = [e for _, e, _ in kept]
        assert returned == [], "a finished entry came back from a read"
        assert broker.atomic.in_flight.get("taskiq", entry_id) is None
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()


async def test_an_entry_acked_while_a_claim_was_in_flight_is_not_yielded(
    server: Server, redis: Redis
) -> None:
    # The Lua path's claim, as the native read above: run by the server
    # before the ack, its reply heard after the ack's.
    if server.local is None:
        pytest.skip("a proxy needs a local server")
    broker = await started(server, idle_timeout=60_000)
    try:
        await broker.kick(message("once"))
        delivered = await asyncio.wait_for(broker.listen().__anext__(), 5)
        entry_id = delivered.data.entry_id  # type: ignore[attr-defined]
        await redis.xclaim(
            "taskiq", "taskiq", broker.consumer_name, 0, [entry_id], idle=120_000,
            justid=True,
        )  # fmt: skip
        async with ReplyDelayingProxy(server.local.port, 0.5) as proxy:
            slow = Redis.from_url(via(server.url, proxy.port))
            try:
                await slow.ping()  # connected: the claim goes out at once
                await broker.atomic.scripts.mode(slow)  # scripts loaded
                claim = asyncio.create_task(
                    broker.atomic.listener.claim(slow, ["taskiq"])
                )
                # Its steps (the fleet's gate, its look, the script, then the
                # fetch of fields, each reply held 0.5 s) run by the server,
                # the last reply held.
                await asyncio.sleep(1.75)
                await maybe_awaitable(delivered.ack())
                assert not claim.done()
                claimed, kept = await asyncio.wait_for(claim, 10)
            finally:
                await slow.aclose()
        assert [e for _, e, _ in claimed] == [entry_id], "nothing was tested"
        assert kept == [], "a finished entry came back from a claim"
        assert broker.atomic.in_flight.get("taskiq", entry_id) is None
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()
