"""``serve``'s own history: a ring buffer of readings per (stream, group),
kept in memory (gone on restart: a Prometheus server keeps longer ones;
docs/grafana/ has a dashboard over the same gauges).

A sample holds running totals and levels read from the server itself, so
rates come from the differences of two samples whoever kicked or ran the
tasks: ``kicked`` (entries added: the group's entries-read plus its lag),
``acked`` (entries-read minus pending), the dead-letter count, the backlog
(lag plus pending), the oldest pending entry's idle time, and
``reclaimed``: the workers' count of reclaims (``reclaim_count.py``), kept
here as a running total that a reset of that count (it lapses a day after
the last reclaim) does not lower. Kicked and acked need Redis >= 7
(entries-read, lag); before, they are null and only the other series are
drawn.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any

from taskiq_atomic_claim.admin.inspection import Inspection
from taskiq_atomic_claim.reclaim_count import increase

HISTORY_S = 3600.0  # what is kept: at least the last hour
MAX_SAMPLES = 3600
# The dead letters the diagnosis counts as "added lately".
DEAD_LETTER_WINDOW_MS = 300_000
FIELDS = (
    "at_ms",
    "kicked",
    "acked",
    "dead_letters",
    "backlog",
    "oldest_ms",
    "reclaimed",
)


class History:
    """The last ``HISTORY_S`` seconds of samples, at most one per
    ``sample_s``; a (stream, group) no longer read is forgotten."""

    def __init__(self, sample_s: float) -> None:
        self.sample_s = sample_s
        self.size = min(MAX_SAMPLES, math.ceil(HISTORY_S / sample_s) + 1)
        self.samples: dict[tuple[str, str], deque[tuple[Any, ...]]] = {}
        # Per (stream, group): the reclaimed count as last read.
        self._reclaimed_read: dict[tuple[str, str], int] = {}
        self.last_at_ms = -math.inf

    def add(self, inspection: Inspection, at_ms: int) -> bool:
        """Sample ``inspection`` read at ``at_ms``, unless the last sample
        is less than ``sample_s`` older; True when sampled."""
        if at_ms - self.last_at_ms < self.sample_s * 1000 * 0.9:
            return False
        self.last_at_ms = at_ms
        seen = set()
        for stream in inspection.streams:
            for group in stream.groups:
                if not group.exists:
                    continue
                pair = (stream.name, group.name)
                seen.add(pair)
                read, lag = group.entries_read, group.lag
                if read is None and lag is not None:
                    read = 0  # Redis 7: a group that never read has none
                known = read is not None and lag is not None
                ring = self.samples.setdefault(pair, deque(maxlen=self.size))
                was = self._reclaimed_read.get(pair)
                self._reclaimed_read[pair] = group.reclaimed
                reclaimed = (
                    ring[-1][6] + increase(was, group.reclaimed)
                    if ring and was is not None
                    else 0
                )
                ring.append(
                    (
                        at_ms,
                        read + lag if known else None,  # type: ignore[operator]
                        read - group.pending if read is not None else None,
                        group.dead_letters,
                        None if lag is None else lag + group.pending,
                        group.oldest_pending_idle_ms or 0,
                        reclaimed,
                    )
                )
        for gone in set(self.samples) - seen:
            del self.samples[gone]
            self._reclaimed_read.pop(gone, None)
        return True

    def dead_letters_added(
        self, window_ms: int = DEAD_LETTER_WINDOW_MS
    ) -> dict[tuple[str, str], tuple[int, int]]:
        """Per (stream, group) with two samples or more: dead letters added
        over the last ``window_ms`` (requeues and deletes not subtracted),
        and over how many ms that is."""
        added: dict[tuple[str, str], tuple[int, int]] = {}
        for pair, ring in self.samples.items():
            recent = [s for s in ring if s[0] >= ring[-1][0] - window_ms]
            if len(recent) < 2:
                continue
            counts = [s[3] for s in recent]
            grown = sum(max(0, b - a) for a, b in itertools.pairwise(counts))
            added[pair] = (grown, recent[-1][0] - recent[0][0])
        return added

    def to_json(self) -> dict[str, Any]:
        """``GET /api/history``."""
        return {
            "sample_s": self.sample_s,
            "fields": list(FIELDS),
            "groups": [
                {"stream": stream, "group": group, "samples": list(ring)}
                for (stream, group), ring in sorted(self.samples.items())
            ],
        }
