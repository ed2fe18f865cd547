"""A loopback TCP proxy that stalls one command on its way to the server:
the first client chunk holding a given command is kept back until
``release()`` (or ``max_hold_s``), with everything after it on that
connection. A claimer delayed between two steps of a claim, as by a
CPU-starved container, a TCP retransmit or a slow network."""

from __future__ import annotations

import asyncio
import contextlib


def resp_word(command: str) -> bytes:
    """How a command name appears in a client's RESP request."""
    return f"${len(command)}\r\n{command}\r\n".encode()


class StallingProxy:
    def __init__(
        self, upstream_port: int, commands: tuple[str, ...], max_hold_s: float = 30.0
    ) -> None:
        self.upstream_port = upstream_port
        self.words = tuple(resp_word(command) for command in commands)
        self.max_hold_s = max_hold_s
        self.holding = asyncio.Event()
        self._released = asyncio.Event()
        self._held_once = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    def release(self) -> None:
        self._released.set()

    async def __aenter__(self) -> StallingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection(
            "127.0.0.1", self.upstream_port
        )
        self._writers += [writer, up_writer]
        for task in (
            asyncio.ensure_future(self._pump(reader, up_writer, stall=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, stall=False)),
        ):
            self._tasks.add(task)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, stall: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                upper = data.upper()
                if (
                    stall
                    and not self._held_once
                    and any(word in upper for word in self.words)
                ):
                    self._held_once = True
                    self.holding.set()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._released.wait(), self.max_hold_s)
                sink.write(data)
                await sink.drain()
        sink.close()


class CuttingProxy:
    """A loopback TCP proxy that can ``cut()``: every open connection is
    closed and new ones are closed at once, until ``restore()``. The server
    keeps its data: what its clients see of a failover or a restart with
    persistence, when what was in flight is lost with the connection."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.cut_off = False
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    def cut(self) -> None:
        self.cut_off = True
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        self._tasks, self._writers = set(), []

    def restore(self) -> None:
        self.cut_off = False

    async def __aenter__(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self.cut_off:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(
            "127.0.0.1", self.upstream_port
        )
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            self._tasks.add(asyncio.ensure_future(_pump(source, sink)))


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.close()
