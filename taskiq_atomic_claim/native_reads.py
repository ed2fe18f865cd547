"""Reclaiming through the reads on Redis >= 8.4 (``XREADGROUP ... CLAIM``),
and the server features an atomic broker adapts to (``ReclaimingListener``
mixes this in).

Where reads reclaim, no claim script, lease or cursor key is used: the read
takes idle pending entries (longest idle first) before new ones. What the
Lua claim also did is done here: entries whose task started
``max_deliveries`` times in workers that died go to the dead letters, and a
rare sweep drops pending entries whose data was deleted (CLAIM skips them).
(The kick, which trims with ``ACKED`` on Redis >= 8.2, is in ``kicking.py``.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from taskiq_atomic_claim.dead_letter_policy import crashed_out
from taskiq_atomic_claim.in_flight import InFlight
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.metrics import ReclaimMetrics, report_trimmed
from taskiq_atomic_claim.operations import drop_trimmed_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import is_outage
from taskiq_atomic_claim.server_info import LUA_CLAIM, NATIVE_CLAIM, ServerInfo
from taskiq_atomic_claim.settings import ClaimSettings

logger = logging.getLogger("taskiq.atomic_claim")


class NativeReads:
    """Which reclaim path a consumer takes, and the native path's upkeep."""

    consumer_name: str
    consumer_group_name: str
    additional_streams: dict[str, str | int]
    maxlen: int | None
    approximate: bool
    queue_name: str
    claim_settings: ClaimSettings
    scripts: ScriptRunner
    metrics: ReclaimMetrics
    in_flight: InFlight
    # What the server can do, once read (startup, or the first read).
    server: ServerInfo | None
    # Where reads reclaim: when drop_trimmed runs next, and where in each
    # stream's PEL it goes on.
    _next_sweep: float
    _sweep_from: dict[str, str]
    # The server this listen() last took its path for; None before its
    # first call.
    _chosen_on: ServerInfo | None

    @property
    def streams(self) -> list[str]:
        raise NotImplementedError

    def _connection(self) -> Any:
        raise NotImplementedError

    if TYPE_CHECKING:  # Claiming's and ReclaimingListener's, later in the MRO

        @property
        def _next_claim(self) -> float: ...

        _read_new: Callable[..., Awaitable[list[tuple[str, str, dict[Any, Any]]]]]

    def _init_native_reads(self) -> None:
        self.server = None
        self._next_sweep = time.monotonic() + self.claim_settings.idle_timeout / 1000
        self._sweep_from = {}
        self._chosen_on = None
        # Where reads reclaim, per stream: not before this (monotonic s);
        # see ReclaimingListener._stand_aside.
        self._read_claims_from: dict[str, float] = {}

    async def learn_server(self, client: Any) -> ServerInfo:
        """What the server is and can do; INFO once until the server may
        have changed (``choose_path_again``)."""
        self.server = await self.scripts.server(client)
        return self.server

    def _reads_reclaim(self, server: ServerInfo) -> bool:
        """Whether reads reclaim (XREADGROUP ... CLAIM). The server ignores
        CLAIM for a stream read from an explicit id, so every stream must be
        read from ``>``; else the Lua claim serves them all."""
        return server.native_claim and all(
            start == ">" for start in self.additional_streams.values()
        )

    @property
    def reclaim_path(self) -> str:
        """What reclaims here: the read itself or the Lua claim script."""
        native = self.server is not None and self._reads_reclaim(self.server)
        return NATIVE_CLAIM if native else LUA_CLAIM

    @property
    def trimming_policy(self) -> str:
        """What bounds the streams here (maxlen trimming, acks deleting)."""
        server = self.server or ServerInfo("Redis", "unknown")
        policy = server.trimming_policy
        if self.claim_settings.delete_acked:
            policy += "; XACKDEL ACKED on ack"
        return policy

    async def require_scripting(self) -> None:
        """Startup: refuse, saying why, a server that runs no scripts for
        this connection; else every ack would fail."""
        async with self._connection() as client:
            self.server = await self.scripts.require_scripting(client)

    async def check_server_features(self) -> None:
        """Startup: refuse, naming the server, what it cannot do."""
        if not self.claim_settings.delete_acked:
            return
        async with self._connection() as client:
            server = await self.learn_server(client)
        server.require_acked_deletion()

    async def _read_step(
        self, client: Any, read_from: dict[str, Any], reads_reclaim: bool
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """One bounded read: until the next claim at most; where reads
        reclaim, one claim interval at most, after the rare upkeep."""
        if not reads_reclaim:
            until = self._next_claim
            return await within(
                max(0.0, until - time.monotonic()) + REPLY_MARGIN_S,
                self._read_new(client, read_from, until),
            )
        await self.sweep_if_due(client)
        now = time.monotonic()
        until = now + self.claim_settings.claim_interval / 1000
        aside = {s for s, at in self._read_claims_from.items() if at > now}
        if aside:
            # Streams standing aside are read without CLAIM; the others
            # claim first, without blocking, then everything is read new:
            # they still reclaim once per claim interval at least.
            claiming = {s: v for s, v in read_from.items() if s not in aside}
            if claiming:
                claimed = await within(
                    REPLY_MARGIN_S,
                    self._read_new(client, claiming, now, claim=True, block=False),
                )
                if claimed:
                    return claimed
        return await within(
            max(0.0, until - time.monotonic()) + REPLY_MARGIN_S,
            self._read_new(client, read_from, until, claim=not aside),
        )

    async def drop_trimmed(self, client: Any) -> None:
        """Where reads reclaim: remove from the PEL entries deleted from the
        stream while pending (CLAIM skips them, so nothing else would), and
        report them as the claim does. Each stream's PEL is walked a batch per
        call, from where the last call stopped (kept here, not in a key)."""
        for stream in self.streams:
            keys = StreamKeys(stream, self.consumer_group_name)
            next_start, trimmed = await self.scripts.run(
                client,
                drop_trimmed_call(
                    stream=stream,
                    started=keys.started,
                    group=self.consumer_group_name,
                    min_idle_ms=self.claim_settings.idle_timeout,
                    count=self.claim_settings.batch_size,
                    start=self._sweep_from.get(stream, "-"),
                    consumer=self.consumer_name,
                ),
            )
            self._sweep_from[stream] = text(next_start)
            report_trimmed(
                self.metrics, stream, [text(entry_id) for entry_id in trimmed]
            )

    async def sweep_if_due(self, client: Any) -> None:
        """At most once per idle_timeout where reads reclaim."""
        if time.monotonic() < self._next_sweep:
            return
        # Rare: trimmed pending entries only come from XDEL, XTRIM or a
        # producer trimming without ACKED.
        self._next_sweep = time.monotonic() + self.claim_settings.idle_timeout / 1000
        try:
            await self.drop_trimmed(client)
        except Exception as error:
            # Refused (e.g. OOM refuses scripts, not reads) or unreachable:
            # the reads go on, or report it themselves.
            if not is_outage(error):
                raise
            logger.debug("Sweep for trimmed entries failed: %s", error)
            self._next_sweep = time.monotonic()

    async def _reads_reclaim_on(self, client: Any) -> bool:
        """Whether this connection's reads reclaim, for the server as last
        read (INFO at the first call and after ``choose_path_again``, the
        runner's cache otherwise); logged at the first call, and again if
        the server turns out to have changed."""
        chosen_on = self._chosen_on
        server = self._chosen_on = await self.learn_server(client)
        if chosen_on is None:
            logger.info(
                "Consumer %s on %s reclaims via %s",
                self.consumer_name,
                server.name,
                self.reclaim_path,
            )
        elif chosen_on.name != server.name:
            logger.warning(
                "Consumer %s: the server changed from %s to %s; it reclaims via %s now",
                self.consumer_name,
                chosen_on.name,
                server.name,
                self.reclaim_path,
            )
        return self._reads_reclaim(server)

    def choose_path_again(self) -> None:
        """Before the next call: read the server again and choose the path
        for it. After a reconnect, or a command refused as a usage error,
        the server behind the URL may be another (a restart on an older
        binary, a failover to another replica)."""
        self.scripts.forget_server()

    async def server_changed(self, client: Any) -> bool:
        """After a usage error: whether the server is another than the one
        the path was chosen for (then the next call takes the new path)."""
        chosen_on = self._chosen_on
        self.choose_path_again()
        await self._reads_reclaim_on(client)
        now = self._chosen_on
        return chosen_on is not None and now is not None and now.name != chosen_on.name

    async def _screen_reclaimed(
        self, client: Any, read: list[tuple[str, str, dict[Any, Any], bool]]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """What a claiming read returned, minus the reclaimed entries whose
        task started max_deliveries times in workers that died (moved to
        dead letters, as the Lua claim does): one HMGET per stream that had
        reclaimed entries."""
        reclaimed: dict[str, list[str]] = {}
        for stream, entry_id, _, maybe_reclaimed in read:
            if maybe_reclaimed:
                reclaimed.setdefault(stream, []).append(entry_id)
        poisoned: set[tuple[str, str]] = set()
        max_deliveries = self.claim_settings.max_deliveries
        for stream, ids in reclaimed.items():
            self.metrics.add("claimed", stream, len(ids))
            logger.debug("Reclaimed %d idle entries from stream %r", len(ids), stream)
            if not max_deliveries:
                continue
            keys = StreamKeys(stream, self.consumer_group_name)
            counts = await client.execute_command("HMGET", keys.started, *ids)
            crashed_out_ids: list[tuple[str, int]] = []
            for entry_id, count in zip(ids, counts, strict=True):
                crashes = int(count or 0)
                if not crashed_out(crashes, max_deliveries):
                    # Held from here with its crashes (see suspects.py).
                    self.in_flight.add(stream, [entry_id], crashes)
                    continue
                crashed_out_ids.append((entry_id, crashes))
                poisoned.add((stream, entry_id))
            await self.in_flight.dead_lettering.move_crashed_out(
                client, keys, crashed_out_ids
            )
        return [
            (stream, entry_id, fields)
            for stream, entry_id, fields, _ in read
            if (stream, entry_id) not in poisoned
        ]


def read_entries(fetched: Any) -> list[tuple[str, str, dict[Any, Any], bool]]:
    """An XREADGROUP reply as (stream, id, fields, maybe reclaimed), whatever
    its shape: RESP2 pairs or a RESP3 map (which redis-py wraps in one more
    list), entries of (id, fields) or, read with CLAIM, (id, fields, idle ms,
    delivery count), where new entries carry 0, 0. An entry without those
    two (a redis-py that drops them) counts as maybe reclaimed."""
    pairs = fetched.items() if isinstance(fetched, dict) else fetched or []
    read = []
    for stream, listed in pairs:
        entries = listed
        if listed and isinstance(listed[0], list) and _is_entry_list(listed[0]):
            entries = listed[0]
        for entry in entries:
            fields = entry[1] if len(entry) > 1 else None
            if not isinstance(fields, dict):
                flat = list(fields or [])
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
            reclaimed = len(entry) < 4 or int(entry[2]) > 0 or int(entry[3]) > 0
            read.append((text(stream), text(entry[0]), fields, reclaimed))
    return read


def _is_entry_list(value: list[Any]) -> bool:
    """A list of entries (each a list or tuple), not one entry (id first)."""
    return not value or isinstance(value[0], list | tuple)
