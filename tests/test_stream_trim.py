"""The trim that keeps a stream bounded (``lua/trim_consumed.lua``) removes
only what every consumer group read and acked, on every server; ``maxlen``
never drops an unread or unacked entry; kicked with ``maxlen`` far below
their number while no worker runs, every task runs once a worker starts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.keys import trim_gate
from taskiq_atomic_claim.operations import trim_consumed_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo
from taskiq_atomic_claim.stream_trim import kick_maxlen
from tests.conftest import Server
from tests.stream_bound_app import TASK_NAME, events_of, taskiq_workers

STREAM = "jobs"
# One entry per node: XTRIM ... ~ then removes exactly the entries below
# the bound, so these tests can name each one.
ONE_PER_NODE = ("stream-node-max-entries", "1")


async def trim(
    redis: Redis, *, keep_from_ms: int = 0, interval_ms: int = 1
) -> tuple[int, str]:
    """One trim call; a 1 ms gate, waited out, unless told otherwise."""
    await asyncio.sleep(0.002)
    trimmed, bound = await ScriptRunner().run(
        redis,
        trim_consumed_call(
            stream=STREAM,
            trim_gate=trim_gate(STREAM),
            interval_ms=interval_ms,
            keep_from_ms=keep_from_ms,
            limit=1000,
        ),
    )
    return int(trimmed), text(bound)


@pytest.fixture
async def nodes(redis: Redis) -> Any:
    old: Any = (await redis.config_get(ONE_PER_NODE[0]))[ONE_PER_NODE[0]]
    await redis.config_set(*ONE_PER_NODE)
    yield
    await redis.config_set(ONE_PER_NODE[0], old)


async def add(redis: Redis, count: int) -> list[str]:
    return [text(await redis.xadd(STREAM, {"data": str(n)})) for n in range(count)]


async def read(redis: Redis, group: str, count: int) -> list[str]:
    reply: Any = await redis.xreadgroup(group, "c", {STREAM: ">"}, count=count)
    return [text(entry_id) for _, entries in reply for entry_id, _ in entries]


async def ids_left(redis: Redis) -> list[str]:
    entries: Any = await redis.xrange(STREAM)
    return [text(entry_id) for entry_id, _ in entries]


async def test_only_what_every_group_read_and_acked_goes(
    redis: Redis, nodes: None
) -> None:
    ids = await add(redis, 10)
    await redis.xgroup_create(STREAM, "fast", id="0")
    await redis.xgroup_create(STREAM, "slow", id="0")
    await redis.xack(STREAM, "fast", *await read(redis, "fast", 10))
    slow = await read(redis, "slow", 6)
    await redis.xack(STREAM, "slow", *slow[:2], *slow[3:])
    # slow: ids[2] pending, ids[6:] unread; fast: everything acked.
    assert await trim(redis) == (2, ids[2])
    assert await ids_left(redis) == ids[2:]
    await redis.xack(STREAM, "slow", ids[2])
    # slow read up to ids[5]: that one stays as the bound.
    assert await trim(redis) == (3, ids[5])
    assert await ids_left(redis) == ids[5:]


async def test_a_group_that_read_nothing_keeps_everything(
    redis: Redis, nodes: None
) -> None:
    ids = await add(redis, 5)
    await redis.xgroup_create(STREAM, "done", id="0")
    await redis.xack(STREAM, "done", *await read(redis, "done", 5))
    await redis.xgroup_create(STREAM, "lagging", id="0")
    assert await trim(redis) == (0, "")
    assert await ids_left(redis) == ids
    # Created at the end ("$"): it needs nothing before.
    await redis.xgroup_destroy(STREAM, "lagging")
    await redis.xgroup_create(STREAM, "late", id="$")
    assert await trim(redis) == (4, ids[4])


async def test_a_stream_without_groups_keeps_everything(
    redis: Redis, nodes: None
) -> None:
    ids = await add(redis, 3)
    assert await trim(redis) == (0, "")
    assert await ids_left(redis) == ids
    await redis.delete(STREAM)
    assert await trim(redis) == (0, "")


async def test_the_fleet_trims_once_per_interval(redis: Redis, nodes: None) -> None:
    ids = await add(redis, 3)
    await redis.xgroup_create(STREAM, "g", id="0")
    await redis.xack(STREAM, "g", *await read(redis, "g", 2))
    assert await trim(redis, interval_ms=60_000) == (1, ids[1])
    assert 0 < await redis.pttl(trim_gate(STREAM)) <= 60_000
    await redis.xack(STREAM, "g", *await read(redis, "g", 1))
    # Another broker within the interval: nothing done.
    assert await trim(redis, interval_ms=60_000) == (-1, "")
    assert await ids_left(redis) == ids[1:]
    await redis.delete(trim_gate(STREAM))
    assert await trim(redis, interval_ms=60_000) == (1, ids[2])


async def test_keep_acked_keeps_entries_younger_than_it(
    redis: Redis, nodes: None
) -> None:
    for n in (1, 2):
        await redis.xadd(STREAM, {"d": "x"}, id=f"1000-{n}")
    young = await add(redis, 2)
    await redis.xgroup_create(STREAM, "g", id="0")
    await redis.xack(STREAM, "g", *await read(redis, "g", 4))
    now_ms = time.time_ns() // 1_000_000
    assert await trim(redis, keep_from_ms=now_ms - 60_000) == (
        2,
        f"{now_ms - 60_000}-0",
    )
    assert await ids_left(redis) == young


@pytest.mark.parametrize(
    ("version", "approximate", "sent"),
    [
        ("7.2.4", True, []),
        ("8.2.0", True, ["ACKED", "MAXLEN", "=", 10]),
        ("8.4.0", True, ["ACKED", "MAXLEN", "=", 10]),
        ("8.4.1", True, ["ACKED", "MAXLEN", "~", 10]),
        ("8.6.3", False, ["ACKED", "MAXLEN", "=", 10]),
    ],
)
def test_maxlen_is_sent_only_where_it_keeps_what_groups_need(
    version: str, approximate: bool, sent: list[Any]
) -> None:
    # 8.2.0-8.4.0 trim nothing with MAXLEN ~ ... ACKED (redis issue 14656).
    assert kick_maxlen(ServerInfo("Redis", version), 10, approximate) == sent
    assert kick_maxlen(ServerInfo("Valkey", "9.1.2"), 10, approximate) == []
    assert kick_maxlen(ServerInfo("Redis", version), None, approximate) == []


def test_keep_acked_is_checked_at_construction() -> None:
    bad: Any
    for bad in (-1, "60", True):
        with pytest.raises(ValueError, match="keep_acked must be"):
            AtomicRedisStreamBroker("redis://127.0.0.1:1", keep_acked=bad)
    with pytest.raises(ValueError, match="keep_acked=60 and maxlen=10 both bound"):
        AtomicRedisStreamBroker("redis://127.0.0.1:1", keep_acked=60, maxlen=10)


KICKED, MAXLEN = 300, 10


async def test_tasks_kicked_with_maxlen_while_no_worker_runs_all_run(
    server: Server, redis: Redis, tmp_path: Any
) -> None:
    """maxlen far below the tasks waiting: none is trimmed before a worker,
    started after, runs it."""
    queue = "bound-maxlen"
    producer = AtomicRedisStreamBroker(server.url, queue_name=queue, maxlen=MAXLEN)
    await producer.startup()  # creates the group, at "$", as taskiq's client does
    try:
        kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, producer, {})
        for number in range(KICKED):
            await kicker.kiq(f"run-{number}")
        assert await redis.xlen(queue) == KICKED
        with taskiq_workers(server.url, queue, 1, tmp_path) as logs:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if len(await events_of(redis, queue)) >= KICKED:
                    break
                await asyncio.sleep(0.2)
            ran = await events_of(redis, queue)
            assert ran == {f"run-{n}" for n in range(KICKED)}, logs()
    finally:
        await producer.shutdown()


@pytest.mark.parametrize("kept_out", [False, True], ids=["trims", "kept-out"])
async def test_an_idle_consumer_trims_once_then_only_after_reads(
    server: Server, redis: Redis, kept_out: bool
) -> None:
    """An idle fleet sends no trim: a consumer calls it after its first
    read step, then only once it read (or finished) something since. That
    first trim is for what an older release or a stopped fleet left: kept
    out by the fleet's gate (another consumer just trimmed), it does not try
    again each second until it gets in."""
    if kept_out:
        await redis.set(trim_gate(STREAM), "1", px=60_000)
    broker = AtomicRedisStreamBroker(server.url, queue_name=STREAM)
    trimming = broker.atomic.trim
    assert trimming.due(time.monotonic()) == [STREAM]
    await trimming.trim_if_due(redis)
    later = time.monotonic() + 3600
    assert trimming.due(later) == []
    trimming.read(STREAM)
    assert trimming.due(later) == [STREAM]
    await broker.shutdown()
