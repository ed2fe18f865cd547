"""An entry's lifecycle in a worker: every state it passes through and
every transition, from its read to its ack or its other ends.

- read (XREADGROUP or a claim): held (``add``), heartbeated, not yet handed
  to taskiq;
- yielded: handed to taskiq's receiver by ``listen()`` as a message
  (``deliverable``); an entry taskiq cannot run (no data field) is
  dead-lettered instead (``settle_undeliverable``);
- loaded: the receiver's callback parsed its data (``loaded``; the
  formatter saw it), or could not (``unparsable``), or found no task of its
  name here (``unknown_task``);
- started: about to run (``starting``); a task that crashed workers before
  waits for its turn (``suspects.py``), then the start is recorded on the
  server (``task_calls.py``) so that a worker dying now counts toward
  ``max_deliveries``;
- and then one of:
  - acked: forgotten here and on the server (``task_calls.py``;
    ``tracked_ack``), and never yielded again (``finished.py``);
  - declined: its task unknown here, handed back for a worker that knows it
    (``decline``);
  - dead-lettered: in place of its ack (``dead_letter``; when, and why, is
    ``dead_letter_policy.py``);
  - handed back: made claimable by others (``hand_back``,
    ``hand_back_unyielded``), or lost to another consumer (``set_idle``).

The broker learns "loaded" and "started" from what taskiq does anyway: the
receiver calls ``broker.formatter.loads(message.data)`` and then every
middleware's ``pre_execute`` in the callback's own asyncio task, before the
task runs (``receiver_hooks.py`` forwards both here). ``EntryData`` is the
message data carrying its entry, so the callback task is tied to the entry.

What is held but not running never stays held for ever: an entry the
receiver dropped (its callback ended without an ack) goes to dead letters; an
entry not handed to taskiq within ``3 * idle_timeout`` is handed back.

The held set is the hot path: per entry one ``Delivery``, one message and
one ack closure, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from taskiq import AckableMessage

from taskiq_atomic_claim import tracing
from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.dead_letter_policy import (
    NO_DATA_FIELD,
    dropped_reason,
    log_handed_back_unknown,
    no_worker_knows,
    unparsable_reason,
)
from taskiq_atomic_claim.dead_letter_results import DeadLetterResults
from taskiq_atomic_claim.dead_letters import DeadLettering
from taskiq_atomic_claim.delivery import Delivery, EntryData
from taskiq_atomic_claim.finished import FinishedEntries
from taskiq_atomic_claim.keys import ORPHANS_CONSUMER, StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.operations import hand_back_call, set_idle_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    within,
)
from taskiq_atomic_claim.server_errors import Fault, classify, describe
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.suspects import SuspectsRunAlone
from taskiq_atomic_claim.task_calls import TaskCalls
from taskiq_atomic_claim.task_records import forget_command
from taskiq_atomic_claim.unknown_tasks import call_decline

logger = logging.getLogger("taskiq.atomic_claim")

SCRIPT_BATCH = 1000
# A start count lives at least this long after its last write (ms); if it
# lapses only crash counts reset, no entry is lost.
MIN_STARTED_TTL_MS = 24 * 3600 * 1000

Connect = Callable[[], contextlib.AbstractAsyncContextManager[ScriptClient]]

_DATA_FIELD = b"data"


class EntryLifecycle:
    """Delivered-not-acked entries of one consumer, with their state, and
    every transition they take (see the module docstring).

    ``connect`` gives a client of the pool acks, starts and declines use;
    ``stand_aside`` is called with the stream of an entry declined (claim
    elsewhere first); ``per_slot``: on Cluster; ``longest_read_s``: how long
    a read may hold a connection (a start may wait that long for one)."""

    def __init__(
        self,
        scripts: ScriptRunner,
        group: str,
        consumer: str,
        settings: ClaimSettings,
        metrics: ReclaimMetrics,
        results: DeadLetterResults,
        stand_aside: Callable[[str], None] = lambda stream: None,
        *,
        connect: Connect,
        per_slot: bool = False,
        longest_read_s: float = 0.0,
        named: Callable[[BaseException], BaseException] = lambda error: error,
    ) -> None:
        self.scripts = scripts
        self.connect = connect
        # An error as the logs name it (a refused login: where, the user).
        self.named = named
        self.dead_lettering = DeadLettering(
            scripts, metrics, results, delete_acked=settings.delete_acked
        )
        self.stand_aside = stand_aside
        self.group = group
        self.consumer = consumer
        self.settings = settings
        self.metrics = metrics
        self.suspects = SuspectsRunAlone(settings.max_deliveries)
        # ms a start count lives: long enough to see max_deliveries crashes
        # and reclaims.
        cycles = (settings.max_deliveries + 1) * 2
        self.started_ttl = max(MIN_STARTED_TTL_MS, cycles * settings.idle_timeout)
        self._held: dict[tuple[str, str], Delivery] = {}
        # The liveness thread copies the held set (held_snapshot): every
        # change to it is made under this lock.
        self._held_lock = threading.Lock()
        self._by_task: dict[asyncio.Task[Any], Delivery] = {}
        self._keys: dict[str, StreamKeys] = {}
        self.calls = TaskCalls(connect, REPLY_MARGIN_S + longest_read_s, per_slot)
        self.finished = FinishedEntries()
        # Starts not recorded since (once per outage, not once per start).
        self._starts_lost_since: float | None = None
        self._starts_lost = 0
        # Acks refused by the ACL: waited out, one line each way.
        self.refused_acks = Backoff(
            f"acks of consumer {consumer}",
            cap=1.0,
            consequence="finished tasks keep their entries, heartbeated, until"
            " the ack is allowed",
        )
        # Shared by every ack: one outage, one log line, however many acks.
        self.ack_backoff = Backoff(
            f"acks of consumer {consumer}",
            cap=1.0,
            consequence=f"an ack still failing after {self.ack_patience:.1f} s"
            " is dropped and its task runs again once reclaimed (a hash slot"
            " migrating is waited out)",
        )

    def keys(self, stream: str) -> StreamKeys:
        """The stream's keys, built once per stream: acks are a hot path."""
        keys = self._keys.get(stream)
        if keys is None:
            keys = self._keys[stream] = StreamKeys(stream, self.group)
        return keys

    # The held set, per stream.

    def add(
        self,
        stream: str,
        entry_ids: Iterable[str],
        crashes: int = 0,
        *,
        reclaimed: bool = False,
    ) -> None:
        now = time.monotonic()
        with self._held_lock:
            for entry_id in entry_ids:
                delivery = Delivery(
                    stream, entry_id, now, crashes=crashes, reclaimed=reclaimed
                )
                self._held.setdefault((stream, entry_id), delivery)

    def discard(self, stream: str, entry_id: str) -> None:
        with self._held_lock:
            delivery = self._held.pop((stream, entry_id), None)
        if delivery is not None and delivery.task is not None:
            self._by_task.pop(delivery.task, None)

    def clear(self) -> None:
        with self._held_lock:
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

    def held_snapshot(self) -> list[Delivery]:
        """What is held, copied under the lock: safe from another thread."""
        with self._held_lock:
            return list(self._held.values())

    def get(self, stream: str, entry_id: str) -> Delivery | None:
        return self._held.get((stream, entry_id))

    # Read -> yielded.

    def deliverable(
        self, stream: str, entry_id: str, fields: dict[Any, Any]
    ) -> AckableMessage | None:
        """The entry as a message, marked yielded; None if this consumer no
        longer holds it (handed back, or taken by another consumer) or it
        has no ``data`` field (see ``settle_undeliverable``). Every entry's
        path: no coroutine."""
        delivery = self._held.get((stream, entry_id))
        if delivery is None or delivery.yielded:
            # Handed back or taken by another consumer; or taken back from
            # ourselves by our own claim (a heartbeat came late) while taskiq
            # still runs it: yielding it again would run it twice.
            return None
        data = fields.get(_DATA_FIELD)
        if data is None:
            data = fields.get("data")  # decoded replies
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes):
            return None
        delivery.yielded = True
        return AckableMessage(
            data=EntryData(data, stream, entry_id),
            ack=self.tracked_ack(stream, entry_id),
        )

    async def settle_undeliverable(
        self, client: ScriptClient, stream: str, entry_id: str
    ) -> None:
        """After ``deliverable`` gave None: an entry still held and not
        yielded has no ``data`` field (written by something else), which
        taskiq cannot run: it goes to dead letters."""
        delivery = self._held.get((stream, entry_id))
        if delivery is not None and not delivery.yielded:
            await self.dead_letter(client, delivery, NO_DATA_FIELD)

    # Yielded -> loaded, in the receiver's callback task.

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

    @staticmethod
    def unparsable(delivery: Delivery | None, error: Exception) -> None:
        """The formatter cannot parse it: taskiq acks it (0.13) or skips it
        (0.12), and either dead-letters it."""
        if delivery is not None:
            delivery.unparsable = unparsable_reason(error)

    @staticmethod
    def unknown_task(delivery: Delivery | None, task_name: str) -> None:
        """No task of that name here: taskiq acks (0.13) or skips (0.12) it;
        either declines it."""
        if delivery is not None:
            delivery.unknown_task = task_name

    # Loaded -> started, just before the task runs.

    async def starting(self) -> None:
        """In the receiver's callback task, before the task runs: a suspect
        waits for its turn, then the start is recorded, on the server
        before the task runs (the starts of one loop turn in one call)."""
        task = asyncio.current_task()
        delivery = None if task is None else self._by_task.get(task)
        if delivery is None:
            return
        assert task is not None
        if not self.suspects.took_turn(delivery, task):
            await self.suspects.wait_turn(delivery)
        if self.settings.max_deliveries == 0 or delivery.started:
            return  # nothing counts crashes: no key, no round trip
        try:
            await self.calls.start(
                self.keys(delivery.stream).started,
                self.started_ttl,
                delivery.entry_id,
            )
        except Exception as error:
            self.start_not_recorded(delivery, error)
            # The pool's idle connections most likely went with this one.
            await drop_idle_connections(self.connect, error)
            return
        delivery.started = True
        if delivery.reclaimed and tracing.recording():
            await self._trace_redelivery(delivery)

    async def _trace_redelivery(self, delivery: Delivery) -> None:
        """The run's span says it is a redelivery, with its counts (one
        XPENDING, only where the app traces this run)."""
        keys = self.keys(delivery.stream)
        try:
            async with self.connect() as client:
                pending = await within(
                    REPLY_MARGIN_S,
                    client.execute_command(
                        "XPENDING",
                        keys.stream,
                        self.group,
                        delivery.entry_id,
                        delivery.entry_id,
                        1,
                        parse_detail=True,
                    ),
                )
        except Exception as error:
            logger.debug("Delivery count of %s not read: %s", delivery.entry_id, error)
            pending = []
        deliveries = int(pending[0]["times_delivered"]) if pending else 0
        tracing.redelivered(deliveries, delivery.crashes)

    def start_not_recorded(
        self, delivery: Delivery, error: BaseException | None
    ) -> None:
        """The task runs anyway: a start not counted only makes a crash go
        uncounted, never dead-letters anything that did not crash. Said once
        until a start is known recorded again, not once per start."""
        delivery.start_lost = True
        if self._starts_lost_since is None:
            self._starts_lost_since = time.monotonic()
            logger.warning(
                "Could not record the start of entry %s of stream %r, nor of"
                " tasks starting after it until a line says starts are recorded"
                " again (a crash running them will not count toward"
                " max_deliveries): %s",
                delivery.entry_id,
                delivery.stream,
                error if error is None else describe(self.named(error)),
            )
        self._starts_lost += 1

    def _starts_recorded_again(self, stream: str, entry_id: str) -> None:
        """An entry acked: if it was read after starts began to fail and
        its start was recorded, starts work again."""
        delivery = self._held.get((stream, entry_id))
        since = self._starts_lost_since
        if since is None or delivery is None or delivery.read_at <= since:
            return
        if delivery.started and not delivery.start_lost:
            logger.warning(
                "Starts recorded again after %.1f s (%d not recorded)",
                time.monotonic() - since,
                self._starts_lost,
            )
            self._starts_lost_since, self._starts_lost = None, 0

    # Started -> acked (or, in place of the ack, declined or dead-lettered).

    @property
    def ack_patience(self) -> float:
        """Seconds an ack keeps retrying: well before the entry, no longer
        heartbeated, becomes claimable."""
        return min(self.settings.idle_timeout / 2000, 30)

    def tracked_ack(self, stream: str, entry_id: str) -> Callable[[], Awaitable[None]]:
        """The message's ack: acked (or declined, or dead-lettered), then
        forgotten here whatever happened."""

        async def ack_and_forget() -> None:
            # An outage must not fail the ack outright; if the server stays
            # away, stop heartbeating the entry either way so another worker
            # reclaims it (at least once, never stuck). Never raise then:
            # taskiq runs acks in tasks nobody awaits, so an exception is a
            # "Task exception was never retrieved" traceback per ack, and the
            # outage's one log line already said what happens.
            give_up = time.monotonic() + self.ack_patience
            refused = False
            try:
                while True:
                    try:
                        await self._ack_once(stream, entry_id)
                    except Exception as error:
                        fault = classify(error)
                        if fault in (Fault.FORBIDDEN, Fault.LOGIN_REFUSED):
                            # An operator took the ack's permission away (or
                            # changed the password): wait for it, however
                            # long, the entry held. Reclaimed, a finished
                            # task would run again, its start a crash.
                            if not refused:
                                refused = True
                                await self._forget_start(stream, entry_id)
                            named = self.named(error)
                            await asyncio.sleep(self.refused_acks.failed(named))
                            continue
                        if not fault.is_outage:
                            raise
                        await drop_idle_connections(self.connect, error)
                        delay = self.ack_backoff.failed(error)
                        if fault is Fault.MIGRATING:
                            # Nothing takes the entry meanwhile: it is still
                            # heartbeated, and a claim needs the ack's keys
                            # and more on one node. Wait the move out.
                            give_up = time.monotonic() + self.ack_patience
                        remaining = give_up - time.monotonic()
                        if remaining <= 0:
                            return
                        # Last try at the deadline: acks share one backoff,
                        # whose cap would else drop acks of short outages.
                        await asyncio.sleep(min(delay, remaining))
                    else:
                        self.ack_backoff.succeeded()
                        self.refused_acks.succeeded()
                        self._starts_recorded_again(stream, entry_id)
                        self.finished.add(stream, entry_id)
                        return
            finally:
                self.discard(stream, entry_id)

        return ack_and_forget

    async def _forget_start(self, stream: str, entry_id: str) -> None:
        """The task of an entry whose ack is refused has finished: its start
        must not count as a crash if this worker dies before the ack is
        allowed again. Best effort: the same ACL change may refuse it."""
        try:
            async with self.connect() as client:
                await within(
                    REPLY_MARGIN_S,
                    client.execute_command(
                        *forget_command(self.keys(stream).started, [entry_id])
                    ),
                )
        except Exception as error:
            logger.debug("Start count of %s not forgotten: %s", entry_id, error)

    async def _ack_once(self, stream: str, entry_id: str) -> None:
        """XACK and forget the entry's start count (with the other acks of
        this loop turn); an entry taskiq could not parse goes to dead
        letters instead, one whose task is unknown here is declined."""
        keys = self.keys(stream)
        delivery = self._held.get((stream, entry_id))
        if delivery is None or (
            delivery.unknown_task is None and delivery.unparsable is None
        ):
            await self.calls.ack(
                stream, keys.started, self.group, self.settings.delete_acked, entry_id
            )
            return
        async with self.connect() as client:
            if delivery.unknown_task is not None:
                await within(REPLY_MARGIN_S, self.decline(client, delivery))
            else:
                await within(
                    REPLY_MARGIN_S,
                    self.dead_letter(client, delivery, delivery.unparsable or ""),
                )

    # Heartbeat and hand-back.

    async def beat(self, client: ScriptClient) -> None:
        """The heartbeat's part on the event loop: dead-letter what the
        receiver dropped, hand back what sat unread too long. Keeping the
        rest from being reclaimed is the liveness thread's (``liveness.py``):
        a blocked loop must not stop it.

        A step that fails at every beat (a refused command, a dead-letter key
        of another type) is logged and tried again at the next."""
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

    async def settle_dropped(self, client: ScriptClient, delivery: Delivery) -> None:
        """Dead-letter (or decline) an entry whose receiver callback ended
        without an ack."""
        task = delivery.task
        assert task is not None
        if delivery.unknown_task is not None:
            # taskiq < 0.13 skips an unknown task without an ack.
            await self.decline(client, delivery)
            return
        reason = dropped_reason(delivery.unparsable, task.exception())
        await self.dead_letter(client, delivery, reason)

    async def decline(self, client: ScriptClient, delivery: Delivery) -> None:
        """In place of the ack of an entry whose task this worker does not
        know: hand it back for a worker that knows it, and stand aside; once
        delivered ``UNKNOWN_TASK_DELIVERIES`` times, dead-letter it."""
        keys = self.keys(delivery.stream)
        deliveries = await call_decline(
            self.scripts, client, keys, self.consumer, self.settings, delivery.entry_id
        )
        task_name = delivery.unknown_task or ""
        reason = no_worker_knows(task_name, deliveries)
        if reason is not None:
            await self.dead_letter(client, delivery, reason, logging.WARNING)
            return
        self.discard(delivery.stream, delivery.entry_id)
        self.finished.add(delivery.stream, delivery.entry_id)
        if deliveries >= 0:  # else no longer ours: whoever took it judges it
            self.stand_aside(delivery.stream)
            self.metrics.add("handed_back", delivery.stream)
            log_handed_back_unknown(
                delivery.stream, delivery.entry_id, task_name, deliveries
            )

    async def dead_letter(
        self,
        client: ScriptClient,
        delivery: Delivery,
        reason: str,
        level: int = logging.ERROR,
    ) -> None:
        """Move a held entry to dead letters, in place of its ack."""
        keys = self.keys(delivery.stream)
        await self.dead_lettering.move(
            client, keys, delivery.entry_id, reason, level=level
        )
        self.discard(delivery.stream, delivery.entry_id)
        self.finished.add(delivery.stream, delivery.entry_id)

    async def hand_back_unyielded(
        self, client: ScriptClient, older_than_s: float
    ) -> None:
        """Hand back entries read but not handed to taskiq for ``older_than_s``
        (every slot busy with long tasks): other workers may have room."""
        oldest = time.monotonic() - older_than_s
        stale = [d for d in self.deliveries() if not d.yielded and d.read_at < oldest]
        if not stale:
            return
        # No group has an orphan (see ``set_idle``) to hand it back to.
        orphans = await self.set_idle(client, self.settings.idle_timeout, stale)
        handed = [d for d in stale if d.entry_id not in orphans.get(d.stream, ())]
        for delivery in handed:
            self.discard(delivery.stream, delivery.entry_id)
            self.metrics.add("handed_back", delivery.stream)
        if handed:
            logger.warning(
                "Handed back %d entries read %.0f s ago and not started yet"
                " (every task slot busy): other workers can take them now",
                len(handed),
                older_than_s,
            )

    async def set_idle(
        self, client: ScriptClient, idle_ms: int, deliveries: list[Delivery]
    ) -> dict[str, set[str]]:
        """Set the idle time of those still owned; forget those not owned,
        but orphans (``_orphans``), which it returns per stream."""
        orphans: dict[str, set[str]] = {}
        for stream, of_stream in _by_stream(deliveries):
            ids = [d.entry_id for d in of_stream]
            for start in range(0, len(ids), SCRIPT_BATCH):
                chunk = ids[start : start + SCRIPT_BATCH]
                lost = await self.scripts.run(
                    client,
                    set_idle_call(
                        stream=stream,
                        group=self.group,
                        consumer=self.consumer,
                        idle_ms=idle_ms,
                        orphans=ORPHANS_CONSUMER,
                        entry_ids=chunk,
                    ),
                )
                if idle_ms == 0:
                    self.metrics.add("heartbeats", stream)
                gone = [text(entry_id) for entry_id in lost]
                kept = await self._orphans(client, stream, gone) if gone else set()
                orphans.setdefault(stream, set()).update(kept)
                for entry_id in gone:
                    if entry_id not in kept:
                        self.discard(stream, entry_id)
        return orphans

    async def _orphans(
        self, client: ScriptClient, stream: str, lost: list[str]
    ) -> set[str]:
        """Of entries this consumer no longer owns, those it keeps: not yet
        parsed by taskiq, pending for no consumer, still in the stream. Their
        group was destroyed (and maybe re-created after them) or an operator
        moved its position: dropped here, no one would ever run them. They
        run here; their ack finds nothing pending. An entry another consumer
        took, or deleted from the stream, is dropped as before."""
        waiting = [
            entry_id
            for entry_id in lost
            if (delivery := self._held.get((stream, entry_id))) is not None
            and delivery.task is None
        ]
        if not waiting:
            return set()
        redis: Any = client  # a redis-py client: it pipelines
        async with redis.pipeline(transaction=False) as pipe:
            for entry_id in waiting:
                pipe.xpending_range(stream, self.group, entry_id, entry_id, 1)
                pipe.xrange(stream, entry_id, entry_id)
            replies = await pipe.execute(raise_on_error=False)
        kept = set()
        for n, entry_id in enumerate(waiting):
            pending, present = replies[2 * n], replies[2 * n + 1]
            if isinstance(present, Exception) or not present:
                continue
            if isinstance(pending, Exception):
                if classify(pending) is not Fault.GROUP_MISSING:
                    raise pending
                pending = []  # the group is gone: nobody owns it
            if not pending:
                kept.add(entry_id)
        new = [i for i in kept if not self._held[(stream, i)].orphaned]
        for entry_id in new:
            self._held[(stream, entry_id)].orphaned = True
        if new:
            logger.warning(
                "%d entries of stream %r read by consumer %r are pending for no"
                " consumer now (their group destroyed or moved): they run here",
                len(new),
                stream,
                self.consumer,
            )
        return kept

    async def hand_back(
        self, client: ScriptClient, held: list[Delivery], idle_ms: int
    ) -> int:
        """Set the idle time of ``held`` (idle_timeout: claimable at once), take
        back their starts (a shutdown is no crash), forget them; count owned."""
        handed = 0
        # Starts sent are answered (and marked) before they are taken back.
        await self.calls.settled()
        for stream, in_stream in _by_stream(held):
            keys = self.keys(stream)
            for start in range(0, len(in_stream), SCRIPT_BATCH):
                chunk = in_stream[start : start + SCRIPT_BATCH]
                ids = [d.entry_id for d in chunk]
                n_started = sum(d.started for d in chunk)
                lost = await self.scripts.run(
                    client,
                    hand_back_call(
                        stream=stream,
                        started=keys.started,
                        group=self.group,
                        consumer=self.consumer,
                        idle_ms=idle_ms,
                        n_started=n_started,
                        entry_ids=ids,
                    ),
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
            describe(error),
        )


def _by_stream(deliveries: list[Delivery]) -> Iterator[tuple[str, list[Delivery]]]:
    """Per stream, started first (as hand_back.lua takes them), then by id."""
    streams: dict[str, list[Delivery]] = {}
    for delivery in deliveries:
        streams.setdefault(delivery.stream, []).append(delivery)
    for stream, held in streams.items():
        yield stream, sorted(held, key=lambda d: (not d.started, d.entry_id))
