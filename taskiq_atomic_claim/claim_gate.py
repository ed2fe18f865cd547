"""Which consumer of a fleet looks for idle entries each claim interval, and
where it finds them (``FleetCheck``).

Without it every consumer looks every claim interval, so an idle fleet's
claim work grows with its workers. One expiring key per (group, streams),
``SET NX PX claim_interval``, lets one consumer through per interval; the
others try again one to two intervals later (``retry_after_s``), so
when the one that got through dies another does within two intervals (a
SIGKILLed worker's task runs again within idle_timeout + 2 claim
intervals). The one that gets through looks with ``XPENDING ...
IDLE``, a plain read that changes no owner, and only the streams where it
finds an entry idle for idle_timeout go to the claim, which checks
everything again in its own step. Where reads reclaim (Redis >= 8.4) the
one that gets through reads with ``CLAIM`` and the others read new entries
only. A claim that comes back full opens the gate: a backlog is drained by
every consumer that tries next, not by one.

On Cluster there is a gate per hash slot, its key in that slot
(``per_slot``): a primary down stops only its own streams' looks, as it
stops their claims.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Any

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.cluster_client import slot_groups
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_errors import Fault, classify

logger = logging.getLogger("taskiq.atomic_claim")

# Refused by the ACL, the gate is tried again this many intervals later.
REFUSED_RETRY = 10


class FleetCheck:
    """One consumer's side of its fleet's claim gate."""

    def __init__(
        self,
        key: str,
        consumer: str,
        group: str,
        idle_timeout_ms: int,
        interval_ms: int,
        read_block_ms: int,
        *,
        one_slot: bool = False,
    ) -> None:
        self.key = key
        # A gate of one Cluster slot's streams (see ``per_slot``).
        self.one_slot = one_slot
        self.read_block_ms = read_block_ms
        self.consumer = consumer
        self.group = group
        self.idle_timeout_ms = idle_timeout_ms
        self.interval_ms = interval_ms
        # An ACL from before the gate refuses its key: the consumer looks
        # each interval, as without a gate, and tries the gate again every
        # REFUSED_RETRY intervals (an operator re-running `acl` restarts
        # nothing).
        self._refused_until: float | None = None

    async def enter(self, client: ScriptClient) -> bool:
        """Whether this consumer looks this interval."""
        refused_until = self._refused_until
        if refused_until is not None and time.monotonic() < refused_until:
            return True
        try:
            # The holder comes back as its key lapses, sometimes a moment
            # before: finding itself still named, it goes on looking (else
            # the gate would pass from worker to worker each interval).
            got, holder = await self._try(client)
        except Exception as error:
            fault = classify(error)
            if fault.is_outage:
                # Look as without a gate: the claim meets the outage. One
                # slot's primary down: its streams wait their next try, as
                # each call to it stalls the loop while redis-py's cluster
                # client retries it.
                return not self.one_slot
            if fault is not Fault.FORBIDDEN:
                raise
            if refused_until is None:
                logger.warning(
                    "Consumer %r cannot use the fleet's claim gate (%s): it"
                    " looks for idle entries every claim interval; re-run"
                    " `taskiq-atomic-claim acl` for the new key",
                    self.consumer,
                    error,
                )
            retry_s = REFUSED_RETRY * self.interval_ms / 1000
            self._refused_until = time.monotonic() + retry_s
            return True
        if refused_until is not None:
            logger.warning(
                "Consumer %r uses the fleet's claim gate again", self.consumer
            )
            self._refused_until = None
        return bool(got) or (holder is not None and text(holder) == self.consumer)

    async def _try(self, client: Any) -> tuple[Any, Any]:
        """SET NX, and who holds the gate. One round trip on a server; on
        Cluster two calls, each to the slot's primary alone (see
        ``cluster_client``: a pipeline there retries a dead primary for
        seconds)."""
        set_nx = ("SET", self.key, self.consumer, "NX", "PX", self.interval_ms)
        if self.one_slot:
            got = await client.execute_command(*set_nx)
            return got, None if got else await client.execute_command("GET", self.key)
        async with client.pipeline(transaction=False) as pipe:
            pipe.execute_command(*set_nx)
            pipe.get(self.key)
            got, holder = await pipe.execute()
        return got, holder

    @staticmethod
    async def _look(client: Any, look: tuple[Any, ...]) -> Any:
        """One look on its own; refused, the refusal (as a pipeline's)."""
        try:
            return await client.execute_command(*look, parse_detail=True)
        except Exception as error:
            if classify(error).is_outage:
                raise
            return error

    async def open(self, client: ScriptClient) -> None:
        """A claim came back full (a backlog): let the next consumer that
        tries in, so every consumer with room joins the drain within two
        intervals. Best effort: if the DEL fails, the gate lapses by itself
        within an interval."""
        with contextlib.suppress(Exception):
            await client.execute_command("DEL", self.key)

    def retry_after_s(self) -> float:
        """When a consumer kept out tries again: one to two intervals on; at
        its next blocking read's end when that comes within them (the reads
        of a fleet kept out then wake as often as taskiq-redis's do). Never
        later: a looker that stops looking while alive (a graceful stop
        that handed its entries back, a worker with no room) is replaced
        within two intervals."""
        interval = self.interval_ms / 1000
        if interval <= self.read_block_ms / 1000 <= 2 * interval:
            return self.read_block_ms / 1000
        return interval * (1 + random.random())  # noqa: S311

    async def idle_streams(self, client: Any, streams: list[str]) -> list[str]:
        """``streams`` with an entry pending for idle_timeout or longer, or
        whose check the server refused (the claim then reports why)."""
        looks = [
            ("XPENDING", stream, self.group, "IDLE", self.idle_timeout_ms, "-", "+", 1)
            for stream in streams
        ]
        try:
            if self.one_slot:
                replies = [await self._look(client, look) for look in looks]
            else:
                async with client.pipeline(transaction=False) as pipe:
                    for look in looks:
                        pipe.execute_command(*look, parse_detail=True)
                    replies = await pipe.execute(raise_on_error=False)
        except Exception as error:
            if not classify(error).is_outage:
                raise
            return streams  # the claim meets the outage stream by stream
        return [
            stream
            for stream, reply in zip(streams, replies, strict=True)
            if reply or isinstance(reply, Exception)
        ]


def by_gate(
    gates: dict[str, FleetCheck], streams: list[str]
) -> dict[FleetCheck, list[str]]:
    """``streams`` grouped by the gate each is behind."""
    grouped: dict[FleetCheck, list[str]] = {}
    for stream in streams:
        grouped.setdefault(gates[stream], []).append(stream)
    return grouped


def per_slot(
    streams: list[str],
    group: str,
    consumer: str,
    idle_timeout_ms: int,
    interval_ms: int,
    read_block_ms: int,
) -> dict[str, FleetCheck]:
    """Cluster: each stream's gate, one per hash slot, its key in that slot
    (named by the slot's first stream in name order, as every consumer of
    the fleet names it)."""
    gates: dict[str, FleetCheck] = {}
    for in_slot in slot_groups(dict.fromkeys(streams, ">")):
        key = StreamKeys(min(in_slot), group).claim_gate(streams)
        gate = FleetCheck(
            key,
            consumer,
            group,
            idle_timeout_ms,
            interval_ms,
            read_block_ms,
            one_slot=True,
        )
        gates.update(dict.fromkeys(in_slot, gate))
    return gates
