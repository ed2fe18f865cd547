"""The listen loop every atomic broker shares: read, reclaim, deliver.

``Listener`` takes the collaborators the broker built: the claim schedule
and the Lua path's claims (``claim_schedule.py``), a reader per path
(``reads.py``, ``native_reads.py``), the path choice (``reclaim_path.py``),
the consumer groups (``stream_setup.py``) and the heartbeat
(``heartbeat.py``). Everything that talks to the server goes through the
scripts in ``lua/`` or plain stream commands, so the same loop serves a
standalone server, Sentinel and Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from taskiq import AckableMessage, AsyncBroker

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.claim_schedule import ClaimSchedule, ScriptClaims
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.delivery import Delivery, EntryData
from taskiq_atomic_claim.heartbeat import Heartbeat
from taskiq_atomic_claim.in_flight import InFlight
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.native_reads import NativePathReads
from taskiq_atomic_claim.operations import ACK
from taskiq_atomic_claim.pipelined import PipelinedCalls
from taskiq_atomic_claim.reads import LuaPathReads, read_entries
from taskiq_atomic_claim.receiver_hooks import EntryAwareFormatter, StartRecorder
from taskiq_atomic_claim.reclaim_path import PathChoice
from taskiq_atomic_claim.scripts import ScriptClient, ScriptRunner
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    raise_if_cancel_was_swallowed,
    within,
)
from taskiq_atomic_claim.server_errors import Fault, classify, is_outage
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.stream_setup import ConsumerGroups

logger = logging.getLogger("taskiq.atomic_claim")

_DATA_FIELD = b"data"


class Listener:
    """One consumer's listen loop and the acks of what it delivered."""

    def __init__(
        self,
        *,
        connection: Connection,
        scripts: ScriptRunner,
        settings: ClaimSettings,
        metrics: ReclaimMetrics,
        in_flight: InFlight,
        schedule: ClaimSchedule,
        claims: ScriptClaims,
        lua_reads: LuaPathReads,
        native_reads: NativePathReads,
        path: PathChoice,
        groups: ConsumerGroups,
        heartbeat: Heartbeat,
        read_from: dict[str, str | int],
        group: str,
        consumer: str,
    ) -> None:
        self.connection = connection
        # The names the acks use (the entry's lifecycle, below).
        self._connection = connection.connect
        self.claim_settings = settings
        self.consumer_group_name = group
        self.consumer_name = consumer
        self.scripts = scripts
        self.metrics = metrics
        self.in_flight = in_flight
        self.schedule = schedule
        self.claims = claims
        self.lua_reads = lua_reads
        self.native_reads = native_reads
        self.path = path
        self.groups = groups
        self.heartbeat = heartbeat
        self.read_from = read_from
        # Shared by every ack: one outage, one log line, however many acks.
        self._ack_backoff = Backoff(
            f"acks of consumer {self.consumer_name}",
            cap=1.0,
            consequence=f"an ack still failing after {self._ack_patience:.1f} s"
            " is dropped and its task runs again once reclaimed (a hash slot"
            " migrating is waited out)",
        )

    async def listen(self, broker: AsyncBroker) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and reclaimed ones: reclaimed by the reads
        themselves on Redis >= 8.4, else by the claim script every claim
        interval. ``broker`` is the app's broker, whose formatter and
        middlewares learn which entry each task comes from."""
        self._begin_listening(broker)
        # After a full claim batch, read new messages before claiming again:
        # they keep flowing while a backlog drains.
        read_turn = False
        outage = Backoff(f"consumer {self.consumer_name}")
        recreate_group = False  # before the next call
        group_gone = False  # NOGROUP since the last call that worked
        # Under OOM claims are refused while reads work: such an outage
        # lasts until a claim works again, not until the next read.
        claim_refused = claiming = False
        async with self.connection.listen_client(self._mark_delivered) as client:
            self._pipeline_over(client)
            while True:
                raise_if_cancel_was_swallowed()
                batch: list[tuple[str, str, dict[Any, Any]]] = []
                try:
                    self.claims.raise_deferred_error()
                    if recreate_group:
                        await self.groups.recreate(client)
                        recreate_group = False
                    reads_reclaim = await self.path.reads_reclaim_on(client)
                    # Where reads reclaim, no claim call runs at all.
                    due = [] if reads_reclaim else self.schedule.due_streams()
                    if due and not read_turn:
                        claiming = True
                        batch = await within(
                            REPLY_MARGIN_S * len(due),
                            self.claims.claim_all(client, due),
                        )
                        claiming = claim_refused = False
                        read_turn = bool(batch)
                    if not batch:
                        # The read blocks until the next claim at most.
                        read_turn = False
                        reads = self.native_reads if reads_reclaim else self.lua_reads
                        batch = await reads.step(client, self.read_from)
                except Exception as error:
                    refused = classify(error) is Fault.REFUSING
                    claim_refused = claim_refused or (claiming and refused)
                    claiming = False
                    if await self._wait_out(client, error, outage, group_gone):
                        group_gone = recreate_group = True
                    continue
                if not claim_refused:
                    outage.succeeded()
                group_gone = False
                for stream, entry_id, _ in batch:
                    self.in_flight.add(stream, [entry_id])
                for stream, entry_id, fields in batch:
                    try:
                        message = await self._deliverable(
                            client, stream, entry_id, fields
                        )
                    except Exception as error:
                        if not is_outage(error):
                            raise
                        # Dead-lettering failed: left pending and unheartbeated,
                        # it is reclaimed and tried again.
                        self.in_flight.discard(stream, entry_id)
                        await outage.wait(error)
                        continue
                    if message is not None:
                        self.in_flight.mark_yielded(stream, entry_id)
                        yield message

    async def _wait_out(
        self, client: ScriptClient, error: Exception, outage: Backoff, group_gone: bool
    ) -> bool:
        """After a failed call of listen(): wait as the fault needs, raise a
        usage error. True when the consumer group is gone."""
        # The pool's idle connections most likely went with this one
        # (restart, half-open): else every call finds them one at a time.
        await drop_idle_connections(lambda: contextlib.nullcontext(client), error)
        fault = classify(error)
        if fault is Fault.GROUP_MISSING:
            if group_gone:
                # Recreating it did not help (say mkstream=False and no
                # stream): no spinning, no log flood.
                await asyncio.sleep(outage.next_delay())
            else:
                # Server restarted empty or the group was deleted.
                logger.warning(
                    "Consumer group %r is gone (%s); recreating it",
                    self.consumer_group_name,
                    error,
                )
            return True
        if not fault.is_outage:
            # Refused as a usage error: maybe by another server version
            # (XREADGROUP ... CLAIM on a server restarted on an older binary).
            try:
                changed = await self.path.server_changed(client)
            except Exception as reread_error:
                if not is_outage(reread_error):
                    raise error from reread_error
                # Gone again: wait, then read it at the next call.
                await outage.wait(reread_error)
                return False
            if not changed:
                raise error
            return False
        if fault in (Fault.UNREACHABLE, Fault.DEMOTED):
            # Reconnected, or a failover: maybe to another server version.
            self.path.choose_path_again()
        # Unreachable, demoted (a failover, REPLICAOF) or refusing for now
        # (OOM, LOADING, BUSY, ...): wait for it to pass.
        await outage.wait(error)
        return False

    def _mark_delivered(self, fetched: Any) -> None:
        for stream, entry_id, _, _ in read_entries(fetched):
            self.in_flight.add(stream, [entry_id])

    def _pipeline_over(self, client: ScriptClient) -> None:
        if self.connection.pipelines and self.in_flight.pipelined is None:
            pipelined = PipelinedCalls(self.scripts, client)
            if pipelined.available:
                self.in_flight.pipelined = pipelined

    def _begin_listening(self, broker: AsyncBroker) -> None:
        """What a new listen() (one new connection) starts from."""
        self.metrics.declare(self.groups.streams)
        self._track_starts(broker)
        self.heartbeat.start()
        self.schedule.begin()
        self.path.begin()

    def _track_starts(self, broker: AsyncBroker) -> None:
        """Learn which entry each task comes from and when it starts: wrap
        the formatter and add the middleware (once, on the worker side, after
        the app configured both)."""
        if not isinstance(broker.formatter, EntryAwareFormatter):
            broker.formatter = EntryAwareFormatter(
                broker.formatter,
                self.in_flight,
                lambda name: broker.find_task(name) is not None,
            )
        if not any(isinstance(m, StartRecorder) for m in broker.middlewares):
            broker.add_middlewares(StartRecorder(self.in_flight, self._connection))

    async def _deliverable(
        self, client: Any, stream: str, entry_id: str, fields: dict[Any, Any]
    ) -> AckableMessage | None:
        """The entry as a message; None if this consumer no longer holds it
        (handed back, or taken by another consumer), or once an entry taskiq
        cannot run (no ``data`` field: written by something else) is moved to
        dead letters."""
        delivery = self.in_flight.get(stream, entry_id)
        if delivery is None or delivery.yielded:
            # Handed back or taken by another consumer; or taken back from
            # ourselves by our own claim (a heartbeat came late) while taskiq
            # still runs it: yielding it again would run it twice.
            return None
        data = fields.get(_DATA_FIELD, fields.get(_DATA_FIELD.decode()))
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes):
            reason = f"no {_DATA_FIELD.decode()} field"
            await self.in_flight.dead_letter(client, delivery, reason)
            return None
        return AckableMessage(
            data=EntryData(data, stream, entry_id),
            ack=self._tracked_ack(stream, entry_id),
        )

    def _ack_once(self, stream: str, entry_id: str) -> Callable[[], Awaitable[None]]:
        """XACK and forget the entry's start count in one round trip; an
        entry taskiq could not parse goes to dead letters instead."""

        keys = StreamKeys(stream, self.consumer_group_name)
        ack_args: list[str | int] = [
            self.consumer_group_name,
            entry_id,
            int(self.claim_settings.delete_acked),
        ]

        async def ack() -> None:
            delivery = self.in_flight.get(stream, entry_id)
            plain = delivery is None or (
                delivery.unknown_task is None and delivery.unparsable is None
            )
            pipelined = self.in_flight.pipelined
            if plain and pipelined is not None:
                # Bounded by the pipeline's own reply deadline.
                await pipelined.call(ACK, [stream, keys.started], ack_args)
                return
            await within(REPLY_MARGIN_S, awaited_ack(delivery))

        async def awaited_ack(delivery: Delivery | None) -> None:
            async with self._connection() as client:
                if delivery is not None and delivery.unknown_task is not None:
                    await self.in_flight.decline(client, delivery)
                    return
                if delivery is not None and delivery.unparsable is not None:
                    await self.in_flight.dead_letter(
                        client, delivery, delivery.unparsable
                    )
                    return
                await self.scripts.call(client, ACK, [stream, keys.started], ack_args)

        return ack

    def _tracked_ack(self, stream: str, entry_id: str) -> Callable[[], Awaitable[None]]:
        ack = self._ack_once(stream, entry_id)

        async def ack_and_forget() -> None:
            # An outage must not fail the ack outright; if the server stays
            # away, stop heartbeating the entry either way so another worker
            # reclaims it (at least once, never stuck). Never raise then:
            # taskiq runs acks in tasks nobody awaits, so an exception is a
            # "Task exception was never retrieved" traceback per ack, and the
            # outage's one log line already said what happens.
            give_up = time.monotonic() + self._ack_patience
            try:
                while True:
                    try:
                        await ack()
                    except Exception as error:
                        if not is_outage(error):
                            raise
                        await drop_idle_connections(self._connection, error)
                        delay = self._ack_backoff.failed(error)
                        if classify(error) is Fault.MIGRATING:
                            # Nothing takes the entry meanwhile: it is still
                            # heartbeated, and a claim needs the ack's keys
                            # and more on one node. Wait the move out.
                            give_up = time.monotonic() + self._ack_patience
                        remaining = give_up - time.monotonic()
                        if remaining <= 0:
                            return
                        # Last try at the deadline: acks share one backoff,
                        # whose cap would else drop acks of short outages.
                        await asyncio.sleep(min(delay, remaining))
                    else:
                        self._ack_backoff.succeeded()
                        return
            finally:
                self.in_flight.discard(stream, entry_id)

        return ack_and_forget

    @property
    def _ack_patience(self) -> float:
        """Seconds an ack keeps retrying: well before the entry, no longer
        heartbeated, becomes claimable."""
        return min(self.claim_settings.idle_timeout / 2000, 30)
