"""A stalled run says where it stalled, then stops.

Every progress line re-arms the watchdog. After ``limit_s`` without one, a
thread sends the process SIGUSR1; its handler runs on the main thread, inside
whatever the main thread is blocked in (the event loop's select, usually), so
it can print every thread's stack and every asyncio task's coroutine stack,
the only stacks that say which await never returned. It then raises
KeyboardInterrupt, so the run's ``finally`` blocks still stop its servers.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
import time
from types import FrameType


class Watchdog:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        signal.signal(signal.SIGUSR1, self._report_and_interrupt)
        self._thread.start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(1.0):
            if time.monotonic() - self._last > self.limit_s:
                os.kill(os.getpid(), signal.SIGUSR1)
                return

    def _report_and_interrupt(self, _signum: int, _frame: FrameType | None) -> None:
        print(
            f"watchdog: no progress for {self.limit_s:.0f} s; stacks follow",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            tasks = asyncio.all_tasks()
        except RuntimeError:  # no event loop running on this thread
            tasks = set()
        for task in tasks:
            print(f"--- {task!r}", file=sys.stderr)
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()
        raise KeyboardInterrupt(f"benchmark stalled for {self.limit_s:.0f} s")
