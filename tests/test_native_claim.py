"""Redis >= 8.4 reclaims through the read (XREADGROUP ... CLAIM); Redis >= 8.2
trims and deletes only what every group acked. Each test runs on every suite
server: where the server lacks the command it asserts the fallback instead."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.dead_letters import list_dead_letters
from taskiq_atomic_claim.dead_letter_policy import MAX_DELIVERIES_EXCEEDED
from taskiq_atomic_claim.keys import PREFIX, StreamKeys
from taskiq_atomic_claim.operations import OperationCall, drop_trimmed_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_info import (
    LUA_CLAIM,
    NATIVE_CLAIM,
    AckedDeletionUnavailableError,
)
from tests.conftest import Server
from tests.test_broker import die, message, receive

# On Redis 8.6 test_reliability's heartbeat test covers the native path: a
# live worker's long task is not reclaimed by a rival's claiming reads.
from tests.test_reliability import IDLE_MS, started

INTERVAL_MS = 100
KEYS = StreamKeys("taskiq", "taskiq")


async def command_calls(redis: Redis, name: str) -> int:
    """Calls of ``name`` since CONFIG RESETSTAT, scripts' calls included."""
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def skip_without_xackdel(server: Server) -> None:
    if not server.info.acked_trimming:
        pytest.skip(f"{server.info.name} has no XACKDEL (Redis >= 8.2)")


async def stream_ids(redis: Redis) -> list[str]:
    entries: Any = await redis.xrange("taskiq")
    return [text(entry_id) for entry_id, _ in entries]


async def coordination_keys(redis: Redis) -> list[bytes]:
    return [key async for key in redis.scan_iter(f"{PREFIX}:lease:*")] + [
        key async for key in redis.scan_iter(f"{PREFIX}:cursor:*")
    ]


async def pending_by(redis: Redis, consumer: str, count: int) -> list[str]:
    """``count`` new entries read by ``consumer``, which then dies at once."""
    fetched: Any = await redis.xreadgroup(
        "taskiq", consumer, {"taskiq": ">"}, count=count
    )
    return [entry_id.decode() for entry_id, _ in fetched[0][1]] if fetched else []


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_dead_consumers_entry_comes_back_through_the_read(
    server: Server, redis: Redis, protocol: int
) -> None:
    # RESP3 replies have another shape (a map, entries wrapped once more).
    native = server.info.native_claim
    dead = await started(server, consumer_name="dead", protocol=protocol)
    alive = await started(server, consumer_name="alive", protocol=protocol)
    try:
        await redis.config_resetstat()
        await dead.kick(message("orphan"))
        dead_listener = dead.listen()
        assert await receive(dead_listener, 2) is not None
        await die(dead, dead_listener)

        reclaimed = await receive(alive.listen(), IDLE_MS / 1000 + 3)
        assert reclaimed is not None
        assert reclaimed.data == b"orphan"
        assert alive.metrics.snapshot()["claimed"] == 1
        await maybe_awaitable(reclaimed.ack())
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        xautoclaims = await command_calls(redis, "xautoclaim")
        if native:
            assert alive.atomic.path.reclaim_path == NATIVE_CLAIM
            assert xautoclaims == 0, "the read reclaims: no claim script runs"
            assert await coordination_keys(redis) == [], "no lease, no cursor"
        else:
            # Redis < 8.4 and Valkey have no CLAIM: the Lua claim serves.
            assert alive.atomic.path.reclaim_path == LUA_CLAIM
            assert xautoclaims > 0
    finally:
        await dead.shutdown()
        await alive.shutdown()


async def test_a_poison_entry_read_back_goes_to_dead_letters(
    server: Server, redis: Redis
) -> None:
    alive = await started(server, consumer_name="alive", max_deliveries=2)
    try:
        await alive.kick(message("poison"))
        await alive.kick(message("innocent"))
        poison, innocent = await pending_by(redis, "dead", 2)
        # The poison's task started twice in workers that died; the
        # innocent one was read many times and never started.
        await redis.hset(KEYS.started, poison, 2)
        await redis.pexpire(KEYS.started, 60_000)
        for _ in range(5):
            await redis.xclaim("taskiq", "taskiq", "dead", 0, [innocent])

        listener = alive.listen()
        delivered = await receive(listener, IDLE_MS / 1000 + 3)
        assert delivered is not None
        assert delivered.data == b"innocent"
        await maybe_awaitable(delivered.ack())
        assert await receive(listener, IDLE_MS / 1000) is None
        [dead_letter] = await list_dead_letters(redis, KEYS)
        assert dead_letter.original_id == poison
        assert dead_letter.reason == "max_deliveries exceeded"
        assert dead_letter.reason == MAX_DELIVERIES_EXCEEDED, "as the Lua path's"
        assert dead_letter.deliveries == 2, "the crashes that counted"
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert await redis.hget(KEYS.started, poison) is None
    finally:
        await alive.shutdown()


