"""The server's count of reclaims (``StreamKeys.reclaimed``), kept by the
workers that reclaim, on either path: a real ``taskiq worker`` SIGKILLed
while it runs tasks, another one reclaims them, and the count rises by
exactly those entries. What ``serve``'s history draws as reclaimed/s."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from redis.asyncio import Redis

from taskiq_atomic_claim.admin.inspection import inspect_stream
from taskiq_atomic_claim.harness.drill_app import TASK_NAME
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.reclaim_count import RECLAIMED_TTL_MS
from tests.conftest import Server
from tests.test_liveness import liveness_queue
from tests.test_started_semantics import stopped_at_exit

IDLE_MS = 1000
TASKS = 3


async def test_a_killed_workers_tasks_reclaimed_elsewhere_are_counted_once_each(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    async with liveness_queue(server, redis, tmp_path, IDLE_MS) as queue:
        keys = StreamKeys(queue.name, "taskiq")
        runs = [f"run-{n}" for n in range(TASKS)]
        with stopped_at_exit() as workers:
            workers.append(queue.worker("doomed"))
            await queue.ready("doomed")
            for run in runs:
                await queue.kick(TASK_NAME, run, 30.0)
            deadline = time.monotonic() + 30
            for run in runs:
                assert await queue.events.wait_for("started", deadline, run, "doomed")
            # Nothing reclaimed yet: no count.
            assert await redis.get(keys.reclaimed) is None
            os.killpg(workers[0].pid, signal.SIGKILL)
            workers.append(queue.worker("survivor"))
            deadline = time.monotonic() + 30
            for run in runs:
                rerun = await queue.events.wait_for(
                    "started", deadline, run, "survivor"
                )
                assert rerun is not None, f"{run} never ran again"
            # New tasks are reads, not reclaims; and past a few more claim
            # cycles (and reads) of the survivor each entry is counted once,
            # however often it looks again.
            for n in range(2):
                await queue.kick(TASK_NAME, f"new-{n}", 0.1)
            for n in range(2):
                assert await queue.events.wait_for(
                    "finished", deadline, f"new-{n}", "survivor"
                )
            await asyncio.sleep(2 * IDLE_MS / 1000)
            assert await redis.get(keys.reclaimed) == str(TASKS).encode()
            assert 0 < await redis.pttl(keys.reclaimed) <= RECLAIMED_TTL_MS
            view = await inspect_stream(redis, queue.name, "taskiq")
            assert view.groups[0].reclaimed == TASKS
