"""Throwaway Redis Cluster and Sentinel topologies on loopback, from local binaries.

``LocalCluster``: N primaries with a replica each, joined with CLUSTER MEET,
ADDSLOTS and REPLICATE (no redis-cli needed), slots split evenly.
``LocalSentinels``: one master, one replica and three sentinels.

Every node is a ``LocalServer`` (or, for sentinels, a process of the same
binary in sentinel mode) on 127.0.0.1 with its files in a temporary
directory. Every wait is bounded; ``close`` kills whatever was started, and
the context managers call it even when start-up fails half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import signal
import subprocess
import tempfile
import time
import types
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import RedisError
from taskiq import AsyncBroker
from taskiq.message import BrokerMessage

from taskiq_atomic_claim.harness.drill import Events, worker_command
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    ServerBinary,
    find_binaries,
    free_port,
)
from taskiq_atomic_claim.replies import text
from tests.receiver import start_as_the_receiver_does

HOST = "127.0.0.1"


# Replicas sync at once instead of waiting 5 s for more replicas to join,
# and the replication offset moves within a second even with no writes:
# Cluster lists a replica only once its offset is not 0.
_FAST_SYNC = ("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1")


def binary_for(major: int, flavor: str = "redis") -> ServerBinary | None:
    """The local server binary of that flavor and major version, if any."""
    for binary in find_binaries():
        if binary.flavor == flavor and binary.major == major:
            return binary
    return None


def need(binary: ServerBinary | None, what: str) -> ServerBinary:
    """The binary, or skip the test saying which server is missing."""
    if binary is None:
        pytest.skip(f"no {what} server binary found (see embedded_server.py)")
    return binary


def wait_until(
    what: str, check: Callable[[], bool], timeout: float, step: float = 0.05
) -> float:
    """Poll ``check`` until true; seconds it took. Raises after ``timeout``."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        with contextlib.suppress(RedisError, OSError):
            if check():
                return time.monotonic() - started
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(step)


def cluster_port(taken: set[int], attempts: int = 200) -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(attempts):
        port = free_port(above=10000)
        if port not in taken:
            taken.add(port)
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _client(port: int) -> Redis:
    return Redis(host=HOST, port=port, socket_timeout=2, socket_connect_timeout=2)


def _info(port: int, section: str) -> dict[str, Any]:
    with _client(port) as client:
        info: dict[str, Any] = client.info(section)
        return info


# Cluster


@dataclass
class ClusterNode:
    server: LocalServer
    node_id: str = ""
    # For a replica: the node id of the primary it was created for.
    replica_of: str | None = None

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def alive(self) -> bool:
        return self.server.process is not None

    def role(self) -> str:
        with _client(self.port) as client:
            reply: Any = client.execute_command("ROLE")
        role = reply[0]
        return role.decode() if isinstance(role, bytes) else str(role)


_TopologyT = TypeVar("_TopologyT", bound="_Started")


class _Started:
    """A set of processes that ``with`` starts (closing what did start if
    that fails) and closes at the end."""

    def start(self: _TopologyT) -> _TopologyT:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _TopologyT) -> _TopologyT:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_BrokerT = TypeVar("_BrokerT", bound=AsyncBroker)
_BrokersT = TypeVar("_BrokersT", bound="StartedBrokers")


class StartedBrokers:
    """Brokers started for one test (``async with``); all shut down at its end."""

    def __init__(self) -> None:
        self.started: list[AsyncBroker] = []

    async def start(self, broker: _BrokerT) -> _BrokerT:
        self.started.append(broker)
        await broker.startup()
        return broker

    async def __aenter__(self: _BrokersT) -> _BrokersT:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        started, self.started = self.started, []
        for broker in started:
            await broker.shutdown()


