"""``taskiq atomic-claim``: the commands through taskiq's own executable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from redis.asyncio import Redis

from tests.conftest import Server, server_command
from tests.test_cli import cli


def taskiq(*args: str) -> subprocess.CompletedProcess[str]:
    """The venv's real ``taskiq`` script, as a user runs it."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("taskiq")), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_taskiq_lists_the_plugin() -> None:
    listed = taskiq("--help")
    assert listed.returncode == 0, listed.stderr
    assert "atomic-claim" in listed.stdout
    assert "Could not load" not in listed.stdout


async def test_taskiq_atomic_claim_runs_the_same_commands(
    server: Server, redis: Redis
) -> None:
    await server_command(redis, "SCRIPT", "FLUSH")
    if server.major >= 7:
        await server_command(redis, "FUNCTION", "FLUSH")
    missing = taskiq("atomic-claim", "check", "--url", server.url)
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert missing.stdout == cli("check", "--url", server.url).stdout

    loaded = taskiq("atomic-claim", "load", "--url", server.url)
    assert loaded.returncode == 0, loaded.stderr
    current = taskiq("atomic-claim", "check", "--url", server.url)
    assert current.returncode == 0, current.stdout + current.stderr
    assert "current" in current.stdout


def test_taskiq_atomic_claim_passes_usage_errors_through() -> None:
    wrong = taskiq("atomic-claim", "requeue", "--queue", "q")
    assert wrong.returncode == 2
    assert "taskiq atomic-claim requeue: error: one of the arguments" in wrong.stderr
    help_text = taskiq("atomic-claim", "--help")
    assert help_text.returncode == 0
    assert help_text.stdout.startswith("usage: taskiq atomic-claim "), help_text.stdout
    named_so = help_text.stdout.replace("taskiq atomic-claim", "taskiq-atomic-claim")
    assert named_so == cli("--help").stdout
