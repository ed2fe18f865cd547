"""``doctor`` against real servers; a fleet of taskiq-redis and atomic workers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq import AckableMessage
from taskiq.message import BrokerMessage
from taskiq.utils import maybe_awaitable
from taskiq_redis import RedisStreamBroker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.doctor import (
    Finding,
    Severity,
    Thresholds,
    apply_fixes,
    diagnose,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import LibraryState, ScriptRunner
from tests.conftest import Server, server_command
from tests.test_cli import cli, cli_in_process

KEYS = StreamKeys("jobs", "workers")
LEGACY = "autoclaim:workers:jobs"


async def healthy_group(redis: Redis) -> None:
    await ScriptRunner().load(redis)
    await redis.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    await redis.xadd(KEYS.stream, {"data": "done"})
    reply: Any = await redis.xreadgroup(KEYS.group, "worker", {KEYS.stream: ">"})
    [(_, [(entry_id, _)])] = reply
    await redis.xack(KEYS.stream, KEYS.group, entry_id)


def kinds(findings: list[Finding]) -> list[str]:
    return sorted(finding.kind for finding in findings)


async def test_a_healthy_server_exits_0(server: Server, redis: Redis) -> None:
    await healthy_group(redis)
    result = cli("doctor", "--url", server.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("healthy: 1 stream, 1 group checked")


async def test_fix_gives_a_legacy_lock_an_expiry_instead_of_deleting_it(
    server: Server, redis: Redis, planted_keys: set[str]
) -> None:
    await healthy_group(redis)
    planted_keys.add(LEGACY)
    # What taskiq-redis 1.1.x leaves when killed inside its claim lock.
    await redis.set(LEGACY, "token-of-a-dead-worker")
    await redis.set("autoclaim:expiring", "live-lock", px=60_000)
    found = cli("doctor", "--url", server.url)
    assert found.returncode == 1
    assert f"[legacy-lock] {LEGACY}: no expiry" in found.stdout
    assert "autoclaim:expiring" not in found.stdout
    assert "1 need attention (1 fixable with --fix)" in found.stdout

    fixed = cli("doctor", "--url", server.url, "--fix", "--lock-expiry-ms", "5000")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "fixed: expires in 5.0 s" in fixed.stdout
    assert "healthy after fixing 1" in fixed.stdout
    assert await redis.get(LEGACY) == b"token-of-a-dead-worker"
    assert 0 < await redis.pttl(LEGACY) <= 5000
    assert 5000 < await redis.pttl("autoclaim:expiring") <= 60_000
    again = cli("doctor", "--url", server.url)
    assert again.returncode == 0, again.stdout


async def test_fix_deletes_idle_consumers_with_nothing_pending_only(
    server: Server, redis: Redis
) -> None:
    await healthy_group(redis)
    await redis.xadd(KEYS.stream, {"data": "held"})
    await redis.xreadgroup(KEYS.group, "busy", {KEYS.stream: ">"})
    await redis.xgroup_createconsumer(KEYS.stream, KEYS.group, "gone")
    await asyncio.sleep(0.05)
    limits = Thresholds(consumer_idle_ms=10)
    diagnosis = await diagnose(redis, ["jobs"], thresholds=limits)
    idle = [f for f in diagnosis.findings if f.kind == "idle-consumer"]
    # "worker" acked everything and "gone" never read; "busy" holds an entry.
    assert sorted(f.consumer or "" for f in idle) == ["gone", "worker"]
    assert all(f.fixable for f in idle)
    await apply_fixes(redis, diagnosis, limits)
    assert diagnosis.healthy
    names = [c["name"] for c in await redis.xinfo_consumers("jobs", "workers")]
    assert names == [b"busy"]


async def test_a_consumer_that_read_meanwhile_is_not_deleted(
    server: Server, redis: Redis
) -> None:
    await healthy_group(redis)
    await asyncio.sleep(0.02)
    diagnosis = await diagnose(redis, ["jobs"], thresholds=Thresholds(1))
    [stale] = [f for f in diagnosis.findings if f.kind == "idle-consumer"]
    # Between diagnosis and fix the consumer comes back and reads an entry:
    # deleting it now would drop that entry from the PEL for good.
    await redis.xadd(KEYS.stream, {"data": "new"})
    await redis.xreadgroup(KEYS.group, "worker", {KEYS.stream: ">"})
    await apply_fixes(redis, diagnosis)
    assert not stale.fixed
    assert stale.outcome == "it read entries meanwhile; left alone"
    assert (await redis.xpending(KEYS.stream, KEYS.group))["pending"] == 1
    assert not diagnosis.healthy


async def test_fix_loads_a_missing_library(server: Server, redis: Redis) -> None:
    await healthy_group(redis)
    await server_command(redis, "SCRIPT", "FLUSH")
    if server.major >= 7:
        await server_command(redis, "FUNCTION", "FLUSH")
    found = cli("doctor", "--url", server.url)
    assert found.returncode == 1
    assert "[library]" in found.stdout and "missing" in found.stdout
    fixed = cli("doctor", "--url", server.url, "--fix")
    assert fixed.returncode == 0, fixed.stdout
    assert (await ScriptRunner().status(redis)).state is LibraryState.CURRENT


async def test_what_needs_a_person_stays_non_zero_after_fix(
    server: Server, redis: Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await healthy_group(redis)
    for number in range(3):
        await redis.xadd(KEYS.stream, {"data": f"m{number}"})
    await redis.xreadgroup(KEYS.group, "slow", {KEYS.stream: ">"})
    await redis.xadd(KEYS.dead_letters, {"data": "poison"})
    await redis.xadd("orphan", {"data": "nobody reads me"})
    await asyncio.sleep(0.05)
    limits = Thresholds(max_pending=2, stale_pending_ms=10)
    diagnosis = await diagnose(redis, thresholds=limits)
    assert kinds(diagnosis.findings) == [
        "dead-letters",
        "no-group",
        "pel-size",
        "stale-pending",
    ]
    await apply_fixes(redis, diagnosis, limits)
    assert not diagnosis.healthy
    result = cli(
        "doctor",
        "--url",
        server.url,
        "--fix",
        "--max-pending",
        "2",
        "--stale-pending-ms",
        "10",
    )
    assert result.returncode == 1
    out = result.stdout
    assert "[pel-size] jobs / workers: 3 pending entries (threshold 2)" in out
    assert "[stale-pending] jobs / workers: an entry held by consumer 'slow'" in out
    assert "[dead-letters] jobs / workers: 1 dead letter in" in out
    assert "dead-letters --url URL --queue=jobs --group=workers" in out
    assert "[no-group] orphan" in out
    assert out.count("what to do:") == 4
    assert "4 need attention:" in out
    code, out, _ = await cli_in_process(
        capsys, "doctor", "--url", server.url, "--json", "--max-pending", "2",
        "--stale-pending-ms", "10",
    )  # fmt: skip
    assert code == 1
    report = json.loads(out)
    assert (report["format"], report["healthy"]) == (1, False)
    by_kind = {finding["kind"]: finding for finding in report["findings"]}
    assert sorted(by_kind) == ["dead-letters", "no-group", "pel-size", "stale-pending"]
    assert by_kind["stale-pending"]["consumer"] == "slow"
    assert "dead-letters --url URL --queue=jobs" in by_kind["dead-letters"]["advice"]


async def test_a_backlog_no_live_consumer_reads_comes_first(
    server: Server, redis: Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await healthy_group(redis)
    for number in range(5):
        await redis.xadd(KEYS.stream, {"data": f"w{number}"})
    live = await diagnose(redis, thresholds=Thresholds(idle_timeout_ms=1000))
    assert kinds(live.findings) == [], "its consumer read just now: a live worker"

    # The library gone too: normally the first finding; the outage ranks
    # before it.
    await server_command(redis, "SCRIPT", "FLUSH")
    if server.major >= 7:
        await server_command(redis, "FUNCTION", "FLUSH")
    await asyncio.sleep(0.25)
    code, out, _ = await cli_in_process(
        capsys, "doctor", "--url", server.url, "--idle-timeout-ms", "100"
    )
    assert code == 1
    lines = out.splitlines()
    waiting = "5 entries" if server.major >= 7 else "entries"  # 6.2: no lag
    assert lines[0].startswith(
        f"[unread-backlog] jobs / workers: {waiting} waiting and none of its"
        " 1 consumer has talked to the server for "
    )
    assert lines[0].endswith(": no live worker reads this group")
    assert lines[1].startswith(
        "    what to do: start workers with queue_name='jobs' and"
        " consumer_group_name='workers'"
    )
    assert lines[1].endswith("(--idle-timeout-ms to tune)")
    assert lines[2].startswith("[library]")

    # A group nobody ever joined, under the default idle timeout.
    await ScriptRunner().load(redis)
    await redis.xgroup_create("mail", "taskiq", id="0", mkstream=True)
    await redis.xadd("mail", {"data": "m"})
    [finding] = (await diagnose(redis, ["mail"])).findings
    assert (finding.kind, finding.subject) == ("unread-backlog", "mail / taskiq")
    assert "no consumer has ever read it" in finding.problem
    await redis.xreadgroup("taskiq", "worker", {"mail": ">"})
    assert (await diagnose(redis, ["mail"])).findings == []


async def test_named_streams_and_groups_that_do_not_exist(
    server: Server, redis: Redis
) -> None:
    await healthy_group(redis)
    diagnosis = await diagnose(redis, ["jobs", "nowhere"], "workers")
    assert kinds(diagnosis.findings) == ["missing-stream"]
    assert diagnosis.findings[0].subject == "nowhere"
    diagnosis = await diagnose(redis, ["jobs"], "other-group")
    [finding] = diagnosis.findings
    assert (finding.kind, finding.subject) == ("no-group", "jobs / other-group")
    assert "XGROUP CREATE jobs other-group 0" in finding.advice


def test_bad_inputs_are_one_line_and_exit_2() -> None:
    url = "redis://127.0.0.1:1"
    for args in (
        ["doctor", "--url", "ftp://nowhere"],
        ["doctor", "--url", url, "--consumer-idle-ms", "soon"],
        ["doctor", "--url", url, "--consumer-idle-ms", "0"],
        ["doctor", "--url", url, "--max-pending", "-1"],
        ["doctor", "--url", url, "--lock-expiry-ms", "1.5"],
        ["doctor", "--url", url, "--queue="],
        ["doctor", "--url", url],  # nothing listens there
    ):
        result = cli(*args)
        assert result.returncode == 2, (args, result.stdout)
        assert "Traceback" not in result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


# Migrating: taskiq-redis workers and ours on one stream.

IDLE_MS = 500


def message(body: str) -> BrokerMessage:
    return BrokerMessage(task_id=body, task_name="t", message=body.encode(), labels={})


class Listener:
    """A worker's listen(), read with timeouts that do not end it.

    Cancelling ``__anext__`` (as ``wait_for`` does on timeout) would close
    the generator; here a pending read simply carries over to the next call.
    """

    def __init__(self, generator: AsyncGenerator[AckableMessage, None]) -> None:
        self.generator = generator
        self.next: asyncio.Future[AckableMessage] | None = None

    async def pull(self, timeout: float) -> AckableMessage | None:
        if self.next is None:
            self.next = asyncio.ensure_future(self.generator.__anext__())
        done, _ = await asyncio.wait({self.next}, timeout=timeout)
        if not done:
            return None
        result, self.next = self.next.result(), None
        return result

    async def die(self) -> None:
        """Stop reading, no ack: what SIGKILL does to a worker in-process."""
        if self.next is not None:
            self.next.cancel()
            await asyncio.wait({self.next})
        await self.generator.aclose()


async def test_a_mixed_fleet_loses_nothing_and_leaves_no_unexpiring_key(
    server: Server, redis: Redis
) -> None:
    # The `redis` fixture fails the test if any non-stream key is left
    # without an expiry: taskiq-redis 1.2.4 takes and releases its lock in
    # one MULTI, and the atomic broker's keys always expire.
    started: list[Any] = []

    async def worker(kind: str, name: str) -> Any:
        common: dict[str, Any] = {"idle_timeout": IDLE_MS, "xread_block": 200}
        if kind == "old":
            broker: Any = RedisStreamBroker(server.url, consumer_name=name, **common)
        else:
            broker = AtomicRedisStreamBroker(
                server.url, consumer_name=name, claim_interval=100, **common
            )
        await broker.startup()
        started.append(broker)
        return broker

    try:
        # Both read at once: every message runs at least once. Old workers
        # do not heartbeat what they prefetched, so a new one may reclaim
        # and run such a message again once it waited idle_timeout, exactly
        # as another old worker would.
        old, new = await worker("old", "old-1"), await worker("new", "new-1")
        listeners = [Listener(old.listen()), Listener(new.listen())]
        for number in range(6):
            await (old if number % 2 else new).kick(message(f"a{number}"))
        seen: set[bytes] = set()
        for _ in range(40):
            got = [await listener.pull(0.2) for listener in listeners]
            for item in got:
                if item is not None:
                    seen.add(item.data)
                    await maybe_awaitable(item.ack())
            if len(seen) == 6 and got == [None, None]:
                break
        assert seen == {f"a{n}".encode() for n in range(6)}
        for listener in listeners:
            await listener.die()
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0

        # An old worker dies holding a message; a new one reclaims it.
        old = await worker("old", "old-2")
        dying = Listener(old.listen())
        await old.kick(message("held-by-old"))
        got_old = await dying.pull(2)
        assert got_old is not None and got_old.data == b"held-by-old"
        await dying.die()
        new = await worker("new", "new-2")
        reclaimer = Listener(new.listen())
        got_new = await reclaimer.pull(IDLE_MS / 1000 + 3)
        assert got_new is not None and got_new.data == b"held-by-old"
        await maybe_awaitable(got_new.ack())
        await reclaimer.die()

        # A new worker dies holding a message; an old one reclaims it, as
        # taskiq-redis does: after a read that returned something.
        new = await worker("new", "new-3")
        dying = Listener(new.listen())
        await new.kick(message("held-by-new"))
        got_new = await dying.pull(2)
        assert got_new is not None and got_new.data == b"held-by-new"
        await dying.die()
        await new.atomic.heartbeat.stop()
        new.atomic.in_flight.clear()  # dead: it hands nothing back
        await asyncio.sleep(IDLE_MS / 1000 + 0.1)
        old = await worker("old", "old-3")
        reclaimer = Listener(old.listen())
        await old.kick(message("traffic"))
        taken = [await reclaimer.pull(2) for _ in range(2)]
        assert sorted(m.data for m in taken if m) == [b"held-by-new", b"traffic"]
        for item in taken:
            assert item is not None
            await maybe_awaitable(item.ack())
        await reclaimer.die()
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert await redis.keys("autoclaim:*") == []
    finally:
        for broker in started:
            await broker.shutdown()


async def test_doctor_warns_about_settings_that_lose_tasks(
    server: Server, redis: Redis
) -> None:
    await healthy_group(redis)
    await redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        result = cli("doctor", "--url", server.url)
    finally:
        await redis.config_set("maxmemory-policy", "noeviction")
    # Warnings, not findings: the exit code still reports the groups.
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("healthy: 1 stream, 1 group checked")
    assert "warning [eviction-policy] server: maxmemory-policy is allkeys-lru" in (
        result.stdout
    )
    # The suite's local servers run without persistence.
    if server.local is not None:
        assert "warning [no-persistence] server" in result.stdout
    quiet = cli("doctor", "--url", server.url)
    assert "eviction-policy" not in quiet.stdout


async def test_a_dead_consumer_and_entries_past_the_idle_timeout(
    server: Server, redis: Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await healthy_group(redis)
    limits = Thresholds(idle_timeout_ms=200)
    for number in range(3):
        await redis.xadd(KEYS.stream, {"data": f"t{number}"})
    await redis.xreadgroup(KEYS.group, "gone", {KEYS.stream: ">"}, count=2)
    await redis.xreadgroup(KEYS.group, "alive", {KEYS.stream: ">"}, count=1)
    fresh = await diagnose(redis, thresholds=limits)
    assert kinds(fresh.findings) == [], "held for less than the idle timeout"
    await asyncio.sleep(0.3)
    # "alive" reads again (Redis < 7.2 counts only a read that delivers):
    # its first entry is overdue, but it is not dead; "gone" is silent and
    # holds overdue ones.
    await redis.xadd(KEYS.stream, {"data": "t3"})
    await redis.xreadgroup(KEYS.group, "alive", {KEYS.stream: ">"}, count=1)
    diagnosis = await diagnose(redis, thresholds=limits)
    assert [(f.kind, f.subject) for f in diagnosis.findings] == [
        ("dead-consumer", f"{KEYS.stream} / {KEYS.group} / gone")
    ]
    [dead] = diagnosis.findings
    assert (dead.kind, dead.consumer, dead.severity) == (
        "dead-consumer",
        "gone",
        Severity.WARNING,
    )
    assert dead.problem.startswith("holds 2 entries, one pending for ")
    assert dead.problem.endswith("its worker is gone")

    # Only the live one's overdue entry left: overdue, nobody dead.
    pending = await redis.xpending_range(KEYS.stream, KEYS.group, "-", "+", 10, "gone")
    await redis.xack(KEYS.stream, KEYS.group, *[p["message_id"] for p in pending])
    [overdue] = (await diagnose(redis, thresholds=limits)).findings
    assert overdue.kind == "overdue-pending"
    assert "past the 200 ms idle timeout" in overdue.problem
    code, out, _ = await cli_in_process(
        capsys, "doctor", "--url", server.url, "--idle-timeout-ms", "200", "--json"
    )
    assert code == 1
    [spelled] = json.loads(out)["findings"]
    assert (spelled["kind"], spelled["severity"]) == ("overdue-pending", "warning")
    assert spelled["advice"].endswith("(--idle-timeout-ms to tune)")


async def test_a_stream_growing_without_bound(server: Server, redis: Redis) -> None:
    await healthy_group(redis)  # one entry, acked
    for number in range(5):
        await redis.xadd(KEYS.stream, {"data": f"t{number}"})
    reply: Any = await redis.xreadgroup(KEYS.group, "worker", {KEYS.stream: ">"})
    await redis.xack(KEYS.stream, KEYS.group, *[i for i, _ in reply[0][1]])
    tight = Thresholds(max_retained=5)
    if server.major < 7:
        # No lag on 6.2: with entries waiting, how many is unknown, and so is
        # what the groups still need; nothing is claimed.
        await redis.xadd(KEYS.stream, {"data": "waiting"})
        assert kinds((await diagnose(redis, thresholds=tight)).findings) == []
        await redis.xreadgroup(KEYS.group, "worker", {KEYS.stream: ">"})
    else:
        await redis.xadd(KEYS.stream, {"data": "waiting"})
    assert kinds((await diagnose(redis)).findings) == []
    [grown] = (await diagnose(redis, thresholds=tight)).findings
    assert (grown.kind, grown.subject) == ("unbounded-stream", KEYS.stream)
    assert grown.problem.startswith("7 entries of which 6 no group needs")


async def test_a_server_refusing_writes_ranks_first(
    server: Server, redis: Redis
) -> None:
    await healthy_group(redis)
    await redis.xadd(KEYS.stream, {"data": "waiting"})
    await asyncio.sleep(0.05)
    limit = str((await redis.config_get("maxmemory"))["maxmemory"])
    await redis.config_set("maxmemory", 1)  # used memory is past it at once
    try:
        findings = (
            await diagnose(redis, thresholds=Thresholds(idle_timeout_ms=1))
        ).findings
    finally:
        await redis.config_set("maxmemory", limit)
    assert [f.kind for f in findings][:2] == ["refusing-writes", "unread-backlog"]
    assert findings[0].severity is Severity.CRITICAL
    assert findings[0].problem.startswith("out of memory: ")
    assert kinds((await diagnose(redis)).findings) == []
