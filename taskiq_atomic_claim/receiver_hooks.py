"""How the broker learns what taskiq's receiver does with a message: which
entry its callback parses (a formatter wrapper) and when the task starts (a
middleware). See ``in_flight.py`` for why these two suffice."""

from __future__ import annotations

from collections.abc import Callable

from taskiq import TaskiqMessage, TaskiqMiddleware
from taskiq.abc.formatter import TaskiqFormatter
from taskiq.message import BrokerMessage

from taskiq_atomic_claim.dead_letter_policy import unparsable_reason
from taskiq_atomic_claim.in_flight import Connect, InFlight
from taskiq_atomic_claim.suspects import OneSuspectAtATime


class EntryAwareFormatter(TaskiqFormatter):
    """The broker's formatter, telling ``InFlight`` which entry the receiver
    parses, which ones it cannot parse and which call a task it cannot find
    (``knows_task`` is how the receiver looks a task up)."""

    def __init__(
        self,
        inner: TaskiqFormatter,
        in_flight: InFlight,
        knows_task: Callable[[str], bool],
    ) -> None:
        self.inner = inner
        self.in_flight = in_flight
        self.knows_task = knows_task

    def dumps(self, message: TaskiqMessage) -> BrokerMessage:
        return self.inner.dumps(message)

    def loads(self, message: bytes) -> TaskiqMessage:
        delivery = self.in_flight.loaded(message)
        try:
            loaded = self.inner.loads(message)
        except Exception as error:
            if delivery is not None:
                # taskiq acks what it cannot parse; that ack dead-letters it.
                delivery.unparsable = unparsable_reason(error)
            raise
        if delivery is not None and not self.knows_task(loaded.task_name):
            # taskiq acks (0.13) or skips (0.12) it; either declines it.
            delivery.unknown_task = loaded.task_name
        return loaded


class StartRecorder(TaskiqMiddleware):
    """Records each task's start on the server before the task runs; a task
    that crashed workers before waits until no other such task runs here."""

    def __init__(self, in_flight: InFlight, connect: Connect) -> None:
        super().__init__()
        self.in_flight = in_flight
        self.connect = connect
        self.suspects = OneSuspectAtATime(in_flight.settings.max_deliveries)

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        delivery = self.in_flight.of_current_task()
        if delivery is not None:
            await self.suspects.wait_turn(delivery)
            await self.in_flight.record_start(self.connect, delivery)
        return message
