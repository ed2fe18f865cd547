"""What the figures were measured on, recorded with them."""

from __future__ import annotations

import datetime
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from taskiq_atomic_claim.harness.embedded_server import ServerBinary, find_binaries

_PACKAGES = ("taskiq-atomic-claim", "taskiq", "taskiq-redis", "redis")


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(binary: ServerBinary, url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        info: Any = client.info("server")
    finally:
        client.close()
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "server": {
            "label": binary.label,
            "binary": str(binary.path),
            "redis_version": info.get("redis_version"),
            "valkey_version": info.get("valkey_version"),
        },
        "servers_found": [found.label for found in find_binaries()],
        "packages": {name: _version(name) for name in _PACKAGES},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        # Other work on the machine shows up here, and in the noise.
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
