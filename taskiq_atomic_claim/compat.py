"""Refuse, at import, a stack this package cannot work on.

The checks read installed versions only (``importlib.metadata``), before
anything imports taskiq-redis: an unsupported taskiq-redis may not even
import (1.2.2 under taskiq 0.13 fails on ``taskiq.compat.model_dump``), and
one that imports may take arguments we pass only at the first kick.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

# The oldest releases .ci/old-stack proves; pyproject.toml says the same.
MINIMUM = {"redis": (7, 2), "taskiq": (0, 12), "taskiq-redis": (1, 2, 2)}
# The first taskiq-redis release that imports under taskiq 0.13.
TASKIQ_013_NEEDS = (1, 2, 3)


class UnsupportedStackError(ImportError):
    """An installed dependency is a version this package does not work with."""


def release(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version ("1.2.2rc1" -> (1, 2, 2))."""
    numbers = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else ()


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def stack_problems(installed: Mapping[str, str | None]) -> list[str]:
    """What is wrong with these installed versions (None: not installed)."""
    problems = []
    for name, oldest in MINIMUM.items():
        found = installed.get(name)
        if found is None:
            problems.append(f"{name} is not installed; needs {name}>={_dotted(oldest)}")
        elif release(found) < oldest:
            why = (
                " (older releases lack unacknowledged_lock_timeout)"
                if name == "taskiq-redis"
                else ""
            )
            problems.append(
                f"needs {name}>={_dotted(oldest)}, found {name} {found}{why}"
            )
    taskiq, taskiq_redis = installed.get("taskiq"), installed.get("taskiq-redis")
    if (
        taskiq is not None
        and taskiq_redis is not None
        and release(taskiq) >= (0, 13)
        and MINIMUM["taskiq-redis"] <= release(taskiq_redis) < TASKIQ_013_NEEDS
    ):
        problems.append(
            f"taskiq-redis {taskiq_redis} does not import under taskiq {taskiq};"
            f" needs taskiq-redis>={_dotted(TASKIQ_013_NEEDS)} (with redis>=8)"
            " or taskiq<0.13"
        )
    return problems


def _installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def check_stack() -> None:
    """Raise UnsupportedStackError naming every version that has to change."""
    problems = stack_problems({name: _installed_version(name) for name in MINIMUM})
    if problems:
        raise UnsupportedStackError(
            "taskiq-atomic-claim cannot run on this stack: " + "; ".join(problems)
        )
