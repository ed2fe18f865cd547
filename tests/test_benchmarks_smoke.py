"""The benchmark suite runs end to end and writes figures of the right shape.

One run of ``python -m benchmarks --smoke`` (every part, briefly) in a
subprocess; the test checks the JSON's keys, rows and signs, never its
timings, which belong to the machine. The published results file renders,
and the report gives no verdict for a configuration the brokers refuse.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report
from benchmarks.config import MODES, refusal

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results.json"
VERDICTS = {"PASS", "MISS", "info", "not measured", "no verdict"}


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_benchmark_smoke_run_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = _bench("--smoke", "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-12000:]
    (run,) = json.loads(out.read_text())["runs"]

    parts = ("hotpath", "e2e", "mass_recovery", "orphan_drain", "fleet_idle")
    for key in ("command", "machine", *parts):
        assert run.get(key), f"missing or empty: {key}"
    machine = run["machine"]
    assert machine["cores"] > 0
    assert machine["cpu_model"]
    assert machine["server"]["redis_version"] or machine["server"]["valkey_version"]
    assert machine["date"]

    assert {(row["broker"], row["queue"]) for row in run["e2e"]} == {
        (broker, queue)
        for broker in ("atomic", "upstream_1_2_4")
        for queue in ("idle", "busy")
    }
    assert all(row["kills"] >= 1 for row in run["e2e"])
    mass = run["mass_recovery"]
    assert {row["broker"] for row in mass} == {
        "atomic",
        "atomic_large_batch",
        "upstream_1_2_4",
    }
    for row in mass:
        assert row["orphans"] > 0 and row["floor_s"] > 0
        assert row["drain_s"] is None or row["drain_s"] > 0
        assert 0 <= row["orphans_left"] <= row["orphans"]
        assert (row["drain_s"] is None) == (row["orphans_left"] > 0)
        assert row["new_kicked"] > 0
        assert 0 <= row["new_censored"] <= row["new_kicked"]
        assert row["new_wait_p99_s"] >= row["new_wait_p50_s"] >= 0
    for row in run["orphan_drain"]:
        assert 0 <= row["orphans_left"] <= row["orphans"]
        assert (row["per_s"] is None) == (row["orphans_left"] > 0)
    idle = run["fleet_idle"]
    assert {row["broker"] for row in idle} == {"atomic", "upstream_1_2_4"}
    for row in idle:
        assert row["workers"] >= 1 and row["streams"] >= 1
        assert row["with_nested_per_s"] >= row["commands_per_s"] >= 0
        assert row["server_usec_per_s"] >= 0
        assert row["server_cpu_usec_per_s"] > 0
    # The atomic broker looks for idle entries on its own schedule, so even
    # idle it sends the fleet's gate and look (top-level, no script while
    # nothing is idle): MONITOR saw them.
    atomic_idle = next(row for row in idle if row["broker"] == "atomic")
    assert {"SET", "XPENDING"} <= set(atomic_idle["monitor_outer"])

    hotpath = run["hotpath"]
    light = hotpath["settings"]["light_tasks"]
    # The light load ran on fresh workers twice, as a full run does five times.
    assert hotpath["settings"]["light_processes"] == 2
    for row in hotpath["rows"]:
        # Every variant's workers got their share of the light load's turns.
        assert row["light_tasks"] == light, row["variant"]
        assert row["light_p99_ms"] >= row["light_p50_ms"] > 0
    intervals = hotpath["light_intervals"]
    assert set(intervals) == {"light_p50_ms", "light_p99_ms"}
    assert all(0 < low <= high for low, high in intervals.values())
    targets = {target["target"]: target for target in report.targets(run)}
    assert all(target["result"] in VERDICTS for target in targets.values())
    hot = [t for name, t in targets.items() if name.startswith("hot path: ")]
    assert len(hot) == 6
    # p99 is shown with no goal of its own.
    assert next(t for t in hot if "p99" in t["target"])["result"] == "info"
    for name in (
        "mass recovery: drain time / execution floor (defaults)",
        "mass recovery: new-task p99 wait, s (defaults)",
    ):
        assert name in targets
    assert any(name.startswith("SIGKILL->rerun p99") for name in targets)
    assert any(name.startswith("idle fleet") for name in targets)
    assert "Targets" in done.stdout


def test_the_published_results_render() -> None:
    done = _bench("--from-json", str(RESULTS), timeout=60)
    assert done.returncode == 0, done.stderr[-12000:]
    for run in json.loads(RESULTS.read_text())["runs"]:
        assert run["command"].startswith("python -m benchmarks")
        assert run["machine"]["date"] in done.stdout
        assert run["machine"]["cpu_model"] in done.stdout


def test_every_configuration_a_mode_measures_is_one_the_brokers_run() -> None:
    for mode in MODES.values():
        for configuration in mode.configurations():
            assert refusal(**configuration) is None, (mode.name, configuration)


def _e2e_row(idle_timeout_ms: int, claim_interval_ms: int) -> dict[str, Any]:
    return {
        "broker": "atomic",
        "queue": "idle",
        "kills": 1,
        "recovered": 1,
        "p99_s": 0.1,
        "bound_s": 1.0,
        "idle_timeout_ms": idle_timeout_ms,
        "claim_interval_ms": claim_interval_ms,
    }


def _fleet_rows(idle_timeout: int) -> list[dict[str, Any]]:
    return [
        {
            "broker": broker,
            "workers": 1,
            "streams": 1,
            "idle_timeout": idle_timeout,
            "commands_per_s": 5.0,
            "with_nested_per_s": 5.0,
            "server_usec_per_s": 10.0,
            "server_cpu_usec_per_s": 1000.0,
        }
        for broker in ("atomic", "upstream_1_2_4")
    ]


@pytest.mark.parametrize(
    ("run", "refused"),
    [
        ({"e2e": [_e2e_row(2000, 500)]}, False),
        # claim_interval must be shorter than idle_timeout.
        ({"e2e": [_e2e_row(500, 2000)]}, True),
        ({"fleet_idle": _fleet_rows(60_000)}, False),
        # idle_timeout must be >= 2 ms.
        ({"fleet_idle": _fleet_rows(1)}, True),
    ],
)
def test_a_refused_configuration_gets_no_verdict(
    run: dict[str, Any], refused: bool
) -> None:
    results = {t["result"] for t in report.targets(run)}
    assert results
    if refused:
        assert results == {"no verdict"}
    else:
        assert results <= {"PASS", "MISS", "info"}


def test_a_lease_longer_than_idle_timeout_is_refused() -> None:
    assert refusal(idle_timeout=200, claim_interval=100) is None
    said = refusal(idle_timeout=100, claim_interval=50, lock_timeout_s=0.4)
    assert said is not None and "idle_timeout" in said


def test_a_named_build_that_is_absent_skips_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import cli  # noqa: PLC0415

    monkeypatch.setattr(cli, "BUILT_SERVERS", tmp_path)
    # As on a machine where the suite's own discovery finds no 8.6 build.
    monkeypatch.setattr(cli, "find_binaries", list)
    assert cli.main(["--server", "redis-8.6.3", "--smoke"]) == 0
    said = capsys.readouterr().err
    assert "skipped" in said
    assert str(tmp_path / "redis-8.6.3" / "redis-server") in said


def test_a_named_build_that_is_present_is_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import cli  # noqa: PLC0415

    built = tmp_path / "redis-8.6.3" / "redis-server"
    built.parent.mkdir()
    # Stands in for the binary only as far as --version: nothing is started.
    built.write_text("#!/bin/sh\necho 'Redis server v=8.6.3 sha=00000000:0'\n")
    built.chmod(0o755)
    monkeypatch.setattr(cli, "BUILT_SERVERS", tmp_path)
    monkeypatch.setattr(cli, "find_binaries", list)
    binary = cli.choose_binary("redis-8.6.3")
    assert (binary.label, binary.path) == ("redis-8.6.3", built)
