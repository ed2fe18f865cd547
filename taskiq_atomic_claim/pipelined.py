"""The per-task calls (a task's start, its ack) pipelined on one connection.

One write is in flight at a time on one connection held for this purpose:
a call made while nothing is owed is written at once; calls made while
replies are owed wait for them and then go out together, concurrent starts
as one transaction per started hash, acks as one XACK per stream
(``task_records.py`` defines the commands). So an idle worker's start
costs its task no turn of the event loop, and a busy worker's calls share
writes and the server's work. Acks are held up to ``ACK_AFTER_S`` to go
out ``ACK_BATCH`` at a time, or sooner with a start that is written
anyway; acked entries' start counts are deleted in bulk (one HDEL per
``FORGET_BATCH`` ids, or ``FORGET_AFTER_S`` after an ack): a field left
meanwhile sits in an expiring hash and counts nothing.

A start waits only until its write is in the kernel: from there it reaches
the server even if the process is killed at once, so no round trip stands
between a task's start record and the task. ``start`` returns None when
the write is in the kernel already (the usual case: no future, no await),
else a future for it. An ack waits for its reply.

A start written alone (an idle worker's) is corked (Linux TCP_CORK, plain
TCP): its send only queues the bytes, and the loop's next turn, after the
task's first step, pushes them. Sending at once would run the server's side
of loopback TCP and wake the server, which then often takes this CPU
before the task runs (stamps inside a worker at light load: a lone
start's call took 111 us, 99 of them its write; corked, 39 us).
Corked bytes are still in the kernel: a killed process's socket closes with
a FIN that sends them first (nothing is owed on the connection, so no
unread reply turns that close into a reset that drops them), and the
kernel sends them within 200 ms even if a task blocks the loop.

The connection is redis-py's (made by its pool: authentication, RESP
version, database, TLS), taken over once connected: its transport talks to
this module's protocol, so replies are parsed (``reply_buffer.py``) and
answered in the transport's own callback, as they arrive, with no reader
task and no timeout object per write. One timer per connection holds the
deadline (``REPLY_MARGIN_S``) of the oldest write owed: no reply in time
means the connection is dead. A failed connection fails every call
awaiting a reply (acks retry on their own) and is replaced at the next
write.

A client without a connection pool of its own (Cluster) does not pipeline:
``available`` is False and callers keep the awaited path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import socket
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from taskiq_atomic_claim.reply_buffer import ReplyBuffer
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S
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
# Acks go out together: at this many, or this long after the first (s), or
# with the next start's write. Each XACK costs the server about what one
# id's does; an ack held a few ms holds its task's slot as long, and no
# task's start waits for it.
ACK_BATCH = 8
ACK_AFTER_S = 0.002
# A start made less than this after the last write of starts (s) waits the
# rest of it for company: under load starts share writes, each of which
# costs the worker a send syscall that runs the server's side of loopback
# TCP (about 45 us of its time per write, measured while draining); a
# worker whose tasks come further apart than this writes each at once.
START_GATHER_S = 0.001


_MULTI = b"*1\r\n$5\r\nMULTI\r\n"

_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)

# Called with the error when a start's reply refuses it (out of memory).
OnRefused = Callable[[Exception], None]


class _Start:
    """One start: its entry, who hears of a refusal, whether its write is in
    the kernel, and ``written``, a future made only when it was not at
    once (or ``error``: it will not be)."""

    __slots__ = ("entry_id", "error", "in_kernel", "on_refused", "written")

    def __init__(self, entry_id: str, on_refused: OnRefused) -> None:
        self.entry_id = entry_id
        self.on_refused = on_refused
        self.in_kernel = False
        self.error: Exception | None = None
        self.written: asyncio.Future[None] | None = None

    def fail(self, error: Exception) -> None:
        if self.written is None:
            self.error = error
        else:
            _fail(self.written, error)


class _Batch:
    """Calls of one write sent as one set of commands (``packed``, RESP,
    ``replies`` of them), answered together."""

    __slots__ = ("acks", "answered", "due", "packed", "replies", "starts")

    def __init__(
        self,
        packed: bytes,
        replies: int,
        *,
        starts: list[_Start] | None = None,
        acks: list[asyncio.Future[int]] | None = None,
        answered: Callable[[], None] | None = None,
    ) -> None:
        self.packed = packed
        self.replies = replies
        self.starts = starts
        self.acks = acks
        # Called once the acks' reply is a count, not an error.
        self.answered = answered
        self.due = 0.0  # the loop's time by which its replies must be in

    def outcome(self, replies: list[Any]) -> None:
        """Settle its calls from the commands' replies."""
        if self.starts is not None:
            error = _start_error(replies)
            if error is not None:
                for start in self.starts:
                    start.on_refused(error)
            return
        if self.acks is None:
            return  # forgotten counts: a refusal leaves fields in an expiring hash
        error = _first_error(replies)
        if error is not None:
            self.fail(error)
            return
        if self.answered is not None:
            self.answered()
        count = acked_count(replies[0])
        for reply in self.acks:
            if not reply.done():
                reply.set_result(count)

    def written(self) -> None:
        """In the kernel: on its way even if this process dies now."""
        for start in self.starts or ():
            start.in_kernel = True
            if start.written is not None and not start.written.done():
                start.written.set_result(None)

    def fail(self, error: Exception) -> None:
        """Not answered; a start already in the kernel hears of it as of a
        refusal (it may not have been counted)."""
        for start in self.starts or ():
            if start.in_kernel:
                start.on_refused(error)
            else:
                start.fail(error)
        for reply in self.acks or ():
            _fail(reply, error)


