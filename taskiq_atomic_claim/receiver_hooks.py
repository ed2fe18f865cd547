"""How the broker learns what taskiq's receiver does with a message: which
entry its callback parses (a formatter wrapper) and when the task starts (a
middleware). Both only forward to ``EntryLifecycle``, where the transitions
are; see ``entry_lifecycle.py`` for why these two suffice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from taskiq import TaskiqMessage, TaskiqMiddleware
from taskiq.abc.formatter import TaskiqFormatter
from taskiq.message import BrokerMessage

from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle


class EntryAwareFormatter(TaskiqFormatter):
    """The broker's formatter, telling the lifecycle which entry the
    receiver parses, which ones it cannot parse and which call a task it
    cannot find (``knows_task`` is how the receiver looks a task up)."""

    def __init__(
        self,
        inner: TaskiqFormatter,
        lifecycle: EntryLifecycle,
        knows_task: Callable[[str], bool],
    ) -> None:
        self.inner = inner
        self.lifecycle = lifecycle
        self.knows_task = knows_task

    def dumps(self, message: TaskiqMessage) -> BrokerMessage:
        return self.inner.dumps(message)

    def loads(self, message: bytes) -> TaskiqMessage:
        delivery = self.lifecycle.loaded(message)
        try:
            loaded = self.inner.loads(message)
        except Exception as error:
            self.lifecycle.unparsable(delivery, error)
            raise
        if delivery is not None and not self.knows_task(loaded.task_name):
            self.lifecycle.unknown_task(delivery, loaded.task_name)
        return loaded


class StartRecorder(TaskiqMiddleware):
    """Records each task's start on the server before the task runs; a task
    that crashed workers before waits until no other such task runs here."""

    def __init__(self, lifecycle: EntryLifecycle) -> None:
        super().__init__()
        self.lifecycle = lifecycle

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        await self.lifecycle.starting()
        return message


class Receiving(Protocol):
    """The slice of a taskiq broker the hooks go into."""

    formatter: TaskiqFormatter
    middlewares: list[TaskiqMiddleware]

    def add_middlewares(self, *middlewares: TaskiqMiddleware) -> None: ...
    def find_task(self, task_name: str) -> object: ...


def hook_receiver(broker: Receiving, lifecycle: EntryLifecycle) -> None:
    """Learn which entry each task comes from and when it starts: wrap the
    formatter and add the middleware (once, on the worker side, after the
    app configured both)."""
    if not isinstance(broker.formatter, EntryAwareFormatter):
        broker.formatter = EntryAwareFormatter(
            broker.formatter,
            lifecycle,
            lambda name: broker.find_task(name) is not None,
        )
    if not any(isinstance(m, StartRecorder) for m in broker.middlewares):
        broker.add_middlewares(StartRecorder(lifecycle))
