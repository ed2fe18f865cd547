"""Chaos soak: many messages, real workers SIGKILLed and replaced, a server restart.

``python -m taskiq_atomic_claim.harness.soak --messages 10000 --kills 50`` starts a
Redis with an fsync-always append-only file (so the restart loses nothing
that was acknowledged by the server), runs ``--workers`` real ``taskiq
worker`` processes, kills one every ``--kill-every`` seconds and starts a
replacement, restarts the server once half way, and checks at the end that
every message ran to completion at least once and nothing is left pending.

Duplicates are allowed only up to what the killed workers had in flight
(pending to them at the moment of the kill): at-least-once, not more.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq.exceptions import SendTaskError

from taskiq_atomic_claim.harness.drill import (
    Drill,
    Worker,
    drill_queue,
    running_workers,
)
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    ServerBinary,
    find_binaries,
)

CONCURRENCY = 20  # --max-async-tasks per worker
_T = TypeVar("_T")


@dataclass
class SoakReport:
    server: str
    messages: int
    workers: int
    kills: int = 0
    server_restarts: int = 0
    executed_once_or_more: int = 0
    duplicates: int = 0
    in_flight_at_kills: int = 0
    left_pending: int = 0
    recovery_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.executed_once_or_more == self.messages
            and self.left_pending == 0
            and self.duplicates <= self.in_flight_at_kills
        )

    def lines(self) -> list[str]:
        recovery = sorted(self.recovery_s)
        p99 = (
            recovery[min(len(recovery) - 1, int(len(recovery) * 0.99))]
            if (recovery)
            else 0.0
        )
        return [
            f"server {self.server}, {self.workers} workers, {self.elapsed_s:.1f} s",
            f"messages {self.messages}, executed at least once"
            f" {self.executed_once_or_more}, left pending {self.left_pending}",
            f"kills {self.kills}, server restarts {self.server_restarts}",
            f"duplicates {self.duplicates} (allowed: in flight at the kills"
            f" {self.in_flight_at_kills})",
            "recovery after a kill (until the killed worker's entries were"
            f" reclaimed): median {statistics.median(recovery or [0]):.2f} s,"
            f" p99 {p99:.2f} s, max {max(recovery or [0]):.2f} s"
            f" over {len(recovery)} kills",
            "PASS" if self.ok else "FAIL",
        ]


async def _pending_by_consumer(client: Redis, queue: str) -> dict[str, int]:
    summary: Any = await client.xpending(queue, "taskiq")
    return {
        c["name"].decode(): int(c["pending"]) for c in summary.get("consumers") or []
    }


async def _finished_counts(client: Redis, stream: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    last = "-"
    for _ in range(10_000):  # bounded pages of 10k events
        page: Any = await client.xrange(stream, min=last, count=10_000)
        if last != "-":
            page = page[1:]
        if not page:
            break
        for _, fields in page:
            if fields[b"event"] == b"finished":
                counts[fields[b"run"].decode()] += 1
        last = page[-1][0].decode()
    return counts


@dataclass
class _Chaos:
    """The soak's moving parts: live workers by slot, kills, recoveries."""

    drill: Drill
    server: LocalServer
    report: SoakReport
    processes: list[Worker]
    live: dict[int, tuple[str, Worker]] = field(default_factory=dict)
    recovering: list[tuple[str, float]] = field(default_factory=list)
    generation: int = 0

    def spawn(self, slot: int) -> str:
        self.generation += 1
        name = f"w{slot}-{self.generation}"
        worker = self.drill.worker(name, "--max-async-tasks", str(CONCURRENCY))
        self.live[slot] = (name, worker)
        self.processes.append(worker)
        return name

    async def pending(self) -> dict[str, int]:
        client = self.drill.events.client
        return await _retrying(lambda: _pending_by_consumer(client, self.drill.queue))

    async def kill_one(self) -> None:
        name, worker = self.live[self.report.kills % self.report.workers]
        worker.kill()
        killed_at = time.monotonic()
        worker.process.wait(timeout=10)
        self.report.in_flight_at_kills += (await self.pending()).get(name, 0)
        self.report.kills += 1
        self.recovering.append((name, killed_at))
        self.spawn((self.report.kills - 1) % self.report.workers)

    async def restart_server(self) -> None:
        self.server.stop()
        self.server.start()
        self.report.server_restarts += 1
        await self.drill.events.client.connection_pool.disconnect()

    def note_recoveries(self, pending: dict[str, int]) -> None:
        now = time.monotonic()
        for name, killed_at in list(self.recovering):
            if pending.get(name, 0) == 0:
                self.report.recovery_s.append(now - killed_at)
                self.recovering.remove((name, killed_at))