class LocalCluster(_Started):
    """``primaries`` primaries, each with ``replicas`` replicas, on loopback.

    ``node_timeout`` (ms) is how long a silent primary takes to be failed
    over: short, so a test can kill one and watch its replica take over.
    """

    def __init__(
        self,
        binary: ServerBinary,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout: int = 1000,
    ) -> None:
        self.binary = binary
        self.node_timeout = node_timeout
        args = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout),
            # A replica may always take over, however long it was cut off:
            # the tests kill primaries on purpose.
            "--cluster-replica-validity-factor", "0",
            *_FAST_SYNC,
        )  # fmt: skip
        taken: set[int] = set()

        def node() -> ClusterNode:
            return ClusterNode(LocalServer(binary, args, port=cluster_port(taken)))

        self.primaries = [node() for _ in range(primaries)]
        self.replicas = [node() for _ in range(primaries * replicas)]

    @property
    def nodes(self) -> list[ClusterNode]:
        return [*self.primaries, *self.replicas]

    @property
    def url(self) -> str:
        """A startup node: any live node will do for a cluster client."""
        return next(node.server.url for node in self.nodes if node.alive)

    def start(self, timeout: float = 60.0) -> LocalCluster:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.server.start()
        for epoch, node in enumerate(self.nodes, 1):
            with _client(node.port) as client:
                node.node_id = client.execute_command("CLUSTER MYID").decode()
                # Distinct epochs up front, as redis-cli does, so no
                # collision has to be resolved while slots are assigned.
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)
        share = REDIS_CLUSTER_HASH_SLOTS // len(self.primaries)
        for index, node in enumerate(self.primaries):
            first = index * share
            last = (
                REDIS_CLUSTER_HASH_SLOTS - 1
                if index == len(self.primaries) - 1
                else first + share - 1
            )
            with _client(node.port) as client:
                # ADDSLOTS, not ADDSLOTSRANGE: 6.2 has only the former.
                client.execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
        first_node = self.nodes[0]
        with _client(first_node.port) as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER MEET", HOST, node.port)
        self._wait(deadline, "every node knows every other", self._all_known)
        for index, node in enumerate(self.replicas):
            primary = self.primaries[index % len(self.primaries)]
            node.replica_of = primary.node_id
            with _client(node.port) as client:
                client.execute_command("CLUSTER REPLICATE", primary.node_id)
        self._wait(deadline, "cluster converged", self.converged)
        return self

    def _wait(self, deadline: float, what: str, check: Callable[[], bool]) -> None:
        wait_until(what, check, max(0.1, deadline - time.monotonic()))

    def _known_ids(self, port: int) -> set[str]:
        with _client(port) as client:
            # redis-py parses CLUSTER NODES into {address: {"node_id": ...}}.
            nodes: dict[str, dict[str, Any]] = client.execute_command("CLUSTER NODES")
        return {entry["node_id"] for entry in nodes.values()}

    def _all_known(self) -> bool:
        expected = {node.node_id for node in self.nodes}
        return all(self._known_ids(node.port) == expected for node in self.nodes)

    def converged(self) -> bool:
        """Every live node: state ok, the same slot owners and replicas, and
        every live replica listed and its link up."""
        views = set()
        for node in self.nodes:
            if not node.alive:
                continue
            info = _cluster_info(node.port)
            if info.get("cluster_state") != "ok":
                return False
            views.add(self._slot_owners(node.port))
        if len(views) != 1:
            return False
        [view] = views
        live_replicas = sum(node.alive for node in self.replicas)
        if sum(replicas for *_, replicas in view) != live_replicas:
            return False
        for node in self.replicas:
            if node.alive and node.role() == "slave":
                link = _info(node.port, "replication").get("master_link_status")
                if link != "up":
                    return False
        return True

    def _slot_owners(self, port: int) -> tuple[tuple[int, int, int, int], ...]:
        """(first slot, last slot, primary port, replica count), sorted."""
        with _client(port) as client:
            slots: Any = client.execute_command("CLUSTER SLOTS")
        owners = [
            (int(start), int(end), int(primary[1]), len(replicas))
            for start, end, primary, *replicas in slots
        ]
        return tuple(sorted(owners))

    def node_for(self, key: str) -> ClusterNode:
        """The live primary serving ``key``'s slot, as the cluster now sees it."""
        slot = key_slot(key.encode())
        for node in self.nodes:
            if not node.alive:
                continue
            for start, end, port, _ in self._slot_owners(node.port):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no live node serves slot {slot}")

    # A slot moved as `redis-cli --cluster reshard` moves it, one step at a
    # time, so a test can hold it half-way.

    def begin_migration(
        self, slot: int, source: ClusterNode, target: ClusterNode
    ) -> None:
        """IMPORTING on ``target``, then MIGRATING on ``source``: from here
        the source redirects what it lacks (ASK), and refuses a call whose
        keys it holds only some of (TRYAGAIN)."""
        with _client(target.port) as client:
            client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source.node_id)
        with _client(source.port) as client:
            client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target.node_id)

    def migrate_keys(
        self,
        slot: int,
        source: ClusterNode,
        target: ClusterNode,
        pause: float = 0.0,
        limit: int = 10_000,
    ) -> int:
        """MIGRATE the slot's keys from ``source`` to ``target`` one by one,
        ``pause`` seconds apart; returns how many moved (at most ``limit``)."""
        moved = 0
        with _client(source.port) as client:
            while moved < limit:
                keys: Any = client.execute_command("CLUSTER GETKEYSINSLOT", slot, 1)
                if not keys:
                    break
                client.execute_command(
                    "MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", keys[0]
                )
                moved += 1
                if pause:
                    time.sleep(pause)
        return moved

    def finish_migration(self, slot: int, target: ClusterNode) -> None:
        """The slot is ``target``'s: told to the target first, then to every
        other primary (the source last ends its MIGRATING state)."""
        others = [node for node in self.primaries if node is not target and node.alive]
        for node in [target, *others]:
            with _client(node.port) as client:
                client.execute_command("CLUSTER SETSLOT", slot, "NODE", target.node_id)

    def replica_for(self, primary: ClusterNode) -> ClusterNode:
        return next(
            node for node in self.replicas if node.replica_of == primary.node_id
        )

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL one node; its files stay so nothing else notices early."""
        node.server.stop()

    def wait_promoted(self, replica: ClusterNode, timeout: float = 30.0) -> float:
        """Seconds until ``replica`` is a primary and the cluster is ok again."""
        return wait_until(
            f"replica on port {replica.port} promoted",
            lambda: replica.role() == "master" and self._ok_without_dead(),
            timeout,
        )

    def _ok_without_dead(self) -> bool:
        return all(
            _cluster_info(node.port).get("cluster_state") == "ok"
            for node in self.nodes
            if node.alive
        )

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.server.close()


def _cluster_info(port: int) -> dict[str, str]:
    with _client(port) as client:
        # redis-py parses CLUSTER INFO into a dict of strings.
        info: dict[str, str] = client.execute_command("CLUSTER INFO")
    return info


# Sentinel


class SentinelProcess:
    """One ``redis-server --sentinel`` on loopback, with its own config file
    (sentinels rewrite theirs, so each gets a private, writable one)."""

    def __init__(self, binary: ServerBinary, monitor: str) -> None:
        self.binary = binary
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"tac-sentinel-{binary.label}-")
        self.directory = Path(self._tmp.name)
        self.config = self.directory / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind {HOST}\ndir {self.directory}\n"
            f"logfile {self.directory / 'sentinel.log'}\n{monitor}",
            encoding="utf-8",
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> SentinelProcess:
        self.process = subprocess.Popen(
            [str(self.binary.path), str(self.config), "--sentinel"],
            stdin=subprocess.DEVNULL,
        )
        process = self.process

        def answers() -> bool:
            if process.poll() is not None:
                log = self.directory / "sentinel.log"
                detail = log.read_text() if log.exists() else ""
                raise RuntimeError(f"sentinel exited at start: {detail[-500:]}")
            with _client(self.port) as client:
                return bool(client.ping())

        wait_until(f"sentinel on port {self.port} answers", answers, timeout)
        return self

    def command(self, *args: Any) -> Any:
        with _client(self.port) as client:
            return client.execute_command(*args)

    def close(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            self.process = None
        self._tmp.cleanup()


class LocalSentinels(_Started):
    """One master, ``replicas`` replicas, ``sentinels`` sentinels (quorum 2)."""

    master_name = "tac-master"

    def __init__(
        self, binary: ServerBinary, replicas: int = 1, sentinels: int = 3
    ) -> None:
        self.binary = binary
        self.master = LocalServer(binary, _FAST_SYNC)
        self.replicas = [
            LocalServer(
                binary, ("--replicaof", HOST, str(self.master.port), *_FAST_SYNC)
            )
            for _ in range(replicas)
        ]
        monitor = (
            f"sentinel monitor {self.master_name} {HOST} {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.master_name} 2000\n"
            f"sentinel failover-timeout {self.master_name} 10000\n"
            f"sentinel parallel-syncs {self.master_name} 1\n"
        )
        self.sentinels = [SentinelProcess(binary, monitor) for _ in range(sentinels)]

    @property
    def servers(self) -> list[LocalServer]:
        return [self.master, *self.replicas]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(HOST, sentinel.port) for sentinel in self.sentinels]

    def start(self, timeout: float = 60.0) -> LocalSentinels:
        deadline = time.monotonic() + timeout
        for server in self.servers:
            server.start()
        for sentinel in self.sentinels:
            sentinel.start()
        wait_until(
            "sentinels see the replicas and each other",
            self.ready,
            max(0.1, deadline - time.monotonic()),
        )
        return self

    def master_port(self, sentinel: SentinelProcess | None = None) -> int:
        """The master's port as one sentinel (by default the first) reports it."""
        reply = (sentinel or self.sentinels[0]).command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name
        )
        return int(reply[1])

    def ready(self) -> bool:
        """Every sentinel: same master, sees every other sentinel, and every
        replica with its link up."""
        master = self.master_port()
        others = len(self.sentinels) - 1
        for sentinel in self.sentinels:
            if self.master_port(sentinel) != master:
                return False
            known = sentinel.command("SENTINEL", "SENTINELS", self.master_name)
            if len(known) != others:
                return False
            replicas = sentinel.command("SENTINEL", "REPLICAS", self.master_name)
            good = [
                r for r in map(_flat_to_dict, replicas)
                if r.get("master-link-status") == "ok"
                and "s_down" not in r.get("flags", "")
            ]  # fmt: skip
            if len(good) != len(self.replicas):
                return False
        return True

    def failover(self, timeout: float = 30.0) -> tuple[int, float]:
        """SENTINEL FAILOVER, then wait until every sentinel names the new
        master and it takes writes. Returns (new master port, seconds)."""
        old = self.master_port()
        started = time.monotonic()
        self.sentinels[0].command("SENTINEL", "FAILOVER", self.master_name)

        def switched() -> bool:
            ports = {self.master_port(s) for s in self.sentinels}
            if len(ports) != 1 or old in ports:
                return False
            new = ports.pop()
            return _info(new, "replication").get("role") == "master"

        wait_until("sentinels agree on a new master", switched, timeout)
        return self.master_port(), time.monotonic() - started

    def close(self) -> None:
        for sentinel in self.sentinels:
            with contextlib.suppress(Exception):
                sentinel.close()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.close()


