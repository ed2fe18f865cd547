"""The shipped alert rules: promtool's unit tests pass, every rule has a
case where it fires and one where it stays quiet, and the docs name them all."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "alerts" / "taskiq-atomic-claim.rules.yml"
RULE_TESTS = ROOT / "tests" / "alerts" / "taskiq-atomic-claim.rules.test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found (Debian: apt-get install prometheus; .ci/run does)",
)


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.MULTILINE)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_the_rules_are_valid() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in checked.stdout


@needs_promtool
def test_the_rules_unit_tests_pass() -> None:
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_rule_is_tested_firing_and_quiet() -> None:
    # Each alert_rule_test case: its alertname, then [] or a list of alerts.
    cases = re.findall(
        r"alertname: (\w+)\n\s*exp_alerts:( \[\])?", RULE_TESTS.read_text()
    )
    assert alert_names()
    for name in alert_names():
        outcomes = {quiet == "" for alert, quiet in cases if alert == name}
        assert outcomes == {True, False}, f"{name}: needs a firing and a quiet case"


def test_the_docs_point_to_the_rules_and_name_every_alert() -> None:
    for doc, path in [
        ("README.md", "docs/alerts/taskiq-atomic-claim.rules.yml"),
        ("docs/operations.md", "alerts/taskiq-atomic-claim.rules.yml"),
    ]:
        text = (ROOT / doc).read_text()
        assert f"]({path})" in text, f"{doc} links the rules file"
        for name in alert_names():
            assert name in text, f"{doc} names {name}"
        # One home: no copy of a rule's expression beside the file.
        assert "expr:" not in text, f"{doc} copies a rule; link the file"
