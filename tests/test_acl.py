"""The worker ACL of ``doctor.worker_acl_rule``, derived and checked on real servers.

A scenario drives every path a worker takes to the server (startup, kick,
read, reclaim, heartbeat, dead letter, script reload, a foreign lease, hand
back). With the documented rule it runs with nothing refused; with any one
command taken out the server refuses exactly that command: the rule is
enough, and nothing in it is spare.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, RedisError
from taskiq import AckableMessage
from taskiq.api import run_receiver_task
from taskiq.message import BrokerMessage
from taskiq.utils import maybe_awaitable
from taskiq_redis import RedisAsyncResultBackend

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.acl import (
    WORKER_ACL,
    acl_pattern,
    worker_acl_rule,
    worker_commands,
    worker_key_patterns,
)
from taskiq_atomic_claim.group_recovery import GroupCreationError
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import set_idle_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LoadMode, ScriptRunner
from taskiq_atomic_claim.server_errors import PermissionRefusedError
from taskiq_atomic_claim.server_info import ScriptingUnavailableError
from tests.conftest import (
    DRILL_HARNESS,
    DRILL_QUEUES,
    LUA_PATH,
    SUITE_GROUP,
    SUITE_STREAMS,
    WORKER_USER,
    Server,
    acl_log_entries,
    per_path,
    server_command,
    with_user,
)
from tests.receiver import start_as_the_receiver_does

USER, PASSWORD = "acl-test-worker", "acl-test-password"
QUEUE, SIDE, GROUP = "jobs", "side", "workers"
IDLE_MS = 150


async def version_of(redis: Redis) -> str:
    return str((await redis.info("server"))["redis_version"])


async def set_user(redis: Redis, rule: list[str]) -> None:
    await server_command(
        redis, "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", *rule
    )


async def refused(redis: Redis) -> list[str]:
    return [
        entry["object"]
        for entry in acl_log_entries(await server_command(redis, "ACL", "LOG"))
        if entry["username"] == USER
    ]


def message(body: str) -> BrokerMessage:
    return BrokerMessage(task_id=body, task_name="t", message=body.encode(), labels={})


async def exercise(url: str, redis: Redis) -> None:
    """Every way a worker talks to the server, once; errors are the ACL's."""
    steps: list[str] = []
    task = asyncio.ensure_future(_exercise(url, redis, steps))
    done, _ = await asyncio.wait({task}, timeout=30)
    if not done:
        task.cancel()
        pytest.fail(f"the scenario hung after: {steps}")
    task.result()


