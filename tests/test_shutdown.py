"""A graceful shutdown never makes a running task claimable, and a worker
that exits owning nothing pending removes its consumer. Real ``taskiq
worker`` processes, one server in CI (ONE_SERVER_MODULES)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.dead_letters import list_dead_letters
from taskiq_atomic_claim.harness.drill_app import events_stream
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from tests.conftest import Server
from tests.shutdown_app import TASK
from tests.test_started_semantics import (
    stop_gracefully,
    stopped_at_exit,
    taskiq_worker,
)

IDLE_MS = 4000


def start_worker(
    server: Server, queue: str, log_dir: Path, name: str, *args: str, **env: str
) -> subprocess.Popen[bytes]:
    settings = {
        "TAC_TEST_URL": server.url,
        "TAC_TEST_QUEUE": queue,
        "TAC_TEST_WORKER": name,
        "TAC_TEST_IDLE_TIMEOUT": str(IDLE_MS),
    }
    app = "tests.shutdown_app:broker"
    return taskiq_worker(
        app, log_dir / f"{name}.log", {**os.environ, **settings, **env}, *args
    )


async def events(redis: Redis, queue: str) -> list[tuple[str, str, str]]:
    """(event, run, worker), in the order reported."""
    entries: Any = await redis.xrange(events_stream(queue))
    return [
        (text(f[b"event"]), text(f[b"run"]), text(f[b"worker"])) for _, f in entries
    ]


async def wait_for(
    redis: Redis, queue: str, wanted: set[tuple[str, str, str]], seconds: float
) -> list[tuple[str, str, str]]:
    deadline = time.monotonic() + seconds
    while True:
        seen = await events(redis, queue)
        if wanted <= set(seen) or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.1)


async def ready_as(redis: Redis, queue: str, worker: str) -> tuple[str, str]:
    """The consumer name and process id a worker reported once ready."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for event, run, who in await events(redis, queue):
            if (event, who) == ("ready", worker):
                consumer, pid = run.split()
                return consumer, pid
        await asyncio.sleep(0.1)
    raise AssertionError(f"worker {worker} never became ready")


async def consumers(redis: Redis, queue: str) -> dict[str, int]:
    """Consumer name: how many entries it has pending."""
    return {
        text(c["name"]): int(c["pending"])
        for c in await redis.xinfo_consumers(queue, "taskiq")
    }


def log_text(log_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))


async def queue_with(
    server: Server, redis: Redis, prefix: str, runs: list[tuple[str, float, str]]
) -> str:
    """A fresh queue, its group at 0, and one task kicked per (run, seconds,
    gate)."""
    queue = f"taskiq-atomic-claim-{prefix}-{uuid.uuid4().hex[:8]}"
    await redis.xgroup_create(queue, "taskiq", id="0", mkstream=True)
    kicker = AtomicRedisStreamBroker(server.url, queue_name=queue)
    try:
        for run, seconds, until in runs:
            kicked: AsyncKicker[Any, Any] = AsyncKicker(TASK, kicker, {})
            await kicked.kiq(run, seconds, until)
    finally:
        await kicker.shutdown()
    return queue


