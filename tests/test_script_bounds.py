"""The scripts at the largest values the settings accept: a list passed to a
variadic command must not overflow Lua's C stack (``unpack`` fails past about
8000 values), and the sweep must not read payloads to test existence."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim.claim import claim_idle_entries
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import (
    drop_trimmed_call,
    hand_back_call,
    set_idle_call,
)
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import MAX_BATCH_SIZE, ClaimSettings
from tests.conftest import Server

KEYS = StreamKeys("jobs", "workers")
# Past Lua's unpack limit (LUAI_MAXCSTACK, 8000).
MANY = MAX_BATCH_SIZE
_ADD_ENTRIES = """
local ids = {}
for i = 1, tonumber(ARGV[1]) do
  ids[i] = redis.call("XADD", KEYS[1], "*", "data", tostring(i))
end
redis.call("XREADGROUP", "GROUP", ARGV[2], ARGV[3], "COUNT", ARGV[1],
  "STREAMS", KEYS[1], ">")
return ids
"""


async def pending_at(redis: Redis, consumer: str, count: int) -> list[str]:
    """``count`` entries read and never acked by ``consumer``."""
    await redis.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    # Added and read server-side: 10000 round trips, or a reply of 10000
    # entries parsed here, would cost seconds of CI.
    added: Any = await redis.eval(
        _ADD_ENTRIES, 1, KEYS.stream, count, KEYS.group, consumer
    )
    return [text(entry_id) for entry_id in added]


async def owners(redis: Redis) -> dict[str, int]:
    reply: Any = await redis.xpending(KEYS.stream, KEYS.group)
    return {text(row["name"]): row["pending"] for row in reply["consumers"]}


async def test_a_claim_at_the_largest_batch_takes_every_entry(redis: Redis) -> None:
    ids = await pending_at(redis, "dead", MANY)
    # Two crashed max_deliveries times: dead-lettered from inside the batch.
    await redis.hset(KEYS.started, mapping={ids[0]: 5, ids[-1]: 5, ids[1]: 2})
    await redis.pexpire(KEYS.started, 60_000)
    await asyncio.sleep(0.05)
    settings = ClaimSettings.from_broker_arguments(
        idle_timeout=20,
        claim_interval=None,
        unacknowledged_batch_size=MAX_BATCH_SIZE,
        unacknowledged_lock_timeout=None,
    )
    outcome = await claim_idle_entries(ScriptRunner(), redis, KEYS, "alive", settings)
    assert sorted(outcome.dead_lettered) == sorted([ids[0], ids[-1]])
    assert [entry.id for entry in outcome.entries] == ids[1:-1]
    assert outcome.entries[0].crashes == 2
    assert await owners(redis) == {"alive": MANY - 2}
    assert await redis.xlen(KEYS.dead_letters) == 2


async def test_set_idle_and_hand_back_take_any_number_of_ids(redis: Redis) -> None:
    ids = await pending_at(redis, "me", MANY)
    runner = ScriptRunner()
    lost = await runner.run(
        redis,
        set_idle_call(
            stream=KEYS.stream,
            group=KEYS.group,
            consumer="me",
            idle_ms=0,
            orphans="o",
            entry_ids=ids,
        ),
    )
    assert lost == []
    await redis.hset(KEYS.started, mapping=dict.fromkeys(ids, 1))
    await redis.pexpire(KEYS.started, 60_000)
    lost = await runner.run(
        redis,
        hand_back_call(
            stream=KEYS.stream,
            started=KEYS.started,
            group=KEYS.group,
            consumer="me",
            idle_ms=60_000,
            n_started=len(ids),
            entry_ids=ids,
        ),
    )
    assert lost == []
    assert await redis.exists(KEYS.started) == 0
    rows: Any = await redis.xpending_range(KEYS.stream, KEYS.group, "-", "+", 1)
    assert rows[0]["time_since_delivered"] >= 60_000


async def commands_run(redis: Redis) -> set[str]:
    """The commands the slow log holds (every one, at a threshold of 0)."""
    entries = await redis.slowlog_get(1000)
    return {text(entry["command"]).split(" ", 1)[0].upper() for entry in entries}


async def test_the_sweep_at_the_largest_batch_drops_only_entries_gone(
    server: Server, redis: Redis
) -> None:
    ids = await pending_at(redis, "dead", MANY)
    gone = ids[: MANY // 2 : 7] + ids[MANY // 2 :: 3]
    await redis.xdel(KEYS.stream, *gone)
    await redis.hset(KEYS.started, mapping=dict.fromkeys(ids, 1))
    await redis.pexpire(KEYS.started, 60_000)
    kept = ids[1]
    before: Any = await redis.xpending_range(KEYS.stream, KEYS.group, kept, kept, 1)
    runner = ScriptRunner()
    await runner.load(redis)
    # Every command the sweep runs, its own included, lands in the slow log.
    config: Any = await redis.config_get("slowlog-*")
    await redis.config_set("slowlog-log-slower-than", 0)
    await redis.config_set("slowlog-max-len", 1000)
    await redis.slowlog_reset()
    try:
        next_start, dropped = await runner.run(
            redis,
            drop_trimmed_call(
                stream=KEYS.stream,
                started=KEYS.started,
                group=KEYS.group,
                min_idle_ms=0,
                count=MAX_BATCH_SIZE,
                start="-",
                consumer="sweeper",
            ),
        )
        run = await commands_run(redis)
    finally:
        for name, value in config.items():
            await redis.config_set(name, value)
    if server.major >= 7:
        # Existence is tested without reading any entry's fields.
        assert "XPENDING" in run
        assert not run & {"XRANGE", "XREVRANGE", "XREAD", "XREADGROUP"}
    assert text(next_start) == f"({ids[-1]}"
    assert [text(entry_id) for entry_id in dropped] == gone
    assert await owners(redis) == {"dead": MANY - len(gone)}
    assert await redis.hlen(KEYS.started) == MANY - len(gone)
    # The entries left were not touched: same idle, same delivery count.
    after: Any = await redis.xpending_range(KEYS.stream, KEYS.group, kept, kept, 1)
    assert text(after[0]["consumer"]) == "dead"
    assert after[0]["times_delivered"] == 1
    assert after[0]["time_since_delivered"] >= before[0]["time_since_delivered"]
