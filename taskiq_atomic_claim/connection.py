"""What differs between a standalone server, Sentinel and Cluster, as one
value each broker hands its collaborators: how to get a client, what to
check before a call, which servers stand behind it."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import AuthenticationError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.finished import FinishedEntries
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import LoginRefusedError, login_problem
from taskiq_atomic_claim.server_info import ServerInfo

T = TypeVar("T")

# A client for one unit of work (a call, a heartbeat, an ack).
Connect = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


__all__ = ["Connect", "Connection", "LoginRefusedError"]


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

    def liveness_client(self) -> contextlib.AbstractAsyncContextManager[ScriptClient]:
        """A client of its own for the liveness thread (``liveness.py``),
        entered, used and left in that thread's event loop: built afresh
        from public redis-py API, it shares no connection and no asyncio
        object with the broker's loop."""
        raise NotImplementedError

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

    def login(self) -> tuple[str, bool, str]:
        """Where the server is, for a refused login, whether a password is
        sent to it, and the user it logs in as."""
        return f"the server of queue {self.queue_name!r}", True, "default"

    def named(self, error: BaseException) -> BaseException:
        """``error``; a refused login (redis-py says only "HELLO must be
        called ..." or NOAUTH) as ``LoginRefusedError``, one line naming
        where, the user and the problem."""
        if not isinstance(error, AuthenticationError):
            return error
        where, has_password, user = self.login()
        return LoginRefusedError(login_problem(error, where, has_password, user))

    async def named_login_refusal(self, call: Awaitable[T]) -> T:
        """``call``; a refused login raised as ``LoginRefusedError``."""
        try:
            return await call
        except AuthenticationError as error:
            raise self.named(error) from None

    async def close(self) -> None:
        """After the broker's shutdown: close what its calls reopened."""
