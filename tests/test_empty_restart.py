"""An empty restart under a live producer loses no accepted task.

Real ``taskiq worker`` processes, a producer kicking at a steady bounded
rate, and the queue server restarted without persistence mid-run: the
producer's XADD recreates the stream before the workers see NOGROUP, and a
group re-created at ``$`` would skip those entries. The task reports to an
events stream on a second server, which the restart leaves alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from taskiq.exceptions import SendTaskError
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker, AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.group_recovery import first_position, recreate_group
from taskiq_atomic_claim.harness.drill_app import events_stream
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.keys import ORPHANS_CONSUMER, StreamKeys
from taskiq_atomic_claim.operations import set_idle_call
from taskiq_atomic_claim.scripts import ScriptRunner
from tests.conftest import (
    SUITE_GROUP,
    Server,
    server_command,
    suite_worker_rule,
    with_user,
)
from tests.empty_restart_app import TASK_NAME
from tests.test_operator_changes import rule_version

REPO_ROOT = Path(__file__).resolve().parent.parent
QUEUE = "taskiq-atomic-claim-drill-empty-restart"
WORKERS = 2
KICKS_PER_S, KICKS = 20, 160  # 8 s of kicking
RESTART_AFTER_KICKS = 40
OUTAGE_S = 2.0
ALL_RAN_WITHIN_S = 30.0


@pytest.fixture
def events_server(server: Server) -> Iterator[LocalServer]:
    if server.local is None:
        pytest.skip(f"{server.label}: cannot restart a server this suite did not start")
    with LocalServer(server.local.binary) as events:
        yield events


@contextlib.contextmanager
def taskiq_workers(env: dict[str, str], log_dir: Path) -> Iterator[list[Path]]:
    script = Path(sys.executable).with_name("taskiq")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "taskiq"]
    processes, logs = [], []
    try:
        for number in range(WORKERS):
            log = log_dir / f"worker-{number}.log"
            logs.append(log)
            argv = [
                *command, "worker", "tests.empty_restart_app:broker",
                "--ack-type", "when_executed",
                "--workers", "1",
                "--log-level", "WARNING",
            ]  # fmt: skip
            processes.append(
                subprocess.Popen(
                    argv,
                    env={
                        **env,
                        "PYTHONPATH": str(REPO_ROOT),
                        "TAC_DRILL_WORKER": f"worker-{number}",
                    },
                    cwd=REPO_ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=log.open("wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        yield logs
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


async def events_of(client: Redis, event: str) -> set[str]:
    entries: Any = await client.xrange(events_stream(QUEUE))
    return {
        fields[b"run"].decode()
        for _, fields in entries
        if fields[b"event"] == event.encode()
    }


async def wait_until(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.2)
    return False


def outage(server: Server) -> None:
    """A crash, OUTAGE_S down, and a start without persistence: empty."""
    assert server.local is not None
    server.local.stop()
    time.sleep(OUTAGE_S)
    server.local.start()


@pytest.fixture
async def events(events_server: LocalServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(events_server.url)
    yield client
    await client.aclose()


async def test_an_empty_restart_under_a_live_producer_loses_nothing(
    server: Server,
    redis: Redis,
    events: Redis,
    events_server: LocalServer,
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "TAC_DRILL_URL": server.worker_url,
        "TAC_DRILL_EVENTS_URL": events_server.url,
        "TAC_DRILL_QUEUE": QUEUE,
    }
    producer = AtomicRedisStreamBroker(server.admin_url, queue_name=QUEUE)
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, producer, {})
    accepted: list[str] = []
    refused = 0
    with taskiq_workers(env, tmp_path) as logs:

        async def all_ready() -> bool:
            ready: Any = await events.xrange(events_stream(QUEUE))
            readies = [f for _, f in ready if f[b"event"] == b"ready"]
            return len(readies) >= WORKERS

        assert await wait_until(all_ready, 30), [p.read_text() for p in logs]
        restart: asyncio.Task[None] | None = None
        for number in range(KICKS):
            if number == RESTART_AFTER_KICKS:
                restart = asyncio.ensure_future(asyncio.to_thread(outage, server))
            run_id = f"kick-{number}"
            try:
                await asyncio.wait_for(kicker.kiq(run_id, 0.01), 1)
            except (SendTaskError, RedisError, OSError, asyncio.TimeoutError):
                refused += 1  # not accepted: the server was down
            else:
                accepted.append(run_id)
            await asyncio.sleep(1 / KICKS_PER_S)
        assert restart is not None
        await restart
        await redis.connection_pool.disconnect()  # the fixture's own client

        async def all_ran() -> bool:
            return set(accepted) <= await events_of(events, "started")

        await wait_until(all_ran, ALL_RAN_WITHIN_S)
        lost = sorted(set(accepted) - await events_of(events, "started"))
        after = [k for k in accepted if int(k.split("-")[1]) > RESTART_AFTER_KICKS]
        print(
            f"\n{server.label}: accepted {len(accepted)}, refused while down"
            f" {refused}, accepted after the restart {len(after)}, lost {len(lost)}"
        )
        assert not lost, (
            f"{len(lost)} of {len(accepted)} accepted tasks never ran: {lost}\n"
            + "\n".join(p.read_text()[-1500:] for p in logs)
        )
    await producer.shutdown()


async def test_a_group_deleted_on_purpose_resumes_where_it_was(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The old entries stay in the stream: those delivered before are not
    run again, and the ones added after the last delivery are delivered."""
    broker = AtomicRedisStreamBroker(
        server.url, idle_timeout=2000, claim_interval=100, xread_block=100
    )
    await broker.startup()
    try:
        listener = broker.listen()
        for number in range(3):
            await broker.kick(_message(f"old-{number}"))
        for _ in range(3):
            done: Any = await asyncio.wait_for(listener.__anext__(), 5)
            await done.ack()
        await redis.xgroup_destroy("taskiq", "taskiq")
        await broker.kick(_message("new"))
        caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
        again: Any = await asyncio.wait_for(listener.__anext__(), 5)
        assert again.data == b"new"
        await again.ack()
        [group] = await redis.xinfo_groups("taskiq")
        assert group["pending"] == 0
        logged = [r.getMessage() for r in caplog.records]
        assert any("Re-created consumer group" in line for line in logged)
    finally:
        await broker.shutdown()