def _start_error(replies: list[Any]) -> Exception | None:
    """MULTI's, each QUEUED, EXEC's: the first refusal, if any."""
    executed = replies[-1]
    error = _first_error(replies[:-1])
    if error is not None:
        return error
    if not isinstance(executed, list):
        return RedisConnectionError(f"unexpected EXEC reply {executed!r}")
    return _first_error(executed)


def _first_error(replies: list[Any]) -> Exception | None:
    for reply in replies:
        if isinstance(reply, Exception):
            return reply
    return None


class _Link(asyncio.Protocol):
    """The taken-over connection's protocol: hands what the transport says
    to the pipeline while this link is its current one."""

    def __init__(self, owner: PipelinedCalls, connection: Any, transport: Any) -> None:
        self.owner = owner
        self.connection = connection  # redis-py's, given back to the pool
        self.transport = transport
        # redis-py's protocol: told when the connection is lost, as its
        # disconnect() waits for that.
        self.inner = transport.get_protocol()
        self.replies = ReplyBuffer()
        self.closed = False
        self.socket = _corkable_socket(transport)

    def cork(self) -> bool:
        """Hold what is written next in the kernel until ``uncork``; False
        where that cannot be done (not plain TCP on Linux)."""
        if self.socket is None:
            return False
        try:
            self.socket.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
        except OSError:
            return False
        return True

    def uncork(self) -> None:
        """Send what is held."""
        if self.socket is not None:
            # Closed meanwhile: the link's failure fails what was owed.
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 0)

    def data_received(self, data: bytes) -> None:
        if not self.closed:
            self.owner._received(self, data)

    def eof_received(self) -> bool:
        self.lost(RedisConnectionError("Connection closed by server."))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)
        self.lost(
            exc
            if isinstance(exc, RedisConnectionError)
            else RedisConnectionError(f"Connection lost: {exc or 'closed'}")
        )

    def resume_writing(self) -> None:
        if not self.closed:
            self.owner._drained(self)

    def lost(self, error: Exception) -> None:
        if not self.closed:
            self.owner._link_failed(self, error)

    @property
    def alive(self) -> bool:
        """Not closed, and the server has not closed its end: a restart's
        FIN is seen here at once, and a write after it would vanish."""
        return not (self.closed or self.transport.is_closing())


