"""Percentiles and ratios, computed one way everywhere."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


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
