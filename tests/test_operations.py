"""Each Lua operation is declared once, with its keys, and checked on every call."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim import operations
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import OPERATIONS, SET_IDLE, check_declarations
from taskiq_atomic_claim.scripts import (
    LIBRARY,
    Operation,
    ScriptLibrary,
    ScriptRunner,
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
    assert operations.ACK.num_keys == 2
    assert operations.CLAIM.keys[0] == "stream"
