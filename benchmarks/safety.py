"""Cleanup that runs however the run ends, and guards for child processes.

Every resource the suite creates (network namespace, proxy process, claimer
processes) registers an undo here. The undos run in ``finally`` blocks, at
interpreter exit, and on SIGTERM/SIGHUP (turned into ``SystemExit`` so the
``finally`` blocks run too). Ctrl-C raises ``KeyboardInterrupt`` at once,
from a handler of our own: ``asyncio.run`` would otherwise turn it into a
cancellation that library code may swallow, and the run would go on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import signal
import sys
from collections.abc import Callable
from types import FrameType

_undos: list[tuple[str, Callable[[], None]]] = []
_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29


def register(label: str, undo: Callable[[], None]) -> Callable[[], None]:
    """Remember ``undo``; returns a function that runs it once and forgets it."""
    entry = (label, undo)
    _undos.append(entry)

    def run_once() -> None:
        if entry in _undos:
            _undos.remove(entry)
            undo()

    return run_once


def run_all() -> None:
    """Undo everything still registered, newest first; never raises."""
    while _undos:
        label, undo = _undos.pop()
        try:
            undo()
        except Exception as error:  # keep undoing the rest
            print(f"cleanup of {label} failed: {error}", file=sys.stderr)


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def install() -> None:
    atexit.register(run_all)
    signal.signal(signal.SIGINT, _interrupt)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent() -> None:
    """In a child: get SIGKILLed if the parent dies, so none outlives a run."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def precise_sleeps() -> None:
    """Shrink the timer slack (50 us by default) so short sleeps end on time."""
    _prctl(_PR_SET_TIMERSLACK, 1)


def hard_deadline(seconds: float) -> None:
    """In a child: SIGALRM (which kills) after ``seconds``, whatever it is doing."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(seconds) + 1))
