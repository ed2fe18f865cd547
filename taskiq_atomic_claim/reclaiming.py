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
from taskiq.message import BrokerMessage

from taskiq_atomic_claim.backoff import MAX_DELAY_S, Backoff
from taskiq_atomic_claim.claim import ClaimOutcome, claim_idle_entries
from taskiq_atomic_claim.dead_letters import move_to_dead_letters
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
from taskiq_atomic_claim.server_info import LUA_CLAIM, NATIVE_CLAIM, ServerInfo
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")

_DATA_FIELD = b"data"
_MAX_DELIVERIES_EXCEEDED = "max_deliveries exceeded"
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# No reply within this (beyond a read's own block) means the connection is
# dead, e.g. half-open after a host vanished: without a socket_timeout
# redis-py would wait for ever. Generous, as a busy server stalls for seconds.
REPLY_MARGIN_S = 5.0

_T = TypeVar("_T")


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
    maxlen: int | None
    approximate: bool
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
        # What the server can do, once read (startup, or the first read).
        self.server: ServerInfo | None = None
        # Where reads reclaim: when drop_trimmed runs next, and where in
        # each stream's PEL it goes on.
        self._next_sweep = time.monotonic() + claim_settings.idle_timeout / 1000
        self._sweep_from: dict[str, str] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self._claim_error: Exception | None = None
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
        keys = StreamKeys(stream, self.consumer_group_name)
        outcome = await claim_idle_entries(
            self.scripts, client, keys, self.consumer_name, self.claim_settings
        )
        if outcome.skipped:
            self.metrics.add("lease_skips", stream)
        self.metrics.add("claimed", stream, len(outcome.entries))
        self.metrics.add("dead_lettered", stream, len(outcome.dead_lettered))
        self._report_trimmed(stream, outcome.trimmed)
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

    async def learn_server(self, client: Any) -> ServerInfo:
        """What the server is and can do; INFO once per runner."""
        self.server = await self.scripts.server(client)
        return self.server

    def _reads_reclaim(self, server: ServerInfo) -> bool:
        """Whether reads reclaim (XREADGROUP ... CLAIM). The server ignores
        CLAIM for a stream read from an explicit id, so every stream must be
        read from ``>``; else the Lua claim serves them all."""
        return server.native_claim and all(
            start == ">" for start in self.additional_streams.values()
        )

    @property
    def reclaim_path(self) -> str:
        """What reclaims here: the read itself or the Lua claim script."""
        native = self.server is not None and self._reads_reclaim(self.server)
        return NATIVE_CLAIM if native else LUA_CLAIM

    @property
    def trimming_policy(self) -> str:
        """What bounds the streams here (maxlen trimming, acks deleting)."""
        server = self.server or ServerInfo("Redis", "unknown")
        policy = server.trimming_policy
        if self.claim_settings.delete_acked:
            policy += "; XACKDEL ACKED on ack"
        return policy

    async def check_server_features(self) -> None:
        """Startup: refuse, naming the server, what it cannot do."""
        if not self.claim_settings.delete_acked:
            return
        async with self._connection() as client:
            server = await self.learn_server(client)
        server.require_acked_deletion()

    async def kick(self, message: BrokerMessage) -> None:
        """As the parent; with ``maxlen`` on Redis >= 8.2 the trimming is
        ``ACKED``, so it never drops an entry a group has not acked."""
        if self.maxlen is None:
            await super().kick(message)  # type: ignore[misc]
            return
        queue_name = message.labels.get("queue_name") or self.queue_name
        trim: list[Any] = ["MAXLEN", "~" if self.approximate else "=", self.maxlen]
        async with self._connection() as client:
            if (await self.learn_server(client)).acked_trimming:
                trim.append("ACKED")
            await client.execute_command(
                "XADD", queue_name, *trim, "*", _DATA_FIELD, message.message
            )

    def _report_trimmed(self, stream: str, trimmed: list[str]) -> None:
        self.metrics.add("trimmed", stream, len(trimmed))
        if trimmed:
            logger.warning(
                "%d pending entries of stream %r were trimmed before anyone acked"
                " them; their tasks are lost: %s",
                len(trimmed),
                stream,
                ", ".join(trimmed),
            )

    async def drop_trimmed(self, client: Any) -> None:
        """Where reads reclaim: remove from the PEL entries deleted from the
        stream while pending (CLAIM skips them, so nothing else would), and
        report them as the claim does. Each stream's PEL is walked a batch per
        call, from where the last call stopped (kept here, not in a key)."""
        for stream in self.streams:
            keys = StreamKeys(stream, self.consumer_group_name)
            next_start, trimmed = await self.scripts.call(
                client,
                "drop_trimmed",
                [stream, keys.started],
                [
                    self.consumer_group_name,
                    self.claim_settings.idle_timeout,
                    self.claim_settings.batch_size,
                    self._sweep_from.get(stream, "-"),
                ],
            )
            self._sweep_from[stream] = _text(next_start)
            self._report_trimmed(stream, [_text(entry_id) for entry_id in trimmed])

    async def listen(self) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and reclaimed ones: reclaimed by the reads
        themselves on Redis >= 8.4, else by the claim script every claim
        interval."""
        self._track_starts()
        self._start_heartbeat()
        interval = self.claim_settings.claim_interval / 1000
        read_from = {self.queue_name: ">", **self.additional_streams}
        next_claim = time.monotonic()
        # Chosen once per connection, at its first call that works.
        reads_reclaim: bool | None = None
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
                    reads_reclaim = (
                        await self._choose_path(client)
                        if reads_reclaim is None
                        else reads_reclaim
                    )
                    # Where reads reclaim, no claim call runs at all.
                    if not reads_reclaim and time.monotonic() >= next_claim:
                        next_claim = time.monotonic() + interval
                        claiming = True
                        batch = await within(
                            REPLY_MARGIN_S * len(self.streams),
                            self._claim_all(client),
                        )
                        claiming = claim_refused = False
                    if not batch:
                        batch, next_claim = await self._read_once(
                            client, read_from, next_claim, interval, reads_reclaim
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

    async def _choose_path(self, client: Any) -> bool:
        """Whether this connection's reads reclaim; logged once."""
        server = await self.learn_server(client)
        logger.info(
            "Consumer %s on %s reclaims via %s",
            self.consumer_name,
            server.name,
            self.reclaim_path,
        )
        return self._reads_reclaim(server)

    async def _read_once(
        self,
        client: Any,
        read_from: dict[str, Any],
        next_claim: float,
        interval: float,
        reclaiming: bool,
    ) -> tuple[list[tuple[str, str, dict[Any, Any]]], float]:
        """One read, blocking until the next claim at most; returns the batch
        and the next claim's time. A read that reclaims itself still returns
        once per claim interval, for the loop's upkeep (e.g. following a
        Sentinel master), which is then due."""
        if reclaiming and time.monotonic() >= next_claim:
            next_claim = time.monotonic() + interval
            await self.before_reads(client)
            if time.monotonic() >= self._next_sweep:
                # Rare: trimmed pending entries only come from XDEL, XTRIM
                # or a producer trimming without ACKED.
                self._next_sweep = next_claim + self.claim_settings.idle_timeout / 1000
                try:
                    await self.drop_trimmed(client)
                except Exception as error:
                    # Refused (e.g. OOM refuses scripts, not reads) or
                    # unreachable: the reads go on, or report it themselves.
                    if not is_outage(error):
                        raise
                    logger.debug("Sweep for trimmed entries failed: %s", error)
                    self._next_sweep = next_claim
        batch = await within(
            max(0.0, next_claim - time.monotonic()) + REPLY_MARGIN_S,
            self._read_new(client, read_from, next_claim, claim=reclaiming),
        )
        return batch, next_claim

    async def before_reads(self, client: Any) -> None:
        """Once per claim interval where reads reclaim (no claim call runs)."""

    async def _read_new(
        self,
        client: Any,
        read_from: dict[str, Any],
        next_claim: float,
        *,
        claim: bool = False,
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """New entries; with ``claim`` (Redis >= 8.4) idle pending entries
        first, taken over by the read itself."""
        # Never block past the next claim: reclaim must not wait for traffic.
        until = max(1, int((next_claim - time.monotonic()) * 1000))
        block = min(self.block, until) if self.block else until
        idle = self.claim_settings.idle_timeout
        extra = {"claim_min_idle_time": idle} if claim else {}
        fetched: Any = await client.xreadgroup(
            self.consumer_group_name,
            self.consumer_name,
            read_from,
            block=block,
            count=self.count,
            **extra,
        )
        read = read_entries(fetched)
        for stream, entry_id, _, _ in read:
            self.group_positions.advance(stream, entry_id)
        if claim:
            return await self._screen_reclaimed(client, read)
        return [(stream, entry_id, fields) for stream, entry_id, fields, _ in read]

    async def _screen_reclaimed(
        self, client: Any, read: list[tuple[str, str, dict[Any, Any], bool]]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """What a claiming read returned, minus the reclaimed entries whose
        task started max_deliveries times in workers that died (moved to
        dead letters, as the Lua claim does): one HMGET per stream that had
        reclaimed entries."""
        reclaimed: dict[str, list[str]] = {}
        for stream, entry_id, _, maybe_reclaimed in read:
            if maybe_reclaimed:
                reclaimed.setdefault(stream, []).append(entry_id)
        poisoned: set[tuple[str, str]] = set()
        max_deliveries = self.claim_settings.max_deliveries
        for stream, ids in reclaimed.items():
            self.metrics.add("claimed", stream, len(ids))
            logger.debug("Reclaimed %d idle entries from stream %r", len(ids), stream)
            if not max_deliveries:
                continue
            keys = StreamKeys(stream, self.consumer_group_name)
            counts = await client.execute_command("HMGET", keys.started, *ids)
            for entry_id, count in zip(ids, counts, strict=True):
                if count is not None and int(count) >= max_deliveries:
                    # Recorded as the Lua claim does: the crashes that counted.
                    await move_to_dead_letters(
                        self.scripts,
                        client,
                        keys,
                        entry_id,
                        _MAX_DELIVERIES_EXCEEDED,
                        deliveries=int(count),
                    )
                    poisoned.add((stream, entry_id))
                    self.metrics.add("dead_lettered", stream)
                    logger.error(
                        "Entry %s of stream %r started %d times in workers that"
                        " died running it and was moved to dead letters %r",
                        entry_id,
                        stream,
                        max_deliveries,
                        keys.dead_letters,
                    )
        return [
            (stream, entry_id, fields)
            for stream, entry_id, fields, _ in read
            if (stream, entry_id) not in poisoned
        ]

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
                    [
                        self.consumer_group_name,
                        entry_id,
                        int(self.claim_settings.delete_acked),
                    ],
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


def read_entries(fetched: Any) -> list[tuple[str, str, dict[Any, Any], bool]]:
    """An XREADGROUP reply as (stream, id, fields, maybe reclaimed), whatever
    its shape: RESP2 pairs or a RESP3 map (which redis-py wraps in one more
    list), entries of (id, fields) or, read with CLAIM, (id, fields, idle ms,
    delivery count), where new entries carry 0, 0. An entry without those
    two (a redis-py that drops them) counts as maybe reclaimed."""
    pairs = fetched.items() if isinstance(fetched, dict) else fetched or []
    read = []
    for stream, listed in pairs:
        entries = listed
        if listed and isinstance(listed[0], list) and _is_entry_list(listed[0]):
            entries = listed[0]
        for entry in entries:
            fields = entry[1] if len(entry) > 1 else None
            if not isinstance(fields, dict):
                flat = list(fields or [])
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
            reclaimed = len(entry) < 4 or int(entry[2]) > 0 or int(entry[3]) > 0
            read.append((_text(stream), _text(entry[0]), fields, reclaimed))
    return read


def _is_entry_list(value: list[Any]) -> bool:
    """A list of entries (each a list or tuple), not one entry (id first)."""
    return not value or isinstance(value[0], list | tuple)