async def test_shutdown_hands_back_only_what_no_task_runs(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # Worker a runs four tasks and holds three more it has no slot for; it
    # is stopped with --wait-tasks-timeout shorter than its tasks and a
    # shutdown handler that takes 2 s. Its tasks go on running through the
    # handler: the two short ones end there (acked), the two long ones are
    # still running when its shutdown ends. Worker b runs beside it.
    short, long_ = ["short-1", "short-2"], ["long-1", "long-2"]
    waiting = ["waiting-1", "waiting-2", "waiting-3"]
    gate = f"taskiq-atomic-claim-shutdown-gate-{uuid.uuid4().hex[:8]}"
    queue = await queue_with(
        server,
        redis,
        "shutdown",
        [
            *((r, 60.0, gate) for r in short),
            *((r, 60.0, "") for r in long_),
            *((r, 0.2, "") for r in waiting),
        ],
    )
    with stopped_at_exit() as workers:
        a = start_worker(
            server, queue, tmp_path, "a", "--max-async-tasks", "4",
            "--wait-tasks-timeout", "0.5", TAC_TEST_SHUTDOWN_S="2",
        )  # fmt: skip
        workers.append(a)
        a_consumer, a_pid = await ready_as(redis, queue, "a")
        running = {("started", r, "a") for r in short + long_}
        seen = await wait_for(redis, queue, running, 30)
        assert running <= set(seen), seen
        b = start_worker(
            server, queue, tmp_path, "b", "--max-async-tasks", "10",
            TAC_TEST_SLEEP_CAP_S="0.2",
        )  # fmt: skip
        workers.append(b)
        b_consumer, b_pid = await ready_as(redis, queue, "b")
        # Named so an operator can tell host and process, and unique.
        host = re.escape(socket.gethostname())
        assert re.fullmatch(rf"{host}-{a_pid}-[0-9a-f]{{6}}", a_consumer), a_consumer
        assert re.fullmatch(rf"{host}-{b_pid}-[0-9a-f]{{6}}", b_consumer), b_consumer

        os.killpg(a.pid, signal.SIGTERM)
        # The short tasks end while a's shutdown handler runs.
        handler = ("shutting-down", "", "a")
        assert handler in await wait_for(redis, queue, {handler}, 20)
        await redis.set(gate, 1, px=60_000)
        stop_gracefully(a)
        at_exit = await events(redis, queue)
        # Not one task ran in b while a still ran it.
        ran_in_b = {
            run for event, run, who in at_exit if (event, who) == ("started", "b")
        }
        assert ran_in_b == set(waiting), (at_exit, log_text(tmp_path))
        finished_in_a = {
            run for event, run, who in at_exit if (event, who) == ("finished", "a")
        }
        assert finished_in_a == set(short), at_exit
        # a still owns the entries of its interrupted tasks: its consumer stays.
        assert (await consumers(redis, queue)).get(a_consumer) == len(long_)

        # b reruns them once a's process is gone, and a shutdown is no crash:
        # with max_deliveries 1 a counted interruption dead-letters them.
        rerun = {("finished", r, "b") for r in long_}
        seen = await wait_for(redis, queue, rerun, IDLE_MS / 1000 + 15)
        dead = await list_dead_letters(redis, StreamKeys(queue, "taskiq"), count=10)
        assert [d.reason for d in dead] == []
        assert rerun <= set(seen), (seen, log_text(tmp_path))
        starts = [(run, who) for event, run, who in seen if event == "started"]
        assert sorted(starts) == sorted(
            [(r, "a") for r in short + long_] + [(r, "b") for r in waiting + long_]
        )

        # b exits owning nothing pending: its consumer goes with it.
        stop_gracefully(b)
        assert b_consumer not in await consumers(redis, queue)


async def test_workers_recycled_by_max_tasks_per_child_leave_no_consumer(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # Each child of `taskiq worker --max-tasks-per-child 2` reads more than
    # the two tasks it runs and exits gracefully handing the rest back, so it
    # still owns entries at its exit and keeps its consumer; the next child
    # takes them. Before, every child's consumer stayed in the group for good.
    runs = [f"run-{n}" for n in range(4)]
    queue = await queue_with(server, redis, "recycled", [(r, 0.05, "") for r in runs])
    idle_ms = 1000
    with stopped_at_exit() as workers:
        a = start_worker(
            server, queue, tmp_path, "a", "--max-tasks-per-child", "2",
            TAC_TEST_IDLE_TIMEOUT=str(idle_ms),
        )  # fmt: skip
        workers.append(a)
        finished = {("finished", r, "a") for r in runs}
        seen = await wait_for(redis, queue, finished, 40)
        assert finished <= set(seen), (seen, log_text(tmp_path))
        children = [run for event, run, _ in seen if event == "ready"]
        assert len(children) >= 2, seen
        # The first child's consumer, emptied, is idle past idle_timeout.
        await asyncio.sleep(idle_ms / 1000)
        stop_gracefully(a)
    left = await consumers(redis, queue)
    print(f"\n{len(children)} children ran {len(runs)} tasks; consumers left {left}")
    assert left == {}, log_text(tmp_path)
