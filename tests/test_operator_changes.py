"""What an operator does to a live queue, with real ``taskiq worker``
processes: a permission revoked for a while and given back (each
worker's user loses one command), the consumer group destroyed under a
producer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_errors import PermissionRefusedError
from tests.conftest import (
    SUITE_GROUP,
    VALKEY_REDIS_VERSION,
    Server,
    server_command,
    suite_worker_rule,
    with_user,
)
from tests.edges_app import NOTE_TASK, done_stream
from tests.test_started_semantics import stop_gracefully, taskiq_worker

QUEUE = "taskiq"  # a name the documented worker rule covers (SUITE_STREAMS)
USER, PASSWORD = "tac-revoked", "tac-revoked-password"
IDLE_MS = 2000


def worker_env(
    url: str,
    notes_url: str,
    name: str,
    *,
    idle_ms: int = IDLE_MS,
    claim_interval_ms: int = IDLE_MS // 5,
    max_deliveries: int = 2,
    xread_block_ms: int | None = None,
) -> dict[str, str]:
    """The environment edges_app's broker takes its settings from."""
    env = {
        **os.environ,
        "TAC_TEST_URL": url,
        "TAC_TEST_NOTES_URL": notes_url,
        "TAC_TEST_QUEUE": QUEUE,
        "TAC_TEST_WORKER": name,
        "TAC_TEST_IDLE_TIMEOUT": str(idle_ms),
        "TAC_TEST_CLAIM_INTERVAL": str(claim_interval_ms),
        "TAC_TEST_MAX_DELIVERIES": str(max_deliveries),
    }
    if xread_block_ms is not None:
        env["TAC_TEST_XREAD_BLOCK"] = str(xread_block_ms)
    return env


@contextlib.contextmanager
def workers_stopped_at_exit() -> Iterator[list[subprocess.Popen[bytes]]]:
    workers: list[subprocess.Popen[bytes]] = []
    try:
        yield workers
    finally:
        for process in workers:
            if process.poll() is None:
                stop_gracefully(process)


@contextlib.asynccontextmanager
async def kicking(url: str) -> AsyncIterator[AsyncKicker[Any, Any]]:
    broker = AtomicRedisStreamBroker(url, queue_name=QUEUE)
    try:
        yield AsyncKicker(NOTE_TASK, broker, {})
    finally:
        await broker.shutdown()


async def runs_noted(redis: Redis) -> Counter[str]:
    entries = await redis.xrange(done_stream(QUEUE)) or []
    return Counter(text(fields[b"run"]) for _, fields in entries if fields)


