"""The crash drill: SIGKILL a real ``taskiq worker`` mid-task, time the recovery.

Each round starts a worker with ``--ack-type when_executed``, sends it one
task, kills the worker's whole process group the moment the task starts
(so the message stays pending, as after an OOM kill), starts a replacement
worker and measures how long until the replacement runs the task again.
The queue is otherwise idle, which is the case taskiq-redis 1.2.4 never
recovers from.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from taskiq import AsyncBroker
from taskiq.kicker import AsyncKicker

from taskiq_atomic_claim.harness.drill_app import (
    POISON_TASK_NAME,
    TASK_NAME,
    build_broker,
    events_stream,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.settings import DEFAULT_MAX_DELIVERIES


@dataclass
class DrillRound:
    recovered: bool
    # SIGKILL to the replacement starting the task; None if never.
    kill_to_rerun_s: float | None
    # First delivery to the rerun: what idle_timeout bounds.
    delivery_to_rerun_s: float | None


@dataclass
class DrillReport:
    url: str
    broker: str
    idle_timeout: int
    claim_interval: int
    # What ran it, as the server names itself ("Valkey 8.1.8").
    server: str = "unknown server"
    rounds: list[DrillRound] = field(default_factory=list)

    @property
    def recovered(self) -> int:
        return sum(r.recovered for r in self.rounds)

    def kill_to_rerun(self) -> list[float]:
        return [r.kill_to_rerun_s for r in self.rounds if r.kill_to_rerun_s is not None]

    def summary(self) -> str:
        times = self.kill_to_rerun()
        setting = (
            "taskiq-redis RedisStreamBroker"
            if self.broker == "upstream"
            else f"AtomicRedisStreamBroker, claim interval {self.claim_interval} ms"
        )
        head = (
            f"{setting}, idle_timeout {self.idle_timeout} ms, on {self.server}:"
            f" recovered {self.recovered}/{len(self.rounds)}"
        )
        if not times:
            return head
        return (
            f"{head}; SIGKILL -> rerun median {statistics.median(times):.2f} s,"
            f" max {max(times):.2f} s"
        )


async def server_name(client: Redis) -> str:
    """ "Redis 7.0.15" or "Valkey 8.1.8": Valkey reports its own version in
    ``valkey_version`` (``redis_version`` is what it is compatible with)."""
    info = await client.info("server")
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', '(version unknown)')}"


def _taskiq_command() -> list[str]:
    script = Path(sys.executable).with_name("taskiq")
    return [str(script)] if script.exists() else [sys.executable, "-m", "taskiq"]


def worker_command(app: str, *extra_args: str) -> list[str]:
    """``taskiq worker APP`` as every drill runs it: one process, acks after
    the task ran, nothing prefetched (the test and topology drills too)."""
    return [
        *_taskiq_command(), "worker", app,
        "--ack-type", "when_executed",
        "--workers", "1",
        "--max-prefetch", "0",
        "--log-level", "WARNING",
        *extra_args,
    ]  # fmt: skip


# How long a worker may take to say it is ready.
WORKER_START_S = 60.0


class Worker:
    """A ``taskiq worker`` process group, killed with the group."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        app: str = "taskiq_atomic_claim.harness.drill_app:broker",
    ) -> None:
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            worker_command(app, *extra_args),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            self.process.wait(timeout=10)
        self.log.close()


