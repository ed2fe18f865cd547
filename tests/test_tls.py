"""rediss:// end to end: Debian's Redis 7 with TLS, certificates made here.

The test makes a CA and a server certificate for 127.0.0.1 with the
``openssl`` command, starts ``redis-server`` with a TLS port next to its
plain one (the plain port is only for start-up checks and cleanup), and runs
the broker and the CLI over ``rediss://`` against it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq.message import BrokerMessage
from taskiq.utils import maybe_awaitable

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    find_binaries,
    free_port,
)
from taskiq_atomic_claim.scripts import LIBRARY
from tests.conftest import assert_every_key_expires, server_command
from tests.test_cli import cli

pytestmark = pytest.mark.tls

IDLE_MS, INTERVAL_MS = 400, 100


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(
        ["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60
    )


def make_certificates(directory: Path) -> None:
    """ca.crt, and server.crt/key plus client.crt/key signed by it."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=taskiq-atomic-claim test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    for name, usage, san in (
        ("server", "serverAuth", "subjectAltName=IP:127.0.0.1"),
        ("client", "clientAuth", "subjectAltName=DNS:worker"),
    ):
        (directory / f"{name}.ext").write_text(
            f"{san}\nextendedKeyUsage={usage}\nkeyUsage=critical,digitalSignature\n"
            "authorityKeyIdentifier=keyid\n"
        )
        _openssl(
            "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}",
            cwd=directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", f"{name}.ext",
            cwd=directory,
        )  # fmt: skip


@dataclass(frozen=True)
class TlsServer:
    local: LocalServer
    tls_port: int
    certificates: Path

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}"

    @property
    def ca(self) -> str:
        return str(self.certificates / "ca.crt")


def _redis_7() -> LocalServer | None:
    for binary in find_binaries():
        if binary.flavor == "redis" and binary.major == 7:
            return LocalServer(binary)
    return None


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    probe = _redis_7()
    if probe is None:
        pytest.skip("no Redis 7 binary (Debian's redis-server) found")
    probe.close()
    certificates = tmp_path_factory.mktemp("tls")
    make_certificates(certificates)
    tls_port = free_port()
    local = LocalServer(
        probe.binary,
        extra_args=(
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(certificates / "server.crt"),
            "--tls-key-file", str(certificates / "server.key"),
            "--tls-ca-cert-file", str(certificates / "ca.crt"),
            "--tls-auth-clients", "optional",
        ),
    )  # fmt: skip
    try:
        local.start()
    except RuntimeError as error:
        local.close()
        if "tls" in str(error).lower():
            pytest.skip(f"{probe.binary.label} was built without TLS: {error}")
        raise
    try:
        yield TlsServer(local, tls_port, certificates)
    finally:
        local.close()


@pytest.fixture
async def admin(tls_server: TlsServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(tls_server.url, ssl_ca_certs=tls_server.ca)
    await client.flushall()
    yield client
    try:
        await assert_every_key_expires(client)
    finally:
        await client.aclose()


def message(body: str) -> BrokerMessage:
    return BrokerMessage(task_id=body, task_name="t", message=body.encode(), labels={})


async def test_the_connection_really_is_tls(
    tls_server: TlsServer, admin: Redis
) -> None:
    info = await admin.info("server")
    assert int(info["tcp_port"]) == tls_server.local.port
    # A plain client speaking to the TLS port gets no answer it can read.
    plain = Redis.from_url(f"redis://127.0.0.1:{tls_server.tls_port}", socket_timeout=2)
    with pytest.raises(Exception):  # noqa: B017 (closed or timed out)
        await plain.ping()
    await plain.aclose()


async def test_broker_round_trip_and_reclaim_over_tls(
    tls_server: TlsServer, admin: Redis
) -> None:
    common: dict[str, Any] = {
        "idle_timeout": IDLE_MS,
        "claim_interval": INTERVAL_MS,
        "xread_block": 200,
        "ssl_ca_certs": tls_server.ca,
    }
    dead = AtomicRedisStreamBroker(tls_server.url, consumer_name="dead", **common)
    alive = AtomicRedisStreamBroker(tls_server.url, consumer_name="alive", **common)
    await dead.startup()
    await alive.startup()
    try:
        await dead.kick(message("over-tls"))
        listener = dead.listen()
        first = await asyncio.wait_for(listener.__anext__(), 3)
        assert first.data == b"over-tls"
        await listener.aclose()
        await dead.atomic.heartbeat.stop()
        dead.atomic.in_flight.clear()  # it "died": nothing handed back
        reclaimed = await asyncio.wait_for(
            alive.listen().__anext__(), (IDLE_MS + INTERVAL_MS) / 1000 + 3
        )
        assert reclaimed.data == b"over-tls"
        await maybe_awaitable(reclaimed.ack())
        assert alive.metrics.snapshot()["claimed"] == 1
        assert (await admin.xpending("taskiq", "taskiq"))["pending"] == 0
    finally:
        await dead.shutdown()
        await alive.shutdown()


async def test_cli_over_tls(tls_server: TlsServer, admin: Redis) -> None:
    await server_command(admin, "FUNCTION", "FLUSH")
    tls = ("--url", tls_server.url, "--tls-ca-cert", tls_server.ca)
    missing = cli("check", *tls)
    assert missing.returncode == 1, missing.stderr
    loaded = cli("load", *tls)
    assert loaded.returncode == 0, loaded.stderr
    assert LIBRARY.name in loaded.stdout
    current = cli("check", *tls)
    assert current.returncode == 0, current.stdout + current.stderr
    await admin.xgroup_create("jobs", "workers", id="0", mkstream=True)
    shown = cli("inspect", *tls)
    assert shown.returncode == 0, shown.stderr
    assert "stream 'jobs'" in shown.stdout and "current" in shown.stdout
    mutual = cli(
        "inspect",
        *tls,
        "--json",
        "--tls-cert",
        str(tls_server.certificates / "client.crt"),
        "--tls-key",
        str(tls_server.certificates / "client.key"),
    )
    assert mutual.returncode == 0, mutual.stderr
    doctor = cli("doctor", *tls)
    assert doctor.returncode == 0, doctor.stdout


def test_an_unverified_server_is_a_one_line_error(tls_server: TlsServer) -> None:
    # Without the CA the server's certificate cannot be verified.
    result = cli("check", "--url", tls_server.url)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "certificate" in result.stderr.lower()
