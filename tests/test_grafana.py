"""The shipped Grafana dashboard queries only series this package exports:
the gauges of gauges.py and the workers' counters of metrics.py, named as
prometheus_client exposes them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from taskiq_atomic_claim.gauges import GAUGES, declare, prometheus_gauges
from taskiq_atomic_claim.metrics import ReclaimMetrics

DASHBOARD = (
    Path(__file__).resolve().parent.parent
    / "docs"
    / "grafana"
    / "taskiq-atomic-claim.json"
)
NAME = re.compile(r"\b(taskiq_atomic_claim_[a-z_]+)\b")


def queries(node: Any) -> list[str]:
    """Every PromQL query of a dashboard: targets' expr, variables' query."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            # A variable's "query" of type datasource is a plugin name.
            is_query = key == "expr" or (key == "query" and "(" in str(value))
            if is_query and isinstance(value, str):
                found.append(value)
            else:
                found += queries(value)
    elif isinstance(node, list):
        for item in node:
            found += queries(item)
    return found


def exported_series() -> set[str]:
    """Sample names a scrape of serve or of a worker shows."""
    registry = CollectorRegistry()
    declare(prometheus_gauges(registry), "s", "g")
    names = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    ReclaimMetrics().declare(["s"])  # the default registry, as in a worker
    from prometheus_client import REGISTRY  # noqa: PLC0415

    names |= {
        sample.name
        for family in text_string_to_metric_families(generate_latest(REGISTRY).decode())
        for sample in family.samples
        if sample.name.startswith("taskiq_atomic_claim_")
    }
    return names


def test_every_series_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    assert len(exprs) >= len(dashboard["panels"]), "every panel queries something"
    exported = exported_series()
    assert {f"taskiq_atomic_claim_{name}" for name in GAUGES} <= exported
    used = set()
    for expr in exprs:
        names = set(NAME.findall(expr))
        assert names, f"queries no series of this package: {expr}"
        unknown = names - exported
        assert not unknown, f"{expr} names series nobody exports: {unknown}"
        used |= names
    # Each gauge has a panel.
    missing = {f"taskiq_atomic_claim_{name}" for name in GAUGES} - used
    assert not missing, f"gauges without a panel: {missing}"


def test_a_mistyped_series_would_be_caught() -> None:
    # The check above reads names the way a query spells them.
    expr = 'max by (stream) (taskiq_atomic_claim_pendnig{stream=~"$stream"})'
    assert NAME.findall(expr) == ["taskiq_atomic_claim_pendnig"]
    assert "taskiq_atomic_claim_pendnig" not in exported_series()