async def wait_for(redis: Redis, runs: set[str], seconds: float) -> Counter[str]:
    """Every run noted and nothing pending in the group (every ack landed),
    or the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        noted = await runs_noted(redis)
        pending = await redis.xpending(QUEUE, SUITE_GROUP)
        if (set(noted) >= runs and not pending["pending"]) or (
            time.monotonic() > deadline
        ):
            return noted
        await asyncio.sleep(0.2)


async def dead_letters(redis: Redis) -> int:
    key = StreamKeys(QUEUE, SUITE_GROUP).dead_letters
    return int(await redis.xlen(key)) if await redis.exists(key) else 0


def rule_version(server: Server) -> str:
    # The rule takes INFO's redis_version, which Valkey keeps at 7.2.4.
    return (
        VALKEY_REDIS_VERSION if server.info.product == "Valkey" else server.info.version
    )


@pytest.mark.parametrize("revoked", ["xack", "scripts", "hincrby"])
async def test_a_permission_revoked_for_a_while_fails_no_task(
    server: Server, redis: Redis, tmp_path: Path, revoked: str
) -> None:
    """The worker's user loses one command for ~5 s while tasks run, then
    gets it back: no task is dead-lettered or runs twice, the worker never
    restarts, and each loop that met the refusal says so once, naming the
    command, and once when it is allowed again."""
    command = revoked
    if revoked == "scripts":
        command = "fcall" if server.info.functions else "evalsha"
    await server_command(redis,
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}",
        *suite_worker_rule(rule_version(server)),
    )  # fmt: skip
    url = with_user(server.admin_url, USER, PASSWORD)
    await redis.xgroup_create(QUEUE, SUITE_GROUP, id="0", mkstream=True)
    log = tmp_path / "worker.log"
    runs = {f"run-{n}" for n in range(40)}
    try:
        with workers_stopped_at_exit() as workers:
            worker = taskiq_worker(
                "tests.edges_app:broker",
                log,
                worker_env(url, server.admin_url, "worker-1"),
            )
            workers.append(worker)
            async with kicking(server.admin_url) as kicker:
                for n, run in enumerate(sorted(runs)):
                    if n == 8:
                        # Revoked under a running worker, not before it ran.
                        assert await wait_for(redis, {"run-0"}, 30), "no run"
                    if n in (8, 32):  # ~5 s apart
                        change = f"{'-' if n == 8 else '+'}{command}"
                        await server_command(redis, "ACL", "SETUSER", USER, change)
                    # Longer at the end: the heartbeat has entries to beat
                    # for, and so a call to prove the ACL allows it again.
                    await kicker.kiq(run, 0.2 if n < 32 else 1.5)
                    await asyncio.sleep(0.2)
            noted = await wait_for(redis, runs, 30)
            stop_gracefully(worker)
    finally:
        await server_command(redis, "ACL", "DELUSER", USER)
    logged = log.read_text()
    assert set(noted) == runs, logged
    twice = sorted(run for run, times in noted.items() if times > 1)
    assert not twice, logged
    assert await dead_letters(redis) == 0, logged
    for sign in ("Traceback", "never retrieved", "workers that died", "restarted"):
        assert sign not in logged, logged
    lines = logged.splitlines()
    if revoked == "hincrby":
        # The task runs anyway, its start uncounted: said once, not per task.
        began = [line for line in lines if "Could not record the start" in line]
        ended = [line for line in lines if "Starts recorded again" in line]
        assert f"'{command}" in began[0], logged
        assert len(began) == len(ended) == 1, logged
        return
    began = [
        line for line in lines if "permission refused" in line and f"'{command}" in line
    ]
    ended = [line for line in lines if "the ACL allows it again" in line]
    assert began, logged
    # At most one line each way per loop that met it (listen, heartbeat, acks).
    assert len(began) == len(ended) <= 3, logged


async def test_a_permission_missing_from_the_start_is_one_clear_error(
    server: Server, redis: Redis
) -> None:
    # Not revoked under a running worker but never granted: waiting would
    # hide a misconfiguration, so the first refused read fails listen().
    await server_command(redis,
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}",
        *suite_worker_rule(rule_version(server)), "-xreadgroup",
    )  # fmt: skip
    broker = AtomicRedisStreamBroker(
        with_user(server.admin_url, USER, PASSWORD), queue_name=QUEUE
    )
    broker.is_worker_process = True
    try:
        await broker.startup()
        with pytest.raises(PermissionRefusedError) as refused:
            async for _ in broker.listen():
                break
    finally:
        await broker.shutdown()
        await server_command(redis, "ACL", "DELUSER", USER)
    message = str(refused.value)
    assert "'xreadgroup'" in message, message
    assert "taskiq-atomic-claim acl" in message


@pytest.mark.parametrize("operation", ["destroy", "delconsumer"])
async def test_a_destroyed_group_loses_no_task_still_in_the_stream(
    server: Server, redis: Redis, tmp_path: Path, operation: str
) -> None:
    """An operator's XGROUP DESTROY (or DELCONSUMER of a live worker) under
    two busy workers and a producer: every accepted task still runs (some
    may run twice: a new group cannot know what the old one delivered)."""
    await redis.xgroup_create(QUEUE, SUITE_GROUP, id="0", mkstream=True)
    runs = [f"run-{n}" for n in range(240)]
    with workers_stopped_at_exit() as workers:
        for name in ("worker-1", "worker-2"):
            workers.append(
                taskiq_worker(
                    "tests.edges_app:broker",
                    tmp_path / f"{name}.log",
                    worker_env(server.admin_url, server.admin_url, name),
                    # Few slots: each worker holds read entries not started.
                    "--max-async-tasks",
                    "4",
                )
            )
        async with kicking(server.admin_url) as kicker:
            for n, run in enumerate(runs):
                if n == 120 and operation == "destroy":
                    await redis.xgroup_destroy(QUEUE, SUITE_GROUP)
                if n == 120 and operation == "delconsumer":
                    await redis.xgroup_delconsumer(QUEUE, SUITE_GROUP, "worker-1")
                await kicker.kiq(run, 0.1)
                if n % 20 == 19:
                    await asyncio.sleep(0.5)
        noted = await wait_for(redis, set(runs), 40)
        for worker in workers:
            stop_gracefully(worker)
    logs = "\n".join(
        (tmp_path / f"{name}.log").read_text() for name in ("worker-1", "worker-2")
    )
    lost = sorted(set(runs) - set(noted))
    assert not lost, logs
    assert "Traceback" not in logs, logs


async def started_at(
    redis: Redis, consumer: str, seconds: float, *, other_than: str = ""
) -> str:
    """The id of an entry pending at ``consumer`` whose start is recorded."""
    started = StreamKeys(QUEUE, SUITE_GROUP).started
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for entry in await redis.xpending_range(QUEUE, SUITE_GROUP, "-", "+", 100):
            entry_id = text(entry["message_id"])
            if (
                text(entry["consumer"]) == consumer
                and entry_id != other_than
                and await redis.hget(started, entry_id)
            ):
                return entry_id
        await asyncio.sleep(0.1)
    raise AssertionError(f"no task started at {consumer!r} within {seconds} s")


async def test_a_dead_workers_task_runs_after_its_group_is_destroyed(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    """XGROUP DESTROY just after a worker was SIGKILLed mid-task (its
    pending list goes with the group) while a live worker runs a long task:
    the dead worker's task still runs, once; the live worker's runs once,
    though it too is pending at the orphans' consumer for a while and an
    idle worker stands by to take it."""
    idle_ms = 4000
    await redis.xgroup_create(QUEUE, SUITE_GROUP, id="0", mkstream=True)

    def worker(name: str, *args: str) -> subprocess.Popen[bytes]:
        env = worker_env(server.admin_url, server.admin_url, name, idle_ms=idle_ms)
        log = tmp_path / f"{name}.log"
        return taskiq_worker("tests.edges_app:broker", log, env, *args)

    with workers_stopped_at_exit() as workers:
        # One slot: busy with the orphan, it reads nothing more.
        workers.append(doomed := worker("doomed", "--max-async-tasks", "1"))
        async with kicking(server.admin_url) as kicker:
            # Long enough to outlast the live worker's start-up: killed while
            # it runs, whatever the machine's speed.
            await kicker.kiq("orphan", 12.0)
            orphan = await started_at(redis, "doomed", 30)
            workers.append(worker("live"))
            await kicker.kiq("long", 8.0)
            await started_at(redis, "live", 30, other_than=orphan)
            os.killpg(doomed.pid, signal.SIGKILL)  # its worker process too
            doomed.wait()
            [still] = await redis.xpending_range(QUEUE, SUITE_GROUP, orphan, orphan, 1)
            assert text(still["consumer"]) == "doomed", "it finished before the kill"
            await redis.xgroup_destroy(QUEUE, SUITE_GROUP)
            # Re-created by the live worker's next read (a worker starting
            # while no group exists creates it at 0 and runs everything).
            deadline = time.monotonic() + 10
            while not await redis.xinfo_groups(QUEUE):
                assert time.monotonic() < deadline, "the group was not re-created"
                await asyncio.sleep(0.1)
            workers.append(worker("standby"))
            noted = await wait_for(redis, {"orphan", "long"}, 60)
        for process in workers:
            if process.poll() is None:
                stop_gracefully(process)
    logs = "\n".join(
        (tmp_path / f"{name}.log").read_text() for name in ("doomed", "live", "standby")
    )
    assert noted["orphan"] == 1, logs
    assert noted["long"] == 1, logs
    assert "Traceback" not in logs, logs


ADMIN = "tac-admin"


@pytest.mark.parametrize("change", ["acl", "requirepass"])
async def test_a_password_changed_under_a_running_worker_is_waited_out(
    server: Server, redis: Redis, tmp_path: Path, change: str
) -> None:
    """The worker's password is changed (``ACL SETUSER ... resetpass
    >new``, or ``CONFIG SET requirepass``) and its connections cut, so every
    reconnect's login is refused, then set back: the worker waits, one line
    naming the refused login when it starts and one when it ends; it never
    restarts, its running task finishes once and the queued ones run once."""
    await server_command(redis,
        "ACL", "SETUSER", ADMIN, "reset", "on", f">{PASSWORD}", "~*", "&*", "+@all",
    )  # fmt: skip
    admin_url = with_user(server.admin_url, ADMIN, PASSWORD)
    if change == "acl":
        await server_command(redis,
            "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}",
            *suite_worker_rule(rule_version(server)),
        )  # fmt: skip
        user, url = USER, with_user(server.admin_url, USER, PASSWORD)
        refuse: list[Any] = ["ACL", "SETUSER", USER, "resetpass", ">changed"]
        allow: list[Any] = ["ACL", "SETUSER", USER, "resetpass", f">{PASSWORD}"]
    else:
        user, url = "default", server.admin_url
        refuse = ["CONFIG", "SET", "requirepass", "changed"]
        allow = ["CONFIG", "SET", "requirepass", ""]
    await redis.xgroup_create(QUEUE, SUITE_GROUP, id="0", mkstream=True)
    admin = Redis.from_url(admin_url)
    log = tmp_path / "worker.log"
    runs = {"first", "long", *(f"queued-{n}" for n in range(6))}
    try:
        with workers_stopped_at_exit() as workers:
            worker = taskiq_worker(
                "tests.edges_app:broker", log, worker_env(url, admin_url, "worker-1")
            )
            workers.append(worker)
            async with kicking(admin_url) as kicker:
                await kicker.kiq("first")
                assert await wait_for(admin, {"first"}, 30), log.read_text()
                await kicker.kiq("long", 5.0)
                await asyncio.sleep(0.5)  # it runs
                await server_command(admin, *refuse)
                # Every connection of the worker, the liveness thread's too:
                # each reconnect now logs in with the old password.
                await server_command(admin, "CLIENT", "KILL", "USER", user)
                for n in range(6):
                    await kicker.kiq(f"queued-{n}", 0.1)
                # Longer than idle_timeout: nothing of the worker's beats.
                await asyncio.sleep(2 * IDLE_MS / 1000)
                await server_command(admin, *allow)
            noted = await wait_for(admin, runs, 30)
            stop_gracefully(worker)
    finally:
        await server_command(admin, "CONFIG", "SET", "requirepass", "")
        await server_command(admin, "ACL", "DELUSER", USER)
        await admin.aclose()
        await server_command(redis, "ACL", "DELUSER", ADMIN)
    logged = log.read_text()
    assert set(noted) == runs, logged
    assert not [run for run, times in noted.items() if times > 1], logged
    for sign in ("Traceback", "never retrieved", "restarted", "LoginRefusedError"):
        assert sign not in logged, logged
    lines = logged.splitlines()
    where = server.admin_url.rsplit("@", 1)[-1].split("//")[-1]
    began = [line for line in lines if "login refused" in line]
    ended = [line for line in lines if "login accepted again" in line]
    assert began, logged
    assert all(f"user {user!r}" in line and where in line for line in began), logged
    # At most one line each way per loop that met it (listen, heartbeat,
    # liveness, acks).
    assert len(began) == len(ended) <= 4, logged