async def test_an_entry_deleted_while_pending_is_reported_and_dropped(
    server: Server, redis: Redis
) -> None:
    # CLAIM skips such entries (checked on 8.6.3: no nil, no id, left in the
    # PEL); the native path's sweep finds them, the Lua claim's XAUTOCLAIM
    # reports them.
    alive = await started(server, consumer_name="alive")
    try:
        await alive.kick(message("gone"))
        await alive.kick(message("kept"))
        gone, _ = await pending_by(redis, "dead", 2)
        await redis.xdel("taskiq", gone)
        listener = alive.listen()
        received = await receive(listener, IDLE_MS / 1000 + 3)
        assert received is not None
        assert received.data == b"kept"
        await maybe_awaitable(received.ack())
        waiting = asyncio.ensure_future(listener.__anext__())
        for _ in range(100):
            if (await redis.xpending("taskiq", "taskiq"))["pending"] == 0:
                break
            await asyncio.sleep(0.1)
        assert not waiting.done()
        waiting.cancel()
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert alive.metrics.snapshot()["trimmed"] == 1
    finally:
        await alive.shutdown()


async def test_the_sweep_drops_only_idle_pending_entries_whose_data_is_gone(
    redis: Redis,
) -> None:
    # Only the native path sweeps (Redis >= 8.4), but its script runs on every
    # server: checked everywhere, page by page.
    await redis.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    ids = [await redis.xadd(KEYS.stream, {"data": str(n)}) for n in range(5)]
    await redis.xreadgroup(KEYS.group, "dead", {KEYS.stream: ">"})
    await redis.hset(KEYS.started, mapping=dict.fromkeys(ids, 1))
    await redis.pexpire(KEYS.started, 60_000)
    await redis.xdel(KEYS.stream, ids[0], ids[3])
    runner = ScriptRunner()

    def sweep(min_idle_ms: int, count: int, start: str) -> OperationCall[list[Any]]:
        return drop_trimmed_call(
            stream=KEYS.stream,
            started=KEYS.started,
            group=KEYS.group,
            min_idle_ms=min_idle_ms,
            count=count,
            start=start,
            consumer="sweeper",
        )

    # Not idle long enough: a live worker may hold them.
    reply = await runner.run(redis, sweep(60_000, 10, "-"))
    assert [text(reply[0]), reply[1]] == ["-", []]
    assert (await redis.xpending(KEYS.stream, KEYS.group))["pending"] == 5

    starts, dropped = ["-"], []
    for _ in range(5):
        next_start, page = await runner.run(redis, sweep(0, 2, starts[-1]))
        dropped += [text(entry_id) for entry_id in page]
        starts.append(text(next_start))
        if starts[-1] == "-":
            break
    assert starts == ["-", f"({text(ids[1])}", f"({text(ids[3])}", "-"]
    assert dropped == [text(ids[0]), text(ids[3])]
    pending = await redis.xpending_range(KEYS.stream, KEYS.group, "-", "+", 10)
    assert [entry["message_id"] for entry in pending] == [ids[1], ids[2], ids[4]]
    assert sorted(await redis.hkeys(KEYS.started)) == [ids[1], ids[2], ids[4]]


