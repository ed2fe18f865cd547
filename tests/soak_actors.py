"""The chaos soak's actors: the producer kicking at a steady rate and the
chaos that kills, stops and replaces workers and restarts the server."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq.exceptions import SendTaskError

from taskiq_atomic_claim.harness.drill import (
    Drill,
    Worker,
)
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
)
from tests.soak_accounting import (
    DeadLetterWatch,
    SoakReport,
    _pending_by_consumer,
)

CONCURRENCY = 20  # --max-async-tasks per worker
EMPTY_OUTAGE_S = 1.0  # the empty restart's downtime, the producer kicking on
_T = TypeVar("_T")
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, SendTaskError)


async def _retrying(call: Callable[[], Awaitable[_T]], attempts: int = 100) -> _T:
    """The soak's own reads ride out the server restarts it causes."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except _UNREACHABLE:
            await asyncio.sleep(0.1)
    return await call()


def _refused(error: BaseException) -> bool:
    """Whether the server refused the connection (so nothing was written)."""
    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or "Connection refused" in str(
            seen
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass
class _Producer:
    """Kicks ``messages`` tasks at a steady rate; each is retried until the
    server accepts it (XADD returned an id), and the time that happened is
    kept: what an empty restart can take is what was accepted before it."""

    drill: Drill
    messages: int
    rate: float
    task_seconds: float
    backlog: int = 0  # kicked at once first: work queued at the first stops
    poison: int = 0  # tasks that kill their worker, among the last third
    accepted_at: dict[str, float] = field(default_factory=dict)
    poison_accepted_at: dict[str, float] = field(default_factory=dict)
    resent: int = 0
    # Set once the empty restart is over: it would take a poison task with
    # it before its max_deliveries starts.
    poison_gate: asyncio.Event = field(default_factory=asyncio.Event)
    # Set as the empty restart begins: the last sixth waits for it, so the
    # restart comes under a live producer however slowly the workers that
    # it waits for come up (the kicks during its outage are retried).
    empty_begun: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        next_at = time.monotonic()
        # Spread over the sixth after two thirds: done well before the end.
        poison_due = [
            2 * self.messages // 3 + k * self.messages // (6 * self.poison)
            for k in range(self.poison)
        ]
        for number in range(self.messages):
            if number == 5 * self.messages // 6:
                await self.empty_begun.wait()
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await self._kick(f"m{number}")
            while (
                self.poison_gate.is_set()
                and len(self.poison_accepted_at) < self.poison
                and number >= poison_due[len(self.poison_accepted_at)]
            ):
                await self._kick(f"p{len(self.poison_accepted_at)}", poison=True)
            if number < self.backlog:
                next_at = time.monotonic()
                continue
            # Steady: time lost to an outage is not made up in a burst.
            next_at = max(next_at + 1 / self.rate, time.monotonic() - 0.05)
        while len(self.poison_accepted_at) < self.poison:
            await self.poison_gate.wait()
            await self._kick(f"p{len(self.poison_accepted_at)}", poison=True)

    async def _kick(self, run_id: str, *, poison: bool = False) -> None:
        maybe_written = False
        for _ in range(600):  # 60 s of retries: longer than any outage here
            try:
                if poison:
                    await self.drill.kick_poison(run_id)
                else:
                    await self.drill.kick(run_id, self.task_seconds)
            except _UNREACHABLE as error:
                maybe_written = maybe_written or not _refused(error)
                await asyncio.sleep(0.1)
                continue
            accepted = self.poison_accepted_at if poison else self.accepted_at
            accepted[run_id] = time.monotonic()
            self.resent += maybe_written
            return
        raise RuntimeError(f"the server never accepted {run_id}")


@dataclass
class _Chaos:
    """The soak's moving parts: live workers by slot, kills, stops, restarts."""

    drill: Drill
    server: LocalServer
    queue_client: Redis
    dead: DeadLetterWatch
    report: SoakReport
    processes: list[Worker]
    live: dict[int, tuple[str, Worker]] = field(default_factory=dict)
    recovering: list[tuple[str, float]] = field(default_factory=list)
    generation: int = 0
    disruptions: int = 0
    # Workers that died while running what they had: killed, stopped by
    # force, or exited on their own (a poison task); the last also apart.
    died: set[str] = field(default_factory=set)
    exited: list[str] = field(default_factory=list)
    empty_up_at: float | None = None  # when the empty server first answered

    def spawn(self, slot: int) -> str:
        self.generation += 1
        name = f"w{slot}-{self.generation}"
        worker = self.drill.worker(name, "--max-async-tasks", str(CONCURRENCY))
        self.live[slot] = (name, worker)
        self.processes.append(worker)
        return name

    async def pending(self) -> dict[str, int]:
        return await _retrying(
            lambda: _pending_by_consumer(self.queue_client, self.drill.queue)
        )

    async def disrupt(self) -> None:
        """The next SIGKILL or SIGTERM, spread evenly, round the slots."""
        slot = self.disruptions % self.report.workers
        self.disruptions += 1
        stops_due = (
            self.disruptions
            * self.report.planned_graceful
            // (self.report.planned_kills + self.report.planned_graceful)
        )
        if self.report.graceful_restarts < stops_due:
            await self.stop(slot)
        else:
            await self.kill(slot)
        self.spawn(slot)

    async def kill(self, slot: int) -> None:
        name, worker = self.live[slot]
        worker.kill()
        killed_at = time.monotonic()
        await asyncio.to_thread(worker.process.wait, 10)
        await self._died(name, killed_at)
        self.report.kills += 1

    async def _died(self, name: str, at: float) -> None:
        self.report.in_flight_at_kills += (await self.pending()).get(name, 0)
        self.died.add(name)
        self.recovering.append((name, at))

    async def replace_exited(self) -> None:
        """Replace each worker that exited on its own (a poison task killed
        it), as after a kill."""
        for slot, (name, worker) in list(self.live.items()):
            if worker.process.poll() is None:
                continue
            await self._died(name, time.monotonic())
            self.exited.append(name)
            self.report.poison_deaths += 1
            self.spawn(slot)

    async def stop(self, slot: int) -> None:
        """A rolling deploy's stop: SIGTERM, wait for the clean exit."""
        name, worker = self.live[slot]
        before = (await self.pending()).get(name, 0)
        await asyncio.to_thread(worker.stop)
        after = (await self.pending()).get(name, 0)
        # What it had delivered and unacked when told to stop; what it
        # handed back stays pending to it until another worker claims it.
        self.report.in_flight_at_kills += max(before, after)
        self.report.graceful_restarts += 1
        if worker.process.returncode == -signal.SIGKILL:
            self.report.graceful_forced += 1
            self.died.add(name)

    async def restart_server(self, *, empty: bool) -> None:
        if empty:
            await self.dead.read_new()  # the dead letters it is about to lose
        await asyncio.to_thread(self._restart, empty)
        await self.queue_client.connection_pool.disconnect()
        if empty:
            self.report.empty_restarts += 1
            self.dead.forget_position()
            self.recovering.clear()  # the pending lists went with the data
        else:
            self.report.aof_restarts += 1

    def _restart(self, empty: bool) -> None:
        self.server.stop()
        if empty:
            stopped_ms = int(time.time() * 1000)
            for name in ("appendonly.aof", "dump.rdb"):
                (self.server.directory / name).unlink(missing_ok=True)
            shutil.rmtree(self.server.directory / "appendonlydir", ignore_errors=True)
            time.sleep(EMPTY_OUTAGE_S)
        self.server.start()
        if empty:
            self.empty_up_at = time.monotonic()
            self._check_empty(stopped_ms)

    def _check_empty(self, stopped_ms: int) -> None:
        """Nothing older than the restart is back (the producer may already
        have recreated the stream)."""
        with SyncRedis.from_url(self.server.url) as client:
            first: Any = client.xrange(self.drill.queue, count=1)
        if first and int(first[0][0].split(b"-")[0]) < stopped_ms:
            raise RuntimeError("the empty restart kept the queue's entries")

    def note_recoveries(self, pending: dict[str, int]) -> None:
        now = time.monotonic()
        for name, killed_at in list(self.recovering):
            if pending.get(name, 0) == 0:
                self.report.recovery_s.append(now - killed_at)
                self.recovering.remove((name, killed_at))
