"""When and how a consumer claims idle entries with the Lua claim script,
part of every atomic broker (``ReclaimingListener`` mixes this in).

Each stream has its own next claim time: at once after a full batch (a
backlog drains at the fleet's pace), past the lease another consumer was
told to hold, else one claim interval on. All due streams are claimed in
one script call where the topology allows (one per hash slot on Cluster).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from taskiq_atomic_claim.claim import ClaimOutcome, claim_streams
from taskiq_atomic_claim.in_flight import InFlight
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics, report_trimmed
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")

# A worker holding nothing still claims this many at once (if its settings
# allow): holding more than it runs waits for it, not the fleet.
MIN_CLAIM = 10


class Claiming:
    """The claim schedule of one consumer over its streams."""

    consumer_name: str
    consumer_group_name: str
    count: int | None
    claim_settings: ClaimSettings
    scripts: ScriptRunner
    metrics: ReclaimMetrics
    in_flight: InFlight
    _claim_error: Exception | None
    # Per stream: when (monotonic s) this consumer claims on it next.
    _claim_due: dict[str, float]
    # Where reads reclaim, per stream: not before this (monotonic s); see
    # _stand_aside.
    _read_claims_from: dict[str, float]

    @property
    def streams(self) -> list[str]:
        raise NotImplementedError

    async def claim(self, client: Any, stream: str) -> ClaimOutcome:
        """One claim cycle for one stream: one script call, and one XCLAIM
        that fetches the fields if it claimed anything."""
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
        report_trimmed(self.metrics, stream, outcome.trimmed)
        self.in_flight.dead_lettering.moved_by_claim(
            keys, outcome.dead_lettered, outcome.dead_lettered_data
        )
        if outcome.entries:
            logger.debug(
                "Reclaimed %d idle entries from stream %r", len(outcome.entries), stream
            )

    def _stand_aside(self, stream: str) -> None:
        """After declining an entry of ``stream`` (its task unknown here),
        claim nothing for a while: past the lease this consumer may hold and
        the time others wait past it, and one claim interval more, so another
        consumer claims it first. Where reads reclaim, no read claims on
        ``stream``; the other streams go on claiming."""
        settings = self.claim_settings
        wait = settings.lease + settings.skip_wait + settings.claim_interval
        until = time.monotonic() + wait / 1000
        self._claim_due[stream] = max(self._claim_due.get(stream, until), until)
        self._read_claims_from[stream] = until

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
                for entry in outcome.entries:
                    # Held from here with its crashes (see suspects.py).
                    self.in_flight.add(stream, [entry.id], entry.crashes)
                    batch.append((stream, entry.id, entry.fields))
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
