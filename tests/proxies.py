"""Loopback TCP proxies that put a fault between a client and its server:
each listens on a free loopback port and opens one upstream connection per
client connection, and its subclass decides what happens to the bytes.

- ``FreezingProxy``: ``freeze()`` stops forwarding on every open connection
  while keeping it open (a half-open connection: a dropped NAT entry, a
  host that vanished); new connections still work.
- ``StallingProxy``: the first client chunk holding one of some commands is
  kept back until ``release()`` (a claimer delayed between two steps).
- ``CuttingProxy``: ``cut()`` closes every connection and refuses new ones
  until ``restore()`` (a failover or restart as its clients see it).
- ``ReplyDelayingProxy``: replies arrive ``delay_s`` late (the server ran a
  command before the client hears of it).
- ``SelectiveFreezingProxy``: ``freeze(marked=...)`` holds the bytes of
  some of a client's connections, both ways, until ``thaw()``: those that
  sent one of some markers (a worker's liveness thread) or the others.
  Connections opened later pass, unless ``later_too``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

Pair = tuple[asyncio.StreamWriter, asyncio.StreamWriter]
P = TypeVar("P", bound="LoopbackProxy")


def resp_word(command: str) -> bytes:
    """How a command name appears in a client's RESP request."""
    return f"${len(command)}\r\n{command}\r\n".encode()


class LoopbackProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        # Open connections: (client side, server side), and their pumps.
        self.pairs: list[Pair] = []
        self.pumps: set[asyncio.Task[None]] = set()
        # Each pump's connection: its number in order of accepting.
        self.connection_of: dict[asyncio.Task[None], int] = {}
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self: P) -> P:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.close_all()

    def close_all(self) -> None:
        for pump in self.pumps:
            pump.cancel()
        for pair in self.pairs:
            for writer in pair:
                writer.close()
        self.pumps, self.pairs = set(), []

    def refuses(self) -> bool:
        """New connections are closed at once."""
        return False

    async def passing(self, data: bytes, to_server: bool) -> None:
        """Before ``data`` is forwarded (to the server or to the client)."""

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self.refuses():
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(
            "127.0.0.1", self.upstream_port
        )
        self.pairs.append((writer, up_writer))
        number, self.accepted = self.accepted, self.accepted + 1
        for source, sink, to_server in (
            (reader, up_writer, True),
            (up_reader, writer, False),
        ):
            pump = asyncio.ensure_future(self._pump(source, sink, to_server))
            self.pumps.add(pump)
            self.connection_of[pump] = number

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, to_server: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                await self.passing(data, to_server)
                sink.write(data)
                await sink.drain()
        sink.close()


class FreezingProxy(LoopbackProxy):
    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.frozen: list[Pair] = []

    def freeze(self) -> None:
        self.frozen += self.pairs
        self.pairs = []
        for pump in self.pumps:
            pump.cancel()
        self.pumps = set()

    def close_all(self) -> None:
        self.pairs += self.frozen
        self.frozen = []
        super().close_all()


class StallingProxy(LoopbackProxy):
    def __init__(
        self, upstream_port: int, commands: tuple[str, ...], max_hold_s: float = 30.0
    ) -> None:
        super().__init__(upstream_port)
        self.words = tuple(resp_word(command) for command in commands)
        self.max_hold_s = max_hold_s
        self.holding = asyncio.Event()
        self._released = asyncio.Event()

    def release(self) -> None:
        self._released.set()

    async def passing(self, data: bytes, to_server: bool) -> None:
        if not to_server or self.holding.is_set():
            return
        upper = data.upper()
        if any(word in upper for word in self.words):
            self.holding.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._released.wait(), self.max_hold_s)


class CuttingProxy(LoopbackProxy):
    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.cut_off = False

    def cut(self) -> None:
        self.cut_off = True
        self.close_all()

    def restore(self) -> None:
        self.cut_off = False

    def refuses(self) -> bool:
        return self.cut_off


class ReplyDelayingProxy(LoopbackProxy):
    def __init__(self, upstream_port: int, delay_s: float) -> None:
        super().__init__(upstream_port)
        self.delay_s = delay_s

    async def passing(self, data: bytes, to_server: bool) -> None:
        if not to_server:
            await asyncio.sleep(self.delay_s)


class SelectiveFreezingProxy(LoopbackProxy):
    def __init__(self, upstream_port: int, markers: tuple[bytes, ...]) -> None:
        super().__init__(upstream_port)
        self.markers = markers
        self.marked: set[int] = set()
        self.frozen: set[int] = set()
        self.freezing_later: bool | None = None
        self._thawed = asyncio.Event()
        self._thawed.set()

    def freeze(self, marked: bool, later_too: bool = False) -> None:
        self.frozen = {
            number
            for number in range(self.accepted)
            if (number in self.marked) == marked
        }
        self.freezing_later = marked if later_too else None
        self._thawed.clear()

    def thaw(self) -> None:
        self.frozen, self.freezing_later = set(), None
        self._thawed.set()

    async def passing(self, data: bytes, to_server: bool) -> None:
        task = asyncio.current_task()
        number = self.connection_of.get(task) if task is not None else None
        if number is None:
            return
        if to_server and any(marker in data for marker in self.markers):
            self.marked.add(number)
        later = self.freezing_later
        if number in self.frozen or (
            later is not None and (number in self.marked) == later
        ):
            await self._thawed.wait()
