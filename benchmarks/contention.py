"""Part 4: N claimer processes on one stream and group, claiming flat out.

The workload: a PEL of long-idle entries; every claimer loops claim cycles
for a fixed window and never acks (as if every task outlived idle_timeout,
or the claimer died after claiming), so claimed entries idle out and are
claimable again. After a skipped cycle a claimer waits one claim interval
or not at all, depending on the regime (config.Regime). Each claimer
records every entry it was handed with the time it sent the cycle and the
time the reply arrived.

A double claim is an entry handed to two different claimers within one
lease period (settings.lease). A hand-out happened somewhere between the
cycle's send and its reply, so a pair of hand-outs counts as a double claim
only when even the widest gap it can have had (second reply minus first
send) is under one lease: scheduling noise cannot fake that. Pairs that
only might have been that close (narrowest gap under a lease, widest not)
are reported apart, as ``possible_double_claims``.

Claimers are forked processes (cheap to start, 64 fit on 2 cores), each
with its own connection and event loop. Each reports ready once connected
and prepared; only then does the parent hand out one common window, so
slow starters do not eat into it. Bounded by the window, a cycle cap and a
hard SIGALRM; the parent kills any that are left.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from benchmarks import safety, workload
from benchmarks.config import Mode, Regime
from benchmarks.netpath import LatencyPath
from benchmarks.variants import VARIANTS, Target, coordination_keys, make_claimer

STREAM, GROUP = "bench-contention", "bench-group"
# Far above what one claimer reaches in a window; only a safety bound.
_MAX_CYCLES = 2_000_000
_READY_TIMEOUT_S = 120.0
# Between the last claimer reporting ready and the window opening.
_START_SLACK_S = 0.05


def _wait_for_window(conn: Connection) -> tuple[float, float]:
    conn.send("ready")
    if not conn.poll(_READY_TIMEOUT_S):
        raise TimeoutError("no window from the parent")
    start_at, stop_at = conn.recv()
    return float(start_at), float(stop_at)


async def _claim_loop(spec: dict[str, Any], conn: Connection) -> dict[str, Any]:
    regime: Regime = spec["regime"]
    client = Redis.from_url(spec["url"])
    try:
        claimer = make_claimer(
            spec["variant"],
            client,
            Target.of(STREAM, GROUP, f"claimer-{spec['index']}", regime.arguments),
        )
        await claimer.prepare()
        await client.ping()
        start_at, stop_at = await asyncio.to_thread(_wait_for_window, conn)
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        back_off_s = regime.arguments.claim_interval / 1000 if regime.back_off else 0
        # One tuple per productive cycle: (sent, replied, ids).
        handed: list[tuple[float, float, list[str]]] = []
        cycles = skipped = errors = 0
        while cycles < _MAX_CYCLES and (sent := time.monotonic()) < stop_at:
            try:
                result = await claimer.cycle()
            except RedisError:
                errors += 1
                cycles += 1
                continue
            cycles += 1
            if result.skipped:
                skipped += 1
                if back_off_s:
                    await asyncio.sleep(
                        min(back_off_s, max(0.0, stop_at - time.monotonic()))
                    )
            elif result.ids:
                handed.append((sent, time.monotonic(), result.ids))
        return {
            "cycles": cycles,
            "skipped": skipped,
            "errors": errors,
            "handed": handed,
            "counters": claimer.counters(),
        }
    finally:
        await client.aclose()


def _child(conn: Connection, spec: dict[str, Any]) -> None:
    safety.die_with_parent()
    safety.hard_deadline(_READY_TIMEOUT_S + spec["window_s"] + 60)
    try:
        if spec["path"] is not None:
            spec["path"].enter()
        conn.send(asyncio.run(_claim_loop(spec, conn)))
    except Exception as error:  # reported by the parent
        conn.send({"failed": repr(error)})
    finally:
        conn.close()


def _double_claims(
    results: list[dict[str, Any]], lease_s: float
) -> tuple[int, int, int]:
    """(certain, possible, entries claimed more than once)."""
    by_entry: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for claimer, result in enumerate(results):
        for sent, replied, ids in result["handed"]:
            for entry in ids:
                by_entry[entry].append((sent, replied, claimer))
    certain = possible = again = 0
    for hand_outs in by_entry.values():
        if len(hand_outs) < 2:
            continue
        again += 1
        hand_outs.sort()
        for first, second in itertools.pairwise(hand_outs):
            (sent1, replied1, who1), (sent2, replied2, who2) = first, second
            if who1 == who2:
                continue
            if replied2 - sent1 < lease_s:
                certain += 1
            elif sent2 - replied1 < lease_s:
                possible += 1
    return certain, possible, again


async def _reset(url: str, pending: int) -> None:
    client = Redis.from_url(url)
    try:
        await workload.create(client, STREAM, GROUP, coordination_keys(STREAM, GROUP))
        await workload.add_pending(client, STREAM, GROUP, pending)
    finally:
        await client.aclose()


def _run_one(
    url: str,
    regime: Regime,
    variant: str,
    claimers: int,
    mode: Mode,
    path: LatencyPath | None,
) -> dict[str, Any]:
    """One window; with ``path`` the claimers reach the server through it."""
    asyncio.run(_reset(url, mode.contention_pending))
    context = multiprocessing.get_context("fork")
    processes, pipes = [], []
    try:
        for index in range(claimers):
            parent_end, child_end = context.Pipe(duplex=True)
            spec = {
                "url": path.client_url if path else url,
                "path": path,
                "regime": regime,
                "variant": variant,
                "index": index,
                "window_s": mode.contention_s,
            }
            process = context.Process(
                target=_child, args=(child_end, spec), daemon=True
            )
            process.start()
            child_end.close()
            processes.append(process)
            pipes.append(parent_end)
        ready_by = time.monotonic() + _READY_TIMEOUT_S
        for conn in pipes:
            if not conn.poll(max(0.0, ready_by - time.monotonic())):
                raise RuntimeError(f"a {variant} claimer never got ready")
            message = conn.recv()
            if message != "ready":
                raise RuntimeError(f"{variant} claimer failed to start: {message}")
        start_at = time.monotonic() + _START_SLACK_S
        stop_at = start_at + mode.contention_s
        for conn in pipes:
            conn.send((start_at, stop_at))
        results = []
        for conn in pipes:
            if not conn.poll(max(0.0, stop_at - time.monotonic() + 30)):
                raise RuntimeError(f"a {variant} claimer did not report in time")
            results.append(conn.recv())
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in pipes:
            conn.close()
    failed = [r["failed"] for r in results if "failed" in r]
    if failed:
        raise RuntimeError(f"{variant} claimers failed: {failed[:3]}")
    settings = regime.arguments.settings()
    certain, possible, again = _double_claims(results, settings.lease / 1000)
    handed = sum(len(ids) for r in results for _, _, ids in r["handed"])
    cycles = sum(r["cycles"] for r in results)
    counters: dict[str, int] = defaultdict(int)
    for result in results:
        for key, value in result["counters"].items():
            counters[key] += value
    return {
        "regime": regime.name,
        "rtt_ms": regime.rtt_ms,
        "variant": variant,
        "claimers": claimers,
        "claims_per_s": round(handed / mode.contention_s, 1),
        "double_claims": certain,
        "possible_double_claims": possible,
        "entries_claimed_again": again,
        "cycles_per_s": round(cycles / mode.contention_s, 1),
        "skipped_fraction": round(sum(r["skipped"] for r in results) / cycles, 3)
        if cycles
        else 0.0,
        "errors": sum(r["errors"] for r in results),
        **dict(counters),
        "duration_s": mode.contention_s,
        "lease_ms": settings.lease,
        "idle_timeout_ms": settings.idle_timeout,
    }


def run(
    url: str,
    regimes: tuple[Regime, ...],
    mode: Mode,
    log: Any,
    path: LatencyPath | None,
) -> list[dict[str, Any]]:
    rows = []
    for regime in regimes:
        if regime.rtt_ms and path is None:
            log(f"contention: {regime.name} skipped: no latency path")
            continue
        if regime.rtt_ms and path is not None:
            path.set_rtt(regime.rtt_ms)
        try:
            for claimers in mode.claimers_for(regime.name):
                for variant in VARIANTS:
                    log(f"contention: {regime.name}, {claimers} x {variant}")
                    rows.append(
                        _run_one(
                            url,
                            regime,
                            variant,
                            claimers,
                            mode,
                            path if regime.rtt_ms else None,
                        )
                    )
        finally:
            if regime.rtt_ms and path is not None:
                path.set_rtt(0)
    asyncio.run(_drop(url))
    return rows


async def _drop(url: str) -> None:
    client = Redis.from_url(url)
    try:
        await client.delete(STREAM, *coordination_keys(STREAM, GROUP))
    finally:
        await client.aclose()
