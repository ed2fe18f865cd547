"""The report: each run's tables and targets, from the results file.

Every figure printed comes from the results; the targets compare measured
ratios with their goals and say PASS, MISS, info (a figure shown with no goal
of its own), not measured, or no verdict (a configuration the brokers refuse
or change: ``config.refusal``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from benchmarks import hotpath
from benchmarks.config import refusal
from benchmarks.stats import ratio

Row = dict[str, Any]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _numeric(cell: str) -> bool:
    return (
        cell == "-" or cell.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()
    )


def table(headers: list[str], rows: Iterable[list[Any]]) -> str:
    """Plain-text table: numeric columns right-aligned, text left-aligned."""
    body = [[_fmt(v) for v in row] for row in rows]
    cells = [headers, *body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = [all(_numeric(row[i]) for row in body) for i in range(len(headers))]
    lines = [
        "  ".join(
            cell.rjust(width) if align else cell.ljust(width)
            for cell, width, align in zip(row, widths, right, strict=True)
        ).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _find(rows: list[Row], **match: Any) -> Row | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _target(
    name: str,
    measured: float | None,
    goal: str,
    ok: bool | None,
    note: str,
    refused: str | None = None,
) -> Row:
    if measured is not None and math.isnan(measured):
        measured, ok = None, None
    if refused is not None:
        result = "no verdict"
        note = f"the brokers refuse this configuration: {refused}"
    elif ok is not None:
        result = "PASS" if ok else "MISS"
    elif measured is not None and goal == "-":
        result = "info"
    else:
        result = "not measured"
    return {
        "target": name,
        "measured": measured,
        "goal": goal,
        "result": result,
        "note": note,
    }


def targets(run: dict[str, Any]) -> list[Row]:
    out = list(hotpath.targets(run.get("hotpath")))
    out += _e2e_targets(run.get("e2e", []))
    out += _mass_targets(run.get("mass_recovery", []))
    out += _idle_targets(run)
    return out


def _e2e_targets(rows: list[Row]) -> list[Row]:
    out = []
    for queue in ("idle", "busy"):
        mine = _find(rows, broker="atomic", queue=queue)
        if mine is None:
            continue
        theirs = _find(rows, broker="upstream_1_2_4", queue=queue)
        measured = mine["p99_s"]
        ok = (
            mine["recovered"] == mine["kills"]
            and measured is not None
            and measured <= mine["bound_s"]
        )
        out.append(
            _target(
                f"SIGKILL->rerun p99, {queue} queue ({_kills(mine)})",
                measured,
                f"<= {mine['bound_s']} s (idle+interval+0.25)",
                ok,
                f"upstream 1.2.4: {_upstream(theirs)}",
                refusal(
                    idle_timeout=mine["idle_timeout_ms"],
                    claim_interval=mine["claim_interval_ms"],
                ),
            )
        )
    return out


def _mass_targets(rows: list[Row]) -> list[Row]:
    """The issue names no numbers; these goals are the harness's reading of
    "reclaims as fast as it can execute" and "new messages keep flowing"."""
    mine = _find(rows, broker="atomic")
    others = "; ".join(
        f"{r['broker']}{_batch(r)}: drain {_drain(r)}, new p99"
        f" {_fmt(r['new_wait_p99_s'])} s"
        for r in rows
        if r["broker"] != "atomic"
    )
    if mine is None:
        return []
    drain = mine["drain_s"]
    over_floor = ratio(drain, mine["floor_s"]) if drain is not None else math.nan
    scene = (
        f"{mine['orphans']} orphans of {mine['dead_consumers']} dead consumers,"
        f" {mine['workers']} workers x {mine['slots']} slots, {mine['task_s']} s"
        " tasks"
    )
    wait_goal = 5 * mine["task_s"]
    p99 = mine["new_wait_p99_s"]
    large = next((r for r in rows if r["broker"] == "atomic_large_batch"), None)
    return [
        _target(
            "mass recovery: drain time / execution floor (defaults)",
            over_floor if drain is not None else None,
            "<= 2",
            # Not drained within the bound is a MISS, not "not measured".
            False if drain is None else over_floor <= 2,
            f"drain {_drain(mine)}, floor {_fmt(mine['floor_s'])} s ({scene});"
            f" {others}",
        ),
        _target(
            "mass recovery: new-task p99 wait, s (defaults)",
            p99,
            f"<= {_fmt(wait_goal)} (5 tasks)",
            None if p99 is None else p99 <= wait_goal and mine["new_censored"] == 0,
            f"p50 {_fmt(mine['new_wait_p50_s'])} s, {mine['new_kicked']} kicked at"
            f" {_fmt(mine['new_per_s'])}/s, {mine['new_censored']} never started;"
            " read with the drain: a slow drain leaves slots free",
        ),
        # "A worker never claims far more than it can start soon", whatever
        # the batch size.
        _new_wait_target(large, wait_goal),
    ]


def _new_wait_target(row: Row | None, goal: float) -> Row:
    name = "mass recovery: new-task p99 wait, s (large batch)"
    if row is None:
        return _target(name, None, "-", None, "not run")
    p99 = row["new_wait_p99_s"]
    return _target(
        name + _batch(row),
        p99,
        f"<= {_fmt(goal)} (5 tasks)",
        None if p99 is None else p99 <= goal and row["new_censored"] == 0,
        f"drain {_drain(row)}; p50 {_fmt(row['new_wait_p50_s'])} s,"
        f" {row['new_censored']} of {row['new_kicked']} never started",
        refusal(batch_size=row["settings"].get("unacknowledged_batch_size")),
    )


def _batch(row: Row) -> str:
    batch = row["settings"].get("unacknowledged_batch_size")
    return f" (batch {batch})" if batch else ""


def _drain(row: Row) -> str:
    if row["drain_s"] is None:
        return f"not done in {_fmt(row['cap_s'])} s ({row['orphans_left']} left)"
    return f"{_fmt(row['drain_s'])} s"


def native_claim(results: dict[str, Any]) -> bool:
    """Redis >= 8.4 claims with XREADGROUP ... CLAIM: no script on that path."""
    version = results.get("machine", {}).get("server", {}).get("redis_version")
    label = results.get("machine", {}).get("server", {}).get("label", "")
    if not version or not str(label).startswith("redis-"):
        return False
    major, minor = (int(x) for x in str(version).split(".")[:2])
    return (major, minor) >= (8, 4)


def _idle_values(rows: list[Row], key: str, **match: Any) -> list[float]:
    """``key`` over the interleaved rounds of one shape and broker."""
    return [
        float(r[key])
        for r in rows
        if key in r and all(r.get(k) == v for k, v in match.items())
    ]


def _idle_median(rows: list[Row], key: str, **match: Any) -> float:
    values = _idle_values(rows, key, **match)
    return float(statistics.median(values)) if values else math.nan


def _idle_spread(rows: list[Row], key: str, **match: Any) -> str:
    """Upstream's own rounds, highest / lowest: the A/A noise of ``key``."""
    values = _idle_values(rows, key, **match)
    if len(values) < 2 or min(values) <= 0:
        return ""
    return f"; upstream's rounds spread {max(values) / min(values):.2f}x"


