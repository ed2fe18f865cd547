"""Seams between the broker's parts under real operations, two real
``taskiq worker`` processes at the default settings (idle_timeout 5 s,
claim interval 1.25 s, read block 2 s): a server that pauses its clients
(``CLIENT PAUSE``, as ``FAILOVER`` and a Cluster's manual failover do), and
a network that freezes one of a worker's connections but not the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim.settings import DEFAULT_IDLE_TIMEOUT_MS, DEFAULT_MAX_DELIVERIES
from tests.conftest import SUITE_GROUP, Server, server_command
from tests.proxies import SelectiveFreezingProxy
from tests.test_operator_changes import (
    QUEUE,
    kicking,
    wait_for,
    worker_env,
    workers_stopped_at_exit,
)
from tests.test_started_semantics import stop_gracefully, taskiq_worker

LONG_S = 7.0  # a task running through the fault and past idle_timeout


def default_env(url: str, notes_url: str, name: str) -> dict[str, str]:
    """The broker's defaults (edges_app takes them from the environment)."""
    return worker_env(
        url,
        notes_url,
        name,
        idle_ms=DEFAULT_IDLE_TIMEOUT_MS,
        claim_interval_ms=DEFAULT_IDLE_TIMEOUT_MS // 4,
        max_deliveries=DEFAULT_MAX_DELIVERIES,
        xread_block_ms=2000,
    )


async def running(redis: Redis, count: int, seconds: float) -> bool:
    """Whether ``count`` entries are delivered (so, with nothing
    prefetched, running) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pending = await redis.xpending(QUEUE, SUITE_GROUP)
        if pending["pending"] >= count:
            return True
        await asyncio.sleep(0.1)
    return False


def twice(noted: Counter[str]) -> list[str]:
    return sorted(run for run, times in noted.items() if times > 1)


@pytest.mark.parametrize("mode", ["ALL", "WRITE"])
async def test_a_client_pause_runs_every_task_once(
    server: Server, redis: Redis, tmp_path: Path, mode: str
) -> None:
    """``CLIENT PAUSE 4000`` while both workers run long tasks and new
    tasks are kicked: each task runs once, none is lost."""
    await redis.xgroup_create(QUEUE, SUITE_GROUP, id="0", mkstream=True)
    names = ("worker-1", "worker-2")
    long_runs = {f"long-{n}" for n in range(4)}
    short_runs = {f"short-{n}" for n in range(12)}
    with workers_stopped_at_exit() as workers:
        for name in names:
            env = default_env(server.admin_url, server.admin_url, name)
            workers.append(
                taskiq_worker("tests.edges_app:broker", tmp_path / f"{name}.log", env)
            )
        async with kicking(server.admin_url) as kicker:
            for run in sorted(long_runs):
                await kicker.kiq(run, LONG_S)
            assert await running(redis, len(long_runs), 20)
            # Beats land at any point before the pause: wait a random-ish
            # part of a beat so runs differ in where the pause falls.
            await asyncio.sleep(1.0)
            pauser = Redis.from_url(server.admin_url)
            try:
                await server_command(pauser, "CLIENT", "PAUSE", "4000", mode)
                kicks = [
                    asyncio.ensure_future(kicker.kiq(run, 0.1))
                    for run in sorted(short_runs)
                ]
                await asyncio.gather(*kicks)
            finally:
                await pauser.aclose()
        noted = await wait_for(redis, long_runs | short_runs, 40)
        for worker in workers:
            stop_gracefully(worker)
    logs = "\n".join((tmp_path / f"{name}.log").read_text() for name in names)
    assert set(noted) == long_runs | short_runs, logs
    assert twice(noted) == [], logs
    assert "Traceback" not in logs, logs


FREEZE_S = 8.0  # longer than idle_timeout (5 s) at the defaults
# What only the liveness thread sends: its alive key, its idle reset.
LIVENESS_MARKERS = (b"taskiq-atomic-claim:alive:", b"_set_idle")


async def owned_by(redis: Redis, consumer: str, seconds: float) -> bool:
    """Whether ``consumer`` owns a pending entry within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        entries = await redis.xpending_range(QUEUE, SUITE_GROUP, "-", "+", 10)
        if any(entry["consumer"] == consumer.encode() for entry in entries):
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize(
    "frozen", ["reads and acks", "liveness connection", "liveness, reconnects too"]
)
async def test_one_frozen_connection_of_a_worker(
    server: Server, redis: Redis, tmp_path: Path, frozen: str
) -> None:
    """Worker a, behind a proxy, runs a long task; one kind of its
    connections is frozen (bytes held both ways, the connection open) for
    longer than idle_timeout while worker b claims and tasks are kicked.

    - its reads, starts and acks frozen, its liveness thread working, or its
      liveness thread's connection frozen (new connections work): a's held
      entries stay a's; every task runs once;
    - every liveness connection frozen, new ones too, reads working (a
      one-way partition the claimers cannot tell from a death): b may run
      the long task a second time while a runs it, as documented; nothing
      else runs twice, nothing is lost."""
    assert server.local is not None
    await redis.xgroup_create(QUEUE, SUITE_GROUP, id="0", mkstream=True)
    names = ("worker-a", "worker-b")
    async with SelectiveFreezingProxy(server.local.port, LIVENESS_MARKERS) as proxy:
        via_proxy = f"redis://127.0.0.1:{proxy.port}"
        with workers_stopped_at_exit() as workers:
            env = default_env(via_proxy, server.admin_url, "worker-a")
            log_a = tmp_path / "worker-a.log"
            workers.append(taskiq_worker("tests.edges_app:broker", log_a, env))
            async with kicking(server.admin_url) as kicker:
                await kicker.kiq("long", LONG_S + FREEZE_S)
                assert await owned_by(redis, "worker-a", 20), log_a.read_text()
                env = default_env(server.admin_url, server.admin_url, "worker-b")
                log_b = tmp_path / "worker-b.log"
                workers.append(taskiq_worker("tests.edges_app:broker", log_b, env))
                await asyncio.sleep(3)  # b listens
                proxy.freeze(
                    marked=frozen != "reads and acks",
                    later_too=frozen == "liveness, reconnects too",
                )
                short_runs = {f"short-{n}" for n in range(6)}
                for run in sorted(short_runs):
                    await kicker.kiq(run, 0.1)
                await asyncio.sleep(FREEZE_S)
                proxy.thaw()
            noted = await wait_for(redis, short_runs | {"long"}, 40)
            # Off the loop: the proxy runs on it, and a's shutdown talks
            # through the proxy.
            for worker in workers:
                await asyncio.to_thread(stop_gracefully, worker)
    logs = "\n".join((tmp_path / f"{name}.log").read_text() for name in names)
    assert set(noted) == short_runs | {"long"}, logs
    for sign in ("Traceback", "cannot be completed"):
        assert sign not in logs, logs
    if frozen != "liveness, reconnects too":
        # A frozen liveness connection is given up after one beat and the
        # beat retried on a new one, before a's entry turns idle.
        assert twice(noted) == [], logs
    else:
        # The documented exception (reliability.md, "Long tasks are not run
        # twice"): while a's beats cannot land, nothing tells b that a's
        # process lives, so b may run the long task again. a's own claims
        # (or claiming reads) may take its idle entry back from itself
        # first, which resets its idle time: whichever claims first wins.
        assert twice(noted) in ([], ["long"]), logs
