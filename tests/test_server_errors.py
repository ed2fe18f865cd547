"""Each question about an error reply has one answer, in server_errors.py,
checked on the errors real servers send (through redis-py's own parser)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from taskiq_atomic_claim.server_errors import (
    UNREACHABLE,
    Fault,
    classify,
    group_exists,
    is_missing_key,
    is_missing_script,
    is_outage,
    is_permission_denied,
    missing_permission,
    reply_code,
    stream_missing,
    waited_out_while_running,
)
from tests.conftest import Server, server_command

STREAM, GROUP = "jobs", "workers"
READ_IN_SCRIPT = (
    "return redis.call('XREADGROUP', 'GROUP', ARGV[1], 'c', 'STREAMS', KEYS[1], '>')"
)


async def refusal(client: Redis, *command: Any) -> ResponseError:
    with pytest.raises(ResponseError) as caught:
        await server_command(client, *command)
    return caught.value


async def test_each_error_reply_is_told_by_its_code(
    redis: Redis, server: Server
) -> None:
    no_group = await refusal(
        redis, "XREADGROUP", "GROUP", GROUP, "c", "STREAMS", STREAM, ">"
    )
    assert reply_code(no_group) == "NOGROUP"
    assert classify(no_group) is Fault.GROUP_MISSING
    # Inside a script (Redis 6.2 wraps it in "ERR Error running script").
    in_script = await refusal(redis, "EVAL", READ_IN_SCRIPT, 1, STREAM, GROUP)
    assert reply_code(in_script) == "NOGROUP"

    await server_command(redis, "XGROUP", "CREATE", STREAM, GROUP, "0", "MKSTREAM")
    busy_group = await refusal(redis, "XGROUP", "CREATE", STREAM, GROUP, "0")
    assert reply_code(busy_group) == "BUSYGROUP"
    assert group_exists(busy_group)
    assert not group_exists(no_group)

    no_stream = await refusal(redis, "XGROUP", "CREATE", "nothing", GROUP, "0")
    assert stream_missing(no_stream)
    assert not stream_missing(busy_group)
    assert classify(no_stream) is Fault.USAGE

    no_key = await refusal(redis, "XINFO", "GROUPS", "nothing")
    assert is_missing_key(no_key)
    await server_command(redis, "SET", "text", "x", "PX", 60_000)
    wrong_type = await refusal(redis, "XINFO", "GROUPS", "text")
    assert reply_code(wrong_type) == "WRONGTYPE"
    assert not is_missing_key(wrong_type)
    assert not is_missing_key(no_group)

    # Codes redis-py has an exception class for: read from the reply, not
    # mapped back from the class.
    no_script = await refusal(redis, "EVALSHA", "0" * 40, 0)
    assert reply_code(no_script) == "NOSCRIPT"
    assert is_missing_script(no_script)
    assert not is_missing_script(no_group)
    if server.info.functions:
        no_function = await refusal(redis, "FCALL", "taskiq_atomic_claim_none", 0)
        assert is_missing_script(no_function)

    worker = Redis.from_url(server.worker_url)
    try:
        denied = await refusal(worker, "CONFIG", "GET", "maxmemory")
    finally:
        await worker.aclose()
    assert reply_code(denied) == "NOPERM"
    assert is_permission_denied(denied)
    assert not is_permission_denied(no_group)
    # Refused at startup, waited out by a running worker (an ACL change).
    assert classify(denied) is Fault.FORBIDDEN
    assert not is_outage(denied)
    assert waited_out_while_running(denied)
    assert not waited_out_while_running(no_group)
    assert "no permissions to run the 'config" in missing_permission(denied)


async def test_a_server_that_cannot_be_reached_is_an_outage() -> None:
    # Port 1 on loopback: nothing listens there.
    client = Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    try:
        with pytest.raises(UNREACHABLE) as caught:
            await client.ping()
    finally:
        await client.aclose()
    assert classify(caught.value) is Fault.UNREACHABLE


async def test_a_read_blocked_on_a_deleted_stream_means_the_group_is_gone(
    redis: Redis, server: Server
) -> None:
    # Redis >= 7 answers UNBLOCKED, as it does to a demoted primary's readers:
    # only the text tells a deleted stream from a failover.
    await server_command(redis, "XGROUP", "CREATE", STREAM, GROUP, "0", "MKSTREAM")
    reader = Redis.from_url(server.admin_url)
    try:
        blocked = ("XREADGROUP", "GROUP", GROUP, "c", "BLOCK", "2000")
        read = asyncio.ensure_future(
            server_command(reader, *blocked, "STREAMS", STREAM, ">")
        )
        await asyncio.sleep(0.3)
        await redis.delete(STREAM)
        try:
            reply = await read
        except ResponseError as error:
            assert classify(error) is Fault.GROUP_MISSING, error
        else:
            assert server.major < 7, reply  # 6.2 keeps the read blocked
    finally:
        await reader.aclose()
