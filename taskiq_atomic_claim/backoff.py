"""The one retry schedule: capped exponential backoff, logged per outage.

Every loop that talks to the server (listen, the heartbeat, acks, the
cluster client's per-slot reads) keeps a ``Backoff``. A failure logs one
warning when an outage starts and one line when it ends, never one per
attempt, and says how long to wait before the next attempt. The delays are
deterministic (no jitter): 50 ms, doubling, capped; a worker fleet is small
enough that synchronised retries do not matter, and fixed delays keep tests
and logs predictable.
"""

from __future__ import annotations

import asyncio
import logging
import time

from taskiq_atomic_claim.server_errors import Fault, classify, reply_text

logger = logging.getLogger("taskiq.atomic_claim")

# The end line names what ended; an outage's is that Redis answers again.
_ENDED: dict[Fault | None, str] = {
    Fault.FORBIDDEN: "the ACL allows it again",
    Fault.LOGIN_REFUSED: "login accepted again",
    Fault.GROUP_MISSING: "the consumer group is back",
    Fault.USAGE: "working again",
}

# Faults only an operator ends: named when they take over an outage.
_NEEDS_AN_OPERATOR = (Fault.FORBIDDEN, Fault.LOGIN_REFUSED)

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 5.0


class Backoff:
    """Retry delays for one loop (or one shared purpose, such as acks), and
    the outage log: one warning when it starts, one line when it ends.

    ``what`` starts every line, e.g. ``"heartbeat worker-1"``.
    """

    def __init__(
        self,
        what: str,
        first: float = FIRST_DELAY_S,
        cap: float = MAX_DELAY_S,
        consequence: str = "",
    ) -> None:
        self.what = what
        # Said once, when an outage starts: what it costs if it lasts.
        self.consequence = consequence
        self.first = min(first, cap)
        self.cap = cap
        self.delay = self.first
        self.started: float | None = None
        self.attempts = 0
        # What the outage under way is (its end line names it too).
        self.fault: Fault | None = None

    @property
    def failing(self) -> bool:
        return self.started is not None

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt; the one after waits longer."""
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay

    def failed(self, error: BaseException) -> float:
        """Record a failed attempt; log if it starts an outage. Returns the
        seconds to wait before trying again."""
        self.attempts += 1
        if self.started is None:
            self.started = time.monotonic()
            fault = self.fault = classify(error)
            reason = fault.value if fault is not Fault.USAGE else type(error).__name__
            logger.warning(
                "%s: %s, retrying with backoff (up to %.1f s apart)%s: %s",
                self.what,
                reason,
                self.cap,
                f"; {self.consequence}" if self.consequence else "",
                reply_text(error),
            )
        elif self.fault not in _NEEDS_AN_OPERATOR:
            fault = classify(error)
            if fault in _NEEDS_AN_OPERATOR:
                # The server is back but refuses us (a password changed
                # while the connection was down): say what now keeps it out.
                self.fault = fault
                logger.warning(
                    "%s: %s now, still retrying: %s",
                    self.what,
                    fault.value,
                    reply_text(error),
                )
        return self.next_delay()

    async def wait(self, error: BaseException) -> None:
        """``failed``, then sleep the delay it returns."""
        await asyncio.sleep(self.failed(error))

    def succeeded(self) -> None:
        """An attempt worked: log the end of an outage, start over at ``first``."""
        if self.started is not None:
            ended = _ENDED.get(self.fault, "Redis reachable again")
            logger.warning(
                "%s: %s after %.1f s (%d attempts failed)",
                self.what,
                ended,
                time.monotonic() - self.started,
                self.attempts,
            )
        self.started, self.delay, self.attempts = None, self.first, 0
        self.fault = None
