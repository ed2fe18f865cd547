"""Semantics of lua/claim.lua on every server the suite found."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from taskiq_atomic_claim.claim import ClaimOutcome, claim_idle_entries
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.reclaim_count import RECLAIMED_TTL_MS
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LoadMode, ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings
from tests.conftest import server_command

STREAM, GROUP = "jobs", "workers"
KEYS = StreamKeys(STREAM, GROUP)


def settings(
    idle_timeout: int = 20, batch: int = 100, lease_s: float | None = None
) -> ClaimSettings:
    return ClaimSettings.from_broker_arguments(
        idle_timeout=idle_timeout,
        claim_interval=None,
        unacknowledged_batch_size=batch,
        unacknowledged_lock_timeout=lease_s,
    )


async def pending_for(redis: Redis, consumer: str, count: int = 10) -> list[bytes]:
    """Entries ``consumer`` read and never acked, as a crashed worker leaves them."""
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for number in range(count):
        await redis.xadd(STREAM, {"data": f"task-{number}"})
    reply: Any = await redis.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=count)
    return [entry_id for entry_id, _ in reply[0][1]]


async def claim(
    redis: Redis, consumer: str, claim_settings: ClaimSettings, runner: ScriptRunner
) -> ClaimOutcome:
    return await claim_idle_entries(runner, redis, KEYS, consumer, claim_settings)


async def owner_of(redis: Redis, entry_id: bytes) -> str:
    [entry] = await redis.xpending_range(STREAM, GROUP, entry_id, entry_id, 1)
    return text(entry["consumer"])


async def test_idle_entries_move_to_the_claimer(redis: Redis) -> None:
    ids = await pending_for(redis, "dead", 3)
    await asyncio.sleep(0.05)
    outcome = await claim(redis, "alive", settings(), ScriptRunner())
    assert not outcome.skipped
    assert [entry.id.encode() for entry in outcome.entries] == ids
    assert [entry.fields[b"data"] for entry in outcome.entries] == [
        b"task-0",
        b"task-1",
        b"task-2",
    ]
    assert [await owner_of(redis, entry_id) for entry_id in ids] == ["alive"] * 3
    assert outcome.trimmed == []


async def test_entries_not_idle_long_enough_stay(redis: Redis) -> None:
    ids = await pending_for(redis, "busy", 2)
    outcome = await claim(redis, "alive", settings(idle_timeout=60_000), ScriptRunner())
    assert not outcome.skipped
    assert outcome.entries == []
    assert [await owner_of(redis, entry_id) for entry_id in ids] == ["busy"] * 2


async def test_count_bounds_one_claim(redis: Redis) -> None:
    await pending_for(redis, "dead", 5)
    await asyncio.sleep(0.05)
    outcome = await claim(redis, "alive", settings(batch=2), ScriptRunner())
    assert len(outcome.entries) == 2


async def test_other_consumers_skip_while_lease_is_held(redis: Redis) -> None:
    await pending_for(redis, "dead", 2)
    await asyncio.sleep(0.05)
    runner, lease = ScriptRunner(), settings(lease_s=30)
    first = await claim(redis, "a", lease, runner)
    second = await claim(redis, "b", lease, runner)
    assert len(first.entries) == 2
    assert second.skipped
    assert second.lease_holder == "a"
    assert second.lease_ttl_ms is not None
    assert 0 < second.lease_ttl_ms <= 30_000


async def test_the_holder_claims_again_and_renews(redis: Redis) -> None:
    await pending_for(redis, "dead", 1)
    runner, lease = ScriptRunner(), settings(lease_s=30)
    await claim(redis, "a", lease, runner)
    await redis.pexpire(KEYS.lease, 100)
    again = await claim(redis, "a", lease, runner)
    assert not again.skipped
    assert await redis.pttl(KEYS.lease) > 20_000


async def test_lease_expires_and_another_consumer_claims(redis: Redis) -> None:
    await pending_for(redis, "dead", 1)
    runner, lease = ScriptRunner(), settings(idle_timeout=20, lease_s=0.1)
    taken = await claim(redis, "a", lease, runner)
    assert not taken.skipped
    assert (await claim(redis, "b", lease, runner)).skipped
    await asyncio.sleep(0.15)
    after = await claim(redis, "b", lease, runner)
    assert not after.skipped
    assert await redis.get(KEYS.lease) == b"b"


async def test_a_lease_written_without_expiry_gets_one(redis: Redis) -> None:
    await pending_for(redis, "dead", 1)
    await redis.set(KEYS.lease, "someone-else")
    outcome = await claim(redis, "a", settings(lease_s=0.2), ScriptRunner())
    assert outcome.skipped
    assert outcome.lease_holder == "someone-else"
    assert 0 < await redis.pttl(KEYS.lease) <= 200
    await asyncio.sleep(0.25)
    assert not (await claim(redis, "a", settings(lease_s=0.2), ScriptRunner())).skipped


async def test_cursor_reaches_entries_beyond_count_times_ten(redis: Redis) -> None:
    # XAUTOCLAIM scans COUNT*10 PEL entries per call. With COUNT 2 the first
    # 50 busy entries hide the 10 idle ones behind them unless the scan
    # resumes where the last call stopped.
    ids = await pending_for(redis, "dead", 60)
    await asyncio.sleep(1.1)
    await redis.xclaim(STREAM, GROUP, "busy", 0, list(ids[:50]), justid=True)
    runner, claim_settings = ScriptRunner(), settings(idle_timeout=1000, batch=2)

    claimed: list[str] = []
    cursors = []
    for _ in range(10):
        outcome = await claim(redis, "alive", claim_settings, runner)
        claimed += [entry.id for entry in outcome.entries]
        cursors.append(outcome.next_cursor)
        if outcome.next_cursor != "0-0":
            assert 0 < await redis.pttl(KEYS.cursor) <= claim_settings.cursor_ttl
    assert sorted(claimed) == sorted(entry_id.decode() for entry_id in ids[50:])
    assert cursors[0] == ids[20].decode()


async def test_cursor_restarts_at_the_start_after_a_full_pass(redis: Redis) -> None:
    await pending_for(redis, "dead", 3)
    await asyncio.sleep(0.05)
    outcome = await claim(redis, "alive", settings(), ScriptRunner())
    assert outcome.next_cursor == "0-0"
    assert await redis.exists(KEYS.cursor) == 0


async def test_trimmed_entries_leave_the_pel_and_are_reported(redis: Redis) -> None:
    ids = await pending_for(redis, "dead", 4)
    await redis.xdel(STREAM, ids[1])
    await redis.xtrim(STREAM, minid=ids[3].decode(), approximate=False)
    await asyncio.sleep(0.05)
    outcome = await claim(redis, "alive", settings(), ScriptRunner())
    assert [entry.id.encode() for entry in outcome.entries] == [ids[3]]
    assert sorted(outcome.trimmed) == sorted(i.decode() for i in ids[:3])
    summary = await redis.xpending(STREAM, GROUP)
    assert summary["pending"] == 1


async def test_trimmed_entries_leave_the_pel_when_the_scan_is_partial(
    redis: Redis,
) -> None:
    ids = await pending_for(redis, "dead", 30)
    await redis.xtrim(STREAM, minid=ids[25].decode(), approximate=False)
    await asyncio.sleep(0.05)
    runner, claim_settings = ScriptRunner(), settings(batch=1)
    trimmed: list[str] = []
    # 7.x drops vanished entries without counting them against COUNT; 6.2
    # claims them one COUNT at a time. Both must get through in bounded calls.
    for _ in range(40):
        outcome = await claim(redis, "alive", claim_settings, runner)
        trimmed += outcome.trimmed
        if outcome.entries:
            break
    assert sorted(trimmed) == sorted(i.decode() for i in ids[:25])
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 5


async def test_missing_group_is_an_error_and_takes_no_lease(redis: Redis) -> None:
    await redis.xadd(STREAM, {"data": "x"})
    with pytest.raises(ResponseError, match="NOGROUP"):
        await claim(redis, "alive", settings(), ScriptRunner())
    assert await redis.exists(KEYS.lease) == 0


async def test_flushed_scripts_are_reloaded_once(redis: Redis) -> None:
    await pending_for(redis, "dead", 1)
    await asyncio.sleep(0.05)
    runner = ScriptRunner()
    mode = await runner.load(redis)
    if mode is LoadMode.FUNCTIONS:
        await server_command(redis, "FUNCTION", "FLUSH")
    else:
        await server_command(redis, "SCRIPT", "FLUSH")
    outcome = await claim(redis, "alive", settings(), runner)
    assert len(outcome.entries) == 1
    assert runner.reloads == 1
    await claim(redis, "alive", settings(), runner)
    assert runner.reloads == 1


async def flush_scripts(redis: Redis, runner: ScriptRunner) -> None:
    await server_command(redis, "SCRIPT", "FLUSH")
    if await runner.mode(redis) is LoadMode.FUNCTIONS:
        await server_command(redis, "FUNCTION", "FLUSH")


async def test_never_loaded_scripts_load_on_first_call(redis: Redis) -> None:
    reloaded: list[None] = []
    runner = ScriptRunner(on_reload=lambda: reloaded.append(None))
    await flush_scripts(redis, runner)
    await pending_for(redis, "dead", 1)
    outcome = await claim(redis, "alive", settings(idle_timeout=60_000), runner)
    assert not outcome.skipped
    # The first load on a server is no reload: nothing was lost.
    assert runner.reloads == 0
    assert not reloaded
    # Lost after it ran (a restart, a flush, a failover): that is a reload.
    await flush_scripts(redis, runner)
    await claim(redis, "alive", settings(idle_timeout=60_000), runner)
    assert runner.reloads == 1
    assert len(reloaded) == 1


async def calls_of(redis: Redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_claim_reads_the_batch_s_start_counts_with_one_hmget(
    redis: Redis,
) -> None:
    # Commands a script runs count in INFO commandstats: a claim of 50 idle
    # entries reads their start counts with one HMGET, not one per entry.
    await pending_for(redis, "dead", 50)
    await asyncio.sleep(0.05)
    runner = ScriptRunner()
    await runner.load(redis)
    hmget = await calls_of(redis, "hmget")
    outcome = await claim(redis, "alive", settings(), runner)
    assert len(outcome.entries) == 50
    assert await calls_of(redis, "hmget") == hmget + 1


async def test_the_claim_script_reads_no_entry_s_fields(redis: Redis) -> None:
    # Fields that pass through Lua are converted to Lua values and back,
    # holding the server far longer than the bare read of them. The script
    # claims ids only and raises the delivery count, as a claim of whole
    # entries does (tasks no worker knows are counted by it); XRANGE
    # outside it reads the fields and takes nothing.
    payload = b"x" * 100_000
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for _ in range(100):
        await redis.xadd(STREAM, {"data": payload})
    await redis.xreadgroup(GROUP, "dead", {STREAM: ">"}, count=100)
    await asyncio.sleep(0.05)
    runner = ScriptRunner()
    await runner.load(redis)
    config: Any = await redis.config_get("slowlog-*")
    try:
        await redis.config_set("slowlog-log-slower-than", 0)
        await redis.config_set("slowlog-max-len", 1024)
        await redis.slowlog_reset()
        outcome = await claim(redis, "alive", settings(), runner)
        logged: Any = await redis.slowlog_get(1024)
    finally:
        for name, value in config.items():
            await redis.config_set(name, value)
    assert [entry.fields for entry in outcome.entries] == [{b"data": payload}] * 100
    pending = await redis.xpending_range(STREAM, GROUP, "-", "+", 100)
    assert {row["times_delivered"] for row in pending} == {2}
    commands = [text(entry["command"]).upper().split() for entry in logged]
    autoclaims = [words for words in commands if words[0] == "XAUTOCLAIM"]
    # Commands a script runs are in the slow log too.
    assert autoclaims
    assert all("JUSTID" in words for words in autoclaims), autoclaims
    # The count raise: XCLAIM ... JUSTID RETRYCOUNT (the slow log cuts its
    # arguments, options last, at 32).
    assert [words for words in commands if words[0] == "XCLAIM"]
    assert not [words for words in commands if words[0] == "XREAD"]
    assert len([words for words in commands if words[0] == "XRANGE"]) == 100


async def test_the_claim_counts_the_entries_it_hands_over_with_an_expiry(
    redis: Redis,
) -> None:
    # What serve's history draws as reclaimed/s (reclaim_count.py): raised
    # by the entries given to the claimer, in the claim's own step; entries
    # dead-lettered instead are not reclaims; a claim of nothing writes
    # nothing.
    ids = await pending_for(redis, "dead", 4)
    runner = ScriptRunner()
    busy = await claim(redis, "alive", settings(idle_timeout=60_000), runner)
    assert busy.entries == []
    assert await redis.exists(KEYS.reclaimed) == 0
    # The first entry's task crashed 5 workers (the default max_deliveries).
    await redis.hset(KEYS.started, ids[0], 5)
    await redis.pexpire(KEYS.started, 60_000)
    await asyncio.sleep(0.05)
    outcome = await claim(redis, "alive", settings(), runner)
    assert (len(outcome.entries), outcome.dead_lettered) == (3, [ids[0].decode()])
    assert await redis.get(KEYS.reclaimed) == b"3"
    assert 0 < await redis.pttl(KEYS.reclaimed) <= RECLAIMED_TTL_MS
    await redis.pexpire(KEYS.reclaimed, 60_000)
    # Idle again at their new owner: taken again, counted again, the
    # expiry renewed.
    await asyncio.sleep(0.05)
    again = await claim(redis, "other", settings(), runner)
    assert len(again.entries) == 3
    assert await redis.get(KEYS.reclaimed) == b"6"
    assert await redis.pttl(KEYS.reclaimed) > 60_000
