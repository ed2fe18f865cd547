"""Part: how fast real workers at defaults work off a crash's orphans.

``orphans`` no-op tasks pending on dead consumers (backdated past
idle_timeout) and ``workers`` real ``taskiq worker`` processes of this
package at its defaults (xread_count 100, max-async-tasks 100): the time
from the first ack to an empty pending list, and the rate. Where the claim
is a script (Redis < 8.4) the rate is read against the native path's (the
read reclaims, Redis >= 8.4) of the same run's other server. taskiq-redis
1.2.4 is not measured: it reclaims only after a read returns new messages,
and none arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from benchmarks.config import AGED_IDLE_MS, REPO_ROOT, Mode
from benchmarks.hotpath import task_message

QUEUE = "bench-orphan-drain"
GROUP = "taskiq"
_DEAD = 20
_CHUNK = 1000


async def _orphan(admin: Redis, count: int) -> None:
    """``count`` no-op tasks delivered to dead consumers long ago."""
    await admin.delete(QUEUE)
    await admin.xgroup_create(QUEUE, GROUP, id="0", mkstream=True)
    for first in range(0, count, _CHUNK):
        async with admin.pipeline(transaction=False) as pipe:
            for _ in range(first, min(first + _CHUNK, count)):
                pipe.xadd(QUEUE, {"data": task_message("bench.noop", [])})
            await pipe.execute()
    share = -(-count // _DEAD)
    for index in range(_DEAD):
        read: Any = await admin.xreadgroup(
            GROUP, f"dead-{index}", {QUEUE: ">"}, count=share
        )
        ids = [entry_id for _, entries in read or [] for entry_id, _ in entries]
        for first in range(0, len(ids), _CHUNK):
            await admin.xclaim(
                QUEUE,
                GROUP,
                f"dead-{index}",
                0,
                ids[first : first + _CHUNK],
                idle=AGED_IDLE_MS,
                justid=True,
            )


def _worker(url: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "HOTPATH_BROKER": "atomic",
        "HOTPATH_URL": url,
        "HOTPATH_QUEUE": QUEUE,
        "HOTPATH_COUNT": "100",  # the brokers' default xread_count
    }
    taskiq = Path(sys.executable).with_name("taskiq")
    command = [str(taskiq)] if taskiq.exists() else [sys.executable, "-m", "taskiq"]
    return subprocess.Popen(
        [*command, "worker", "benchmarks.hotpath_app:broker", "--workers", "1"],
        env=env,
        cwd=REPO_ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _measure(url: str, mode: Mode) -> dict[str, Any]:
    admin = Redis.from_url(url)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        await _orphan(admin, mode.drain_orphans)
        workers = [_worker(url) for _ in range(mode.drain_workers)]
        started = time.monotonic()
        first = end = None
        left = mode.drain_orphans
        while time.monotonic() - started < mode.drain_cap_s:
            left = int((await admin.xpending(QUEUE, GROUP))["pending"])
            now = time.monotonic()
            if first is None and left < mode.drain_orphans:
                first = now
            if left == 0:
                end = now
                break
            await asyncio.sleep(0.05)
        drain = None if first is None or end is None else end - first
        return {
            "orphans": mode.drain_orphans,
            "workers": mode.drain_workers,
            "drain_s": None if drain is None else round(drain, 2),
            "per_s": None if not drain else round(mode.drain_orphans / drain),
            "orphans_left": left,
            "cap_s": mode.drain_cap_s,
        }
    finally:
        for process in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        await admin.delete(QUEUE)
        await admin.aclose()


def run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    rows = []
    for rep in range(mode.drain_reps):
        row = asyncio.run(_measure(url, mode))
        log(f"orphan drain {rep + 1}/{mode.drain_reps}: {row['per_s']}/s")
        rows.append(row)
    return rows
