"""What taskiq's receiver does before a task runs, for tests without one."""

from __future__ import annotations

from typing import Any

from taskiq import AckableMessage, TaskiqMessage


async def start_as_the_receiver_does(broker: Any, delivered: AckableMessage) -> None:
    """Run in a task of its own, as the receiver's callback: the broker
    learns the entry from the data it parses (here without parsing: test
    bodies are no taskiq messages), then every middleware's pre_execute."""
    broker.atomic.in_flight.loaded(delivered.data)
    parsed = TaskiqMessage(task_id="t", task_name="t", labels={}, args=[], kwargs={})
    for middleware in broker.middlewares:
        await middleware.pre_execute(parsed)
