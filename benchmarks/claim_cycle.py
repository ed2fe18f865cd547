"""Part 1-3: claim-cycle latency per RTT, round trips and server time per cycle.

One stream, one PEL of ``mode.cycle_pending`` long-idle entries, one set of
settings; every variant claims a full batch each cycle (see workload.py).
Latency is measured by ``benchmarks.cycle_client`` in its own process behind
the latency path; round trips, commands and server time are measured here,
over loopback, since none of them depends on the RTT. ``native_claim`` runs
only where the server has XREADGROUP ... CLAIM (Redis >= 8.4).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

from redis.asyncio import Redis

from benchmarks import roundtrips, server_cpu, workload
from benchmarks.config import CYCLE_ARGUMENTS, REPO_ROOT, Mode
from benchmarks.netpath import LatencyPath
from benchmarks.variants import LUA_FLOOR, NATIVE_CLAIM, VARIANTS, coordination_keys
from taskiq_atomic_claim.server_info import read_server_info

STREAM, GROUP = "bench-cycle", "bench-group"


async def _prepare(port: int, pending: int, log: Any) -> tuple[str, ...]:
    """The stream and its PEL; the variants this server can run."""
    client = Redis.from_url(f"redis://127.0.0.1:{port}")
    try:
        await workload.create(client, STREAM, GROUP, coordination_keys(STREAM, GROUP))
        await workload.add_pending(client, STREAM, GROUP, pending)
        server = await read_server_info(client)
    finally:
        await client.aclose()
    if server.native_claim:
        return (*VARIANTS, LUA_FLOOR, NATIVE_CLAIM)
    log(
        f"claim cycle: {NATIVE_CLAIM} skipped: {server.name} has no"
        " XREADGROUP ... CLAIM (Redis >= 8.4)"
    )
    return (*VARIANTS, LUA_FLOOR)


def _latency_at(
    path: LatencyPath, rtt_ms: float, mode: Mode, variants: tuple[str, ...]
) -> dict[str, Any]:
    path.set_rtt(rtt_ms)
    # Generous: the slowest variant at 2 ms RTT is about 10 ms per cycle.
    max_seconds = 30 + mode.cycles * len(variants) * (8 * rtt_ms + 2) / 1000 * 3
    spec = {
        "url": path.client_url,
        "hand_back_url": path.hand_back_url,
        "stream": STREAM,
        "group": GROUP,
        "variants": list(variants),
        "cycles": mode.cycles,
        "warmup": mode.warmup,
        "max_seconds": max_seconds,
        "arguments": CYCLE_ARGUMENTS.as_dict(),
    }
    argv = path.command(
        [sys.executable, "-m", "benchmarks.cycle_client", json.dumps(spec)]
    )
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=max_seconds + 90,
        check=False,
        cwd=REPO_ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cycle client failed at {rtt_ms} ms: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def _counts_and_cpu(
    port: int, mode: Mode, variants: tuple[str, ...]
) -> dict[str, Any]:
    url = f"redis://127.0.0.1:{port}"
    counted: dict[str, Any] = {}
    cpu = []
    for variant in variants:
        turns, commands = await roundtrips.count_variant(
            port, variant, STREAM, GROUP, CYCLE_ARGUMENTS, mode.count_cycles
        )
        counted[variant] = {
            "variant": variant,
            "round_trips": round(turns, 2),
            **commands.per_cycle(mode.count_cycles),
        }
        cpu.append(
            await server_cpu.measure_variant(
                url, variant, STREAM, GROUP, CYCLE_ARGUMENTS, mode.cpu_cycles, commands
            )
        )
    fidelity = await roundtrips.upstream_fidelity(port, CYCLE_ARGUMENTS)
    return {
        "round_trips": list(counted.values()),
        "server_cpu": cpu,
        "fidelity": fidelity,
    }


def run(port: int, path: LatencyPath, mode: Mode, log: Any) -> dict[str, Any]:
    path.attach(port)
    variants = asyncio.run(_prepare(port, mode.cycle_pending, log))
    counted = asyncio.run(_counts_and_cpu(port, mode, variants))
    trips = {row["variant"]: row["round_trips"] for row in counted["round_trips"]}
    rows = []
    truncated = False
    for rtt_ms in mode.rtts_ms:
        log(f"claim cycle: {rtt_ms} ms RTT ({path.method})")
        result = _latency_at(path, rtt_ms, mode, variants)
        truncated = truncated or result["truncated"]
        for variant in variants:
            summary = result["variants"][variant]
            rows.append(
                {
                    "variant": variant,
                    "rtt_ms": rtt_ms,
                    "measured_rtt_us": result["measured_rtt_us"],
                    "path_rtt_us": round(path.injected_rtt_us, 1),
                    "p50_us": summary["p50_us"],
                    "p99_us": summary["p99_us"],
                    "mean_us": summary["mean_us"],
                    "cycles": summary["cycles"],
                    "entries_per_cycle": summary["entries_per_cycle"],
                    "round_trips": trips[variant],
                }
            )
    path.set_rtt(0)
    return {
        "claim_cycle": rows,
        "claim_cycle_settings": {
            **CYCLE_ARGUMENTS.as_dict(),
            "pending": mode.cycle_pending,
            "truncated_by_time_bound": truncated,
        },
        **counted,
    }
