"""What a waiter on a dead-lettered task learns: when the broker has a result
backend, every path that moves an entry to the dead letters hands it here,
and an error result (``DeadLettered``) is stored under the task's id, so
``wait_result`` returns at once instead of waiting out its timeout. A
requeued task that then runs overwrites it with its own result, as taskiq
overwrites any result.

The write runs beside the dead-lettering, never inside it: the entry is in
the dead letters already, and a result backend that fails or hangs costs a
warning, not the worker's loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from taskiq import TaskiqResult
from taskiq.abc.result_backend import AsyncResultBackend
from taskiq.result_backends.dummy import DummyResultBackend

from taskiq_atomic_claim import tracing

logger = logging.getLogger("taskiq.atomic_claim")

# A result write that has not finished by then is given up (with a warning).
WRITE_TIMEOUT_S = 5.0


class DeadLettered(Exception):  # noqa: N818 (what happened, as taskiq names errors)
    """The task's message was moved to the dead letters: it does not run
    unless an operator requeues it (``taskiq-atomic-claim requeue``).

    Its args are its fields, so taskiq's result serialisation (JSON or
    pickle) rebuilds it as it was.
    """

    def __init__(self, reason: str, stream: str, entry_id: str) -> None:
        super().__init__(reason, stream, entry_id)

    @property
    def reason(self) -> str:
        return str(self.args[0])

    @property
    def stream(self) -> str:
        return str(self.args[1])

    @property
    def entry_id(self) -> str:
        return str(self.args[2])

    def __str__(self) -> str:
        return (
            f"entry {self.entry_id} of stream {self.stream!r} was moved to the"
            f" dead letters: {self.reason}"
        )


def task_id_of(data: bytes | str | None) -> str | None:
    """The task id in a message's data (taskiq's JSON message), if any."""
    if data is None:
        return None
    try:
        task_id = json.loads(data).get("task_id")
    except (ValueError, AttributeError):
        return None
    return task_id if isinstance(task_id, str) and task_id else None


class DeadLetterResults:
    """Stores a ``DeadLettered`` error result for each dead-lettered entry
    whose data names a task, in the broker's result backend (none stored
    while it has none: taskiq's ``DummyResultBackend``)."""

    def __init__(self, result_backend: Callable[[], AsyncResultBackend[Any]]) -> None:
        # A callable: taskiq's with_result_backend() replaces the backend
        # after the broker is built.
        self.result_backend = result_backend
        self._writes: set[asyncio.Task[None]] = set()

    def dead_lettered(
        self, stream: str, entry_id: str, data: bytes | str | None, reason: str
    ) -> None:
        """The entry is in the dead letters: say so in its task's trace, and
        start writing its task's result."""
        tracing.dead_lettered(stream, entry_id, data, reason)
        backend = self.result_backend()
        task_id = task_id_of(data)
        if task_id is None or isinstance(backend, DummyResultBackend):
            return
        result: TaskiqResult[None] = TaskiqResult(
            is_err=True,
            return_value=None,
            execution_time=0.0,
            error=DeadLettered(reason, stream, entry_id),
        )
        write = asyncio.create_task(self._write(backend, task_id, result))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    async def _write(
        self, backend: AsyncResultBackend[Any], task_id: str, result: TaskiqResult[None]
    ) -> None:
        try:
            await asyncio.wait_for(backend.set_result(task_id, result), WRITE_TIMEOUT_S)
        except Exception as error:
            logger.warning(
                "Could not store the dead-letter result of task %s (its waiters"
                " wait out their timeout): %s: %s",
                task_id,
                type(error).__name__,
                error,
            )

    async def flush(self) -> None:
        """Let the writes under way finish (each is bounded): at shutdown,
        before the result backend closes."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