def _corkable_socket(transport: Any) -> Any:
    """The transport's socket where corking it works as the module's
    docstring says: plain TCP on Linux (no TLS layer between); else None."""
    if _TCP_CORK is None or transport.get_extra_info("sslcontext") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


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
        self._lone_frames: dict[tuple[str, int], tuple[bytes, bytes, int]] = {}
        # Starts first in a write (see _batches): by target, then the entry.
        self._starts: dict[tuple[str, int], list[_Start]] = {}
        self._acks: dict[tuple[str, str, str, bool], list[tuple[str, Any]]] = {}
        # Per started hash, entries acked whose counts are not yet deleted.
        self._acked: dict[str, list[str]] = {}
        self._forget_due = False
        self._forget_timer: asyncio.TimerHandle | None = None
        self._ack_count = 0
        self._acks_due = False
        self._ack_timer: asyncio.TimerHandle | None = None
        self._last_start_write = float("-inf")  # the loop's time
        self._gather_timer: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._link: _Link | None = None
        self._awaiting: collections.deque[_Batch] = collections.deque()
        # Written to the transport, not yet all in the kernel.
        self._unwritten: list[_Batch] = []
        # Replies so far of the batch first in _awaiting.
        self._partial: list[Any] = []
        self._deadline: asyncio.TimerHandle | None = None
        self._idle_waiters: list[asyncio.Future[None]] = []

    @property
    def available(self) -> bool:
        return self.pool is not None

    def start(
        self, started: str, ttl_ms: int, entry_id: str, on_refused: OnRefused
    ) -> asyncio.Future[None] | None:
        """Write a start now if nothing is owed, else with the next write.
        None once it is in the kernel; else a future that is done then (or
        fails: not written). ``on_refused`` hears of a written start the
        server refused or whose reply was lost."""
        call = _Start(entry_id, on_refused)
        if not (self._awaiting or self._starts or self._acks or self._forget_due):
            if self._write_lone_start(call, started, ttl_ms):
                return None
        else:
            self._starts.setdefault((started, ttl_ms), []).append(call)
        # Queued: written now if nothing is owed and no start was written
        # just now, else once the replies owed are in or its company
        # gathered (START_GATHER_S).
        if self._starts and not self._awaiting and self._may_write():
            self._flush()
        if call.in_kernel:
            return None
        future = call.written = asyncio.get_running_loop().create_future()
        if call.error is not None:
            _fail(future, call.error)
        return future

    def _write_lone_start(self, call: _Start, started: str, ttl_ms: int) -> bool:
        """A start with nothing queued or owed beside it (a worker whose
        tasks come further apart than ``START_GATHER_S``): written at once,
        without the general path's batching; else queued, to gather. True
        once it is in the kernel."""
        link = self._link
        loop = asyncio.get_running_loop()
        now = loop.time()
        if (
            link is None
            or not link.alive
            or now < self._last_start_write + START_GATHER_S
        ):
            self._starts[(started, ttl_ms)] = [call]
            return False
        self._last_start_write = now
        head, tail, replies = self._lone_frame(started, ttl_ms)
        data = call.entry_id.encode()
        packed = b"%s$%d\r\n%s\r\n%s" % (head, len(data), data, tail)
        corked = link.cork()  # see the module's docstring
        self._write(link, [_Batch(packed, replies, starts=[call])])
        if corked:
            loop.call_soon(link.uncork)
        return call.in_kernel

    async def ack(
        self, stream: str, started: str, group: str, entry_id: str, delete_acked: bool
    ) -> int:
        """Ack with others (see ``ACK_BATCH``); 1 if the entry was pending,
        else 0."""
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[int] = loop.create_future()
        self._acks.setdefault((stream, started, group, delete_acked), []).append(
            (entry_id, reply)
        )
        self._ack_count += 1
        if self._ack_count >= ACK_BATCH:
            self._acks_due = True
            if not self._awaiting:
                self._flush()
        elif self._ack_timer is None:
            self._ack_timer = loop.call_later(ACK_AFTER_S, self._acks_now)
        return await reply

    def _acks_now(self) -> None:
        self._ack_timer = None
        if self._acks:
            self._acks_due = True
            if not self._awaiting:
                self._flush()

    def _batches(self) -> list[_Batch]:
        # Starts before acks: an entry's ack is only made once its start was
        # written, so within one write no ack precedes its own start.
        batches = []
        if self._starts:
            self._last_start_write = asyncio.get_running_loop().time()
            if self._gather_timer is not None:
                self._gather_timer.cancel()
                self._gather_timer = None
        for (started, ttl_ms), starts in self._starts.items():
            end, end_replies = self._start_end(started, ttl_ms)
            counts = self._pack_counts(started, [s.entry_id for s in starts])
            packed = b"".join((_MULTI, counts, end))
            replies = 1 + len(starts) + end_replies  # MULTI's, each QUEUED, EXEC's
            batches.append(_Batch(packed, replies, starts=starts))
        # Acks held for company go with a start written anyway: no write of
        # their own.
        if self._acks and (self._acks_due or self._starts):
            for (stream, started, group, delete_acked), acks in self._acks.items():
                ids = [entry_id for entry_id, _ in acks]
                packed = self._pack([ack_command(stream, group, ids, delete_acked)])
                answered = functools.partial(self._forget_later, started, ids)
                batches.append(
                    _Batch(
                        packed, 1, acks=[reply for _, reply in acks], answered=answered
                    )
                )
            self._acks, self._ack_count = {}, 0
            if self._ack_timer is not None:
                self._ack_timer.cancel()
                self._ack_timer = None
        self._starts = {}
        self._acks_due = False
        # Acked counts go in bulk, each HDEL costing the server about what
        # one id's did: at FORGET_BATCH ids, or FORGET_AFTER_S after an ack.
        for started, ids in list(self._acked.items()):
            if self._forget_due or len(ids) >= FORGET_BATCH:
                del self._acked[started]
                packed = self._pack([forget_command(started, ids)])
                batches.append(_Batch(packed, 1))
        self._forget_due = False
        return batches

    def _lone_frame(self, started: str, ttl_ms: int) -> tuple[bytes, bytes, int]:
        """A lone start's transaction packed around its entry id, and how
        many replies it has: built once per (started hash, ttl)."""
        frame = self._lone_frames.get((started, ttl_ms))
        if frame is None:
            end, end_replies = self._start_end(started, ttl_ms)
            head, tail = self._count_frame(started)
            frame = self._lone_frames[(started, ttl_ms)] = (
                _MULTI + head,
                tail + end,
                2 + end_replies,  # MULTI's, the count's QUEUED; the end's
            )
        return frame

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
        head, tail = self._count_frame(started)
        return b"".join(
            b"%s$%d\r\n%s\r\n%s" % (head, len(data), data, tail)
            for data in (entry_id.encode() for entry_id in entry_ids)
        )

    def _count_frame(self, started: str) -> tuple[bytes, bytes]:
        """``count_start_command`` packed around its entry id."""
        around = self._count_frames.get(started)
        if around is None:
            head, _, tail = self._pack([count_start_command(started, "")]).rpartition(
                b"$0\r\n\r\n"
            )
            around = self._count_frames[started] = (head, tail)
        return around

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
            # Never a new connection for this alone (after a shutdown, say):
            # the next write takes them.
            link = self._link
            if not self._awaiting and link is not None and link.alive:
                self._flush()

    def _queued(self) -> bool:
        return bool(self._starts or self._acks_due or self._forget_due)

    def _may_write(self) -> bool:
        """Something queued may go now: acks or forgotten counts due, or
        starts whose time to gather is over (else it is set to end)."""
        if self._acks_due or self._forget_due:
            return True
        if not self._starts:
            return False
        loop = asyncio.get_running_loop()
        wait = self._last_start_write + START_GATHER_S - loop.time()
        if wait <= 0:
            return True
        if self._gather_timer is None:
            self._gather_timer = loop.call_later(wait, self._gathered)
        return False

    def _gathered(self) -> None:
        self._gather_timer = None
        if self._starts and not self._awaiting:
            self._flush()

    # The connection.

    def _flush(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            return  # the connecting task writes what is queued once ready
        link = self._link
        if link is not None and not link.alive:
            # Fails what it owes, then flushes again on a new connection.
            self._link_failed(link, RedisConnectionError("connection lost"))
            return
        if link is None:
            self._connecting = asyncio.create_task(self._connect_and_flush())
            return
        batches = self._batches()
        if batches:
            self._write(link, batches)

    async def _connect_and_flush(self) -> None:
        try:
            link = await self._connected()
        except BaseException as error:
            failure = _as_exception(error)
            for batch in self._batches():
                batch.fail(failure)
            self._wake_idle_waiters()
            if not isinstance(error, Exception):
                raise
            return
        batches = self._batches()
        if batches:
            self._write(link, batches)

    async def _connected(self) -> _Link:
        assert self.pool is not None
        connection = await self.pool.get_connection()
        try:
            transport = connection._writer.transport
            if connection._reader.at_eof() or transport.is_closing():
                raise RedisConnectionError("connection closed as it was handed out")
            # From here its bytes come to _Link (nothing else reads this
            # connection: it was handed out, handshake done, nothing owed).
            link = _Link(self, connection, transport)
            transport.set_protocol(link)
            # A write leaves nothing in asyncio's buffer unless the kernel's
            # is full: then the calls are written at resume_writing.
            transport.set_write_buffer_limits(high=0, low=0)
        except BaseException:
            await self._release(connection)
            raise
        self._link = link
        return link

    def _write(self, link: _Link, batches: list[_Batch]) -> None:
        packed = b"".join([batch.packed for batch in batches])
        transport = link.transport
        failure: Exception | None = None
        try:
            transport.write(packed)
        except Exception as error:
            failure = error
        if failure is None and transport.is_closing():
            # The send failed (the transport closes itself): nothing is sure
            # to be on its way.
            failure = RedisConnectionError("connection lost writing")
        if failure is not None:
            for batch in batches:
                batch.fail(failure)
            self._link_failed(link, failure)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + REPLY_MARGIN_S
        for batch in batches:
            batch.due = due
        self._awaiting.extend(batches)
        if self._deadline is None:
            self._deadline = loop.call_at(due, self._check_deadline)
        if transport.get_write_buffer_size() == 0:
            for batch in batches:
                batch.written()
        else:
            # The kernel's buffer is full: written once it took the rest.
            self._unwritten.extend(batches)

    def _drained(self, link: _Link) -> None:
        if link is self._link and link.transport.get_write_buffer_size() == 0:
            unwritten, self._unwritten = self._unwritten, []
            for batch in unwritten:
                batch.written()

    def _check_deadline(self) -> None:
        """The oldest write owed must have its replies by its due time."""
        self._deadline = None
        if not self._awaiting or self._link is None:
            return
        loop = asyncio.get_running_loop()
        due = self._awaiting[0].due
        if due <= loop.time():
            self._link_failed(
                self._link,
                RedisTimeoutError(f"no reply within {REPLY_MARGIN_S} s"),
            )
            return
        self._deadline = loop.call_at(due, self._check_deadline)

    def _received(self, link: _Link, data: bytes) -> None:
        """Replies as they arrive: each batch settled once whole; once none
        is owed, what queued meanwhile is written."""
        if link is not self._link:
            return
        buffer = link.replies
        buffer.feed(data)
        awaiting = self._awaiting
        partial = self._partial
        while awaiting:
            try:
                whole, reply = buffer.pop()
            except Exception as error:  # a reply this parser cannot read
                self._link_failed(link, error)
                return
            if not whole:
                break
            # An error reply is the server's answer: a value here.
            partial.append(reply)
            batch = awaiting[0]
            if len(partial) < batch.replies:
                continue
            awaiting.popleft()
            batch.outcome(partial)
            self._partial = partial = []
        if not awaiting:
            if not buffer.empty:
                # Bytes nobody asked for: the replies no longer line up.
                self._link_failed(link, RedisConnectionError("unexpected reply"))
            elif self._may_write():
                self._flush()
            elif not self._queued():
                self._wake_idle_waiters()

    def _link_failed(self, link: _Link, error: Exception) -> None:
        """``link`` is dead: every call owed on it fails, its connection goes
        back to the pool disconnected, and what is queued goes on a new one."""
        if link.closed:
            return
        link.closed = True
        if link is self._link:
            self._link = None
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._unwritten = []
            self._partial = []
            while self._awaiting:
                self._awaiting.popleft().fail(error)
        asyncio.get_running_loop().create_task(self._release(link.connection))
        if self._queued() and not self._awaiting:
            self._flush()  # on a new connection
        elif not self._awaiting:
            self._wake_idle_waiters()

    async def _release(self, connection: Any) -> None:
        if connection is not None and self.pool is not None:
            # Disconnected before it goes back: what it still owes is unknown.
            await connection.disconnect(nowait=True)
            await self.pool.release(connection)

    def _wake_idle_waiters(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def settled(self) -> None:
        """Every call written so far answered (or failed), bounded; acked
        counts forgotten."""
        self._acks_due = bool(self._acks)
        self._forget_due = bool(self._acked)
        if self._queued() and not self._awaiting:
            self._flush()
        if self._awaiting or self._queued():
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await asyncio.wait([waiter], timeout=REPLY_MARGIN_S)


def _as_exception(error: BaseException) -> Exception:
    if isinstance(error, Exception):
        return error
    return RuntimeError("the pipelined call was cancelled")


def _fail(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
        # Retrieved here: a call nobody awaits must not log "exception was
        # never retrieved"; its owner logs it.
        future.exception()
