"""The kick: one XADD that rides out a short outage and never enqueues twice
where the server can tell a resend.

On Redis >= 8.6 every XADD carries the task id as its idempotency id
(``IDMP producer-id task-id``): a resend with the same ids, by this retry or
by a caller kicking again with the same task id (taskiq's ``with_task_id``),
adds nothing and answers the first entry's id, for ``idempotency_window``
seconds. taskiq's retry middlewares kick a failed task again with its task
id and the retry's number in label ``_retries``: a new kick, not a resend,
so that number is part of the idempotency id (``idempotency_id``). The
producer id is one of ``PRODUCER_SHARDS`` names picked by a hash of the
task id, so every process names the same task the same way, and the stream
remembers up to ``PRODUCER_SHARDS`` x ``IDMP_MAXSIZE`` task ids (Redis
keeps at most ``IDMP_MAXSIZE`` per producer id).

Elsewhere (older Redis, Valkey) a resend cannot be told apart, so only a
failure that certainly wrote nothing is retried (``server_errors
.certainly_not_written``); an ambiguous one (a timeout or a connection lost
after sending) raises at once, saying why.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

from taskiq.message import BrokerMessage

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.connection import Connect
from taskiq_atomic_claim.operations import set_idempotency_call
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_calls import (
    REPLY_MARGIN_S,
    drop_idle_connections,
    within,
)
from taskiq_atomic_claim.server_errors import certainly_not_written, is_outage
from taskiq_atomic_claim.server_info import ServerInfo
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.stream_trim import kick_maxlen

logger = logging.getLogger("taskiq.atomic_claim")

_DATA_FIELD = b"data"
# Producer ids a stream's remembered task ids are spread over: Redis keeps at
# most IDMP_MAXSIZE (its maximum) per producer id, so a stream remembers up
# to 16 x 10,000 task ids within the window. Fixed: every producer must
# derive the same producer id from a task id.
PRODUCER_SHARDS = 16
IDMP_MAXSIZE = 10_000


class UncertainKickError(RuntimeError):
    """A kick failed after it may have reached the server, on a server that
    cannot tell a resend apart: retrying could enqueue the task twice."""


# The label taskiq's SimpleRetryMiddleware and SmartRetryMiddleware number
# their kicks of a failed task with (1, 2, ...); the first kick has none.
RETRY_LABEL = "_retries"


def producer_id(task_id: str) -> str:
    """The IDMP producer id for ``task_id``: the same in every process."""
    return f"tac{zlib.crc32(task_id.encode()) % PRODUCER_SHARDS}"


def idempotency_id(message: BrokerMessage) -> str:
    """The IDMP id of a kick: its task id, and the retry's number for a
    retry middleware's kick (after a NUL, which taskiq's task ids, uuid4
    hex, never hold), so a retry is enqueued and a resend of the same kick
    is not."""
    retry = message.labels.get(RETRY_LABEL)
    if retry is None:
        return message.task_id
    return f"{message.task_id}\0{retry}"


class Kicker:
    """``kick`` for the atomic brokers: one XADD per message, retried as the
    module docstring says."""

    def __init__(
        self,
        scripts: ScriptRunner,
        connect: Connect,
        queue_name: str,
        maxlen: int | None,
        approximate: bool,
        settings: ClaimSettings,
    ) -> None:
        self.scripts = scripts
        self.connect = connect
        self.queue_name = queue_name
        self.maxlen = maxlen
        self.approximate = approximate
        self.settings = settings
        # Per stream: the server whose IDMP settings this broker last set on it.
        self._idempotency_set: dict[str, ServerInfo] = {}
        # The server last told that maxlen is not sent to it.
        self._maxlen_warned = ""
        # Shared by every kick: one outage, one log line, however many kicks.
        self.backoff = Backoff(
            "kicks",
            cap=1.0,
            consequence=f"a kick still failing after"
            f" {settings.kick_patience:g} s raises",
        )

    async def kick(self, message: BrokerMessage) -> None:
        """Add the message to its stream; retry through an outage for
        ``kick_patience`` seconds (see the module docstring for which
        failures are retried), then raise the last error."""
        stream = message.labels.get("queue_name") or self.queue_name
        give_up = time.monotonic() + self.settings.kick_patience
        while True:
            attempt = _Attempt()
            try:
                await within(REPLY_MARGIN_S, self._add(stream, message, attempt))
            except Exception as error:
                remaining = give_up - time.monotonic()
                if not is_outage(error) or remaining <= 0:
                    raise
                if attempt.uncertain and not certainly_not_written(error):
                    raise UncertainKickError(
                        f"Kick of task {message.task_id} to stream {stream!r}"
                        f" may have been added ({type(error).__name__}: {error});"
                        " not retried: this server has no idempotent XADD"
                        " (Redis >= 8.6), so a resend could enqueue it twice"
                    ) from error
                await drop_idle_connections(self.connect, error)
                # The server may be another one now (a failover, a restart
                # on another binary): read it again before the next try.
                self.scripts.forget_server()
                delay = self.backoff.failed(error)
                # Last try at the deadline: kicks share one backoff.
                await asyncio.sleep(min(delay, remaining))
            else:
                self.backoff.succeeded()
                return

    async def _add(
        self, stream: str, message: BrokerMessage, attempt: _Attempt
    ) -> None:
        """One XADD, with IDMP where the server has it; ``attempt`` records
        how far it got, for deciding whether a failed one may be resent."""
        async with self.connect() as client:
            server = await self.scripts.server(client)
            # Never trims an entry a group has not read and acked.
            trimming = kick_maxlen(server, self.maxlen, self.approximate)
            if self.maxlen is not None and not trimming:
                self._maxlen_not_sent(server)
            options: list[Any] = trimming[:1]
            if server.idempotent_add:
                await self._set_idempotency(client, stream, server)
                options += [
                    "IDMP",
                    producer_id(message.task_id),
                    idempotency_id(message),
                ]
                attempt.idempotent = True
            options += trimming[1:]
            # From here a failure may come after the server added the entry.
            attempt.sent = True
            await client.execute_command(
                "XADD", stream, *options, "*", _DATA_FIELD, message.message
            )

    def _maxlen_not_sent(self, server: ServerInfo) -> None:
        """Once per server: say why maxlen is not sent."""
        if self._maxlen_warned == server.name:
            return
        self._maxlen_warned = server.name
        logger.warning(
            "maxlen=%d is not sent to %s: its MAXLEN would trim unread and"
            " unacked entries (no ACKED before Redis 8.2), losing accepted"
            " tasks; the workers trim what every consumer group acked instead",
            self.maxlen,
            server.name,
        )

    async def _set_idempotency(
        self, client: ScriptClient, stream: str, server: ServerInfo
    ) -> None:
        """Once per stream and server: how long and how many task ids the
        stream remembers (``lua/set_idempotency.lua``). Setting the values
        the stream has changes nothing; others (a broker with another
        idempotency_window) forget the ids remembered so far."""
        if self._idempotency_set.get(stream) is server:
            return
        await self.scripts.run(
            client,
            set_idempotency_call(
                stream=stream,
                duration_s=self.settings.idempotency_window,
                maxsize=IDMP_MAXSIZE,
            ),
        )
        self._idempotency_set[stream] = server


@dataclass
class _Attempt:
    """One try of a kick, as far as it got before failing."""

    # The XADD carried IDMP: resending it adds nothing.
    idempotent: bool = False
    # The XADD was being sent (not just the INFO or XCFGSET before it).
    sent: bool = False

    @property
    def uncertain(self) -> bool:
        """Whether a failure of this try may have left an entry that a
        resend would add again."""
        return self.sent and not self.idempotent
