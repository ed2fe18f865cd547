"""Part 5: claim-cycle latency as the PEL grows (no injected RTT).

One stream per PEL size (100, 10k, 100k), all on the server at once, and
two workloads, every variant:

- ``claim``: every cycle claims a full batch of idle entries (the recovery
  cycle of the claim-cycle part);
- ``scan``: nothing is idle long enough, so XAUTOCLAIM scans its bounded
  COUNT*10 PEL entries and claims nothing (the cycle a healthy broker runs
  every claim interval).

Within a workload every (variant, size) pair is timed interleaved with the
others, so a busy moment on the machine cannot land on one size only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from benchmarks import workload
from benchmarks.config import CYCLE_ARGUMENTS, SCAN_ARGUMENTS, BrokerArguments, Mode
from benchmarks.measure import Subject, measure
from benchmarks.variants import VARIANTS, Target, coordination_keys, make_claimer

GROUP = "bench-group"
WORKLOADS: dict[str, BrokerArguments] = {
    "claim": CYCLE_ARGUMENTS,
    "scan": SCAN_ARGUMENTS,
}


def _stream(size: int) -> str:
    return f"bench-scale-{size}"


def _hand_back(admin: Redis, stream: str) -> Any:
    async def hand_back(ids: list[str]) -> None:
        await workload.hand_back(admin, stream, GROUP, ids)

    return hand_back


async def _run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    admin = Redis.from_url(url)
    client = Redis.from_url(url)
    streams = {size: _stream(size) for size in mode.scale_sizes}
    rows = []
    try:
        for size, stream in streams.items():
            await workload.create(
                admin, stream, GROUP, coordination_keys(stream, GROUP)
            )
            await workload.add_pending(admin, stream, GROUP, size)
        pending = {
            size: await workload.pending_count(admin, stream, GROUP)
            for size, stream in streams.items()
        }
        for name, arguments in WORKLOADS.items():
            log(f"scale: {name} workload, PEL sizes {list(pending.values())}")
            subjects = []
            for size, stream in streams.items():
                await admin.delete(*coordination_keys(stream, GROUP))
                for variant in VARIANTS:
                    target = Target.of(stream, GROUP, f"bench-{variant}", arguments)
                    subjects.append(
                        Subject(
                            f"{variant}@{size}",
                            make_claimer(variant, client, target),
                            _hand_back(admin, stream),
                        )
                    )
            samples, truncated = await measure(
                subjects, mode.scale_cycles, mode.warmup, 300
            )
            for size in streams:
                for variant in VARIANTS:
                    summary = samples[f"{variant}@{size}"].summary()
                    rows.append(
                        {
                            "variant": variant,
                            "workload": name,
                            "pending": pending[size],
                            "p50_us": summary["p50_us"],
                            "p99_us": summary["p99_us"],
                            "cycles": summary["cycles"],
                            "entries_per_cycle": summary["entries_per_cycle"],
                            "truncated_by_time_bound": truncated,
                        }
                    )
        for stream in streams.values():
            await admin.delete(stream, *coordination_keys(stream, GROUP))
    finally:
        await client.aclose()
        await admin.aclose()
    return rows


def run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    return asyncio.run(_run(url, mode, log))
