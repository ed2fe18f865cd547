"""Arbitrary names and settings thrown at the broker and the CLI.

Valid names (any non-empty string: unicode, braces, colons, spaces, quotes,
Lua syntax) work end to end against a real server, as a user holding only
the worker ACL made for exactly those names; invalid ones are refused with a
ValueError naming the parameter (constructor) or a one-line error and exit 2
(CLI). Names only ever travel as KEYS and ARGV, so one that reads as Lua
comes back as it went in.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from typing import Any

import pytest
import redis as sync_redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from taskiq.message import BrokerMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.acl import worker_acl_rule
from taskiq_atomic_claim.admin.inspection import inspect_server
from taskiq_atomic_claim.cli import main
from taskiq_atomic_claim.harness.embedded_server import free_port
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.server_info import LUA_CLAIM
from tests.conftest import Server, server_command, with_user

USER, PASSWORD = "property-worker", "property-password"
LUA_NAME = "\"]] ; redis.call('FLUSHALL') --[[ ' end"

# Any text, with the characters that mean something to Redis, Lua, ACL
# patterns or shells drawn often.
names = st.text(
    alphabet=st.one_of(
        st.sampled_from("{}:*?[]\\\"' \t-_.=%$\n"),
        st.characters(exclude_categories=["Cs"]),
    ),
    max_size=24,
)
FAST = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# The constructor: one parameter at a time, anything at all.

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**7),
    st.floats(allow_nan=True, allow_infinity=True),
    names,
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(names, st.sampled_from([">", "0"]), max_size=2),
)
NAME_PARAMETERS = ("queue_name", "consumer_group_name", "consumer_name")
PARAMETERS = (
    *NAME_PARAMETERS,
    "idle_timeout",
    "claim_interval",
    "unacknowledged_batch_size",
    "unacknowledged_lock_timeout",
    "max_deliveries",
    "xread_block",
    "xread_count",
    "maxlen",
    "additional_streams",
)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stored(broker: AtomicRedisStreamBroker, parameter: str) -> Any:
    """Where the broker keeps an accepted value: the parent's attribute where
    taskiq-redis has one, else the checked claim settings."""
    where = {
        "xread_block": "block",
        "xread_count": "count",
        "claim_interval": "atomic.settings.claim_interval",
        "max_deliveries": "atomic.settings.max_deliveries",
    }.get(parameter, parameter)
    value: Any = broker
    for part in where.split("."):
        value = getattr(value, part)
    return value


# What each parameter accepts, as its error messages state it (idle_timeout
# is 10_000 ms in every example, so claim_interval must stay below it).
VALID: dict[str, Any] = {
    "queue_name": lambda v: isinstance(v, str) and v != "",
    "consumer_group_name": lambda v: isinstance(v, str) and v != "",
    "consumer_name": lambda v: isinstance(v, str) and v != "",
    "idle_timeout": lambda v: _whole(v) and v >= 2,
    "claim_interval": lambda v: v is None or (_whole(v) and 1 <= v < 10_000),
    "unacknowledged_batch_size": lambda v: _whole(v) and v >= 1,
    "unacknowledged_lock_timeout": lambda v: (
        v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v > 0)
    ),
    "max_deliveries": lambda v: v is None or (_whole(v) and v >= 1),
    "xread_block": lambda v: _whole(v) and v >= 0,
    "xread_count": lambda v: v is None or (_whole(v) and v >= 1),
    "maxlen": lambda v: v is None or (_whole(v) and v >= 1),
    "additional_streams": lambda v: (
        v is None or (isinstance(v, dict) and all(isinstance(k, str) and k for k in v))
    ),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PARAMETERS), anything)
# The smallest value each accepts, and values taken as they are.
@example("idle_timeout", 2)
@example("claim_interval", 1)
@example("claim_interval", 9_999)
@example("unacknowledged_batch_size", 1)
@example("unacknowledged_lock_timeout", 0.001)
@example("max_deliveries", 1)
@example("max_deliveries", None)
@example("xread_block", 0)
@example("xread_count", 1)
@example("maxlen", 1)
@example("additional_streams", {"other": "0-1"})
@example("queue_name", LUA_NAME)
def test_the_constructor_accepts_or_names_the_parameter(
    parameter: str, value: Any
) -> None:
    if parameter == "consumer_name" and value is None:
        return  # None means "make one up"
    kwargs = {"idle_timeout": 10_000, parameter: value}
    try:
        broker = AtomicRedisStreamBroker("redis://127.0.0.1:1", **kwargs)
    except ValueError as error:
        assert parameter in str(error), (parameter, str(error))
        if parameter in NAME_PARAMETERS:
            assert not (isinstance(value, str) and value)
        return
    # Accepted: the value is one the parameter's rule allows, and the broker
    # keeps it as given (None: the documented default instead).
    assert VALID[parameter](value), (parameter, value)
    stored = _stored(broker, parameter)
    if value is None:
        assert parameter != "max_deliveries" or stored == 0  # never dead-letter
    elif parameter == "max_deliveries":
        assert stored == value
    else:
        assert stored == value and type(stored) is type(value), (parameter, stored)


# End to end, as a worker whose ACL was made for these very names.


def message(body: str) -> BrokerMessage:
    return BrokerMessage(task_id=body, task_name="t", message=body.encode(), labels={})


@FAST
@given(queue=names, group=names, consumer=names)
@example(queue=LUA_NAME, group=LUA_NAME, consumer=LUA_NAME)
@example(queue="{jobs}", group="a:b c", consumer="🚀 worker")
@example(queue="a{b", group="}{", consumer="'")
@example(queue="", group="g", consumer="c")
async def test_any_valid_names_work_end_to_end(
    server: Server, redis: Redis, queue: str, group: str, consumer: str
) -> None:
    kwargs: dict[str, Any] = {
        "queue_name": queue,
        "consumer_group_name": group,
        "consumer_name": consumer,
        "idle_timeout": 2000,
        "claim_interval": 100,
        "unacknowledged_lock_timeout": 30.0,
        "xread_block": 100,
    }
    url = with_user(server.url, USER, PASSWORD)
    if not (queue and group and consumer):
        with pytest.raises(ValueError, match="must be a non-empty string"):
            AtomicRedisStreamBroker(url, **kwargs)
        return
    await redis.flushall()
    version = str((await redis.info("server"))["redis_version"])
    await server_command(redis,
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}",
        *worker_acl_rule([queue], group, version),
    )  # fmt: skip
    broker = AtomicRedisStreamBroker(url, **kwargs)
    await broker.startup()
    try:
        await broker.kick(message(queue))
        received = await asyncio.wait_for(broker.listen().__anext__(), 5)
        assert received.data == queue.encode()
        await maybe_awaitable(received.ack())
        keys = StreamKeys(queue, group)
        # Came back from ARGV exactly as sent: the claim script's lease
        # holder. Where reads reclaim (Redis >= 8.4) no lease is ever taken.
        # (Nothing is idle, so the fleet's look sends no claim: one here.)
        lua = broker.atomic.path.reclaim_path == LUA_CLAIM
        if lua:
            async with broker.atomic.connection.connect() as client:
                await broker.atomic.claims.claim(client, queue)
        expected_lease = consumer.encode() if lua else None
        assert await redis.get(keys.lease) == expected_lease
        seen = await inspect_server(redis, [queue], group)
        [stream] = seen.streams
        assert (stream.name, stream.length) == (queue, 1)
        [view] = stream.groups
        assert view.exists and view.pending == 0
        assert consumer in [c.name for c in view.consumers]
        assert view.lease.value == (consumer if lua else None)
    finally:
        await broker.shutdown()


# The CLI, in-process: a traceback would escape main().

cli_names = names.filter(lambda name: "\x00" not in name)  # argv cannot carry NUL


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def one_line_usage_error(code: int, err: str) -> bool:
    return code == 2 and err.count("\n") == 1 and "error:" in err


@FAST
@given(queue=cli_names, group=cli_names, consumer=cli_names)
@example(queue=LUA_NAME, group="{jobs}", consumer="a:b c")
@example(queue="-q", group="--group", consumer="x")
@example(queue="", group="g", consumer="c")
def test_the_cli_takes_any_name_or_refuses_it_in_one_line(
    server: Server, queue: str, group: str, consumer: str
) -> None:
    admin = sync_redis.Redis.from_url(server.admin_url)
    try:
        admin.flushall()
        if queue and group and consumer:
            admin.xgroup_create(queue, group, id="0", mkstream=True)
            admin.xadd(queue, {"data": "x"})
            admin.xreadgroup(group, consumer, {queue: ">"})
    finally:
        admin.close()
    scope = (f"--queue={queue}", f"--group={group}")
    code, out, err = run_cli("inspect", "--url", server.url, *scope, "--json")
    if not (queue and group):
        assert one_line_usage_error(code, err), (code, err)
        assert "--queue" in err or "--group" in err
        return
    assert code == 0, err
    [stream] = json.loads(out)["streams"]
    assert stream["stream"] == queue
    [view] = stream["groups"]
    assert view["group"] == group
    if consumer:
        assert [c["name"] for c in view["consumers"]] == [consumer]
        assert view["pending"] == 1
    code, out, err = run_cli("dead-letters", "--url", server.url, *scope)
    if consumer:
        assert code == 0, err
    else:  # no stream made: a name that is not there is an error
        assert one_line_usage_error(code, err), (code, err)
        assert f"no queue {queue!r}" in err
    code, out, err = run_cli(
        "doctor", "--url", server.url, *scope, "--max-pending", "5"
    )
    assert code in (0, 1), err
    assert "Traceback" not in err


@FAST
@given(
    option=st.sampled_from(
        [
            "--consumer-idle-ms",
            "--max-pending",
            "--stale-pending-ms",
            "--lock-expiry-ms",
        ]
    ),
    value=st.one_of(st.integers(-5, 5).map(str), cli_names),
)
def test_doctor_thresholds_are_numbers_or_a_one_line_error(
    server: Server, option: str, value: str
) -> None:
    code, _, err = run_cli("doctor", "--url", server.url, f"{option}={value}")
    try:
        number = int(value)
    except ValueError:
        number = None
    lowest = 0 if option == "--max-pending" else 1
    if number is None or number < lowest:
        assert one_line_usage_error(code, err), (code, err)
        assert option in err
    else:
        assert code in (0, 1), err


# Topology options: only loopback is ever dialled (a port nothing listens
# on, or one no socket can have), so every run ends in a one-line error.
CLOSED_PORT = free_port()
ports = st.one_of(
    st.sampled_from([CLOSED_PORT, 0, -1, 65536, 10**9]).map(str),
    cli_names.filter(lambda text: not text.isdigit()),
)
sentinel_addresses = st.one_of(
    cli_names.filter(lambda text: ":" not in text),
    ports.map(lambda port: f"127.0.0.1:{port}"),
)


@FAST
@given(
    command=st.sampled_from(["load", "check", "inspect", "doctor", "dead-letters"]),
    sentinel=sentinel_addresses,
    master=st.one_of(st.none(), cli_names),
    cluster=st.booleans(),
)
def test_sentinel_options_work_or_fail_in_one_line(
    command: str, sentinel: str, master: str | None, cluster: bool
) -> None:
    args = [command, f"--sentinel={sentinel}"]
    args += [] if master is None else [f"--master={master}"]
    args += ["--cluster"] if cluster else []
    code, out, err = run_cli(*args)
    assert one_line_usage_error(code, err), (code, out, err)


@FAST
@given(
    command=st.sampled_from(["load", "check", "inspect", "doctor", "requeue"]),
    port=ports,
)
@example(command="load", port="[")  # urlsplit raises ValueError on it
@example(command="load", port="@")  # a URL with no host: RedisCluster refuses it
def test_cluster_urls_work_or_fail_in_one_line(command: str, port: str) -> None:
    extra = ["--all"] if command == "requeue" else []
    code, out, err = run_cli(
        command, "--cluster", f"--url=redis://127.0.0.1:{port}", *extra
    )
    assert one_line_usage_error(code, err), (code, out, err)
