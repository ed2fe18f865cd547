"""What differs between a standalone server, Sentinel and Cluster, as one
value each broker hands its collaborators: how to get a client, what to
check before a call, which servers stand behind it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.finished import FinishedEntries
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo

# A client for one unit of work (a call, a heartbeat, an ack).
Connect = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


class Connection:
    """How an atomic broker reaches its server(s). What is defined here
    serves one server (standalone, Sentinel); Cluster redefines it."""

    # A server unreachable at startup is waited out by the listen loop
    # instead of failing the worker's start (Sentinel, Cluster).
    waits_out_startup = False
    # Cluster: one script call per hash slot, a slot that cannot be claimed
    # now skipped rather than fatal.
    per_slot = False

    def __init__(self, queue_name: str) -> None:
        self.queue_name = queue_name

    def connect(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A client for one unit of work; leaving it closes nothing shared."""
        raise NotImplementedError

    def listen_client(
        self, on_delivered: Callable[[Any], None], finished: FinishedEntries
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """The client one listen() holds for its life. Cluster keeps reads
        outstanding across calls and reports each read's reply to
        ``on_delivered`` as it completes, so entries that arrive while the
        consumer is not pulling are held (and heartbeated) at once; it
        screens out ``finished`` entries itself, as each read completes."""
        return self.connect()

    def setup_client(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """The client that creates consumer groups at startup."""
        return self.connect()

    def servers(self, client: Any) -> list[tuple[str, Any]]:
        """The servers behind ``client``, each with a name for the log."""
        return [(f"server of queue {self.queue_name!r}", client)]

    async def require_scripting(
        self, scripts: ScriptRunner, client: ScriptClient
    ) -> ServerInfo:
        """Startup: refuse, naming it, a server behind ``client`` where this
        user runs no scripts; else the server as read."""
        return await scripts.require_scripting(client)

    async def before_call(self, client: Any) -> None:
        """What to check before a claim or a read (Sentinel: the master)."""

    async def close(self) -> None:
        """After the broker's shutdown: close what its calls reopened."""