async def _exercise(url: str, redis: Redis, steps: list[str]) -> None:
    await server_command(redis, "SCRIPT", "FLUSH")
    if await ScriptRunner().mode(redis) is LoadMode.FUNCTIONS:
        await server_command(redis, "FUNCTION", "FLUSH")
    jobs, side = StreamKeys(QUEUE, GROUP), StreamKeys(SIDE, GROUP)
    for stream in (QUEUE, SIDE):
        await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    # A lease of another claimer, once without an expiry (PTTL, PEXPIRE),
    # over an entry idle there (else the fleet's check sends no claim).
    await redis.set(side.lease, "someone-else")
    await redis.xadd(SIDE, {"data": "side-orphan"})
    await redis.xreadgroup(GROUP, "dead", {SIDE: ">"})
    # A cursor a claimer left mid-scan: this scan ends, so it is deleted (DEL).
    await redis.set(jobs.cursor, "0-1", px=60_000)
    # Pending at a consumer that died (XAUTOCLAIM), and an entry without
    # data (the dead_letter script).
    await redis.xadd(QUEUE, {"data": "orphan"})
    await redis.xreadgroup(GROUP, "dead", {QUEUE: ">"})
    await redis.xadd(QUEUE, {"written-by": "someone else"})
    await asyncio.sleep(IDLE_MS / 1000)
    broker = AtomicRedisStreamBroker(
        url,
        queue_name=QUEUE,
        consumer_group_name=GROUP,
        consumer_name="worker",
        additional_streams={SIDE: ">"},
        idle_timeout=IDLE_MS,
        claim_interval=50,
        xread_block=50,
    )
    listener = broker.listen()
    try:
        # Without +fcall/+evalsha, +xgroup|create, +xack or +hdel the broker
        # refuses at startup (its probe is what ACL LOG shows refused); a
        # command first refused by listen() ends it (PermissionRefusedError).
        refusals = (
            RedisError,
            ScriptingUnavailableError,
            GroupCreationError,
            PermissionRefusedError,
            asyncio.TimeoutError,
        )
        with contextlib.suppress(*refusals):
            steps.append("startup")
            await broker.startup()
            steps.append("kick")
            await broker.kick(message("new"))
            got: list[AckableMessage] = []
            # The side stream's orphan may come too, once the lease the
            # claim gave an expiry lapses.
            while not {b"new", b"orphan"} <= {m.data for m in got} and len(got) < 3:
                steps.append("listen")
                got.append(await asyncio.wait_for(listener.__anext__(), 3))
            assert {b"new", b"orphan"} <= {m.data for m in got}
            # Start one (HINCRBY) as taskiq's receiver does: parse its data,
            # then the middlewares' pre_execute, in one task.
            steps.append("start")
            await asyncio.create_task(start_as_the_receiver_does(broker, got[1]))
            # Held past a heartbeat, then acked one; hand back the other.
            await asyncio.sleep(IDLE_MS / 1000)
            steps.append("ack")
            await maybe_awaitable(got[0].ack())
            # An operator's XGROUP DESTROY: the group re-created (the started
            # entry adopted: HKEYS), then taken back by a heartbeat.
            steps.append("group destroyed")
            await redis.xgroup_destroy(QUEUE, GROUP)
            await broker.kick(message("after"))
            while b"after" not in {m.data for m in got}:
                steps.append("listen")
                got.append(await asyncio.wait_for(listener.__anext__(), 3))
            await asyncio.sleep(IDLE_MS / 1000)
            steps.append("hand back")
            await broker.atomic.heartbeat.hand_back()
    finally:
        steps.append("shutdown")
        with contextlib.suppress(RedisError, RuntimeError):
            await listener.aclose()
        with contextlib.suppress(RedisError):
            await broker.shutdown()
        await redis.delete(jobs.lease, side.lease)
        steps.append("done")


def _same(denied: str, command: str) -> bool:
    # 6.2 logs a refused subcommand under its command's name.
    return denied == command or denied == command.split("|", 1)[0]


async def test_the_rule_is_enough_and_nothing_in_it_is_spare(
    server: Server, redis: Redis
) -> None:
    version = await version_of(redis)
    url = with_user(server.url, USER, PASSWORD)
    rule = worker_acl_rule([QUEUE, SIDE], GROUP, version)
    await set_user(redis, rule)
    await server_command(redis, "ACL", "LOG", "RESET")
    await exercise(url, redis)
    assert await refused(redis) == []

    commands = worker_commands(version, handshake=False)
    for command in commands:
        await redis.flushall()
        await set_user(redis, [r for r in rule if r != command])
        await server_command(redis, "ACL", "LOG", "RESET")
        await exercise(url, redis)
        denied = await refused(redis)
        assert any(_same(d, command[1:]) for d in denied), (command, denied)


async def test_a_rule_from_before_the_reclaimed_count_still_reclaims(
    server: Server, redis: Redis
) -> None:
    # The count is an observation (reclaim_count.py): refused, the claim and
    # the read go on (the scenario gets the orphan back), uncounted.
    version = await version_of(redis)
    counting = {"+incrby"} | {
        "~" + acl_pattern(StreamKeys(stream, GROUP).reclaimed)
        for stream in (QUEUE, SIDE)
    }
    rule = worker_acl_rule([QUEUE, SIDE], GROUP, version)
    await set_user(redis, [r for r in rule if r not in counting])
    await server_command(redis, "ACL", "LOG", "RESET")
    await exercise(with_user(server.url, USER, PASSWORD), redis)
    denied = await refused(redis)
    assert denied, "the scenario reclaims nothing"
    assert all(d == "incrby" or ":reclaimed:" in d for d in denied), denied
    assert await redis.exists(StreamKeys(QUEUE, GROUP).reclaimed) == 0


