"""Server time from INFO commandstats.

commandstats counts a command run inside a script or a MULTI/EXEC both on its
own line and inside the FCALL/EVALSHA/EXEC that ran it, so callers sum only
the outer commands' time. The harness's own commands are left out by name.
"""

from __future__ import annotations

from typing import Any

HARNESS_COMMANDS = {"xclaim", "config", "info", "ping", "client", "hello"}


def stat_bases(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(calls, usec) per command, subcommands folded into their command."""
    folded: dict[str, tuple[int, int]] = {}
    for key, value in stats.items():
        base = key.removeprefix("cmdstat_").split("|", 1)[0]
        calls, usec = folded.get(base, (0, 0))
        folded[base] = (calls + int(value["calls"]), usec + int(value["usec"]))
    return folded
