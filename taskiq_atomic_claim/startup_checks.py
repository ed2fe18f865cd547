"""What a worker checks at startup, before it reads: the stream keys' types,
that the server is in the supported range and its user runs scripts, the
server features its settings need, and the server settings that lose tasks
(``durability``, warnings only)."""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.durability import warn_about_durability
from taskiq_atomic_claim.group_recovery import GroupPositions
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.reclaim_path import PathChoice
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import (
    UNREACHABLE,
    Fault,
    classify,
    permission_refused,
)
from taskiq_atomic_claim.stream_setup import require_stream_type
from taskiq_atomic_claim.task_records import ack_commands

logger = logging.getLogger("taskiq.atomic_claim")


class StartupChecks:
    """The checks of one broker's start, in order."""

    def __init__(
        self,
        connection: Connection,
        scripts: ScriptRunner,
        path: PathChoice,
        streams: list[str],
        group: str,
        positions: GroupPositions,
        delete_acked: bool,
    ) -> None:
        self.connection = connection
        self.scripts = scripts
        self.path = path
        self.streams = streams
        self.group = group
        self.positions = positions
        self.delete_acked = delete_acked

    async def run(self) -> None:
        """Every check, in order; raises what it meets (an outage too: a
        worker waits it out and runs them again, ``AtomicParts.startup``)."""
        await self.check_stream_types()
        await self.require_scripting()
        # Before the ack's probe: delete_acked on a server without XACKDEL
        # is refused as such, not as an unknown command.
        await self.check_server_features()
        await self.require_ack_permissions()
        await self.check_durability()

    async def check_stream_types(self) -> None:
        """Fail at startup, naming the key, if a stream key holds another type."""
        async with self.connection.connect() as client:
            for stream in self.streams:
                await require_stream_type(client, stream)

    async def require_scripting(self) -> None:
        """Refuse, saying why, a server that runs no scripts for this
        connection (else every ack would fail), or one below the supported
        range, naming the minimum."""
        async with self.connection.connect() as client:
            server = await self.connection.require_scripting(self.scripts, client)
        # Below the range the scripts call commands the server lacks:
        # refused here, not by every claim of a crash-looping worker.
        server.require_supported()
        self.path.learned(server)

    async def require_ack_permissions(self) -> None:
        """Refuse, naming the command, a user who may not ack: once the
        worker runs, a refused ack is an operator's ACL change, waited out
        with its entry held. Acks that match nothing (id 0-0, a field no
        count has) change nothing."""
        async with self.connection.connect() as client:
            for stream in self.streams:
                keys = StreamKeys(stream, self.group)
                for command in ack_commands(
                    stream, keys.started, self.group, ["0-0"], self.delete_acked
                ):
                    try:
                        await client.execute_command(*command)
                    except ResponseError as error:
                        if classify(error) is not Fault.FORBIDDEN:
                            raise
                        raise permission_refused(error, "this worker") from None

    async def check_server_features(self) -> None:
        """Refuse, naming the server, what it cannot do."""
        if not self.delete_acked:
            return
        async with self.connection.connect() as client:
            server = await self.path.learn_server(client)
        server.require_acked_deletion()

    async def check_durability(self) -> None:
        """Remember where the groups are, and warn about server settings
        that lose tasks. Never fails the start."""
        try:
            async with self.connection.connect() as client:
                await self.positions.learn(client, self.streams, self.group)
                for where, server in self.connection.servers(client):
                    await warn_about_durability(server, where)
        except UNREACHABLE as error:
            logger.debug("Durability not checked at start-up: %s", error)
