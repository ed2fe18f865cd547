"""Real round-trip latency between the measuring client and the server.

Preferred: ``netem``. A network namespace of our own, a veth pair between it
and the root namespace on a private /30, and a netem qdisc on both ends
adding half the RTT each way. The server (root namespace) listens on
127.0.0.1 and on our veth end; the measuring client runs inside the
namespace (``ip netns exec``) and connects over the veth pair, so nothing
but our own pair is ever delayed or routed.

Fallback: ``proxy``. When namespaces or netem are not available, a
delaying TCP proxy (``benchmarks.delay_proxy``) on 127.0.0.1 sits between
client and server. The run records which method was used and why.

RTT 0 means nothing injected: the bare veth pair, or a direct loopback
connection. The measuring client reports the RTT it actually saw (PING).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

from benchmarks import safety
from benchmarks.config import REPO_ROOT

_NAMESPACE_PREFIX = "tacbench-"
_CLONE_NEWNET = 0x40000000
# Private range for our pair only; a /30 that overlaps nothing on this host.
_POOL = ipaddress.IPv4Network("10.231.0.0/16")


class UnavailableError(RuntimeError):
    """This method cannot inject latency here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=15, check=False
    )
    if check and result.returncode != 0:
        raise UnavailableError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _tc(*args: str, namespace: str | None = None) -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    return subprocess.run(
        [*prefix, "tc", *args], capture_output=True, text=True, timeout=15, check=False
    )


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces an earlier, killed run of this suite left behind."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for name in re.findall(rf"^({_NAMESPACE_PREFIX}(\d+))\b", listing, re.MULTILINE):
        namespace, pid = name
        if int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", namespace, check=False)
            removed.append(namespace)
    return removed


def _networks_in_use() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for args in (("-j", "-4", "addr"), ("-j", "-4", "route", "show", "table", "all")):
        try:
            data = json.loads(_ip(*args).stdout or "[]")
        except (UnavailableError, ValueError):
            continue
        for item in data:
            for info in item.get("addr_info", []):
                used.append(
                    ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", False)
                )
            dst = item.get("dst")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(dst, strict=False))
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    used = _networks_in_use()
    subnets = list(_POOL.subnets(new_prefix=30))
    start = os.getpid() % len(subnets)
    for offset in range(64):
        candidate = subnets[(start + offset) % len(subnets)]
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise UnavailableError(f"no free /30 in {_POOL} for the veth pair")


class NetemPath:
    method = "netem"

    def __init__(self) -> None:
        pid = os.getpid()
        self.namespace = f"{_NAMESPACE_PREFIX}{pid}"
        # Interface names are at most 15 characters.
        self.root_dev = f"tacb{pid % 1_000_000}a"
        self.ns_dev = f"tacb{pid % 1_000_000}b"
        subnet = _free_subnet()
        hosts = list(subnet.hosts())
        self.root_ip, self.ns_ip = str(hosts[0]), str(hosts[1])
        self.prefix = subnet.prefixlen
        self.server_port: int | None = None
        self.rtt_ms = 0.0
        self.injected_rtt_us = 0.0
        self._undo = safety.register(f"namespace {self.namespace}", self.close)
        self.detail = ""

    def open(self) -> NetemPath:
        try:
            _ip("netns", "add", self.namespace)
            _ip(
                "link",
                "add",
                self.root_dev,
                "type",
                "veth",
                "peer",
                "name",
                self.ns_dev,
            )
            _ip("link", "set", self.ns_dev, "netns", self.namespace)
            _ip("addr", "add", f"{self.root_ip}/{self.prefix}", "dev", self.root_dev)
            _ip("link", "set", self.root_dev, "up")
            ns = ("-n", self.namespace)
            _ip(*ns, "addr", "add", f"{self.ns_ip}/{self.prefix}", "dev", self.ns_dev)
            _ip(*ns, "link", "set", self.ns_dev, "up")
            _ip(*ns, "link", "set", "lo", "up")
            probe = _tc(
                "qdisc", "add", "dev", self.root_dev, "root", "netem", "delay", "0ms"
            )
            if probe.returncode != 0:
                raise UnavailableError(f"tc netem: {probe.stderr.strip()}")
            _tc("qdisc", "del", "dev", self.root_dev, "root")
        except UnavailableError:
            self._undo()
            raise
        self.detail = (
            f"netns {self.namespace}, veth {self.root_dev}<->{self.ns_dev} on"
            f" {self.root_ip}/{self.prefix}, netem delay rtt/2 on each end"
        )
        return self

    @property
    def server_args(self) -> tuple[str, ...]:
        # Loopback plus our veth end, nothing else. Protected mode would refuse
        # the namespace's (non-loopback) client: the throwaway server has no
        # password, and only this host's own veth pair reaches that address.
        return ("--bind", "127.0.0.1", self.root_ip, "--protected-mode", "no")

    def attach(self, server_port: int) -> None:
        self.server_port = server_port

    def set_rtt(self, rtt_ms: float) -> None:
        for dev, namespace in ((self.root_dev, None), (self.ns_dev, self.namespace)):
            _tc("qdisc", "del", "dev", dev, "root", namespace=namespace)
            if rtt_ms > 0:
                result = _tc(
                    "qdisc", "add", "dev", dev, "root", "netem",
                    "delay", f"{rtt_ms / 2 * 1000:.0f}us",
                    namespace=namespace,
                )  # fmt: skip
                if result.returncode != 0:
                    raise RuntimeError(f"tc netem on {dev}: {result.stderr.strip()}")
        self.rtt_ms = rtt_ms
        # netem's configured delay; the client reports what it measured.
        self.injected_rtt_us = rtt_ms * 1000

    @property
    def client_url(self) -> str:
        return f"redis://{self.root_ip}:{self.server_port}"

    @property
    def hand_back_url(self) -> str:
        # The client lives in the namespace: its only way to the server.
        return self.client_url

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def enter(self) -> None:
        """Move this (single-threaded, forked) process into our namespace."""
        fd = os.open(f"/run/netns/{self.namespace}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the benchmark namespace")
        finally:
            os.close(fd)

    def close(self) -> None:
        # Deleting the namespace destroys its veth end and with it the pair.
        _ip("netns", "del", self.namespace, check=False)
        _ip("link", "del", self.root_dev, check=False)