async def test_maxlen_never_trims_an_unread_or_unacked_entry(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await started(server, maxlen=2, approximate=False)
    try:
        await broker.kick(message("unacked"))
        [unacked] = await pending_by(redis, "busy", 1)
        for number in range(4):
            await broker.kick(message(f"m{number}"))
        assert await redis.xrange("taskiq", unacked, unacked), "a pending entry went"
        # One pending, four unread: nothing may go, on any server.
        assert await redis.xlen("taskiq") == 5
        policy = broker.atomic.path.trimming_policy
        if server.info.acked_trimming:
            # Redis >= 8.2: XADD ... ACKED MAXLEN.
            assert policy.startswith("MAXLEN ACKED")
        else:
            # Elsewhere MAXLEN would trim them: the kick does not send it,
            # and says so once.
            assert policy.startswith("maxlen not sent")
            warned = [m for r in caplog.records if "maxlen=2" in (m := r.getMessage())]
            assert len(warned) == 1, warned
            assert server.info.name in warned[0]
    finally:
        await broker.shutdown()


async def test_delete_acked_removes_acked_entries_or_is_refused(
    server: Server, redis: Redis
) -> None:
    broker = AtomicRedisStreamBroker(
        server.url, idle_timeout=IDLE_MS, claim_interval=INTERVAL_MS, delete_acked=True
    )
    if not server.info.acked_trimming:
        with pytest.raises(AckedDeletionUnavailableError) as refused:
            await broker.startup()
        await broker.shutdown()
        assert server.info.name in str(refused.value)
        assert "delete_acked" in str(refused.value)
        return
    await broker.startup()
    try:
        await broker.kick(message("done"))
        await broker.kick(message("running"))
        listener = broker.listen()
        done = await receive(listener, 2)
        running = await receive(listener, 2)
        assert done is not None
        assert running is not None
        await maybe_awaitable(done.ack())
        assert await redis.xlen("taskiq") == 1, "the acked entry is deleted"
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 1
        assert broker.atomic.path.trimming_policy.endswith("XACKDEL ACKED on ack")
        await maybe_awaitable(running.ack())
        assert await redis.xlen("taskiq") == 0
    finally:
        await broker.shutdown()


async def test_delete_acked_keeps_entries_another_group_still_needs(
    server: Server, redis: Redis
) -> None:
    skip_without_xackdel(server)
    broker = await started(server, delete_acked=True)
    try:
        await redis.xgroup_create("taskiq", "audit", id="0")
        await broker.kick(message("shared"))
        received = await receive(broker.listen(), 2)
        assert received is not None
        await maybe_awaitable(received.ack())
        assert await redis.xlen("taskiq") == 1, "group audit has not read it"
    finally:
        await broker.shutdown()


@pytest.mark.parametrize("delete_acked", [True, False])
@pytest.mark.parametrize("path", [NATIVE_CLAIM, LUA_CLAIM])
async def test_with_delete_acked_a_poison_entry_leaves_the_stream_as_an_ack_would(
    server: Server, redis: Redis, path: str, delete_acked: bool
) -> None:
    if delete_acked:
        skip_without_xackdel(server)
    if path == NATIVE_CLAIM and not server.info.native_claim:
        pytest.skip(f"{server.info.name} has no XREADGROUP CLAIM (Redis >= 8.4)")
    # An additional stream read from an explicit id keeps the reads from
    # reclaiming: the Lua claim serves every stream, even on Redis >= 8.4.
    lua = {"additional_streams": {"extra": "0"}} if path == LUA_CLAIM else {}
    alive = await started(
        server,
        consumer_name="alive",
        max_deliveries=2,
        delete_acked=delete_acked,
        **lua,
    )
    try:
        await alive.kick(message("poison"))
        await alive.kick(message("innocent"))
        poison, _ = await pending_by(redis, "dead", 2)
        await redis.hset(KEYS.started, poison, 2)
        await redis.pexpire(KEYS.started, 60_000)

        delivered = await receive(alive.listen(), IDLE_MS / 1000 + 3)
        assert delivered is not None
        assert delivered.data == b"innocent"
        assert alive.atomic.path.reclaim_path == path
        [dead_letter] = await list_dead_letters(redis, KEYS)
        assert dead_letter.original_id == poison
        assert dead_letter.fields[b"data"] == b"poison", "the copy holds the data"
        left = await stream_ids(redis)
        if delete_acked:
            assert poison not in left, "no group needs it: deleted as acks delete"
        else:
            assert poison in left, "without delete_acked dead-lettering only acks"
        await maybe_awaitable(delivered.ack())
    finally:
        await alive.shutdown()


async def test_with_delete_acked_a_dead_letter_stays_while_another_group_needs_it(
    server: Server, redis: Redis
) -> None:
    skip_without_xackdel(server)
    broker = await started(server, delete_acked=True)
    try:
        # Entries the broker cannot run (no data field): dead_letter.lua.
        # Group audit has acked the first and still holds the second.
        await redis.xgroup_create("taskiq", "audit", id="0")
        acked = text(await redis.xadd("taskiq", {"written-by": "someone"}))
        held = text(await redis.xadd("taskiq", {"written-by": "someone"}))
        await redis.xreadgroup("audit", "a", {"taskiq": ">"})
        await redis.xack("taskiq", "audit", acked)
        await broker.kick(message("real"))

        received = await receive(broker.listen(), 3)
        assert received is not None
        assert received.data == b"real"
        dead_letters = await list_dead_letters(redis, KEYS)
        assert sorted(d.original_id for d in dead_letters) == sorted([acked, held])
        left = await stream_ids(redis)
        assert acked not in left, "every group acked it: deleted"
        assert held in left, "group audit still needs it"
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 1
        await maybe_awaitable(received.ack())
    finally:
        await broker.shutdown()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_delete_acked_must_be_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match="delete_acked"):
        AtomicRedisStreamBroker("redis://localhost", delete_acked=value)  # type: ignore[arg-type]


