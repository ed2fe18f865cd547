"""``python -m benchmarks``: every part, on each server named, one results file.

Parts, in order: hotpath (what every task pays: drain rate, worker CPU and
server time per task, light-load kick-to-start delay), e2e (SIGKILL ->
re-run), mass_recovery (a fleet drains dead consumers' entries while new
tasks flow), orphan_drain (how fast real workers work off a crash's no-op
orphans), fleet_idle (what an idle fleet costs the server). Each against
taskiq-redis 1.2.4 in the same run. See ``benchmarks/README.md``.
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
    end_to_end,
    fleet_idle,
    hotpath,
    machine,
    mass_recovery,
    orphan_drain,
    report,
    safety,
    watchdog,
)
from benchmarks.config import MODES, Mode
from taskiq_atomic_claim.harness.embedded_server import (
    LocalServer,
    ServerBinary,
    default_binary,
    find_binaries,
)

PARTS = ("hotpath", "e2e", "mass_recovery", "orphan_drain", "fleet_idle")
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
        description="This package against taskiq-redis 1.2.4: the hot path,"
        " crash recovery, mass recovery and an idle fleet's cost.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="short run (minutes)")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="every part, very briefly, for the test suite (figures meaningless)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--server",
        action="append",
        help="server binary path or label such as redis-7.0.15 or"
        f" {', '.join(KNOWN_BUILDS)} (from {BUILT_SERVERS}; skipped if not"
        " built); repeat it to run every part on each server in turn"
        f" (default: Redis 7.0 at {DEFAULT_SERVER} if present, else the newest"
        " found)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: print the report of a saved results file",
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


def _run_server(
    binary: ServerBinary, args: argparse.Namespace, mode: Mode, log: Any
) -> dict[str, Any]:
    """Every part asked for, on one server: one run of the results file."""
    started = time.monotonic()
    run: dict[str, Any] = {"mode": mode.name}
    with LocalServer(binary) as server:
        log(f"server {binary.label} on port {server.port}")
        run["machine"] = machine.describe(binary, server.url)
        if "hotpath" in args.parts:
            run["hotpath"] = hotpath.run(
                server.url, server.port, mode, log, args.hotpath_before
            )
        if "e2e" in args.parts:
            run["e2e"] = end_to_end.run(server.url, mode, log)
        if "mass_recovery" in args.parts:
            run["mass_recovery"] = mass_recovery.run(server.url, mode, log)
        if "orphan_drain" in args.parts:
            run["orphan_drain"] = orphan_drain.run(server.url, mode, log)
        if "fleet_idle" in args.parts:
            run["fleet_idle"] = fleet_idle.run(server.url, server.port, mode, log)
    run["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    run["elapsed_s"] = round(time.monotonic() - started, 1)
    return run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json:
        print(report.render(json.loads(args.from_json.read_text())))
        return 0
    binaries = []
    for choice in args.server or [None]:
        try:
            binaries.append(choose_binary(choice))
        except ServerAbsentError as absent:
            print(f"skipped: {absent}", file=sys.stderr)
    if not binaries:
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

    command = " ".join(["python -m benchmarks", *argv])
    try:
        runs = [
            {"command": command, **_run_server(binary, args, mode, log)}
            for binary in binaries
        ]
    finally:
        stall.stop()
    results = _finite({"runs": runs})
    print(report.render(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0
