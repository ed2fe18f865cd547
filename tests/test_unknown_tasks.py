"""A message whose task the worker does not know (a rolling deploy: a new
producer kicks a task only new workers have) is handed back for a worker that
knows it, never acked away; when no worker knows it, it reaches the dead
letters after a bounded number of deliveries. On every local server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq import TaskiqMessage
from taskiq.receiver import Receiver

from taskiq_atomic_claim.dead_letter_policy import UNKNOWN_TASK_DELIVERIES
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from tests.conftest import Server
from tests.started_app import NEW_TASK
from tests.test_reliability import started
from tests.test_started_semantics import (
    fresh_queue,
    log_text,
    stop_gracefully,
    stopped_at_exit,
)

UNKNOWN = "removed_module:typo_task"
LOGGER = "taskiq.atomic_claim"


async def test_the_receiver_hands_an_unknown_task_back_then_dead_letters_it(
    server: Server, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # taskiq's own receiver on one broker: 0.13 acks what it cannot run,
    # 0.12 drops it unacked; neither may lose it.
    caplog.set_level(logging.WARNING)
    idle_ms = 600
    broker = await started(
        server, consumer_name="old", idle_timeout=idle_ms, xread_block=100
    )
    broker.is_worker_process = True  # as `taskiq worker` sets it
    receiver = Receiver(broker, run_startup=False)
    call = TaskiqMessage(task_id="1", task_name=UNKNOWN, labels={}, args=[], kwargs={})
    await broker.kick(broker.formatter.dumps(call))
    kicked: Any = await redis.xrange("taskiq")
    entry_id = text(kicked[0][0])
    dead_letters = StreamKeys("taskiq", "taskiq").dead_letters
    listen = broker.listen()
    callbacks = 0
    try:
        first = await asyncio.wait_for(listen.__anext__(), 5)
        await asyncio.wait_for(receiver.callback(first), 5)
        callbacks += 1
        # Handed back (at the ack on 0.13, at the next heartbeat on 0.12):
        # still pending, idle for idle_timeout, so any claim takes it now.
        deadline = time.monotonic() + 3 * idle_ms / 1000
        handed_back = False
        while not handed_back and time.monotonic() < deadline:
            pending: Any
            [pending] = await redis.xpending_range("taskiq", "taskiq", "-", "+", 10)
            handed_back = pending["time_since_delivered"] >= idle_ms
            await asyncio.sleep(0.02)
        assert handed_back, pending
        assert text(pending["message_id"]) == entry_id
        assert pending["times_delivered"] == 1
        assert await redis.xlen(dead_letters) == 0
        # No worker here knows it: it comes back until the bound.
        deadline = time.monotonic() + UNKNOWN_TASK_DELIVERIES * 3 * idle_ms / 1000
        while not await redis.xlen(dead_letters) and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                again = await asyncio.wait_for(listen.__anext__(), 2 * idle_ms / 1000)
                await asyncio.wait_for(receiver.callback(again), 5)
                callbacks += 1
        letters: Any = await redis.xrange(dead_letters)
    finally:
        await listen.aclose()
        await broker.shutdown()
    [(_, dead)] = letters
    assert callbacks == UNKNOWN_TASK_DELIVERIES
    assert text(dead[b"dead_letter_id"]) == entry_id
    assert int(dead[b"dead_letter_deliveries"]) == UNKNOWN_TASK_DELIVERIES
    assert UNKNOWN in text(dead[b"dead_letter_reason"]), dead
    assert await redis.xpending_range("taskiq", "taskiq", "-", "+", 10) == []
    ours = [r for r in caplog.records if r.name == LOGGER and UNKNOWN in r.message]
    # One warning line per event, naming the task; no traceback.
    assert len(ours) == UNKNOWN_TASK_DELIVERIES, [r.message for r in ours]
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in ours)
    assert all("handed back" in r.message for r in ours[:-1])
    assert "dead letters" in ours[-1].message


async def test_declining_an_entry_stands_aside_on_its_stream_only(
    server: Server, redis: Redis
) -> None:
    # Where reads reclaim, a declined entry of one stream must not stop the
    # claiming reads of the others: an entry a dead worker left on another
    # stream is reclaimed within idle_timeout + claim_interval all the same.
    if not server.info.native_claim:
        pytest.skip("the Lua claim schedules each stream apart (claim_schedule.py)")
    idle_ms, interval_ms = 4000, 500
    settings: dict[str, Any] = {
        "idle_timeout": idle_ms,
        "claim_interval": interval_ms,
        "xread_block": 100,
        "additional_streams": {"side": ">"},
    }
    dead = await started(server, consumer_name="dead", **settings)
    old = await started(server, consumer_name="old", **settings)
    old.is_worker_process = True
    receiver = Receiver(old, run_startup=False)
    dead_listen, listen = dead.listen(), old.listen()
    try:
        await redis.xadd("side", {"data": b"orphan"})
        orphan = await asyncio.wait_for(dead_listen.__anext__(), 5)
        left = time.monotonic()
        assert orphan.data == b"orphan"
        await dead_listen.aclose()
        await dead.atomic.heartbeat.stop()
        # Declined shortly before the orphan turns idle: standing aside on
        # every stream would delay it by about one stand-aside (2 s here).
        await asyncio.sleep(idle_ms / 1000 - 0.5)
        call = TaskiqMessage(
            task_id="1", task_name=UNKNOWN, labels={}, args=[], kwargs={}
        )
        await old.kick(old.formatter.dumps(call))
        unknown = await asyncio.wait_for(listen.__anext__(), 5)
        await asyncio.wait_for(receiver.callback(unknown), 5)
        again = await asyncio.wait_for(listen.__anext__(), 5)
        took = time.monotonic() - left
        print(
            f"\norphan on another stream reclaimed {took:.2f} s after its worker died"
        )
        assert again.data == b"orphan"
        assert took <= (idle_ms + interval_ms) / 1000 + 0.3
    finally:
        await listen.aclose()
        await old.shutdown()
        await dead.shutdown()


async def test_in_a_rolling_deploy_only_new_workers_run_a_new_task(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    # An old and a new release of the app on one queue; a new producer kicks
    # a task only the new one has. Whatever the old worker reads, it hands
    # back; every call runs exactly once, on the new worker.
    runs = {f"new-{n}" for n in range(20)}
    async with fresh_queue(server, redis, tmp_path) as queue:
        with stopped_at_exit() as workers:
            workers.append(queue.worker("old", old_release=True))
            workers.append(queue.worker("new"))
            for worker in ("old", "new"):
                ready = await queue.events.wait_for(
                    "ready", time.monotonic() + 60, worker=worker
                )
                assert ready is not None, f"{worker} never started"
            for run_id in sorted(runs):
                # One at a time: both workers' blocked reads get some.
                await queue.kick(NEW_TASK, run_id)
                await asyncio.sleep(0.05)
            done = await queue.wait_until_finished(runs, 60)
            for process in workers:
                stop_gracefully(process)
        assert done >= runs, f"never ran: {sorted(runs - done)}"
        finished = [
            (run, worker)
            for _, event, run, worker in queue.events.seen
            if event == "finished" and run in runs
        ]
        assert sorted(finished) == sorted((run, "new") for run in runs)
        assert await queue.dead_letters(redis) == []
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0
        old_log = (tmp_path / "old.log").read_text(errors="replace")
        assert "handed back" in old_log and NEW_TASK in old_log, (
            "the old worker never read one: the test proved nothing"
        )
        assert "Traceback" not in log_text(queue)


async def test_a_task_no_worker_knows_ends_in_the_dead_letters(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    runs = [f"nobody-{n}" for n in range(3)]
    async with fresh_queue(server, redis, tmp_path) as queue:
        with stopped_at_exit() as workers:
            workers.append(queue.worker("old-1", old_release=True))
            workers.append(queue.worker("old-2", old_release=True))
            for run_id in runs:
                await queue.kick(NEW_TASK, run_id)
            deadline = time.monotonic() + UNKNOWN_TASK_DELIVERIES * 3 + 30
            while time.monotonic() < deadline:
                dead = await queue.dead_letters(redis)
                if len(dead) >= len(runs):
                    break
                await asyncio.sleep(0.2)
            for process in workers:
                stop_gracefully(process)
        assert len(dead) == len(runs), [(d.original_id, d.reason) for d in dead]
        for letter in dead:
            assert NEW_TASK in letter.reason, letter.reason
            assert letter.deliveries == UNKNOWN_TASK_DELIVERIES
        assert (await redis.xpending(queue.name, "taskiq"))["pending"] == 0
        log = log_text(queue)
        assert "Traceback" not in log
        assert log.count("dead letters") >= len(runs)
