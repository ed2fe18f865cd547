"""The setup command against real servers, run as users run it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from taskiq_atomic_claim.cli import main
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    default_binary,
    free_port,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LIBRARY, LibraryState, LoadMode, ScriptRunner
from tests.conftest import Server, server_command


async def cli_in_process(
    capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``main`` in this process (a thread: it runs its own event loop), for
    tests that run many commands: exit code, stdout, stderr."""
    code = await asyncio.to_thread(main, list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli(*args: str, redis_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it; with ``REDIS_URL`` only if given."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    return subprocess.run(
        [sys.executable, "-m", "taskiq_atomic_claim.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


async def test_check_fails_until_load_then_passes(server: Server, redis: Redis) -> None:
    await server_command(redis, "SCRIPT", "FLUSH")
    if server.major >= 7:
        await server_command(redis, "FUNCTION", "FLUSH")
    missing = cli("check", "--url", server.url)
    assert missing.returncode == 1
    assert "missing" in missing.stdout

    loaded = cli("load", "--url", server.url)
    assert loaded.returncode == 0, loaded.stderr
    assert LIBRARY.name in loaded.stdout
    again = cli("load", "--url", server.url)
    assert again.returncode == 0, again.stderr

    current = cli("check", "--url", server.url)
    assert current.returncode == 0, current.stdout + current.stderr
    assert "current" in current.stdout


async def test_check_reports_an_older_library_as_outdated(
    server: Server, redis: Redis
) -> None:
    runner = ScriptRunner()
    if await runner.mode(redis) is not LoadMode.FUNCTIONS:
        return  # scripts have no names to be outdated by; covered above
    await server_command(redis, "FUNCTION", "FLUSH")
    await server_command(
        redis,
        "FUNCTION",
        "LOAD",
        "#!lua name=taskiq_atomic_claim_000000000000\n"
        "redis.register_function('tac_000000000000_claim', function() return 1 end)",
    )
    status = await runner.status(redis)
    assert status.state is LibraryState.OUTDATED
    assert status.other_versions == ("taskiq_atomic_claim_000000000000",)
    result = cli("check", "--url", server.url)
    assert result.returncode == 1
    assert "outdated" in result.stdout
    assert "taskiq_atomic_claim_000000000000" in result.stdout
    await runner.load(redis)
    assert (await runner.status(redis)).state is LibraryState.CURRENT
    await server_command(redis, "FUNCTION", "FLUSH")


def test_bad_url_is_one_line_and_non_zero() -> None:
    result = cli("load", "--url", "http://nowhere")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "bad --url" in result.stderr


def test_unreachable_server_is_one_line_and_non_zero() -> None:
    result = cli("check", "--url", f"redis://127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "ConnectionError" in result.stderr


def test_help_names_every_command() -> None:
    result = cli("--help")
    assert result.returncode == 0
    for command in ("load", "check", "drill"):
        assert command in result.stdout


def test_missing_url_is_a_usage_error() -> None:
    result = cli("load")
    assert result.returncode == 2
    assert "--url" in result.stderr
    assert "REDIS_URL" in result.stderr


@contextlib.contextmanager
def password_protected() -> Iterator[int]:
    """The port of a server of its own whose default user needs a password."""
    with LocalServer(default_binary()) as local:
        with sync_redis.Redis(port=local.port) as admin:
            admin.config_set("requirepass", "s3cret")
        yield local.port


async def test_a_missing_password_is_one_line_saying_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without one the server's own text is about HELLO (RESP3) or a
    # username-password pair.
    monkeypatch.delenv("REDIS_URL", raising=False)
    with password_protected() as port:
        for command, url in [
            ("inspect", f"redis://127.0.0.1:{port}"),
            ("dead-letters", f"redis://default@127.0.0.1:{port}"),
        ]:
            code, _, err = await cli_in_process(capsys, command, "--url", url)
            assert code == 2, err
            assert err.count("\n") == 1, err
            assert f"127.0.0.1:{port} requires a password" in err
        wrong = f"redis://:wrong@127.0.0.1:{port}"
        code, _, err = await cli_in_process(capsys, "doctor", "--url", wrong)
        assert code == 2
        assert "refused the URL's username and password" in err
        monkeypatch.setenv("REDIS_URL", f"redis://:s3cret@127.0.0.1:{port}")
        code, _, err = await cli_in_process(capsys, "inspect")
        assert code == 0, err


async def test_url_falls_back_to_redis_url(
    server: Server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Credentials stay off command lines (and out of ps).
    monkeypatch.setenv("REDIS_URL", server.admin_url)
    code, out, err = await cli_in_process(capsys, "inspect", "--json")
    assert code == 0, err
    address = urlsplit(server.admin_url).netloc.rpartition("@")[2]
    assert json.loads(out)["node"] == address
    code, _, _ = await cli_in_process(
        capsys, "inspect", "--json", "--url", "redis://127.0.0.1:1"
    )
    assert code == 2, "--url wins over REDIS_URL"


async def test_dead_letters_listed_and_requeued(server: Server, redis: Redis) -> None:
    keys = StreamKeys("jobs", "workers")
    ids = [
        text(
            await redis.xadd(
                keys.dead_letters,
                {
                    "data": f"t{n}",
                    "dead_letter_id": f"1-{n}",
                    "dead_letter_deliveries": "6",
                    "dead_letter_reason": "max_deliveries exceeded",
                },
            )
        )
        for n in range(3)
    ]
    listed = cli(
        "dead-letters", "--url", server.url, "--queue", "jobs", "--group", "workers"
    )
    assert listed.returncode == 0, listed.stderr
    assert "3 dead letters" in listed.stdout
    assert all(entry_id in listed.stdout for entry_id in ids)

    one = cli(
        "requeue",
        "--url",
        server.url,
        "--queue",
        "jobs",
        "--group",
        "workers",
        "--id",
        ids[0],
    )
    assert one.returncode == 0, one.stderr
    assert await redis.xlen("jobs") == 1
    unknown = cli(
        "requeue",
        "--url",
        server.url,
        "--queue",
        "jobs",
        "--group",
        "workers",
        "--id",
        "5-5",
    )
    assert unknown.returncode == 1
    assert "5-5" in unknown.stderr
    rest = cli(
        "requeue", "--url", server.url, "--queue", "jobs", "--group", "workers", "--all"
    )
    assert rest.returncode == 0, rest.stderr
    assert "2 requeued" in rest.stdout
    assert await redis.xlen("jobs") == 3
    assert await redis.xlen(keys.dead_letters) == 0


def test_requeue_needs_ids_or_all() -> None:
    result = cli("requeue", "--url", "redis://127.0.0.1:1")
    assert result.returncode == 2
    assert "--id" in result.stderr


class NotRedisPeer:
    """A loopback TCP server that answers every command with ``*1 :42``: it
    speaks RESP but is not Redis (what the CLI meets at a wrong port)."""

    REPLY = b"*1\r\n:42\r\n"

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self.closed.is_set():
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                # One reply per command: each starts with a "*" array header.
                commands = sum(line.startswith(b"*") for line in data.split(b"\r\n"))
                conn.sendall(self.REPLY * max(1, commands))

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


@pytest.fixture
def not_redis() -> Iterator[NotRedisPeer]:
    peer = NotRedisPeer()
    yield peer
    peer.close()


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["inspect", "--json"],
        ["load"],
        ["check"],
        ["doctor"],
        ["dead-letters"],
        ["requeue", "--all"],
        ["acl"],
        ["doctor", "--cluster"],
    ],
)
def test_a_server_that_is_not_redis_is_one_line_and_exit_2(
    not_redis: NotRedisPeer, command: list[str]
) -> None:
    url = f"redis://127.0.0.1:{not_redis.port}"
    result = cli(*command, "--url", url)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "is not a Redis or Valkey" in result.stderr or "did not answer" in (
        result.stderr
    )
    assert f"127.0.0.1:{not_redis.port}" in result.stderr