async def test_recreating_in_a_new_stream_starts_at_its_first_entry(
    redis: Redis,
) -> None:
    """Only the remembered entry itself proves the old history survived: a
    remembered id later than everything in the stream (a new history whose
    server clock is behind the old one's), a trimmed one, or none at all
    re-create at 0, skipping nothing."""
    runner = ScriptRunner()
    await redis.xadd("s", {"a": "1"}, id="5-0")
    await redis.xadd("s", {"a": "2"}, id="7-0")
    assert (
        await recreate_group(redis, runner, StreamKeys("s", "g"), "99-0", mkstream=True)
        == "0"
    )
    assert (
        await recreate_group(redis, runner, StreamKeys("s", "g"), "99-0", mkstream=True)
        is None
    )
    await redis.xgroup_destroy("s", "g")
    assert (
        await recreate_group(redis, runner, StreamKeys("s", "g"), "6-0", mkstream=True)
        == "0"
    )
    await redis.xgroup_destroy("s", "g")
    assert (
        await recreate_group(redis, runner, StreamKeys("s", "g"), None, mkstream=True)
        == "0"
    )
    await redis.xgroup_destroy("s", "g")
    assert (
        await recreate_group(redis, runner, StreamKeys("s", "g"), "5-0", mkstream=True)
        == "5-0"
    )
    [group] = await redis.xinfo_groups("s")
    assert group["last-delivered-id"] == b"5-0"
    assert (
        await recreate_group(
            redis, runner, StreamKeys("gone", "g"), "5-0", mkstream=True
        )
        == "0"
    )
    assert await redis.xinfo_groups("gone")


async def test_a_recreated_group_gives_its_started_entries_to_the_orphans(
    redis: Redis,
) -> None:
    """The started hash outlives the group: an entry started and not acked
    before the group vanished is pending again, at the orphans' consumer,
    where the claim finds it; a worker that holds it takes it back."""
    runner = ScriptRunner()
    keys = StreamKeys("s", "g")
    for ms in (1, 2, 3, 4):
        await redis.xadd("s", {"a": str(ms)}, id=f"{ms}-0")
    await redis.xgroup_create("s", "g", id="0")
    await redis.xreadgroup("g", "w", {"s": ">"}, count=3)
    # 1-0 and 3-0 started (3-0 after what the re-creating worker knows);
    # 2-0 was read and not started; 4-0 never read.
    await redis.hset(keys.started, mapping={"1-0": 1, "3-0": 1, "keep-hashtable": "x"})
    await redis.pexpire(keys.started, 60_000)
    await redis.xgroup_destroy("s", "g")
    assert await recreate_group(redis, runner, keys, "2-0", mkstream=True) == "2-0"
    pending = await redis.xpending_range("s", "g", "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [
        (b"1-0", ORPHANS_CONSUMER.encode())
    ]
    assert pending[0]["times_delivered"] == 1
    # 3-0 and 4-0 come with the next read, as new.
    fresh: Any = await redis.xreadgroup("g", "x", {"s": ">"})
    assert [entry_id for entry_id, _ in fresh[0][1]] == [b"3-0", b"4-0"]
    # The worker running 1-0 takes it back at its heartbeat.
    lost = await runner.run(
        redis,
        set_idle_call(
            stream="s",
            group="g",
            consumer="w",
            idle_ms=0,
            orphans=ORPHANS_CONSUMER,
            entry_ids=["1-0"],
        ),
    )
    assert lost == []
    [taken] = await redis.xpending_range("s", "g", "1-0", "1-0", 1)
    assert taken["consumer"] == b"w"


