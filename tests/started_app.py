"""A taskiq app for tests/test_started_semantics.py, run by ``taskiq worker``.

Configured from the environment. Besides the drill's ``work`` task it has a
poison task that SIGKILLs its own worker process (as an OOM kill would), one
that does so until a "cure" is posted (``cure_stream``), one that does so at
once, with no await before it, and, unless ``TAC_TEST_OLD_RELEASE`` is "1"
(an older release of the app, as in a rolling deploy), ``NEW_TASK``. With
``TAC_TEST_RESULTS_URL`` it stores results there (taskiq-redis' result
backend, one minute).
"""

from __future__ import annotations

import os
import signal

from redis.asyncio import Redis
from taskiq_redis import RedisAsyncResultBackend

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.drill_app import add_drill_task, events_stream

POISON_TASK = "tests.started_app.poison"
POISON_UNTIL_CURED_TASK = "tests.started_app.poison_until_cured"
INSTANT_POISON_TASK = "tests.started_app.instant_poison"
NEW_TASK = "tests.started_app.added_in_the_new_release"

URL = os.environ.get("TAC_TEST_URL", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("TAC_TEST_QUEUE", "taskiq-atomic-claim-drill-started")
WORKER = os.environ.get("TAC_TEST_WORKER", "worker")

broker = AtomicRedisStreamBroker(
    URL,
    queue_name=QUEUE,
    idle_timeout=int(os.environ.get("TAC_TEST_IDLE_TIMEOUT", "1000")),
    claim_interval=int(os.environ.get("TAC_TEST_CLAIM_INTERVAL", "200")),
    max_deliveries=int(os.environ.get("TAC_TEST_MAX_DELIVERIES", "2")),
    xread_block=500,
)
if os.environ.get("TAC_TEST_RESULTS_URL"):
    broker = broker.with_result_backend(
        RedisAsyncResultBackend(os.environ["TAC_TEST_RESULTS_URL"], result_ex_time=60)
    )
events = Redis.from_url(URL)
add_drill_task(broker, events, QUEUE, WORKER)


def cure_stream(queue: str) -> str:
    return f"{queue}:cure"


@broker.task(task_name=POISON_TASK)
async def poison(run_id: str) -> None:
    await events.xadd(
        events_stream(QUEUE), {"event": "poisoned", "run": run_id, "worker": WORKER}
    )
    os.kill(os.getpid(), signal.SIGKILL)


@broker.task(task_name=POISON_UNTIL_CURED_TASK)
async def poison_until_cured(run_id: str) -> str:
    if await events.xread({cure_stream(QUEUE): "0"}, count=1):
        return f"{run_id} cured"
    await poison(run_id)
    return "unreachable"


@broker.task(task_name=INSTANT_POISON_TASK)
async def instant_poison(run_id: str) -> None:
    # Killed before the loop turns once more: only a start already handed
    # to the kernel can count this crash. Each run is noted in a local file
    # (no await: no turn of the loop).
    if os.environ.get("TAC_TEST_RUNS_FILE"):
        with open(os.environ["TAC_TEST_RUNS_FILE"], "a", encoding="utf-8") as runs:  # noqa: ASYNC230
            runs.write(f"{run_id}\n")
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("TAC_TEST_OLD_RELEASE") != "1":

    @broker.task(task_name=NEW_TASK)
    async def added_in_the_new_release(run_id: str) -> None:
        await events.xadd(
            events_stream(QUEUE), {"event": "finished", "run": run_id, "worker": WORKER}
        )