async def test_commands_and_keys_outside_the_rule_are_refused(
    server: Server, redis: Redis
) -> None:
    version = await version_of(redis)
    await set_user(redis, worker_acl_rule([QUEUE], GROUP, version))
    await redis.set("secret", "x", px=60_000)
    worker = Redis.from_url(with_user(server.url, USER, PASSWORD))
    try:
        await worker.xadd(QUEUE, {"data": "mine"})
        for forbidden in (
            ("ACL", "WHOAMI"),
            ("FLUSHALL",),
            ("KEYS", "*"),
            ("CONFIG", "GET", "*"),
            ("SCRIPT", "FLUSH"),
            ("EVAL", "return 1", "0"),
            ("PUBLISH", "channel", "x"),
            ("XGROUP", "DESTROY", QUEUE, GROUP),
            ("GET", "secret"),
            ("XADD", "other-queue", "*", "data", "x"),
            ("XADD", StreamKeys(QUEUE, "other-group").dead_letters, "*", "a", "b"),
        ):
            with pytest.raises(NoPermissionError):
                await server_command(worker, *forbidden)
        if int(version.split(".")[0]) >= 7:
            for forbidden in (("FUNCTION", "FLUSH"), ("FUNCTION", "DELETE", "x")):
                with pytest.raises(NoPermissionError):
                    await server_command(worker, *forbidden)
    finally:
        await worker.aclose()


async def test_without_reload_a_flushed_library_needs_an_operator(
    server: Server, redis: Redis
) -> None:
    version = await version_of(redis)
    await set_user(redis, worker_acl_rule([QUEUE], GROUP, version, reload=False))
    await redis.xgroup_create(QUEUE, GROUP, id="0", mkstream=True)
    keys = StreamKeys(QUEUE, GROUP)
    worker = Redis.from_url(with_user(server.url, USER, PASSWORD))
    beat = set_idle_call(
        stream=QUEUE, group=GROUP, consumer="c", idle_ms=0, orphans="o", entry_ids=[]
    )
    try:
        await ScriptRunner().load(redis)  # what `taskiq-atomic-claim load` does
        await ScriptRunner().run(worker, beat)
        await server_command(redis, "SCRIPT", "FLUSH")
        if int(version.split(".")[0]) >= 7:
            await server_command(redis, "FUNCTION", "FLUSH")
        with pytest.raises(NoPermissionError):
            await ScriptRunner().run(worker, beat)
    finally:
        await worker.aclose()
        await redis.delete(keys.lease)


async def test_names_with_glob_characters_match_only_themselves(
    server: Server, redis: Redis
) -> None:
    version = await version_of(redis)
    queue = "jobs[1]*?\\x"
    await set_user(redis, worker_acl_rule([queue], GROUP, version))
    worker = Redis.from_url(with_user(server.url, USER, PASSWORD))
    try:
        await worker.xadd(queue, {"data": "mine"})
        for lookalike in ("jobs1anything\\x", "jobs[1]*?\\", "jobs1ab\\x"):
            with pytest.raises(NoPermissionError):
                await worker.xadd(lookalike, {"data": "x"})
    finally:
        await worker.aclose()


