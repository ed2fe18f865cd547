"""A claimer stalled between the steps of its claim takes nothing from the
consumer that owns an entry by then, and reports no loss for an entry acked
meanwhile. The stall is real: a loopback proxy holds the claimer's second
step (its fetch of the claimed entries' fields) on its way to the server.

Where reads reclaim (Redis >= 8.4) the claim is one command and has no
second step; these tests run where the claim script runs.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim.claim import claim_idle_entries
from taskiq_atomic_claim.scripts import ScriptRunner
from tests.conftest import Server
from tests.proxies import StallingProxy
from tests.test_claim_script import GROUP, KEYS, STREAM, owner_of, pending_for, settings
from tests.test_faults import out_of_memory, via

# The claim's second step, whatever its shape: anything but the script call.
FETCH = ("XCLAIM", "XRANGE", "XPENDING", "MULTI")


def lua_path_only(server: Server) -> None:
    if server.info.native_claim:
        pytest.skip(f"{server.label}: reads reclaim, the claim is one command")


async def stalled_claim(
    server: Server, redis: Redis, meanwhile: str
) -> tuple[list[str], list[str], str]:
    """The claimer's fetch is held while ``other`` claims the entry (and,
    with ``meanwhile`` "ack", acks it)."""
    [entry_id] = await pending_for(redis, "dead", 1)
    await asyncio.sleep(0.05)
    runner = ScriptRunner()
    await runner.load(redis)
    port = urlsplit(server.admin_url).port
    assert port is not None
    async with StallingProxy(port, FETCH) as proxy:
        stalled = Redis.from_url(via(server.admin_url, proxy.port))
        try:
            claim = asyncio.ensure_future(
                claim_idle_entries(runner, stalled, KEYS, "stalled", settings())
            )
            await asyncio.wait_for(proxy.holding.wait(), 10)
            # Idle past idle_timeout again: the claimer is late.
            await asyncio.sleep(0.05)
            taken = await redis.xclaim(STREAM, GROUP, "other", 20, [entry_id])
            assert len(taken) == 1
            if meanwhile == "ack":
                assert await redis.xack(STREAM, GROUP, entry_id) == 1
            proxy.release()
            outcome = await asyncio.wait_for(claim, 10)
        finally:
            await stalled.aclose()
    owner = ""
    if meanwhile != "ack":
        owner = await owner_of(redis, entry_id)
    return [entry.id for entry in outcome.entries], outcome.trimmed, owner


async def test_a_stalled_claimer_takes_nothing_from_the_new_owner(
    server: Server, redis: Redis
) -> None:
    lua_path_only(server)
    entries, trimmed, owner = await stalled_claim(server, redis, "claim")
    assert entries == []
    assert trimmed == []
    assert owner == "other"


async def test_an_entry_acked_meanwhile_is_not_reported_lost(
    server: Server, redis: Redis
) -> None:
    lua_path_only(server)
    entries, trimmed, _ = await stalled_claim(server, redis, "ack")
    assert entries == []
    assert trimmed == [], "acked by its owner, not trimmed"


async def test_a_claim_out_of_memory_still_reads_what_it_took(
    server: Server, redis: Redis
) -> None:
    # Out of memory the server refuses whatever is queued in a MULTI: the
    # claim's read of the entries it took must not be one.
    lua_path_only(server)
    ids = await pending_for(redis, "dead", 3)
    await asyncio.sleep(0.05)
    runner = ScriptRunner()
    await runner.load(redis)
    async with out_of_memory(redis):
        outcome = await claim_idle_entries(runner, redis, KEYS, "alive", settings())
    assert [entry.id.encode() for entry in outcome.entries] == ids
    assert all(entry.fields for entry in outcome.entries)
