"""What a server is and what it can do, read once from ``INFO server``.

``redis_version`` alone misleads: Valkey reports 7.2.4 there for client
compatibility and its real version in ``valkey_version`` (``server_name`` is
``valkey``). The capabilities this package cares about follow from product
and version; whether scripts may run is found by behaviour (a server built
without Lua, a managed service that disables scripting commands, a user
without the right to call them all look alike from INFO).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from redis.exceptions import ResponseError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_errors import is_missing_script, is_permission_denied

_NUMERIC = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")
# A script that cannot be loaded anywhere: calling it by SHA answers NOSCRIPT
# wherever scripting works, without running anything.
_PROBE_SHA = hashlib.sha1(b"-- taskiq-atomic-claim probe", usedforsecurity=False)
PROBE_FUNCTION = "taskiq_atomic_claim_probe_never_loaded"

# The oldest release of each product this package runs on (the README's
# supported range): older ones lack commands the scripts call (Redis 5 has
# no XAUTOCLAIM), and every worker would fail on its first claim.
MINIMUM_VERSIONS = {"Redis": (6, 2), "Valkey": (8, 1)}

LUA_CLAIM = "lua claim script"
NATIVE_CLAIM = "native XREADGROUP CLAIM"


class ScriptingUnavailableError(RuntimeError):
    """The server runs no scripts for this connection, and nothing else serves."""


class UnsupportedServerError(RuntimeError):
    """The server is older than the oldest release this package supports."""


class AckedDeletionUnavailableError(RuntimeError):
    """``delete_acked`` was asked of a server without XACKDEL."""


@dataclass(frozen=True)
class ServerInfo:
    """One server: product, real version and what this package may use there."""

    product: str  # "Redis" or "Valkey"
    version: str  # the real version, or "unknown"
    # None: not probed yet (``with_scripting``); "" when scripts run, else why not.
    scripting_problem: str | None = None

    @classmethod
    def from_info(cls, info: Any) -> ServerInfo:
        """From an ``INFO server`` reply as redis-py parses it (a dict)."""
        fields = (
            {text(k): text(v) for k, v in info.items()}
            if isinstance(info, dict)
            else {}
        )
        if "valkey_version" in fields or fields.get("server_name") == "valkey":
            return cls("Valkey", fields.get("valkey_version", "unknown"))
        return cls("Redis", fields.get("redis_version", "unknown"))

    @property
    def name(self) -> str:
        return f"{self.product} {self.version}"

    # Parsed once: every script call asks whether the server has functions.
    @cached_property
    def version_tuple(self) -> tuple[int, int, int] | None:
        match = _NUMERIC.match(self.version)
        if match is None:
            return None
        major, minor, patch = match.groups()
        return int(major), int(minor), int(patch or 0)

    def _redis_at_least(self, *version: int) -> bool:
        found = self.version_tuple
        return self.product == "Redis" and found is not None and found >= version

    @property
    def major(self) -> int:
        """The real major version; 0 when unknown."""
        found = self.version_tuple
        return found[0] if found else 0

    @property
    def functions(self) -> bool:
        """FUNCTION LOAD / FCALL: Redis >= 7; every Valkey release has them.
        Unknown versions get cached scripts, which every server runs."""
        return self.product == "Valkey" or self.major >= 7

    @property
    def native_claim(self) -> bool:
        """XREADGROUP ... CLAIM min-idle-time: Redis >= 8.4 (not Valkey 9.1)."""
        return self._redis_at_least(8, 4)

    @property
    def acked_trimming(self) -> bool:
        """XADD/XTRIM ... ACKED and XACKDEL: Redis >= 8.2 (not Valkey 9.1)."""
        return self._redis_at_least(8, 2)

    @property
    def idempotent_add(self) -> bool:
        """XADD ... IDMP and XCFGSET: Redis >= 8.6 (not Valkey 9.1)."""
        return self._redis_at_least(8, 6)

    @property
    def scripting(self) -> bool | None:
        """True/False once probed (``with_scripting``), None before."""
        return None if self.scripting_problem is None else not self.scripting_problem

    @property
    def reclaim_path(self) -> str:
        """The path a broker takes on this server: its reads reclaim where
        XREADGROUP ... CLAIM exists, the Lua claim script elsewhere."""
        return NATIVE_CLAIM if self.native_claim else LUA_CLAIM

    @property
    def trimming_policy(self) -> str:
        """What ``maxlen`` trimming does on this server."""
        if self.acked_trimming:
            return "MAXLEN ACKED (trims only entries every group acked)"
        return "maxlen not sent (MAXLEN here trims unread and unacked entries)"

    def unsupported(
        self, minimums: dict[str, tuple[int, int]] = MINIMUM_VERSIONS
    ) -> str:
        """Why this server is below the supported range, naming the
        minimum; empty when it is not (or its version cannot be read)."""
        found, minimum = self.version_tuple, minimums.get(self.product)
        if found is None or minimum is None or found[:2] >= minimum:
            return ""
        supported = " or ".join(
            f"{product} >= {'.'.join(map(str, version))}"
            for product, version in minimums.items()
        )
        return (
            f"{self.name} is below the supported range: this package needs {supported}"
        )

    def require_supported(self, where: str = "") -> None:
        """Raise ``UnsupportedServerError``, naming the minimum, for a
        server below the supported range; ``where`` names it among several."""
        problem = self.unsupported()
        if problem:
            at = f" ({where})" if where else ""
            raise UnsupportedServerError(f"{problem}{at}")

    def require_scripting(self, where: str = "") -> None:
        """Raise, saying why, when this server runs no scripts for us;
        ``where`` names it among several (a cluster's primaries)."""
        if self.scripting_problem:
            # Even where the read reclaims (native CLAIM), acks, start counts
            # and heartbeats are scripts.
            at = f" ({where})" if where else ""
            raise ScriptingUnavailableError(
                f"{self.name}{at} cannot run this package's scripts:"
                f" {self.scripting_problem}. The broker needs server-side"
                " scripting (FCALL on Redis/Valkey >= 7, EVALSHA on 6.2) for"
                " acks, start counts, heartbeats and, before Redis 8.4, the"
                " reclaim: enable it for this user, or use a server that allows it"
            )

    def require_acked_deletion(self) -> None:
        """Raise, naming the server, when it cannot run ``delete_acked``."""
        if not self.acked_trimming:
            raise AckedDeletionUnavailableError(
                f"delete_acked=True needs XACKDEL (Redis >= 8.2), and {self.name}"
                " has none: leave delete_acked off (bound the stream with maxlen"
                " instead) or use Redis >= 8.2"
            )

    def describe(self) -> str:
        """One line for operators: server, reclaim path, trimming."""
        supports = []
        if self.native_claim:
            supports.append(NATIVE_CLAIM)
        if self.acked_trimming:
            supports.append("ACKED trimming and XACKDEL")
        if self.idempotent_add:
            supports.append("idempotent XADD (IDMP)")
        server_has = f"; server also offers {', '.join(supports)}" if supports else ""
        scripting = (
            f"; scripting unavailable: {self.scripting_problem}"
            if self.scripting_problem
            else ""
        )
        return (
            f"{self.name}: reclaim via {self.reclaim_path}, trimming"
            f" {self.trimming_policy}{server_has}{scripting}"
        )


async def probe_scripting(client: ScriptClient, functions: bool) -> str:
    """An empty string when scripts run for this connection, else why not.

    Calls what a worker's ACL already grants (FCALL on servers with
    functions, EVALSHA on 6.2), naming something that cannot exist: a
    working server answers "not found" and runs nothing; a server without
    scripting answers "unknown command", a user without the right NOPERM.
    """
    if functions:
        probe: tuple[Any, ...] = ("FCALL", PROBE_FUNCTION, 0)
    else:
        probe = ("EVALSHA", _PROBE_SHA.hexdigest(), 0)
    try:
        await client.execute_command(*probe)
    except ResponseError as error:
        if is_missing_script(error):
            return ""
        if is_permission_denied(error):
            return f"{probe[0]} refused for this user ({error})"
        return f"{probe[0]} failed ({str(error).strip()})"
    return ""


async def read_server_info(client: ScriptClient, *, probe: bool = False) -> ServerInfo:
    """``INFO server`` once; with ``probe``, also whether scripts run."""
    info = ServerInfo.from_info(await client.execute_command("INFO", "server"))
    if not probe:
        return info
    problem = await probe_scripting(client, info.functions)
    return ServerInfo(info.product, info.version, problem)
