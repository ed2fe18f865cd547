"""Which servers the suite runs on, and that CI covers the ones it must."""

from __future__ import annotations

import os

import pytest

from tests.conftest import (
    _BINARIES,
    DOCKER_UNREACHABLE,
    _server_params,
    missing_servers,
)


def test_testcontainers_redis_when_docker_answers() -> None:
    # The container is one of the `server` fixture's params; when Docker
    # answers, it is in the matrix and serves the Redis the suite names.
    if DOCKER_UNREACHABLE is not None:
        pytest.skip(f"testcontainers server not used: {DOCKER_UNREACHABLE}")
    assert "container" in _server_params()
    from testcontainers.redis import RedisContainer  # noqa: PLC0415

    with RedisContainer("redis:7.4") as container:
        client = container.get_client()
        try:
            assert client.ping()
            assert str(client.info("server")["redis_version"]).startswith("7.4.")
        finally:
            client.close()


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI requirement only")
def test_ci_covers_redis_62_70_and_valkey_81() -> None:
    found = set(_BINARIES)
    required = {"redis-6.2.14", "redis-7.0.15", "valkey-8.1.8", "valkey-9.1.2"}
    assert required <= found, f"servers found: {sorted(found)}"


def test_redis_86_runs_or_the_reason_is_said() -> None:
    # Built by .ci/build-redis, which may fail (no network, no compiler):
    # then the server is skipped, and this says why.
    reason = missing_servers().get("redis-8.6")
    if reason is not None:
        pytest.skip(f"redis-8.6.3 not in the suite: {reason}")
    assert "redis-8.6.3" in _BINARIES
