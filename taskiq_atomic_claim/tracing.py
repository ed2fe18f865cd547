"""Redeliveries and dead letters in a task's trace, where the app traces
with OpenTelemetry (taskiq's ``OpenTelemetryMiddleware``). Optional: the
package never requires opentelemetry, and without a recording span nothing
here costs a call to the server.

- A task that runs again after its worker died (its entry was reclaimed)
  carries ``taskiq_atomic_claim.redelivered``, ``.deliveries`` (the PEL's
  delivery count) and ``.crashes`` (starts in workers that died running
  it) on the span taskiq's middleware opened for the run.
- An entry moved to the dead letters leaves a span in its task's trace (the
  context the middleware put in the message's labels when it was sent),
  with a ``dead_lettered`` event naming the reason.
"""

from __future__ import annotations

import json
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.propagate import extract
except ImportError:  # pragma: no cover (tracing is the app's choice)
    trace = None  # type: ignore[assignment]

PREFIX = "taskiq_atomic_claim"
TRACER = "taskiq_atomic_claim"


def recording() -> bool:
    """A span records in the running task: the app traces this run."""
    return trace is not None and trace.get_current_span().is_recording()


def redelivered(deliveries: int, crashes: int) -> None:
    """Mark the running task's span as a redelivery."""
    if trace is None:
        return
    span = trace.get_current_span()
    span.set_attribute(f"{PREFIX}.redelivered", True)
    span.set_attribute(f"{PREFIX}.deliveries", deliveries)
    span.set_attribute(f"{PREFIX}.crashes", crashes)


def _message(data: bytes | str | None) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        message = json.loads(data)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def dead_lettered(
    stream: str, entry_id: str, data: bytes | str | None, reason: str
) -> None:
    """A span with a ``dead_lettered`` event in the task's trace (its send's,
    from the message's labels), where a tracer provider records it."""
    if trace is None:
        return
    message = _message(data)
    labels = message.get("labels")
    carrier = {k: str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}
    tracer = trace.get_tracer(TRACER)
    with tracer.start_as_current_span(
        "dead-letter", context=extract(carrier), kind=trace.SpanKind.INTERNAL
    ) as span:
        span.add_event(
            "dead_lettered",
            {
                "reason": reason,
                "stream": stream,
                "entry_id": entry_id,
                "task_id": str(message.get("task_id", "")),
                "task_name": str(message.get("task_name", "")),
            },
        )
