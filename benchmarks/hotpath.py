"""The hot path: what every task pays, with dead-lettering on and off.

One real ``taskiq worker`` (one process, ``--max-async-tasks 32
--max-prefetch 32``, xread_count 32) per broker variant, started on a queue
where ``tasks`` no-op tasks wait. Per variant, interleaved (the order
rotates every repetition), medians reported:

- drain: from the worker's first read to nothing left unread or pending
  (polled every ``_POLL_S``), and the worker process's CPU over that time
  (``/proc``), per 1k tasks;
- server time per task: INFO commandstats over the drain, outer commands
  only (a script's nested commands are inside its FCALL/EVALSHA figure, a
  transaction's inside its EXEC; MULTI and EXEC counted for every variant;
  the poller's and the worker's one-off startup commands left out), and the
  server process's CPU per task beside it;
- round trips per task: a smaller drain with the worker connected through
  the turn-counting proxy (every connection it opens), counted from its
  first read to the end;
- light load: after the drains, one idle worker per variant, all at
  once, each on its own queue; every 20 ms a round kicks one task to each,
  spread evenly over the round in an order that rotates every round, so
  every variant meets the same machine at the same moments. The load is
  split over several sets of fresh workers, one set after the other, each
  started in a rotated order: a worker process keeps a speed of its own, so
  one process per variant would measure its process. Kick-to-start delay
  (the task's wall clock minus the kick's), p50 and p99 of all sets pooled,
  after a warm-up per worker; the ratios' intervals resample the sets and
  their rounds.

``before``: a source tree (``git archive`` of an older commit) to run as
one more variant, "atomic@before", in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from benchmarks.config import REPO_ROOT
from benchmarks.counting_proxy import TurnCountingProxy
from benchmarks.server_cpu import stat_bases
from benchmarks.stats import p50, paired_ratio_interval, percentile, ratio, rotated

UPSTREAM = "upstream_1_2_4"
ATOMIC = "atomic"
ATOMIC_NONE = "atomic_none"
BEFORE = "atomic@before"
# Variant -> the app's HOTPATH_BROKER.
_KINDS = {
    UPSTREAM: "upstream",
    ATOMIC: "atomic",
    ATOMIC_NONE: "atomic_none",
    BEFORE: "atomic",
}
_SLOTS = "32"
_POLL_S = 0.02
_LIGHT_EVERY_S = 0.02
_LIGHT_WARMUP = 50
# The light load runs on this many sets of fresh worker processes (fewer
# where each would get under _LIGHT_MIN_PER_PROCESS tasks): a process keeps
# a speed of its own for its whole life.
_LIGHT_PROCESSES = 5
_LIGHT_MIN_PER_PROCESS = 50
# Not the worker's per-task work: its startup, the harness's polling.
_NOT_HOT = {
    "xinfo", "xpending", "config", "info", "ping", "client", "hello", "xgroup",
    "function", "script", "xadd", "type", "exists", "select", "del", "command",
}  # fmt: skip
# Outer commands: a script's usec holds the commands it ran, and EXEC's
# holds its transaction's (which commandstats also lists on their own
# lines): counted once, in the script or the EXEC.
_OUTER = {"xreadgroup", "fcall", "evalsha", "eval", "fcall_ro", "multi", "exec"}
# Sent outside any script or transaction: this package's ack and forget,
# taskiq-redis's XACK.
_PLAIN = {"xack", "xackdel", "hdel"}
_CLK = os.sysconf("SC_CLK_TCK")


def variants(before: Path | None) -> list[str]:
    found = [ATOMIC, ATOMIC_NONE, UPSTREAM]
    if before is not None:
        found.append(BEFORE)
    return found


def task_message(task_name: str, args: list[Any]) -> bytes:
    return json.dumps(
        {
            "task_id": uuid.uuid4().hex,
            "task_name": task_name,
            "labels": {},
            "labels_types": {},
            "args": args,
            "kwargs": {},
        }
    ).encode()


async def _prepare(url: str, queue: str, tasks: int) -> None:
    admin = Redis.from_url(url)
    try:
        await admin.delete(queue)
        await admin.xgroup_create(queue, "taskiq", id="0", mkstream=True)
        for first in range(0, tasks, 1000):
            async with admin.pipeline(transaction=False) as pipe:
                for _ in range(first, min(first + 1000, tasks)):
                    pipe.xadd(queue, {"data": task_message("bench.noop", [])})
                await pipe.execute()
    finally:
        await admin.aclose()


def _worker(
    variant: str, url: str, queue: str, before: Path | None, latency_file: str = ""
) -> subprocess.Popen[bytes]:
    tree = before if variant == BEFORE and before is not None else REPO_ROOT
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree}{os.pathsep}{REPO_ROOT}",
        "HOTPATH_BROKER": _KINDS[variant],
        "HOTPATH_URL": url,
        "HOTPATH_QUEUE": queue,
        "HOTPATH_COUNT": _SLOTS,
        "HOTPATH_LATENCY_FILE": latency_file,
    }
    taskiq = Path(sys.executable).with_name("taskiq")
    command = [str(taskiq)] if taskiq.exists() else [sys.executable, "-m", "taskiq"]
    # fmt: off
    arguments = [
        *command, "worker", "benchmarks.hotpath_app:broker",
        "--workers", "1",
        "--max-async-tasks", _SLOTS,
        "--max-prefetch", _SLOTS,
        "--log-level", "WARNING",
    ]
    # fmt: on
    return subprocess.Popen(
        arguments,
        env=env,
        cwd=tree,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    # Measured already; its queue is deleted after it, so no need to wait
    # for a graceful shutdown.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _cpu_s(pid: int) -> float:
    """The process's CPU (user + system), seconds; its taskiq worker child's
    when it is ``taskiq worker``'s manager."""
    total = 0.0
    for each in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLK
    return total


