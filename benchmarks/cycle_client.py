"""The measuring client of the claim-cycle part, run as its own process.

``python -m benchmarks.cycle_client SPEC_JSON`` times every variant's claim
cycle against the stream the orchestrator prepared, and prints one JSON
object. It is a separate process so it can run inside the network namespace
(netem) or talk through the delay proxy, with nothing else in its event loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from redis.asyncio import Redis

from benchmarks import safety, workload
from benchmarks.config import BrokerArguments
from benchmarks.measure import Subject, measure
from benchmarks.stats import p50
from benchmarks.variants import Target, make_claimer

_PINGS = 50


async def _ping_rtt_us(client: Redis) -> float:
    """The round trip the client actually sees: PING, median of a few."""
    samples = []
    for _ in range(_PINGS):
        started = time.perf_counter()
        await client.ping()
        samples.append((time.perf_counter() - started) * 1e6)
    return p50(samples)


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    arguments = BrokerArguments.from_dict(spec["arguments"])
    client = Redis.from_url(spec["url"])
    harness = Redis.from_url(spec["hand_back_url"])
    try:
        await client.ping()
        rtt_us = await _ping_rtt_us(client)

        async def hand_back(ids: list[str]) -> None:
            await workload.hand_back(harness, spec["stream"], spec["group"], ids)

        subjects = [
            Subject(
                variant,
                make_claimer(
                    variant,
                    client,
                    Target.of(
                        spec["stream"], spec["group"], f"bench-{variant}", arguments
                    ),
                ),
                hand_back,
            )
            for variant in spec["variants"]
        ]
        samples, truncated = await measure(
            subjects, spec["cycles"], spec["warmup"], spec["max_seconds"]
        )
        return {
            "measured_rtt_us": round(rtt_us, 1),
            "truncated": truncated,
            "variants": {name: s.summary() for name, s in samples.items()},
        }
    finally:
        await client.aclose()
        await harness.aclose()


def main() -> int:
    safety.die_with_parent()
    spec = json.loads(sys.argv[1])
    safety.hard_deadline(spec["max_seconds"] + 60)
    print(json.dumps(asyncio.run(run(spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
