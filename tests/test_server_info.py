"""What a server is and can do (``server_info``), checked by behaviour on each
real server, and how ``check``, ``inspect``, ``doctor`` and the broker use it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.doctor import apply_fixes, diagnose
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from taskiq_atomic_claim.scripts import LIBRARY
from taskiq_atomic_claim.server_info import (
    LUA_CLAIM,
    NATIVE_CLAIM,
    ScriptingUnavailableError,
    ServerInfo,
    read_server_info,
)
from tests.conftest import Server, server_command
from tests.test_cli import cli


def expected_name(server: Server) -> str:
    if server.local is None:
        pytest.skip(f"{server.label}: the suite did not start it; version unknown")
    binary = server.local.binary
    return f"{binary.flavor.capitalize()} {binary.version}"


async def test_names_the_product_and_its_real_version(
    server: Server, redis: Redis
) -> None:
    info = await read_server_info(redis)
    assert info.name == expected_name(server)


async def test_capabilities_match_what_the_server_does(redis: Redis) -> None:
    info = await read_server_info(redis)
    await redis.xgroup_create("s", "g", id="0", mkstream=True)

    async def accepts(*command: str) -> bool:
        try:
            await server_command(redis, *command)
        except ResponseError:
            return False
        return True

    assert info.native_claim == await accepts(
        "XREADGROUP", "GROUP", "g", "c", "CLAIM", "1000", "STREAMS", "s", ">"
    )
    assert info.acked_trimming == await accepts("XACKDEL", "s", "g", "IDS", "1", "1-0")
    assert info.functions == await accepts("FUNCTION", "LIST")
    assert info.idempotent_add == await accepts(
        "XADD", "s", "IDMP", "p", "i", "*", "f", "v"
    )


async def test_scripting_runs_on_every_suite_server(redis: Redis) -> None:
    info = await read_server_info(redis, probe=True)
    assert info.scripting is True, info.scripting_problem


async def test_each_server_passes_the_minimum_and_a_raised_one_refuses_it(
    redis: Redis,
) -> None:
    # The rule on each real server's own INFO: in range today; refused, the
    # minimum named, were the minimum one minor release above it.
    info = ServerInfo.from_info(await redis.info("server"))
    assert info.unsupported() == ""
    found = info.version_tuple
    assert found is not None
    raised = {info.product: (found[0], found[1] + 1)}
    problem = info.unsupported(raised)
    assert problem.startswith(f"{info.name} is below the supported range")
    assert f"{info.product} >= {found[0]}.{found[1] + 1}" in problem


def test_unreadable_version_has_no_capabilities() -> None:
    info = ServerInfo.from_info({"redis_version": "x.y"})
    assert (info.major, info.functions, info.native_claim) == (0, False, False)
    assert ServerInfo.from_info(None).version == "unknown"


def test_a_server_the_suite_did_not_start_reads_its_real_version(
    server: Server,
) -> None:
    # As the `env` param (REDIS_URL) sees it: no local process to ask.
    remote = Server("REDIS_URL", server.admin_url)
    assert remote.major == server.info.major
    assert remote.major >= 6


async def test_broker_refuses_a_user_who_may_not_call_scripts(
    server: Server, redis: Redis
) -> None:
    await server_command(redis,
        "ACL", "SETUSER", "noscripts", "reset", "on", ">pw", "~*", "+@all",
        "-@scripting",
    )  # fmt: skip
    try:
        url = server.admin_url.replace("redis://", "redis://noscripts:pw@", 1)
        broker = AtomicRedisStreamBroker(url)
        with pytest.raises(ScriptingUnavailableError, match="refused for this user"):
            await broker.startup()
        await broker.shutdown()
    finally:
        await server_command(redis, "ACL", "DELUSER", "noscripts")


async def test_broker_refuses_a_server_with_scripting_disabled(server: Server) -> None:
    if server.local is None:
        pytest.skip(f"{server.label}: cannot start a copy without scripting")
    # What a managed service that forbids scripts looks like: no such commands.
    # (6.2 has no FCALL to rename.)
    names = ["EVALSHA", *(["FCALL"] if server.info.functions else [])]
    disabled = tuple(arg for name in names for arg in ("--rename-command", name, ""))
    with LocalServer(server.local.binary, extra_args=disabled) as local:
        broker = AtomicRedisStreamBroker(local.url)
        with pytest.raises(ScriptingUnavailableError) as refused:
            await broker.startup()
        await broker.shutdown()
        assert expected_name(server) in str(refused.value)
        assert "unknown command" in str(refused.value)
        check = cli("check", "--url", local.url)
        assert check.returncode == 1
        assert "scripting unavailable" in check.stdout


async def test_check_inspect_and_doctor_name_the_server_and_paths(
    server: Server, redis: Redis
) -> None:
    name = expected_name(server)
    product, version = name.split(" ")
    release = tuple(map(int, version.split(".")))
    native = product == "Redis" and release >= (8, 4)
    path = NATIVE_CLAIM if native else LUA_CLAIM
    acked = product == "Redis" and release >= (8, 2)
    trimming = (
        "MAXLEN ACKED"
        if acked
        else "maxlen not sent (MAXLEN here trims unread and unacked entries)"
    )
    await redis.xgroup_create("jobs", "workers", id="0", mkstream=True)
    check = cli("check", "--url", server.url)
    assert f"{name}: reclaim via {path}, trimming {trimming}" in check.stdout
    inspect = cli("inspect", "--url", server.url)
    assert inspect.stdout.startswith(f"{name}: reclaim via {path}")
    data = json.loads(cli("inspect", "--url", server.url, "--json").stdout)
    assert data["server"]["name"] == name
    assert data["server"]["reclaim_path"] == path
    assert data["server"]["native_claim"] is native
    doctor = cli("doctor", "--url", server.url)
    assert f"checked on {name}: reclaim via {path}" in doctor.stdout


async def test_fixes_work_when_the_version_is_unknown(
    redis: Redis, planted_keys: set[str]
) -> None:
    planted_keys.add("autoclaim:workers:jobs")
    await redis.set("autoclaim:workers:jobs", "token-of-a-dead-worker")
    diagnosis = await diagnose(redis)
    unknown = dataclasses.replace(diagnosis, server=ServerInfo("Redis", "unknown"))
    await apply_fixes(redis, unknown)
    assert [f.fixed for f in unknown.findings if f.kind == "legacy-lock"] == [True]
    assert await redis.pttl("autoclaim:workers:jobs") > 0


def test_library_names_are_computed_once() -> None:
    # Every FCALL names a function: re-hashing every Lua source per call was
    # the cost. The same object back means nothing was recomputed.
    assert LIBRARY.version is LIBRARY.version
    assert LIBRARY.function_name("claim") is LIBRARY.function_name("claim")
    assert LIBRARY.function_code is LIBRARY.function_code
    script = LIBRARY.scripts["claim"]
    assert script.sha is script.sha