async def _group(admin: Redis, queue: str) -> dict[str, Any]:
    groups = await admin.xinfo_groups(queue)
    return next(g for g in groups if g["name"] in (b"taskiq", "taskiq"))


async def _wait_first_read(admin: Redis, queue: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        group = await _group(admin, queue)
        if int(group.get("entries-read") or 0) > 0:
            return
        await asyncio.sleep(_POLL_S / 4)
    raise RuntimeError("the worker never read")


async def _wait_drained(admin: Redis, queue: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        group = await _group(admin, queue)
        if int(group["pending"]) == 0 and int(group.get("lag") or 0) == 0:
            return
        await asyncio.sleep(_POLL_S)
    raise RuntimeError("not drained in time")


def _server_usec(stats: dict[str, tuple[int, int]]) -> float:
    """Outer commands' usec (see ``_OUTER`` and ``_PLAIN``). The claim's HDEL
    of a crashed entry's count runs inside its script and is counted twice:
    rare, and only against this package."""
    return float(
        sum(usec for name, (_, usec) in stats.items() if name in _OUTER | _PLAIN)
    )


async def _server_cpu(admin: Redis) -> float:
    info = await admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _drain(
    variant: str, url: str, mode: Any, before: Path | None, rep: int
) -> dict[str, Any]:
    """The drain's figures."""
    tasks = mode.hotpath_tasks
    queue = f"bench-hotpath-{variant}-{rep}"
    await _prepare(url, queue, tasks)
    admin = Redis.from_url(url)
    await admin.config_resetstat()
    worker = _worker(variant, url, queue, before)
    try:
        deadline = time.monotonic() + 60 + tasks / 200
        await _wait_first_read(admin, queue, deadline)
        began, cpu0 = time.monotonic(), _cpu_s(worker.pid)
        server0 = await _server_cpu(admin)
        await _wait_drained(admin, queue, deadline)
        wall, cpu1 = time.monotonic() - began, _cpu_s(worker.pid)
        server1 = await _server_cpu(admin)
        stats = stat_bases(await admin.info("commandstats"))
    finally:
        _stop(worker)
        await admin.delete(queue)
        await admin.aclose()
    figures = {
        "drain_s": wall,
        "tasks_per_s": tasks / wall,
        "worker_cpu_per_1k_s": (cpu1 - cpu0) / tasks * 1000,
        "server_usec_per_task": _server_usec(stats) / tasks,
        "server_cpu_usec_per_task": (server1 - server0) / tasks * 1e6,
    }
    hot = {k: v for k, v in stats.items() if k not in _NOT_HOT}
    return figures | {"commandstats": hot}


@contextlib.contextmanager
def _proxy(port: int) -> Iterator[TurnCountingProxy]:
    """The turn-counting proxy, on an event loop of its own thread."""
    loop = asyncio.new_event_loop()
    proxy = TurnCountingProxy(port)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(proxy.__aenter__())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.__aexit__(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def _round_trips(
    variant: str, url: str, port: int, tasks: int, before: Path | None
) -> float:
    queue = f"bench-hotpath-rt-{variant}"
    await _prepare(url, queue, tasks)
    admin = Redis.from_url(url)
    try:
        with _proxy(port) as proxy:
            worker = _worker(variant, proxy.url, queue, before)
            try:
                deadline = time.monotonic() + 60 + tasks / 50
                await _wait_first_read(admin, queue, deadline)
                proxy.reset()
                await _wait_drained(admin, queue, deadline)
                turns = proxy.turns
            finally:
                _stop(worker)
    finally:
        await admin.delete(queue)
        await admin.aclose()
    return turns / tasks


def _light(
    url: str, names: list[str], before: Path | None, tasks: int
) -> dict[str, list[list[float]]]:
    """Kick-to-start delays (ms) per variant, one list per worker process:
    the load split over ``_LIGHT_PROCESSES`` sets of fresh workers, one
    after the other, each set started in an order that rotates (see the
    module's docstring)."""
    sets = max(1, min(_LIGHT_PROCESSES, tasks // _LIGHT_MIN_PER_PROCESS))
    delays: dict[str, list[list[float]]] = {v: [] for v in names}
    for n in range(sets):
        share = tasks // sets + (1 if n < tasks % sets else 0)
        measured = asyncio.run(_light_set(url, rotated(names, n), before, share))
        for variant in names:
            delays[variant].append(measured[variant])
    return delays


async def _light_set(
    url: str, names: list[str], before: Path | None, tasks: int
) -> dict[str, list[float]]:
    """One set of idle workers, one per variant started in ``names``'s
    order, kicked in turn; the first ``_LIGHT_WARMUP`` tasks of each are
    left out (a new worker's first calls)."""
    queues = {v: f"bench-hotpath-light-{v}" for v in names}
    admin = Redis.from_url(url)
    with contextlib.ExitStack() as files:
        outs = {
            v: Path(files.enter_context(tempfile.NamedTemporaryFile("r")).name)
            for v in names
        }
        workers = []
        try:
            for variant in names:
                await _prepare(url, queues[variant], 0)
                workers.append(
                    _worker(variant, url, queues[variant], before, str(outs[variant]))
                )
            rounds = _LIGHT_WARMUP + tasks
            deadline = time.monotonic() + 60 + rounds * _LIGHT_EVERY_S * 2
            await _wait_all_idle(admin, len(names), deadline)
            gap = _LIGHT_EVERY_S / len(names)
            for turn in range(rounds):
                for variant in rotated(names, turn):
                    kicked = time.monotonic()
                    message = task_message("bench.timed", [time.time()])
                    await admin.xadd(queues[variant], {"data": message})
                    await asyncio.sleep(max(0.0, kicked + gap - time.monotonic()))
            while time.monotonic() < deadline:
                if all(len(out.read_text().split()) >= rounds for out in outs.values()):
                    break
                await asyncio.sleep(0.05)
        finally:
            for worker in workers:
                _stop(worker)
            await admin.delete(*queues.values())
            await admin.aclose()
        return {
            v: [float(line) * 1000 for line in out.read_text().split()][_LIGHT_WARMUP:]
            for v, out in outs.items()
        }


async def _wait_all_idle(admin: Redis, workers: int, deadline: float) -> None:
    """Every worker's read blocks (a consumer is not listed in its group
    before its first entry on Redis 7.0), then a second more for their
    startup's one-off calls."""
    while time.monotonic() < deadline:
        if int((await admin.info("clients"))["blocked_clients"]) >= workers:
            await asyncio.sleep(1.0)
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the light load's workers never went idle")


def _summary(variant: str, drains: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": variant, "reps": len(drains)}
    # (calls, usec) per command over each drain, for reading the figure.
    row["each_commandstats"] = [d.pop("commandstats") for d in drains]
    for key in drains[0]:
        row[key] = round(p50([d[key] for d in drains]), 3)
        row[f"each_{key}"] = [round(d[key], 3) for d in drains]
    return row


def run(
    url: str, port: int, mode: Any, log: Any, before: Path | None = None
) -> dict[str, Any]:
    names = variants(before)
    drains: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
    for rep in range(mode.hotpath_reps):
        # No variant always runs first, on a warmer or colder server.
        for variant in rotated(names, rep):
            log(f"hotpath: drain {mode.hotpath_tasks} tasks, {variant}, rep {rep + 1}")
            drains[variant].append(asyncio.run(_drain(variant, url, mode, before, rep)))
    log(f"hotpath: light load, {mode.hotpath_light} tasks to each variant in turn")
    per_process = _light(url, names, before, mode.hotpath_light)
    light = {v: [d for one in per_process[v] for d in one] for v in names}
    rows = []
    for variant in names:
        log(f"hotpath: round trips, {variant}")
        row = _summary(variant, drains[variant])
        row["round_trips_per_task"] = (
            round(
                asyncio.run(
                    _round_trips(variant, url, port, mode.hotpath_rt_tasks, before)
                ),
                3,
            )
            if mode.hotpath_rt_tasks
            else None
        )
        row["light_tasks"] = len(light[variant])
        row["light_p50_ms"] = round(p50(light[variant]), 3)
        row["light_p99_ms"] = round(percentile(light[variant], 99), 3)
        rows.append(row)
    return {
        "light_intervals": _light_intervals(per_process),
        "settings": {
            "tasks": mode.hotpath_tasks,
            "reps": mode.hotpath_reps,
            "round_trip_tasks": mode.hotpath_rt_tasks,
            "light_tasks": mode.hotpath_light,
            "light_processes": len(per_process[names[0]]),
            "light_warmup": _LIGHT_WARMUP,
            "light_every_ms": _LIGHT_EVERY_S * 1000,
            "max_async_tasks": int(_SLOTS),
            "max_prefetch": int(_SLOTS),
            "xread_count": int(_SLOTS),
        },
        "rows": rows,
    }


def _light_intervals(light: dict[str, list[list[float]]]) -> dict[str, list[float]]:
    """The light-load ratios' 95% intervals (atomic / upstream, worker
    processes and rounds resampled: ``stats.paired_ratio_interval``): how
    far one run's ratio can be trusted."""
    if ATOMIC not in light or UPSTREAM not in light:
        return {}
    mine, theirs = light[ATOMIC], light[UPSTREAM]
    return {
        key: [round(x, 3) for x in paired_ratio_interval(mine, theirs, stat)]
        for key, stat in (
            ("light_p50_ms", p50),
            ("light_p99_ms", lambda xs: percentile(xs, 99)),
        )
    }


# This package with defaults against upstream: (key, label, goal or None for
# a figure shown without one, whether higher is better). p99 is shown, not
# held to a goal: identical code lands up to 5% either side of it in one run.
GOALS: tuple[tuple[str, str, float | None, bool], ...] = (
    ("tasks_per_s", "drain rate", 1.3, True),
    ("worker_cpu_per_1k_s", "worker CPU per 1k tasks", 0.75, False),
    ("server_usec_per_task", "server us per task (commandstats)", 1.2, False),
    ("light_p50_ms", "light-load kick-to-start p50", 1.05, False),
    ("round_trips_per_task", "round trips per task", None, False),
    ("light_p99_ms", "light-load kick-to-start p99", None, False),
)


def targets(part: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not part:
        return []
    rows = {r["variant"]: r for r in part["rows"]}
    mine, theirs = rows.get(ATOMIC), rows.get(UPSTREAM)
    intervals = part.get("light_intervals", {})
    out = []
    for key, label, goal, higher in GOALS:
        measured = float("nan")
        if mine and theirs and None not in (mine.get(key), theirs.get(key)):
            measured = ratio(mine[key], theirs[key])
        if measured != measured:
            result = "not measured"
        elif goal is None:
            result = "info"
        else:
            result = (
                "PASS" if (measured >= goal if higher else measured <= goal) else "MISS"
            )
        out.append(
            {
                "target": f"hot path: {label}, atomic (defaults) / upstream",
                "measured": None if measured != measured else round(measured, 3),
                "goal": "-" if goal is None else f"{'>=' if higher else '<='} {goal}",
                "result": result,
                "note": f"medians: atomic {mine.get(key) if mine else '-'},"
                f" upstream {theirs.get(key) if theirs else '-'}"
                + _interval_note(intervals.get(key)),
            }
        )
    return out


def _interval_note(interval: list[float] | None) -> str:
    if not interval:
        return ""
    low, high = interval
    return (
        f"; 95% interval {low:.2f}-{high:.2f} (worker processes and rounds resampled)"
    )


COLUMNS = (
    ("variant", "variant"),
    ("drain s", "drain_s"),
    ("tasks/s", "tasks_per_s"),
    ("worker CPU s/1k", "worker_cpu_per_1k_s"),
    ("round trips/task", "round_trips_per_task"),
    ("server us/task", "server_usec_per_task"),
    ("server CPU us/task", "server_cpu_usec_per_task"),
    ("light p50 ms", "light_p50_ms"),
    ("light p99 ms", "light_p99_ms"),
)
