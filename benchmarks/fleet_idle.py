"""Part: what an idle fleet costs the server.

``workers`` brokers, each listening on the same ``streams`` streams (the
queue plus ``additional_streams``), nothing ever sent. Each worker is the
broker's own ``listen()`` iterated in this process (one broker instance,
connection pool and listening connection per worker, all in one event
loop); idle, so no task runs and no ``Receiver`` is needed.

``INFO commandstats`` is read before and after ``idle_s``: the deltas give
calls and server usec per command. commandstats counts a command run inside a
script or MULTI/EXEC both on its own line and inside the FCALL/EVALSHA/EXEC
that ran it, so a MONITOR window before (``monitor_s`` from the workers'
start; never during the timed window, where it would cost the server time)
gives each command's share of top-level calls, as in ``server_cpu``. Figures
per second:

- ``commands_per_s``: top-level commands (what clients sent);
- ``with_nested_per_s``: plus the commands scripts and MULTI ran (every call
  commandstats saw);
- ``server_usec_per_s``: server time of the top-level commands (a script's
  own time includes its nested commands');
- ``server_cpu_usec_per_s``: the server process's CPU (``INFO cpu``, user +
  system): issue 40's measure. Beside the commands it counts what each
  round trip costs an idle server (waking, reading, writing) and the
  server's own timers, which both brokers pay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from redis.asyncio import Redis
from taskiq import AsyncBroker
from taskiq_redis import RedisStreamBroker

from benchmarks.config import Mode
from benchmarks.monitor import Monitor, count
from benchmarks.server_cpu import HARNESS_COMMANDS, stat_bases
from taskiq_atomic_claim.broker import AtomicRedisStreamBroker

BROKERS = ("atomic", "upstream_1_2_4")
# After MONITOR stops, before the timed window.
_SETTLE_S = 0.2


def _broker(
    kind: str, url: str, streams: list[str], consumer: str, idle_timeout: int | None
) -> AsyncBroker:
    extra: dict[str, Any] = {}
    if idle_timeout is not None:
        extra["idle_timeout"] = idle_timeout
    cls = AtomicRedisStreamBroker if kind == "atomic" else RedisStreamBroker
    return cls(
        url,
        queue_name=streams[0],
        additional_streams=dict.fromkeys(streams[1:], ">"),
        consumer_name=consumer,
        **extra,
    )


def _cpu_s(info: dict[str, Any]) -> float:
    """The server process's CPU seconds (user + system) so far."""
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _drain(messages: AsyncGenerator[Any, None]) -> None:
    async for _ in messages:
        pass  # nothing is ever sent


async def run_shape(
    url: str,
    port: int,
    kind: str,
    workers: int,
    streams: int,
    idle_timeout: int | None,
    idle_s: float,
    monitor_s: float,
) -> dict[str, Any]:
    names = [f"bench-idle-{kind}-{workers}x{streams}-{i}" for i in range(streams)]
    admin = Redis.from_url(url)
    await admin.delete(*names)
    brokers = [
        _broker(kind, url, names, f"idle-{index}", idle_timeout)
        for index in range(workers)
    ]
    listeners: list[asyncio.Task[None]] = []
    try:
        for broker in brokers:
            await broker.startup()
        with Monitor(port, max_seconds=monitor_s + 30) as monitor:
            listeners = [asyncio.create_task(_drain(b.listen())) for b in brokers]
            await asyncio.sleep(monitor_s)
            seen = monitor.stop()
        await asyncio.sleep(_SETTLE_S)
        before = stat_bases(await admin.info("commandstats"))
        cpu_before = _cpu_s(await admin.info("cpu"))
        started = time.monotonic()
        await asyncio.sleep(idle_s)
        after = stat_bases(await admin.info("commandstats"))
        cpu_after = _cpu_s(await admin.info("cpu"))
        elapsed = time.monotonic() - started
        failed = [t for t in listeners if t.done()]
        if failed:
            failed[0].result()  # a listener that died is the run's error
    finally:
        for task in listeners:
            task.cancel()
        if listeners:
            await asyncio.wait(listeners, timeout=10)
        for broker in brokers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(broker.shutdown(), 15)
        await admin.delete(*names)
        await admin.aclose()
    sources = {c.source for c in seen if monitor.sentinel not in c.tokens} - {"lua"}
    counts = count(seen, sources)
    top_calls = all_calls = top_usec = 0.0
    commands: dict[str, float] = {}
    unseen: list[str] = []
    for base, (calls_after, usec_after) in after.items():
        calls = calls_after - before.get(base, (0, 0))[0]
        usec = usec_after - before.get(base, (0, 0))[1]
        if base in HARNESS_COMMANDS or calls <= 0:
            continue
        outer = counts.outer_base.get(base, 0)
        nested = counts.nested_base.get(base, 0)
        # Not seen in the MONITOR window (rare, e.g. a heartbeat): counted as
        # top-level, and named in the row.
        share = outer / (outer + nested) if outer + nested else 1.0
        if not outer + nested:
            unseen.append(base)
        top_calls += calls * share
        all_calls += calls
        top_usec += usec * share
        commands[base] = round(calls / elapsed, 2)
    return {
        "broker": kind,
        "workers": workers,
        "streams": streams,
        "idle_timeout": idle_timeout,
        "idle_s": round(elapsed, 2),
        "commands_per_s": round(top_calls / elapsed, 2),
        "with_nested_per_s": round(all_calls / elapsed, 2),
        "server_usec_per_s": round(top_usec / elapsed, 1),
        "server_cpu_usec_per_s": round((cpu_after - cpu_before) * 1e6 / elapsed, 1),
        "calls_per_s": dict(sorted(commands.items())),
        "monitor_outer": dict(sorted(counts.outer.items())),
        "monitor_nested": dict(sorted(counts.nested.items())),
        "unseen_in_monitor": unseen,
    }


def run(url: str, port: int, mode: Mode, log: Any) -> list[dict[str, Any]]:
    rows = []
    for workers, streams, idle_timeout in mode.fleet_shapes:
        for round_ in range(mode.fleet_rounds):
            for kind in BROKERS:
                log(
                    f"fleet idle: {kind}, {workers} workers x {streams} streams,"
                    f" idle_timeout {idle_timeout or 'default'},"
                    f" {mode.fleet_idle_s} s, round {round_ + 1}"
                )
                row = asyncio.run(
                    run_shape(
                        url,
                        port,
                        kind,
                        workers,
                        streams,
                        idle_timeout,
                        mode.fleet_idle_s,
                        mode.fleet_monitor_s,
                    )
                )
                rows.append({**row, "round": round_ + 1})
    return rows
