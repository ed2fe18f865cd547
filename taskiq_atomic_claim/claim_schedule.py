"""When each stream is claimed (``ClaimSchedule``), and the Lua path's claim
calls that follow it (``ScriptClaims``).

Each stream has its own next claim time: at once after a full batch (a
backlog drains at the fleet's pace), past the lease another consumer was
told to hold, else one claim interval on. All due streams are claimed in
one script call where the topology allows (one per hash slot on Cluster).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from taskiq_atomic_claim.claim import ClaimOutcome, claim_streams
from taskiq_atomic_claim.claim_gate import FleetCheck, by_gate
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.cluster_client import slot_groups
from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics, report_trimmed
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import Fault, classify, reply_text
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")

# Called with the client before each claim or read: Sentinel checks there
# that the client is still on the current master.
BeforeCall = Callable[[Any], Awaitable[None]]


async def no_check(client: Any) -> None:
    """Nothing to check before a call (standalone server, Cluster)."""


class ClaimSchedule:
    """When one consumer claims on each of its streams, on either path."""

    def __init__(self, streams: list[str], settings: ClaimSettings) -> None:
        self.streams = streams
        self.settings = settings
        # Per stream: when (monotonic s) this consumer claims on it next.
        self._claim_due: dict[str, float] = {}
        # Where reads reclaim, per stream: not before this (monotonic s).
        self._read_claims_from: dict[str, float] = {}
        # Streams whose last claim came back full or cut short: claimed
        # again at once, past the fleet's gate.
        self._draining: set[str] = set()

    def begin(self) -> None:
        """A new listen(): every stream is due at once."""
        self._claim_due = dict.fromkeys(self.streams, time.monotonic())

    @property
    def next_claim(self) -> float:
        return min(self._claim_due.values())

    def due_streams(self) -> list[str]:
        now = time.monotonic()
        return [stream for stream, at in self._claim_due.items() if at <= now]

    def standing_aside(self, now: float) -> set[str]:
        """Where reads reclaim: streams no read claims on now."""
        return {s for s, at in self._read_claims_from.items() if at > now}

    def stand_aside(self, stream: str) -> None:
        """After declining an entry of ``stream`` (its task unknown here),
        claim nothing for a while: past the lease this consumer may hold and
        the time others wait past it, and one claim interval more, so another
        consumer claims it first. Where reads reclaim, no read claims on
        ``stream``; the other streams go on claiming."""
        settings = self.settings
        wait = settings.lease + settings.skip_wait + settings.claim_interval
        self._claim_nothing([stream], time.monotonic() + wait / 1000)

    def hold_off_after_outage(self) -> None:
        """An outage (connections lost, a failover, a server refusing): the
        pending entries of live workers look idle when it ends, as their
        heartbeats failed too. Claim nothing, on any stream and either path,
        until two heartbeats past now: called at each failed call and once
        more at the first call that works, so live workers (whose heartbeat
        threads retry within a third of a beat) reset their entries' idle
        time first. Dead workers' entries wait that much longer."""
        self._claim_nothing(
            self.streams, time.monotonic() + 2 * self.settings.idle_timeout / 3000
        )

    def _claim_nothing(self, streams: list[str], until: float) -> None:
        """No claim on ``streams`` before ``until``, on either path."""
        for stream in streams:
            self._claim_due[stream] = max(self._claim_due.get(stream, until), until)
            self._read_claims_from[stream] = max(
                self._read_claims_from.get(stream, until), until
            )

    def claiming(self, streams: list[str], started: float) -> None:
        """``streams`` are claimed now: next due one claim interval on."""
        interval = self.settings.claim_interval / 1000
        self._claim_due.update(dict.fromkeys(streams, started + interval))

    def gated(self, streams: list[str]) -> list[str]:
        """Of ``streams`` due, those only the fleet's gate lets this consumer
        claim (``claim_gate.py``): all but a backlog this consumer drains."""
        return [stream for stream in streams if stream not in self._draining]

    def kept_out(self, streams: list[str], started: float, wait_s: float) -> None:
        """The gate let another consumer look: due again ``wait_s`` on."""
        self._claim_due.update(dict.fromkeys(streams, started + wait_s))

    def read_claimed(self, stream: str, *, full: bool, started: float) -> None:
        """Where reads reclaim: a read that came back full of reclaimed
        entries makes ``stream`` due again at once, past the gate."""
        if full:
            self._draining.add(stream)
            self._claim_due[stream] = started
        else:
            self._draining.discard(stream)

    def claimed(self, stream: str, outcome: ClaimOutcome, started: float) -> None:
        """Due again at once after a backlog, or past another's lease."""
        self._draining.discard(stream)
        if outcome.full or outcome.next_cursor != "0-0":
            # A backlog, or a scan cut short at 10 x COUNT: go on.
            self._draining.add(stream)
            self._claim_due[stream] = started
        elif outcome.lease_ttl_ms is not None:
            wait = outcome.lease_ttl_ms + self.settings.skip_wait
            self._claim_due[stream] = started + wait / 1000


