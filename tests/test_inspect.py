"""``inspect`` against real servers: the numbers, the JSON shape, the table."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import pytest
from redis.asyncio import Redis

import taskiq_atomic_claim.admin.inspection as inspection_module
import taskiq_atomic_claim.admin.inspection_json as inspection_json_module
from taskiq_atomic_claim.admin.inspection import inspect_server
from taskiq_atomic_claim.admin.inspection_json import inspection_to_json
from taskiq_atomic_claim.claim import claim_idle_entries
from taskiq_atomic_claim.cli.inspect import render_inspection
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import LIBRARY, ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings
from tests.conftest import Server
from tests.test_cli import cli

KEYS = StreamKeys("jobs", "workers")
# The documented shape, key order included: scripts may rely on it.
TOP = ["format", "node", "server", "library", "discovery", "streams"]
LIBRARY_KEYS = ["name", "version", "mode", "state", "other_versions"]
STREAM_KEYS = ["stream", "type", "length", "groups"]
GROUP_KEYS = [
    "group",
    "exists",
    "pending",
    "last_delivered_id",
    "lag",
    "oldest_pending_idle_ms",
    "pel_scanned",
    "pel_scan_complete",
    "consumer_count",
    "last_read_idle_ms",
    "consumers",
    "lease",
    "cursor",
    "dead_letters",
    "reclaimed",
]
CONSUMER_KEYS = ["name", "pending", "idle_ms", "oldest_pending_idle_ms"]


async def busy_group(redis: Redis) -> None:
    """alice holds 2 entries, bob 1, carol took the lease; 2 dead letters."""
    await redis.xgroup_create(KEYS.stream, KEYS.group, id="0", mkstream=True)
    for number in range(4):
        await redis.xadd(KEYS.stream, {"data": f"m{number}"})
    await redis.xreadgroup(KEYS.group, "alice", {KEYS.stream: ">"}, count=2)
    await redis.xreadgroup(KEYS.group, "bob", {KEYS.stream: ">"}, count=1)
    settings = ClaimSettings.from_broker_arguments(
        idle_timeout=600_000,
        claim_interval=None,
        unacknowledged_batch_size=100,
        unacknowledged_lock_timeout=30.0,
    )
    outcome = await claim_idle_entries(ScriptRunner(), redis, KEYS, "carol", settings)
    assert not outcome.skipped and not outcome.entries
    await redis.set(KEYS.cursor, "5-0", px=60_000)
    # As a worker's reclaims leave it (reclaim_count.py).
    await redis.set(KEYS.reclaimed, 7, px=60_000)
    for number in range(2):
        await redis.xadd(KEYS.dead_letters, {"data": f"d{number}"})
    await asyncio.sleep(0.05)  # idle times above 0


def keys_of(value: dict[str, Any]) -> list[str]:
    return list(value)


async def test_the_numbers_of_a_busy_group(server: Server, redis: Redis) -> None:
    await busy_group(redis)
    seen = await inspect_server(redis, ["jobs"], "workers")
    [stream] = seen.streams
    assert (stream.name, stream.type, stream.length) == ("jobs", "stream", 4)
    [group] = stream.groups
    assert group.exists and group.pending == 3
    assert group.pel_scanned == 3 and group.pel_scan_complete
    assert group.oldest_pending_idle_ms is not None
    assert group.oldest_pending_idle_ms >= 50
    by_name = {consumer.name: consumer for consumer in group.consumers}
    # Whether an XAUTOCLAIM that took nothing creates its consumer differs
    # between servers (Valkey does), so carol may or may not be listed.
    by_name.pop("carol", None)
    assert {name: c.pending for name, c in by_name.items()} == {"alice": 2, "bob": 1}
    assert by_name["alice"].oldest_pending_idle_ms is not None
    assert group.lease.value == "carol"
    assert group.lease.ttl_ms is not None and 0 < group.lease.ttl_ms <= 30_000
    assert group.cursor.value == "5-0"
    assert group.cursor.ttl_ms is not None and 0 < group.cursor.ttl_ms <= 60_000
    assert group.dead_letters == 2
    assert group.dead_letters_key == KEYS.dead_letters
    assert group.reclaimed == 7
    assert seen.library.name == LIBRARY.name
    assert seen.library.state == "current"
    if server.major >= 7:
        assert group.lag == 1  # one entry not yet delivered to the group


async def test_json_is_the_documented_shape(server: Server, redis: Redis) -> None:
    await busy_group(redis)
    result = cli("inspect", "--url", server.url, "--queue", "jobs", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert keys_of(document) == TOP
    assert document["format"] == 1
    parts = urlsplit(server.url)
    assert document["node"] == f"{parts.hostname}:{parts.port}"
    assert keys_of(document["library"]) == LIBRARY_KEYS
    assert keys_of(document["discovery"]) == ["discovered", "truncated"]
    assert document["discovery"] == {"discovered": False, "truncated": False}
    [stream] = document["streams"]
    assert keys_of(stream) == STREAM_KEYS
    [group] = stream["groups"]
    assert keys_of(group) == GROUP_KEYS
    assert keys_of(group["lease"]) == ["key", "holder", "ttl_ms"]
    assert keys_of(group["cursor"]) == ["key", "value", "ttl_ms"]
    assert keys_of(group["dead_letters"]) == ["key", "count"]
    for consumer in group["consumers"]:
        assert keys_of(consumer) == CONSUMER_KEYS
        assert isinstance(consumer["idle_ms"], int)
    assert [c["name"] for c in group["consumers"]][:2] == ["alice", "bob"]
    assert group["lease"]["holder"] == "carol"
    assert group["dead_letters"] == {"key": KEYS.dead_letters, "count": 2}
    assert group["reclaimed"] == {"key": KEYS.reclaimed, "count": 7}
    # Every key the code emits is named in the module's documentation.
    doc = inspection_json_module.__doc__ or ""
    for key in {*TOP, *LIBRARY_KEYS, *STREAM_KEYS, *GROUP_KEYS, *CONSUMER_KEYS}:
        assert f'"{key}"' in doc, key


async def test_discovery_finds_streams_but_not_dead_letter_streams(
    server: Server, redis: Redis
) -> None:
    await busy_group(redis)
    await redis.xadd("audit-log", {"event": "x"})
    await redis.set("not-a-stream", "x", px=60_000)
    seen = await inspect_server(redis)
    assert seen.discovered and not seen.truncated
    assert [stream.name for stream in seen.streams] == ["audit-log", "jobs"]
    assert seen.streams[0].groups == []
    document = inspection_to_json(seen)
    assert document["discovery"]["discovered"] is True
    only_group = await inspect_server(redis, group="workers")
    assert [stream.name for stream in only_group.streams] == ["jobs"]


async def test_discovery_is_bounded(
    server: Server, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    for number in range(5):
        await redis.xadd(f"s{number}", {"a": "b"})
    monkeypatch.setattr(inspection_module, "MAX_STREAMS", 3)
    seen = await inspect_server(redis)
    assert len(seen.streams) == 3 and seen.truncated
    assert "stopped at its bound" in render_inspection(seen)


async def test_missing_group_and_keys_of_another_type(
    server: Server, redis: Redis
) -> None:
    await busy_group(redis)
    await redis.set("plain", "x", px=60_000)
    seen = await inspect_server(redis, ["jobs", "plain", "absent"], "nobody")
    jobs, plain, absent = seen.streams
    assert [group.exists for group in jobs.groups] == [False]
    assert jobs.groups[0].pending == 0 and jobs.groups[0].consumers == []
    assert (plain.type, plain.length) == ("string", 0)
    assert (absent.type, absent.length) == ("none", 0)
    table = render_inspection(seen)
    assert "group 'nobody': does not exist" in table
    assert "(key is string)" in table


async def test_table_for_people(server: Server, redis: Redis) -> None:
    await busy_group(redis)
    result = cli("inspect", "--url", server.url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"library {LIBRARY.name}" in out and ": current" in out
    assert "stream 'jobs': 4 entries" in out
    assert "group 'workers': 3 pending" in out
    assert "lease held by 'carol'" in out
    assert "cursor 5-0" in out
    assert "2 dead letters; 7 reclaimed" in out
    for name in ("'alice'", "'bob'"):
        assert name in out


def test_bad_inputs_are_one_line_and_exit_2() -> None:
    for args in (
        ["inspect", "--url", "http://nowhere"],
        ["inspect", "--url", "redis://127.0.0.1:1", "--queue="],
        ["inspect", "--url", "redis://127.0.0.1:1", "--group="],
        ["inspect"],
        ["inspect", "--url", "redis://127.0.0.1:1", "--tls-ca-cert", "/nonexistent"],
    ):
        result = cli(*args)
        assert result.returncode == 2, (args, result.stdout)
        assert "Traceback" not in result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
