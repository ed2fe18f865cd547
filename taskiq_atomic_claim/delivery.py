"""One entry delivered to this consumer, as the broker tracks it from its
read to its ack (its states and transitions are in ``entry_lifecycle.py``),
and the message data that names it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


class EntryData(bytes):
    """A message's data that remembers the stream entry it was read from.

    taskiq hands ``AckableMessage.data`` unchanged to the formatter.
    """

    stream: str
    entry_id: str

    def __new__(cls, data: bytes, stream: str, entry_id: str) -> EntryData:
        made = super().__new__(cls, data)
        made.stream, made.entry_id = stream, entry_id
        return made


@dataclass(eq=False, slots=True)
class Delivery:
    stream: str
    entry_id: str
    read_at: float
    yielded: bool = False
    # The receiver's callback task that parsed it.
    task: asyncio.Task[Any] | None = None
    # A start is recorded on the server and not yet acked or taken back.
    started: bool = False
    # Its start was sent and refused (or lost): a crash would go uncounted.
    start_lost: bool = False
    # Why the formatter could not parse it; its "ack" dead-letters it.
    unparsable: str | None = None
    # The task name this worker does not know; its "ack" declines it.
    unknown_task: str | None = None
    # Pending for no consumer (its group destroyed): run here, not dropped.
    orphaned: bool = False
    # Starts in workers that died running it, as the claim that took it saw.
    crashes: int = 0
    # Taken over from another consumer (a claim, or a read with CLAIM).
    reclaimed: bool = False

    def running(self) -> bool:
        """Its callback runs: parsing it, starting it or running its task."""
        return self.task is not None and not self.task.done()

    def dropped_by_receiver(self) -> bool:
        """Its callback ended, neither acked (else it would be gone) nor
        cancelled (a shutdown: handed back instead)."""
        task = self.task
        return task is not None and task.done() and not task.cancelled()
