"""The in-flight heartbeat and the graceful hand-back of one consumer.

While a worker's process lives, the entries it holds are kept from being
reclaimed, every third of ``idle_timeout``, by a thread of its own
(``liveness.py``): a task that blocks the event loop does not stop it. The
rest of the heartbeat runs on the loop (``EntryLifecycle.beat``). Its
shutdown makes claimable at once what no task runs; a task still running is
never made claimable while this process may run it (see
``finish_shutdown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from taskiq_atomic_claim.backoff import MAX_DELAY_S, Backoff
from taskiq_atomic_claim.connection import Connect
from taskiq_atomic_claim.delivery import Delivery
from taskiq_atomic_claim.entry_lifecycle import SCRIPT_BATCH, EntryLifecycle
from taskiq_atomic_claim.liveness import LivenessThread
from taskiq_atomic_claim.operations import leave_group_call
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    raise_if_cancel_was_swallowed,
    within,
)
from taskiq_atomic_claim.server_errors import is_passing
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")


class Heartbeat:
    """The heartbeat task of one consumer, and its hand-back at shutdown."""

    def __init__(
        self,
        in_flight: EntryLifecycle,
        scripts: ScriptRunner,
        connect: Connect,
        settings: ClaimSettings,
        streams: list[str],
        group: str,
        consumer: str,
        liveness: LivenessThread,
    ) -> None:
        self.in_flight = in_flight
        self.liveness = liveness
        self.scripts = scripts
        self.connect = connect
        self.settings = settings
        self.streams = streams
        self.group = group
        self.consumer = consumer
        self._task: asyncio.Task[None] | None = None
        # A listen() began: this broker read as a consumer of its group.
        self._listened = False
        self._give_back_failed = False

    @property
    def heartbeat_interval(self) -> float:
        """Seconds: three heartbeats fit in one idle_timeout."""
        return self.settings.idle_timeout / 3000

    def start(self) -> None:
        """A listen() begins: beat from now on (one task however many)."""
        self._listened = True
        self.liveness.start()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(
                self._loop(), name=f"heartbeat {self.consumer}"
            )

    async def _loop(self) -> None:
        # A task of its own, not part of listen(): while every slot is busy
        # the receiver stops pulling from listen(), and that is exactly when
        # entries wait for a slot and dropped ones need settling.
        #
        # It must never die: what the receiver dropped would stay held, and
        # what waits for a slot would never be handed back. So every error
        # is retried, usage errors too (logged as such).
        beat = self.heartbeat_interval
        outage = Backoff(f"heartbeat {self.consumer}", cap=min(MAX_DELAY_S, beat / 3))
        delay = beat
        while True:
            await asyncio.sleep(delay)
            raise_if_cancel_was_swallowed()
            try:
                async with self.connect() as client:
                    await within(
                        REPLY_MARGIN_S * self._beat_calls, self.in_flight.beat(client)
                    )
            except Exception as error:
                # A busy receiver parks the listen loop: then the heartbeat
                # may be first to find the server gone.
                await drop_idle_connections(self.connect, error)
                delay = outage.failed(self.in_flight.named(error))
            else:
                if len(self.in_flight):  # else the beat called nothing
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

    async def stop(self) -> None:
        """Stop beating, the liveness thread included (bounded)."""
        await self.liveness.stop()
        task, self._task = self._task, None
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
        """Make every held delivery no task runs here claimable at once, as
        the worker's shutdown begins.

        taskiq drops deliveries it prefetched but never started; without this
        they would wait out idle_timeout in the PEL. Tasks still running (past
        ``--wait-tasks-timeout``) run on through the app's shutdown handlers:
        their entries stay held and heartbeated until ``finish_shutdown``.
        """
        # Before the parent's shutdown closes the result backend: each
        # dead-letter result write is bounded.
        await self.in_flight.dead_lettering.results.flush()
        waiting = [d for d in self.in_flight.deliveries() if not d.running()]
        return await self._give_back(waiting, self.settings.idle_timeout)

    async def finish_shutdown(self) -> None:
        """At the very end of a shutdown: stop the heartbeat; hand back what
        no task runs; leave tasks still running to be reclaimed an
        idle_timeout after their last beat, when this process is long gone,
        their interruption not counted; delete this consumer if it owns
        nothing pending, and the group's idle consumers that own nothing."""
        await self.stop()
        held = self.in_flight.deliveries()
        running = [d for d in held if d.running()]
        waiting = [d for d in held if not d.running()]
        await self._give_back(waiting, self.settings.idle_timeout)
        # Idle 0 is a last beat: nothing claims them while the task may still
        # take a step before the event loop stops.
        if await self._give_back(running, 0):
            logger.info(
                "%d tasks still running at shutdown: their entries become"
                " claimable in idle_timeout (%d ms), not counted as crashes",
                len(running),
                self.settings.idle_timeout,
            )
        if self._listened:
            await self._leave_group()

    async def _give_back(self, deliveries: list[Delivery], idle_ms: int) -> int:
        if not deliveries:
            return 0
        try:
            # Bounded: the end of a shutdown taskiq timed out still waits.
            calls = (
                len({d.stream for d in deliveries}) + len(deliveries) // SCRIPT_BATCH
            )
            async with self.connect() as client:
                handed = await within(
                    REPLY_MARGIN_S * calls,
                    self.in_flight.hand_back(client, deliveries, idle_ms),
                )
        except Exception as error:
            # Unreachable, demoted (a failover under the shutdown), busy or
            # the password changed: the entries stay ours and are reclaimed
            # after idle_timeout.
            if not is_passing(error):
                raise
            # One line per shutdown: its end tries again what failed first.
            logger.log(
                logging.DEBUG if self._give_back_failed else logging.WARNING,
                "Could not hand back %d entries (others reclaim them after"
                " idle_timeout): %s",
                len(deliveries),
                error,
            )
            self._give_back_failed = True
            return 0
        if idle_ms:
            logger.info("Handed back %d unacked deliveries", handed)
        return handed

    async def _leave_group(self) -> None:
        """Remove this consumer from each stream's group where it owns
        nothing pending, and every other consumer owning nothing that has not
        read for idle_timeout (atomically checked): else every restart that
        exits owning entries (handed back, interrupted) leaves one."""
        for stream in self.streams:
            try:
                async with self.connect() as client:
                    own, others = await within(
                        REPLY_MARGIN_S,
                        self.scripts.run(
                            client,
                            leave_group_call(
                                stream=stream,
                                group=self.group,
                                consumer=self.consumer,
                                min_idle_ms=self.settings.idle_timeout,
                            ),
                        ),
                    )
            except Exception as error:
                # Housekeeping only: an outage, a group gone or a user without
                # +xgroup|delconsumer or +xinfo|consumers leaves the consumers
                # for doctor --fix.
                logger.warning(
                    "Consumer %r not deleted from stream %r: %s",
                    self.consumer,
                    stream,
                    error,
                )
                continue
            if int(own) == -1:
                logger.info(
                    "Consumer %r kept on stream %r: it still owns pending entries",
                    self.consumer,
                    stream,
                )
            if int(others):
                logger.info(
                    "Deleted %d consumers of stream %r owning nothing pending,"
                    " idle past idle_timeout (%d ms)",
                    int(others),
                    stream,
                    self.settings.idle_timeout,
                )
