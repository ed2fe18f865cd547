"""Each Lua operation is declared once, with its keys and ARGV, and called
through one typed function whose KEYS and ARGV match its Lua header."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim import operations
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import (
    DECLINE,
    OPERATIONS,
    SET_IDLE,
    ClaimKeys,
    Operation,
    OperationCall,
    set_idle_call,
)
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import (
    LIBRARY,
    LibraryState,
    LoadMode,
    ScriptLibrary,
    ScriptRunner,
    check_declarations,
    declared_argv,
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
        OperationCall(SET_IDLE, (keys.stream, keys.started), (keys.group, "c", 0))
    # Nothing was sent: not even INFO to learn how to call it.
    sent = await redis.info("commandstats")
    assert [name for name in sent if "config" not in name] == []
    # Its function builds the right count, and it goes through.
    call = set_idle_call(
        stream=keys.stream,
        group=keys.group,
        consumer="c",
        idle_ms=0,
        orphans="o",
        entry_ids=[],
    )
    assert await runner.run(redis, call) == []


def _sentinels(function: Callable[..., Any]) -> dict[str, Any]:
    """A value for each parameter, told apart from every other one."""
    hints = typing.get_type_hints(function)
    values: dict[str, Any] = {}
    for n, name in enumerate(inspect.signature(function).parameters):
        hint = hints[name]
        if hint is str:
            values[name] = f"<{name}>"
        elif hint is bool:
            values[name] = True
        elif hint in (int, int | None):
            values[name] = 1000 + n
        elif typing.get_origin(hint) is Sequence:
            (item,) = typing.get_args(hint)
            if item is str:
                values[name] = (f"<{name}0>", f"<{name}1>")
            elif item is int:
                values[name] = (2000 + 2 * n, 2001 + 2 * n)
            else:
                assert item is ClaimKeys, hint
                values[name] = tuple(
                    ClaimKeys(*(f"<{role}{i}>" for role in ClaimKeys._fields))
                    for i in range(2)
                )
        else:
            raise AssertionError(f"{function.__name__}({name}: {hint}): no sentinel")
    return values


def argv_mismatch(function: Callable[..., Any], operation: Operation[Any]) -> str:
    """What ``function`` sends that its Lua header does not declare (""
    when nothing): its KEYS in the declared roles' order, and each ARGV
    where the header names it (``entry id`` is ``entry_id``)."""
    declared = declared_argv(LIBRARY.scripts[operation.name].source)
    values = _sentinels(function)
    optional = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.default is None
    ]
    for omitted in ([], *([name] for name in optional)):
        kwargs = {k: v for k, v in values.items() if k not in omitted}
        call = function(**kwargs)
        if call.operation is not operation:
            return f"builds a call of {call.operation.name!r}"
        if operation.repeated:
            keys = tuple(key for group in kwargs["keys"] for key in group)
        else:
            keys = tuple(kwargs[role] for role in operation.keys)
        if call.keys != keys:
            return f"KEYS {call.keys} where its roles are {operation.keys}"
        expected: list[tuple[type, Any]] = []
        for declaration in declared:
            name = declaration.name.replace(" ", "_")
            if name in omitted:
                continue
            if name not in kwargs:
                return f"takes no {name!r} for ARGV[{declaration.position}]"
            value = kwargs[name]
            if declaration.rest:
                expected += [(type(item), item) for item in value]
            elif value is True:
                expected.append((int, 1))  # a flag: "1"
            else:
                expected.append((type(value), value))
        sent = [(type(arg), arg) for arg in call.args]
        if sent != expected:
            return f"ARGV {call.args}, declared {[v for _, v in expected]}"
        unsent = set(kwargs) - set(operation.keys) - {"keys"}
        unsent -= {d.name.replace(" ", "_") for d in declared}
        if unsent:
            return f"takes {sorted(unsent)}, which the header does not declare"
    return ""


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.name)
def test_each_operation_function_sends_the_argv_its_lua_header_declares(
    operation: Operation[Any],
) -> None:
    function = getattr(operations, f"{operation.name}_call")
    assert argv_mismatch(function, operation) == ""


def test_a_function_that_swaps_two_arguments_is_caught() -> None:
    def swapped(
        *,
        stream: str,
        group: str,
        consumer: str,
        idle_ms: int,
        bound: int,
        entry_id: str,
    ) -> OperationCall[int]:
        return OperationCall(
            DECLINE, (stream,), (group, consumer, bound, idle_ms, entry_id)
        )

    assert "ARGV" in argv_mismatch(swapped, DECLINE)

    def misnamed(
        *, stream: str, group: str, consumer: str, idle: int, bound: int, entry_id: str
    ) -> OperationCall[int]:
        return OperationCall(
            DECLINE, (stream,), (group, consumer, idle, bound, entry_id)
        )

    assert "takes no 'idle_ms'" in argv_mismatch(misnamed, DECLINE)


def test_a_header_must_number_its_argv_in_order() -> None:
    assert [d.name for d in declared_argv("--[[\n  ARGV[1]  entry id\n]]")] == [
        "entry id"
    ]
    with pytest.raises(ValueError, match=r"ARGV\[1\]\.\.ARGV\[n\]"):
        declared_argv("--[[\n  ARGV[2]  b\n]]\n")
    with pytest.raises(ValueError, match="only the last"):
        declared_argv("--[[\n  ARGV[1..]  ids\n  ARGV[2]  b\n]]\n")


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
        "recreate_group",  # creates a group: refused as XGROUP CREATE is
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
