"""Chaos soak: 10k messages, 3 real workers, SIGKILLs and a server restart.

Short here; the long run (>= 50 kills) with --slow. Each server is one this
suite starts itself, with an fsync-always AOF so its restart loses nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from taskiq_atomic_claim.harness.soak import durable_server, run_soak
from tests.conftest import _BINARIES

# 6.2 loses its scripts on restart (EVALSHA path); 7.x keeps functions.
SOAK_SERVERS = [label for label in _BINARIES if label.startswith("redis-")]


def check(report_lines: list[str], ok: bool) -> None:
    print("\n".join(report_lines))
    assert ok, "\n".join(report_lines)


@pytest.mark.parametrize("label", SOAK_SERVERS)
def test_short_soak_loses_nothing(label: str, tmp_path: Path) -> None:
    with durable_server(_BINARIES[label]) as server:
        report = asyncio.run(
            run_soak(
                server,
                messages=10_000,
                kills=5,
                kill_every=2.0,
                time_limit=240,
                log_dir=tmp_path,
            )
        )
    assert report.kills == 5
    assert report.server_restarts == 1
    assert report.executed_once_or_more == 10_000
    assert report.left_pending == 0
    assert report.duplicates <= report.in_flight_at_kills
    check(report.lines(), report.ok)


@pytest.mark.slow
def test_long_soak_loses_nothing(tmp_path: Path) -> None:
    label = max(SOAK_SERVERS, key=lambda key: _BINARIES[key].major)
    with durable_server(_BINARIES[label]) as server:
        report = asyncio.run(
            run_soak(
                server,
                messages=10_000,
                kills=50,
                kill_every=3.0,
                time_limit=1200,
                log_dir=tmp_path,
            )
        )
    assert report.kills == 50
    check(report.lines(), report.ok)
