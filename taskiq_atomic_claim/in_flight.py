"""What one consumer holds: entries delivered to it and not yet acked.

An entry passes through these states in a worker:

- read (XREADGROUP or a claim): held, heartbeated, not yet handed to taskiq;
- yielded: handed to taskiq's receiver by ``listen()``;
- loaded: the receiver's callback parsed its data (the formatter saw it);
- started: about to run; the start is recorded on the server (``task_records``)
  so that a worker dying now counts toward ``max_deliveries``;
- acked: forgotten here and on the server (``task_records``).

The broker learns "loaded" and "started" from what taskiq does anyway: the
receiver calls ``broker.formatter.loads(message.data)`` and then every
middleware's ``pre_execute`` in the callback's own asyncio task, before the
task runs. ``EntryData`` is the message data carrying its entry, so the
formatter wrapper can tie that callback task to the entry.

What is held but not running never stays held for ever: an entry the
receiver dropped (its callback ended without an ack) goes to dead letters; an
entry not handed to taskiq within ``3 * idle_timeout`` is handed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from taskiq_atomic_claim.dead_letter_results import DeadLetterResults
from taskiq_atomic_claim.dead_letters import DeadLettering, bounded_reason
from taskiq_atomic_claim.delivery import Delivery, EntryData
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.operations import HAND_BACK, SET_IDLE
from taskiq_atomic_claim.pipelined import PipelinedCalls
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import drop_idle_connections
from taskiq_atomic_claim.server_errors import Fault, classify
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.task_records import record_starts
from taskiq_atomic_claim.unknown_tasks import (
    call_decline,
    log_handed_back,
    no_worker_knows,
)

logger = logging.getLogger("taskiq.atomic_claim")

SCRIPT_BATCH = 1000
# A start count lives at least this long after its last write (ms); if it
# lapses only crash counts reset, no entry is lost.
MIN_STARTED_TTL_MS = 24 * 3600 * 1000

Connect = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


class InFlight:
    """Delivered-not-acked entries of one consumer, with their start state,
    and what the heartbeat and the hand-back do with them."""

    def __init__(
        self,
        scripts: ScriptRunner,
        group: str,
        consumer: str,
        settings: ClaimSettings,
        metrics: ReclaimMetrics,
        results: DeadLetterResults,
        stand_aside: Callable[[str], None] = lambda stream: None,
    ) -> None:
        self.scripts = scripts
        self.dead_lettering = DeadLettering(
            scripts, metrics, results, delete_acked=settings.delete_acked
        )
        # Called with the stream of an entry declined: claim elsewhere first.
        self.stand_aside = stand_aside
        self.group = group
        self.consumer = consumer
        self.settings = settings
        self.metrics = metrics
        self._held: dict[tuple[str, str], Delivery] = {}
        self._by_task: dict[asyncio.Task[Any], Delivery] = {}
        self._starts: dict[str, list[tuple[Delivery, asyncio.Future[None]]]] = {}
        self._start_flush: asyncio.Task[None] | None = None
        # Where starts go without an awaited reply (standalone servers).
        self.pipelined: PipelinedCalls | None = None

    # The held set, per stream.

    def add(self, stream: str, entry_ids: Iterable[str], crashes: int = 0) -> None:
        now = time.monotonic()
        for entry_id in entry_ids:
            delivery = Delivery(stream, entry_id, now, crashes=crashes)
            self._held.setdefault((stream, entry_id), delivery)

    def discard(self, stream: str, entry_id: str) -> None:
        delivery = self._held.pop((stream, entry_id), None)
        if delivery is not None and delivery.task is not None:
            self._by_task.pop(delivery.task, None)

    def clear(self) -> None:
        self._held.clear()
        self._by_task.clear()

    def __getitem__(self, stream: str) -> set[str]:
        return {entry_id for (s, entry_id) in self._held if s == stream}

    def __len__(self) -> int:
        return len(self._held)

    def streams(self) -> list[str]:
        return list(dict.fromkeys(s for s, _ in self._held))

    def deliveries(self) -> list[Delivery]:
        return list(self._held.values())

    def get(self, stream: str, entry_id: str) -> Delivery | None:
        return self._held.get((stream, entry_id))

    def mark_yielded(self, stream: str, entry_id: str) -> None:
        delivery = self._held.get((stream, entry_id))
        if delivery is not None:
            delivery.yielded = True

    # What the receiver does with a yielded entry.

    def loaded(self, data: bytes) -> Delivery | None:
        """The formatter is parsing ``data`` in the receiver's callback task."""
        if not isinstance(data, EntryData):
            return None
        delivery = self._held.get((data.stream, data.entry_id))
        task = asyncio.current_task()
        if delivery is not None and task is not None:
            delivery.task = task
            self._by_task[task] = delivery
        return delivery

    def of_current_task(self) -> Delivery | None:
        task = asyncio.current_task()
        return None if task is None else self._by_task.get(task)

    @property
    def started_ttl(self) -> int:
        """ms: long enough to see max_deliveries crashes and reclaims."""
        cycles = (self.settings.max_deliveries + 1) * 2
        return max(MIN_STARTED_TTL_MS, cycles * self.settings.idle_timeout)

    async def record_start(self, connect: Connect, delivery: Delivery) -> None:
        """Record on the server that the entry's task starts, before it runs.

        Starts arriving while a call is under way wait and go together in
        the next call (one per stream).
        """
        if self.settings.max_deliveries == 0 or delivery.started:
            return  # nothing counts crashes: no key, no round trip
        if self.pipelined is not None:
            await self._pipeline_start(delivery)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._starts.setdefault(delivery.stream, []).append((delivery, waiter))
        if self._start_flush is None or self._start_flush.done():
            self._start_flush = asyncio.create_task(self._flush_starts(connect))
        try:
            await waiter
        except Exception as error:
            _start_not_recorded(delivery, error)

    async def _pipeline_start(self, delivery: Delivery) -> None:
        """Written, not answered: once the kernel has it, the start reaches
        the server even if this process dies right after."""
        assert self.pipelined is not None
        keys = StreamKeys(delivery.stream, self.group)
        call = self.pipelined.start(keys.started, self.started_ttl, delivery.entry_id)
        try:
            await call.written
        except Exception as error:
            _start_not_recorded(delivery, error)
            return
        delivery.started = True

        def answered(reply: asyncio.Future[Any]) -> None:
            if not reply.cancelled() and reply.exception() is not None:
                _start_not_recorded(delivery, reply.exception())

        call.reply.add_done_callback(answered)

    async def _flush_starts(self, connect: Connect) -> None:
        # Let the callbacks scheduled beside this one reach their start too.
        await asyncio.sleep(0)
        while self._starts:
            batches, self._starts = self._starts, {}
            try:
                async with connect() as client:
                    for stream, waiting in batches.items():
                        await self._call_start(client, stream, waiting)
            except BaseException as error:
                # One start lost to a closed connection is enough; and a
                # cancelled flush (shutdown) fails its waiters as well.
                await drop_idle_connections(connect, error)
                failure = (
                    error
                    if isinstance(error, Exception)
                    else RuntimeError("recording the start was cancelled")
                )
                for waiting in batches.values():
                    for _, waiter in waiting:
                        if not waiter.done():
                            waiter.set_exception(failure)
                if not isinstance(error, Exception):
                    raise

    async def _call_start(
        self,
        client: Any,
        stream: str,
        waiting: list[tuple[Delivery, asyncio.Future[None]]],
    ) -> None:
        keys = StreamKeys(stream, self.group)
        for start in range(0, len(waiting), SCRIPT_BATCH):
            chunk = waiting[start : start + SCRIPT_BATCH]
            ids = [d.entry_id for d, _ in chunk]
            await record_starts(client, keys.started, self.started_ttl, ids)
            for delivery, waiter in chunk:
                delivery.started = True
                if not waiter.done():
                    waiter.set_result(None)

    # Heartbeat and hand-back.

    async def beat(self, client: Any) -> None:
        """One heartbeat: dead-letter what the receiver dropped, hand back
        what sat unread too long, keep the rest from being reclaimed.

        The idle reset runs whatever the steps before it met: a step that
        fails at every beat (a refused command, a dead-letter key of another
        type) is logged and tried again at the next, and must not let long
        tasks be reclaimed and run twice. Only an unreachable server stops
        the beat, as the reset would fail too."""
        for delivery in [d for d in self.deliveries() if d.dropped_by_receiver()]:
            await _contained(
                f"settling entry {delivery.entry_id} of stream {delivery.stream!r}"
                " that taskiq dropped",
                self.settle_dropped(client, delivery),
            )
        await _contained(
            "handing back entries not started",
            self.hand_back_unyielded(client, 3 * self.settings.idle_timeout / 1000),
        )
        await self.set_idle(client, 0, self.deliveries())

    async def settle_dropped(self, client: Any, delivery: Delivery) -> None:
        """Dead-letter (or decline) an entry whose receiver callback ended
        without an ack."""
        task = delivery.task
        assert task is not None
        error = task.exception()
        if delivery.unknown_task is not None:
            # taskiq < 0.13 skips an unknown task without an ack.
            await self.decline(client, delivery)
            return
        if delivery.unparsable is not None:
            # taskiq < 0.13 skips what it cannot parse without an ack.
            reason = delivery.unparsable
        elif error is None:  # e.g. a manual-ack task that never acked
            reason = "its task ended without acking it"
        else:
            reason = bounded_reason(
                "taskiq's receiver raised after starting it, without acking:"
                f" {type(error).__name__}: {error}"
            )
        await self.dead_letter(client, delivery, reason)

    async def decline(self, client: Any, delivery: Delivery) -> None:
        """In place of the ack of an entry whose task this worker does not
        know: hand it back for a worker that knows it, and stand aside; once
        delivered ``UNKNOWN_TASK_DELIVERIES`` times, dead-letter it."""
        keys = StreamKeys(delivery.stream, self.group)
        deliveries = await call_decline(
            self.scripts, client, keys, self.consumer, self.settings, delivery.entry_id
        )
        task_name = delivery.unknown_task or ""
        reason = no_worker_knows(task_name, deliveries)
        if reason is not None:
            await self.dead_letter(client, delivery, reason, logging.WARNING)
            return
        self.discard(delivery.stream, delivery.entry_id)
        if deliveries >= 0:  # else no longer ours: whoever took it judges it
            self.stand_aside(delivery.stream)
            self.metrics.add("handed_back", delivery.stream)
            log_handed_back(delivery.stream, delivery.entry_id, task_name, deliveries)

    async def dead_letter(
        self, client: Any, delivery: Delivery, reason: str, level: int = logging.ERROR
    ) -> None:
        """Move a held entry to dead letters, in place of its ack."""
        keys = StreamKeys(delivery.stream, self.group)
        await self.dead_lettering.move(
            client, keys, delivery.entry_id, reason, level=level
        )
        self.discard(delivery.stream, delivery.entry_id)

    async def hand_back_unyielded(self, client: Any, older_than_s: float) -> None:
        """Hand back entries read but not handed to taskiq for ``older_than_s``
        (every slot busy with long tasks): other workers may have room."""
        oldest = time.monotonic() - older_than_s
        stale = [d for d in self.deliveries() if not d.yielded and d.read_at < oldest]
        if not stale:
            return
        await self.set_idle(client, self.settings.idle_timeout, stale)
        for delivery in stale:
            self.discard(delivery.stream, delivery.entry_id)
            self.metrics.add("handed_back", delivery.stream)
        logger.warning(
            "Handed back %d entries read %.0f s ago and not started yet (every"
            " task slot busy): other workers can take them now",
            len(stale),
            older_than_s,
        )

    async def set_idle(
        self, client: Any, idle_ms: int, deliveries: list[Delivery]
    ) -> None:
        """Set the idle time of those still owned; forget those not owned."""
        for stream, of_stream in _by_stream(deliveries):
            ids = [d.entry_id for d in of_stream]
            for start in range(0, len(ids), SCRIPT_BATCH):
                chunk = ids[start : start + SCRIPT_BATCH]
                lost = await self.scripts.call(
                    client,
                    SET_IDLE,
                    [stream],
                    [self.group, self.consumer, idle_ms, *chunk],
                )
                if idle_ms == 0:
                    self.metrics.add("heartbeats", stream)
                for entry_id in lost:
                    self.discard(stream, text(entry_id))

    async def hand_back(self, client: Any, held: list[Delivery], idle_ms: int) -> int:
        """Set the idle time of ``held`` (idle_timeout: claimable at once), take
        back their starts (a shutdown is no crash), forget them; count owned."""
        handed = 0
        if self.pipelined is not None:
            # Its starts on the server before they are taken back.
            await self.pipelined.settled()
        for stream, in_stream in _by_stream(held):
            keys = StreamKeys(stream, self.group)
            for start in range(0, len(in_stream), SCRIPT_BATCH):
                chunk = in_stream[start : start + SCRIPT_BATCH]
                ids = [d.entry_id for d in chunk]
                n_started = sum(d.started for d in chunk)
                lost = await self.scripts.call(
                    client,
                    HAND_BACK,
                    [stream, keys.started],
                    [self.group, self.consumer, idle_ms, n_started, *ids],
                )
                handed += len(chunk) - len(lost)
                if idle_ms:
                    self.metrics.add("handed_back", stream, len(chunk) - len(lost))
                for entry_id in ids:
                    self.discard(stream, entry_id)
        return handed


async def _contained(what: str, step: Awaitable[None]) -> None:
    """Run one heartbeat step; log its failure instead of raising it, unless
    the server is unreachable."""
    try:
        await step
    except Exception as error:
        if classify(error) is Fault.UNREACHABLE:
            raise
        logger.warning(
            "Heartbeat: %s failed (tried again at the next beat; running"
            " entries are still kept from being reclaimed): %s",
            what,
            error,
        )


def _start_not_recorded(delivery: Delivery, error: BaseException | None) -> None:
    # The task runs anyway: a start not counted only makes a crash go
    # uncounted, never dead-letters anything that did not crash.
    logger.warning(
        "Could not record the start of entry %s of stream %r (a crash"
        " running it will not count toward max_deliveries): %s",
        delivery.entry_id,
        delivery.stream,
        error,
    )


def _by_stream(deliveries: list[Delivery]) -> Iterator[tuple[str, list[Delivery]]]:
    """Per stream, started first (as hand_back.lua takes them), then by id."""
    streams: dict[str, list[Delivery]] = {}
    for delivery in deliveries:
        streams.setdefault(delivery.stream, []).append(delivery)
    for stream, held in streams.items():
        yield stream, sorted(held, key=lambda d: (not d.started, d.entry_id))
