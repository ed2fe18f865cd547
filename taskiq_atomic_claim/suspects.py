"""Tasks that crashed their workers before run alone in their worker.

A worker that dies kills every task it runs, and each of them gains a crash
(``task_records`` counts starts; an ack or a graceful hand-back takes them
back): a poison task's neighbours gain crashes beside it. A task whose entry
has ``threshold`` crashes or more (``dead_letter_policy.suspect_threshold``)
is a suspect, and a suspect runs with no other task beside it in its worker:
it waits until the tasks running there have ended, and nothing new starts
there until it has. An innocent task then dies beside a poison only while
neither is a suspect, so however many poisons it meets it gains at most
``threshold`` (< max_deliveries) crashes from them: no poison takes a
neighbour to the dead letters (for max_deliveries >= 2). "One suspect at a
time" was not enough: a suspect still ran beside a poison nobody suspected
yet, and each new poison added crashes to it.

The threshold stays above one crash where max_deliveries allows (2 for the
default 5): the tasks of a worker killed once (OOM, eviction, a lost node)
are recovered at full speed. While a suspect waits for its turn the worker
starts nothing new (else a busy worker would never give it one); what waits
is held and heartbeated, so no other worker takes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from taskiq_atomic_claim.dead_letter_policy import suspect_threshold

if TYPE_CHECKING:
    from taskiq_atomic_claim.delivery import Delivery

logger = logging.getLogger("taskiq.atomic_claim")


class SuspectsRunAlone:
    """The turns of the tasks a worker starts: any number together, or one
    suspect alone. A turn ends with the asyncio task that took it (taskiq's
    callback), however that ends (run and acked, failed, cancelled)."""

    def __init__(self, max_deliveries: int) -> None:
        self.threshold = suspect_threshold(max_deliveries)
        self._running = 0  # turns taken and not ended
        self._alone = False  # the turn taken is a suspect's
        self._suspects: deque[asyncio.Future[None]] = deque()
        self._others: deque[asyncio.Future[None]] = deque()

    def took_turn(self, delivery: Delivery, task: asyncio.Task[Any]) -> bool:
        """The turn of ``delivery`` (run by ``task``) taken at once if it
        is no suspect and may start now: every task's path, without a
        coroutine. False: ``wait_turn`` decides."""
        if not self.threshold:
            return True
        if delivery.crashes >= self.threshold or self._alone or self._suspects:
            return False
        self._running += 1
        task.add_done_callback(self._ended)
        return True

    async def wait_turn(self, delivery: Delivery) -> None:
        """In the asyncio task about to run ``delivery``'s task: wait until
        it may start."""
        if not self.threshold:
            return  # crashes are not counted: nobody is suspect
        task = asyncio.current_task()
        if task is None:
            return
        suspect = delivery.crashes >= self.threshold
        if suspect:
            logger.warning(
                "Entry %s of stream %r was running in %d workers that died: it"
                " runs with no other task beside it in this worker",
                delivery.entry_id,
                delivery.stream,
                delivery.crashes,
            )
        if not self._may_start(suspect):
            await self._queue_for_turn(suspect)
        else:
            self._take_turn(suspect)
        task.add_done_callback(self._alone_ended if suspect else self._ended)

    def _may_start(self, suspect: bool) -> bool:
        if suspect:
            return self._running == 0 and not self._suspects
        return not self._alone and not self._suspects

    def _take_turn(self, suspect: bool) -> None:
        self._running += 1
        self._alone = suspect

    async def _queue_for_turn(self, suspect: bool) -> None:
        waiters = self._suspects if suspect else self._others
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                # Given the turn, then cancelled before taking it up.
                self._end_turn(alone=suspect)
            else:
                if turn in waiters:
                    waiters.remove(turn)
                self._hand_out()
            raise

    def _ended(self, _: Any) -> None:
        self._end_turn(alone=False)

    def _alone_ended(self, _: Any) -> None:
        self._end_turn(alone=True)

    def _end_turn(self, *, alone: bool) -> None:
        self._running -= 1
        if alone:
            self._alone = False
        self._hand_out()

    def _hand_out(self) -> None:
        """Give the free turns to those waiting: a suspect first, once
        nothing runs; else every other task."""
        # A waiter cancelled is dropped from its queue only once its task
        # runs again: skip it here.
        while self._suspects and self._suspects[0].done():
            self._suspects.popleft()
        if self._alone:
            return
        if self._suspects:
            if self._running == 0:
                self._take_turn(suspect=True)
                self._suspects.popleft().set_result(None)
            return
        while self._others:
            turn = self._others.popleft()
            if not turn.done():
                self._take_turn(suspect=False)
                turn.set_result(None)
