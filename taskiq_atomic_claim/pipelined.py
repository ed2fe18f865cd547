"""The per-task calls (a task's start, its ack) pipelined on one connection.

Every call made in one turn of the event loop goes out in one write on one
connection held for this purpose: concurrent tasks' starts and acks share a
round trip, and each call costs a list append, not a pool checkout, a
deadline object and an awaited reply of its own. A start waits only until
its write is in the kernel (``written``): from there it reaches the server
even if the process is killed at once, so no round trip stands between a
task's start record and the task. An ack waits for its reply.

Replies come back in order on the same connection and are read by one
reader task, under one deadline per write (``REPLY_MARGIN_S``): no reply in
time means the connection is dead. A failed connection fails every call
awaiting a reply (acks retry on their own) and is replaced at the next
write; the new connection makes sure the library is loaded before anything
is written on it, so the first start after a server restart is not lost to
a missing function.

A client without a connection pool of its own (Cluster) does not pipeline:
``available`` is False and callers keep the awaited path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any, TypeVar

from redis.exceptions import RedisError, ResponseError

from taskiq_atomic_claim.operations import Operation, OperationCall
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import is_missing_script

logger = logging.getLogger("taskiq.atomic_claim")

ReplyT = TypeVar("ReplyT")


class _Call:
    __slots__ = ("args", "loads_before", "operation", "reply", "resent", "written")

    def __init__(
        self,
        operation: Operation[Any],
        args: tuple[Any, ...],
        loads_before: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.operation = operation
        # numkeys, keys, arguments: FCALL or EVALSHA goes before them when
        # written, once the server is known.
        self.args = args
        # The runner's reloads when it was queued: a reload made since serves it.
        self.loads_before = loads_before
        self.written: asyncio.Future[None] = loop.create_future()
        self.reply: asyncio.Future[Any] = loop.create_future()
        self.resent = False


class PipelinedCalls:
    """Pipelined script calls over one connection of ``client``'s pool."""

    def __init__(self, scripts: ScriptRunner, client: Any) -> None:
        self.scripts = scripts
        self.client = client
        self.pool = getattr(client, "connection_pool", None)
        self._queued: list[_Call] = []
        self._flushing: asyncio.Task[None] | None = None
        self._awaiting: collections.deque[_Call] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._connection: Any = None

    @property
    def available(self) -> bool:
        return self.pool is not None

    def submit(self, bound: OperationCall[Any]) -> _Call:
        """Queue one call for the next write; await ``written`` or ``reply``
        on what it returns."""
        call = _Call(
            bound.operation,
            (len(bound.keys), *bound.keys, *bound.args),
            self.scripts.loads,
            asyncio.get_running_loop(),
        )
        self._queued.append(call)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        return call

    async def call(self, bound: OperationCall[ReplyT]) -> ReplyT:
        reply: ReplyT = await self.submit(bound).reply
        return reply

    async def _flush(self) -> None:
        # Whatever else this turn of the loop queues goes in the same write.
        await asyncio.sleep(0)
        while self._queued:
            calls, self._queued = self._queued, []
            try:
                connection = await self._connected()
                # Read again after a failover or a reconnect: FCALL on Redis
                # 6.2 would be an unknown command, and the call a usage error.
                functions = (await self.scripts.server(self.client)).functions
                # Returns once the kernel has every byte (see _connected): a
                # start counts as recorded from here, whatever happens to
                # this process.
                await connection.send_packed_command(
                    connection.pack_commands(
                        [
                            (*self.scripts.command(c.operation, functions), *c.args)
                            for c in calls
                        ]
                    ),
                    check_health=False,
                )
            except BaseException as error:
                await self._drop_connection()
                failure = _as_exception(error)
                for call in calls:
                    _fail(call.written, failure)
                    _fail(call.reply, failure)
                if not isinstance(error, Exception):
                    raise
                continue
            self._awaiting.extend(calls)
            for call in calls:
                if not call.written.done():
                    call.written.set_result(None)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(connection))

    async def _connected(self) -> Any:
        if self._connection is not None and _alive(self._connection):
            return self._connection
        await self._drop_connection()
        assert self.pool is not None
        # The library before anything that calls it: after a restart it is
        # gone, and a start written before it would fail unseen.
        # Best effort: refused (out of memory, an ACL without reloads) the
        # calls still run, and one finding it missing loads it then.
        with contextlib.suppress(RedisError):
            await self.scripts.load(self.client)
        connection = await self.pool.get_connection()
        transport = connection._writer.transport
        # drain() then waits until the kernel has all of it.
        transport.set_write_buffer_limits(high=0, low=0)
        self._connection = connection
        return connection

    async def _read(self, connection: Any) -> None:
        while self._awaiting and connection is self._connection:
            try:
                # One deadline for the replies owed so far.
                await within(
                    REPLY_MARGIN_S, self._read_replies(connection, len(self._awaiting))
                )
            except BaseException as error:
                await self._drop_connection()
                failure = _as_exception(error)
                while self._awaiting:
                    _fail(self._awaiting.popleft().reply, failure)
                if not isinstance(error, Exception):
                    raise
                return

    async def _read_replies(self, connection: Any, count: int) -> None:
        for _ in range(count):
            call = self._awaiting[0]
            try:
                reply = await connection.read_response()
            except ResponseError as error:
                self._awaiting.popleft()
                if is_missing_script(error) and not call.resent:
                    # A flush without a reconnect (FUNCTION/SCRIPT FLUSH):
                    # one load for every call it caught, as on the awaited path.
                    try:
                        await self.scripts.reload_after_missing(
                            self.client, call.loads_before
                        )
                    except RedisError:
                        _fail(call.reply, error)
                        continue
                    call.resent = True
                    self._queued.append(call)
                    if self._flushing is None or self._flushing.done():
                        self._flushing = asyncio.create_task(self._flush())
                    continue
                _fail(call.reply, error)
                continue
            self._awaiting.popleft()
            if not call.reply.done():
                call.reply.set_result(reply)

    async def settled(self) -> None:
        """Every call written so far answered (or failed), bounded."""
        owed = [call.reply for call in (*self._awaiting, *self._queued)]
        if owed:
            await asyncio.wait(owed, timeout=REPLY_MARGIN_S)

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and self.pool is not None:
            # Disconnected before it goes back: what it still owes is unknown.
            await connection.disconnect(nowait=True)
            await self.pool.release(connection)


def _alive(connection: Any) -> bool:
    """Connected, and the server has not closed its end: a restart's FIN is
    seen here (asyncio reads it as it comes) though nobody read a reply since,
    and a write on that connection would vanish."""
    if not connection.is_connected:
        return False
    reader, writer = connection._reader, connection._writer
    return not (reader.at_eof() or writer.transport.is_closing())


def _as_exception(error: BaseException) -> Exception:
    if isinstance(error, Exception):
        return error
    return RuntimeError("the pipelined call was cancelled")


def _fail(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
        # Retrieved here: a start nobody awaits the reply of must not log
        # "exception was never retrieved"; its owner logs it.
        future.exception()
