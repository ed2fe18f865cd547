"""Tasks that crashed their workers before run one at a time per worker.

A worker that dies kills every task it runs, and each of them gains a crash
(``task_records`` counts starts; an ack or a graceful hand-back takes them
back): a poison task's neighbours gain crashes beside it. A task whose entry
has ``threshold`` crashes or more (``dead_letter_policy.suspect_threshold``)
is a suspect, and a worker runs one suspect at a time, so two suspects never
die together. An innocent task then dies
beside a poison only while one of the two is not yet a suspect, at most
``threshold`` times each: ``2 * threshold < max_deliveries`` crashes in all,
so one poison never takes a neighbour to the dead letters (for
max_deliveries >= 3). The threshold stays above one crash where
max_deliveries allows (2 for the default 5): the tasks of a worker killed
once (OOM, eviction, a lost node) are recovered at full speed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from taskiq_atomic_claim.dead_letter_policy import suspect_threshold

if TYPE_CHECKING:
    from taskiq_atomic_claim.delivery import Delivery

logger = logging.getLogger("taskiq.atomic_claim")


class OneSuspectAtATime:
    """The one turn a worker gives its suspects."""

    def __init__(self, max_deliveries: int) -> None:
        self.threshold = suspect_threshold(max_deliveries)
        self._turn = asyncio.Lock()

    def is_suspect(self, delivery: Delivery) -> bool:
        return bool(self.threshold) and delivery.crashes >= self.threshold

    async def wait_turn(self, delivery: Delivery) -> None:
        """For a suspect, in the asyncio task about to run it (taskiq's
        callback): wait until no other suspect runs here. The turn ends with
        that asyncio task, however it ends (run and acked, failed,
        cancelled)."""
        if not self.is_suspect(delivery):
            return
        task = asyncio.current_task()
        if task is None:
            return
        logger.warning(
            "Entry %s of stream %r was running in %d workers that died: it runs"
            " with no other such entry beside it in this worker",
            delivery.entry_id,
            delivery.stream,
            delivery.crashes,
        )
        await self._turn.acquire()
        task.add_done_callback(lambda _: self._turn.release())
