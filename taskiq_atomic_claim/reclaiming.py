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
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from taskiq import AckableMessage, AsyncBroker

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.claim_schedule import ClaimSchedule, ScriptClaims
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle
from taskiq_atomic_claim.heartbeat import Heartbeat
from taskiq_atomic_claim.metrics import ReclaimMetrics
from taskiq_atomic_claim.native_reads import NativePathReads
from taskiq_atomic_claim.reads import LuaPathReads
from taskiq_atomic_claim.receiver_hooks import hook_receiver
from taskiq_atomic_claim.reclaim_path import PathChoice
from taskiq_atomic_claim.replies import read_entries
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    raise_if_cancel_was_swallowed,
    within,
)
from taskiq_atomic_claim.server_errors import (
    Fault,
    classify,
    is_outage,
    permission_refused,
    reply_text,
    stream_vanished,
    waited_out_while_running,
)
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.stream_setup import ConsumerGroups

logger = logging.getLogger("taskiq.atomic_claim")

ClaimedEntry = tuple[str, str, dict[Any, Any]]
Entry = TypeVar("Entry", bound=tuple[Any, ...])


class Listener:
    """One consumer's listen loop and the acks of what it delivered."""

    def __init__(
        self,
        *,
        connection: Connection,
        scripts: ScriptRunner,
        settings: ClaimSettings,
        metrics: ReclaimMetrics,
        in_flight: EntryLifecycle,
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
        # One outage log for the consumer: from a startup that found the
        # server unreachable to the listen loop's calls.
        self.outage = Backoff(f"consumer {consumer}")
        # A call of listen() worked: a permission refused from now on was
        # revoked under it (waited out), not missing from the start.
        self.worked = False
        # Startup steps an outage deferred (groups, checks), run in order
        # before the first read.
        self.deferred_startup: list[Callable[[], Awaitable[None]]] = []
        # An outage since the last call that worked: claims wait
        # (ClaimSchedule.hold_off_after_outage).
        self._recovering = False

    def defer_startup(
        self, error: BaseException, step: Callable[[], Awaitable[None]]
    ) -> None:
        """The server could not be reached at startup: ``step`` runs in
        listen() once it can (one line now, one when it answers)."""
        self.outage.failed(error)
        self.deferred_startup.append(step)

    async def _finish_startup(self) -> None:
        """The startup steps an outage deferred, in order."""
        while self.deferred_startup:
            await self.connection.named_login_refusal(self.deferred_startup[0]())
            del self.deferred_startup[0]

    async def listen(self, broker: AsyncBroker) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and reclaimed ones: reclaimed by the reads
        themselves on Redis >= 8.4, else by the claim script every claim
        interval. ``broker`` is the app's broker, whose formatter and
        middlewares learn which entry each task comes from."""
        self._begin_listening(broker)
        # After a full claim batch, read new messages before claiming again:
        # they keep flowing while a backlog drains.
        read_turn = False
        recreate_group = False  # before the next call
        group_gone = False  # NOGROUP since the last call that worked
        # Under OOM claims are refused while reads work: such an outage
        # lasts until a claim works again, not until the next read.
        claim_refused = claiming = False
        async with self.connection.listen_client(
            self._mark_delivered, self.in_flight.finished
        ) as client:
            while True:
                raise_if_cancel_was_swallowed()
                batch: list[tuple[str, str, dict[Any, Any]]] = []
                try:
                    await self._finish_startup()
                    self.claims.raise_deferred_error()
                    if recreate_group:
                        await self.groups.recreate(client)
                        recreate_group = False
                    reads_reclaim = await self.path.reads_reclaim_on(client)
                    # Where reads reclaim, no claim call runs at all.
                    due = [] if reads_reclaim else self.schedule.due_streams()
                    if due and not read_turn:
                        claiming = True
                        claimed, batch = await self.claim(client, due)
                        claiming = claim_refused = False
                        read_turn = bool(claimed)
                    if not batch:
                        # The read blocks until the next claim at most.
                        read_turn = False
                        reads = self.native_reads if reads_reclaim else self.lua_reads
                        _, batch = await self.held(reads.step(client, self.read_from))
                except Exception as error:
                    # Refused for now (OOM) or by the ACL (-fcall): claims.
                    refused = classify(error) in (Fault.REFUSING, Fault.FORBIDDEN)
                    claim_refused = claim_refused or (claiming and refused)
                    claiming = False
                    if await self._wait_out(client, error, self.outage, group_gone):
                        group_gone = recreate_group = True
                    continue
                self._worked(claim_refused)
                group_gone = False
                for stream, entry_id, fields in batch:
                    message = self.in_flight.deliverable(stream, entry_id, fields)
                    if message is not None:
                        yield message
                        continue
                    try:
                        await self.in_flight.settle_undeliverable(
                            client, stream, entry_id
                        )
                    except Exception as error:
                        if not waited_out_while_running(error):
                            raise
                        # Dead-lettering failed: left pending and unheartbeated,
                        # it is reclaimed and tried again.
                        self.in_flight.discard(stream, entry_id)
                        await self.outage.wait(error)

    async def claim(
        self, client: ScriptClient, due: list[str]
    ) -> tuple[list[ClaimedEntry], list[ClaimedEntry]]:
        """The Lua path's claim of ``due`` streams, as ``held`` gives it."""
        return await self.held(
            within(REPLY_MARGIN_S * len(due), self.claims.claim_all(client, due))
        )

    async def held(
        self, fetch: Awaitable[list[Entry]]
    ) -> tuple[list[Entry], list[Entry]]:
        """What a read or a claim returned, and that minus what this
        consumer finished while it was in flight (see ``FinishedEntries``:
        an ack's reply may come first), now held. In flight until held: the
        steps between (the native path's start counts) take turns of the
        loop in which an ack may end."""
        finished = self.in_flight.finished
        number = finished.read_sent()
        try:
            got = await fetch
            kept = finished.screened(number, got)
            kept_ids = {(entry[0], entry[1]) for entry in kept}
            for entry in got:
                if (entry[0], entry[1]) in kept_ids:
                    self.in_flight.add(entry[0], [entry[1]])
                else:
                    # Held by the step itself (a claim), no longer.
                    self.in_flight.discard(entry[0], entry[1])
        finally:
            finished.read_done(number)
        return got, kept

    async def _wait_out(
        self, client: ScriptClient, error: Exception, outage: Backoff, group_gone: bool
    ) -> bool:
        """After a failed call of listen(): wait as the fault needs, raise a
        usage error. True when the consumer group is gone."""
        # The pool's idle connections most likely went with this one
        # (restart, half-open): else every call finds them one at a time.
        await drop_idle_connections(lambda: contextlib.nullcontext(client), error)
        fault = classify(error)
        if fault.passing:
            self.schedule.hold_off_after_outage()
            self._recovering = True
        if fault is Fault.GROUP_MISSING:
            await self._group_missing(error, outage, group_gone)
            return True
        if fault in (Fault.FORBIDDEN, Fault.LOGIN_REFUSED):
            named = self.connection.named(error)
            if not self.worked:
                # Missing from the start: the user's ACL or the URL's
                # password needs fixing.
                if fault is Fault.LOGIN_REFUSED:
                    raise named from None
                raise permission_refused(
                    error, f"consumer {self.consumer_name!r}"
                ) from error
            # Revoked under a running worker (an operator changing the ACL
            # or the password, met on reconnect): wait for it to come back
            # (or the app redeployed), as for an outage.
            await outage.wait(named)
            return False
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

    async def _group_missing(
        self, error: Exception, outage: Backoff, group_gone: bool
    ) -> None:
        """NOGROUP (or a read's stream gone): say so once; the caller
        re-creates the group before the next call."""
        if group_gone:
            # Recreating it did not help (say mkstream=False and no
            # stream): no spinning, no log flood.
            await asyncio.sleep(outage.next_delay())
        elif stream_vanished(error):
            # A read blocked on a stream that left this node: deleted, or
            # moved by a Cluster reshard (MIGRATE deletes it here). The
            # group is re-created only where it is really gone.
            logger.info(
                "Consumer %r: a stream it read left the server (deleted, or"
                " moved by a reshard); reading again, the group re-created if"
                " gone",
                self.consumer_name,
            )
        else:
            # Server restarted empty or the group was deleted.
            logger.warning(
                "Consumer group %r is gone (%s); recreating it",
                self.consumer_group_name,
                reply_text(error),
            )

    def _worked(self, claim_refused: bool) -> None:
        """A call of listen() worked; under OOM (claims refused, reads
        working) the outage lasts until a claim works again."""
        self.worked = True
        if not claim_refused:
            self.outage.succeeded()
        if self._recovering:
            # From the end of the outage: live workers beat first.
            self.schedule.hold_off_after_outage()
            self._recovering = False

    def _mark_delivered(self, fetched: Any) -> None:
        for stream, entry_id, _, _ in read_entries(fetched):
            self.in_flight.add(stream, [entry_id])

    def _begin_listening(self, broker: AsyncBroker) -> None:
        """What a new listen() (one new connection) starts from."""
        self.metrics.declare(self.groups.streams)
        # Learn from taskiq's receiver when each entry's task starts.
        hook_receiver(broker, self.in_flight)
        self.heartbeat.start()
        self.schedule.begin()
        self.path.begin()
