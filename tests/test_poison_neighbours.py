"""A poison task kills every task running beside it in its worker, each time
it runs; max_deliveries must still dead-letter the poison alone. Real
``taskiq worker`` processes: the poison SIGKILLs its own process, taskiq
starts another, which reclaims the poison and its neighbours together."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from redis.asyncio import Redis

from taskiq_atomic_claim.dead_letter_policy import suspect_threshold
from taskiq_atomic_claim.harness.drill_app import TASK_NAME
from tests.conftest import Server
from tests.started_app import POISON_TASK
from tests.test_started_semantics import (
    Queue,
    fresh_queue,
    stop_gracefully,
    stopped_at_exit,
)

MAX_DELIVERIES = 5  # the default


async def test_a_poison_beside_running_tasks_dead_letters_only_itself(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    innocents = [f"innocent-{n}" for n in range(6)]
    async with fresh_queue(server, redis, tmp_path, MAX_DELIVERIES) as queue:
        # Kicked first, so they are running when the poison starts.
        for run_id in innocents:
            await queue.kick(TASK_NAME, run_id, 1.0)
        await queue.kick(POISON_TASK, "poison")
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", "--max-async-tasks", "10"))
            done = await queue.wait_until_finished(set(innocents), 120)
            dead = await queue.dead_letters(redis)
            for _ in range(60):  # the poison may still be on its last runs
                if any(b"poison" in d.fields[b"data"] for d in dead):
                    break
                await queue.wait_until_finished({"never"}, 1)
                dead = await queue.dead_letters(redis)
            poisoned = await queue.run_ids("poisoned")
            stop_gracefully(workers[-1])
        assert [
            (d.original_id, d.reason, d.deliveries)
            for d in dead
            if (b"poison" not in d.fields[b"data"])
        ] == [], "innocent neighbours of the poison were dead-lettered"
        assert done >= set(innocents), f"never finished: {set(innocents) - done}"
        assert len(dead) == 1
        assert dead[0].reason == "max_deliveries exceeded"
        assert dead[0].deliveries == MAX_DELIVERIES
        assert poisoned == ["poison"] * MAX_DELIVERIES, "once per allowed crash"
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0


def kill_the_worker_process(worker: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process ``taskiq worker`` runs tasks in (as an OOM kill
    would); taskiq starts another."""
    children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text()
    for pid in children.split():
        os.kill(int(pid), signal.SIGKILL)


async def wait_for_reports(
    queue: Queue, run_id: str, count: int, seconds: float, event: str = "started"
) -> None:
    """Until the workers reported ``event`` for ``run_id`` ``count`` times."""
    deadline = time.monotonic() + seconds
    while (await queue.run_ids(event)).count(run_id) < count:
        assert time.monotonic() < deadline, f"{run_id}: {event} not {count} times"
        await asyncio.sleep(0.05)


async def crash_it_into_a_suspect(
    queue: Queue, worker: subprocess.Popen[bytes], run_id: str, seconds: float
) -> None:
    """Kick ``run_id`` and kill the worker process under it until its entry
    has the crashes that make a suspect (the worker's next process reclaims
    it)."""
    await queue.kick(TASK_NAME, run_id, seconds)
    for crash in range(suspect_threshold(MAX_DELIVERIES)):
        await wait_for_reports(queue, run_id, crash + 1, 30)
        kill_the_worker_process(worker)


async def test_a_task_that_crashed_its_workers_runs_with_nothing_beside_it(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    """A suspect that is innocent meets a poison nobody suspects yet (kicked
    later, as a second poison would be): the poison must not start beside
    it, or every new poison adds a crash to it until it is dead-lettered
    (the soak found one dead-lettered beside three poisons)."""
    threshold = suspect_threshold(MAX_DELIVERIES)
    async with fresh_queue(server, redis, tmp_path, MAX_DELIVERIES) as queue:
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", "--max-async-tasks", "10"))
            await crash_it_into_a_suspect(queue, workers[-1], "innocent", 3.0)
            # Reclaimed with its crashes: a suspect, running.
            await wait_for_reports(queue, "innocent", threshold + 1, 30)
            await queue.kick(POISON_TASK, "poison")
            done = await queue.wait_until_finished({"innocent"}, 60)
            starts = (await queue.run_ids("started")).count("innocent")
            stop_gracefully(workers[-1])
        assert "innocent" in done
        assert starts == threshold + 1, "the poison started beside the suspect"


async def test_poisons_arriving_one_after_another_dead_letter_only_themselves(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    """Each poison kicked once the one before has made every running task a
    suspect: under "one suspect at a time" each new poison added crashes to
    the innocent holding the turn until it was dead-lettered."""
    threshold = suspect_threshold(MAX_DELIVERIES)
    innocents = [f"innocent-{n}" for n in range(3)]
    poisons = [f"poison-{n}" for n in range(3)]
    async with fresh_queue(server, redis, tmp_path, MAX_DELIVERIES) as queue:
        for run_id in innocents:
            await queue.kick(TASK_NAME, run_id, 3.0)
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", "--max-async-tasks", "10"))
            for run_id in poisons:
                await wait_for_reports(queue, innocents[0], 1, 30)
                await queue.kick(POISON_TASK, run_id)
                await wait_for_reports(queue, run_id, threshold, 60, "poisoned")
            done = await queue.wait_until_finished(set(innocents), 120)
            deadline = time.monotonic() + 120
            while len(await queue.dead_letters(redis)) < len(poisons):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            dead = await queue.dead_letters(redis)
            stop_gracefully(workers[-1])
        assert [
            (d.original_id, d.deliveries)
            for d in dead
            if b"poison" not in d.fields[b"data"]
        ] == [], "innocent neighbours of the poisons were dead-lettered"
        assert done >= set(innocents), f"never finished: {set(innocents) - done}"
        assert sorted((d.reason, d.deliveries) for d in dead) == [
            ("max_deliveries exceeded", MAX_DELIVERIES)
        ] * len(poisons)


async def test_a_graceful_stop_while_tasks_queue_for_a_suspect_loses_nothing(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    """SIGTERM while a suspect and the tasks behind it wait for their turns:
    each runs (taskiq waits for its tasks) or is handed back, none is
    dead-lettered, none stays pending, none gains a crash."""
    threshold = suspect_threshold(MAX_DELIVERIES)
    async with fresh_queue(server, redis, tmp_path, MAX_DELIVERIES) as queue:
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w1", "--max-async-tasks", "10"))
            await crash_it_into_a_suspect(queue, workers[-1], "suspect", 2.0)
            await queue.kick(TASK_NAME, "long", 3.0)
            await wait_for_reports(queue, "suspect", threshold + 1, 30)
            await queue.kick(TASK_NAME, "later", 0.5)
            await asyncio.sleep(0.3)  # read and queued behind the turns
            stop_gracefully(workers[-1])
            # Takes what w1 handed back.
            workers.append(queue.worker("w2", "--max-async-tasks", "10"))
            done = await queue.wait_until_finished({"suspect", "long", "later"}, 60)
            stop_gracefully(workers[-1])
        starts = await queue.run_ids("started")
        assert done >= {"suspect", "long", "later"}
        assert starts.count("suspect") == threshold + 1
        assert starts.count("long") == starts.count("later") == 1
        assert await queue.dead_letters(redis) == []
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0
