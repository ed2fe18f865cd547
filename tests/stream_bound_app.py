"""The taskiq app of the stream-bound tests, run under ``taskiq worker``,
and how the tests start it.

The broker at its defaults on queue ``TAC_BOUND_QUEUE`` of ``TAC_BOUND_URL``
(``TAC_BOUND_MAXLEN`` sets maxlen); its task records each run in the
stream ``<queue>:events`` (data, never expires) on the same server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim import AtomicRedisStreamBroker

REPO_ROOT = Path(__file__).resolve().parent.parent
TASK_NAME = "tests.stream_bound_app.record"
_URL = os.environ.get("TAC_BOUND_URL", "redis://127.0.0.1:6379")
_QUEUE = os.environ.get("TAC_BOUND_QUEUE", "bound")
_MAXLEN = os.environ.get("TAC_BOUND_MAXLEN")

broker = AtomicRedisStreamBroker(
    _URL, queue_name=_QUEUE, maxlen=int(_MAXLEN) if _MAXLEN else None
)
_events = Redis.from_url(_URL)


def events_stream(queue: str) -> str:
    return f"{queue}:events"


@broker.task(task_name=TASK_NAME)
async def record(run_id: str) -> None:
    await _events.xadd(events_stream(_QUEUE), {"run": run_id})


async def events_of(client: Redis, queue: str) -> set[str]:
    """The runs recorded so far."""
    entries: Any = await client.xrange(events_stream(queue))
    return {fields[b"run"].decode() for _, fields in entries}


@contextlib.contextmanager
def taskiq_workers(
    url: str, queue: str, count: int, log_dir: Path
) -> Iterator[Callable[[], str]]:
    """``count`` ``taskiq worker`` processes of this app; yields what they
    logged, for failure messages. SIGKILLed on exit."""
    script = Path(sys.executable).with_name("taskiq")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "taskiq"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "TAC_BOUND_URL": url,
        "TAC_BOUND_QUEUE": queue,
    }
    processes, logs = [], []
    try:
        for number in range(count):
            log = log_dir / f"worker-{number}.log"
            logs.append(log)
            argv = [
                *command, "worker", "tests.stream_bound_app:broker",
                "--ack-type", "when_executed",
                "--workers", "1",
                "--log-level", "WARNING",
            ]  # fmt: skip
            processes.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    cwd=REPO_ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=log.open("wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        yield lambda: "\n".join(log.read_text()[-1500:] for log in logs)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
