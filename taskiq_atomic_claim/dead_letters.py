"""Moving an entry the broker cannot run to its dead-letter stream: what a
worker does. Which entries go, and why, is ``dead_letter_policy.py``.
Listing and requeue, what an operator does, are in
``taskiq_atomic_claim.admin.dead_letters``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.dead_letter_policy import (
    MAX_DELIVERIES_EXCEEDED,
    log_crashed_out,
    log_moved,
)
from taskiq_atomic_claim.dead_letter_results import DeadLetterResults
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.operations import dead_letter_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner


async def move_to_dead_letters(
    runner: ScriptRunner,
    client: ScriptClient,
    keys: StreamKeys,
    entry_id: str,
    reason: str,
    *,
    delete_acked: bool,
    deliveries: int | None = None,
    results: DeadLetterResults | None = None,
) -> str | None:
    """Move one pending entry and ack it; None if its data was already gone.
    With ``delete_acked`` the ack is the broker's (XACKDEL ... ACKED): the
    entry leaves its stream once no group still needs it. ``deliveries`` is
    recorded in place of the PEL's delivery count. ``results`` stores the
    task's error result once it moved."""
    reply = await runner.run(
        client,
        dead_letter_call(
            stream=keys.stream,
            dead_letters=keys.dead_letters,
            started=keys.started,
            group=keys.group,
            entry_id=entry_id,
            reason=reason,
            delete_acked=delete_acked,
            deliveries=deliveries,
        ),
    )
    if not reply:
        return None
    if results is not None:
        results.dead_lettered(keys.stream, entry_id, reply[1], reason)
    return text(reply[0])


class DeadLettering:
    """What a worker does with each entry it dead-letters, whichever path
    moved it: count it, log it, and tell its task's waiters."""

    def __init__(
        self,
        scripts: ScriptRunner,
        metrics: ReclaimMetrics,
        results: DeadLetterResults,
        *,
        delete_acked: bool,
    ) -> None:
        self.scripts = scripts
        self.metrics = metrics
        self.results = results
        self.delete_acked = delete_acked

    async def move(
        self,
        client: ScriptClient,
        keys: StreamKeys,
        entry_id: str,
        reason: str,
        *,
        level: int = logging.ERROR,
    ) -> None:
        """Move a held entry to the dead letters, in place of its ack."""
        await move_to_dead_letters(
            self.scripts,
            client,
            keys,
            entry_id,
            reason,
            delete_acked=self.delete_acked,
            results=self.results,
        )
        self.metrics.add("dead_lettered", keys.stream)
        log_moved(keys, entry_id, reason, level)

    async def move_crashed_out(
        self, client: ScriptClient, keys: StreamKeys, crashed: Sequence[tuple[str, int]]
    ) -> None:
        """Move held entries whose tasks crashed max_deliveries workers, each
        with its crashes (recorded as the claim script records them), as
        the claim script would have (see ``moved_by_claim``)."""
        if not crashed:
            return
        for entry_id, crashes in crashed:
            await move_to_dead_letters(
                self.scripts,
                client,
                keys,
                entry_id,
                MAX_DELIVERIES_EXCEEDED,
                delete_acked=self.delete_acked,
                deliveries=crashes,
                results=self.results,
            )
        self.metrics.add("dead_lettered", keys.stream, len(crashed))
        log_crashed_out(keys, [entry_id for entry_id, _ in crashed])

    def moved_by_claim(
        self, keys: StreamKeys, ids: Sequence[str], data: Mapping[str, bytes]
    ) -> None:
        """The claim script moved ``ids`` (their tasks crashed max_deliveries
        workers); ``data`` holds their data fields."""
        if not ids:
            return
        self.metrics.add("dead_lettered", keys.stream, len(ids))
        for entry_id in ids:
            self.results.dead_lettered(
                keys.stream, entry_id, data.get(entry_id), MAX_DELIVERIES_EXCEEDED
            )
        log_crashed_out(keys, ids)
