"""Part 8: what an idempotent kick (XADD ... IDMP, Redis >= 8.6) costs.

Four ways of adding ``messages`` entries, each with 50 in flight from this
process, side by side on one server, one fresh stream each:

- ``xadd``: redis-py's XADD of the message, no broker: the floor;
- ``xadd_idmp``: the same XADD carrying ``IDMP producer-id task-id`` as the
  atomic broker sends it (where the server has IDMP);
- ``upstream_1_2_4``: taskiq-redis's ``RedisStreamBroker`` kick;
- ``atomic``: ``AtomicRedisStreamBroker``'s kick (IDMP where the server has
  it, the outage retry around it).

Per variant: kicks per second (median over the repetitions, which alternate
the order), and the server's microseconds per XADD (``INFO commandstats``
delta). ``idmp_bytes_per_id``: the memory the stream's remembered task ids
take, per id (``MEMORY USAGE`` of the ``xadd_idmp`` stream minus the
``xadd`` one, same entries).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from taskiq.kicker import AsyncKicker
from taskiq_redis import RedisStreamBroker

from benchmarks.stats import p50
from taskiq_atomic_claim.broker import AtomicRedisStreamBroker
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.kicking import IDMP_MAXSIZE, producer_id
from taskiq_atomic_claim.server_info import read_server_info

TASK_NAME = "bench.kick"
_IN_FLIGHT = 50
VARIANTS = ("xadd", "xadd_idmp", "upstream_1_2_4", "atomic")
# What a taskiq message of a no-argument task weighs, about.
_BODY = b'{"task_id":"0","task_name":"bench.kick","labels":{},"args":[],"kwargs":{}}'

Kick = Callable[[str], Awaitable[Any]]


async def _timed(kick: Kick, messages: int) -> float:
    """Seconds to kick ``messages`` task ids, _IN_FLIGHT at a time."""
    ids = [uuid.uuid4().hex for _ in range(messages)]
    started = time.monotonic()
    for first in range(0, messages, _IN_FLIGHT):
        await asyncio.gather(*(kick(i) for i in ids[first : first + _IN_FLIGHT]))
    return time.monotonic() - started


async def _xadd_usec(client: Redis) -> tuple[int, int]:
    """(calls, usec) of XADD so far, from INFO commandstats."""
    stats = await client.info("commandstats")
    row = stats.get("cmdstat_xadd", {})
    return int(row.get("calls", 0)), int(row.get("usec", 0))


async def _variant(
    name: str, url: str, client: Redis, stream: str
) -> tuple[Kick, Callable[[], Awaitable[None]]]:
    """A kick of that variant into ``stream``, and how to close it."""
    typed: ScriptClient = client
    if name in ("xadd", "xadd_idmp"):
        if name == "xadd_idmp":
            # As the broker sets it: the stream remembers ids for the run.
            await client.xadd(stream, {"data": b""}, maxlen=0, approximate=False)
            await typed.execute_command(
                "XCFGSET", stream, "IDMP-DURATION", 100, "IDMP-MAXSIZE", IDMP_MAXSIZE
            )

        async def raw(task_id: str) -> Any:
            idmp = (
                ["IDMP", producer_id(task_id), task_id] if name == "xadd_idmp" else []
            )
            return await typed.execute_command(
                "XADD", stream, *idmp, "*", "data", _BODY
            )

        async def nothing() -> None:
            return None

        return raw, nothing
    broker_class = AtomicRedisStreamBroker if name == "atomic" else RedisStreamBroker
    broker = broker_class(url, queue_name=stream)
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, broker, {})

    async def kick(task_id: str) -> Any:
        return await kicker.with_task_id(task_id).kiq()

    return kick, broker.shutdown


async def _run(url: str, messages: int, reps: int, log: Callable[[str], None]) -> Any:
    client = Redis.from_url(url)
    try:
        server = await read_server_info(client)
        names = [v for v in VARIANTS if v != "xadd_idmp" or server.idempotent_add]
        rates: dict[str, list[float]] = {name: [] for name in names}
        usec: dict[str, list[float]] = {name: [] for name in names}
        memory: dict[str, int] = {}
        for rep in range(reps):
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                stream = f"bench-kicks-{name}"
                await client.delete(stream)
                kick, close = await _variant(name, url, client, stream)
                try:
                    await kick(uuid.uuid4().hex)  # connect, learn the server
                    calls, spent = await _xadd_usec(client)
                    took = await _timed(kick, messages)
                    calls_after, spent_after = await _xadd_usec(client)
                finally:
                    await close()
                rates[name].append(messages / took)
                usec[name].append((spent_after - spent) / max(1, calls_after - calls))
                if name.startswith("xadd"):
                    memory[name] = int(await client.memory_usage(stream) or 0)
                await client.delete(stream)
            log(f"kicks rep {rep + 1}/{reps} done")
        rows = [
            {
                "variant": name,
                "kicks_per_s": round(p50(rates[name])),
                "server_usec_per_xadd": round(p50(usec[name]), 2),
                "idmp": name == "xadd_idmp"
                or (name == "atomic" and server.idempotent_add),
            }
            for name in names
        ]
        per_id = None
        if "xadd_idmp" in memory:
            # Every id is still remembered: well within the window, and
            # fewer than 16 x IDMP_MAXSIZE.
            remembered = min(messages + 1, 16 * IDMP_MAXSIZE)
            per_id = round((memory["xadd_idmp"] - memory["xadd"]) / remembered, 1)
        return {
            "server": server.name,
            "messages": messages,
            "reps": reps,
            "in_flight": _IN_FLIGHT,
            "rows": rows,
            "idmp_bytes_per_id": per_id,
        }
    finally:
        await client.aclose()


def run(url: str, messages: int, reps: int, log: Callable[[str], None]) -> Any:
    log(f"kicks: {messages} kicks x {len(VARIANTS)} variants x {reps} reps")
    return asyncio.run(_run(url, messages, reps, log))
