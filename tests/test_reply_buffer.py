"""The pipelined connection's reply parser against what a real server sends:
the same replies as redis-py's own parser gives, however the bytes arrive."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError

from taskiq_atomic_claim.reply_buffer import ReplyBuffer
from taskiq_atomic_claim.task_records import (
    KEEP_HASHTABLE_FIELD,
    KEEP_HASHTABLE_VALUE,
)
from tests.conftest import Server

# What the pipelined connection sends, and a few replies it could meet:
# an error inside EXEC (WRONGTYPE), a transaction the server aborts
# (EXECABORT), a nil, a plain error.
COMMANDS: list[tuple[Any, ...]] = [
    ("MULTI",),
    ("HINCRBY", "started", "1-0", 1),
    ("HINCRBY", "started", "2-0", 1),
    ("HSETNX", "started", KEEP_HASHTABLE_FIELD, KEEP_HASHTABLE_VALUE),
    ("PEXPIRE", "started", 60_000),
    ("EXEC",),
    ("SET", "plain", "x"),
    ("MULTI",),
    ("HINCRBY", "plain", "1-0", 1),
    ("PEXPIRE", "plain", 60_000),
    ("EXEC",),
    ("MULTI",),
    ("HINCRBY", "started"),
    ("EXEC",),
    ("XADD", "stream", "1-1", "data", "d"),
    ("XGROUP", "CREATE", "stream", "g", "0"),
    ("XREADGROUP", "GROUP", "g", "c", "STREAMS", "stream", ">"),
    ("XACK", "stream", "g", "1-1", "9-9"),
    ("HDEL", "started", "1-0", "2-0"),
    ("HGET", "started", "missing"),
    ("NOSUCHCOMMAND",),
]


async def server_replies(url: str, protocol: int) -> tuple[bytes, list[Any]]:
    """The raw bytes a server sends for COMMANDS, and redis-py's parse of
    the same replies (errors as the exception it raises)."""
    client = Redis.from_url(url, protocol=protocol)
    try:
        await client.flushall()
        raw: Connection = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            assert raw._writer is not None and raw._reader is not None
            raw._writer.write(b"".join(raw.pack_commands(COMMANDS)))
            await asyncio.sleep(0.2)  # every reply in the socket's buffer
            data = await asyncio.wait_for(raw._reader.read(1 << 20), 5)
        finally:
            await raw.disconnect()
            await client.connection_pool.release(raw)
        await client.flushall()
        parsed: Connection = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            expected = []
            for command in COMMANDS:
                await parsed.send_command(*command)
                try:
                    expected.append(await parsed.read_response())
                except ResponseError as error:
                    expected.append(error)
        finally:
            await client.connection_pool.release(parsed)
    finally:
        await client.aclose()
    return data, expected


def comparable(value: Any) -> Any:
    """Exceptions compare by class and text."""
    if isinstance(value, BaseException):
        return (type(value), str(value))
    if isinstance(value, list):
        return [comparable(item) for item in value]
    if isinstance(value, dict):
        return {comparable(k): comparable(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("protocol", [2, 3])
async def test_replies_parse_as_redis_py_parses_them_in_any_chunking(
    server: Server, protocol: int
) -> None:
    data, expected = await server_replies(server.admin_url or server.url, protocol)
    assert len(expected) == len(COMMANDS)
    assert any(isinstance(reply, ResponseError) for reply in expected)
    rng = random.Random(protocol)
    for chunking in ("whole", "bytewise", "random"):
        replies = ReplyBuffer()
        got: list[Any] = []
        position = 0
        while position < len(data):
            size = {"whole": len(data), "bytewise": 1}.get(chunking) or rng.randint(
                1, 40
            )
            replies.feed(data[position : position + size])
            position += size
            whole, reply = replies.pop()
            while whole:
                got.append(reply)
                whole, reply = replies.pop()
        assert comparable(got) == comparable(expected), chunking
    assert replies.pop() == (False, None)


def test_a_push_message_is_no_reply() -> None:
    # RESP3 out-of-band notice (no server here sends one unasked): skipped.
    replies = ReplyBuffer()
    replies.feed(b">2\r\n$6\r\nMOVING\r\n:1\r\n:3\r\n")
    assert replies.pop() == (True, 3)
