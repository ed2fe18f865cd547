"""Timing claim cycles: interleaved, bounded in count and in time.

Subjects (variants, or variant and PEL size) take turns in blocks, in a
rotating order, so slow drift on a shared machine (another process, CPU
frequency) lands on every subject alike. Only the ``cycle()`` call is timed;
handing the batch back is not.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from benchmarks.stats import p50, percentile, rotated
from benchmarks.variants import Claimer

HandBack = Callable[[list[str]], Awaitable[None]]
_BLOCK = 25


@dataclass
class Samples:
    name: str
    latencies_us: list[float] = field(default_factory=list)
    claimed: int = 0
    skipped: int = 0

    def summary(self) -> dict[str, float | int | str]:
        cycles = len(self.latencies_us)
        return {
            "cycles": cycles,
            "p50_us": round(p50(self.latencies_us), 1),
            "p99_us": round(percentile(self.latencies_us, 99), 1),
            "mean_us": round(sum(self.latencies_us) / cycles, 1) if cycles else 0.0,
            "entries_per_cycle": round(self.claimed / cycles, 2) if cycles else 0.0,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class Subject:
    """One thing to time: a claimer and how to hand its batches back."""

    name: str
    claimer: Claimer
    hand_back: HandBack


async def _one(subject: Subject, samples: Samples | None) -> None:
    started = time.perf_counter()
    result = await subject.claimer.cycle()
    elapsed_us = (time.perf_counter() - started) * 1e6
    await subject.hand_back(result.ids)
    if samples is not None:
        samples.latencies_us.append(elapsed_us)
        samples.claimed += len(result.ids)
        samples.skipped += result.skipped


async def measure(
    subjects: list[Subject], cycles: int, warmup: int, max_seconds: float
) -> tuple[dict[str, Samples], bool]:
    """Samples per subject, and whether the time bound cut the run short."""
    for subject in subjects:
        await subject.claimer.prepare()
        for _ in range(warmup):
            await _one(subject, None)
    samples = {subject.name: Samples(subject.name) for subject in subjects}
    deadline = time.monotonic() + max_seconds
    blocks = -(-cycles // _BLOCK)
    for block in range(blocks):
        for subject in rotated(subjects, block):
            for _ in range(min(_BLOCK, cycles - block * _BLOCK)):
                await _one(subject, samples[subject.name])
        if time.monotonic() > deadline:
            return samples, True
    return samples, False
