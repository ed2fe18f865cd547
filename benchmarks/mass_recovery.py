"""Part: mass recovery. A fleet drains what dead consumers left, new work flows.

The scene: ``orphans`` entries were read by
``dead_consumers`` consumers that then died without acking; ``workers`` live
workers with ``slots`` concurrent tasks each run tasks that sleep ``task_s``.
A producer kicks new tasks at a steady ``new_per_s`` while the fleet drains.

Workers are in-process: each is the broker's own ``listen()`` driven by
taskiq's ``Receiver`` (what ``taskiq worker`` runs; ``max_async_tasks`` =
slots, no extra prefetch, ack when executed), all in one event loop, one
broker instance and connection pool per worker. The task records when it
started, so waits are measured on one clock.

The orphans are made as a crash leaves them: XADDed as real taskiq messages,
then read with XREADGROUP by the dead consumers' names, never acked. They are
then backdated with ``XCLAIM ... IDLE <1 day> RETRYCOUNT 1`` (to the same
dead consumer) so they are past any idle_timeout at once and the brokers keep
their default idle_timeout (10 minutes) without the run waiting it out.

Figures per broker: ``drain_s``, from the workers' start until every orphan
has run once to its end (None if the time bound cut it short, with
``orphans_left`` not run to the end; ``last_orphan_started_s`` beside it);
``new_wait_p50_s``/``new_wait_p99_s``, kick to start of the new tasks kicked
until the drain ended; new tasks still not started when
the run gave up count with their wait so far (``new_censored``: then the
figures are lower bounds). ``floor_s`` is what the fleet's slots allow:
orphans x task_s / (workers x slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from taskiq import AsyncBroker
from taskiq.acks import AcknowledgeType
from taskiq.kicker import AsyncKicker
from taskiq.message import TaskiqMessage
from taskiq.receiver import Receiver
from taskiq_redis import RedisStreamBroker

from benchmarks.config import AGED_IDLE_MS, Mode
from benchmarks.stats import p50, percentile
from taskiq_atomic_claim.broker import AtomicRedisStreamBroker

TASK_NAME = "bench.mass_work"
GROUP = "taskiq"
_CHUNK = 1000
# After the drain: how long new tasks may still take to start before the run
# stops waiting for them (their waits then count as censored lower bounds).
_GRACE_S = 10.0


async def stop_receiver(finish: asyncio.Event, listener: asyncio.Task[None]) -> None:
    """Let the receiver finish; cancel it if it will not; never wait unbounded."""
    finish.set()
    done, _ = await asyncio.wait({listener}, timeout=5)
    if not done:
        listener.cancel()
        await asyncio.wait({listener}, timeout=5)
    if listener.done() and not listener.cancelled():
        listener.exception()  # retrieved: an error here is not the figure's


@dataclass(frozen=True)
class Fleet:
    """One broker configuration under test."""

    name: str
    make: Callable[[str, str, str], AsyncBroker]  # url, queue, consumer name
    settings: dict[str, Any]


def _make(
    cls: Callable[..., AsyncBroker], **extra: Any
) -> Callable[[str, str, str], AsyncBroker]:
    def make(url: str, queue: str, consumer: str) -> AsyncBroker:
        return cls(url, queue_name=queue, consumer_name=consumer, **extra)

    return make


def fleets(large_batch: int, slots: int) -> tuple[Fleet, ...]:
    """Defaults; a batch big enough for every worker to hoard a share of the
    backlog (``Mode.mass_large_batch``); taskiq-redis 1.2.4 at defaults.
    Each reads (and claims) as many as it has slots, as a default worker
    does (``xread_count`` 100, ``--max-async-tasks`` 100): the same in a
    full run, scaled down with the slots in a quick one."""
    read = {"xread_count": slots}
    return (
        Fleet("atomic", _make(AtomicRedisStreamBroker, **read), {"defaults": True}),
        Fleet(
            "atomic_large_batch",
            _make(
                AtomicRedisStreamBroker, unacknowledged_batch_size=large_batch, **read
            ),
            {"unacknowledged_batch_size": large_batch},
        ),
        Fleet("upstream_1_2_4", _make(RedisStreamBroker, **read), {"defaults": True}),
    )


@dataclass
class Record:
    """Start times of the tasks, on the harness's monotonic clock."""

    orphans: int
    orphan_started: dict[int, float] = field(default_factory=dict)
    orphan_finished: dict[int, float] = field(default_factory=dict)
    orphan_runs: int = 0
    new_kicked: dict[int, float] = field(default_factory=dict)
    new_started: dict[int, float] = field(default_factory=dict)
    all_orphans_ran: asyncio.Event = field(default_factory=asyncio.Event)
    kicking_done: bool = False
    all_new_started: asyncio.Event = field(default_factory=asyncio.Event)

    def check_new(self) -> None:
        if self.kicking_done and len(self.new_started) >= len(self.new_kicked):
            self.all_new_started.set()


def _message(broker: AsyncBroker, kind: str, number: int) -> bytes:
    message = TaskiqMessage(
        task_id=uuid.uuid4().hex,
        task_name=TASK_NAME,
        labels={},
        labels_types={},
        args=[kind, number],
        kwargs={},
    )
    return broker.formatter.dumps(message).message