def _idle_targets(results: dict[str, Any]) -> list[Row]:
    """Issue 40's goal: an idle fleet's server CPU at most 1.5x taskiq-redis's
    (which never reclaims on an idle queue), medians of interleaved rounds;
    command time and commands are shown beside it."""
    rows = results.get("fleet_idle", [])
    path = "native CLAIM path" if native_claim(results) else "Lua path"
    out: list[Row] = []
    shapes = sorted(
        {(r["workers"], r["streams"], r["idle_timeout"]) for r in rows},
        key=lambda s: (-s[0] * s[1], s[2] or 0),
    )
    for workers, streams, idle in shapes:
        shape = dict(workers=workers, streams=streams, idle_timeout=idle)
        name = f"idle fleet {workers}x{streams}" + (
            f", idle_timeout {idle / 1000:g} s" if idle else ", defaults"
        )
        for key, what, limit in (
            ("commands_per_s", "commands/s", None),
            ("server_usec_per_s", "command time us/s", None),
            ("server_cpu_usec_per_s", "server CPU us/s", 1.5),
        ):
            mine = _idle_median(rows, key, broker="atomic", **shape)
            theirs = _idle_median(rows, key, broker="upstream_1_2_4", **shape)
            value = ratio(mine, theirs)
            out.append(
                _target(
                    f"{name}: atomic / upstream {what}",
                    value,
                    "-" if limit is None else f"<= {limit:g} ({path})",
                    None if math.isnan(value) or limit is None else value <= limit,
                    f"atomic {_fmt(mine)} vs upstream {_fmt(theirs)}"
                    + _idle_spread(rows, key, broker="upstream_1_2_4", **shape),
                    refusal(idle_timeout=idle),
                )
            )
    return out