async def test_whitespace_in_a_name_widens_the_pattern_by_one_character(
    server: Server, redis: Redis
) -> None:
    # ACL patterns cannot hold whitespace (ACL SETUSER: syntax error), so
    # each whitespace character is matched by "?": documented in WORKER_ACL.
    version = await version_of(redis)
    queue = "my queue"
    with pytest.raises(RedisError, match=r"(?i)syntax"):
        await set_user(redis, ["~" + queue])
    await set_user(redis, worker_acl_rule([queue], GROUP, version))
    assert acl_pattern(queue) == "my?queue"
    worker = Redis.from_url(with_user(server.url, USER, PASSWORD))
    try:
        await worker.xadd(queue, {"data": "mine"})
        await worker.xadd("my_queue", {"data": "the documented widening"})
        with pytest.raises(NoPermissionError):
            await worker.xadd("my  queue", {"data": "x"})
    finally:
        await worker.aclose()
    assert "whitespace" in WORKER_ACL


def acl_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "taskiq_atomic_claim.cli", "acl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_acl_command_prints_a_rule_the_server_takes(
    server: Server, redis: Redis
) -> None:
    result = acl_command(
        "--url", server.url, "--queue", QUEUE, "--queue", SIDE, "--group", GROUP,
        "--user", USER,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    comment, line = result.stdout.splitlines()
    assert comment.startswith("# ")
    words = line.split()
    assert words[:6] == ["ACL", "SETUSER", USER, "reset", "on", ">CHANGE-ME"]
    rule = worker_acl_rule([QUEUE, SIDE], GROUP, await version_of(redis))
    assert words[6:] == rule
    assert "~*" not in rule and "+@all" not in rule
    words[5] = f">{PASSWORD}"
    assert await server_command(redis, *words) in (b"OK", "OK")


@pytest.mark.worker_acl
async def test_the_suite_runs_workers_as_the_documented_rule(
    server: Server, redis: Redis
) -> None:
    """What the worker_acl tests run with: the documented rule for their names."""
    assert f"{WORKER_USER}:" in server.url
    version = await version_of(redis)
    fields = await acl_user(redis, WORKER_USER)
    keys = fields[b"keys"]
    listed = (
        keys.decode().split()
        if isinstance(keys, bytes)
        else ["~" + k.decode() for k in keys]
    )
    expected = [
        *worker_key_patterns(list(SUITE_STREAMS), SUITE_GROUP),
        *worker_key_patterns([DRILL_QUEUES], SUITE_GROUP, literal=False),
        *(r for r in DRILL_HARNESS if r.startswith("~")),
    ]
    assert sorted(listed) == sorted(dict.fromkeys(expected))
    assert "~*" not in listed
    commands = fields[b"commands"].decode().split()
    assert "+@all" not in commands
    if int(version.split(".")[0]) < 7:
        return  # 6.2 describes a command set with categories of its own choice
    # The server describes a rule in its own words (7.0: "+@stream -xdel
    # ..." once most of a category is granted): compare with its words for
    # the documented rule, given to a user of its own.
    documented = "tac-documented-rule"
    expected_commands = {
        *worker_commands(version),
        *(r for r in DRILL_HARNESS if r.startswith("+")),
    }
    await server_command(
        redis, "ACL", "SETUSER", documented, "reset", "-@all", *expected_commands
    )
    try:
        described = (await acl_user(redis, documented))[b"commands"]
    finally:
        await server_command(redis, "ACL", "DELUSER", documented)
    assert commands[0] == "-@all"
    assert sorted(commands) == sorted(described.decode().split())


async def acl_user(redis: Redis, name: str) -> dict[bytes, Any]:
    """ACL GETUSER's fields, in RESP2 (a flat list) or RESP3 (a map)."""
    user: Any = await server_command(redis, "ACL", "GETUSER", name)
    if isinstance(user, list):
        return dict(zip(user[::2], user[1::2], strict=True))
    return dict(user)


def test_the_documented_rule_is_the_one_the_code_makes() -> None:
    for version in ("6.2", "7.0", "7.2"):
        for command in worker_commands(version, result_backend=True):
            assert command in WORKER_ACL, (version, command)
    for command in worker_commands("8.2", delete_acked=True):
        assert command in WORKER_ACL, command
    for pattern in worker_key_patterns(["S"], "G"):
        assert pattern in WORKER_ACL


async def test_a_worker_with_a_result_backend_runs_under_the_printed_rule(
    server: Server, redis: Redis
) -> None:
    prefix = "app-results"
    printed = acl_command(
        "--url", server.url, "--queue", QUEUE, "--group", GROUP, "--user", USER,
        "--result-backend-prefix", prefix,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    words = printed.stdout.splitlines()[1].split()
    words[5] = f">{PASSWORD}"
    await server_command(redis, *words)
    await server_command(redis, "ACL", "LOG", "RESET")
    url = with_user(server.url, USER, PASSWORD)
    broker = AtomicRedisStreamBroker(
        url, queue_name=QUEUE, consumer_group_name=GROUP, xread_block=100
    ).with_result_backend(
        RedisAsyncResultBackend(url, prefix_str=prefix, result_ex_time=60)
    )

    @broker.task(task_name="add")
    async def add(a: int, b: int) -> int:
        return a + b

    await broker.startup()
    # What `taskiq worker` runs: the receiver on the broker's listen().
    worker = asyncio.create_task(run_receiver_task(broker))
    try:
        sent = await add.kiq(1, 2)
        result = await sent.wait_result(timeout=10)
        assert result.return_value == 3
        assert await sent.is_ready()
        assert await redis.exists(f"{prefix}:{sent.task_id}") == 1
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
        await broker.shutdown()
    assert await refused(redis) == []


def test_the_result_backend_prefix_cannot_be_empty() -> None:
    printed = acl_command("--result-backend-prefix", "")
    assert printed.returncode == 2
    assert "result_backend_prefix must not be empty" in printed.stderr


async def delete_acked_worker(url: str, redis: Redis) -> None:
    """A worker with delete_acked acks one entry and dead-letters two: one
    without data (dead_letter), one whose task crashed (the reclaim)."""
    keys = StreamKeys(QUEUE, GROUP)
    broker = AtomicRedisStreamBroker(
        url,
        queue_name=QUEUE,
        consumer_group_name=GROUP,
        consumer_name="worker",
        idle_timeout=IDLE_MS,
        claim_interval=50,
        xread_block=50,
        max_deliveries=1,
        delete_acked=True,
    )
    await redis.xgroup_create(QUEUE, GROUP, id="0", mkstream=True)
    crashed = text(await redis.xadd(QUEUE, {"data": "crashed"}))
    await redis.xreadgroup(GROUP, "dead", {QUEUE: ">"})
    await redis.hset(keys.started, crashed, 1)
    await redis.pexpire(keys.started, 60_000)
    await redis.xadd(QUEUE, {"written-by": "someone else"})
    listener = broker.listen()
    try:
        # Without +xackdel the startup refuses (its probe is in ACL LOG).
        with contextlib.suppress(RedisError, PermissionRefusedError):
            await broker.startup()
            await broker.kick(message("new"))
            received = await asyncio.wait_for(listener.__anext__(), 5)
            assert received.data == b"new"
            await maybe_awaitable(received.ack())
            # Reading on, the crashed entry is reclaimed once idle and goes
            # to the dead letters instead of being yielded.
            reading = asyncio.ensure_future(listener.__anext__())
            for _ in range(50):
                if reading.done() or await redis.xlen(keys.dead_letters) == 2:
                    break
                await asyncio.sleep(0.1)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
    finally:
        with contextlib.suppress(RedisError, RuntimeError):
            await listener.aclose()
        with contextlib.suppress(RedisError):
            await broker.shutdown()


async def test_a_delete_acked_worker_acks_and_dead_letters_under_the_printed_rule(
    server: Server, redis: Redis
) -> None:
    printed = acl_command(
        "--url", server.url, "--queue", QUEUE, "--group", GROUP, "--user", USER,
        "--delete-acked",
    )  # fmt: skip
    if not server.info.acked_trimming:
        assert printed.returncode == 2, printed.stdout
        assert printed.stderr.count("\n") == 1, printed.stderr
        assert "delete_acked" in printed.stderr
        assert server.info.name in printed.stderr, "the real product and version"
        return
    assert printed.returncode == 0, printed.stderr
    words = printed.stdout.splitlines()[1].split()
    assert "+xackdel" in words
    words[5] = f">{PASSWORD}"
    await server_command(redis, *words)
    await server_command(redis, "ACL", "LOG", "RESET")
    await delete_acked_worker(with_user(server.url, USER, PASSWORD), redis)
    assert await refused(redis) == []
    assert await redis.xlen(QUEUE) == 0, "acked and dead-lettered: all deleted"
    assert await redis.xlen(StreamKeys(QUEUE, GROUP).dead_letters) == 2

    # Without +xackdel the same worker is refused: the rule needs it.
    await redis.flushall()
    await set_user(redis, [word for word in words[6:] if word != "+xackdel"])
    await server_command(redis, "ACL", "LOG", "RESET")
    await delete_acked_worker(with_user(server.url, USER, PASSWORD), redis)
    assert "xackdel" in await refused(redis)


@pytest.mark.parametrize("version", ["6.2", "7.2", "8.0"])
def test_delete_acked_is_refused_for_a_server_version_without_xackdel(
    version: str,
) -> None:
    printed = acl_command("--server-version", version, "--delete-acked")
    assert printed.returncode == 2
    assert printed.stderr.count("\n") == 1, printed.stderr
    assert f"version {version} has none" in printed.stderr
    assert "Redis >= 8.2" in printed.stderr
    accepted = acl_command("--server-version", "8.2", "--delete-acked")
    assert accepted.returncode == 0, accepted.stderr
    assert "+xackdel" in accepted.stdout.split()
    assert "+xackdel" not in acl_command("--server-version", "8.2").stdout.split()


def test_delete_acked_without_a_version_says_the_refused_version_was_a_default() -> (
    None
):
    printed = acl_command("--delete-acked")
    assert printed.returncode == 2
    assert printed.stderr.count("\n") == 1, printed.stderr
    assert "Redis >= 8.2" in printed.stderr
    assert "default" in printed.stderr and "7.2" in printed.stderr, printed.stderr
    assert "--url" in printed.stderr and "--server-version" in printed.stderr


async def logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    for _ in range(100):
        if any(text in record.getMessage() for record in caplog.records):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not logged in 5 s: {text!r}")


@per_path(LUA_PATH)
async def test_a_gate_the_acl_refused_is_used_again_once_allowed(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # An operator re-runs `acl` after an upgrade added the gate's key: the
    # running worker uses the gate again, no restart needed.
    version = await version_of(redis)
    rule = worker_acl_rule([QUEUE], GROUP, version)
    gate = StreamKeys(QUEUE, GROUP)
    without_gate = [r for r in rule if "gate" not in r]
    assert len(without_gate) == len(rule) - 1
    await set_user(redis, without_gate)
    await redis.xgroup_create(QUEUE, GROUP, id="0", mkstream=True)
    broker = AtomicRedisStreamBroker(
        with_user(server.url, USER, PASSWORD),
        queue_name=QUEUE,
        consumer_group_name=GROUP,
        consumer_name="upgraded",
        idle_timeout=1000,
        claim_interval=100,
        xread_block=100,
    )
    caplog.set_level(logging.INFO, "taskiq.atomic_claim")
    await broker.startup()
    listening = asyncio.ensure_future(broker.listen().__anext__())
    try:
        await logged(caplog, "cannot use the fleet's claim gate")
        await set_user(redis, rule)
        await logged(caplog, "uses the fleet's claim gate again")
        assert await redis.get(gate.claim_gate([QUEUE])) == b"upgraded"
        assert not listening.done()
    finally:
        listening.cancel()
        await broker.shutdown()
    warned = [
        r.getMessage()
        for r in caplog.records
        if "cannot use the fleet's" in r.getMessage()
    ]
    assert len(warned) == 1, warned
