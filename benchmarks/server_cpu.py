"""Server time per claim cycle, from INFO commandstats.

commandstats counts a command run inside a script or a MULTI/EXEC both on its
own line and inside the FCALL/EVALSHA/EXEC that ran it. So only the outer
commands' time is summed: for each command, the share of its calls that
MONITOR saw as outer (``roundtrips``). The harness's own commands (XCLAIM to
hand batches back, CONFIG, INFO) are left out by name; no variant uses them.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from benchmarks import workload
from benchmarks.config import BrokerArguments
from benchmarks.monitor import CommandCounts
from benchmarks.variants import Target, make_claimer

HARNESS_COMMANDS = {"xclaim", "config", "info", "ping", "client", "hello"}


def stat_bases(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(calls, usec) per command, subcommands folded into their command."""
    folded: dict[str, tuple[int, int]] = {}
    for key, value in stats.items():
        base = key.removeprefix("cmdstat_").split("|", 1)[0]
        calls, usec = folded.get(base, (0, 0))
        folded[base] = (calls + int(value["calls"]), usec + int(value["usec"]))
    return folded


async def measure_variant(
    url: str,
    variant: str,
    stream: str,
    group: str,
    arguments: BrokerArguments,
    cycles: int,
    commands: CommandCounts,
) -> dict[str, Any]:
    client = Redis.from_url(url)
    harness = Redis.from_url(url)
    try:
        claimer = make_claimer(
            variant, client, Target.of(stream, group, f"bench-{variant}", arguments)
        )
        await claimer.prepare()
        await workload.claim_cycles(claimer, harness, stream, group, 3)  # warm
        await harness.config_resetstat()
        await workload.claim_cycles(claimer, harness, stream, group, cycles)
        stats = stat_bases(await harness.info("commandstats"))
    finally:
        await client.aclose()
        await harness.aclose()
    outer_usec: dict[str, float] = {}
    # Already inside the outer figures; shown to say where a script's time goes.
    nested_usec: dict[str, float] = {}
    for base, (calls, usec) in stats.items():
        outer = commands.outer_base.get(base, 0)
        nested = commands.nested_base.get(base, 0)
        if base in HARNESS_COMMANDS or not calls or outer + nested == 0:
            continue
        if outer:
            outer_usec[base] = usec * outer / (outer + nested) / cycles
        if nested:
            nested_usec[base] = usec * nested / (outer + nested) / cycles
    return {
        "variant": variant,
        "cycles": cycles,
        "server_usec_per_cycle": round(sum(outer_usec.values()), 2),
        "outer_usec": {k: round(v, 2) for k, v in sorted(outer_usec.items())},
        "nested_usec": {k: round(v, 2) for k, v in sorted(nested_usec.items())},
    }