def _kills(row: Row | None) -> str:
    return f"{row['recovered']}/{row['kills']} recovered" if row else "not run"


def _upstream(row: Row | None) -> str:
    if row is None:
        return "not run"
    if row["recovered"] == 0:
        return f"0/{row['kills']} recovered within {row['not_recovered_within_s']} s"
    return (
        f"{row['recovered']}/{row['kills']} recovered, p50 {_fmt(row['p50_s'])} s,"
        f" p99 {_fmt(row['p99_s'])} s"
    )


def render(results: dict[str, Any]) -> str:
    """Every run of a results file, one after the other, then the targets
    that compare two of them."""
    parts = [render_run(run) for run in results["runs"]]
    across = drain_targets(results["runs"])
    if across:
        parts.append(targets_table("Targets across runs", across))
    return "\n\n\n".join(parts)


def targets_table(title: str, found: list[Row]) -> str:
    return f"{title}\n" + table(
        ["target", "measured", "goal", "result", "note"],
        (
            [t["target"], t["measured"], t["goal"], t["result"], t["note"]]
            for t in found
        ),
    )


def _drain_rate(run: dict[str, Any]) -> float | None:
    rates = [r["per_s"] for r in run.get("orphan_drain", [])]
    if not rates or None in rates:
        return None
    return float(statistics.median(rates))


def drain_targets(runs: list[dict[str, Any]]) -> list[Row]:
    """The Lua path's orphan drain against the native path's, the same
    workers on two servers of one results file."""
    lua = [r for r in runs if r.get("orphan_drain") and not native_claim(r)]
    native = [r for r in runs if r.get("orphan_drain") and native_claim(r)]
    out = []
    for a in lua:
        for b in native:
            rate_a, rate_b = _drain_rate(a), _drain_rate(b)
            measured = None if rate_a is None or rate_b is None else rate_a / rate_b
            out.append(
                _target(
                    "orphan drain: Lua path / native path rate",
                    measured,
                    ">= 0.5",
                    None if measured is None else measured >= 0.5,
                    f"{_label(a)} {_fmt(rate_a)}/s, {_label(b)} {_fmt(rate_b)}/s"
                    " (medians)",
                )
            )
    return out


def _label(run: dict[str, Any]) -> str:
    return str(run.get("machine", {}).get("server", {}).get("label"))


