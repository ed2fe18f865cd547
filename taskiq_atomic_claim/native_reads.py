"""Reclaiming through the reads on Redis >= 8.4 (``XREADGROUP ... CLAIM``):
that path's read step.

Where reads reclaim, no claim script, lease or cursor key is used: the read
takes idle pending entries (longest idle first) before new ones. What the
Lua claim also did is done here: entries whose task started
``max_deliveries`` times in workers that died go to the dead letters, and a
rare sweep drops pending entries whose data was deleted (CLAIM skips them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from taskiq_atomic_claim.claim_gate import FleetCheck, by_gate
from taskiq_atomic_claim.claim_schedule import ClaimSchedule
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.dead_letter_policy import crashed_out
from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics, report_trimmed
from taskiq_atomic_claim.operations import drop_trimmed_call
from taskiq_atomic_claim.reads import GroupReads
from taskiq_atomic_claim.reclaim_count import ReclaimCounter
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import waited_out_while_running

logger = logging.getLogger("taskiq.atomic_claim")


class NativePathReads:
    """The read step where reads reclaim, and that path's upkeep."""

    def __init__(
        self,
        reads: GroupReads,
        schedule: ClaimSchedule,
        scripts: ScriptRunner,
        in_flight: EntryLifecycle,
        metrics: ReclaimMetrics,
        gates: dict[str, FleetCheck],
        *,
        per_slot: bool = False,
    ) -> None:
        self.reads = reads
        # Each stream's gate: one for all on a server, one per slot on
        # Cluster.
        self.gates = gates
        # Cluster: a slot's blocking read outlives one step (it goes on in
        # cluster_client), so claims go in a read of their own that does
        # not block, and blocking reads never claim.
        self.per_slot = per_slot
        self.schedule = schedule
        self.settings = schedule.settings
        self.streams = schedule.streams
        self.group = reads.group
        self.consumer = reads.consumer
        self.scripts = scripts
        self.in_flight = in_flight
        self.metrics = metrics
        self.reclaim_counter = ReclaimCounter(self.group)
        # When drop_trimmed runs next, and where in each stream's PEL it
        # goes on.
        self._next_sweep = time.monotonic() + self.settings.idle_timeout / 1000
        self._sweep_from: dict[str, str] = {}

    async def step(
        self, client: Any, read_from: dict[str, Any]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """One bounded read, after the rare upkeep. Only the consumer the
        fleet's gate lets through this claim interval (or one draining a
        backlog) reads with CLAIM; the others read new entries only, until
        their next try of the gate (one to two intervals, or
        ``xread_block``, whichever comes first)."""
        now = time.monotonic()
        claiming: set[str] = set()
        due = self.schedule.due_streams()
        if due:
            draining = set(due) - set(self.schedule.gated(due))
            for gate, behind in by_gate(self.gates, self._behind_gates(due)).items():
                if draining & set(behind) or await gate.enter(client):
                    claiming.update(behind)
                else:
                    self.schedule.kept_out(behind, now, gate.retry_after_s())
            if claiming:
                self.schedule.claiming(sorted(claiming), now)
                await self.sweep_if_due(client)
        until = self.schedule.next_claim
        claiming -= self.schedule.standing_aside(now)
        claims = {s: start for s, start in read_from.items() if s in claiming}
        if claims and (self.per_slot or len(claims) < len(read_from)):
            # Those that claim do so first, without blocking; then everything
            # is read new.
            claimed = await within(
                REPLY_MARGIN_S,
                self._read(client, claims, now, claim=True, block=False),
            )
            if claimed:
                return claimed
            claims = {}
        return await within(
            max(0.0, until - time.monotonic()) + REPLY_MARGIN_S,
            self._read(client, read_from, until, claim=bool(claims)),
        )

    def _behind_gates(self, due: list[str]) -> list[str]:
        """The streams whose gates ``due`` streams are behind: a gate lets
        its consumer claim on every stream behind it."""
        gates = {self.gates[stream] for stream in due}
        return [stream for stream in self.streams if self.gates[stream] in gates]

    async def _read(
        self,
        client: Any,
        read_from: dict[str, Any],
        next_claim: float,
        *,
        claim: bool,
        block: bool = True,
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        started = time.monotonic()
        read = await self.reads.read(
            client, read_from, next_claim, claim=claim, block=block
        )
        if claim:
            await self._note_backlog(client, list(read_from), read, started)
            if any(maybe_reclaimed for _, _, _, maybe_reclaimed in read):
                return await self._screen_reclaimed(client, read)
        return [(stream, entry_id, fields) for stream, entry_id, fields, _ in read]

    async def _note_backlog(
        self,
        client: Any,
        streams: list[str],
        read: list[tuple[str, str, dict[Any, Any], bool]],
        started: float,
    ) -> None:
        """A stream whose claiming read was all reclaimed entries (COUNT is
        per stream) may have more idle: claim it again at once, and open
        the fleet's gate so every consumer with room joins the drain."""
        count = self.reads.count
        reclaimed = dict.fromkeys(streams, 0)
        for stream, _, _, maybe_reclaimed in read:
            reclaimed[stream] += maybe_reclaimed
        backlog = []
        for stream, taken in reclaimed.items():
            full = count is not None and taken >= count
            self.schedule.read_claimed(stream, full=full, started=started)
            if full:
                backlog.append(stream)
        for gate in by_gate(self.gates, backlog):
            await gate.open(client)

    async def drop_trimmed(self, client: ScriptClient) -> None:
        """Where reads reclaim: remove from the PEL entries deleted from the
        stream while pending (CLAIM skips them, so nothing else would), and
        report them as the claim does. Each stream's PEL is walked a batch per
        call, from where the last call stopped (kept here, not in a key).
        Only streams where a plain look finds an entry idle that long are
        swept (after a claiming read, those are the deleted ones)."""
        idle = [
            stream
            for gate, behind in by_gate(self.gates, self.streams).items()
            for stream in await gate.idle_streams(client, behind)
        ]
        for stream in idle:
            keys = StreamKeys(stream, self.group)
            next_start, trimmed = await self.scripts.run(
                client,
                drop_trimmed_call(
                    stream=stream,
                    started=keys.started,
                    group=self.group,
                    min_idle_ms=self.settings.idle_timeout,
                    count=self.settings.batch_size,
                    start=self._sweep_from.get(stream, "-"),
                    consumer=self.consumer,
                ),
            )
            self._sweep_from[stream] = text(next_start)
            report_trimmed(
                self.metrics, stream, [text(entry_id) for entry_id in trimmed]
            )

    async def sweep_if_due(self, client: ScriptClient) -> None:
        """At most once per idle_timeout where reads reclaim."""
        if time.monotonic() < self._next_sweep:
            return
        # Rare: trimmed pending entries only come from XDEL, XTRIM or a
        # producer trimming without ACKED.
        self._next_sweep = time.monotonic() + self.settings.idle_timeout / 1000
        try:
            await self.drop_trimmed(client)
        except Exception as error:
            # Refused (e.g. OOM refuses scripts, not reads) or unreachable:
            # the reads go on, or report it themselves.
            if not waited_out_while_running(error):
                raise
            logger.debug("Sweep for trimmed entries failed: %s", error)
            self._next_sweep = time.monotonic()

    async def _screen_reclaimed(
        self, client: Any, read: list[tuple[str, str, dict[Any, Any], bool]]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """What a claiming read returned, minus the reclaimed entries whose
        task started max_deliveries times in workers that died (moved to
        dead letters, as the Lua claim does): one HMGET per stream that had
        reclaimed entries; the others counted on the server, as the Lua
        claim counts them (reclaim_count.py)."""
        reclaimed: dict[str, list[str]] = {}
        for stream, entry_id, _, maybe_reclaimed in read:
            if maybe_reclaimed:
                reclaimed.setdefault(stream, []).append(entry_id)
        poisoned: set[tuple[str, str]] = set()
        max_deliveries = self.settings.max_deliveries
        for stream, ids in reclaimed.items():
            self.metrics.add("claimed", stream, len(ids))
            logger.debug("Reclaimed %d idle entries from stream %r", len(ids), stream)
            if not max_deliveries:
                self.in_flight.add(stream, ids, reclaimed=True)
                await self.reclaim_counter.add(client, stream, len(ids))
                continue
            keys = StreamKeys(stream, self.group)
            counts = await client.execute_command("HMGET", keys.started, *ids)
            crashed_out_ids: list[tuple[str, int]] = []
            for entry_id, count in zip(ids, counts, strict=True):
                crashes = int(count or 0)
                if not crashed_out(crashes, max_deliveries):
                    # Held from here with its crashes (see suspects.py).
                    self.in_flight.add(stream, [entry_id], crashes, reclaimed=True)
                    continue
                crashed_out_ids.append((entry_id, crashes))
                poisoned.add((stream, entry_id))
            await self.in_flight.dead_lettering.move_crashed_out(
                client, keys, crashed_out_ids
            )
            await self.reclaim_counter.add(
                client, stream, len(ids) - len(crashed_out_ids)
            )
        return [
            (stream, entry_id, fields)
            for stream, entry_id, fields, _ in read
            if (stream, entry_id) not in poisoned
        ]
