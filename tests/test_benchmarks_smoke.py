"""The benchmark suite runs end to end and writes figures of the right shape.

One run of ``python -m benchmarks --smoke`` (every part, briefly: ``--quick``
takes about two minutes) in a subprocess; the test checks the JSON's keys,
rows and signs, never its timings, which belong to the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"atomic", "plain_lock", "bare_xautoclaim", "upstream_1_2_4"}


def test_benchmark_smoke_run_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--json", str(out)],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())

    for key in (
        "machine",
        "claim_cycle",
        "round_trips",
        "server_cpu",
        "contention",
        "scale",
        "e2e",
        "throughput",
        "targets",
    ):
        assert results.get(key), f"missing or empty: {key}"

    machine = results["machine"]
    assert machine["cores"] > 0
    assert machine["cpu_model"]
    assert machine["server"]["redis_version"] or machine["server"]["valkey_version"]
    assert machine["date"]
    assert machine["latency_method"] in ("netem", "proxy")

    cycle_rows = results["claim_cycle"]
    assert {row["variant"] for row in cycle_rows} == VARIANTS
    rtts = {row["rtt_ms"] for row in cycle_rows}
    assert 0 in rtts and len(rtts) >= 2
    assert len(cycle_rows) == len(VARIANTS) * len(rtts)
    for row in cycle_rows:
        assert row["p50_us"] > 0
        assert row["p99_us"] >= row["p50_us"]
        assert row["round_trips"] >= 1
    assert {row["variant"] for row in results["round_trips"]} == VARIANTS
    assert all(row["server_usec_per_cycle"] > 0 for row in results["server_cpu"])

    contention = results["contention"]
    assert {row["variant"] for row in contention} == VARIANTS
    for row in contention:
        assert row["claimers"] >= 1
        assert row["claims_per_s"] > 0
        assert isinstance(row["double_claims"], int)
        assert row["double_claims"] >= 0
        if row["variant"] == "atomic":
            # A property of the script, not a timing: one holder per lease.
            assert row["double_claims"] == 0

    assert {row["variant"] for row in results["scale"]} == VARIANTS
    assert all(row["p50_us"] > 0 and row["pending"] > 0 for row in results["scale"])
    assert {(row["broker"], row["queue"]) for row in results["e2e"]} == {
        (broker, queue)
        for broker in ("atomic", "upstream_1_2_4")
        for queue in ("idle", "busy")
    }
    assert all(row["kills"] >= 1 for row in results["e2e"])
    assert {row["broker"] for row in results["throughput"]} == {
        "atomic",
        "upstream_1_2_4",
    }
    assert all(row["messages_per_s"] > 0 for row in results["throughput"])
    assert all(
        target["result"] in ("PASS", "MISS", "not measured")
        for target in results["targets"]
    )
    assert (tmp_path / "claim_latency.png").stat().st_size > 0