def _flat_to_dict(flat: Any) -> dict[str, str]:
    if isinstance(flat, dict):
        return {text(k): text(v) for k, v in flat.items()}
    return {text(k): text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


# Shared by the Cluster and Sentinel tests.


def wait_replicated(primary: int, replicas: list[int], timeout: float = 10.0) -> float:
    """Seconds until every replica has what ``primary`` had when called:
    what a test writes before a failover must survive it."""
    target = int(_info(primary, "replication")["master_repl_offset"])
    return wait_until(
        f"replicas of port {primary} caught up",
        lambda: all(
            int(_info(port, "replication").get("slave_repl_offset", -1)) >= target
            for port in replicas
        ),
        timeout,
    )


# A user who may do anything but run scripts (what a managed service that
# forbids them looks like to a worker), on every node of a topology.
NO_SCRIPTS_USER, NO_SCRIPTS_PASSWORD = "noscripts", "pw"


@contextlib.contextmanager
def user_without_scripting(
    ports: list[int], scripting_on: Collection[int] = ()
) -> Iterator[None]:
    """The user on every node of ``ports``; it may run scripts on those of
    ``scripting_on`` (none by default)."""
    rule = ["reset", "on", f">{NO_SCRIPTS_PASSWORD}", "~*", "+@all"]
    for port in ports:
        scripting = [] if port in scripting_on else ["-@scripting"]
        with _client(port) as client:
            client.execute_command("ACL", "SETUSER", NO_SCRIPTS_USER, *rule, *scripting)
    try:
        yield
    finally:
        for port in ports:
            with _client(port) as client:
                client.execute_command("ACL", "DELUSER", NO_SCRIPTS_USER)


def unexpiring_keys(ports: list[int]) -> list[str]:
    """Keys other than streams without an expiry, on the given servers."""
    found = []
    for port in ports:
        with _client(port) as client:
            for key in client.scan_iter(count=1000):
                if client.type(key) != b"stream" and client.pttl(key) == -1:
                    found.append(f"{port}:{text(key)}")
    return found


def _awaiting(coro: Any) -> list[str]:
    """Where a coroutine is suspended, outermost first, down its await chain."""
    where = []
    for _ in range(100):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return where


def _suspended_async_generators() -> list[Any]:
    found = []
    for obj in gc.get_objects():
        with contextlib.suppress(ReferenceError):  # dead weak proxies
            if type(obj) is types.AsyncGeneratorType and obj.ag_await is not None:
                found.append(obj)
    return found


def bounded(seconds: float) -> Callable[[Any], Any]:
    """Fail an async test that runs longer than ``seconds``, showing where
    every task was waiting (cancellation alone could be swallowed by a
    ``suppress(CancelledError)`` on the way and the test pass late)."""

    def decorate(test: Any) -> Any:
        @functools.wraps(test)
        async def run(*args: Any, **kwargs: Any) -> Any:
            task = asyncio.ensure_future(test(*args, **kwargs))
            done, _ = await asyncio.wait({task}, timeout=seconds)
            if not done:
                stacks = "\n".join(
                    f"{other.get_name()}: {' -> '.join(_awaiting(other.get_coro()))}"
                    for other in asyncio.all_tasks()
                    if other is not asyncio.current_task()
                )
                # Async generators suspended mid-await hide their frames
                # from the task's chain.
                stacks += "".join(
                    f"\n{gen.__qualname__}: {' -> '.join(_awaiting(gen))}"
                    for gen in _suspended_async_generators()
                )
                task.cancel()
                await asyncio.wait({task}, timeout=10)
                pytest.fail(f"still running after {seconds} s; tasks:\n{stacks}")
            return task.result()

        return run

    return decorate


REPO_ROOT = Path(__file__).resolve().parent.parent
APP = "tests.topology_app:broker"


class DrillWorkers:
    """``taskiq worker`` processes running ``tests.topology_app``, each in
    its own process group; every one still running is killed on exit."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def start(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("wb")
        self._logs.append(log)
        process = subprocess.Popen(
            worker_command(APP),
            env={**self.env, "TAC_DRILL_WORKER": name, **env},
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def close(self) -> None:
        # SIGKILL: the tests assert on what happened before, and a graceful
        # taskiq shutdown can take seconds.
        for name, process in self.processes.items():
            if process.poll() is None:
                self.kill(name)
        for log in self._logs:
            log.close()

    def __enter__(self) -> DrillWorkers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EventLog:
    """The drill app's events stream on a standalone server, read by the
    harness's ``Events`` (which keeps an event read while waiting for
    another), with waits given in seconds from now."""

    def __init__(self, url: str, stream: str) -> None:
        self.events = Events(AsyncRedis.from_url(url), stream)

    async def wait_for(
        self, event: str, timeout: float, run: str = "", worker: str | None = None
    ) -> float | None:
        """Monotonic time the event was seen, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        return await self.events.wait_for(event, deadline, run, worker)

    async def aclose(self) -> None:
        await self.events.client.aclose()