async def orphan(
    client: Redis, broker: AsyncBroker, queue: str, count: int, dead_consumers: int
) -> None:
    """``count`` taskiq messages pending on ``dead_consumers`` consumers, long
    idle, delivered once."""
    await client.delete(queue)
    await client.xgroup_create(queue, GROUP, id="0", mkstream=True)
    for first in range(0, count, _CHUNK):
        pipe = client.pipeline(transaction=False)
        for number in range(first, min(first + _CHUNK, count)):
            pipe.xadd(queue, {b"data": _message(broker, "orphan", number)})
        await pipe.execute()
    share = -(-count // dead_consumers)
    for index in range(dead_consumers):
        consumer = f"dead-{index}"
        read: Any = await client.xreadgroup(GROUP, consumer, {queue: ">"}, count=share)
        ids = [entry_id for _, entries in read or [] for entry_id, _ in entries]
        for first in range(0, len(ids), _CHUNK):
            await client.xclaim(
                queue,
                GROUP,
                consumer,
                0,
                ids[first : first + _CHUNK],
                idle=AGED_IDLE_MS,
                retrycount=1,
                justid=True,
            )
    pending = int((await client.xpending(queue, GROUP))["pending"])
    if pending != count:
        raise RuntimeError(f"orphaning left {pending} pending, wanted {count}")


async def _kick_new(
    url: str, queue: str, per_s: float, record: Record, stop_at: float
) -> None:
    """New tasks at a steady rate until the drain ends or the bound; bounded."""
    kicker_broker = RedisStreamBroker(url, queue_name=queue)
    kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, kicker_broker, {})
    started = time.monotonic()
    try:
        number = 0
        while not record.all_orphans_ran.is_set():
            due = started + number / per_s
            if due >= stop_at:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            record.new_kicked[number] = time.monotonic()
            await kicker.kiq("new", number)
            number += 1
    finally:
        await kicker_broker.shutdown()


async def run_fleet(url: str, fleet: Fleet, mode: Mode, log: Any) -> dict[str, Any]:
    queue = f"bench-mass-{fleet.name}"
    record = Record(mode.mass_orphans)
    admin = Redis.from_url(url)
    brokers = [
        fleet.make(url, queue, f"live-{index}") for index in range(mode.mass_workers)
    ]

    async def work(kind: str, number: int) -> None:
        now = time.monotonic()
        if kind != "orphan":
            record.new_started.setdefault(number, now)
            record.check_new()
            await asyncio.sleep(mode.mass_task_s)
            return
        record.orphan_runs += 1
        record.orphan_started.setdefault(number, now)
        await asyncio.sleep(mode.mass_task_s)
        record.orphan_finished.setdefault(number, time.monotonic())
        if len(record.orphan_finished) >= record.orphans:
            record.all_orphans_ran.set()

    listeners: list[tuple[asyncio.Event, asyncio.Task[None]]] = []
    try:
        await orphan(admin, brokers[0], queue, mode.mass_orphans, mode.mass_dead)
        for broker in brokers:
            broker.register_task(work, task_name=TASK_NAME)
            await broker.startup()
        log(
            f"mass recovery: {fleet.name}, {mode.mass_orphans} orphans,"
            f" {mode.mass_workers} workers x {mode.mass_slots} slots,"
            f" {mode.mass_task_s} s tasks"
        )
        started = time.monotonic()
        give_up = started + mode.mass_cap_s
        for broker in brokers:
            receiver = Receiver(
                broker,
                max_async_tasks=mode.mass_slots,
                max_prefetch=0,
                ack_type=AcknowledgeType.WHEN_EXECUTED,
                run_startup=False,
            )
            finish = asyncio.Event()
            listeners.append((finish, asyncio.create_task(receiver.listen(finish))))
        await _kick_new(url, queue, mode.mass_new_per_s, record, give_up)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                record.all_orphans_ran.wait(), max(0.0, give_up - time.monotonic())
            )
    finally:
        # New tasks kicked during the drain get a bounded while to start.
        record.kicking_done = True
        record.check_new()
        if listeners:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(record.all_new_started.wait(), _GRACE_S)
        ended = time.monotonic()
        for finish, listener in listeners:
            await stop_receiver(finish, listener)
        for broker in brokers:
            await asyncio.wait_for(broker.shutdown(), 15)
        await admin.delete(queue)
        await admin.aclose()
    waits = [
        record.new_started.get(number, ended) - kicked
        for number, kicked in record.new_kicked.items()
    ]
    drained = record.all_orphans_ran.is_set()
    floor = mode.mass_orphans * mode.mass_task_s / (mode.mass_workers * mode.mass_slots)
    return {
        "broker": fleet.name,
        "settings": fleet.settings,
        "orphans": mode.mass_orphans,
        "dead_consumers": mode.mass_dead,
        "workers": mode.mass_workers,
        "slots": mode.mass_slots,
        "task_s": mode.mass_task_s,
        "new_per_s": mode.mass_new_per_s,
        "cap_s": mode.mass_cap_s,
        "floor_s": round(floor, 2),
        "drain_s": (
            round(max(record.orphan_finished.values()) - started, 2)
            if drained
            else None
        ),
        "last_orphan_started_s": (
            round(max(record.orphan_started.values()) - started, 2) if drained else None
        ),
        "orphans_left": mode.mass_orphans - len(record.orphan_finished),
        # Runs beyond the first of an orphan: none expected while workers live.
        "orphan_reruns": record.orphan_runs - len(record.orphan_started),
        "new_kicked": len(record.new_kicked),
        "new_censored": len(record.new_kicked) - len(record.new_started),
        "new_wait_p50_s": round(p50(waits), 3),
        "new_wait_p99_s": round(percentile(waits, 99), 3),
        "new_wait_max_s": round(max(waits), 3) if waits else None,
    }


def run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    rows = []
    for fleet in fleets(mode.mass_large_batch, mode.mass_slots):
        row = asyncio.run(run_fleet(url, fleet, mode, log))
        log(
            f"mass recovery: {fleet.name}: drain {row['drain_s']} s"
            f" (left {row['orphans_left']}), new p99 {row['new_wait_p99_s']} s"
        )
        rows.append(row)
    return rows
