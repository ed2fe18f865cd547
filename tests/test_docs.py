"""What the README and the docs tell a user to run, run: the example app
with a real ``taskiq worker``, every ``taskiq-atomic-claim`` command line
parsed by the CLI's own parser, every ``python -m`` module importable."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from taskiq_atomic_claim.cli.main import build_parser
from taskiq_atomic_claim.harness.drill import _taskiq_command
from tests.conftest import Server

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Placeholders a synopsis uses, and a value each parses as.
_PLACEHOLDERS = {
    "URL": "redis://127.0.0.1:6379",
    "NODE_URL": "redis://127.0.0.1:7000",
    "HOST:PORT": "127.0.0.1:26379",
    "NAME": "mymaster",
    "Q": "taskiq",
    "S": "other",
    "G": "taskiq",
    "N": "3",
    "ID": "1-0",
    "PREFIX": "results",
    "FILE": "/dev/null",
}


def code_blocks(language: str) -> list[tuple[Path, str]]:
    return [
        (path, match.group(2))
        for path in DOCUMENTS
        for match in _FENCE.finditer(path.read_text())
        if match.group(1) == language
    ]


def shell_lines(program: str) -> list[tuple[Path, str]]:
    """Every line of a shell block that runs ``program``, comment dropped."""
    found = []
    for path, block in code_blocks("sh"):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            command = command.split("&&")[-1].strip()
            if re.match(rf"^(\S*/)?{re.escape(program)}(\s|$)", command):
                found.append((path, command))
    return found


def as_arguments(synopsis: str) -> list[str]:
    """A synopsis as one concrete command line: optional ``[...]`` groups
    dropped, the first of each ``(a | b)`` choice taken, ``...`` dropped,
    placeholders given values."""
    text = synopsis
    while re.search(r"\[[^\[\]]*\]", text):
        text = re.sub(r"\[[^\[\]]*\]", "", text)
    text = re.sub(r"\(([^|()]*)\|[^()]*\)", r"\1", text)
    text = text.replace("...", "").replace("…", "")
    words = shlex.split(text)[1:]
    return [_PLACEHOLDERS.get(word, word) for word in words]


def test_the_documents_quote_commands() -> None:
    # The extraction below must find what it checks, or it checks nothing.
    assert len(shell_lines("taskiq-atomic-claim")) >= 10
    assert code_blocks("python")


@pytest.mark.parametrize(
    ("path", "command"),
    shell_lines("taskiq-atomic-claim"),
    ids=lambda value: value.name if isinstance(value, Path) else value[:60],
)
def test_every_quoted_cli_command_parses(path: Path, command: str) -> None:
    arguments = as_arguments(command)
    try:
        parsed = build_parser().parse_args(arguments)
    except SystemExit as exit_:
        pytest.fail(f"{path.name}: {command!r} does not parse (exit {exit_.code})")
    assert parsed.command


def test_every_quoted_python_module_exists() -> None:
    modules = {
        match.group(1)
        for path in DOCUMENTS
        for match in re.finditer(r"python3? -m ([\w.]+)", path.read_text())
    }
    assert "benchmarks" in modules
    sys.path.insert(0, str(REPO))
    try:
        missing = [
            name
            for name in sorted(modules)
            if name not in {"venv", "pip", "pytest", "build"}
            and importlib.util.find_spec(name) is None
        ]
    finally:
        sys.path.remove(str(REPO))
    assert not missing, f"documents quote python -m of missing modules: {missing}"


def test_the_readme_example_app_runs_with_a_real_worker(
    server: Server, tmp_path: Path
) -> None:
    """The README's app, worker command and producer, as a user runs them,
    pointed at the test server instead of localhost:6379."""
    readme = REPO / "README.md"
    files = {}
    for path, block in code_blocks("python"):
        first = block.splitlines()[0]
        if path == readme and first.startswith("# ") and first.endswith(".py"):
            files[first[2:]] = block.replace("redis://localhost:6379", server.url)
    assert set(files) == {"myapp.py", "produce.py"}
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    worker_lines = [c for p, c in shell_lines("taskiq") if p == readme]
    assert worker_lines == ["taskiq worker myapp:broker --ack-type when_executed"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    worker = subprocess.Popen(
        [*_taskiq_command(), *shlex.split(worker_lines[0])[1:], "--workers", "1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        produced = subprocess.run(
            [sys.executable, "produce.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        worker.terminate()
        _, worker_errors = worker.communicate(timeout=30)
    assert produced.returncode == 0, produced.stderr + worker_errors.decode()
    assert produced.stdout.strip() == "3"
