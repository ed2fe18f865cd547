"""The turns a worker gives the tasks it starts (suspects.py), in-process:
no server is involved, only asyncio tasks taking and ending turns. The
behaviour with real workers and a poison is tests/test_poison_neighbours.py."""

from __future__ import annotations

import asyncio

import pytest

from taskiq_atomic_claim.delivery import Delivery
from taskiq_atomic_claim.suspects import SuspectsRunAlone

MAX_DELIVERIES = 5  # suspects from 2 crashes


class Worker:
    """Tasks that take a turn, note that they run, and run until released."""

    def __init__(self) -> None:
        self.gate = SuspectsRunAlone(MAX_DELIVERIES)
        self.running: set[str] = set()
        self.releases: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, crashes: int = 0) -> None:
        release = self.releases[name] = asyncio.Event()

        async def run() -> None:
            # As EntryLifecycle.starting takes a turn: at once when it may,
            # else waiting for it.
            delivery = Delivery("s", name, 0.0, crashes=crashes)
            task = asyncio.current_task()
            assert task is not None
            if not self.gate.took_turn(delivery, task):
                await self.gate.wait_turn(delivery)
            self.running.add(name)
            try:
                await release.wait()
            finally:
                self.running.discard(name)

        self.tasks[name] = asyncio.create_task(run())

    async def end(self, name: str) -> set[str]:
        """End ``name``; what runs once the turns are handed out."""
        self.releases[name].set()
        await self.tasks[name]
        await settle()
        return set(self.running)

    async def cancel(self, name: str) -> set[str]:
        self.tasks[name].cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.tasks[name]
        await settle()
        return set(self.running)

    async def suspect_queued_behind(self, *running: str) -> None:
        """``running`` run; a suspect comes, then a task that is not one."""
        for name in running:
            self.start(name)
        await settle()
        self.start("suspect", crashes=2)
        self.start("later")
        await settle()
        assert self.running == set(running)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_tasks_not_suspect_run_together() -> None:
    worker = Worker()
    for name in ("a", "b", "c"):
        worker.start(name, crashes=1)
    await settle()
    assert worker.running == {"a", "b", "c"}


async def test_a_suspect_waits_for_the_running_and_nothing_starts_meanwhile() -> None:
    worker = Worker()
    await worker.suspect_queued_behind("a", "b")
    assert await worker.end("a") == {"b"}
    assert await worker.end("b") == {"suspect"}
    assert await worker.end("suspect") == {"later"}


async def test_suspects_run_one_after_another() -> None:
    worker = Worker()
    worker.start("s1", crashes=2)
    worker.start("s2", crashes=3)
    await settle()
    assert worker.running == {"s1"}
    assert await worker.end("s1") == {"s2"}


async def test_a_suspect_cancelled_while_waiting_lets_the_others_start() -> None:
    worker = Worker()
    await worker.suspect_queued_behind("a")
    assert await worker.cancel("suspect") == {"a", "later"}


async def test_a_turn_given_then_cancelled_is_not_kept() -> None:
    worker = Worker()
    await worker.suspect_queued_behind("a")
    # a's end gives the suspect the turn before this test resumes; the
    # suspect is cancelled before it runs again.
    worker.releases["a"].set()
    await worker.tasks["a"]
    assert worker.gate._running == 1, "the suspect was not given the turn"
    assert await worker.cancel("suspect") == {"later"}


async def test_without_crash_counts_nothing_waits() -> None:
    worker = Worker()
    worker.gate = SuspectsRunAlone(0)
    worker.start("a", crashes=9)
    worker.start("b", crashes=9)
    await settle()
    assert worker.running == {"a", "b"}
