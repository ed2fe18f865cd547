"""What keeps a stream bounded at defaults: the workers trim what no consumer
group needs any more (``lua/trim_consumed.lua``).

XACK only clears the pending list; every task ever kicked would stay in the
stream. So a consumer that read from a stream, or finished some of what it
held, since it last trimmed calls the trim once its interval passed. The
script itself lets the fleet trim each stream at most once per
``TRIM_INTERVAL_MS`` (its gate key), and removes only what every group
has read and acked, so it is safe on every server generation and topology,
on both reclaim paths. It runs after each read step of the listen loop:
that is where a worker's reads, and so its need to trim, come from, on
either path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from taskiq_atomic_claim.claim_gate import FleetCheck
from taskiq_atomic_claim.claim_schedule import ClaimSchedule
from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle
from taskiq_atomic_claim.keys import trim_gate
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.native_reads import NativePathReads
from taskiq_atomic_claim.operations import trim_consumed_call
from taskiq_atomic_claim.reads import GroupReads, LuaPathReads
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import is_passing
from taskiq_atomic_claim.server_info import ServerInfo

logger = logging.getLogger("taskiq.atomic_claim")

# The fleet trims a stream at most this often: what it holds beyond what is
# waiting and in flight is about one interval of traffic.
TRIM_INTERVAL_MS = 1000
# XTRIM ... LIMIT: entries one call may remove (whole nodes, each freed at
# once), so even a stream of millions left by an older release is cut
# without blocking the server for long.
TRIM_LIMIT = 100_000
# With keep_acked, entries age out without any read: trim this often too.
AGED_TRIM_S = 60.0


# Redis 8.2.0 to 8.4.0 trim nothing with MAXLEN ~ ... ACKED (redis/redis
# issue 14656, fixed by pull request 14623): there the kick trims exactly.
APPROXIMATE_ACKED_FIXED = (8, 4, 1)


def kick_maxlen(server: ServerInfo, maxlen: int | None, approximate: bool) -> list[Any]:
    """What a kick's XADD adds for ``maxlen``: ``ACKED MAXLEN ~|= n`` where
    the server trims only entries every group acked (Redis >= 8.2), nothing
    elsewhere: there MAXLEN trims unread and unacked entries too, tasks
    accepted and never run, and the workers' trim bounds the stream."""
    if maxlen is None or not server.acked_trimming:
        return []
    found = server.version_tuple
    exact = not approximate or found is None or found < APPROXIMATE_ACKED_FIXED
    return ["ACKED", "MAXLEN", "=" if exact else "~", maxlen]