def render_run(run: dict[str, Any]) -> str:
    parts: list[str] = []
    m = run.get("machine", {})
    packages = ", ".join(f"{k} {v}" for k, v in m.get("packages", {}).items())
    parts.append(
        f"Run: {run.get('command')}\n"
        f"Machine: {m.get('cores')} cores, {m.get('cpu_model')}, Python"
        f" {m.get('python')}, {packages}\n"
        f"Server {m.get('server', {}).get('label')}, {m.get('date')}, load"
        f" {m.get('load_average_start')} -> {m.get('load_average_end')};"
        f" mode {run.get('mode')}, {run.get('elapsed_s')} s"
    )
    if run.get("hotpath"):
        hot = run["hotpath"]
        settings = hot["settings"]
        sets = settings.get("light_processes", 1)
        parts.append(
            f"Hot path ({settings['tasks']} no-op tasks drained by one taskiq"
            " worker, --max-async-tasks 32 --max-prefetch 32; medians of"
            f" {settings['reps']} reps; light load: every variant's idle worker"
            f" at once, one task each every {settings['light_every_ms']:.0f} ms,"
            f" kicked in turn; {sets} set{'s' if sets != 1 else ''} of fresh"
            " workers, pooled)\n"
            + table(
                [label for label, _ in hotpath.COLUMNS],
                ([r.get(key) for _, key in hotpath.COLUMNS] for r in hot["rows"]),
            )
        )
    if run.get("e2e"):
        parts.append(
            "End to end: SIGKILL -> re-run (s)\n"
            + table(
                [
                    "broker",
                    "queue",
                    "recovered",
                    "p50",
                    "p99",
                    "max",
                    "bound",
                    "gave up at",
                ],
                (
                    [
                        r["broker"],
                        r["queue"],
                        f"{r['recovered']}/{r['kills']}",
                        r["p50_s"],
                        r["p99_s"],
                        r["max_s"],
                        r["bound_s"],
                        r["not_recovered_within_s"],
                    ]
                    for r in run["e2e"]
                ),
            )
        )
    if run.get("mass_recovery"):
        parts.append(
            "Mass recovery: orphans of dead consumers re-run by a live fleet,"
            " new tasks kicked meanwhile (s)\n"
            + table(
                [
                    "broker",
                    "orphans",
                    "workers x slots",
                    "task s",
                    "floor",
                    "drain",
                    "left",
                    "reruns",
                    "new kicked",
                    "new p50",
                    "new p99",
                    "new max",
                    "never started",
                ],
                (
                    [
                        r["broker"] + _batch(r),
                        r["orphans"],
                        f"{r['workers']}x{r['slots']}",
                        r["task_s"],
                        r["floor_s"],
                        r["drain_s"],
                        r["orphans_left"],
                        r["orphan_reruns"],
                        r["new_kicked"],
                        r["new_wait_p50_s"],
                        r["new_wait_p99_s"],
                        r["new_wait_max_s"],
                        r["new_censored"],
                    ]
                    for r in run["mass_recovery"]
                ),
            )
        )
    if run.get("orphan_drain"):
        parts.append(
            "Orphan drain: no-op orphans of dead consumers worked off by real"
            " workers at defaults\n"
            + table(
                ["orphans", "workers", "drain s", "per s", "left"],
                (
                    [
                        r["orphans"],
                        r["workers"],
                        r["drain_s"],
                        r["per_s"],
                        r["orphans_left"],
                    ]
                    for r in run["orphan_drain"]
                ),
            )
        )
    if run.get("fleet_idle"):
        parts.append(
            "Idle fleet: server load per second (commandstats deltas; top-level"
            " share from MONITOR; server CPU from INFO cpu)\n"
            + table(
                [
                    "broker",
                    "workers x streams",
                    "idle_timeout",
                    "window s",
                    "commands/s",
                    "with nested/s",
                    "command us/s",
                    "server CPU us/s",
                    "calls/s",
                ],
                (
                    [
                        r["broker"],
                        f"{r['workers']}x{r['streams']}",
                        r["idle_timeout"] or "default",
                        r["idle_s"],
                        r["commands_per_s"],
                        r["with_nested_per_s"],
                        r["server_usec_per_s"],
                        r.get("server_cpu_usec_per_s", "-"),
                        " ".join(
                            f"{name} {_fmt(n)}" for name, n in r["calls_per_s"].items()
                        ),
                    ]
                    for r in run["fleet_idle"]
                ),
            )
        )
    found = targets(run)
    if found:
        parts.append(targets_table("Targets", found))
    return "\n\n".join(parts)
