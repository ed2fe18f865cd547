"""Server settings under which accepted tasks vanish without a trace.

- ``maxmemory-policy`` other than ``noeviction``: under memory pressure Redis
  may evict a queue stream, with its consumer group and pending entries
  (measured: ``allkeys-lru`` dropped a stream and its 200 tasks, no log).
- no persistence (neither AOF nor an RDB save point): a restart comes back
  empty and every queued task is gone.

Used by the brokers' startup (warnings in the log) and by ``doctor``
(findings). INFO answers for a worker's ACL (``+info``); the RDB save points
need CONFIG GET, asked only when AOF is off, and by a worker only when it
logs in as the default user: the documented worker ACL has no CONFIG, and
every refused attempt would land in ACL LOG. What is not checked is logged at
debug level; a check that cannot run never fails anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.replies import text

logger = logging.getLogger("taskiq.atomic_claim")

SAFE_EVICTION_POLICY = "noeviction"


@dataclass(frozen=True)
class DurabilityRisk:
    kind: str  # "eviction-policy" or "no-persistence"
    problem: str
    advice: str


async def _info(client: ScriptClient, section: str) -> dict[str, Any]:
    reply = await client.execute_command("INFO", section)
    if isinstance(reply, bytes | str):  # raw text when no callback parsed it
        pairs = (line.split(":", 1) for line in text(reply).splitlines())
        return {p[0]: p[1] for p in pairs if len(p) == 2}
    return {text(k): v for k, v in dict(reply).items()}


async def _save_points(client: ScriptClient) -> str | None:
    """CONFIG GET save; None when the ACL (or a renamed command) forbids it."""
    try:
        reply = await client.execute_command("CONFIG", "GET", "save")
    except (RedisError, RedisClusterException) as error:
        logger.debug("RDB save points not checked: %s", error)
        return None
    values = (
        list(reply.values())
        if isinstance(reply, dict)
        else [v for k, v in zip(reply[::2], reply[1::2], strict=True)]
    )
    return text(values[0]) if values else None


def may_read_config(client: Any) -> bool:
    """Whether ``client`` logs in as the default user (or names none)."""
    pool = getattr(client, "connection_pool", None)
    cluster = getattr(getattr(client, "cluster", client), "nodes_manager", None)
    kwargs = getattr(pool or cluster, "connection_kwargs", {}) or {}
    return kwargs.get("username") in (None, "", "default")


async def durability_risks(
    client: ScriptClient, read_config: bool = True
) -> list[DurabilityRisk]:
    """What in this server's settings can lose accepted tasks; [] when safe
    or when nothing could be checked (logged at debug). ``read_config``
    False leaves the RDB save points unchecked."""
    risks: list[DurabilityRisk] = []
    try:
        memory = await _info(client, "memory")
        persistence = await _info(client, "persistence")
    except RedisError as error:
        logger.debug("Durability settings not checked: %s", error)
        return risks
    policy = text(memory.get("maxmemory_policy", SAFE_EVICTION_POLICY))
    if policy != SAFE_EVICTION_POLICY:
        risks.append(
            DurabilityRisk(
                "eviction-policy",
                f"maxmemory-policy is {policy}: under memory pressure the server"
                " may evict a queue stream with its group, and its tasks vanish"
                " without an error",
                "CONFIG SET maxmemory-policy noeviction (writes then fail loudly"
                " when memory is full)",
            )
        )
    if str(persistence.get("aof_enabled", "0")) != "1":
        if not read_config:
            logger.debug("RDB save points not checked: no CONFIG for this user")
            return risks
        save = await _save_points(client)
        if save is not None and not save.strip():
            risks.append(
                DurabilityRisk(
                    "no-persistence",
                    "neither AOF nor RDB save points: a restart comes back empty"
                    " and every queued task is lost",
                    "enable appendonly yes (or set save points) unless losing"
                    " the queue on restart is acceptable",
                )
            )
    return risks


async def warn_about_durability(client: ScriptClient, where: str) -> None:
    """Log each risk once, at startup; never raises."""
    try:
        risks = await durability_risks(client, may_read_config(client))
    except (RedisError, RedisClusterException, OSError) as error:
        logger.debug("Durability settings of %s not checked: %s", where, error)
        return
    for risk in risks:
        logger.warning("%s: %s; %s", where, risk.problem, risk.advice)
