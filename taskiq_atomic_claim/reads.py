"""One consumer's XREADGROUP (``GroupReads``), and the Lua path's read step
(``LuaPathReads``): new entries only, never blocking past the next claim.

Where reads reclaim (Redis >= 8.4) the same read carries ``CLAIM``; that
path's step is in ``native_reads.py``.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from taskiq_atomic_claim.claim_schedule import BeforeCall, ClaimSchedule, no_check
from taskiq_atomic_claim.group_recovery import GroupPositions
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.reply_buffer import ReplyBuffer
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within

# Bytes asked of the socket per read: a whole batch of small tasks, usually.
_READ_SIZE = 65536

# (stream, entry id, fields, maybe reclaimed)
ReadEntry = tuple[str, str, dict[Any, Any], bool]


class GroupReads:
    """XREADGROUP as one consumer of its group, bounded by the claim schedule."""

    def __init__(
        self,
        group: str,
        consumer: str,
        block_ms: int,
        count: int | None,
        idle_timeout_ms: int,
        positions: GroupPositions,
        *,
        before_call: BeforeCall = no_check,
        direct: bool = False,
    ) -> None:
        self.group = group
        self.consumer = consumer
        self.block_ms = block_ms
        self.count = count
        self.idle_timeout_ms = idle_timeout_ms
        self.positions = positions
        # Sentinel: claims can be minutes apart (idle_timeout / 4 by
        # default); reads, at least every xread_block, check for a replaced
        # master too.
        self.before_call = before_call
        # One server behind a pool of the broker's: the read is written and
        # its reply parsed here (``DirectReader``), not by redis-py.
        self.direct = direct
        self._reader: DirectReader | None = None

    async def read(
        self,
        client: Any,
        read_from: dict[str, Any],
        next_claim: float,
        *,
        claim: bool = False,
        block: bool = True,
    ) -> list[ReadEntry]:
        """New entries; with ``claim`` (Redis >= 8.4) idle pending entries
        first, taken over by the read itself. Without ``block`` it returns
        at once."""
        await self.before_call(client)
        # Never block past the next claim: reclaim must not wait for traffic.
        until = max(1, int((next_claim - time.monotonic()) * 1000))
        block_ms = (
            (min(self.block_ms, until) if self.block_ms else until) if block else None
        )
        fetched: Any
        if self.direct:
            reader = self._reader
            if reader is None or reader.pool is not client.connection_pool:
                reader = self._reader = DirectReader(client.connection_pool)
            fetched = await reader.call(self._command(read_from, block_ms, claim))
        else:
            extra = {"claim_min_idle_time": self.idle_timeout_ms} if claim else {}
            fetched = await client.xreadgroup(
                self.group,
                self.consumer,
                read_from,
                block=block_ms,
                count=self.count,
                **extra,
            )
        read = read_entries(fetched)
        for stream, entry_id, _, _ in read:
            self.positions.advance(stream, entry_id)
        return read

    def _command(
        self, read_from: dict[str, Any], block_ms: int | None, claim: bool
    ) -> list[Any]:
        """XREADGROUP's arguments, in the order redis-py sends them."""
        command: list[Any] = ["XREADGROUP", "GROUP", self.group, self.consumer]
        if self.count is not None:
            command += ["COUNT", self.count]
        if block_ms is not None:
            command += ["BLOCK", block_ms]
        if claim:
            command += ["CLAIM", self.idle_timeout_ms]
        return [*command, "STREAMS", *read_from, *read_from.values()]


class DirectReader:
    """Commands on one connection of ``pool``, kept from one to the next (a
    consumer reads one at a time), their replies parsed from whole socket
    reads (``reply_buffer.py``): redis-py's parser awaits a stream read per
    line, several per entry read, and its pool's hand-out and release run
    listeners and metrics, on every read of every worker. An error reply is
    raised as redis-py raises it. A connection left in an unknown state
    (cancelled, failed, more bytes than the reply) is disconnected and
    given back; the next command takes another."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._connection: Any = None

    async def call(self, command: list[Any]) -> Any:
        connection = self._connection
        if connection is None:
            connection = self._connection = await self.pool.get_connection()
        clean = False
        try:
            await connection.send_packed_command(
                connection.pack_command(*command), check_health=False
            )
            replies = ReplyBuffer()
            while True:
                whole, reply = replies.pop()
                if whole:
                    break
                try:
                    chunk = await connection._reader.read(_READ_SIZE)
                except OSError as error:
                    raise RedisConnectionError(
                        f"Error while reading from the socket: {error}"
                    ) from error
                if not chunk:
                    raise RedisConnectionError("Connection closed by server.")
                replies.feed(chunk)
            clean = replies.empty
        finally:
            if not clean:
                self._connection = None
                await connection.disconnect(nowait=True)
                await self.pool.release(connection)
        if isinstance(reply, Exception):
            raise reply
        return reply


class LuaPathReads:
    """The Lua path's read step: new entries until the next claim at most."""

    def __init__(self, reads: GroupReads, schedule: ClaimSchedule) -> None:
        self.reads = reads
        self.schedule = schedule

    async def step(
        self, client: Any, read_from: dict[str, Any]
    ) -> list[tuple[str, str, dict[Any, Any]]]:
        """One bounded read: until the next claim at most."""
        until = self.schedule.next_claim
        read = await within(
            max(0.0, until - time.monotonic()) + REPLY_MARGIN_S,
            self.reads.read(client, read_from, until),
        )
        return [(stream, entry_id, fields) for stream, entry_id, fields, _ in read]


def read_entries(fetched: Any) -> list[ReadEntry]:
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
