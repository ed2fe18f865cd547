"""The listen loop every atomic broker shares: read, reclaim, heartbeat, hand back.

A broker class mixes this in before its taskiq-redis parent and says how to
get a client (``_connection``). Everything that talks to the server goes
through the scripts in ``lua/`` or plain stream commands, so the same loop
serves a standalone server, Sentinel and Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import AckableMessage, TaskiqMiddleware
from taskiq.abc.formatter import TaskiqFormatter

from taskiq_atomic_claim.backoff import MAX_DELAY_S, Backoff
from taskiq_atomic_claim.claim import ClaimOutcome, claim_streams
from taskiq_atomic_claim.durability import warn_about_durability
from taskiq_atomic_claim.group_recovery import GroupPositions, recreate_group
from taskiq_atomic_claim.in_flight import (
    SCRIPT_BATCH,
    EntryAwareFormatter,
    EntryData,
    InFlight,
    StartRecorder,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import Fault, classify, is_outage
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")

_DATA_FIELD = b"data"
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# No reply within this (beyond a read's own block) means the connection is
# dead, e.g. half-open after a host vanished: without a socket_timeout
# redis-py would wait for ever. Generous, as a busy server stalls for seconds.
REPLY_MARGIN_S = 5.0

_T = TypeVar("_T")
# A worker holding nothing still claims this many at once (if its settings
# allow): holding more than it runs waits for it, not the fleet.
MIN_CLAIM = 10


async def within(seconds: float, awaitable: Awaitable[_T]) -> _T:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` after ``seconds``.

    Runs in the calling task where Python allows (3.11+): ``wait_for``'s
    extra task was seen to leave killed pool connections to the next caller.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _raise_if_cancel_was_swallowed() -> None:
    """Honour a cancel that a redis-py call swallowed (seen on Python 3.11).

    The call then returns normally and a loop would run on forever, so
    whoever cancelled it (taskiq's receiver at shutdown, ``wait_for``) hangs.
    ``Task.cancelling()`` still counts the request.
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


class StreamTypeError(RuntimeError):
    """A key the broker must read as a stream holds another type (WRONGTYPE)."""


class ReclaimingListener:
    """Mixin for a taskiq-redis stream broker; see ``AtomicRedisStreamBroker``."""

    # Provided by the taskiq-redis parent class.
    queue_name: str
    consumer_group_name: str
    consumer_name: str
    additional_streams: dict[str, str | int]
    block: int
    count: int | None
    mkstream: bool
    if TYPE_CHECKING:  # at run time the parent's methods must win the MRO
        formatter: TaskiqFormatter
        middlewares: list[TaskiqMiddleware]

        def add_middlewares(self, *middlewares: TaskiqMiddleware) -> None: ...

    claim_settings: ClaimSettings
    scripts: ScriptRunner

    def _init_reclaim(self, claim_settings: ClaimSettings) -> None:
        self.claim_settings = claim_settings
        self.claim_interval = claim_settings.claim_interval
        self.metrics = ReclaimMetrics()
        self.scripts = ScriptRunner(
            on_reload=lambda: self.metrics.add("script_reloads", "*")
        )
        # Delivered to this consumer and not yet acked: what the heartbeat
        # keeps from being reclaimed, and what shutdown hands back.
        self.in_flight = InFlight(
            self.scripts,
            self.consumer_group_name,
            self.consumer_name,
            claim_settings,
            self.metrics,
        )
        self.group_positions = GroupPositions()
        self._heartbeat: asyncio.Task[None] | None = None
        self._claim_error: Exception | None = None
        # Per stream: when (monotonic s) this consumer claims on it next.
        self._claim_due: dict[str, float] = {}
        # Shared by every ack: one outage, one log line, however many acks.
        self._ack_backoff = Backoff(
            f"acks of consumer {self.consumer_name}",
            cap=1.0,
            consequence=f"an ack still failing after {self._ack_patience:.1f} s"
            " is dropped and its task runs again once reclaimed",
        )

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    @property
    def streams(self) -> list[str]:
        return [self.queue_name, *self.additional_streams]

    async def claim(self, client: Any, stream: str) -> ClaimOutcome:
        """One claim cycle for one stream: one script call, one round trip."""
        (outcome,) = await self.claim_streams(client, [stream])
        return outcome

    async def claim_streams(
        self, client: Any, streams: list[str]
    ) -> list[ClaimOutcome]:
        """One claim cycle on each of ``streams`` in one script call. A batch
        is at most what one read takes (``xread_count``) and what this worker
        already runs (at least ``MIN_CLAIM``): it claims no more than it
        starts soon, so a backlog spreads over the fleet."""
        count = max(MIN_CLAIM, len(self.in_flight))
        count = min(count, self.claim_settings.batch_size, self.count or count)
        outcomes = await claim_streams(
            self.scripts,
            client,
            [StreamKeys(stream, self.consumer_group_name) for stream in streams],
            self.consumer_name,
            self.claim_settings,
            [count] * len(streams),
        )
        for stream, outcome in zip(streams, outcomes, strict=True):
            self._record(stream, outcome)
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            # Entries other streams gave are this consumer's now: deliver
            # them first, raise after (see _claim_all).
            if not any(outcome.entries for outcome in outcomes):
                raise failed[0]
            self._claim_error = failed[0]
        return outcomes

    def _record(self, stream: str, outcome: ClaimOutcome) -> None:
        keys = StreamKeys(stream, self.consumer_group_name)
        if outcome.skipped:
            self.metrics.add("lease_skips", stream)
        self.metrics.add("claimed", stream, len(outcome.entries))
        self.metrics.add("trimmed", stream, len(outcome.trimmed))
        self.metrics.add("dead_lettered", stream, len(outcome.dead_lettered))
        if outcome.trimmed:
            logger.warning(
                "%d pending entries of stream %r were trimmed before anyone acked"
                " them; their tasks are lost: %s",
                len(outcome.trimmed),
                stream,
                ", ".join(outcome.trimmed),
            )
        if outcome.dead_lettered:
            logger.error(
                "%d entries of stream %r started %d times in workers that died"
                " running them and were moved to dead letters %r: %s",
                len(outcome.dead_lettered),
                stream,
                self.claim_settings.max_deliveries,
                keys.dead_letters,
                ", ".join(outcome.dead_lettered),
            )
        if outcome.entries:
            logger.debug(
                "Reclaimed %d idle entries from stream %r", len(outcome.entries), stream
            )

    async def listen(self) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and, every claim interval, reclaimed ones."""
        self._track_starts()
        self._start_heartbeat()
        read_from = {self.queue_name: ">", **self.additional_streams}
        self._claim_due = dict.fromkeys(self.streams, time.monotonic())
        # After a full claim batch, read new messages before claiming again:
        # they keep flowing while a backlog drains.
        read_turn = False
        outage = Backoff(f"consumer {self.consumer_name}")
        recreate_group = False  # before the next call
        group_gone = False  # NOGROUP since the last call that worked
        # Under OOM claims are refused while reads work: such an outage
        # lasts until a claim works again, not until the next read.
        claim_refused = claiming = False
        async with self._connection() as client:
            while True:
                _raise_if_cancel_was_swallowed()
                batch: list[tuple[str, str, dict[Any, Any]]] = []
                try:
                    self._raise_deferred_claim_error()
                    if recreate_group:
                        await self.recreate_groups(client)
                        recreate_group = False
                    due = self._due_streams()
                    if due and not read_turn:
                        claiming = True
                        batch = await within(
                            REPLY_MARGIN_S * len(due), self._claim_all(client, due)
                        )
                        claiming = claim_refused = False
                        read_turn = bool(batch)
                    if not batch:
                        # The read blocks until the next claim at most.
                        read_turn = False
                        batch = await within(
                            max(0.0, self._next_claim - time.monotonic())
                            + REPLY_MARGIN_S,
                            self._read_new(client, read_from, self._next_claim),
                        )
                except Exception as error:
                    refused = classify(error) is Fault.REFUSING
                    claim_refused = claim_refused or (claiming and refused)
                    claiming = False
                    if await self._wait_out(client, error, outage, group_gone):
                        group_gone = recreate_group = True
                    continue
                if not claim_refused:
                    outage.succeeded()
                group_gone = False
                for stream, entry_id, _ in batch:
                    self.in_flight.add(stream, [entry_id])
                for stream, entry_id, fields in batch:
                    try:
                        message = await self._deliverable(
                            client, stream, entry_id, fields
                        )
                    except Exception as error:
                        if not is_outage(error):
                            raise
                        # Dead-lettering failed: left pending and unheartbeated,
                        # it is reclaimed and tried again.
                        self.in_flight.discard(stream, entry_id)
                        await outage.wait(error)
                        continue
                    if message is not None:
                        self.in_flight.mark_yielded(stream, entry_id)
                        yield message

    async def _wait_out(
        self, client: Any, error: Exception, outage: Backoff, group_gone: bool
    ) -> bool:
        """After a failed call of listen(): wait as the fault needs, raise a
        usage error. True when the consumer group is gone."""
        pool = getattr(client, "connection_pool", None)
        if isinstance(error, asyncio.TimeoutError | RedisTimeoutError) and pool:
            # No reply within our bound: the connection was half-open, and
            # the idle ones in the pool most likely are too. Without this
            # the retries would find them one bound at a time.
            await pool.disconnect(inuse_connections=False)
        fault = classify(error)
        if fault is Fault.GROUP_MISSING:
            if group_gone:
                # Recreating it did not help (say mkstream=False and no
                # stream): no spinning, no log flood.
                await asyncio.sleep(outage.next_delay())
            else:
                # Server restarted empty or the group was deleted.
                logger.warning(
                    "Consumer group %r is gone (%s); recreating it",
                    self.consumer_group_name,
                    error,
                )
            return True
        if not fault.is_outage:
            raise error
        # Unreachable, demoted (a failover, REPLICAOF) or refusing for now
        # (OOM, LOADING, BUSY, ...): wait for it to pass.
        await outage.wait(error)
        return False

    def _track_starts(self) -> None:
        """Learn which entry each task comes from and when it starts: wrap
        the formatter and add the middleware (once, on the worker side, after
        the app configured both)."""
        if not isinstance(self.formatter, EntryAwareFormatter):
            self.formatter = EntryAwareFormatter(self.formatter, self.in_flight)
        if not any(isinstance(m, StartRecorder) for m in self.middlewares):
            self.add_middlewares(StartRecorder(self.in_flight, self._connection))

    def _raise_deferred_claim_error(self) -> None:
        """A claim that failed after other streams' claims took entries is
        raised once those are delivered, to be handled as any failed call."""
        error, self._claim_error = self._claim_error, None
        if error is not None:
            raise error

    async def _claim_all(
        self, client: Any, streams: list[str] | None = None
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """Claim on ``streams`` (all by default), as few calls as the
        topology allows, and schedule each stream's next claim: at once
        after a full batch, past the lease another consumer holds, else one
        claim interval on. A call that fails does not drop what earlier calls
        took (those entries are this consumer's now): they are delivered,
        and the error is raised afterwards."""
        interval = self.claim_settings.claim_interval / 1000
        streams = self.streams if streams is None else streams
        started = time.monotonic()
        self._claim_due.update(dict.fromkeys(streams, started + interval))
        batch: list[tuple[str, str, dict[Any, Any]]] = []
        for group in self._claim_groups(streams):
            try:
                outcomes = await self.claim_streams(client, group)
            except Exception as error:
                if not batch:
                    raise
                self._claim_error = error
                break
            for stream, outcome in zip(group, outcomes, strict=True):
                batch += [(stream, e.id, e.fields) for e in outcome.entries]
                if outcome.full or outcome.next_cursor != "0-0":
                    # A backlog, or a scan cut short at 10 x COUNT: go on.
                    self._claim_due[stream] = started
                elif outcome.lease_ttl_ms is not None:
                    wait = outcome.lease_ttl_ms + self.claim_settings.skip_wait
                    self._claim_due[stream] = started + wait / 1000
        return batch

    @property
    def _next_claim(self) -> float:
        return min(self._claim_due.values())

    def _due_streams(self) -> list[str]:
        now = time.monotonic()
        return [stream for stream, at in self._claim_due.items() if at <= now]

    def _claim_groups(self, streams: list[str]) -> list[list[str]]:
        """Streams that one script call can claim together."""
        return [streams]

    async def _read_new(
        self, client: Any, read_from: dict[str, Any], next_claim: float
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        # Never block past the next claim: reclaim must not wait for traffic.
        until = max(1, int((next_claim - time.monotonic()) * 1000))
        block = min(self.block, until) if self.block else until
        fetched: Any = await client.xreadgroup(
            self.consumer_group_name,
            self.consumer_name,
            read_from,
            block=block,
            count=self.count,
        )
        batch = [
            (_text(stream), _text(entry_id), fields)
            for stream, entries in fetched or []
            for entry_id, fields in entries
        ]
        for stream, entry_id, _ in batch:
            self.group_positions.advance(stream, entry_id)
        return batch

    async def recreate_groups(self, client: Any) -> None:
        """Re-create the consumer group on every stream that lost it, never
        after entries it holds (see ``group_recovery``)."""
        for stream in self.streams:
            try:
                start = await recreate_group(
                    client,
                    stream,
                    self.consumer_group_name,
                    self.group_positions.get(stream),
                    self.mkstream,
                )
            except ResponseError as error:  # e.g. mkstream=False, stream gone
                logger.debug("Group on %r not re-created: %s", stream, error)
                continue
            if start is not None:
                logger.warning(
                    "Re-created consumer group %r on stream %r at id %s",
                    self.consumer_group_name,
                    stream,
                    start,
                )

    def _servers(self, client: Any) -> list[tuple[str, Any]]:
        """The servers behind ``client``, each with a name for the log."""
        return [(f"server of queue {self.queue_name!r}", client)]

    async def check_durability(self) -> None:
        """Startup: remember where the groups are, and warn about server
        settings that lose tasks. Never fails the start."""
        try:
            async with self._connection() as client:
                await self.group_positions.learn(
                    client, self.streams, self.consumer_group_name
                )
                for where, server in self._servers(client):
                    await warn_about_durability(server, where)
        except _UNREACHABLE as error:
            logger.debug("Durability not checked at start-up: %s", error)

    async def _deliverable(
        self, client: Any, stream: str, entry_id: str, fields: dict[Any, Any]
    ) -> AckableMessage | None:
        """The entry as a message; None if this consumer no longer holds it
        (handed back, or taken by another consumer), or once an entry taskiq
        cannot run (no ``data`` field: written by something else) is moved to
        dead letters."""
        if not self.in_flight.holds(stream, entry_id):
            return None
        data = fields.get(_DATA_FIELD, fields.get(_DATA_FIELD.decode()))
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes):
            delivery = self.in_flight.get(stream, entry_id)
            assert delivery is not None  # held: checked above
            reason = f"no {_DATA_FIELD.decode()} field"
            await self.in_flight.dead_letter(client, delivery, reason)
            return None
        return AckableMessage(
            data=EntryData(data, stream, entry_id),
            ack=self._tracked_ack(stream, entry_id),
        )

    def _ack_once(self, stream: str, entry_id: str) -> Callable[[], Awaitable[None]]:
        """XACK and forget the entry's start count in one round trip; an
        entry taskiq could not parse goes to dead letters instead."""

        async def ack() -> None:
            delivery = self.in_flight.get(stream, entry_id)
            async with self._connection() as client:
                if delivery is not None and delivery.unparsable is not None:
                    await self.in_flight.dead_letter(
                        client, delivery, delivery.unparsable
                    )
                    return
                keys = StreamKeys(stream, self.consumer_group_name)
                await self.scripts.call(
                    client,
                    "ack",
                    [stream, keys.started],
                    [self.consumer_group_name, entry_id],
                )

        return ack

    def _tracked_ack(self, stream: str, entry_id: str) -> Callable[[], Awaitable[None]]:
        ack = self._ack_once(stream, entry_id)

        async def ack_and_forget() -> None:
            # An outage must not fail the ack outright; if the server stays
            # away, stop heartbeating the entry either way so another worker
            # reclaims it (at least once, never stuck). Never raise then:
            # taskiq runs acks in tasks nobody awaits, so an exception is a
            # "Task exception was never retrieved" traceback per ack, and the
            # outage's one log line already said what happens.
            give_up = time.monotonic() + self._ack_patience
            try:
                while True:
                    try:
                        await within(REPLY_MARGIN_S, ack())
                    except Exception as error:
                        if not is_outage(error):
                            raise
                        delay = self._ack_backoff.failed(error)
                        if time.monotonic() + delay > give_up:
                            return
                        await asyncio.sleep(delay)
                    else:
                        self._ack_backoff.succeeded()
                        return
            finally:
                self.in_flight.discard(stream, entry_id)

        return ack_and_forget

    @property
    def _ack_patience(self) -> float:
        """Seconds an ack keeps retrying: well before the entry, no longer
        heartbeated, becomes claimable."""
        return min(self.claim_settings.idle_timeout / 2000, 30)

    async def check_stream_types(self) -> None:
        """Fail at startup, naming the key, if a stream key holds another type."""
        async with self._connection() as client:
            for stream in self.streams:
                kind = _text(await client.type(stream))
                if kind not in ("stream", "none"):
                    raise StreamTypeError(
                        f"key {stream!r} holds a {kind}, not a stream: pick another"
                        " queue_name / additional_streams key or remove that key"
                    )

    # In-flight heartbeats.

    @property
    def heartbeat_interval(self) -> float:
        """Seconds: three heartbeats fit in one idle_timeout."""
        return self.claim_settings.idle_timeout / 3000

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.create_task(
                self._heartbeat_loop(), name=f"heartbeat {self.consumer_name}"
            )

    async def _heartbeat_loop(self) -> None:
        # A task of its own, not part of listen(): while every slot is busy
        # the receiver stops pulling from listen(), and that is exactly when
        # long tasks need their heartbeat.
        #
        # It must never die: a dead heartbeat lets every long task be
        # reclaimed and run twice. So every error is retried, usage errors
        # too (logged as such). Retries come faster than beats, so entries
        # unheartbeated through an outage are refreshed soon after it ends.
        beat = self.heartbeat_interval
        outage = Backoff(
            f"heartbeat {self.consumer_name}", cap=min(MAX_DELAY_S, beat / 3)
        )
        delay = beat
        while True:
            await asyncio.sleep(delay)
            _raise_if_cancel_was_swallowed()
            try:
                async with self._connection() as client:
                    await within(
                        REPLY_MARGIN_S * self._beat_calls, self.in_flight.beat(client)
                    )
            except Exception as error:
                delay = outage.failed(error)
            else:
                outage.succeeded()
                delay = beat

    @property
    def _beat_calls(self) -> int:
        """Script calls one heartbeat makes, at least one."""
        return max(
            1,
            sum(
                -(-len(self.in_flight[stream]) // SCRIPT_BATCH)
                for stream in self.in_flight.streams()
            ),
        )

    async def set_idle(self, client: Any, idle_ms: int) -> None:
        """Set the idle time of every in-flight entry this consumer still owns."""
        await self.in_flight.set_idle(client, idle_ms, self.in_flight.deliveries())

    async def stop_heartbeat(self) -> None:
        task, self._heartbeat = self._heartbeat, None
        if task is None:
            return
        # A cancel that lands inside a redis-py call can be swallowed there
        # (the call returns normally, the loop sleeps on): cancel until the
        # task is gone, or shutdown waits forever. Bounded: a beat is short.
        for _ in range(100):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                break
        if task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def hand_back(self) -> int:
        """Make every unacked delivery claimable at once (graceful shutdown).

        taskiq drops deliveries it prefetched but never started; without this
        they would wait out idle_timeout in the PEL.
        """
        await self.stop_heartbeat()
        held = len(self.in_flight)
        if not held:
            return 0
        try:
            async with self._connection() as client:
                handed = await self.in_flight.hand_back(client)
        except _UNREACHABLE as error:
            logger.warning("Could not hand back %d entries: %s", held, error)
            return 0
        logger.info("Handed back %d unacked deliveries", handed)
        return handed
