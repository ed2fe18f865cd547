"""A loopback proxy that counts client round trips ("turns").

A turn starts whenever the client sends bytes after the server last spoke
(or first): a pipelined burst of commands is one turn, a command that waits
for the previous reply is another. That is exactly what costs one RTT, so
it is counted on the wire rather than inferred from the command list.

It runs in the measuring process's own event loop: only the count matters
here, never the timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

_CHUNK = 65536


class TurnCountingProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.turns = 0
        # "host:port" of our side of every server connection: what MONITOR
        # shows as the client address of commands that came through us.
        self.upstream_addresses: set[str] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}"

    async def __aenter__(self) -> TurnCountingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    def reset(self) -> None:
        self.turns = 0

    async def _accept(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        server_r, server_w = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        for writer in (client_w, server_w):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._writers.append(writer)
        host, port = server_w.get_extra_info("sockname")[:2]
        self.upstream_addresses.add(f"{host}:{port}")
        # Who spoke last on this connection; a list so both pumps share it.
        last = ["server"]

        async def pump(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, side: str
        ) -> None:
            while data := await reader.read(_CHUNK):
                if side == "client" and last[0] != "client":
                    self.turns += 1
                last[0] = side
                writer.write(data)
                await writer.drain()
            writer.close()

        for task in (
            asyncio.create_task(pump(client_r, server_w, "client")),
            asyncio.create_task(pump(server_r, client_w, "server")),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
