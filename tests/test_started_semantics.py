"""max_deliveries counts crashes while running, nothing else; nothing held is
held for ever. Real ``taskiq worker`` processes on every local server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq import TaskiqResult
from taskiq.kicker import AsyncKicker
from taskiq.receiver import Receiver
from taskiq.utils import maybe_awaitable
from taskiq_redis import RedisAsyncResultBackend

from taskiq_atomic_claim import AtomicRedisStreamBroker, DeadLettered
from taskiq_atomic_claim.admin.dead_letters import (
    DeadLetter,
    list_dead_letters,
    requeue_dead_letters,
)
from taskiq_atomic_claim.harness.drill import Events, _taskiq_command
from taskiq_atomic_claim.harness.drill_app import TASK_NAME, events_stream
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from tests.conftest import Server
from tests.receiver import start_as_the_receiver_does
from tests.started_app import (
    INSTANT_POISON_TASK,
    POISON_TASK,
    POISON_UNTIL_CURED_TASK,
    cure_stream,
)
from tests.test_broker import message
from tests.test_reliability import started

REPO = Path(__file__).resolve().parent.parent
IDLE_MS, INTERVAL_MS = 1000, 200


@dataclass
class Queue:
    name: str
    url: str
    log_dir: Path
    events: Events
    kicker: AtomicRedisStreamBroker
    max_deliveries: int

    @property
    def keys(self) -> StreamKeys:
        return StreamKeys(self.name, "taskiq")

    @property
    def runs_file(self) -> Path:
        """Where the instant poison notes each run."""
        return self.log_dir / "instant-poison-runs.txt"

    def worker(
        self,
        name: str,
        *extra_args: str,
        old_release: bool = False,
        results_url: str = "",
    ) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "TAC_TEST_RUNS_FILE": str(self.runs_file),
            "TAC_TEST_RESULTS_URL": results_url,
            "PYTHONPATH": str(REPO),
            "TAC_TEST_URL": self.url,
            "TAC_TEST_QUEUE": self.name,
            "TAC_TEST_WORKER": name,
            "TAC_TEST_IDLE_TIMEOUT": str(IDLE_MS),
            "TAC_TEST_CLAIM_INTERVAL": str(INTERVAL_MS),
            "TAC_TEST_MAX_DELIVERIES": str(self.max_deliveries),
            "TAC_TEST_OLD_RELEASE": str(int(old_release)),
        }
        # The poison kills the worker process; taskiq starts another.
        extra_args = ("--max-fails", "50", *extra_args)
        return taskiq_worker(
            "tests.started_app:broker", self.log_dir / f"{name}.log", env, *extra_args
        )

    async def kick(self, task: str, *args: Any, **labels: Any) -> None:
        kicker: AsyncKicker[Any, Any] = AsyncKicker(task, self.kicker, labels)
        await kicker.kiq(*args)

    async def run_ids(self, event: str) -> list[str]:
        await self.read_events()
        return [run for _, seen, run, _ in self.events.seen if seen == event]

    async def read_events(self) -> None:
        """Read what the workers reported so far (waits ~50 ms at most)."""
        await self.events.wait_for("never", time.monotonic() + 0.05)

    async def wait_for_a_start(self, worker: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self.read_events()
            if any(e == "started" and w == worker for _, e, _, w in self.events.seen):
                return True
            await asyncio.sleep(0.1)
        return False

    async def wait_until_finished(self, runs: set[str], seconds: float) -> set[str]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            done = set(await self.run_ids("finished"))
            if done >= runs:
                return done
            await asyncio.sleep(0.2)
        return set(await self.run_ids("finished"))

    async def dead_letters(self, client: Redis) -> list[DeadLetter]:
        return await list_dead_letters(client, self.keys, count=1000)


def taskiq_worker(
    app: str, log: Path, env: dict[str, str], *extra_args: str
) -> subprocess.Popen[bytes]:
    """``taskiq worker APP``: one process, nothing prefetched, its output
    appended to ``log``, in a session of its own."""
    return subprocess.Popen(
        [
            *_taskiq_command(),
            "worker",
            app,
            "--workers",
            "1",
            "--max-prefetch",
            "0",
            "--log-level",
            "INFO",
            *extra_args,
        ],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@contextlib.asynccontextmanager
async def fresh_queue(
    server: Server, redis: Redis, tmp_path: Path, max_deliveries: int = 2
) -> AsyncIterator[Queue]:
    name = f"taskiq-atomic-claim-drill-started-{uuid.uuid4().hex[:8]}"
    kicker = AtomicRedisStreamBroker(server.url, queue_name=name)
    queue = Queue(
        name,
        server.url,
        tmp_path,
        Events(redis, events_stream(name)),
        kicker,
        max_deliveries,
    )
    # Before the first kick: a worker's startup creates the group at "$".
    await redis.xgroup_create(name, "taskiq", id="0", mkstream=True)
    try:
        yield queue
    finally:
        await kicker.shutdown()


@contextlib.contextmanager
def stopped_at_exit() -> Iterator[list[subprocess.Popen[bytes]]]:
    workers: list[subprocess.Popen[bytes]] = []
    try:
        yield workers
    finally:
        for process in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def stop_gracefully(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        pytest.fail("the worker did not stop within 20 s of SIGTERM")


def log_text(queue: Queue) -> str:
    return "".join(p.read_text(errors="replace") for p in queue.log_dir.glob("*.log"))


async def test_graceful_restarts_never_dead_letter_tasks_that_never_started(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # A rolling deploy: each worker reads the whole backlog, runs two tasks
    # at a time and is stopped with SIGTERM; its successor reclaims the rest.
    # With max_deliveries 2, three hand-backs were enough to dead-letter
    # every task still waiting.
    runs = {f"job-{n}" for n in range(40)}
    async with fresh_queue(server, redis, tmp_path) as queue:
        for run_id in sorted(runs):
            await queue.kick(TASK_NAME, run_id, 0.2)
        with stopped_at_exit() as workers:
            for restart in range(4):
                workers.append(queue.worker(f"w{restart}", "--max-async-tasks", "2"))
                # Stopped while running its first tasks, the rest unstarted
                # (none left to start: the dead letters below tell why).
                began = await queue.wait_for_a_start(f"w{restart}", 30)
                await asyncio.sleep(0.3)
                stop_gracefully(workers[-1])
                if not began:
                    break
            workers.append(queue.worker("last", "--max-async-tasks", "2"))
            done = await queue.wait_until_finished(runs, 60)
            dead = await queue.dead_letters(redis)
            assert [d.original_id for d in dead] == [], [d.reason for d in dead]
            assert done >= runs, f"never ran: {sorted(runs - done)}"
            stop_gracefully(workers[-1])
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0


async def test_a_poison_task_alone_reaches_the_dead_letters(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # One slot: the tasks kicked after the poison sit read-but-unstarted each
    # time it kills the worker; only the poison crashes while running.
    innocents = [f"innocent-{n}" for n in range(6)]
    async with fresh_queue(server, redis, tmp_path, max_deliveries=2) as queue:
        for run_id in innocents[:3]:
            await queue.kick(TASK_NAME, run_id, 0.05)
        await queue.kick(POISON_TASK, "poison")
        for run_id in innocents[3:]:
            await queue.kick(TASK_NAME, run_id, 0.05)
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", "--max-async-tasks", "1"))
            done = await queue.wait_until_finished(set(innocents), 60)
            dead = await queue.dead_letters(redis)
            poisoned = await queue.run_ids("poisoned")
            stop_gracefully(workers[-1])
        assert done >= set(innocents), f"never ran: {set(innocents) - done}"
        assert len(dead) == 1, [(d.original_id, d.reason) for d in dead]
        assert b"poison" in dead[0].fields[b"data"]
        assert dead[0].reason == "max_deliveries exceeded"
        assert dead[0].deliveries == 2
        assert poisoned == ["poison", "poison"], "ran once per allowed crash"
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0


async def test_a_task_that_kills_its_worker_at_once_is_counted(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # The start is not awaited to the server's reply: it counts once its
    # write is in the kernel, which a SIGKILL right after does not undo.
    async with fresh_queue(server, redis, tmp_path, max_deliveries=2) as queue:
        await queue.kick(INSTANT_POISON_TASK, "instant")
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", "--max-async-tasks", "1"))
            deadline = time.monotonic() + 60
            while not (dead := await queue.dead_letters(redis)):
                assert time.monotonic() < deadline, "never dead-lettered"
                await asyncio.sleep(0.2)
            stop_gracefully(workers[-1])
        assert len(dead) == 1
        assert dead[0].reason == "max_deliveries exceeded"
        assert dead[0].deliveries == 2
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0


async def test_an_idle_workers_task_that_kills_it_at_once_is_counted(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # A worker that ran a task before and sits idle writes its next start
    # alone, corked: held in the kernel, pushed when the loop next turns,
    # which this task never lets happen. The kernel sends it as the killed
    # process's socket closes: counted once, the poison runs once.
    async with fresh_queue(server, redis, tmp_path, max_deliveries=1) as queue:
        await queue.kick(TASK_NAME, "warm-up", 0)
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", "--max-async-tasks", "1"))
            assert "warm-up" in await queue.wait_until_finished({"warm-up"}, 60)
            # Its ack answered and its count forgotten: nothing owed.
            await asyncio.sleep(1.5)
            await queue.kick(INSTANT_POISON_TASK, "instant")
            deadline = time.monotonic() + 60
            while not (dead := await queue.dead_letters(redis)):
                assert time.monotonic() < deadline, "never dead-lettered"
                await asyncio.sleep(0.2)
            stop_gracefully(workers[-1])
        assert queue.runs_file.read_text().split() == ["instant"], "ran uncounted"
        assert len(dead) == 1
        assert dead[0].reason == "max_deliveries exceeded"
        assert dead[0].deliveries == 1
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0


async def test_a_task_taskiq_drops_unacked_and_unparsable_data_are_dead_lettered(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # ack_type "bogus": taskiq's receiver raises after pre_execute and never
    # acks. Unparsable data: taskiq acks and drops it. Neither may stay
    # pending (heartbeated for ever) or vanish without a trace.
    async with fresh_queue(server, redis, tmp_path) as queue:
        await queue.kick(TASK_NAME, "bogus", 0.01, ack_type="bogus")
        garbage = text(await redis.xadd(queue.name, {"data": b"\xffnot json"}))
        await queue.kick(TASK_NAME, "fine", 0.01)
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w"))
            assert await queue.wait_until_finished({"fine"}, 30) >= {"fine"}
            deadline = time.monotonic() + 6 * IDLE_MS / 1000
            while time.monotonic() < deadline:
                dead = await queue.dead_letters(redis)
                if len(dead) >= 2:
                    break
                await asyncio.sleep(0.2)
            stop_gracefully(workers[-1])
        reasons = {d.original_id: d.reason for d in dead}
        assert garbage in reasons, f"unparsable data not dead-lettered: {reasons}"
        assert "cannot parse" in reasons.pop(garbage)
        [(bogus_id, reason)] = reasons.items()
        assert "Invalid ack_type" in reason, reason
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0
        log = log_text(queue)
        assert bogus_id in log and garbage in log, "each says why in the log"


async def result_of(
    results: RedisAsyncResultBackend[Any], task_id: str, seconds: float, err: bool
) -> TaskiqResult[Any]:
    """The task's result once one with that ``is_err`` is stored (bounded)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await results.is_result_ready(task_id):
            result = await results.get_result(task_id)
            if result.is_err == err:
                return result
        await asyncio.sleep(0.1)
    pytest.fail(f"no result with is_err={err} for task {task_id} in {seconds} s")


