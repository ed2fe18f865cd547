"""Every file and Python name docs/internals.md cites exists in the tree.

Backticked spans are read as: a path (``lua/claim.lua``, ``claim.py``,
``taskiq_atomic_claim/admin/``), which some file or folder of the repository
must end with; a dotted name (``scripts.ScriptRunner``,
``ScriptRunner.run``), whose head is a module or class of the package and
whose tail is defined in it; a call (``claim_call(...)``), whose name the
package defines, taskiq-redis's broker has or Python has built in; a
CamelCase name, a class of the package. Redis commands, keys and settings
are left alone.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
from taskiq_redis import RedisStreamBroker

REPO = Path(__file__).resolve().parent.parent
INTERNALS = REPO / "docs" / "internals.md"
PACKAGE = REPO / "taskiq_atomic_claim"
_SKIP_DIRS = {".git", ".venv", "site", "__pycache__", "node_modules"}

_SPAN = re.compile(r"`([^`]+)`")
_PATH = re.compile(r"^[\w./-]+(\.(py|lua|md)|/)$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_CALL = re.compile(r"^([A-Za-z_]\w*)\(")
_CAMEL = re.compile(r"^[A-Z][a-z]+[A-Za-z]*$")


@functools.cache
def _tree() -> list[str]:
    """Every file and folder of the repository, as paths relative to it,
    folders with a trailing slash."""
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [
            d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")
        ]
        relative = Path(folder).relative_to(REPO)
        found += [(relative / d).as_posix() + "/" for d in dirs]
        found += [(relative / f).as_posix() for f in files]
    return found


@functools.cache
def _definitions() -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """Per module name and per class name of the package, what each
    defines; and every name the package defines anywhere."""
    modules: dict[str, set[str]] = defaultdict(set)
    classes: dict[str, set[str]] = defaultdict(set)
    everything: set[str] = set()
    for source in PACKAGE.rglob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                everything.add(node.name)
        for node in tree.body:
            names = _defined(node)
            modules[source.stem].update(names)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    classes[node.name].update(_defined(member))
    return modules, classes, everything


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def cited(text: str) -> list[str]:
    spans = [" ".join(span.split()) for span in _SPAN.findall(text)]
    return [span for span in spans if not span.startswith(("python ", "taskiq "))]


def missing(text: str) -> list[str]:
    tree = _tree()
    modules, classes, everything = _definitions()
    parent = set(dir(RedisStreamBroker)) | set(dir(builtins))
    absent = []
    for span in cited(text):
        if _PATH.match(span):
            if not any(p == span or p.endswith("/" + span) for p in tree):
                absent.append(span)
        elif _DOTTED.match(span):
            *heads, name = span.split(".")
            head = heads[-1]
            if heads[0] == "taskiq_atomic_claim" and len(heads) == 1:
                known = set(modules) | set(classes)
                if name not in known:
                    absent.append(span)
            elif name not in modules.get(head, set()) | classes.get(head, set()):
                absent.append(span)
        elif call := _CALL.match(span):
            if call.group(1) not in everything | parent:
                absent.append(span)
        elif _CAMEL.match(span) and span not in classes:
            absent.append(span)
    return absent


def test_every_file_and_name_internals_cites_exists() -> None:
    absent = missing(INTERNALS.read_text())
    assert not absent, f"docs/internals.md cites what the tree lacks: {absent}"


@pytest.mark.parametrize(
    "span",
    [
        "lua/start.lua",
        "ack.lua",
        "no_such_module.py",
        "taskiq_atomic_claim/nowhere/",
        "operations.ack_call",
        "ScriptRunner.no_such_method",
        "no_such_call(stream=...,\n  group=...)",
        "NoSuchClass",
    ],
)
def test_a_citation_of_nothing_is_caught(span: str) -> None:
    assert missing(f"text `{span}` text") == [" ".join(span.split())]


@pytest.mark.parametrize(
    "span",
    [
        "lua/claim.lua",
        "includes/call_chunked.lua",
        "claim.py",
        "taskiq_atomic_claim/admin/",
        "scripts.ScriptRunner",
        "ScriptRunner.run",
        "claim_call(stream=...)",
        "listen()",
        "Connection",
        "XAUTOCLAIM ... JUSTID",
        "idle_timeout",
    ],
)
def test_a_citation_of_what_exists_passes(span: str) -> None:
    assert missing(f"text `{span}` text") == []