class Events:
    """What the drill workers report, in the order they reported it."""

    def __init__(self, client: Redis, stream: str) -> None:
        self.client = client
        self.stream = stream
        self.last_id = "0-0"
        # (seen at, event, run, worker): waits may ask in any order, so an
        # event read while waiting for another is kept, not skipped.
        self.seen: list[tuple[float, str, str, str]] = []

    def _find(self, event: str, run_id: str, worker: str | None) -> float | None:
        for seen_at, seen_event, seen_run, seen_worker in self.seen:
            if (seen_event, seen_run) == (event, run_id) and worker in (
                None,
                seen_worker,
            ):
                return seen_at
        return None

    async def wait_for(
        self, event: str, deadline: float, run_id: str = "", worker: str | None = None
    ) -> float | None:
        """Monotonic time the event was first seen, or None at the deadline."""
        while (found := self._find(event, run_id, worker)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            reply: Any = await self.client.xread(
                {self.stream: self.last_id},
                block=max(1, int(min(remaining, 0.5) * 1000)),
            )
            now = time.monotonic()
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self.last_id = entry_id.decode()
                    self.seen.append(
                        (
                            now,
                            fields[b"event"].decode(),
                            fields[b"run"].decode(),
                            fields[b"worker"].decode(),
                        )
                    )
        return found


@contextlib.contextmanager
def running_workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        yield started
    finally:
        for worker in started:
            worker.kill()
            worker.stop()


@dataclass
class Drill:
    url: str
    queue: str
    report: DrillReport
    events: Events
    kicker_broker: AsyncBroker
    give_up_after: float
    log_dir: Path
    events_url: str = ""  # where workers report; the queue's server if empty
    max_deliveries: int = DEFAULT_MAX_DELIVERIES

    def worker(self, name: str, *extra_args: str) -> Worker:
        env = {
            **os.environ,
            "TAC_DRILL_URL": self.url,
            "TAC_DRILL_QUEUE": self.queue,
            "TAC_DRILL_IDLE_TIMEOUT": str(self.report.idle_timeout),
            "TAC_DRILL_CLAIM_INTERVAL": str(self.report.claim_interval),
            "TAC_DRILL_BROKER": self.report.broker,
            "TAC_DRILL_WORKER": name,
            "TAC_DRILL_EVENTS_URL": self.events_url or self.url,
            "TAC_DRILL_MAX_DELIVERIES": str(self.max_deliveries),
        }
        return Worker(env, self.log_dir / f"{self.queue}-{name}.log", extra_args)

    async def kick(self, run_id: str, seconds: float) -> None:
        kicker: AsyncKicker[Any, Any] = AsyncKicker(TASK_NAME, self.kicker_broker, {})
        await kicker.kiq(run_id, seconds)

    async def kick_poison(self, run_id: str) -> None:
        kicker: AsyncKicker[Any, Any] = AsyncKicker(
            POISON_TASK_NAME, self.kicker_broker, {}
        )
        await kicker.kiq(run_id)

    async def one_round(self, number: int) -> DrillRound:
        run_id = f"round-{number}"
        with running_workers() as workers:
            doomed_name = f"doomed-{number}"
            doomed = self.worker(doomed_name)
            workers.append(doomed)
            # A worker's start-up is not what a round measures: on a loaded
            # machine importing taskiq alone can outlast a short give-up.
            started_by = time.monotonic() + max(self.give_up_after, WORKER_START_S)
            if (
                await self.events.wait_for("ready", started_by, worker=doomed_name)
                is None
            ):
                raise RuntimeError(f"drill worker did not start; see {doomed.log.name}")
            deadline = time.monotonic() + self.give_up_after
            await self.kick(run_id, 1.0)
            delivered = await self.events.wait_for(
                "started", deadline, run_id, doomed_name
            )
            if delivered is None:
                raise RuntimeError("drill worker never started the task")
            doomed.kill()
            killed = time.monotonic()
            doomed.process.wait(timeout=10)

            fresh_name = f"fresh-{number}"
            workers.append(self.worker(fresh_name))
            rerun = await self.events.wait_for(
                "started", killed + self.give_up_after, run_id, fresh_name
            )
            if rerun is None:
                return DrillRound(False, None, None)
            await self.events.wait_for(
                "finished", rerun + self.give_up_after, run_id, fresh_name
            )
            return DrillRound(True, rerun - killed, rerun - delivered)


@contextlib.asynccontextmanager
async def drill_queue(
    url: str,
    idle_timeout: int,
    claim_interval: int,
    broker_kind: str = "atomic",
    log_dir: Path | None = None,
    give_up_after: float = 30.0,
    events_url: str | None = None,
    max_deliveries: int = DEFAULT_MAX_DELIVERIES,
) -> AsyncIterator[Drill]:
    """A fresh queue for drill workers; its keys are deleted afterwards.

    Workers report to ``events_url`` (default: the queue's own server).
    """
    queue = f"taskiq-atomic-claim-drill-{uuid.uuid4().hex[:8]}"
    client = Redis.from_url(url)
    events_client = Redis.from_url(events_url) if events_url else client
    drill = Drill(
        url=url,
        queue=queue,
        report=DrillReport(url, broker_kind, idle_timeout, claim_interval),
        events=Events(events_client, events_stream(queue)),
        kicker_broker=build_broker(
            url, queue, idle_timeout, claim_interval, broker_kind
        ),
        give_up_after=give_up_after,
        log_dir=log_dir or Path(tempfile.gettempdir()),
        events_url=events_url or "",
        max_deliveries=max_deliveries,
    )
    try:
        # The group must exist before the first kick: a worker's startup
        # creates it at "$", which would skip a message sent just before.
        await client.xgroup_create(queue, "taskiq", id="0", mkstream=True)
        drill.report.server = await server_name(client)
        yield drill
    finally:
        keys = StreamKeys(queue, "taskiq")
        # The soak restarts the server: pooled connections may be dead.
        await client.connection_pool.disconnect()
        await client.delete(
            queue,
            drill.events.stream,
            keys.lease,
            keys.cursor,
            keys.dead_letters,
            keys.reclaimed,
        )
        await events_client.delete(drill.events.stream)
        await drill.kicker_broker.shutdown()
        await client.aclose()
        if events_client is not client:
            await events_client.aclose()


async def run_drill(
    url: str,
    *,
    rounds: int = 3,
    idle_timeout: int = 2000,
    claim_interval: int = 500,
    broker_kind: str = "atomic",
    give_up_after: float = 30.0,
    log_dir: Path | None = None,
    plant_legacy_lock: bool = False,
) -> DrillReport:
    """Run ``rounds`` kill-and-recover rounds against the server at ``url``.

    ``plant_legacy_lock`` first writes the no-expiry ``autoclaim:*`` key a
    taskiq-redis 1.1.2 worker killed inside its lock leaves behind.
    """
    async with drill_queue(
        url, idle_timeout, claim_interval, broker_kind, log_dir, give_up_after
    ) as drill:
        client = drill.events.client
        legacy_lock = f"autoclaim:taskiq:{drill.queue}"
        if plant_legacy_lock:
            await client.set(legacy_lock, "killed-worker-token")
        try:
            for number in range(rounds):
                drill.report.rounds.append(await drill.one_round(number))
        finally:
            if plant_legacy_lock:
                await client.delete(legacy_lock)
    return drill.report


def main_drill(url: str, rounds: int, broker_kind: str) -> DrillReport:
    return asyncio.run(run_drill(url, rounds=rounds, broker_kind=broker_kind))
