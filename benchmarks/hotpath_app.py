"""The ``taskiq worker`` app of the hot-path part (``hotpath.py``).

Configured from the environment: which broker (``HOTPATH_BROKER``: atomic,
atomic_none, upstream), the server and queue, and where the timed
task appends its kick-to-start delay.
"""

from __future__ import annotations

import os
import time
from typing import Any

from taskiq import AsyncBroker

KIND = os.environ.get("HOTPATH_BROKER", "atomic")
URL = os.environ.get("HOTPATH_URL", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("HOTPATH_QUEUE", "bench-hotpath")
LATENCY_FILE = os.environ.get("HOTPATH_LATENCY_FILE", "")
# The part's read settings: xread_count as --max-prefetch.
COUNT = int(os.environ.get("HOTPATH_COUNT", "32"))


def _broker() -> AsyncBroker:
    common: dict[str, Any] = {"queue_name": QUEUE, "xread_count": COUNT}
    if KIND in ("atomic", "atomic_none"):
        from taskiq_atomic_claim import AtomicRedisStreamBroker  # noqa: PLC0415

        none = KIND == "atomic_none"
        extra: dict[str, Any] = {"max_deliveries": None} if none else {}
        return AtomicRedisStreamBroker(URL, **common, **extra)
    from taskiq_redis import RedisStreamBroker  # noqa: PLC0415

    return RedisStreamBroker(URL, **common)


broker = _broker()


@broker.task(task_name="bench.noop")
async def noop() -> None:
    return None


@broker.task(task_name="bench.timed")
async def timed(kicked_at: float) -> None:
    delay = time.time() - kicked_at
    if LATENCY_FILE:
        # A local append: no await, nothing on the server's side.
        with open(LATENCY_FILE, "a", encoding="utf-8") as out:  # noqa: ASYNC230
            out.write(f"{delay:.6f}\n")
