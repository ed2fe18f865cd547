"""Part 7: steady-state kick -> execute -> ack throughput, both brokers.

A forked producer process kicks ``messages`` no-op tasks as fast as it can
(taskiq's kicker, 50 in flight); the measuring process runs taskiq's own
``Receiver`` (what ``taskiq worker`` runs) with identical settings for both
brokers: 100 async tasks, no extra prefetch, ack when executed, broker
defaults otherwise (same idle_timeout). Two figures per broker:

- ``messages_per_s``: producer and consumer at once; messages over the time
  from the first kick until every message has run and nothing is pending.
  On a small machine the producer can be what limits this, so its own rate
  is reported beside it.
- ``drain_messages_per_s``: the same messages kicked first, then consumed;
  messages over the time from the receiver starting to nothing pending.
  Only the consumer side, where the two brokers differ, is timed.

Repetitions alternate which broker goes first; medians are reported.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

from redis.asyncio import Redis
from taskiq import AsyncBroker
from taskiq.acks import AcknowledgeType
from taskiq.kicker import AsyncKicker
from taskiq.receiver import Receiver
from taskiq_redis import RedisStreamBroker

from benchmarks import safety
from benchmarks.stats import p50
from taskiq_atomic_claim.broker import AtomicRedisStreamBroker

TASK_NAME = "bench.noop"
_IN_FLIGHT = 50
_START_DELAY_S = 0.5
_IDLE_TIMEOUT_MS = 60_000


async def _produce(
    url: str, queue: str, messages: int, start_at: float
) -> tuple[float, float]:
    broker = RedisStreamBroker(url, queue_name=queue)
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, broker, {})
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    started = time.monotonic()
    try:
        for first in range(0, messages, _IN_FLIGHT):
            batch = range(first, min(first + _IN_FLIGHT, messages))
            await asyncio.gather(*(kicker.kiq(i) for i in batch))
    finally:
        await broker.shutdown()
    return started, time.monotonic()


def _producer(
    conn: Connection, url: str, queue: str, messages: int, start_at: float
) -> None:
    safety.die_with_parent()
    safety.hard_deadline(start_at - time.monotonic() + 300)
    try:
        conn.send(asyncio.run(_produce(url, queue, messages, start_at)))
    finally:
        conn.close()


def _broker(kind: str, url: str, queue: str) -> AsyncBroker:
    if kind == "atomic":
        return AtomicRedisStreamBroker(
            url, queue_name=queue, idle_timeout=_IDLE_TIMEOUT_MS
        )
    return RedisStreamBroker(url, queue_name=queue, idle_timeout=_IDLE_TIMEOUT_MS)


async def _consume(
    kind: str, url: str, queue: str, messages: int, max_seconds: float
) -> tuple[float, float]:
    """When the receiver started, and when the last message was acked."""
    broker = _broker(kind, url, queue)
    executed = 0
    all_ran = asyncio.Event()

    async def noop(_: int) -> None:
        nonlocal executed
        executed += 1
        if executed >= messages:
            all_ran.set()

    broker.register_task(noop, task_name=TASK_NAME)
    await broker.startup()
    receiver = Receiver(
        broker,
        max_async_tasks=100,
        max_prefetch=0,
        ack_type=AcknowledgeType.WHEN_EXECUTED,
        run_startup=False,
    )
    finish = asyncio.Event()
    started = time.monotonic()
    listener = asyncio.create_task(receiver.listen(finish))
    admin = Redis.from_url(url)
    try:
        await asyncio.wait_for(all_ran.wait(), max_seconds)
        # Executed is not acked yet: wait for the PEL to drain, bounded.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            summary = await admin.xpending(queue, "taskiq")
            if int(summary["pending"]) == 0:
                return started, time.monotonic()
            await asyncio.sleep(0.002)
        raise RuntimeError(f"{kind}: messages still pending 30 s after running")
    finally:
        await stop_receiver(finish, listener)
        await asyncio.wait_for(broker.shutdown(), 15)
        await admin.delete(queue)
        await admin.aclose()


async def stop_receiver(finish: asyncio.Event, listener: asyncio.Task[None]) -> None:
    """Let the receiver finish; cancel it if it will not; never wait unbounded."""
    finish.set()
    done, _ = await asyncio.wait({listener}, timeout=5)
    if not done:
        listener.cancel()
        await asyncio.wait({listener}, timeout=5)
    if listener.done() and not listener.cancelled():
        listener.exception()  # retrieved: an error here is not the figure's


async def _create_group(url: str, queue: str) -> None:
    # Before the first kick: the broker's own startup would create it at "$".
    client = Redis.from_url(url)
    try:
        await client.delete(queue)
        await client.xgroup_create(queue, "taskiq", id="0", mkstream=True)
    finally:
        await client.aclose()


def _one(
    kind: str, url: str, messages: int, rep: int, backlog: bool
) -> dict[str, float]:
    """One run; with ``backlog`` every message is kicked before consuming."""
    queue = f"bench-throughput-{kind}-{rep}-{'drain' if backlog else 'live'}"
    asyncio.run(_create_group(url, queue))
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    start_at = time.monotonic() + (0 if backlog else _START_DELAY_S)
    producer = context.Process(
        target=_producer, args=(send, url, queue, messages, start_at), daemon=True
    )
    producer.start()
    send.close()
    max_seconds = 60 + messages / 100
    try:
        if backlog:
            if not receive.poll(max_seconds):
                raise RuntimeError("producer did not finish")
            kick_start, kick_end = receive.recv()
        listen_start, done = asyncio.run(
            _consume(kind, url, queue, messages, max_seconds)
        )
        if not backlog:
            if not receive.poll(30):
                raise RuntimeError("producer did not report")
            kick_start, kick_end = receive.recv()
    finally:
        producer.join(timeout=10)
        if producer.is_alive():
            producer.kill()
            producer.join(timeout=5)
        receive.close()
    return {
        "messages_per_s": messages / (done - (listen_start if backlog else kick_start)),
        "producer_per_s": messages / (kick_end - kick_start),
    }


def run(url: str, messages: int, reps: int, log: Any) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, float]]] = {"atomic": [], "upstream": []}
    drains: dict[str, list[dict[str, float]]] = {"atomic": [], "upstream": []}
    for rep in range(reps):
        # Alternate who goes first, so neither always runs on a warmer server.
        order = ("atomic", "upstream") if rep % 2 == 0 else ("upstream", "atomic")
        for kind in order:
            log(f"throughput: {kind} broker, {messages} messages, rep {rep + 1}/{reps}")
            runs[kind].append(_one(kind, url, messages, rep, backlog=False))
            drains[kind].append(_one(kind, url, messages, rep, backlog=True))
    return [
        {
            "broker": "atomic" if kind == "atomic" else "upstream_1_2_4",
            "messages": messages,
            "reps": len(results),
            "messages_per_s": round(p50([r["messages_per_s"] for r in results]), 1),
            "each_messages_per_s": [round(r["messages_per_s"], 1) for r in results],
            "producer_per_s": round(p50([r["producer_per_s"] for r in results]), 1),
            "drain_messages_per_s": round(
                p50([r["messages_per_s"] for r in drains[kind]]), 1
            ),
            "each_drain_messages_per_s": [
                round(r["messages_per_s"], 1) for r in drains[kind]
            ],
        }
        for kind, results in runs.items()
    ]
