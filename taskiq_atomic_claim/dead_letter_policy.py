"""The dead-letter policy: when an entry a worker holds goes to the dead
letters instead of running, the reason it is stored with, and the log line
that says so. ``dead_letters.py`` moves entries; this module decides.

An entry goes to the dead letters when:

- its task started ``max_deliveries`` times in workers that died running it
  (``crashed_out``). The claim script (``lua/claim.lua``) applies this rule
  server-side on the Lua path, with ``max_deliveries`` from the settings in
  its ARGV and the reason ``MAX_DELIVERIES_EXCEEDED`` (the tests check the
  script stores exactly this text); the native path
  (``XREADGROUP ... CLAIM``) applies it here.
- it cannot become a task: it has no data field, the formatter cannot parse
  it, or taskiq's receiver dropped it (``dropped_reason``).
- no worker knows its task after ``UNKNOWN_TASK_DELIVERIES`` deliveries
  (``no_worker_knows``; ``lua/decline.lua`` compares, with that bound in
  its ARGV).

Short of the first rule, an entry with ``suspect_threshold`` crashes runs
alone in its worker (``suspects.py``), so no poison task takes its
neighbours to the dead letters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from taskiq_atomic_claim.keys import StreamKeys

logger = logging.getLogger("taskiq.atomic_claim")

# The reason of an entry whose task crashed max_deliveries workers.
MAX_DELIVERIES_EXCEEDED = "max_deliveries exceeded"
# The reason of an entry without the "data" field taskiq runs.
NO_DATA_FIELD = "no data field"
# The reason of an entry whose task ended without an ack (a manual-ack task
# that never acked).
ENDED_WITHOUT_ACK = "its task ended without acking it"

# A worker that declines stands aside about one idle_timeout per decline, so
# with no worker knowing the task it is dead-lettered after roughly this many
# idle_timeouts (fewer with several declining workers): time for a rolling
# deploy whose producers went first to bring up a worker that knows it.
UNKNOWN_TASK_DELIVERIES = 10

_REASON_LIMIT = 200


def bounded_reason(reason: str) -> str:
    """A reason short enough to store with every dead letter."""
    return reason if len(reason) <= _REASON_LIMIT else reason[: _REASON_LIMIT - 1] + "…"


def crashed_out(crashes: int, max_deliveries: int) -> bool:
    """Whether an entry whose task started ``crashes`` times in workers that
    died goes to the dead letters (``max_deliveries`` 0: never)."""
    return bool(max_deliveries) and crashes >= max_deliveries


def suspect_threshold(max_deliveries: int) -> int:
    """Crashes that make a suspect; 0 (none) where crashes are not counted.
    Above one crash where max_deliveries allows (2 for the default 5), below
    max_deliveries for max_deliveries >= 2, and leaving an innocent task
    room for as many crashes of its own (see ``suspects.py``)."""
    return max(1, (max_deliveries - 1) // 2) if max_deliveries else 0


def unparsable_reason(error: Exception) -> str:
    """The reason of an entry whose data the formatter cannot parse."""
    return bounded_reason(
        f"the formatter cannot parse its data: {type(error).__name__}: {error}"
    )


def dropped_reason(unparsable: str | None, error: BaseException | None) -> str:
    """The reason of an entry whose receiver callback ended without an ack:
    it could not be parsed, its task ended without acking, or the receiver
    raised (``error``)."""
    if unparsable is not None:
        # taskiq < 0.13 skips what it cannot parse without an ack.
        return unparsable
    if error is None:
        return ENDED_WITHOUT_ACK
    return bounded_reason(
        "taskiq's receiver raised after starting it, without acking:"
        f" {type(error).__name__}: {error}"
    )


def no_worker_knows(task_name: str, deliveries: int) -> str | None:
    """The dead-letter reason of an entry whose task this worker does not
    know once delivered ``UNKNOWN_TASK_DELIVERIES`` times, else None."""
    if deliveries < UNKNOWN_TASK_DELIVERIES:
        return None
    return f"no worker knows its task {task_name[:100]!r}: delivered {deliveries} times"


def log_moved(keys: StreamKeys, entry_id: str, reason: str, level: int) -> None:
    logger.log(
        level,
        "Entry %s of stream %r moved to dead letters %r: %s",
        entry_id,
        keys.stream,
        keys.dead_letters,
        reason,
    )


def log_crashed_out(keys: StreamKeys, ids: Sequence[str]) -> None:
    """Entries moved because their tasks crashed max_deliveries workers,
    whichever path moved them: one line per stream and batch."""
    logger.error(
        "%d entries of stream %r whose tasks crashed max_deliveries workers"
        " moved to dead letters %r: %s",
        len(ids),
        keys.stream,
        keys.dead_letters,
        ", ".join(ids),
    )


def log_handed_back_unknown(
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