async def run_soak(
    server: LocalServer,
    *,
    messages: int,
    workers: int = 3,
    kills: int = 5,
    kill_every: float = 2.0,
    idle_timeout: int = 1000,
    claim_interval: int = 200,
    time_limit: float = 600.0,
    log_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    report = SoakReport(server.binary.label, messages, workers)
    began = time.monotonic()
    deadline = began + time_limit
    async with drill_queue(
        server.url, idle_timeout, claim_interval, log_dir=log_dir
    ) as drill:
        client = drill.events.client
        with running_workers() as processes:
            chaos = _Chaos(drill, server, report, processes)
            for name in [chaos.spawn(slot) for slot in range(workers)]:
                ready_by = time.monotonic() + 30
                if await drill.events.wait_for("ready", ready_by, worker=name) is None:
                    raise RuntimeError(f"soak worker {name} did not start")
            # Tasks last long enough that the kills land on busy workers.
            task_seconds = workers * CONCURRENCY * kills * kill_every / messages

            async def kick_all() -> None:
                for number in range(messages):
                    run_id = f"m{number}"
                    await _retrying(lambda: drill.kick(run_id, task_seconds))  # noqa: B023

            kicking = asyncio.create_task(kick_all())
            next_kill = time.monotonic() + kill_every
            next_progress = time.monotonic()
            try:
                while time.monotonic() < deadline:
                    if kicking.done() and kicking.exception() is not None:
                        raise RuntimeError("kicking messages failed") from (
                            kicking.exception()
                        )
                    pending = await chaos.pending()
                    chaos.note_recoveries(pending)
                    if report.kills < kills and time.monotonic() >= next_kill:
                        await chaos.kill_one()
                        next_kill = time.monotonic() + kill_every
                        if report.kills == max(1, kills // 2):
                            await chaos.restart_server()
                    done = await _retrying(
                        lambda: _finished_counts(client, drill.events.stream)
                    )
                    if progress is not None and time.monotonic() >= next_progress:
                        next_progress = time.monotonic() + 5
                        progress(
                            f"{time.monotonic() - began:6.1f} s: {len(done)}/{messages}"
                            f" done, {sum(pending.values())} pending,"
                            f" {report.kills} kills"
                        )
                    settled = (
                        kicking.done()
                        and report.kills >= kills
                        and not chaos.recovering
                        and len(done) >= messages
                        and not sum(pending.values())
                    )
                    if settled:
                        break
                    await asyncio.sleep(0.2)
            finally:
                kicking.cancel()
            counts = await _finished_counts(client, drill.events.stream)
            report.executed_once_or_more = sum(
                1 for number in range(messages) if counts[f"m{number}"] > 0
            )
            report.duplicates = sum(max(0, n - 1) for n in counts.values())
            report.left_pending = sum((await chaos.pending()).values())
    report.elapsed_s = time.monotonic() - began
    return report


async def _retrying(call: Callable[[], Awaitable[_T]], attempts: int = 100) -> _T:
    """The soak's own reads ride out the server restart it causes."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError, OSError, SendTaskError):
            await asyncio.sleep(0.1)
    return await call()


def durable_server(binary: ServerBinary) -> LocalServer:
    return LocalServer(binary, ("--appendonly", "yes", "--appendfsync", "always"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m taskiq_atomic_claim.harness.soak",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--kill-every", type=float, default=3.0)
    parser.add_argument("--time-limit", type=float, default=1200.0)
    parser.add_argument("--server", help="server label, e.g. redis-7.0.15")
    args = parser.parse_args(argv)
    binaries = {b.label: b for b in find_binaries()}
    if not binaries:
        print("no server binary found", file=sys.stderr)
        return 2
    label = args.server or max(binaries, key=lambda key: binaries[key].major)
    with durable_server(binaries[label]) as server:
        report = asyncio.run(
            run_soak(
                server,
                messages=args.messages,
                workers=args.workers,
                kills=args.kills,
                kill_every=args.kill_every,
                time_limit=args.time_limit,
                progress=lambda line: print(line, flush=True),
            )
        )
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
