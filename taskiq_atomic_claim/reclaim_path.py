"""Which reclaim path a consumer takes: the reads themselves (Redis >= 8.4,
``XREADGROUP ... CLAIM``) or the Lua claim script, chosen per connection
from the server as last read, and chosen again when the server may have
changed (a reconnect, a failover, a command refused as a usage error)."""

from __future__ import annotations

import logging

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_info import LUA_CLAIM, NATIVE_CLAIM, ServerInfo

logger = logging.getLogger("taskiq.atomic_claim")


class PathChoice:
    """The server a consumer reads from, and the path it reclaims by there."""

    def __init__(
        self,
        scripts: ScriptRunner,
        consumer: str,
        additional_streams: dict[str, str | int],
        delete_acked: bool,
    ) -> None:
        self.scripts = scripts
        self.consumer = consumer
        self.additional_streams = additional_streams
        self.delete_acked = delete_acked
        # What the server can do, once read (startup, or the first read).
        self.server: ServerInfo | None = None
        # The server this listen() last took its path for; None before its
        # first call.
        self._chosen_on: ServerInfo | None = None

    def begin(self) -> None:
        """A new listen(): the path is logged at its first call."""
        self._chosen_on = None

    def learned(self, server: ServerInfo) -> ServerInfo:
        """The server as a startup check read it."""
        self.server = server
        return server

    async def learn_server(self, client: ScriptClient) -> ServerInfo:
        """What the server is and can do; INFO once until the server may
        have changed (``choose_path_again``)."""
        return self.learned(await self.scripts.server(client))

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
        if self.delete_acked:
            policy += "; XACKDEL ACKED on ack"
        return policy

    async def reads_reclaim_on(self, client: ScriptClient) -> bool:
        """Whether this connection's reads reclaim, for the server as last
        read (INFO at the first call and after ``choose_path_again``, the
        runner's cache otherwise); logged at the first call, and again if
        the server turns out to have changed."""
        chosen_on = self._chosen_on
        server = self._chosen_on = await self.learn_server(client)
        if chosen_on is None:
            logger.info(
                "Consumer %s on %s reclaims via %s",
                self.consumer,
                server.name,
                self.reclaim_path,
            )
        elif chosen_on.name != server.name:
            logger.warning(
                "Consumer %s: the server changed from %s to %s; it reclaims via %s now",
                self.consumer,
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

    async def server_changed(self, client: ScriptClient) -> bool:
        """After a usage error: whether the server is another than the one
        the path was chosen for (then the next call takes the new path)."""
        chosen_on = self._chosen_on
        self.choose_path_again()
        await self.reads_reclaim_on(client)
        now = self._chosen_on
        return chosen_on is not None and now is not None and now.name != chosen_on.name
