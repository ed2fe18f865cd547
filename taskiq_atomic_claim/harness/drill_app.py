"""The taskiq app the crash drill runs under ``taskiq worker``.

Configured from the environment so a plain ``taskiq worker
taskiq_atomic_claim.harness.drill_app:broker`` subprocess picks it up. The task
reports to an events stream (data, never expiring) when it starts and ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import (
    AsyncBroker,
    TaskiqEvents,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqState,
)
from taskiq_redis import RedisStreamBroker

from taskiq_atomic_claim.broker import AtomicRedisStreamBroker
from taskiq_atomic_claim.settings import DEFAULT_MAX_DELIVERIES

TASK_NAME = "taskiq_atomic_claim.drill.work"
POISON_TASK_NAME = "taskiq_atomic_claim.drill.poison"


def events_stream(queue: str) -> str:
    return f"{queue}:drill-events"


def build_broker(
    url: str,
    queue: str,
    idle_timeout: int,
    claim_interval: int,
    kind: str,
    consumer_name: str | None = None,
    max_deliveries: int = DEFAULT_MAX_DELIVERIES,
) -> AsyncBroker:
    """``kind`` "atomic" is this package's broker; "upstream" is taskiq-redis's."""
    if kind == "upstream":
        return RedisStreamBroker(
            url,
            queue_name=queue,
            idle_timeout=idle_timeout,
            consumer_name=consumer_name,
        )
    return AtomicRedisStreamBroker(
        url,
        queue_name=queue,
        idle_timeout=idle_timeout,
        claim_interval=claim_interval,
        consumer_name=consumer_name,
        max_deliveries=max_deliveries,
    )


def add_drill_task(
    broker: AsyncBroker,
    events: Redis,
    queue: str,
    worker: str,
    task_name: str = TASK_NAME,
) -> None:
    """Give ``broker`` the drill's task: ``work(run_id, seconds)`` sleeps, and
    the worker reports "ready", "started" and "finished" to the events stream
    of ``queue`` on ``events``, each naming ``worker``. ``poison(run_id)``
    reports "started", then SIGKILLs the whole ``taskiq worker`` (its process
    group, as an OOM kill of its container would): taskiq does not restart
    it, the soak does, under a new name, as after its own kills. Before
    either, "starting" comes from a middleware that runs before the broker
    records the start: a kill between the two leaves a start the broker
    counted and the task never reported, never one it counted unreported."""

    async def report(event: str, run_id: str = "") -> None:
        fields = {"event": event, "run": run_id, "worker": worker}
        # Bounded retries: the soak restarts the server under running tasks,
        # and a lost report would read as a lost task.
        for _ in range(100):
            try:
                await events.xadd(events_stream(queue), fields)  # type: ignore[arg-type]
                return
            except (RedisConnectionError, RedisTimeoutError, OSError):
                await asyncio.sleep(0.1)
        await events.xadd(events_stream(queue), fields)  # type: ignore[arg-type]

    class ReportStarting(TaskiqMiddleware):
        # The broker adds its start recorder at the worker's startup, after
        # the app's middlewares: this one runs first.
        async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
            await report("starting", str(message.args[0]))
            return message

    broker.add_middlewares(ReportStarting())

    @broker.on_event(TaskiqEvents.WORKER_STARTUP)
    async def ready(_: TaskiqState) -> None:
        await report("ready")

    @broker.task(task_name=task_name)
    async def work(run_id: str, seconds: float) -> None:
        await report("started", run_id)
        await asyncio.sleep(seconds)
        await report("finished", run_id)

    @broker.task(task_name=POISON_TASK_NAME)
    async def poison(run_id: str) -> None:
        await report("started", run_id)
        os.killpg(os.getpgrp(), signal.SIGKILL)


_URL = os.environ.get("TAC_DRILL_URL", "redis://127.0.0.1:6379")
_QUEUE = os.environ.get("TAC_DRILL_QUEUE", "taskiq-atomic-claim-drill")
_WORKER = os.environ.get("TAC_DRILL_WORKER", f"{socket.gethostname()}:{os.getpid()}")

broker = build_broker(
    _URL,
    _QUEUE,
    # Empty: as unset (the topology drills' app imports this one).
    int(os.environ.get("TAC_DRILL_IDLE_TIMEOUT") or "2000"),
    int(os.environ.get("TAC_DRILL_CLAIM_INTERVAL") or "500"),
    os.environ.get("TAC_DRILL_BROKER", "atomic"),
    # The worker's name doubles as its consumer name, so a drill can ask the
    # server what a worker it killed still had pending.
    consumer_name=_WORKER,
    max_deliveries=int(
        os.environ.get("TAC_DRILL_MAX_DELIVERIES", str(DEFAULT_MAX_DELIVERIES))
    ),
)
# Reports may go to another server (the soak's), which survives the queue
# server's empty restart.
_EVENTS_URL = os.environ.get("TAC_DRILL_EVENTS_URL", _URL)
add_drill_task(broker, Redis.from_url(_EVENTS_URL), _QUEUE, _WORKER)
