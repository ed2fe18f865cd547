"""The interval the hot-path part quotes beside a light-load ratio: what a
ratio measured once on a noisy machine can and cannot say. Delays come in
groups, one per pair of worker processes measured side by side; a single
group is a run with one process per variant."""

from __future__ import annotations

import random

from benchmarks.hotpath import ATOMIC, GOALS, UPSTREAM, targets
from benchmarks.stats import p50, paired_ratio_interval, percentile


def _delays(seed: int, n: int = 600) -> list[float]:
    rng = random.Random(seed)
    return [0.6 + rng.expovariate(8) for _ in range(n)]


def p99(values: list[float]) -> float:
    return percentile(values, 99)


def test_a_ratio_that_holds_in_every_round_has_no_spread() -> None:
    theirs = _delays(1)
    mine = [0.9 * d for d in theirs]
    low, high = paired_ratio_interval([mine], [theirs], p50)
    assert 0.9 - 1e-9 <= low <= high <= 0.9 + 1e-9


def test_two_draws_of_one_distribution_are_level() -> None:
    """Neither is ahead: the interval holds 1.0, and it is wide enough to
    show why one run's point ratio flips from side to side."""
    for seed in range(5):
        low, high = paired_ratio_interval([_delays(seed)], [_delays(seed + 100)], p50)
        assert low < 1.0 < high, seed
        low99, high99 = paired_ratio_interval(
            [_delays(seed)], [_delays(seed + 100)], p99
        )
        assert low99 < 1.0 < high99, seed
        assert high99 - low99 > high - low  # a tail is known less well


def test_a_real_gap_is_told_apart() -> None:
    theirs = _delays(7)
    slower = [d + 0.1 for d in _delays(8)]
    low, _ = paired_ratio_interval([slower], [theirs], p50)
    assert low > 1.0
    _, high = paired_ratio_interval([theirs], [slower], p50)
    assert high < 1.0


def test_the_interval_is_the_same_every_time_it_is_computed() -> None:
    mine, theirs = _delays(3), _delays(4)
    assert paired_ratio_interval([mine], [theirs], p99) == paired_ratio_interval(
        [mine], [theirs], p99
    )


def test_each_worker_process_keeping_its_own_speed_widens_the_interval() -> None:
    """Identical code in two worker processes is not equally fast: each
    process keeps an offset of its own for its whole life (measured here:
    up to 1.7% at p50 between four taskiq-redis workers in one run). Rounds
    resampled within one pair of processes cannot see that, and call such
    an offset a real gap; the process pairs resampled too can."""
    # Five pairs of processes running the same code, each process a little
    # faster or slower than another, by offsets drawn alike for both sides.
    mine_offsets = (1.05, 0.97, 1.06, 1.04, 0.99)
    their_offsets = (0.98, 1.02, 0.97, 1.00, 1.01)
    mine = [[f * d for d in _delays(10 + n)] for n, f in enumerate(mine_offsets)]
    theirs = [[f * d for d in _delays(20 + n)] for n, f in enumerate(their_offsets)]
    low, high = paired_ratio_interval(mine, theirs, p50)
    assert low < 1.0 < high
    pooled_low, _ = paired_ratio_interval(
        [[d for group in mine for d in group]],
        [[d for group in theirs for d in group]],
        p50,
    )
    assert pooled_low > 1.0  # the pooled rounds alone would call it a gap


def test_the_light_targets_quote_their_interval() -> None:
    rows = [
        {"variant": v, **{key: 1.0 for key, *_ in GOALS}} for v in (ATOMIC, UPSTREAM)
    ]
    part = {
        "rows": rows,
        "light_intervals": {"light_p50_ms": [0.97, 1.02], "light_p99_ms": [0.9, 1.1]},
    }
    notes = {t["target"]: t["note"] for t in targets(part)}
    p50_note = next(n for t, n in notes.items() if "kick-to-start p50" in t)
    p99_note = next(n for t, n in notes.items() if "kick-to-start p99" in t)
    assert "95% interval 0.97-1.02" in p50_note
    assert "95% interval 0.90-1.10" in p99_note
    drain_note = next(n for t, n in notes.items() if "drain rate" in t)
    assert "interval" not in drain_note
