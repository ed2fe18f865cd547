"""Counters of what reclaiming did, for logs, health checks and Prometheus.

The counts live on each broker (``broker.metrics.snapshot()``). When
``prometheus_client`` is installed the same counts also go to its default
registry, labelled by stream: that is the registry taskiq's own
``PrometheusMiddleware`` serves, so adding that middleware exports them with
nothing else to set up.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

COUNTERS = {
    "claimed": "Idle entries reclaimed from other consumers",
    "lease_skips": "Claim cycles skipped because another consumer held the lease",
    "trimmed": "Pending entries found trimmed from their stream (data lost)",
    "dead_lettered": "Entries moved to the dead-letter stream",
    "heartbeats": "In-flight heartbeat calls sent",
    "handed_back": "Unacked deliveries handed back at shutdown",
    "script_reloads": "Scripts or function library reloaded after going missing",
}

_prometheus_counters: dict[str, Any] | None = None


def _prometheus() -> dict[str, Any]:
    """Created once per process: registering a name twice is an error."""
    global _prometheus_counters  # noqa: PLW0603
    if _prometheus_counters is None:
        _prometheus_counters = {}
        with contextlib.suppress(ImportError):
            from prometheus_client import Counter  # noqa: PLC0415

            for name, description in COUNTERS.items():
                _prometheus_counters[name] = Counter(
                    f"taskiq_atomic_claim_{name}", description, ["stream"]
                )
    return _prometheus_counters


class ReclaimMetrics:
    def __init__(self) -> None:
        self._counts = dict.fromkeys(COUNTERS, 0)

    def declare(self, streams: list[str]) -> None:
        """Make every counter exist at 0 for ``streams`` (and the script
        reloads, counted under "*"), so an alert can tell 0 from absent.
        Called as a worker starts listening, not at construction: taskiq's
        PrometheusMiddleware picks the (multiprocess) storage in its own."""
        for name, counter in _prometheus().items():
            for stream in ["*"] if name == "script_reloads" else streams:
                counter.labels(stream=stream)

    def add(self, name: str, stream: str, amount: int = 1) -> None:
        if amount <= 0:
            return
        self._counts[name] += amount
        counter = _prometheus().get(name)
        if counter is not None:
            counter.labels(stream=stream).inc(amount)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)


def report_trimmed(metrics: ReclaimMetrics, stream: str, trimmed: list[str]) -> None:
    """Count and log pending entries found deleted from their stream: lost
    tasks, whichever path (Lua claim or native sweep) found them."""
    metrics.add("trimmed", stream, len(trimmed))
    if trimmed:
        logging.getLogger("taskiq.atomic_claim").warning(
            "%d pending entries of stream %r were trimmed before anyone acked"
            " them; their tasks are lost: %s",
            len(trimmed),
            stream,
            ", ".join(trimmed),
        )
