"""Part 5: claim-cycle latency as the PEL grows (no injected RTT).

Two workloads per PEL size, every variant:

- ``claim``: every cycle claims a full batch of idle entries (the recovery
  cycle of the claim-cycle part);
- ``scan``: nothing is idle long enough, so XAUTOCLAIM scans its bounded
  COUNT*10 PEL entries and claims nothing (the cycle a healthy broker runs
  every claim interval).

The PEL only grows between sizes (entries are added), so the sizes share
one stream; each variant starts with its cursor and keys reset.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from benchmarks import workload
from benchmarks.config import CYCLE_ARGUMENTS, SCAN_ARGUMENTS, BrokerArguments, Mode
from benchmarks.measure import measure
from benchmarks.variants import VARIANTS, Target, coordination_keys, make_claimer

STREAM, GROUP = "bench-scale", "bench-group"
WORKLOADS: dict[str, BrokerArguments] = {
    "claim": CYCLE_ARGUMENTS,
    "scan": SCAN_ARGUMENTS,
}


async def _run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    admin = Redis.from_url(url)
    client = Redis.from_url(url)
    rows = []
    try:
        await workload.create(admin, STREAM, GROUP, coordination_keys(STREAM, GROUP))
        pending = 0
        for size in mode.scale_sizes:
            pending += await workload.add_pending(admin, STREAM, GROUP, size - pending)
            actual = await workload.pending_count(admin, STREAM, GROUP)
            for name, arguments in WORKLOADS.items():
                log(f"scale: {actual} pending, {name}")
                await admin.delete(*coordination_keys(STREAM, GROUP))
                claimers = [
                    make_claimer(
                        variant,
                        client,
                        Target(
                            STREAM,
                            GROUP,
                            f"bench-{variant}",
                            arguments.settings(),
                            arguments.lock_timeout_s,
                        ),
                    )
                    for variant in VARIANTS
                ]

                async def hand_back(ids: list[str]) -> None:
                    await workload.hand_back(admin, STREAM, GROUP, ids)

                samples, truncated = await measure(
                    claimers, hand_back, mode.scale_cycles, mode.warmup, 120
                )
                for variant in VARIANTS:
                    summary = samples[variant].summary()
                    rows.append(
                        {
                            "variant": variant,
                            "workload": name,
                            "pending": actual,
                            "p50_us": summary["p50_us"],
                            "p99_us": summary["p99_us"],
                            "cycles": summary["cycles"],
                            "entries_per_cycle": summary["entries_per_cycle"],
                            "truncated_by_time_bound": truncated,
                        }
                    )
        await admin.delete(STREAM, *coordination_keys(STREAM, GROUP))
    finally:
        await client.aclose()
        await admin.aclose()
    return rows


def run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    return asyncio.run(_run(url, mode, log))
