"""``SlotRoutedClient``: what the listen loop and ``ScriptRunner`` talk to on
a Redis Cluster, in front of redis-py's ``RedisCluster``.

redis-py already routes most of what the loop sends: keyed commands, EVALSHA
(it reads the key count itself), and FUNCTION LOAD, SCRIPT LOAD and SCRIPT
EXISTS to every primary (``ScriptRunner`` names each in one string, which is
how redis-py finds their routing). This client handles only what it does not
route right (redis-py 7.2 to 8.1 alike):

- INFO goes to one node; here it goes to every primary and the oldest server
  decides, so one older node puts the whole broker on cached scripts;
- FUNCTION LIST goes to one node (or, named in one string, returns a reply per
  node whose shape depends on how many primaries there are); here it is asked
  of every primary and answers the libraries every primary has;
- FCALL and XREADGROUP have "movable" keys, which redis-py resolves with
  COMMAND GETKEYS on one fixed node: once that node dies, every such call
  fails until some other command happens to refresh the topology. They are
  sent here to the primary of their first key's slot instead;
- XREADGROUP over streams in different slots is CROSSSLOT (taskiq-redis's
  broker sends it anyway): streams are read per slot, concurrently, and a
  slot whose primary is unreachable rests while the others are read.

- an ASK redirection (a slot migrating, the key already moved): redis-py's
  asyncio client sends ASKING on one pooled connection and the command on
  another, which the target answers with MOVED back, until "TTL exhausted".
  Script calls and reads it gave up on are sent once more here, following
  the ASK on one connection.

A topology change shows up as CLUSTERDOWN, TRYAGAIN, an uncovered slot or a
node that cannot be reached; ``server_errors.classify`` calls those an
outage, so the loop waits them out instead of stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterError,
    MovedError,
    RedisClusterException,
    ResponseError,
)

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.finished import FinishedEntries
from taskiq_atomic_claim.replies import read_entries, text
from taskiq_atomic_claim.scripts import _library_name
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import is_outage
from taskiq_atomic_claim.server_info import ServerInfo

# (stream, [(entry id, fields), ...]) as XREADGROUP replies under RESP2.
StreamEntries = list[tuple[Any, Any]]

# Script calls, sent to the primary of their first key's slot: FCALL's keys
# are "movable" (see the module docstring), and all of them may need an ASK
# followed here.
_SCRIPT_CALLS = frozenset({"FCALL", "FCALL_RO", "EVALSHA", "EVAL"})
# Sent to their key's primary as the only target: redis-py's cluster client
# resends a command it routed itself after a lost connection, and a resent
# XADD on a server without IDMP is a second entry (kicking.py retries).
_KICK_COMMANDS = frozenset({"XADD"})
# Single-key calls sent to their key's primary as the only target, which
# redis-py does not retry, so a primary that is down costs one refused
# connection, not seconds of the loop: the fleet's gate and look
# (claim_gate.py), and with them the liveness thread's alive key and a
# traced redelivery's XPENDING.
_GATE_COMMANDS = frozenset({"SET", "GET", "XPENDING"})


def slot_groups(streams: dict[str, str | int]) -> list[dict[str, str | int]]:
    """``streams`` split by hash slot, in order: one XREADGROUP per group."""
    groups: dict[int, dict[str, str | int]] = {}
    for stream, start in streams.items():
        groups.setdefault(key_slot(stream.encode()), {})[stream] = start
    return list(groups.values())


def _as_pairs(reply: Any) -> StreamEntries:
    # RESP3 replies map stream -> entries; the loop expects RESP2's pairs.
    if isinstance(reply, dict):
        return list(reply.items())
    return list(reply or [])


def _age(info: Any) -> tuple[int, int, int]:
    """An INFO reply's real version (Valkey's, not its redis_version);
    unknown sorts oldest, so it gets what every server runs."""
    return ServerInfo.from_info(info).version_tuple or (0, 0, 0)


def _libraries_everywhere(replies: list[Any]) -> list[Any]:
    """FUNCTION LIST replies of every primary: the libraries all of them have."""
    present = [{_library_name(entry) for entry in reply} for reply in replies]
    everywhere = set.intersection(*present)
    return [entry for entry in replies[0] if _library_name(entry) in everywhere]


class SlotRoutedClient:
    """What the listen loop and ``ScriptRunner`` talk to on a cluster.

    ``execute_command`` is ``RedisCluster.execute_command`` with the routing
    described in the module docstring; ``xreadgroup`` reads streams in
    several slots with one outstanding XREADGROUP per slot.

    An outstanding read is kept, never cancelled, across calls: a read the
    server served but whose reply was thrown away would leave its entries
    pending, unseen, until idle_timeout. ``on_delivered`` hears of every read
    as it completes, so entries that arrive while the consumer is not
    pulling are known (and heartbeated) at once.

    A slot whose primary cannot be reached rests, with its own capped
    backoff, while the other slots are still read: one failed primary out
    of several must not stop the streams on the others. Only when every
    slot fails does the error reach the loop, which then waits it out.
    """

    def __init__(
        self,
        cluster: RedisCluster,
        on_delivered: Callable[[StreamEntries], None] | None = None,
        finished: FinishedEntries | None = None,
    ) -> None:
        self.cluster = cluster
        self._on_delivered = on_delivered
        # Screened out of each read as it completes (reads outlive calls,
        # and on_delivered holds their entries at once).
        self.finished = FinishedEntries() if finished is None else finished
        self._reads: dict[tuple[str, ...], asyncio.Task[StreamEntries]] = {}
        # A failed read whose siblings brought entries: raised next call,
        # after those entries have been handed over.
        self._deferred: BaseException | None = None
        # Per slot group that failed to be read: the error, the backoff, and
        # when to try again.
        self._failing: dict[tuple[str, ...], BaseException] = {}
        self._backoff: dict[tuple[str, ...], Backoff] = {}
        self._resting_until: dict[tuple[str, ...], float] = {}

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        command = text(args[0]).upper()
        if command == "INFO":
            # The oldest server decides which features may be used.
            infos = await self._on_every_primary(args, options)
            return min(infos, key=_age)
        if command == "FUNCTION" and text(args[1]).upper() == "LIST":
            return _libraries_everywhere(await self._on_every_primary(args, options))
        if command in _SCRIPT_CALLS and len(args) > 3 and int(args[2]) > 0:
            return await self._on_slot(text(args[3]), args, options)
        if command in _GATE_COMMANDS:
            return await self._on_slot(text(args[1]), args, options)
        if command in _KICK_COMMANDS:
            return await self._kick(text(args[1]), args, options)
        return await self.cluster.execute_command(*args, **options)

    async def _on_slot(self, key: str, args: Any, options: dict[str, Any]) -> Any:
        """``args`` on the primary serving ``key``'s slot; if redis-py gave
        up on redirections, once more following an ASK on one connection."""
        node = await self.primary_for(key)
        try:
            return await self.cluster.execute_command(
                *args, target_nodes=node, **options
            )
        except ClusterError as error:
            if isinstance(error, ResponseError):  # CLUSTERDOWN
                raise
            # "TTL exhausted.": never run, so it is safe to send again.
            return await self._following_ask(key, args, options, error)

    async def _kick(self, key: str, args: Any, options: dict[str, Any]) -> Any:
        """``args`` on the primary serving ``key``'s slot, once, on an idle
        connection checked first: one its server closed (killed, restarted)
        fails after sending, which reads as "may have been added" (redis-py's
        own pool checks a connection before handing it out; a cluster
        node's does not). Redirected, it was not run: sent the usual way."""
        node = await self.primary_for(key)
        connection = node.acquire_connection()
        try:
            if connection.is_connected and await _closed_by_server(connection):
                await connection.disconnect()
            await connection.send_packed_command(connection.pack_command(*args))
            return await node.parse_response(connection, args[0], **options)
        except AskError:  # or MOVED: the reply was read, nothing ran
            pass
        except ResponseError:
            raise
        except BaseException:
            # Maybe a reply left unread: never reuse it.
            await connection.disconnect()
            raise
        finally:
            node.release(connection)
        return await self._on_slot(key, args, options)

    async def _following_ask(
        self, key: str, args: Any, options: dict[str, Any], gave_up: Exception
    ) -> Any:
        source = await self.primary_for(key)
        try:
            # The node's own call follows no redirection: an ASK comes back.
            return await source.execute_command(*args, **options)
        except AskError as ask:
            target = self.cluster.get_node(host=ask.host, port=ask.port)
            if isinstance(ask, MovedError) or target is None:
                raise gave_up from ask
            # ASKING and the command on one connection, as the target needs.
            connection = target.acquire_connection()
            try:
                await connection.send_packed_command(
                    connection.pack_commands([("ASKING",), args])
                )
                await target.parse_response(connection, "ASKING")
                return await target.parse_response(connection, args[0], **options)
            except BaseException:
                # Maybe a reply left unread: never reuse it.
                await connection.disconnect()
                raise
            finally:
                target.release(connection)

    def pipeline(self, transaction: bool) -> Any:
        """redis-py's, routed by key (a transaction's keys share one slot)."""
        return self.cluster.pipeline(transaction=transaction)

    async def type(self, name: str) -> Any:
        """TYPE, for the loop's start-up check of the stream keys."""
        return await self.execute_command("TYPE", name)

    async def primary_for(self, key: str) -> ClusterNode:
        """The primary serving ``key`` as the client now knows the cluster."""
        # A no-op unless a failed command asked for the topology to be
        # refreshed; then it is refreshed before we pick a node from it.
        await self.cluster.initialize()
        node = self.cluster.get_node_from_key(key)
        if node is None:
            raise RedisClusterException(f"slot of {key!r} not covered")
        return node

    async def _on_every_primary(
        self, args: tuple[Any, ...], options: dict[str, Any]
    ) -> list[Any]:
        await self.cluster.initialize()
        primaries = self.cluster.get_primaries()
        # One call per node, so the reply shape does not depend on how many
        # primaries there are; any failure fails the whole check, which the
        # caller retries: an answer must hold for every primary.
        replies = await asyncio.gather(
            *(
                self.cluster.execute_command(*args, target_nodes=node, **options)
                for node in primaries
            )
        )
        return list(replies)

    async def xreadgroup(
        self,
        groupname: str,
        consumername: str,
        streams: dict[str, str | int],
        count: int | None = None,
        block: int | None = None,
        claim_min_idle_time: int | None = None,
    ) -> StreamEntries:
        """XREADGROUP for streams in any slots; replies as RESP2 pairs.
        ``claim_min_idle_time``: XREADGROUP ... CLAIM (Redis >= 8.4)."""
        read = functools.partial(
            self._read,
            groupname=groupname,
            consumername=consumername,
            count=count,
            block=block,
            claim_min_idle_time=claim_min_idle_time,
        )
        if self._deferred is not None:
            error, self._deferred = self._deferred, None
            raise error
        groups = slot_groups(streams)
        if len(groups) == 1:
            return await read(groups[0])
        if block is None:
            return await self._at_once(groups, read)
        now = time.monotonic()
        for group in groups:
            key = tuple(group)
            if key not in self._reads and self._resting_until.get(key, 0.0) <= now:
                self._reads[key] = asyncio.create_task(read(group))
        # block 0 is "forever" to Redis; None does not block at all.
        timeout = None if block in (None, 0) else block / 1000
        if not self._reads:
            # Every slot is resting after failures: wait for the first one
            # due, within the caller's block.
            due = min(self._resting_until.values()) - now
            await asyncio.sleep(max(0.0, due if timeout is None else min(due, timeout)))
            return []
        done, _ = await asyncio.wait(
            self._reads.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        return self._collect(done, len(groups))

    async def _at_once(
        self,
        groups: list[dict[str, str | int]],
        read: Callable[[dict[str, str | int]], Awaitable[StreamEntries]],
    ) -> StreamEntries:
        """A read that does not block (the claims where reads reclaim), one
        per slot, awaited here beside the blocking reads outstanding: a
        slot whose primary cannot be reached gives nothing this time."""
        replies = await asyncio.gather(
            *(read(group) for group in groups), return_exceptions=True
        )
        fetched: StreamEntries = []
        errors: list[BaseException] = []
        for reply in replies:
            if isinstance(reply, BaseException):
                errors.append(reply)
            else:
                fetched += reply
        failure = next((e for e in errors if not is_outage(e)), None)
        if failure is None and len(errors) == len(groups):
            failure = errors[0]
        if failure is not None:
            if not fetched:
                raise failure
            self._deferred = failure
        return fetched

    def _collect(
        self, done: Iterable[asyncio.Task[StreamEntries]], group_count: int
    ) -> StreamEntries:
        fetched: StreamEntries = []
        failure: BaseException | None = None
        for key, task in list(self._reads.items()):
            if task not in done:
                continue
            del self._reads[key]
            error = task.exception()
            if error is None:
                fetched += task.result()
                self._reachable(key)
            elif is_outage(error):
                self._unreachable(key, error)
            elif failure is None:
                failure = error
        if failure is None and len(self._failing) == group_count:
            # Nothing is reachable: the loop's own outage handling takes over
            # and every slot is tried again after it.
            failure = next(iter(self._failing.values()))
            self._failing.clear()
            self._backoff.clear()
            self._resting_until.clear()
        if failure is not None:
            if not fetched:
                raise failure
            self._deferred = failure
        return fetched

    def _unreachable(self, key: tuple[str, ...], error: BaseException) -> None:
        backoff = self._backoff.get(key)
        if backoff is None:
            backoff = self._backoff[key] = Backoff(
                f"streams {', '.join(key)}", consequence="reading the others meanwhile"
            )
        self._failing[key] = error
        self._resting_until[key] = time.monotonic() + backoff.failed(error)

    def _reachable(self, key: tuple[str, ...]) -> None:
        self._failing.pop(key, None)
        backoff = self._backoff.pop(key, None)
        if backoff is not None:
            backoff.succeeded()
        self._resting_until.pop(key, None)

    async def _read(
        self,
        group: dict[str, str | int],
        groupname: str,
        consumername: str,
        count: int | None,
        block: int | None,
        claim_min_idle_time: int | None,
    ) -> StreamEntries:
        pieces: list[Any] = ["XREADGROUP", "GROUP", groupname, consumername]
        options: dict[str, Any] = {}
        if count is not None:
            pieces += ["COUNT", count]
        if block is not None:
            pieces += ["BLOCK", block]
        if claim_min_idle_time is not None:
            pieces += ["CLAIM", claim_min_idle_time]
            # Tells redis-py's reply parser to keep each entry's idle time
            # and delivery count.
            options["claim_min_idle_time"] = claim_min_idle_time
        pieces += ["STREAMS", *group, *group.values()]
        # Bounded: on a half-open connection (socket_timeout None) the read
        # would wait for ever and its slot would never be read again.
        call = self._on_slot(next(iter(group)), pieces, options)
        read_number = self.finished.read_sent()
        try:
            reply = await (
                within(block / 1000 + REPLY_MARGIN_S, call) if block else call
            )
            fetched = self._screened(read_number, _as_pairs(reply))
        finally:
            self.finished.read_done(read_number)
        if fetched and self._on_delivered is not None:
            self._on_delivered(fetched)
        return fetched

    def _screened(self, read_number: int, fetched: StreamEntries) -> StreamEntries:
        """``fetched`` minus the entries this consumer finished while the
        read was in flight (see ``FinishedEntries``)."""
        read = read_entries(fetched)
        kept = self.finished.screened(read_number, read)
        if len(kept) == len(read):
            return fetched
        streams: dict[Any, list[Any]] = {}
        for stream, entry_id, fields, maybe_reclaimed in kept:
            # As CLAIM returns them: idle time and delivery count, 0 if new.
            flag = int(maybe_reclaimed)
            streams.setdefault(stream, []).append((entry_id, fields, flag, flag))
        return list(streams.items())

    async def close(self) -> None:
        """Stop outstanding reads (their entries, if any, were already
        reported to ``on_delivered``, so a hand-back still covers them)."""
        reads, self._reads = list(self._reads.values()), {}
        for task in reads:
            task.cancel()
        for task in reads:
            with contextlib.suppress(BaseException):
                await task


async def _closed_by_server(connection: Any) -> bool:
    # can_read from redis-py 8, can_read_destructive before.
    check = getattr(connection, "can_read", None)
    try:
        return bool(await (check or connection.can_read_destructive)())
    except Exception:
        return True


class OneNodeClient:
    """The slice of a client that durability checks need, bound to one node."""

    def __init__(self, cluster: RedisCluster, node: ClusterNode) -> None:
        self.cluster = cluster
        self.node = node

    async def execute_command(self, *args: Any) -> Any:
        return await self.cluster.execute_command(*args, target_nodes=self.node)
