"""The listen loop every atomic broker shares: read, reclaim, heartbeat, hand back.

A broker class mixes this in before its taskiq-redis parent and says how to
get a client (``_connection``). Everything that talks to the server goes
through the scripts in ``lua/`` or plain stream commands, so the same loop
serves a standalone server, Sentinel and Cluster. When and how it claims is
in ``claiming.py``, the heartbeat and hand-back in ``heartbeat.py``, the
stream and group checks in ``stream_setup.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from taskiq import AckableMessage, TaskiqMiddleware
from taskiq.abc.formatter import TaskiqFormatter
from taskiq.abc.result_backend import AsyncResultBackend

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.claiming import Claiming
from taskiq_atomic_claim.dead_letter_results import DeadLetterResults
from taskiq_atomic_claim.group_recovery import GroupPositions
from taskiq_atomic_claim.heartbeat import Heartbeating
from taskiq_atomic_claim.in_flight import InFlight
from taskiq_atomic_claim.kicking import Kicking
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.native_reads import NativeReads, read_entries
from taskiq_atomic_claim.pipelined import PipelinedCalls
from taskiq_atomic_claim.receiver_hooks import hook_receiver
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    raise_if_cancel_was_swallowed,
    within,
)
from taskiq_atomic_claim.server_errors import Fault, classify, is_outage
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.stream_setup import StreamSetup

logger = logging.getLogger("taskiq.atomic_claim")


class ReclaimingListener(Kicking, NativeReads, Claiming, Heartbeating, StreamSetup):
    """Mixin for a taskiq-redis stream broker; see ``AtomicRedisStreamBroker``."""

    # Provided by the taskiq-redis parent class.
    queue_name: str
    consumer_group_name: str
    consumer_name: str
    additional_streams: dict[str, str | int]
    block: int
    count: int | None
    mkstream: bool
    maxlen: int | None
    approximate: bool
    if TYPE_CHECKING:  # at run time the parent's methods must win the MRO
        formatter: TaskiqFormatter
        middlewares: list[TaskiqMiddleware]
        result_backend: AsyncResultBackend[Any]

        def add_middlewares(self, *middlewares: TaskiqMiddleware) -> None: ...
        def find_task(self, task_name: str) -> Any: ...

    claim_settings: ClaimSettings
    scripts: ScriptRunner
    # Whether starts and acks go pipelined over one connection of the
    # listen client's pool (see pipelined.py): only where that pool lives as
    # long as the broker.
    pipelines_calls = False

    def _init_reclaim(self, claim_settings: ClaimSettings) -> None:
        self.claim_settings = claim_settings
        self.claim_interval = claim_settings.claim_interval
        self.metrics = ReclaimMetrics()
        self.scripts = ScriptRunner(
            on_reload=lambda: self.metrics.add("script_reloads", "*")
        )
        # Delivered to this consumer and not yet acked: what the heartbeat
        # keeps from being reclaimed, and what shutdown hands back.
        self.in_flight = InFlight(
            self.scripts,
            self.consumer_group_name,
            self.consumer_name,
            claim_settings,
            self.metrics,
            DeadLetterResults(lambda: self.result_backend),
            stand_aside=self._stand_aside,
            connect=self._connection,
        )
        self.group_positions = GroupPositions()
        self._init_native_reads()
        self._init_kicking()
        self._heartbeat: asyncio.Task[None] | None = None
        self._claim_error: Exception | None = None
        # Per stream: when (monotonic s) this consumer claims on it next.
        self._claim_due: dict[str, float] = {}

    def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    @property
    def streams(self) -> list[str]:
        return [self.queue_name, *self.additional_streams]

    async def listen(self) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and reclaimed ones: reclaimed by the reads
        themselves on Redis >= 8.4, else by the claim script every claim
        interval."""
        self._begin_listening()
        read_from = {self.queue_name: ">", **self.additional_streams}
        # After a full claim batch, read new messages before claiming again:
        # they keep flowing while a backlog drains.
        read_turn = False
        outage = Backoff(f"consumer {self.consumer_name}")
        recreate_group = False  # before the next call
        group_gone = False  # NOGROUP since the last call that worked
        # Under OOM claims are refused while reads work: such an outage
        # lasts until a claim works again, not until the next read.
        claim_refused = claiming = False
        async with self._connection() as client:
            self._pipeline_over(client)
            while True:
                raise_if_cancel_was_swallowed()
                batch: list[tuple[str, str, dict[Any, Any]]] = []
                try:
                    self._raise_deferred_claim_error()
                    if recreate_group:
                        await self.recreate_groups(client)
                        recreate_group = False
                    reads_reclaim = await self._reads_reclaim_on(client)
                    # Where reads reclaim, no claim call runs at all.
                    due = [] if reads_reclaim else self._due_streams()
                    if due and not read_turn:
                        claiming = True
                        batch = await within(
                            REPLY_MARGIN_S * len(due), self._claim_all(client, due)
                        )
                        claiming = claim_refused = False
                        read_turn = bool(batch)
                    if not batch:
                        # The read blocks until the next claim at most.
                        read_turn = False
                        batch = await self._read_step(client, read_from, reads_reclaim)
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
        self, client: Any, error: Exception, outage: Backoff, group_gone: bool
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
                changed = await self.server_changed(client)
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
            self.choose_path_again()
        # Unreachable, demoted (a failover, REPLICAOF) or refusing for now
        # (OOM, LOADING, BUSY, ...): wait for it to pass.
        await outage.wait(error)
        return False

    def _pipeline_over(self, client: Any) -> None:
        if self.pipelines_calls and self.in_flight.pipelined is None:
            pipelined = PipelinedCalls(client)
            if pipelined.available:
                self.in_flight.pipelined = pipelined

    def _begin_listening(self) -> None:
        """What a new listen() (one new connection) starts from."""
        self._listened = True
        self.metrics.declare(self.streams)
        self._track_starts()
        self._start_heartbeat()
        self._claim_due = dict.fromkeys(self.streams, time.monotonic())
        self._chosen_on = None  # the path is logged at its first call

    def _track_starts(self) -> None:
        hook_receiver(self, self.in_flight)

    async def _read_new(
        self,
        client: Any,
        read_from: dict[str, Any],
        next_claim: float,
        *,
        claim: bool = False,
        block: bool = True,
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """New entries; with ``claim`` (Redis >= 8.4) idle pending entries
        first, taken over by the read itself. Without ``block`` it returns
        at once."""
        # Never block past the next claim: reclaim must not wait for traffic.
        until = max(1, int((next_claim - time.monotonic()) * 1000))
        block_ms = (min(self.block, until) if self.block else until) if block else None
        idle = self.claim_settings.idle_timeout
        extra = {"claim_min_idle_time": idle} if claim else {}
        fetched: Any = await client.xreadgroup(
            self.consumer_group_name,
            self.consumer_name,
            read_from,
            block=block_ms,
            count=self.count,
            **extra,
        )
        read = read_entries(fetched)
        for stream, entry_id, _, _ in read:
            self.group_positions.advance(stream, entry_id)
        if claim:
            return await self._screen_reclaimed(client, read)
        return [(stream, entry_id, fields) for stream, entry_id, fields, _ in read]

    async def _deliverable(
        self, client: Any, stream: str, entry_id: str, fields: dict[Any, Any]
    ) -> AckableMessage | None:
        return await self.in_flight.deliverable(client, stream, entry_id, fields)