async def test_a_started_count_never_written_on_the_native_path(
    server: Server, redis: Redis
) -> None:
    # Reads that reclaimed nothing cost nothing beyond the read itself.
    if not server.info.native_claim:
        pytest.skip(f"{server.info.name} has no XREADGROUP CLAIM (Redis >= 8.4)")
    # idle_timeout beyond the test: no sweep for trimmed entries either.
    broker = await started(server, idle_timeout=10_000)
    try:
        waiting = asyncio.ensure_future(broker.listen().__anext__())
        await asyncio.sleep(0.5)
        await redis.config_resetstat()
        await asyncio.sleep(1.0)
        assert not waiting.done()
        waiting.cancel()
        assert await command_calls(redis, "hmget") == 0
        assert await command_calls(redis, "fcall") == 0
        assert await command_calls(redis, "xreadgroup") >= 1
    finally:
        await broker.shutdown()


async def commands_seen(redis: Redis, seconds: float) -> list[list[str]]:
    """Every command the server runs for ``seconds`` (MONITOR), as tokens."""
    seen: list[list[str]] = []
    async with redis.monitor() as monitor:

        async def collect() -> None:
            while True:
                command = await monitor.next_command()
                seen.append(str(command["command"]).split())

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(collect(), seconds)
    return seen


async def test_an_idle_fleet_reclaims_through_one_read_per_interval(
    server: Server, redis: Redis
) -> None:
    """Where reads reclaim, only the consumer the fleet's gate lets through
    reads with CLAIM (once per claim interval); the others' reads are plain,
    as taskiq-redis's are. Nothing idle: the sweep for deleted entries only
    looks (XPENDING), it calls no script."""
    if not server.info.native_claim:
        pytest.skip(f"{server.info.name}: no XREADGROUP ... CLAIM")
    await redis.xgroup_create("taskiq", "taskiq", id="0", mkstream=True)
    brokers = [
        await started(
            server, idle_timeout=1000, claim_interval=250, consumer_name=f"w{n}"
        )
        for n in range(4)
    ]
    listeners = [asyncio.ensure_future(b.listen().__anext__()) for b in brokers]
    try:
        seen = await commands_seen(redis, 3.0)
    finally:
        for listener in listeners:
            listener.cancel()
        for broker in brokers:
            await broker.shutdown()
    reads = [c for c in seen if c[0].upper() == "XREADGROUP"]
    claiming = [c for c in reads if "CLAIM" in (t.upper() for t in c)]
    # 4 consumers reading every 200 ms (xread_block) for 3 s: ~60 reads.
    # One claiming read per 250 ms interval, fleet-wide: ~12.
    assert len(reads) >= 30, reads
    assert len(claiming) <= 18, f"{len(claiming)} of {len(reads)} reads claim"
    sweeps = [c for c in seen if c[0].upper() == "FCALL" and "drop_trimmed" in c[1]]
    assert sweeps == [], "nothing idle: the sweep only looks"
