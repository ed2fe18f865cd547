"""One consumer's XREADGROUP (``GroupReads``), and the Lua path's read step
(``LuaPathReads``): new entries only, never blocking past the next claim.

Where reads reclaim (Redis >= 8.4) the same read carries ``CLAIM``; that
path's step is in ``native_reads.py``.
"""

from __future__ import annotations

import time
from typing import Any

from taskiq_atomic_claim.claim_schedule import BeforeCall, ClaimSchedule, no_check
from taskiq_atomic_claim.group_recovery import GroupPositions
from taskiq_atomic_claim.replies import ReadEntry, read_entries
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within

# read_entries: as it was imported from here before.
__all__ = ["GroupReads", "LuaPathReads", "ReadEntry", "read_entries"]


class GroupReads:
    """XREADGROUP as one consumer of its group, bounded by the claim schedule."""

    def __init__(
        self,
        group: str,
        consumer: str,
        block_ms: int,
        count: int | None,
        idle_timeout_ms: int,
        positions: GroupPositions,
        *,
        before_call: BeforeCall = no_check,
    ) -> None:
        self.group = group
        self.consumer = consumer
        self.block_ms = block_ms
        self.count = count
        self.idle_timeout_ms = idle_timeout_ms
        self.positions = positions
        # Sentinel: claims can be minutes apart (idle_timeout / 4 by
        # default); reads, at least every xread_block, check for a replaced
        # master too.
        self.before_call = before_call

    async def read(
        self,
        client: Any,
        read_from: dict[str, Any],
        next_claim: float,
        *,
        claim: bool = False,
        block: bool = True,
    ) -> list[ReadEntry]:
        """New entries; with ``claim`` (Redis >= 8.4) idle pending entries
        first, taken over by the read itself. Without ``block`` it returns
        at once."""
        await self.before_call(client)
        # Never block past the next claim: reclaim must not wait for traffic.
        until = max(1, int((next_claim - time.monotonic()) * 1000))
        block_ms = (
            (min(self.block_ms, until) if self.block_ms else until) if block else None
        )
        extra = {"claim_min_idle_time": self.idle_timeout_ms} if claim else {}
        fetched = await client.xreadgroup(
            self.group,
            self.consumer,
            read_from,
            block=block_ms,
            count=self.count,
            **extra,
        )
        read = read_entries(fetched)
        for stream, entry_id, _, _ in read:
            self.positions.advance(stream, entry_id)
        return read


class LuaPathReads:
    """The Lua path's read step: new entries until the next claim at most."""

    def __init__(self, reads: GroupReads, schedule: ClaimSchedule) -> None:
        self.reads = reads
        self.schedule = schedule

    async def step(
        self, client: Any, read_from: dict[str, Any]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """One bounded read: until the next claim at most."""
        until = self.schedule.next_claim
        read = await within(
            max(0.0, until - time.monotonic()) + REPLY_MARGIN_S,
            self.reads.read(client, read_from, until),
        )
        return [(stream, entry_id, fields) for stream, entry_id, fields, _ in read]
