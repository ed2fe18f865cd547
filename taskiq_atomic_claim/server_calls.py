"""Bounds on calls to the server: a deadline for every reply, and honouring
a cancel that redis-py swallowed, so no loop waits or runs for ever."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from taskiq_atomic_claim.server_errors import Fault, classify

# No reply within this (beyond a read's own block) means the connection is
# dead, e.g. half-open after a host vanished: without a socket_timeout
# redis-py would wait for ever. Generous, as a busy server stalls for seconds.
REPLY_MARGIN_S = 5.0

_T = TypeVar("_T")


async def within(seconds: float, awaitable: Awaitable[_T]) -> _T:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``seconds``.

    Runs in the calling task where Python allows (3.11+): ``wait_for``'s
    extra task can leave killed pool connections to the next caller.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


async def drop_idle_connections(
    connect: Callable[[], AbstractAsyncContextManager[Any]], error: BaseException
) -> None:
    """After ``error``, if it says the server is unreachable, close the idle
    connections of the pool ``connect`` gives: they went with the server (a
    restart, a half-open network). Never raises.

    redis-py 8.1 hands pooled connections out unchecked under RESP3
    (redis/redis-py#4252): each would fail the next call made on it, and a
    call not retried, a task's start, would be lost. A Cluster client has
    no pool of its own and handles its nodes itself.
    """
    if not isinstance(error, Exception) or classify(error) is not Fault.UNREACHABLE:
        return
    with contextlib.suppress(Exception):
        async with connect() as client:
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                await pool.disconnect(inuse_connections=False)


def raise_if_cancel_was_swallowed() -> None:
    """Honour a cancel that a redis-py call swallowed (seen on Python 3.11).

    The call then returns normally and a loop would run on forever, so
    whoever cancelled it (taskiq's receiver at shutdown, ``wait_for``) hangs.
    ``Task.cancelling()`` still counts the request.
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError
