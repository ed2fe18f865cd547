"""A benchmark run that stops making progress prints where it is stuck and
stops, instead of hanging until the test's timeout kills it silently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _python(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


_STUCK = """
import asyncio
from benchmarks.watchdog import Watchdog

async def an_await_that_never_returns() -> None:
    await asyncio.get_running_loop().create_future()

async def main() -> None:
    stuck = asyncio.create_task(an_await_that_never_returns())
    await stuck

dog = Watchdog(1.0)
dog.start()
try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("stopped by the watchdog")
"""


def test_a_stalled_run_prints_the_stuck_await_and_stops() -> None:
    done = _python(_STUCK)
    assert "stopped by the watchdog" in done.stdout, done.stderr
    assert "no progress for 1 s" in done.stderr
    # The coroutine stack names the await that never returned.
    assert "an_await_that_never_returns" in done.stderr


_BUSY = """
import time
from benchmarks.watchdog import Watchdog

dog = Watchdog(1.0)
dog.start()
for _ in range(30):
    time.sleep(0.1)
    dog.progress()
dog.stop()
print("finished")
"""


def test_a_run_that_keeps_reporting_progress_is_left_alone() -> None:
    done = _python(_BUSY)
    assert done.stdout.strip() == "finished", done.stderr
    assert "watchdog" not in done.stderr