def message(body: str, queue: str) -> BrokerMessage:
    return BrokerMessage(
        task_id=body, task_name="t", message=body.encode(), labels={"queue_name": queue}
    )


class Consumer:
    """Runs a broker's ``listen()`` in a task, recording (and by default
    acking) every message with the monotonic time it arrived; with ``start``
    each message's task is started first, as taskiq's receiver does. With
    ``detached_acks`` each message is started and acked in a task of its
    own, as taskiq's receiver does: a slow ack holds up no delivery."""

    def __init__(
        self,
        broker: Any,
        ack: bool = True,
        start: bool = False,
        detached_acks: bool = False,
    ) -> None:
        self.broker = broker
        self.ack = ack
        self.start = start
        self.detached_acks = detached_acks
        self.callbacks: set[asyncio.Task[None]] = set()
        self.received: list[tuple[float, str]] = []
        self.listener = broker.listen()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for received in self.listener:
            if self.detached_acks:
                callback = asyncio.create_task(self._start_and_ack(received))
                self.callbacks.add(callback)
                callback.add_done_callback(self.callbacks.discard)
                self.received.append((time.monotonic(), text(received.data)))
                continue
            if self.start:
                await asyncio.create_task(
                    start_as_the_receiver_does(self.broker, received)
                )
            arrived = time.monotonic()
            if self.ack:
                await received.ack()
            # Recorded once acked: a test that stops the consumer as soon as
            # wait_for() returns must not cancel the last ack.
            self.received.append((arrived, text(received.data)))

    async def _start_and_ack(self, received: Any) -> None:
        # One task per message, as the receiver's callback: the broker knows
        # the entry by the task that loaded it until its ack is done.
        if self.start:
            await start_as_the_receiver_does(self.broker, received)
        if self.ack:
            await received.ack()

    @property
    def bodies(self) -> list[str]:
        return [body for _, body in self.received]

    async def wait_for(self, bodies: set[str], timeout: float) -> float | None:
        """Monotonic time the last of ``bodies`` arrived, None after ``timeout``
        (or if the listen loop stopped: its error is raised)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.task.done():
                self.task.result()
                return None
            if bodies <= set(self.bodies):
                return max(t for t, body in self.received if body in bodies)
            await asyncio.sleep(0.02)
        return None

    async def stop(self) -> None:
        # Cancel until it takes: on Python 3.11 a cancellation that lands
        # while redis-py sends a command (asyncio.wait_for around the write)
        # can be lost, and the listen loop carries on.
        for _ in range(50):
            self.task.cancel()
            done, _ = await asyncio.wait({self.task}, timeout=0.2)
            if done:
                break
        else:
            raise RuntimeError("the listen task ignored 50 cancellations")
        error = None if self.task.cancelled() else self.task.exception()
        if error is not None:
            raise error
        await self.listener.aclose()

    async def die(self) -> None:
        """What SIGKILL does in-process: no more reads, heartbeats or acks."""
        await self.stop()
        await self.broker.atomic.heartbeat.stop()