async def test_an_acl_from_before_hkeys_recreates_the_group_as_before(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker user from before ``+hkeys``: the group comes back where it
    did before, without adopting its started entries, and one warning says
    to re-run ``acl``."""
    user, password = "tac-old-acl", "tac-old-acl-password"
    rule = [r for r in suite_worker_rule(rule_version(server)) if r != "+hkeys"]
    await server_command(
        redis, "ACL", "SETUSER", user, "reset", "on", f">{password}", *rule
    )
    worker = Redis.from_url(with_user(server.admin_url, user, password))
    try:
        await redis.xadd(QUEUE, {"a": "1"}, id="5-0")
        caplog.set_level(logging.WARNING, "taskiq.atomic_claim")
        keys = StreamKeys(QUEUE, SUITE_GROUP)
        started = await recreate_group(
            worker, ScriptRunner(), keys, "5-0", mkstream=True
        )
        assert started == "5-0"
        [group] = await redis.xinfo_groups(QUEUE)
        assert group["last-delivered-id"] == b"5-0"
        warned = [r.getMessage() for r in caplog.records]
        assert any("re-run `taskiq-atomic-claim acl`" in line for line in warned)
    finally:
        await worker.aclose()
        await server_command(redis, "ACL", "DELUSER", user)


def _message(body: str) -> Any:
    from tests.test_broker import message  # noqa: PLC0415

    return message(body)


@contextlib.asynccontextmanager
async def server_config(redis: Redis, **settings: str) -> AsyncIterator[None]:
    """Change the shared server's settings for one test, then put them back."""
    before = {name: str((await redis.config_get(name))[name]) for name in settings}
    for name, value in settings.items():
        await redis.config_set(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            await redis.config_set(name, value)


async def start_and_log(url: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    broker = AtomicRedisStreamBroker(url, idle_timeout=2000)
    with caplog.at_level(logging.WARNING, "taskiq.atomic_claim"):
        await broker.startup()
    await broker.shutdown()
    return [r.getMessage() for r in caplog.records]


async def test_startup_warns_about_settings_that_lose_tasks(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with server_config(redis, **{"maxmemory-policy": "allkeys-lru", "save": ""}):
        logged = await start_and_log(server.admin_url, caplog)
        assert any("maxmemory-policy is allkeys-lru" in line for line in logged)
        assert any("neither AOF nor RDB save points" in line for line in logged)
    async with server_config(
        redis, **{"maxmemory-policy": "noeviction", "save": "3600 1"}
    ):
        logged = await start_and_log(server.admin_url, caplog)
        assert not any("maxmemory-policy" in line for line in logged), logged
        assert not any("save points" in line for line in logged), logged


async def test_a_worker_without_config_in_its_acl_checks_what_info_tells(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented worker ACL has +info, not CONFIG: the eviction policy
    is still checked, the save points are not even asked for (nothing lands
    in ACL LOG), and the worker starts."""
    await server_command(redis, "ACL", "LOG", "RESET")
    async with server_config(redis, **{"maxmemory-policy": "volatile-lru"}):
        logged = await start_and_log(server.worker_url, caplog)
    assert any("maxmemory-policy is volatile-lru" in line for line in logged)
    assert not any("save points" in line for line in logged), logged
    assert await server_command(redis, "ACL", "LOG") == []


async def test_a_cluster_worker_checks_every_primary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.topologies import LocalCluster, binary_for, need  # noqa: PLC0415

    with LocalCluster(need(binary_for(7), "Redis 7"), replicas=0) as cluster:
        one = cluster.primaries[1].server.url
        admin = Redis.from_url(one)
        await admin.config_set("maxmemory-policy", "allkeys-lfu")
        await admin.aclose()
        broker = AtomicRedisStreamClusterBroker(cluster.url, idle_timeout=2000)
        with caplog.at_level(logging.WARNING, "taskiq.atomic_claim"):
            await broker.startup()
        await broker.shutdown()
    logged = [r.getMessage() for r in caplog.records]
    port = cluster.primaries[1].port
    evicting = [line for line in logged if "maxmemory-policy is allkeys-lfu" in line]
    assert evicting == [evicting[0]] and f":{port}" in evicting[0], logged
    unsaved = [line for line in logged if "neither AOF nor RDB" in line]
    assert len(unsaved) == len(cluster.primaries), logged


async def test_a_new_group_beside_another_groups_starts_at_new_entries(
    redis: Redis,
) -> None:
    # A stream another group reads holds history that group consumed: a new
    # group keeps taskiq-redis's "$" and does not replay it. A stream no group
    # ever read holds only tasks nobody has seen: those are delivered.
    await redis.xadd("shared", {"data": b"old"})
    await redis.xgroup_create("shared", "other-app", id="0")
    await redis.xadd("fresh", {"data": b"kicked-before-any-worker"})
    assert await first_position(redis, "shared", "$") == "$"
    assert await first_position(redis, "fresh", "$") == "0"
    assert await first_position(redis, "absent", "$") == "0"
    assert await first_position(redis, "fresh", "5-0") == "5-0"
