"""The per-task calls (a task's start, its ack) pipelined on one connection.

One write is in flight at a time on one connection held for this purpose:
a call made while nothing is owed is written at once; calls made while
replies are owed wait for them and then go out together, concurrent starts
as one transaction per started hash, acks as one XACK per stream
(``task_records.py`` defines the commands). So an idle worker's start
costs its task no turn of the event loop, and a busy worker's calls share
writes and the server's work. Acks are held up to ``ACK_AFTER_S`` to go
out ``ACK_BATCH`` at a time, and acked entries' start counts are deleted in
bulk (one HDEL per ``FORGET_BATCH`` ids, or ``FORGET_AFTER_S`` after an
ack): a field left meanwhile sits in an expiring hash and counts nothing.

A start waits only until its write is in the kernel (``written``): from
there it reaches the server even if the process is killed at once, so no
round trip stands between a task's start record and the task. An ack waits
for its reply. Writes go straight to the socket from the caller: no task
and no ``wait_for`` per write.

Replies come back in order on the same connection and are read by one
reader task (parsed by ``reply_buffer.py`` from whatever the socket had, one
read for many replies), under one deadline per write (``REPLY_MARGIN_S``): no reply in
time means the connection is dead. A failed connection fails every call
awaiting a reply (acks retry on their own) and is replaced at the next
write.

A client without a connection pool of its own (Cluster) does not pipeline:
``available`` is False and callers keep the awaited path.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from taskiq_atomic_claim.reply_buffer import ReplyBuffer
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.task_records import (
    Command,
    ack_command,
    acked_count,
    count_start_command,
    forget_command,
    start_upkeep_commands,
)

# Acked entries' start counts are deleted together: at this many per
# started hash, or this long after the first (s).
FORGET_BATCH = 32
FORGET_AFTER_S = 1.0
# Acks go out together: at this many, or this long after the first (s).
# Each XACK costs the server about what one id's does; an ack held a few
# ms holds its task's slot as long, and no task's start waits for it.
ACK_BATCH = 8
ACK_AFTER_S = 0.002


_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
# Bytes asked of the socket per read: every reply owed, usually.
_READ_SIZE = 65536


class _Call:
    __slots__ = ("entry_id", "reply", "written")

    def __init__(self, entry_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.entry_id = entry_id
        self.written: asyncio.Future[None] = loop.create_future()
        self.reply: asyncio.Future[Any] = loop.create_future()


class _Batch:
    """Calls of one write sent as one set of commands (``packed``, RESP,
    ``replies`` of them), answered together."""

    __slots__ = ("answered", "calls", "outcome", "packed", "replies")

    def __init__(
        self,
        calls: list[_Call],
        packed: bytes,
        replies: int,
        outcome: Callable[[list[Any]], Any],
        answered: Callable[[], None] = lambda: None,
    ) -> None:
        self.calls = calls
        self.packed = packed
        self.replies = replies
        # The calls' reply from the commands' replies (an exception among
        # them raised).
        self.outcome = outcome
        # Called once the outcome is a reply, not an error.
        self.answered = answered


def _transaction_outcome(replies: list[Any]) -> Any:
    executed = replies[-1]
    _raise_any(replies[:-1])
    if not isinstance(executed, list):
        raise RedisConnectionError(f"unexpected EXEC reply {executed!r}")
    _raise_any(executed)
    return None  # a start's callers need only know it was not refused


def _ack_outcome(replies: list[Any]) -> Any:
    _raise_any(replies)
    return acked_count(replies[0])


def _forget_outcome(replies: list[Any]) -> Any:
    # Nobody waits for it: a refusal leaves fields in an expiring hash.
    del replies


def _raise_any(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


class PipelinedCalls:
    """Pipelined starts and acks over one connection of ``client``'s pool."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pool = getattr(client, "connection_pool", None)
        self._encoder = None if self.pool is None else self.pool.get_encoder()
        # Per (started hash, ttl): its transaction's end, the same for every
        # start of it, packed once (a start is on every task's path).
        self._start_ends: dict[tuple[str, int], tuple[bytes, int]] = {}
        self._count_frames: dict[str, tuple[bytes, bytes]] = {}
        # Starts first in a write (see _batches): by target, then the entry.
        self._starts: dict[tuple[str, int], list[_Call]] = {}
        self._acks: dict[tuple[str, str, str, bool], list[_Call]] = {}
        # Per started hash, entries acked whose counts are not yet deleted.
        self._acked: dict[str, list[str]] = {}
        self._forget_due = False
        self._forget_timer: asyncio.TimerHandle | None = None
        self._ack_count = 0
        self._acks_due = False
        self._ack_timer: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._awaiting: collections.deque[_Batch] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._reader_due = False
        self._connection: Any = None
        self._replies = ReplyBuffer()  # of the current connection

    @property
    def available(self) -> bool:
        return self.pool is not None

    def start(self, started: str, ttl_ms: int, entry_id: str) -> _Call:
        """Write a start now if nothing is owed, else with the next write;
        await ``written`` (or ``reply``) on what it returns."""
        return self._queue(self._starts.setdefault((started, ttl_ms), []), entry_id)

    async def ack(
        self, stream: str, started: str, group: str, entry_id: str, delete_acked: bool
    ) -> int:
        """Ack with others (see ``ACK_BATCH``); 1 if the entry was pending,
        else 0."""
        loop = asyncio.get_running_loop()
        call = _Call(entry_id, loop)
        self._acks.setdefault((stream, started, group, delete_acked), []).append(call)
        self._ack_count += 1
        if self._ack_count >= ACK_BATCH:
            self._acks_due = True
            if not self._awaiting:
                self._flush()
        elif self._ack_timer is None:
            self._ack_timer = loop.call_later(ACK_AFTER_S, self._acks_now)
        reply: int = await call.reply
        return reply

    def _acks_now(self) -> None:
        self._ack_timer = None
        if self._acks:
            self._acks_due = True
            if not self._awaiting:
                self._flush()

    def _queue(self, calls: list[_Call], entry_id: str) -> _Call:
        call = _Call(entry_id, asyncio.get_running_loop())
        calls.append(call)
        if not self._awaiting:
            # Nothing owed: written now, so a start costs its task no turn
            # of the loop. Else it waits for the replies owed (see _read).
            self._flush()
        return call

    def _batches(self) -> list[_Batch]:
        # Starts before acks: an entry's ack is only made once its start was
        # written, so within one write no ack precedes its own start.
        batches = []
        for (started, ttl_ms), calls in self._starts.items():
            end, end_replies = self._start_end(started, ttl_ms)
            counts = self._pack_counts(started, [call.entry_id for call in calls])
            packed = b"".join((_MULTI, counts, end))
            replies = 1 + len(calls) + end_replies  # MULTI's, each QUEUED, EXEC's
            batches.append(_Batch(calls, packed, replies, _transaction_outcome))
        self._starts = {}
        if self._acks_due:
            for (stream, started, group, delete_acked), calls in self._acks.items():
                ids = [call.entry_id for call in calls]
                packed = self._pack([ack_command(stream, group, ids, delete_acked)])
                answered = functools.partial(self._forget_later, started, ids)
                batches.append(_Batch(calls, packed, 1, _ack_outcome, answered))
            self._acks, self._ack_count, self._acks_due = {}, 0, False
            if self._ack_timer is not None:
                self._ack_timer.cancel()
                self._ack_timer = None
        # Acked counts go in bulk, each HDEL costing the server about what
        # one id's did: at FORGET_BATCH ids, or FORGET_AFTER_S after an ack.
        for started, ids in list(self._acked.items()):
            if self._forget_due or len(ids) >= FORGET_BATCH:
                del self._acked[started]
                packed = self._pack([forget_command(started, ids)])
                batches.append(_Batch([], packed, 1, _forget_outcome))
        self._forget_due = False
        return batches

    def _start_end(self, started: str, ttl_ms: int) -> tuple[bytes, int]:
        """The start transaction's end, packed, and how many replies it has."""
        end = self._start_ends.get((started, ttl_ms))
        if end is None:
            commands = [*start_upkeep_commands(started, ttl_ms), ("EXEC",)]
            end = self._start_ends[(started, ttl_ms)] = (
                self._pack(commands),
                len(commands),
            )
        return end

    def _pack_counts(self, started: str, entry_ids: list[str]) -> bytes:
        """Each entry's ``count_start_command``, packed: only the id differs
        from one to the next."""
        around = self._count_frames.get(started)
        if around is None:
            head, _, tail = self._pack([count_start_command(started, "")]).rpartition(
                b"$0\r\n\r\n"
            )
            around = self._count_frames[started] = (head, tail)
        head, tail = around
        return b"".join(
            b"%s$%d\r\n%s\r\n%s" % (head, len(data), data, tail)
            for data in (entry_id.encode() for entry_id in entry_ids)
        )

    def _pack(self, commands: list[Command]) -> bytes:
        """RESP for ``commands``: short arguments only (ids, keys, numbers),
        so one buffer, without redis-py's chunking of large values."""
        encode = self._encoder.encode  # type: ignore[union-attr]
        out = []
        for command in commands:
            out.append(b"*%d\r\n" % len(command))
            for argument in command:
                data = encode(argument)
                out.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return b"".join(out)

    def _forget_later(self, started: str, ids: list[str]) -> None:
        self._acked.setdefault(started, []).extend(ids)
        if self._forget_timer is None:
            loop = asyncio.get_running_loop()
            self._forget_timer = loop.call_later(FORGET_AFTER_S, self._forget_now)

    def _forget_now(self) -> None:
        self._forget_timer = None
        if self._acked:
            self._forget_due = True
            connection = self._connection
            # Never a new connection for this alone (after a shutdown, say):
            # the next write takes them.
            if not self._awaiting and connection is not None and _alive(connection):
                self._flush()

    def _flush(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            return  # the connecting task writes what is queued once ready
        connection = self._connection
        if connection is None or not _alive(connection):
            self._connecting = asyncio.create_task(self._connect_and_flush())
            return
        batches = self._batches()
        if batches:
            self._write(connection, batches)

    def _queued(self) -> bool:
        return bool(self._starts or self._acks_due or self._forget_due)

    async def _connect_and_flush(self) -> None:
        try:
            connection = await self._connected()
        except BaseException as error:
            failure = _as_exception(error)
            for batch in self._batches():
                _fail_batch(batch, failure)
            if not isinstance(error, Exception):
                raise
            return
        batches = self._batches()
        if batches:
            self._write(connection, batches)

    def _write(self, connection: Any, batches: list[_Batch]) -> None:
        packed = b"".join(batch.packed for batch in batches)
        transport = connection._writer.transport
        try:
            connection._writer.write(packed)
        except Exception as error:
            self._lost(batches, error)
            return
        if transport.is_closing():
            # The send failed (the transport closes itself): nothing is sure
            # to be on its way.
            self._lost(batches, RedisConnectionError("connection lost writing"))
            return
        self._awaiting.extend(batches)
        if transport.get_write_buffer_size() == 0:
            _written(batches)
        else:
            # The kernel's buffer is full: written once it took the rest.
            asyncio.create_task(self._drained(connection, batches))  # noqa: RUF006
        if not self._reader_due and (self._reader is None or self._reader.done()):
            # Started after this turn: the writer (a task about to start)
            # does not pay for creating it.
            self._reader_due = True
            asyncio.get_running_loop().call_soon(self._start_reader)

    def _start_reader(self) -> None:
        self._reader_due = False
        connection = self._connection
        # What is owed is owed on the current connection (a lost one failed
        # its calls), and a reader still running reads it.
        idle = self._reader is None or self._reader.done()
        if self._awaiting and connection is not None and idle:
            self._reader = asyncio.create_task(self._read(connection))

    async def _drained(self, connection: Any, batches: list[_Batch]) -> None:
        try:
            await within(REPLY_MARGIN_S, connection._writer.drain())
        except Exception as error:
            for batch in batches:
                for call in batch.calls:
                    _fail(call.written, error)
            await self._drop_connection()
            return
        _written(batches)

    def _lost(self, batches: list[_Batch], error: Exception) -> None:
        for batch in batches:
            _fail_batch(batch, error)
        connection, self._connection = self._connection, None
        asyncio.create_task(self._release(self.pool, connection))  # noqa: RUF006

    async def _connected(self) -> Any:
        if self._connection is not None and _alive(self._connection):
            return self._connection
        await self._drop_connection()
        assert self.pool is not None
        connection = await self.pool.get_connection()
        transport = connection._writer.transport
        # A write leaves nothing in asyncio's buffer unless the kernel's is
        # full: then ``written`` waits for drain().
        transport.set_write_buffer_limits(high=0, low=0)
        self._connection = connection
        self._replies = ReplyBuffer()
        return connection

    async def _read(self, connection: Any) -> None:
        """Read the replies owed; once none is, write what queued meanwhile:
        one write in flight, so under load calls share writes (a start
        waits at most one round trip) and idle each goes out at once."""
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
                    _fail_batch(self._awaiting.popleft(), failure)
                if self._queued():
                    self._flush()  # on a new connection
                if not isinstance(error, Exception):
                    raise
                return
            if not self._awaiting and self._queued():
                self._flush()

    async def _read_replies(self, connection: Any, count: int) -> None:
        replies_read = self._replies
        for _ in range(count):
            batch = self._awaiting[0]
            replies: list[Any] = []
            while len(replies) < batch.replies:
                whole, reply = replies_read.pop()
                if whole:
                    # An error reply is the server's answer: a value here.
                    replies.append(reply)
                    continue
                # No deadline per read: one per batch (_read).
                try:
                    chunk = await connection._reader.read(_READ_SIZE)
                except OSError as error:
                    raise RedisConnectionError(
                        f"Error while reading from the socket: {error}"
                    ) from error
                if not chunk:
                    raise RedisConnectionError("Connection closed by server.")
                replies_read.feed(chunk)
            self._awaiting.popleft()
            try:
                outcome = batch.outcome(replies)
            except Exception as error:
                _fail_batch(batch, error)
                continue
            batch.answered()
            for call in batch.calls:
                if not call.reply.done():
                    call.reply.set_result(outcome)

    async def settled(self) -> None:
        """Every call written so far answered (or failed), bounded; acked
        counts forgotten."""
        self._acks_due = bool(self._acks)
        self._forget_due = bool(self._acked)
        if self._queued() and not self._awaiting:
            self._flush()
        owed = [call.reply for batch in self._awaiting for call in batch.calls]
        queued = [*self._starts.values(), *self._acks.values()]
        owed += [call.reply for calls in queued for call in calls]
        if owed:
            await asyncio.wait(owed, timeout=REPLY_MARGIN_S)

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        await self._release(self.pool, connection)

    @staticmethod
    async def _release(pool: Any, connection: Any) -> None:
        if connection is not None and pool is not None:
            # Disconnected before it goes back: what it still owes is unknown.
            await connection.disconnect(nowait=True)
            await pool.release(connection)


def _alive(connection: Any) -> bool:
    """Connected, and the server has not closed its end: a restart's FIN is
    seen here (asyncio reads it as it comes) though nobody read a reply since,
    and a write on that connection would vanish."""
    if not connection.is_connected:
        return False
    reader, writer = connection._reader, connection._writer
    return not (reader.at_eof() or writer.transport.is_closing())


def _written(batches: list[_Batch]) -> None:
    for batch in batches:
        for call in batch.calls:
            if not call.written.done():
                call.written.set_result(None)


def _as_exception(error: BaseException) -> Exception:
    if isinstance(error, Exception):
        return error
    return RuntimeError("the pipelined call was cancelled")


def _fail_batch(batch: _Batch, error: Exception) -> None:
    for call in batch.calls:
        _fail(call.written, error)
        _fail(call.reply, error)


def _fail(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
        # Retrieved here: a start nobody awaits the reply of must not log
        # "exception was never retrieved"; its owner logs it.
        future.exception()
