"""A poison task kills every task running beside it in its worker, each time
it runs; max_deliveries must still dead-letter the poison alone. Real
``taskiq worker`` processes: the poison SIGKILLs its own process, taskiq
starts another, which reclaims the poison and its neighbours together."""

from __future__ import annotations

from pathlib import Path

from redis.asyncio import Redis

from taskiq_atomic_claim.harness.drill_app import TASK_NAME
from tests.conftest import Server
from tests.started_app import POISON_TASK
from tests.test_started_semantics import fresh_queue, stop_gracefully, stopped_at_exit

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
