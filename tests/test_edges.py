"""What a user meets at the edges: a server below the supported range, a
worker started before its server, a login the server refuses. Real servers;
the worker test runs a real ``taskiq worker``."""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.connection import LoginRefusedError
from taskiq_atomic_claim.harness.embedded_server import LocalServer, free_port
from taskiq_atomic_claim.server_info import (
    MINIMUM_VERSIONS,
    ServerInfo,
    UnsupportedServerError,
)
from tests.conftest import Server
from tests.edges_app import NOTE_TASK, done_stream
from tests.test_cli import password_protected
from tests.test_started_semantics import (
    stop_gracefully,
    stopped_at_exit,
    taskiq_worker,
)

REPO = Path(__file__).resolve().parent.parent


def test_the_supported_range_starts_where_the_readme_says() -> None:
    readme = (REPO / "README.md").read_text()
    found = re.search(
        r"Redis (\d+)\.(\d+) \N{EN DASH} [\d.]+ and\s+Valkey (\d+)\.(\d+)", readme
    )
    assert found is not None
    redis_major, redis_minor, valkey_major, valkey_minor = map(int, found.groups())
    assert {
        "Redis": (redis_major, redis_minor),
        "Valkey": (valkey_major, valkey_minor),
    } == MINIMUM_VERSIONS
    for below in ("Redis 5.0.14", "Redis 6.0.20", "Valkey 8.0.2", "Valkey 7.2.5"):
        product, version = below.split()
        problem = ServerInfo(product, version).unsupported()
        assert problem.startswith(f"{below} is below the supported range"), problem
        assert "Redis >= 6.2 or Valkey >= 8.1" in problem
        with pytest.raises(UnsupportedServerError, match=below):
            ServerInfo(product, version).require_supported()
    for within in ("Redis 6.2.0", "Redis 8.6.3", "Valkey 8.1.0", "Redis unknown"):
        product, version = within.split()
        assert ServerInfo(product, version).unsupported() == ""


async def test_a_broker_without_the_needed_password_names_the_problem() -> None:
    # redis-py's own text is about HELLO (RESP3) or NOAUTH; a worker must not
    # wait it out as an outage either.
    with password_protected() as port:
        for worker in (False, True):
            broker = AtomicRedisStreamBroker(f"redis://127.0.0.1:{port}")
            broker.is_worker_process = worker
            with pytest.raises(LoginRefusedError) as refused:
                await broker.startup()
            await broker.shutdown()
            message = str(refused.value)
            assert message.startswith(
                f"127.0.0.1:{port} requires a password, and the URL has none"
            ), message
            assert "\n" not in message
        wrong = AtomicRedisStreamBroker(f"redis://:wrong@127.0.0.1:{port}")
        with pytest.raises(LoginRefusedError, match="refused the URL's username"):
            await wrong.startup()
        await wrong.shutdown()


async def test_a_worker_started_before_its_server_waits_for_it_in_two_lines(
    server: Server, tmp_path: Path
) -> None:
    if server.local is None:
        pytest.skip(f"{server.label}: cannot start a copy on a port of our own")
    port = free_port()
    queue = f"edges-late-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{port}"
    log = tmp_path / "worker.log"
    env = {**os.environ, "TAC_TEST_URL": url, "TAC_TEST_QUEUE": queue}
    with stopped_at_exit() as workers:
        worker = taskiq_worker("tests.edges_app:broker", log, env)
        workers.append(worker)
        # Long enough for several attempts (before: a restart every second).
        await asyncio.sleep(4)
        with LocalServer(server.local.binary, port=port) as local:
            client = Redis.from_url(local.url)
            kicker = AtomicRedisStreamBroker(local.url, queue_name=queue)
            try:
                noting: AsyncKicker[Any, Any] = AsyncKicker(NOTE_TASK, kicker, {})
                await noting.kiq("late")
                deadline = time.monotonic() + 20
                done: Any = []
                while not done and time.monotonic() < deadline:
                    done = await client.xrange(done_stream(queue))
                    await asyncio.sleep(0.2)
                assert done, log.read_text()
            finally:
                await kicker.shutdown()
                await client.aclose()
            stop_gracefully(worker)
    text = log.read_text()
    assert "Traceback" not in text, text
    assert "restarted" not in text, text
    unreachable = [line for line in text.splitlines() if "Redis unreachable" in line]
    assert len(unreachable) == 1, text
    assert str(port) in unreachable[0]
    assert text.count("Redis reachable again") == 1, text
