"""Signals that end a run through its ``finally`` blocks.

SIGTERM and SIGHUP become ``SystemExit``, so every part's ``finally`` stops
its workers and servers. Ctrl-C raises ``KeyboardInterrupt`` at once, from a
handler of our own: ``asyncio.run`` would otherwise turn it into a
cancellation that library code may swallow, and the run would go on.
"""

from __future__ import annotations

import signal
from types import FrameType


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def install() -> None:
    signal.signal(signal.SIGINT, _interrupt)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
