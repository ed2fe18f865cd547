"""Each Lua operation is declared once, with its keys, and checked on every call."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim import operations
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import (
    OPERATIONS,
    SET_IDLE,
    Operation,
)
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import (
    LIBRARY,
    LibraryState,
    LoadMode,
    ScriptLibrary,
    ScriptRunner,
    check_declarations,
    declared_key_count,
)

_KEY_USE = re.compile(r"KEYS\[(\d+)\]")
# KEYS[5 * i + 2]: the second key of item i's group.
_GROUP_KEY_USE = re.compile(r"KEYS\[(\d+) \* \w+ \+ (\d+)\]")


def test_every_lua_file_is_declared_with_its_header_key_count() -> None:
    assert {op.name for op in OPERATIONS} == set(LIBRARY.scripts)
    for operation in OPERATIONS:
        assert LIBRARY.scripts[operation.name].num_keys == operation.num_keys


@pytest.mark.parametrize("name", sorted(LIBRARY.scripts))
def test_no_script_uses_a_key_its_header_does_not_declare(name: str) -> None:
    script = LIBRARY.scripts[name]
    body = script.source.split("]]", 1)[1]  # includes resolved
    if script.repeated_keys:
        groups = _GROUP_KEY_USE.findall(body)
        assert {int(stride) for stride, _ in groups} == {script.num_keys}
        used = {int(n) for _, n in groups}
    else:
        used = {int(n) for n in _KEY_USE.findall(body)}
    assert used == set(range(1, script.num_keys + 1))


def test_a_declaration_that_disagrees_with_the_lua_header_fails_the_import() -> None:
    wrong = tuple(
        Operation(op.name, (*op.keys, "extra")) if op is SET_IDLE else op
        for op in OPERATIONS
    )
    with pytest.raises(RuntimeError, match=r"set_idle\.lua declares 1 KEYS"):
        check_declarations(LIBRARY, wrong)
    with pytest.raises(RuntimeError, match="undeclared"):
        check_declarations(LIBRARY, OPERATIONS[1:])


def test_a_header_must_number_its_keys_in_order(tmp_path: Path) -> None:
    assert declared_key_count("--[[\n  KEYS[1]  a\n  KEYS[2]  b\n]]\n") == 2
    with pytest.raises(ValueError, match=r"KEYS\[1\]\.\.KEYS\[n\]"):
        declared_key_count("--[[\n  KEYS[2]  b\n]]\n")
    (tmp_path / "includes").mkdir()
    (tmp_path / "one.lua").write_text("--[[\n  KEYS[1]  a\n]]\nreturn KEYS[1]\n")
    assert ScriptLibrary.from_directory(tmp_path).scripts["one"].num_keys == 1


async def test_a_wrong_key_count_is_refused_before_any_round_trip(
    redis: Redis,
) -> None:
    keys = StreamKeys("jobs", "workers")
    await redis.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
    await redis.config_resetstat()
    runner = ScriptRunner()
    with pytest.raises(TypeError, match=r"'set_idle' takes 1 keys \(stream\), got 2"):
        await runner.call(
            redis, SET_IDLE, [keys.stream, keys.started], [keys.group, "c", 0, "1-0"]
        )
    # Nothing was sent: not even INFO to learn how to call it.
    sent = await redis.info("commandstats")
    assert [name for name in sent if "config" not in name] == []
    # The right count goes through.
    reply = await runner.call(redis, SET_IDLE, [keys.stream], [keys.group, "c", 0])
    assert reply == []


def test_operations_are_typed_by_their_reply() -> None:
    # The declarations are module constants callers import by name.
    assert operations.HAND_BACK.num_keys == 2
    assert operations.CLAIM.keys[0] == "stream"


def as_map(reply: Any) -> dict[str, Any]:
    """A map reply: a flat [key, value, ...] list under RESP2."""
    if isinstance(reply, dict):
        return {text(k): v for k, v in reply.items()}
    return {text(k): v for k, v in zip(reply[::2], reply[1::2], strict=True)}


def test_other_flags_make_another_library_version() -> None:
    # Else a server holding the library without them would pass for current.
    unflagged = ScriptLibrary(LIBRARY.scripts)
    assert unflagged.version != LIBRARY.version
    assert ScriptLibrary(LIBRARY.scripts, LIBRARY.allow_oom).name == LIBRARY.name


async def test_functions_carry_the_declared_flags_and_an_unflagged_library_is_outdated(
    redis: Redis,
) -> None:
    runner = ScriptRunner()
    if await runner.mode(redis) is not LoadMode.FUNCTIONS:
        pytest.skip("no functions (Redis 6.2): cached scripts carry no flags")
    await runner.load(redis)
    [library] = await redis.function_list(library=LIBRARY.name)
    functions = [as_map(function) for function in as_map(library)["functions"]]
    flags = {
        text(function["name"]): {text(flag) for flag in function["flags"]}
        for function in functions
    }
    assert flags == {
        LIBRARY.function_name(op.name): {"allow-oom"} if op.allow_oom else set()
        for op in OPERATIONS
    }
    assert {op.name for op in OPERATIONS if not op.allow_oom} == {
        "requeue_dead_letters",
        "set_idempotency",
    }
    # A release without the flags, left alone on the server: outdated.
    unflagged = ScriptRunner(ScriptLibrary(LIBRARY.scripts))
    await unflagged.load(redis)
    await redis.function_delete(LIBRARY.name)
    status = await runner.status(redis)
    assert status.state is LibraryState.OUTDATED
    assert status.other_versions == (unflagged.library.name,)
