"""Reclaim counters reach the registry taskiq's PrometheusMiddleware serves."""

from __future__ import annotations

from prometheus_client import REGISTRY

from taskiq_atomic_claim.metrics import COUNTERS, ReclaimMetrics


def sample(name: str, stream: str) -> float:
    value = REGISTRY.get_sample_value(
        f"taskiq_atomic_claim_{name}_total", {"stream": stream}
    )
    return value or 0.0


def test_counts_go_to_the_broker_and_to_prometheus() -> None:
    before = sample("claimed", "metrics-test")
    metrics = ReclaimMetrics()
    metrics.add("claimed", "metrics-test", 3)
    metrics.add("claimed", "metrics-test", 0)
    metrics.add("trimmed", "metrics-test", 2)
    assert metrics.snapshot()["claimed"] == 3
    assert metrics.snapshot()["trimmed"] == 2
    assert set(metrics.snapshot()) == set(COUNTERS)
    assert sample("claimed", "metrics-test") == before + 3
