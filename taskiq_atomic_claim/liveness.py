"""The liveness thread: while this process lives, the entries its consumer
holds are kept from being reclaimed, whatever its event loop does.

A task that blocks the worker's event loop (a sync client called inside an
async task) stops everything on that loop, the heartbeat included; another
worker would then reclaim and run the task a second time. So the idle reset
of held entries (``set_idle`` with idle 0, every third of ``idle_timeout``)
runs here, in a daemon thread with an event loop, a client (its own
connections, ``Connection.liveness_client``) and a ``ScriptRunner`` of its
own: no asyncio object is shared with the worker's loop. It reads what is
held as a copy taken under the held set's lock
(``EntryLifecycle.held_snapshot``) and changes nothing of the worker's: what
it learns (entries no longer owned, the heartbeat count) goes back to the
worker's loop with ``call_soon_threadsafe``.

The rest of the heartbeat (dead-lettering what taskiq dropped, handing back
what waited too long) stays on the loop (``heartbeat.py``).

A frozen process (SIGSTOP, a debugger, a C call holding the GIL) runs no
thread either: its entries are reclaimed once idle_timeout passes, as a dead
one's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from taskiq_atomic_claim.backoff import MAX_DELAY_S, Backoff
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.delivery import Delivery
from taskiq_atomic_claim.entry_lifecycle import SCRIPT_BATCH, EntryLifecycle
from taskiq_atomic_claim.keys import ORPHANS_CONSUMER, alive_prefix
from taskiq_atomic_claim.operations import set_idle_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import Fault, classify, is_passing

logger = logging.getLogger("taskiq.atomic_claim")

# How long stopping waits for the thread: a beat in flight is cancelled, and
# closing its client is bounded by the same reply margin as any call.
STOP_WAIT_S = REPLY_MARGIN_S + 1.0
# A beat's call is never given up sooner (tiny idle_timeouts, a busy host).
MIN_DEADLINE_S = 0.5


class LivenessThread:
    """The idle reset of one consumer's held entries, in a thread of its own."""

    def __init__(
        self,
        in_flight: EntryLifecycle,
        connection: Connection,
        idle_timeout: int,
    ) -> None:
        self.in_flight = in_flight
        self.connection = connection
        self.idle_timeout = idle_timeout
        # This consumer's alive key: renewed every other beat, it expires
        # idle_timeout after the process stops beating.
        self._announce_refused = False
        self._announced_at = -float("inf")
        self.alive_key = alive_prefix(in_flight.group) + in_flight.consumer
        self._thread: threading.Thread | None = None
        # The worker's loop, where results are handed back.
        self._owner: asyncio.AbstractEventLoop | None = None
        # Guards the stop request and the handle to cancel the thread's work.
        self._lock = threading.Lock()
        self._stopping = False
        self._running: tuple[asyncio.AbstractEventLoop, asyncio.Task[None]] | None = (
            None
        )

    @property
    def interval(self) -> float:
        """Seconds: three beats fit in one idle_timeout."""
        return self.idle_timeout / 3000

    @property
    def deadline(self) -> float:
        """Seconds a beat's call may take: one beat. A connection frozen
        (held open, nothing answered) is then given up and the beat retried
        on a new one before its entries turn idle; waiting the usual reply
        margin (5 s) would let them."""
        return min(REPLY_MARGIN_S, max(MIN_DEADLINE_S, self.interval))

    def start(self) -> None:
        """A listen() begins: beat from now on (one thread however many)."""
        self._owner = asyncio.get_running_loop()
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            self._stopping = False
        self._thread = threading.Thread(
            target=asyncio.run,
            args=(self._beat_until_stopped(),),
            name=f"liveness {self.in_flight.consumer}",
            daemon=True,
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and wait for it (bounded): no beat after this
        returns, so a hand-back after it is the last word on idle times."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._lock:
            self._stopping = True
            running = self._running
        # A cancel that lands inside a redis-py call can be swallowed there:
        # cancel until the thread is gone (bounded), as Heartbeat.stop does.
        deadline = time.monotonic() + STOP_WAIT_S
        while thread.is_alive() and time.monotonic() < deadline:
            if running is not None:
                loop, task = running
                with contextlib.suppress(RuntimeError):  # its loop closed
                    loop.call_soon_threadsafe(task.cancel)
            await asyncio.to_thread(thread.join, 0.1)
        if thread.is_alive():
            logger.warning(
                "The liveness thread of consumer %r did not stop within %.0f s"
                " (a call hung); it makes no further call",
                self.in_flight.consumer,
                STOP_WAIT_S,
            )

    async def _beat_until_stopped(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            if self._stopping:
                return
            self._running = (asyncio.get_running_loop(), task)
        try:
            async with self.connection.liveness_client() as client:
                await self._beat_forever(client)
        except asyncio.CancelledError:
            pass
        finally:
            with self._lock:
                self._running = None

    async def _beat_forever(self, client: ScriptClient) -> None:
        # It must never die: a dead heartbeat lets every long task be
        # reclaimed and run twice. So every error is retried; retries come
        # faster than beats, so entries unheartbeated through an outage are
        # refreshed soon after it ends.
        scripts = ScriptRunner()
        beat = self.interval
        outage = Backoff(
            f"heartbeat {self.in_flight.consumer}", cap=min(MAX_DELAY_S, beat / 3)
        )
        await self._announce(client)  # alive from the start
        delay = beat
        while not self._stopping:
            await asyncio.sleep(delay)
            try:
                await self._beat(scripts, client)
                # Every other beat: the key still has a third of
                # idle_timeout to run, and an idle server is woken less.
                if time.monotonic() - self._announced_at >= 1.5 * beat:
                    await self._announce(client)
            except Exception as error:
                if classify(error) is Fault.UNREACHABLE:
                    # Its connections went with the server: reconnect.
                    pool = getattr(client, "connection_pool", None)
                    if pool is not None:
                        with contextlib.suppress(Exception):
                            await pool.disconnect(inuse_connections=False)
                delay = outage.failed(self.connection.named(error))
            else:
                outage.succeeded()
                delay = beat

    async def _announce(self, client: ScriptClient) -> None:
        """Renew this consumer's alive key: what tells operators a
        consumer's process lives (a dead one's lapse within idle_timeout)."""
        now_ms = str(time.time_ns() // 1_000_000)
        try:
            await within(
                self.deadline,
                client.execute_command(
                    "SET", self.alive_key, now_ms, "PX", self.idle_timeout
                ),
            )
            self._announced_at = time.monotonic()
        except Exception as error:
            # Never the beat's failure: its resets went through or failed on
            # their own. Out of memory the SET is refused; an ACL from
            # before this key (re-run `acl`) refuses it too.
            if is_passing(error) or self._announce_refused:
                logger.debug("Alive key not renewed: %s", error)
                return
            logger.warning(
                "Consumer %r cannot mark itself alive (%s); operators"
                " see it only by its idle time",
                self.in_flight.consumer,
                error,
            )
            self._announce_refused = True

    async def _beat(self, scripts: ScriptRunner, client: ScriptClient) -> None:
        """Reset the idle time of every held entry still owned; report
        those no longer owned to the worker's loop. Each stream is tried
        (a Cluster slot unreachable must not stop the others'); the first
        failure is raised after."""
        failure: Exception | None = None
        for stream, held in _by_stream(self.in_flight.held_snapshot()):
            for start in range(0, len(held), SCRIPT_BATCH):
                chunk = held[start : start + SCRIPT_BATCH]
                try:
                    lost = await within(
                        self.deadline,
                        scripts.run(
                            client,
                            set_idle_call(
                                stream=stream,
                                group=self.in_flight.group,
                                consumer=self.in_flight.consumer,
                                idle_ms=0,
                                orphans=ORPHANS_CONSUMER,
                                entry_ids=[d.entry_id for d in chunk],
                            ),
                        ),
                    )
                except Exception as error:
                    failure = failure or error
                    break
                self._on_worker_loop(self._beaten, stream, chunk, lost)
        if failure is not None:
            raise failure

    def _on_worker_loop(self, callback: Callable[..., None], *args: Any) -> None:
        owner = self._owner
        if owner is not None:
            with contextlib.suppress(RuntimeError):  # the worker's loop closed
                owner.call_soon_threadsafe(callback, *args)

    def _beaten(self, stream: str, chunk: list[Delivery], lost: list[Any]) -> None:
        """On the worker's loop: count the beat; forget entries this consumer
        no longer owns (claimed by another, acked, trimmed) unless what is
        held now is a newer delivery of the same entry."""
        self.in_flight.metrics.add("heartbeats", stream)
        by_id = {d.entry_id: d for d in chunk}
        for raw in lost:
            entry_id = text(raw)
            held = self.in_flight.get(stream, entry_id)
            if held is not None and held is by_id.get(entry_id):
                self.in_flight.discard(stream, entry_id)


def _by_stream(held: list[Delivery]) -> Iterator[tuple[str, list[Delivery]]]:
    streams: dict[str, list[Delivery]] = {}
    for delivery in held:
        streams.setdefault(delivery.stream, []).append(delivery)
    yield from streams.items()