class StreamTrim:
    """When one consumer trims each of its streams: after its read steps
    (``TrimmedLuaReads``, ``TrimmedNativeReads``)."""

    def __init__(
        self,
        scripts: ScriptRunner,
        streams: list[str],
        in_flight: EntryLifecycle,
        keep_acked_ms: int,
    ) -> None:
        self.scripts = scripts
        self.streams = streams
        self.in_flight = in_flight
        self.keep_acked_ms = keep_acked_ms
        self._next: dict[str, float] = {}
        self._last: dict[str, float] = {}
        # Streams not trimmed since this consumer started: the first read
        # step trims what an older release or a stopped fleet left behind,
        # or finds that another consumer just did.
        self._unchecked = set(streams)
        # Per stream: entries read since the last trim call, and how many
        # of its entries this consumer held then.
        self._read = dict.fromkeys(streams, 0)
        self._held: dict[str, int] = {}
        self._warned = False

    def read(self, stream: str) -> None:
        """An entry of ``stream`` was read by this consumer."""
        self._read[stream] = self._read.get(stream, 0) + 1

    async def after_read(
        self, client: Any, batch: list[tuple[str, str, dict[Any, Any]]]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """After a read step: count what it read, trim the streams due, and
        hand ``batch`` on."""
        for stream, _, _ in batch:
            self.read(stream)
        await self.trim_if_due(client)
        return batch

    def due(self, now: float) -> list[str]:
        due = []
        for stream in self.streams:
            if now < self._next.get(stream, 0.0):
                continue
            changed = (
                stream in self._unchecked
                or self._read.get(stream, 0) > 0
                or len(self.in_flight[stream]) < self._held.get(stream, 0)
            )
            aged = (
                self.keep_acked_ms > 0
                and now >= self._last.get(stream, 0.0) + AGED_TRIM_S
            )
            if changed or aged:
                due.append(stream)
        return due

    async def trim_if_due(self, client: Any) -> None:
        """Trim each stream due; never fails the caller: a trim that cannot
        run now (outage, a user without +xtrim) leaves the stream longer
        until the next one. A call another broker's trim kept out (its gate)
        stays due, so what this consumer acked since is trimmed next time."""
        now = time.monotonic()
        for stream in self.due(now):
            self._next[stream] = now + TRIM_INTERVAL_MS / 1000
            held = len(self.in_flight[stream])
            try:
                trimmed, _ = await within(REPLY_MARGIN_S, self.trim(client, stream))
            except Exception as error:
                trimmed = 0
                if is_passing(error):
                    logger.debug("Trim of stream %r failed: %s", stream, error)
                else:
                    logger.log(
                        logging.DEBUG if self._warned else logging.WARNING,
                        "Cannot trim stream %r (it keeps acked entries until"
                        " a trim works): %s",
                        stream,
                        error,
                    )
                    self._warned = True
            # Kept out (-1): another consumer trimmed within the interval,
            # so what was left before this one started is gone; its own
            # reads since keep the stream due.
            self._unchecked.discard(stream)
            if trimmed != -1:
                self._last[stream] = now
                self._read[stream] = 0
                self._held[stream] = held

    def keep_from_ms(self) -> int:
        """0, or the id time from which entries are kept: keep_acked ago, by
        this worker's clock (ids carry the server's; a skew of seconds
        against a keep_acked meant in hours)."""
        if not self.keep_acked_ms:
            return 0
        return max(1, time.time_ns() // 1_000_000 - self.keep_acked_ms)

    async def trim(self, client: Any, stream: str) -> tuple[int, str]:
        """One trim call: entries removed (-1: another call trimmed within
        the interval) and the bound."""
        trimmed, bound = await self.scripts.run(
            client,
            trim_consumed_call(
                stream=stream,
                trim_gate=trim_gate(stream),
                interval_ms=TRIM_INTERVAL_MS,
                keep_from_ms=self.keep_from_ms(),
                limit=TRIM_LIMIT,
            ),
        )
        if int(trimmed) > 0:
            logger.debug(
                "Trimmed %d entries below %s from stream %r",
                int(trimmed),
                text(bound),
                stream,
            )
        return int(trimmed), text(bound)


class TrimmedLuaReads(LuaPathReads):
    """The Lua path's read step, then the trim of the streams due."""

    def __init__(
        self, reads: GroupReads, schedule: ClaimSchedule, trim: StreamTrim
    ) -> None:
        super().__init__(reads, schedule)
        self.trim = trim

    async def step(
        self, client: Any, read_from: dict[str, Any]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        return await self.trim.after_read(client, await super().step(client, read_from))


class TrimmedNativeReads(NativePathReads):
    """The read step where reads reclaim, then the trim of the streams due."""

    def __init__(
        self,
        reads: GroupReads,
        schedule: ClaimSchedule,
        scripts: ScriptRunner,
        in_flight: EntryLifecycle,
        metrics: ReclaimMetrics,
        trim: StreamTrim,
        gates: dict[str, FleetCheck],
        *,
        per_slot: bool = False,
    ) -> None:
        super().__init__(
            reads, schedule, scripts, in_flight, metrics, gates, per_slot=per_slot
        )
        self.trim = trim

    async def step(
        self, client: Any, read_from: dict[str, Any]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        return await self.trim.after_read(client, await super().step(client, read_from))
