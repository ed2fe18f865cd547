"""Entries whose task the worker does not know (a rolling deploy: a new
producer kicks a task only new workers have). taskiq's receiver acks such an
entry (0.13) or drops it (0.12); the broker declines it instead (see
``EntryAwareFormatter`` and ``InFlight.decline``): hands it back, claimable at
once, and its worker stands aside for a while, so a worker that knows the
task takes it. When no worker knows it (a typo, a removed task), it goes to
dead letters once delivered ``UNKNOWN_TASK_DELIVERIES`` times, counted by the
PEL's delivery count: the read and every claim raise it, Lua (the XCLAIM
that fetches what the script claimed, see claim.py) or native (XREADGROUP
... CLAIM); hand-backs and heartbeats never do.
"""

from __future__ import annotations

import logging
from typing import Any

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import decline_call
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")

# A worker that declines stands aside about one idle_timeout per decline, so
# with no worker knowing the task it is dead-lettered after roughly this many
# idle_timeouts (fewer with several declining workers): time for a rolling
# deploy whose producers went first to bring up a worker that knows it.
UNKNOWN_TASK_DELIVERIES = 10


async def call_decline(
    scripts: ScriptRunner,
    client: Any,
    keys: StreamKeys,
    consumer: str,
    settings: ClaimSettings,
    entry_id: str,
) -> int:
    """Hand the entry back unless delivered ``UNKNOWN_TASK_DELIVERIES``
    times; its delivery count, or -1 if the consumer no longer owns it."""
    return await scripts.run(
        client,
        decline_call(
            stream=keys.stream,
            group=keys.group,
            consumer=consumer,
            idle_ms=settings.idle_timeout,
            bound=UNKNOWN_TASK_DELIVERIES,
            entry_id=entry_id,
        ),
    )


def no_worker_knows(task_name: str, deliveries: int) -> str | None:
    """The dead-letter reason once the bound is reached, else None."""
    if deliveries < UNKNOWN_TASK_DELIVERIES:
        return None
    return f"no worker knows its task {task_name[:100]!r}: delivered {deliveries} times"


def log_handed_back(
    stream: str, entry_id: str, task_name: str, deliveries: int
) -> None:
    logger.warning(
        "Entry %s of stream %r calls task %r, which this worker does not know:"
        " handed back for a worker that knows it (delivery %d of %d before it"
        " goes to dead letters)",
        entry_id,
        stream,
        task_name,
        deliveries,
        UNKNOWN_TASK_DELIVERIES,
    )
