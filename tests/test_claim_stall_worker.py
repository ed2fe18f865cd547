"""A real worker stalled inside its claim: the task it claimed, claimed
again meanwhile by a live worker, runs in that worker only (the fast,
per-server checks are in ``test_claim_stall.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis

from taskiq_atomic_claim.harness.drill_app import TASK_NAME
from tests.conftest import Server
from tests.proxies import StallingProxy
from tests.test_claim_stall import FETCH, lua_path_only
from tests.test_faults import via
from tests.test_started_semantics import fresh_queue, stopped_at_exit


async def test_a_task_runs_once_when_a_worker_stalls_inside_its_claim(
    server: Server, redis: Redis, tmp_path: Path
) -> None:
    """Two real workers: the first claims a dead consumer's entry and stalls
    before fetching it; the second claims it once idle again and runs it;
    then the first's fetch arrives. The task starts in one worker only."""
    lua_path_only(server)
    port = urlsplit(server.url).port
    assert port is not None
    async with fresh_queue(server, redis, tmp_path) as queue:
        run = uuid.uuid4().hex[:8]
        await queue.kick(TASK_NAME, run, 4.0)
        # Read by a consumer that then died.
        reply: Any = await redis.xreadgroup(
            "taskiq", "dead", {queue.name: ">"}, count=1
        )
        assert len(reply[0][1]) == 1
        async with StallingProxy(port, FETCH) as proxy:
            stalled_queue = dataclasses.replace(queue, url=via(server.url, proxy.port))
            with stopped_at_exit() as workers:
                workers.append(stalled_queue.worker("stalled"))
                await asyncio.wait_for(proxy.holding.wait(), 60)
                workers.append(queue.worker("live"))
                deadline = time.monotonic() + 60
                started = await queue.events.wait_for("started", deadline, run, "live")
                assert started is not None, "the live worker never ran the task"
                proxy.release()
                finished = await queue.wait_until_finished({run}, 20)
                assert run in finished
                # The stalled worker's fetch has long arrived; give it time
                # to run what it would have taken.
                await asyncio.sleep(1.5)
                await queue.read_events()
        starts = [
            worker
            for _, event, seen_run, worker in queue.events.seen
            if event == "started" and seen_run == run
        ]
        assert starts == ["live"], starts
