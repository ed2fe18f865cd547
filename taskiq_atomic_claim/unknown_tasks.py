"""Entries whose task the worker does not know (a rolling deploy: a new
producer kicks a task only new workers have). taskiq's receiver acks such an
entry (0.13) or drops it (0.12); the broker declines it instead (see
``EntryLifecycle.unknown_task`` and ``EntryLifecycle.decline``): hands it
back, claimable at once, and its worker stands aside for a while, so a
worker that knows the task takes it. When no worker knows it (a typo, a
removed task), it goes to dead letters once delivered
``UNKNOWN_TASK_DELIVERIES`` times (the bound and the reason are in
``dead_letter_policy.py``), counted by the PEL's delivery count: the read
and every claim raise it, Lua (the claim script raises it for what it
claimed) or native (XREADGROUP ... CLAIM); hand-backs and heartbeats never
do.
"""

from __future__ import annotations

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.dead_letter_policy import UNKNOWN_TASK_DELIVERIES
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import decline_call
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings


async def call_decline(
    scripts: ScriptRunner,
    client: ScriptClient,
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
