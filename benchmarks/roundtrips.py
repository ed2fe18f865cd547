"""Round trips and commands per claim cycle, counted on the wire.

Each variant's client connects through ``TurnCountingProxy`` (round trips)
while a MONITOR connection records what the server ran (commands, and which
of them ran nested inside a script or a transaction). Handing batches back
goes over a direct connection that neither sees.

``upstream_fidelity`` runs the real taskiq-redis ``RedisStreamBroker.listen()``
claim step under MONITOR and compares its commands with ``UpstreamClaimer``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from redis.asyncio import Redis
from taskiq import BrokerMessage
from taskiq_redis import RedisStreamBroker

from benchmarks import workload
from benchmarks.config import BrokerArguments
from benchmarks.counting_proxy import TurnCountingProxy
from benchmarks.monitor import Command, CommandCounts, Monitor, count
from benchmarks.variants import Target, make_claimer


async def count_variant(
    port: int,
    variant: str,
    stream: str,
    group: str,
    arguments: BrokerArguments,
    cycles: int,
) -> tuple[float, CommandCounts]:
    """Round trips per cycle and the commands the cycles ran."""
    harness = Redis.from_url(f"redis://127.0.0.1:{port}")
    async with TurnCountingProxy(port) as proxy:
        client = Redis.from_url(proxy.url)
        try:
            claimer = make_claimer(
                variant, client, Target.of(stream, group, f"bench-{variant}", arguments)
            )
            await claimer.prepare()
            # Warm: connection handshake, script loads, first-use lookups.
            await workload.claim_cycles(claimer, harness, stream, group, 3)
            with Monitor(port) as monitor:
                proxy.reset()
                await workload.claim_cycles(claimer, harness, stream, group, cycles)
                turns = proxy.turns
                commands = await asyncio.to_thread(monitor.stop)
        finally:
            await client.aclose()
            await harness.aclose()
        return turns / cycles, count(commands, proxy.upstream_addresses)


def _shape(command: Command) -> tuple[str, int]:
    # Names and argument counts: tokens, ids and consumer names differ by run.
    return (command.name, len(command.tokens))


def _claim_step(
    commands: list[Command], sources: set[str] | None
) -> list[tuple[str, int]]:
    """Outer commands, without reads and one-off script loads."""
    skip = {
        "XREADGROUP",
        "SCRIPT LOAD",
        "HELLO",
        "CLIENT SETINFO",
        "XGROUP CREATE",
        "XADD",
        "PING",
        "INFO",
        "CLIENT INFO",
    }
    return [
        _shape(c)
        for c in commands
        if c.source != "lua"
        and (sources is None or c.source in sources)
        and c.name not in skip
    ]


def _noop(task_id: str) -> BrokerMessage:
    return BrokerMessage(
        task_id=task_id, task_name="bench.noop", message=b"{}", labels={}
    )


async def _next_within(messages: AsyncGenerator[Any, None], seconds: float) -> Any:
    """The generator's next item, or an error after ``seconds``.

    Never cancels the generator: on Python 3.11 redis-py (socket_timeout
    set, as 8.2 does by default) sends each command inside ``wait_for``,
    which swallows a cancel that lands as the send completes (CPython
    gh-86296); 1.2.4's ``listen()`` then reads on for ever and whoever
    awaits the cancel waits with it.
    """
    step = asyncio.ensure_future(messages.__anext__())
    done, _ = await asyncio.wait({step}, timeout=seconds)
    if not done:
        raise RuntimeError(f"taskiq-redis listen() gave nothing within {seconds} s")
    return step.result()


async def upstream_fidelity(port: int, arguments: BrokerArguments) -> dict[str, Any]:
    """The real 1.2.4 claim step next to ``UpstreamClaimer``'s, under MONITOR."""
    url = f"redis://127.0.0.1:{port}"
    stream, replica_stream = "bench-fidelity", "bench-fidelity-replica"
    broker = RedisStreamBroker(
        url,
        queue_name=stream,
        idle_timeout=arguments.idle_timeout,
        unacknowledged_batch_size=arguments.batch_size,
        unacknowledged_lock_timeout=arguments.lock_timeout_s,
        xread_block=50,
    )
    admin = Redis.from_url(url)
    try:
        await admin.delete(stream, replica_stream)
        await broker.startup()
        with Monitor(port) as monitor:
            messages = broker.listen()
            await broker.kick(_noop("1"))
            await _next_within(messages, 10)
            # The claim step runs when the next message is asked for, before
            # the read that returns the second one: the generator is never
            # cancelled mid-call (see _next_within).
            await broker.kick(_noop("2"))
            await _next_within(messages, 10)
            await messages.aclose()
            observed = await asyncio.to_thread(monitor.stop)
        real = _claim_step(observed, None)
        await workload.create(admin, replica_stream, "taskiq", [])
        replica_client = Redis.from_url(url)
        try:
            replica = make_claimer(
                "upstream_1_2_4",
                replica_client,
                Target.of(replica_stream, "taskiq", "bench-replica", arguments),
            )
            await replica.cycle()  # loads the release script, like 1.2.4's first
            with Monitor(port) as monitor:
                await replica.cycle()
                replicated = await asyncio.to_thread(monitor.stop)
        finally:
            await replica_client.aclose()
        mine = _claim_step(replicated, None)
        return {
            "observed_upstream": [f"{name}/{argc}" for name, argc in real],
            "replica": [f"{name}/{argc}" for name, argc in mine],
            "match": real == mine,
        }
    finally:
        await broker.shutdown()
        await admin.delete(stream, replica_stream, f"autoclaim:taskiq:{stream}")
        await admin.aclose()