def _raw_ping_us(port: int | None, pings: int = 200) -> float:
    """Median PING round trip on a raw socket: the path, not a client library."""
    samples = []
    with socket.create_connection(("127.0.0.1", port or 0), timeout=5) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pings):
            started = time.perf_counter()
            conn.sendall(b"PING\r\n")
            if not conn.recv(64).startswith(b"+PONG"):
                raise RuntimeError("unexpected PING reply through the delay proxy")
            samples.append((time.perf_counter() - started) * 1e6)
    return float(statistics.median(samples))


class ProxyPath:
    method = "proxy"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.server_port: int | None = None
        self.rtt_ms = 0.0
        self._proxy: subprocess.Popen[str] | None = None
        self._proxy_port: int | None = None
        self.injected_rtt_us = 0.0
        self._undo = safety.register("delay proxy", self.close)
        self.detail = (
            "threaded TCP proxy on 127.0.0.1 holding each chunk rtt/2 per direction"
            f" (netem unavailable: {reason})"
        )

    server_args: tuple[str, ...] = ()

    def attach(self, server_port: int) -> None:
        self.server_port = server_port

    def set_rtt(self, rtt_ms: float) -> None:
        """Start a proxy whose measured RTT is ``rtt_ms``, within one correction.

        The proxy's own handoffs and sleep overshoot add a roughly constant
        overhead, so the delay is corrected once by what a first measurement
        showed; ``injected_rtt_us`` is what a raw PING then sees.
        """
        self._stop_proxy()
        self.rtt_ms = rtt_ms
        if rtt_ms <= 0:
            self.injected_rtt_us = _raw_ping_us(self.server_port)
            return
        one_way_us = rtt_ms * 1000 / 2
        self._start_proxy(one_way_us)
        overshoot_us = _raw_ping_us(self._proxy_port) - rtt_ms * 1000
        if overshoot_us > 0:
            self._stop_proxy()
            self._start_proxy(max(0.0, one_way_us - overshoot_us / 2))
        self.injected_rtt_us = _raw_ping_us(self._proxy_port)

    def _start_proxy(self, one_way_us: float) -> None:
        self._proxy = subprocess.Popen(
            [
                sys.executable, "-m", "benchmarks.delay_proxy",
                "--target", f"127.0.0.1:{self.server_port}",
                "--one-way-us", f"{one_way_us:.1f}",
                "--max-seconds", "900",
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO_ROOT,
        )  # fmt: skip
        assert self._proxy.stdout is not None
        line = self._proxy.stdout.readline().strip()
        if not line.isdigit():
            self._stop_proxy()
            raise RuntimeError(f"delay proxy did not start: {line!r}")
        self._proxy_port = int(line)

    @property
    def client_url(self) -> str:
        port = self._proxy_port if self.rtt_ms > 0 else self.server_port
        return f"redis://127.0.0.1:{port}"

    @property
    def hand_back_url(self) -> str:
        # Harness traffic skips the proxy: only the timed calls pay the RTT.
        return f"redis://127.0.0.1:{self.server_port}"

    def command(self, argv: list[str]) -> list[str]:
        return argv

    def enter(self) -> None:
        return None

    def _stop_proxy(self) -> None:
        if self._proxy is not None:
            self._proxy.kill()
            self._proxy.wait(timeout=10)
            if self._proxy.stdout is not None:
                self._proxy.stdout.close()
            self._proxy = None
            self._proxy_port = None

    def close(self) -> None:
        self._stop_proxy()


LatencyPath = NetemPath | ProxyPath


def open_path(method: str) -> LatencyPath:
    """``auto`` tries netem and falls back to the proxy, saying why."""
    if method == "proxy":
        return ProxyPath("proxy requested with --latency-method proxy")
    if os.geteuid() != 0:
        reason = "not root: cannot create a network namespace"
    else:
        remove_stale_namespaces()
        try:
            return NetemPath().open()
        except (UnavailableError, OSError, subprocess.TimeoutExpired) as error:
            reason = str(error)
    if method == "netem":
        raise UnavailableError(reason)
    return ProxyPath(reason)
