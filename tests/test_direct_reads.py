"""The standalone broker's reads (``reads.DirectReader``): the XREADGROUP
written and its reply parsed by the package, against what redis-py's own
``xreadgroup`` makes of the same server's replies, on every server, RESP2
and RESP3; errors raised as redis-py raises them; a connection whose state
is unknown never goes back to the pool usable."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from taskiq_atomic_claim.group_recovery import GroupPositions
from taskiq_atomic_claim.reads import DirectReader, GroupReads, read_entries
from tests.conftest import Server

STREAMS = ("direct-a", "direct-b")


def group_reads(direct: bool, *, count: int | None = 10) -> GroupReads:
    return GroupReads("g", "c", 0, count, 1000, GroupPositions(), direct=direct)


async def fill(admin: Redis) -> None:
    for stream in STREAMS:
        await admin.delete(stream)
        await admin.xgroup_create(stream, "g", id="0", mkstream=True)
        for n in range(1, 4):
            data = f"{stream}-{n}".encode()
            await admin.xadd(stream, {"data": data, "n": n}, id=f"{n}-1")
        # An entry without a data field: read as it is.
        await admin.xadd(stream, {"other": "x"}, id="4-1")


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_direct_read_reads_what_redis_py_reads(
    server: Server, redis: Redis, protocol: int
) -> None:
    url = f"{server.admin_url}?protocol={protocol}"
    reads: dict[bool, list[Any]] = {}
    for direct in (False, True):
        await fill(redis)
        client = Redis.from_url(url)
        try:
            read_from = {stream: ">" for stream in STREAMS}
            reads[direct] = await group_reads(direct).read(
                client, read_from, time.monotonic() + 5
            )
            # Nothing new: the block runs out, both say so alike.
            again = await group_reads(direct).read(
                client, read_from, time.monotonic() + 0.05
            )
            assert again == []
        finally:
            await client.aclose()
    assert len(reads[True]) == 2 * 4
    assert reads[True] == reads[False]
    assert reads[True][0] == (
        "direct-a",
        "1-1",
        {b"data": b"direct-a-1", b"n": b"1"},
        True,
    )


async def test_a_direct_read_with_claim_takes_idle_entries_as_redis_py_does(
    server: Server, redis: Redis
) -> None:
    if not server.info.native_claim:
        pytest.skip(f"{server.label}: no XREADGROUP ... CLAIM (Redis >= 8.4)")
    reads: dict[bool, list[Any]] = {}
    for direct in (False, True):
        await fill(redis)
        # Delivered to a consumer that died: idle past 50 ms, then claimed.
        await redis.xreadgroup("g", "dead", {STREAMS[0]: ">"}, count=2)
        await asyncio.sleep(0.1)
        reads_ = GroupReads("g", "c", 0, 10, 50, GroupPositions(), direct=direct)
        client = Redis.from_url(server.admin_url)
        try:
            read = await reads_.read(
                client,
                {STREAMS[0]: ">"},
                time.monotonic() + 5,
                claim=True,
            )
        finally:
            await client.aclose()
        # Idle times differ between the two runs: compare the rest.
        reads[direct] = [(s, i, f, r) for s, i, f, r in read]
    assert [r for *_, r in reads[True]] == [True, True, False, False]
    assert reads[True] == reads[False]


async def test_an_error_reply_is_raised_as_redis_py_raises_it(
    server: Server, redis: Redis
) -> None:
    await redis.delete("direct-missing")
    client = Redis.from_url(server.admin_url)
    try:
        with pytest.raises(ResponseError) as theirs:
            await client.xreadgroup("nogroup", "c", {"direct-missing": ">"})
        reader = DirectReader(client.connection_pool)
        with pytest.raises(ResponseError) as ours:
            await reader.call(
                [
                    "XREADGROUP",
                    "GROUP",
                    "nogroup",
                    "c",
                    "STREAMS",
                    "direct-missing",
                    ">",
                ],
            )
        assert type(ours.value) is type(theirs.value)
        assert str(ours.value) == str(theirs.value)
        # The connection answered in full: it stays, usable.
        held = reader._connection
        assert held is not None
        assert await reader.call(["PING"]) == b"PONG"
        assert reader._connection is held
    finally:
        await client.aclose()


async def test_a_read_cancelled_while_blocked_leaves_no_connection_owing_a_reply(
    server: Server, redis: Redis
) -> None:
    await redis.delete("direct-empty")
    await redis.xgroup_create("direct-empty", "g", id="$", mkstream=True)
    client = Redis.from_url(server.admin_url)
    try:
        pool = client.connection_pool
        reader = DirectReader(pool)
        command = ["XREADGROUP", "GROUP", "g", "c", "BLOCK", 0, "STREAMS"]
        # Nothing new: it blocks until cancelled.
        blocked = asyncio.create_task(reader.call([*command, "direct-empty", ">"]))
        await asyncio.sleep(0.2)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        # Were that connection handed out again as it was, its next command
        # would get the blocked read's reply (or wait behind it for ever).
        # An entry added before the server saw it close would go to it.
        await asyncio.sleep(0.3)
        await redis.xadd("direct-empty", {"data": b"late"})
        assert await asyncio.wait_for(client.get("direct-nothing"), 5) is None
        # The reader's next read goes on another connection.
        fetched = await asyncio.wait_for(
            reader.call([*command[:4], "COUNT", 100, "STREAMS", "direct-empty", ">"]),
            5,
        )
        # The cancelled read took nothing: the entry is still new.
        assert [f[b"data"] for _, _, f, _ in read_entries(fetched)] == [b"late"]
    finally:
        await client.aclose()


async def test_the_reader_keeps_one_connection_from_one_read_to_the_next(
    server: Server, redis: Redis
) -> None:
    await fill(redis)
    client = Redis.from_url(server.admin_url)
    try:
        pool = client.connection_pool
        reads = group_reads(direct=True, count=1)
        seen = set()
        for _ in range(3):
            await reads.read(client, dict.fromkeys(STREAMS, ">"), time.monotonic() + 1)
            seen.add(id(reads._reader._connection))  # type: ignore[union-attr]
        # Not handed back and out again per read: one connection, in use.
        assert len(seen) == 1
        assert len(pool._in_use_connections) == 1
    finally:
        await client.aclose()
