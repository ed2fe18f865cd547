"""Which dependency versions the package accepts, refused at import."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq import TaskiqMessage
from taskiq.message import BrokerMessage
from taskiq.receiver import Receiver

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.compat import MINIMUM, stack_problems
from taskiq_atomic_claim.keys import StreamKeys
from tests.conftest import Server

OLDEST = {"redis": "7.2.0", "taskiq": "0.12.6", "taskiq-redis": "1.2.2"}
NEWEST = {"redis": "8.1.0", "taskiq": "0.13.0", "taskiq-redis": "1.2.4"}


def test_the_oldest_and_newest_supported_stacks_pass() -> None:
    assert stack_problems(OLDEST) == []
    assert stack_problems(NEWEST) == []
    assert stack_problems({**OLDEST, "redis": "7.4.1"}) == []


def test_taskiq_redis_1_1_is_refused_naming_the_version_needed() -> None:
    (problem,) = stack_problems({**OLDEST, "taskiq-redis": "1.1.2"})
    assert "needs taskiq-redis>=1.2.2, found taskiq-redis 1.1.2" in problem
    assert "unacknowledged_lock_timeout" in problem


def test_taskiq_redis_1_2_2_under_taskiq_0_13_is_refused() -> None:
    (problem,) = stack_problems({**OLDEST, "taskiq": "0.13.0"})
    assert "needs taskiq-redis>=1.2.3 (with redis>=8) or taskiq<0.13" in problem


def test_every_old_or_missing_dependency_is_named() -> None:
    problems = stack_problems({"redis": "6.4.0", "taskiq": "0.11.20"})
    assert problems == [
        "needs redis>=7.2, found redis 6.4.0",
        "needs taskiq>=0.12, found taskiq 0.11.20",
        "taskiq-redis is not installed; needs taskiq-redis>=1.2.2",
    ]


def test_the_floors_are_the_ones_pyproject_declares() -> None:
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for name, oldest in MINIMUM.items():
        assert f'"{name}>={".".join(map(str, oldest))},' in pyproject


def test_importing_on_an_unsupported_taskiq_redis_fails_at_import(
    tmp_path: Path,
) -> None:
    # An installed taskiq-redis 1.1.2, as importlib.metadata sees it: its
    # dist-info first on sys.path shadows the real one's version.
    dist_info = tmp_path / "taskiq_redis-1.1.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: taskiq-redis\nVersion: 1.1.2\n"
    )
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(tmp_path)!r});"
            " import taskiq_atomic_claim",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert imported.returncode == 1
    last_line = imported.stderr.strip().splitlines()[-1]
    assert last_line.startswith("taskiq_atomic_claim.compat.UnsupportedStackError:")
    assert "needs taskiq-redis>=1.2.2, found taskiq-redis 1.1.2" in last_line


async def test_a_message_the_receiver_skips_is_not_kept_pending(
    server: Server, redis: Redis
) -> None:
    # taskiq 0.12's receiver skips an unparsable message or an unknown task
    # without acking it (0.13 acks it): neither may stay pending under this
    # worker's heartbeat. The unparsable one leaves a dead letter; the unknown
    # task is handed back, claimable at once by a worker that knows it (see
    # tests/test_unknown_tasks.py).
    idle_ms = 600
    broker = AtomicRedisStreamBroker(
        server.url, idle_timeout=idle_ms, claim_interval=100, xread_block=100
    )
    broker.is_worker_process = True  # as `taskiq worker` sets it
    receiver = Receiver(broker, run_startup=False)
    unknown_task = TaskiqMessage(
        task_id="1", task_name="nobody:knows", labels={}, args=[], kwargs={}
    )
    await broker.startup()
    listen = broker.listen()
    try:
        await broker.kick(broker.formatter.dumps(unknown_task))
        await broker.kick(
            BrokerMessage(task_id="2", task_name="t", message=b"not json", labels={})
        )
        # As taskiq's runner does: one task per message's callback.
        callbacks = [
            asyncio.create_task(
                receiver.callback(await asyncio.wait_for(listen.__anext__(), 5))
            )
            for _ in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*callbacks), 5)
        await asyncio.sleep(2 * idle_ms / 1000)
        pending: Any = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
        assert [p["times_delivered"] for p in pending] == [1], pending
        assert pending[0]["time_since_delivered"] >= idle_ms, "not handed back"
        dead: Any = await redis.xrange(StreamKeys("taskiq", "taskiq").dead_letters)
        assert len(dead) == 1, dead  # the unparsable one
    finally:
        await listen.aclose()
        await broker.shutdown()


def test_the_cli_on_an_unsupported_stack_says_so_in_one_line(tmp_path: Path) -> None:
    dist_info = tmp_path / "taskiq_redis-1.1.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: taskiq-redis\nVersion: 1.1.2\n"
    )
    ran = subprocess.run(
        [str(Path(sys.executable).with_name("taskiq-atomic-claim")), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert ran.returncode == 2
    assert ran.stderr.startswith("taskiq-atomic-claim: error: "), ran.stderr
    assert ran.stderr.count("\n") == 1, ran.stderr
    assert "needs taskiq-redis>=1.2.2, found taskiq-redis 1.1.2" in ran.stderr
