"""Moving an entry the broker cannot run to its dead-letter stream: what a
worker does. Listing and requeue, what an operator does, are in
``taskiq_atomic_claim.admin.dead_letters``."""

from __future__ import annotations

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import DEAD_LETTER
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptClient, ScriptRunner

_REASON_LIMIT = 200


def bounded_reason(reason: str) -> str:
    """A reason short enough to store with every dead letter."""
    return reason if len(reason) <= _REASON_LIMIT else reason[: _REASON_LIMIT - 1] + "…"


async def move_to_dead_letters(
    runner: ScriptRunner,
    client: ScriptClient,
    keys: StreamKeys,
    entry_id: str,
    reason: str,
    *,
    delete_acked: bool,
    deliveries: int | None = None,
) -> str | None:
    """Move one pending entry and ack it; None if its data was already gone.
    With ``delete_acked`` the ack is the broker's (XACKDEL ... ACKED): the
    entry leaves its stream once no group still needs it. ``deliveries`` is
    recorded in place of the PEL's delivery count."""
    extra = [] if deliveries is None else [deliveries]
    reply = await runner.call(
        client,
        DEAD_LETTER,
        [keys.stream, keys.dead_letters, keys.started],
        [keys.group, entry_id, reason, int(delete_acked), *extra],
    )
    return text(reply[0]) if reply else None
