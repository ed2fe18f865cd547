"""``python -m benchmarks``: every part, one server, one results file.

Parts, in order: claim_cycle (latency per RTT, round trips, server time,
upstream fidelity), contention, scale, e2e (SIGKILL drill), throughput,
mass_recovery (a fleet drains dead consumers' entries), fleet_idle (what an
idle fleet costs the server), longest_calls (each operation's longest call
in a mass recovery with large payloads), kicks (kick throughput with and
without idempotent XADD), hotpath (what every task pays: drain, worker
CPU, round trips and server time per task, light-load latency).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import (
    claim_cycle,
    contention,
    end_to_end,
    fleet_idle,
    hotpath,
    kicks,
    longest_calls,
    machine,
    mass_recovery,
    netpath,
    report,
    safety,
    scale,
    throughput,
    watchdog,
)
from benchmarks.config import MODES, REGIMES
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    ServerBinary,
    default_binary,
    find_binaries,
)

PARTS = (
    "claim_cycle",
    "contention",
    "scale",
    "e2e",
    "throughput",
    "mass_recovery",
    "fleet_idle",
    "longest_calls",
    "kicks",
    "hotpath",
)
DEFAULT_SERVER = Path("/usr/bin/redis-server")
# Servers built from source once by the test suite's setup, by label; a run
# may name one before it is built and is then skipped, not failed.
BUILT_SERVERS = Path("/var/cache/taskiq-atomic-claim")
KNOWN_BUILDS = ("redis-8.6.3",)


class ServerAbsentError(Exception):
    """A --server that names a known build not present on this machine."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Atomic claim vs client-side locking: latency under RTT,"
        " contention, scale, crash recovery and throughput.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="short run (< 2 min)")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="every part, very briefly, for the test suite (figures meaningless)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--plot",
        type=Path,
        help="draw the latency-vs-RTT PNG here (needs matplotlib: the bench"
        " extra); without it no plot is drawn",
    )
    parser.add_argument(
        "--server",
        help="server binary path or label such as redis-6.2.14 or"
        f" {', '.join(KNOWN_BUILDS)} (from {BUILT_SERVERS}; the run is skipped"
        f" if it is not built) (default: Redis 7.0 at {DEFAULT_SERVER} if"
        " present, else the newest found)",
    )
    parser.add_argument(
        "--latency-method",
        choices=("auto", "netem", "proxy"),
        default="auto",
        help="auto: netem in a network namespace, else the loopback delay proxy",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: print the report and redraw the plot from a saved run",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated subset of: {','.join(PARTS)}",
    )
    parser.add_argument(
        "--hotpath-before",
        type=Path,
        help="a source tree of another commit (git archive) run as one more"
        " hotpath variant, atomic@before, in the same run",
    )
    args = parser.parse_args(argv)
    if args.plot:
        # Checked before measuring, not after minutes of it; only --plot pays
        # for the import.
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError as error:
            parser.error(
                "--plot needs matplotlib: pip install 'taskiq-atomic-claim[bench]'"
                f" ({error})"
            )
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return args


def _describe_binary(path: Path) -> ServerBinary:
    out = subprocess.run(
        [str(path), "--version"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout
    match = re.search(r"v=(\d+\.\d+\.\d+)", out)
    if match is None:
        raise SystemExit(f"{path} --version did not say which version it is")
    flavor = "valkey" if out.lower().startswith("valkey") else "redis"
    return ServerBinary(flavor, match.group(1), path)


def choose_binary(choice: str | None) -> ServerBinary:
    found = find_binaries()
    if choice is None:
        if DEFAULT_SERVER.exists():
            return _describe_binary(DEFAULT_SERVER)
        return default_binary()
    for binary in found:
        if choice in (binary.label, str(binary.path)):
            return binary
    if choice in KNOWN_BUILDS:
        built = BUILT_SERVERS / choice / "redis-server"
        if not built.exists():
            raise ServerAbsentError(
                f"--server {choice}: not built yet ({built} is absent)"
            )
        return _describe_binary(built)
    path = Path(choice)
    if not path.exists():
        labels = ", ".join(b.label for b in found)
        raise SystemExit(f"--server {choice}: no such binary (found: {labels})")
    return _describe_binary(path)


def _finite(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _from_json(args: argparse.Namespace) -> int:
    results = json.loads(args.from_json.read_text())
    print(report.render(results))
    if args.plot and report.plot(results, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json:
        return _from_json(args)
    try:
        binary = choose_binary(args.server)
    except ServerAbsentError as absent:
        print(f"skipped: {absent}", file=sys.stderr)
        return 0
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    safety.install()
    started = time.monotonic()
    stall = watchdog.Watchdog(mode.stall_limit_s)
    stall.start()

    def log(message: str) -> None:
        stall.progress()
        print(
            f"[{time.monotonic() - started:6.1f} s] {message}",
            file=sys.stderr,
            flush=True,
        )

    results: dict[str, Any] = {
        "mode": mode.name,
        "command": " ".join(["python -m benchmarks", *argv]),
    }
    path: netpath.LatencyPath | None = None
    try:
        if {"claim_cycle", "contention"} & set(args.parts):
            path = netpath.open_path(args.latency_method)
            log(f"latency injection: {path.method}: {path.detail}")
        with LocalServer(binary, extra_args=path.server_args if path else ()) as server:
            log(f"server {binary.label} on port {server.port}")
            results["machine"] = machine.describe(
                binary,
                server.url,
                path.method if path else None,
                path.detail if path else "",
            )
            if path is not None:
                path.attach(server.port)
            if "claim_cycle" in args.parts and path is not None:
                results.update(claim_cycle.run(server.port, path, mode, log))
            if "contention" in args.parts:
                results["contention_regimes"] = {
                    r.name: {
                        **r.arguments.as_dict(),
                        "back_off": r.back_off,
                        "why": r.why,
                    }
                    for r in REGIMES
                }
                results["contention"] = contention.run(
                    server.url, REGIMES, mode, log, path
                )
            if "scale" in args.parts:
                results["scale"] = scale.run(server.url, mode, log)
            if "e2e" in args.parts:
                results["e2e"] = end_to_end.run(server.url, mode, log)
            if "throughput" in args.parts:
                results["throughput"] = throughput.run(
                    server.url, mode.throughput_messages, mode.throughput_reps, log
                )
            if "mass_recovery" in args.parts:
                results["mass_recovery"] = mass_recovery.run(server.url, mode, log)
            if "fleet_idle" in args.parts:
                results["fleet_idle"] = fleet_idle.run(
                    server.url, server.port, mode, log
                )
            if "longest_calls" in args.parts:
                results["longest_calls"] = longest_calls.run(server.url, mode, log)
            if "kicks" in args.parts:
                results["kicks"] = kicks.run(
                    server.url, mode.kick_messages, mode.kick_reps, log
                )
            if "hotpath" in args.parts:
                results["hotpath"] = hotpath.run(
                    server.url, server.port, mode, log, args.hotpath_before
                )
    finally:
        stall.stop()
        if path is not None:
            path.close()
        safety.run_all()
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["targets"] = report.targets(results)
    results = _finite(results)
    print(report.render(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {args.json}")
    # Only --plot draws, and only it needs matplotlib.
    if args.plot and report.plot(results, args.plot):
        log(f"wrote {args.plot}")
    return 0
