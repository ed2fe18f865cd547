"""Percentiles and ratios, computed one way everywhere; and the rotating
order interleaved measurements take turns in."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

_T = TypeVar("_T")


def p50(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually observed."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def ratio(numerator: float, denominator: float) -> float:
    if denominator == 0 or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


def paired_ratio_interval(
    mine: Sequence[Sequence[float]],
    theirs: Sequence[Sequence[float]],
    stat: Callable[[list[float]], float],
    resamples: int = 1000,
) -> tuple[float, float]:
    """A 95% bootstrap interval of ``stat(mine) / stat(theirs)``, all of each
    pooled. ``mine[g][i]`` and ``theirs[g][i]`` were measured side by side:
    the g-th pair of worker processes, in round i. Both levels are
    resampled: the pairs (a worker process keeps its own speed for its whole
    life), then the rounds of each pair picked, each round whole, so what a
    round shared (the machine's state) stays paired. An interval holding 1.0
    says the run cannot tell the two apart. Seeded: the same figures give
    the same interval."""
    draw = random.Random(0).choices
    pairs = min(len(mine), len(theirs))
    ratios = []
    for _ in range(resamples):
        picked_mine: list[float] = []
        picked_theirs: list[float] = []
        for pair in draw(range(pairs), k=pairs):
            rounds = min(len(mine[pair]), len(theirs[pair]))
            picked = draw(range(rounds), k=rounds)
            picked_mine.extend(mine[pair][i] for i in picked)
            picked_theirs.extend(theirs[pair][i] for i in picked)
        ratios.append(ratio(stat(picked_mine), stat(picked_theirs)))
    return percentile(ratios, 2.5), percentile(ratios, 97.5)


def rotated(items: Sequence[_T], turn: int) -> list[_T]:
    """``items`` starting at ``turn`` (modulo their number): who goes first
    changes every turn, so drift on a shared machine lands on each alike."""
    shift = turn % len(items)
    return [*items[shift:], *items[:shift]]