async def test_waiters_learn_at_once_that_their_task_was_dead_lettered(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # A poison task that crashes its worker, and a message the formatter
    # cannot parse: their waiters get DeadLettered, not a 30 s timeout. A
    # requeue that then runs overwrites it with the task's own result.
    results: RedisAsyncResultBackend[Any] = RedisAsyncResultBackend(
        server.admin_url, result_ex_time=60
    )
    async with fresh_queue(server, redis, tmp_path, max_deliveries=1) as queue:
        queue.kicker.with_result_backend(results)
        garbled = {"task_id": "garbled-1", "task_name": POISON_TASK}
        await redis.xadd(queue.name, {"data": json.dumps(garbled)})
        kicker: AsyncKicker[Any, Any] = AsyncKicker(
            POISON_UNTIL_CURED_TASK, queue.kicker, {}
        )
        with stopped_at_exit() as workers:
            workers.append(queue.worker("w", results_url=server.admin_url))
            # Before the poison: a worker killed within milliseconds of a
            # dead-lettering may die before the result is written.
            unparsed = await result_of(results, "garbled-1", 10, err=True)
            assert isinstance(unparsed.error, DeadLettered), unparsed.error
            assert "cannot parse" in unparsed.error.reason
            poisoned = await kicker.kiq("poison")
            result = await poisoned.wait_result(timeout=30)
            assert result.is_err
            assert isinstance(result.error, DeadLettered), result.error
            assert result.error.reason == "max_deliveries exceeded"
            assert result.error.stream == queue.name
            [dead] = [
                d
                for d in await queue.dead_letters(redis)
                if d.original_id == result.error.entry_id
            ]
            await redis.xadd(cure_stream(queue.name), {"cured": "1"})
            await requeue_dead_letters(ScriptRunner(), redis, queue.keys, [dead.id])
            cured = await result_of(results, poisoned.task_id, 30, err=False)
            assert cured.return_value == "poison cured"
            stop_gracefully(workers[-1])


async def test_entries_read_but_never_handed_to_taskiq_are_handed_back(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The owner's receiver takes one message and never asks for more (every
    # slot busy with a long task): the two others it read must not be
    # heartbeated for ever.
    idle_ms = 600
    owner = await started(server, consumer_name="owner", idle_timeout=idle_ms)
    rival = await started(server, consumer_name="rival", idle_timeout=idle_ms)
    try:
        for number in range(3):
            await owner.kick(message(f"m{number}"))
        owner_listener = owner.listen()
        first = await asyncio.wait_for(owner_listener.__anext__(), 5)
        assert first.data == b"m0"
        rival_listener = rival.listen()
        taken = []
        deadline = time.monotonic() + 3 * idle_ms / 1000 + 10
        for _ in range(2):
            remaining = deadline - time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                taken.append(
                    await asyncio.wait_for(rival_listener.__anext__(), remaining)
                )
        assert sorted(m.data for m in taken) == [b"m1", b"m2"]
        assert "not started yet" in caplog.text
        for item in taken:
            await maybe_awaitable(item.ack())
        # The owner no longer holds them, so it never yields them.
        assert owner.atomic.in_flight["taskiq"] == {first.data.entry_id}  # type: ignore[attr-defined]
        with contextlib.suppress(asyncio.TimeoutError):
            again = await asyncio.wait_for(owner_listener.__anext__(), 1)
            pytest.fail(f"yielded an entry it no longer owns: {again.data!r}")
        await maybe_awaitable(first.ack())
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await owner.shutdown()
        await rival.shutdown()


async def test_a_failed_claim_on_a_later_stream_keeps_what_earlier_ones_took(
    server: Server, redis: Redis
) -> None:
    # An entry a dead consumer left idle on "taskiq"; then "extra" vanishes,
    # so the claim on it fails (NOGROUP) after the claim on "taskiq" took
    # the entry. Dropped from the batch, it would wait another idle_timeout.
    idle_ms = 5000
    await redis.xgroup_create("taskiq", "taskiq", id="0", mkstream=True)
    orphan = text(await redis.xadd("taskiq", {"data": b"orphan"}))
    await redis.xreadgroup("taskiq", "dead", {"taskiq": ">"})
    await redis.xclaim(
        "taskiq", "taskiq", "dead", 0, [orphan], idle=10 * idle_ms, justid=True
    )
    broker = await started(
        server,
        consumer_name="claimer",
        idle_timeout=idle_ms,
        additional_streams={"extra": ">"},
    )
    try:
        await redis.delete("extra")
        received = await asyncio.wait_for(broker.listen().__anext__(), idle_ms / 2000)
        assert received.data == b"orphan"
        await maybe_awaitable(received.ack())
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()


async def test_a_manual_ack_task_that_never_acks_is_dead_lettered(
    server: Server, redis: Redis
) -> None:
    broker = await started(server, consumer_name="w")

    @broker.task(task_name="forgets", ack_type="manual")
    async def forgets() -> None:
        return None

    try:
        await forgets.kiq()
        delivered = await asyncio.wait_for(broker.listen().__anext__(), 5)
        [pending] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 1)
        entry_id = text(pending["message_id"])
        # taskiq's own receiver, in a task of its own as in a worker.
        receiver = Receiver(broker, run_startup=False)
        await asyncio.create_task(receiver.callback(delivered))
        keys = StreamKeys("taskiq", "taskiq")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if await redis.exists(keys.dead_letters):
                break
            await asyncio.sleep(0.1)
        [dead] = await list_dead_letters(redis, keys)
        assert dead.original_id == entry_id
        assert dead.reason == "its task ended without acking it"
        assert broker.atomic.in_flight["taskiq"] == set()
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await broker.shutdown()


async def test_a_graceful_hand_back_takes_back_the_starts_it_recorded(
    server: Server, redis: Redis
) -> None:
    keys = StreamKeys("taskiq", "taskiq")
    leaving = await started(server, consumer_name="leaving", idle_timeout=30_000)
    try:
        await leaving.kick(message("interrupted"))
        await leaving.kick(message("never-started"))
        listener = leaving.listen()
        running = await asyncio.wait_for(listener.__anext__(), 5)
        await asyncio.create_task(start_as_the_receiver_does(leaving, running))
        entry_id = running.data.entry_id  # type: ignore[attr-defined]
        assert await redis.hget(keys.started, entry_id) == b"1"
        assert await redis.pttl(keys.started) > 0
        assert await leaving.atomic.heartbeat.hand_back() == 2
        assert await redis.hexists(keys.started, entry_id) is False
    finally:
        await leaving.shutdown()
