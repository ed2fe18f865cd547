"""The in-flight heartbeat and the graceful hand-back, part of every atomic
broker (``ReclaimingListener`` mixes this in).

While a worker lives, the entries it holds are kept from being reclaimed
(``InFlight.beat``, every third of ``idle_timeout``); at shutdown whatever it
still holds is made claimable at once (``InFlight.hand_back``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from taskiq_atomic_claim.backoff import MAX_DELAY_S, Backoff
from taskiq_atomic_claim.in_flight import SCRIPT_BATCH, InFlight
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    raise_if_cancel_was_swallowed,
    within,
)
from taskiq_atomic_claim.server_errors import is_outage
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")


class Heartbeating:
    """The heartbeat task of one consumer, and its hand-back at shutdown."""

    consumer_name: str
    claim_settings: ClaimSettings
    in_flight: InFlight
    _heartbeat: asyncio.Task[None] | None
    if TYPE_CHECKING:

        def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]: ...

    @property
    def heartbeat_interval(self) -> float:
        """Seconds: three heartbeats fit in one idle_timeout."""
        return self.claim_settings.idle_timeout / 3000

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.create_task(
                self._heartbeat_loop(), name=f"heartbeat {self.consumer_name}"
            )

    async def _heartbeat_loop(self) -> None:
        # A task of its own, not part of listen(): while every slot is busy
        # the receiver stops pulling from listen(), and that is exactly when
        # long tasks need their heartbeat.
        #
        # It must never die: a dead heartbeat lets every long task be
        # reclaimed and run twice. So every error is retried, usage errors
        # too (logged as such). Retries come faster than beats, so entries
        # unheartbeated through an outage are refreshed soon after it ends.
        beat = self.heartbeat_interval
        outage = Backoff(
            f"heartbeat {self.consumer_name}", cap=min(MAX_DELAY_S, beat / 3)
        )
        delay = beat
        while True:
            await asyncio.sleep(delay)
            raise_if_cancel_was_swallowed()
            try:
                async with self._connection() as client:
                    await within(
                        REPLY_MARGIN_S * self._beat_calls, self.in_flight.beat(client)
                    )
            except Exception as error:
                # A busy receiver parks the listen loop: then the heartbeat
                # may be first to find the server gone.
                await drop_idle_connections(self._connection, error)
                delay = outage.failed(error)
            else:
                outage.succeeded()
                delay = beat

    @property
    def _beat_calls(self) -> int:
        """Script calls one heartbeat makes, at least one."""
        return max(
            1,
            sum(
                -(-len(self.in_flight[stream]) // SCRIPT_BATCH)
                for stream in self.in_flight.streams()
            ),
        )

    async def set_idle(self, client: Any, idle_ms: int) -> None:
        """Set the idle time of every in-flight entry this consumer still owns."""
        await self.in_flight.set_idle(client, idle_ms, self.in_flight.deliveries())

    async def stop_heartbeat(self) -> None:
        task, self._heartbeat = self._heartbeat, None
        if task is None:
            return
        # A cancel that lands inside a redis-py call can be swallowed there
        # (the call returns normally, the loop sleeps on): cancel until the
        # task is gone, or shutdown waits forever. Bounded: a beat is short.
        for _ in range(100):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                break
        if task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def hand_back(self) -> int:
        """Make every unacked delivery claimable at once (graceful shutdown).

        taskiq drops deliveries it prefetched but never started; without this
        they would wait out idle_timeout in the PEL.
        """
        await self.stop_heartbeat()
        # Before the result backend closes: each write is bounded.
        await self.in_flight.dead_lettering.results.flush()
        held = len(self.in_flight)
        if not held:
            return 0
        try:
            async with self._connection() as client:
                handed = await self.in_flight.hand_back(client)
        except Exception as error:
            # Unreachable, demoted (a failover under the shutdown) or busy:
            # the entries stay ours and are reclaimed after idle_timeout.
            if not is_outage(error):
                raise
            logger.warning(
                "Could not hand back %d entries (others reclaim them after"
                " idle_timeout): %s",
                held,
                error,
            )
            return 0
        logger.info("Handed back %d unacked deliveries", handed)
        return handed
