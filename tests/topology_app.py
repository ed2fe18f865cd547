"""The taskiq app the Cluster and Sentinel crash drills run under ``taskiq worker``.

Configured from the environment, so a plain ``taskiq worker
tests.topology_app:broker`` subprocess picks it up:

- ``TAC_TOPOLOGY``: ``cluster`` or ``sentinel``;
- ``TAC_TOPOLOGY_NODES``: ``host:port,...``, a cluster node (the first is
  the startup node) or the sentinels;
- ``TAC_TOPOLOGY_MASTER``: the Sentinel master name;
- ``TAC_DRILL_QUEUE``, ``TAC_DRILL_IDLE_TIMEOUT``, ``TAC_DRILL_CLAIM_INTERVAL``
  and ``TAC_DRILL_WORKER`` as for ``taskiq_atomic_claim.harness.drill_app``
  (an empty idle timeout or claim interval: the broker's default);
- ``TAC_DRILL_EVENTS_URL``: a standalone server, outside the topology, for
  the events stream, so a failover can neither lose nor hide an event.
"""

from __future__ import annotations

import os
from typing import Any

from redis.asyncio import Redis
from taskiq import AsyncBroker

from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.harness.drill_app import add_drill_task
from taskiq_atomic_claim.sentinel_broker import AtomicRedisStreamSentinelBroker

TASK_NAME = "tests.topology_app.work"
MASTER_NAME = "tac-master"


def parse_nodes(text: str) -> list[tuple[str, int]]:
    nodes = []
    for item in text.split(","):
        host, port = item.rsplit(":", 1)
        nodes.append((host, int(port)))
    return nodes


def build_broker(
    kind: str,
    nodes: list[tuple[str, int]],
    queue: str,
    idle_timeout: int | None,
    claim_interval: int | None,
    master_name: str = MASTER_NAME,
) -> AsyncBroker:
    reclaim: dict[str, Any] = {
        name: value
        for name, value in (
            ("idle_timeout", idle_timeout),
            ("claim_interval", claim_interval),
        )
        if value is not None
    }
    if kind == "cluster":
        host, port = nodes[0]
        return AtomicRedisStreamClusterBroker(
            f"redis://{host}:{port}",
            queue_name=queue,
            xread_block=2000,
            **reclaim,
        )
    if kind == "sentinel":
        return AtomicRedisStreamSentinelBroker(
            nodes,
            master_name,
            queue_name=queue,
            xread_block=2000,
            **reclaim,
        )
    raise ValueError(f"TAC_TOPOLOGY must be cluster or sentinel, got {kind!r}")


_QUEUE = os.environ.get("TAC_DRILL_QUEUE", "taskiq-atomic-claim-drill")


def _ms(name: str, default: str) -> int | None:
    value = os.environ.get(name, default)
    return int(value) if value else None


broker = build_broker(
    os.environ.get("TAC_TOPOLOGY", "cluster"),
    parse_nodes(os.environ.get("TAC_TOPOLOGY_NODES", "127.0.0.1:7000")),
    _QUEUE,
    _ms("TAC_DRILL_IDLE_TIMEOUT", "2000"),
    _ms("TAC_DRILL_CLAIM_INTERVAL", "500"),
    os.environ.get("TAC_TOPOLOGY_MASTER", MASTER_NAME),
)
add_drill_task(
    broker,
    Redis.from_url(os.environ.get("TAC_DRILL_EVENTS_URL", "redis://127.0.0.1:6379")),
    _QUEUE,
    os.environ.get("TAC_DRILL_WORKER", f"worker-{os.getpid()}"),
    TASK_NAME,
)
