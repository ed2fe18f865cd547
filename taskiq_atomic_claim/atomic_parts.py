"""What every atomic broker is built from, assembled once: the one
constructor body, startup and shutdown the three brokers share.

Each collaborator has one job and is handed what it needs: the claim
schedule and the Lua path's claims, a reader per path, the path choice, the
consumer groups, the startup checks, the heartbeat, the kicker and the
listen loop. What differs between a standalone server, Sentinel and Cluster
is one value, the broker's ``Connection``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from redis.exceptions import RedisClusterException
from taskiq import AckableMessage, AsyncBroker, BrokerMessage
from taskiq.abc.result_backend import AsyncResultBackend

from taskiq_atomic_claim import claim_gate
from taskiq_atomic_claim.claim_gate import FleetCheck
from taskiq_atomic_claim.claim_schedule import ClaimSchedule, ScriptClaims
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.dead_letter_results import DeadLetterResults
from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle
from taskiq_atomic_claim.group_recovery import GroupPositions
from taskiq_atomic_claim.heartbeat import Heartbeat
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.kicking import Kicker
from taskiq_atomic_claim.liveness import LivenessThread
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.reads import GroupReads
from taskiq_atomic_claim.reclaim_path import PathChoice
from taskiq_atomic_claim.reclaiming import Listener
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import is_outage
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.startup_checks import StartupChecks
from taskiq_atomic_claim.stream_setup import ConsumerGroups
from taskiq_atomic_claim.stream_trim import (
    StreamTrim,
    TrimmedLuaReads,
    TrimmedNativeReads,
)


class ParentFields(Protocol):
    """What the taskiq-redis parent's constructor set on the broker, in its
    names: read once, when the parts are built."""

    @property
    def queue_name(self) -> str: ...
    @property
    def additional_streams(self) -> Mapping[str, str | int]: ...
    @property
    def consumer_group_name(self) -> str: ...
    @property
    def consumer_name(self) -> str: ...
    @property
    def consumer_id(self) -> str: ...
    @property
    def mkstream(self) -> bool: ...
    @property
    def block(self) -> int: ...
    @property
    def maxlen(self) -> int | None: ...
    @property
    def approximate(self) -> bool: ...
    @property
    def result_backend(self) -> AsyncResultBackend[Any]: ...


class AtomicParts:
    """The collaborators of one atomic broker."""

    def __init__(
        self,
        broker: ParentFields,
        settings: ClaimSettings,
        connection: Connection,
        read_count: int | None,
    ) -> None:
        """The one constructor body of the three brokers, after the
        parent's: ``read_count`` is ``xread_count`` (the Cluster and
        Sentinel parents keep none)."""
        queue_name = broker.queue_name
        additional_streams = dict(broker.additional_streams)
        group = broker.consumer_group_name
        consumer = broker.consumer_name
        self.settings = settings
        self.streams = [queue_name, *additional_streams]
        self.metrics = ReclaimMetrics()
        self.scripts = ScriptRunner(
            on_reload=functools.partial(self.metrics.add, "script_reloads", "*")
        )
        self.schedule = ClaimSchedule(self.streams, settings)
        # Delivered to this consumer and not yet acked: what the heartbeat
        # keeps from being reclaimed, and what shutdown hands back. The
        # result backend is looked up when a dead letter is written: the app
        # may set it after building the broker.
        self.in_flight = EntryLifecycle(
            self.scripts,
            group,
            consumer,
            settings,
            self.metrics,
            DeadLetterResults(lambda: broker.result_backend),
            stand_aside=self.schedule.stand_aside,
            connect=connection.connect,
            per_slot=connection.per_slot,
            named=connection.named,
            # A read blocks this long at most (see GroupReads.read).
            longest_read_s=(
                min(broker.block, settings.claim_interval)
                if broker.block
                else settings.claim_interval
            )
            / 1000,
        )
        # Each read step is followed by the trim of the streams due (on
        # either path: where reads reclaim no claim script runs).
        self.trim = StreamTrim(
            self.scripts, self.streams, self.in_flight, settings.keep_acked
        )
        self.connection = connection
        before_call = self.connection.before_call
        positions = GroupPositions()
        self.path = PathChoice(
            self.scripts, consumer, additional_streams, settings.delete_acked
        )
        # One consumer of the fleet reading these streams looks for idle
        # entries each claim interval: one gate for all of them on a
        # server, one per hash slot on Cluster.
        gates = (
            claim_gate.per_slot(
                self.streams,
                group,
                consumer,
                settings.idle_timeout,
                settings.claim_interval,
                broker.block,
            )
            if connection.per_slot
            else dict.fromkeys(
                self.streams,
                FleetCheck(
                    StreamKeys(queue_name, group).claim_gate(self.streams),
                    consumer,
                    group,
                    settings.idle_timeout,
                    settings.claim_interval,
                    broker.block,
                ),
            )
        )
        self.claims = ScriptClaims(
            self.scripts,
            self.schedule,
            self.in_flight,
            self.metrics,
            group,
            consumer,
            read_count,
            gates,
            per_slot=self.connection.per_slot,
            before_call=before_call,
        )
        self.reads = GroupReads(
            group,
            consumer,
            broker.block,
            read_count,
            settings.idle_timeout,
            positions,
            before_call=before_call,
        )
        self.groups = ConsumerGroups(
            self.streams,
            group,
            broker.consumer_id,
            broker.mkstream,
            positions,
            self.scripts,
        )
        self.checks = StartupChecks(
            self.connection,
            self.scripts,
            self.path,
            self.streams,
            group,
            positions,
            settings.delete_acked,
        )
        self.heartbeat = Heartbeat(
            self.in_flight,
            self.scripts,
            self.connection.connect,
            settings,
            self.streams,
            group,
            consumer,
            LivenessThread(self.in_flight, self.connection, settings.idle_timeout),
        )
        self.kicker = Kicker(
            self.scripts,
            self.connection.connect,
            queue_name,
            broker.maxlen,
            broker.approximate,
            settings,
        )
        # Set by ``declare_groups``, the first startup step.
        self.waits_out_startup = self.connection.waits_out_startup
        self.listener = Listener(
            connection=self.connection,
            scripts=self.scripts,
            settings=settings,
            metrics=self.metrics,
            in_flight=self.in_flight,
            schedule=self.schedule,
            claims=self.claims,
            lua_reads=TrimmedLuaReads(self.reads, self.schedule, self.trim),
            native_reads=TrimmedNativeReads(
                self.reads,
                self.schedule,
                self.scripts,
                self.in_flight,
                self.metrics,
                self.trim,
                gates,
                per_slot=self.connection.per_slot,
            ),
            path=self.path,
            groups=self.groups,
            heartbeat=self.heartbeat,
            read_from={queue_name: ">", **additional_streams},
            group=group,
            consumer=consumer,
        )

    def listen(self, broker: AsyncBroker) -> AsyncGenerator[AckableMessage, None]:
        return self.listener.listen(broker)

    async def declare_groups(self, worker: bool) -> None:
        """Startup (the parent's ``_declare_consumer_group``): create the
        groups where missing, never after accepted tasks no worker has seen.
        A ``worker`` (and any Sentinel or Cluster broker) whose server
        cannot be reached does not fail: its listen loop waits the outage
        out, then creates the groups and runs the checks (``startup``)."""
        self.waits_out_startup = worker or self.connection.waits_out_startup
        await self._start_up_step(self._declare_groups)

    async def _declare_groups(self) -> None:
        async with self.connection.setup_client() as client:
            await self.groups.declare(client)

    async def startup(self, parent_startup: Callable[[], Awaitable[None]]) -> None:
        """The parent's startup (it declares the groups), then the checks;
        deferred to the listen loop while the server cannot be reached."""
        await parent_startup()
        await self._start_up_step(self.checks.run)

    async def _start_up_step(self, step: Callable[[], Awaitable[None]]) -> None:
        if self.listener.deferred_startup:
            # The server was unreachable already: one line said so.
            self.listener.deferred_startup.append(step)
            return
        try:
            await self.connection.named_login_refusal(step())
        except Exception as error:
            # Unreachable, or a Cluster slot migrating ("TTL exhausted").
            outage = is_outage(error) or isinstance(error, RedisClusterException)
            if not (self.waits_out_startup and outage):
                raise
            self.listener.defer_startup(error, step)

    async def shutdown(self, parent_shutdown: Callable[[], Awaitable[None]]) -> None:
        """Hand back what no task runs; after the app's shutdown handlers
        (tasks run on through them), give back the rest and leave the group
        (``Heartbeat.finish_shutdown``);
        then close what those calls reopened after the parent closed it."""
        try:
            try:
                await self.heartbeat.hand_back()
            finally:
                await parent_shutdown()
        finally:
            # Even after a hand-back refused (say by the ACL): the liveness
            # thread must not outlive the broker.
            try:
                await self.heartbeat.finish_shutdown()
            finally:
                await self.connection.close()


class AtomicBroker(AsyncBroker):
    """taskiq's broker interface answered by the broker's ``AtomicParts``.

    First among each atomic broker's bases, before its taskiq-redis parent:
    these methods win, and the parent's own startup and shutdown run inside
    ours (``super()`` is that parent)."""

    atomic: AtomicParts

    @property
    def metrics(self) -> ReclaimMetrics:
        """What this broker counted (``metrics.snapshot()``)."""
        return self.atomic.metrics

    async def _declare_consumer_group(self) -> None:
        await self.atomic.declare_groups(self.is_worker_process)

    async def startup(self) -> None:
        await self.atomic.startup(super().startup)

    async def shutdown(self) -> None:
        await self.atomic.shutdown(super().shutdown)

    async def kick(self, message: BrokerMessage) -> None:
        await self.atomic.kicker.kick(message)

    def listen(self) -> AsyncGenerator[AckableMessage, None]:
        return self.atomic.listen(self)
