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
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import AckableMessage, TaskiqMiddleware
from taskiq.abc.formatter import TaskiqFormatter

from taskiq_atomic_claim.claim import ClaimOutcome, claim_idle_entries
from taskiq_atomic_claim.in_flight import (
    EntryAwareFormatter,
    EntryData,
    InFlight,
    StartRecorder,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")

_DATA_FIELD = b"data"
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
_MAX_BACKOFF_S = 5.0


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


class _Outage:
    """Capped exponential backoff, logged once per outage, not per attempt."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.started: float | None = None
        self.delay = 0.05

    async def failed(self, error: BaseException) -> None:
        if self.started is None:
            self.started = time.monotonic()
            logger.warning("%s: Redis unreachable, retrying: %s", self.what, error)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, _MAX_BACKOFF_S)

    def succeeded(self) -> None:
        if self.started is not None:
            logger.warning(
                "%s: Redis reachable again after %.1f s",
                self.what,
                time.monotonic() - self.started,
            )
            self.started, self.delay = None, 0.05


class ReclaimingListener:
    """Mixin for a taskiq-redis stream broker; see ``AtomicRedisStreamBroker``."""

    # Provided by the taskiq-redis parent class.
    queue_name: str
    consumer_group_name: str
    consumer_name: str
    additional_streams: dict[str, str | int]
    block: int
    count: int | None
    if TYPE_CHECKING:  # at run time the parent's methods must win the MRO
        formatter: TaskiqFormatter
        middlewares: list[TaskiqMiddleware]

        def add_middlewares(self, *middlewares: TaskiqMiddleware) -> None: ...

        async def _declare_consumer_group(self) -> None: ...

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
        self._heartbeat: asyncio.Task[None] | None = None
        self._claim_error: Exception | None = None

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    @property
    def streams(self) -> list[str]:
        return [self.queue_name, *self.additional_streams]

    async def claim(self, client: Any, stream: str) -> ClaimOutcome:
        """One claim cycle for one stream: one script call, one round trip."""
        keys = StreamKeys(stream, self.consumer_group_name)
        outcome = await claim_idle_entries(
            self.scripts, client, keys, self.consumer_name, self.claim_settings
        )
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
        return outcome

    async def listen(self) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and, every claim interval, reclaimed ones."""
        self._track_starts()
        self._start_heartbeat()
        interval = self.claim_settings.claim_interval / 1000
        read_from = {self.queue_name: ">", **self.additional_streams}
        next_claim = time.monotonic()
        outage = _Outage(f"consumer {self.consumer_name}")
        group_missing = False
        async with self._connection() as client:
            while True:
                _raise_if_cancel_was_swallowed()
                batch: list[tuple[str, str, dict[Any, Any]]] = []
                try:
                    self._raise_deferred_claim_error()
                    if group_missing:
                        await self._declare_consumer_group()
                        group_missing = False
                    if time.monotonic() >= next_claim:
                        next_claim = time.monotonic() + interval
                        batch = await self._claim_all(client)
                    if not batch:
                        batch = await self._read_new(client, read_from, next_claim)
                except _UNREACHABLE as error:
                    await outage.failed(error)
                    continue
                except ResponseError as error:
                    demoted = isinstance(error, ReadOnlyError) or str(error).startswith(
                        "UNBLOCKED"
                    )
                    if demoted:
                        # The server became a replica (under a blocked read,
                        # or before this call): wait for a primary again.
                        await outage.failed(error)
                        continue
                    if "NOGROUP" not in str(error):
                        raise
                    # Server restarted empty or the group was deleted.
                    logger.warning(
                        "Consumer group %r is gone (%s); recreating it",
                        self.consumer_group_name,
                        error,
                    )
                    group_missing = True
                    continue
                outage.succeeded()
                for stream, entry_id, _ in batch:
                    self.in_flight.add(stream, [entry_id])
                for stream, entry_id, fields in batch:
                    try:
                        message = await self._deliverable(
                            client, stream, entry_id, fields
                        )
                    except _UNREACHABLE as error:
                        # Dead-lettering failed: left pending and unheartbeated,
                        # it is reclaimed and tried again.
                        self.in_flight.discard(stream, entry_id)
                        await outage.failed(error)
                        continue
                    if message is not None:
                        self.in_flight.mark_yielded(stream, entry_id)
                        yield message

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

    async def _claim_all(self, client: Any) -> list[tuple[str, str, dict[Any, Any]]]:
        """Claim on every stream. A stream whose claim fails does not drop
        what earlier streams' claims took (those entries are this consumer's
        now): they are delivered, and the error is raised afterwards."""
        batch: list[tuple[str, str, dict[Any, Any]]] = []
        for stream in self.streams:
            try:
                outcome = await self.claim(client, stream)
            except Exception as error:
                if not batch:
                    raise
                self._claim_error = error
                break
            batch += [(stream, e.id, e.fields) for e in outcome.entries]
        return batch

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
        return [
            (_text(stream), _text(entry_id), fields)
            for stream, entries in fetched or []
            for entry_id, fields in entries
        ]

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
            # A dropped connection must not fail the ack outright; if the
            # server stays away, stop heartbeating the entry either way so
            # another worker reclaims it (at least once, never stuck).
            give_up = time.monotonic() + min(
                self.claim_settings.idle_timeout / 2000, 30
            )
            delay = 0.05
            try:
                while True:
                    try:
                        await ack()
                        return
                    except _UNREACHABLE:
                        if time.monotonic() + delay > give_up:
                            raise
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 1.0)
            finally:
                self.in_flight.discard(stream, entry_id)

        return ack_and_forget

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
        outage = _Outage(f"heartbeat {self.consumer_name}")
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            _raise_if_cancel_was_swallowed()
            try:
                async with self._connection() as client:
                    await self.in_flight.beat(client)
            except _UNREACHABLE as error:
                await outage.failed(error)
            else:
                outage.succeeded()

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