class ScriptClaims:
    """The Lua path's claim calls of one consumer, as the schedule says."""

    def __init__(
        self,
        scripts: ScriptRunner,
        schedule: ClaimSchedule,
        in_flight: EntryLifecycle,
        metrics: ReclaimMetrics,
        group: str,
        consumer: str,
        read_count: int | None,
        gates: dict[str, FleetCheck],
        *,
        per_slot: bool = False,
        before_call: BeforeCall = no_check,
    ) -> None:
        self.scripts = scripts
        self.schedule = schedule
        self.in_flight = in_flight
        self.metrics = metrics
        self.group = group
        self.consumer = consumer
        self.settings = schedule.settings
        self.read_count = read_count
        # Each stream's gate: one for all on a single server, one per slot
        # on Cluster.
        self.gates = gates
        # Cluster: one script call per hash slot (its keys must share one),
        # and a slot that cannot be claimed now is skipped, not fatal.
        self.per_slot = per_slot
        self.before_call = before_call
        self._claim_error: Exception | None = None
        # Streams whose last claim failed to reach their primary (Cluster).
        self._unclaimable: set[str] = set()

    async def claim(self, client: ScriptClient, stream: str) -> ClaimOutcome:
        """One claim cycle for one stream: one script call, and one XCLAIM
        that fetches the fields if it claimed anything."""
        (outcome,) = await self.claim_streams(client, [stream])
        return outcome

    async def claim_streams(
        self, client: ScriptClient, streams: list[str]
    ) -> list[ClaimOutcome]:
        """A claim cycle on ``streams``; on Cluster, streams of one slot,
        skipped this cycle (tried again the next) while the slot migrates,
        or, with several slots, while its primary is unreachable: the reads
        (and the other slots' claims) go on."""
        await self.before_call(client)
        if not self.per_slot:
            return await self._claim_streams(client, streams)
        try:
            outcomes = await self._claim_streams(client, streams)
        except Exception as error:
            fault = classify(error)
            # A migrating slot refuses the claim (its keys are split between
            # two primaries) but serves reads: never stop them for it.
            everything = set(streams) == set(self.schedule.streams)
            if not fault.is_outage or (everything and fault is not Fault.MIGRATING):
                raise
            for stream in streams:
                if stream not in self._unclaimable:
                    self._unclaimable.add(stream)
                    logger.warning(
                        "Cannot claim on stream %r (%s), trying again every"
                        " claim interval: %s",
                        stream,
                        fault.value,
                        reply_text(error),
                    )
            return [ClaimOutcome(skipped=True) for _ in streams]
        for stream in streams:
            if stream in self._unclaimable:
                self._unclaimable.discard(stream)
                logger.warning("Claiming on stream %r again", stream)
        return outcomes

    async def _claim_streams(
        self, client: ScriptClient, streams: list[str]
    ) -> list[ClaimOutcome]:
        """One claim cycle on each of ``streams`` in one script call, each
        batch what one read takes (``xread_count``, at most
        ``unacknowledged_batch_size``), as where the read itself reclaims."""
        count = min(
            self.settings.batch_size, self.read_count or self.settings.batch_size
        )
        outcomes = await claim_streams(
            self.scripts,
            client,
            [StreamKeys(stream, self.group) for stream in streams],
            self.consumer,
            self.settings,
            [count] * len(streams),
        )
        for stream, outcome in zip(streams, outcomes, strict=True):
            self._record(stream, outcome)
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            # Entries other streams gave are this consumer's now: deliver
            # them first, raise after (see claim_all).
            if not any(outcome.entries for outcome in outcomes):
                raise failed[0]
            self._claim_error = failed[0]
        return outcomes

    def _record(self, stream: str, outcome: ClaimOutcome) -> None:
        keys = StreamKeys(stream, self.group)
        if outcome.skipped:
            self.metrics.add("lease_skips", stream)
        self.metrics.add("claimed", stream, len(outcome.entries))
        report_trimmed(self.metrics, stream, outcome.trimmed)
        self.in_flight.dead_lettering.moved_by_claim(
            keys, outcome.dead_lettered, outcome.dead_lettered_data
        )
        if outcome.entries:
            logger.debug(
                "Reclaimed %d idle entries from stream %r", len(outcome.entries), stream
            )

    def raise_deferred_error(self) -> None:
        """A claim that failed after other streams' claims took entries is
        raised once those are delivered, to be handled as any failed call."""
        error, self._claim_error = self._claim_error, None
        if error is not None:
            raise error

    async def claim_all(
        self, client: ScriptClient, streams: list[str] | None = None
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """Claim on ``streams`` (all by default), as few calls as the
        topology allows, and schedule each stream's next claim: at once
        after a full batch, past the lease another consumer holds, else one
        claim interval on. A call that fails does not drop what earlier calls
        took (those entries are this consumer's now): they are delivered,
        and the error is raised afterwards."""
        streams = self.schedule.streams if streams is None else streams
        started = time.monotonic()
        self.schedule.claiming(streams, started)
        gated = self.schedule.gated(streams)
        if gated:
            await self.before_call(client)
            idle = set()
            for gate, behind in by_gate(self.gates, gated).items():
                if await gate.enter(client):
                    idle.update(await gate.idle_streams(client, behind))
                else:
                    self.schedule.kept_out(behind, started, gate.retry_after_s())
            streams = [s for s in streams if s not in gated or s in idle]
        batch: list[tuple[str, str, dict[Any, Any]]] = []
        if not streams:
            return batch
        backlog: list[str] = []
        for group in self._claim_groups(streams):
            try:
                outcomes = await self.claim_streams(client, group)
            except Exception as error:
                if not batch:
                    raise
                self._claim_error = error
                break
            for stream, outcome in zip(group, outcomes, strict=True):
                for entry in outcome.entries:
                    # Held from here with its crashes (see suspects.py).
                    self.in_flight.add(
                        stream, [entry.id], entry.crashes, reclaimed=True
                    )
                    batch.append((stream, entry.id, entry.fields))
                self.schedule.claimed(stream, outcome, started)
                if outcome.full:
                    backlog.append(stream)
        for gate in by_gate(self.gates, backlog):
            await gate.open(client)
        return batch

    def _claim_groups(self, streams: list[str]) -> list[list[str]]:
        """Streams that one script call can claim together."""
        if not self.per_slot:
            return [streams]
        return [list(group) for group in slot_groups(dict.fromkeys(streams, ">"))]
