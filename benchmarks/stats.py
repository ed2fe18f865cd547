"""Percentiles and ratios, computed one way everywhere; and the rotating
order interleaved measurements take turns in."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
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


def rotated(items: Sequence[_T], turn: int) -> list[_T]:
    """``items`` starting at ``turn`` (modulo their number): who goes first
    changes every turn, so drift on a shared machine lands on each alike."""
    shift = turn % len(items)
    return [*items[shift:], *items[:shift]]
