"""What the chaos soak counts: its report, the workers' execution log, the
dead letters it watches and the pending entries left (``soak.py`` runs it).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.settings import DEFAULT_MAX_DELIVERIES

GROUP = "taskiq"
PAGE = 10_000
POISONED = "max_deliveries exceeded"  # the dead-letter reason of a poison task


@dataclass
class SoakReport:
    server: str
    messages: int
    workers: int
    planned_kills: int = 0
    planned_graceful: int = 0
    planned_empty: int = 0
    rate: float = 0.0  # kicks per second
    task_seconds: float = 0.0
    accepted: int = 0
    executed: int = 0  # finished at least once
    left_pending: int = 0
    kills: int = 0
    graceful_restarts: int = 0
    # Stops that had to be finished with SIGKILL (no clean exit in 10 s).
    graceful_forced: int = 0
    aof_restarts: int = 0
    empty_restarts: int = 0
    duplicates: int = 0  # extra finished runs of one message
    # Delivered and unacked by the worker when it was killed or stopped.
    in_flight_at_kills: int = 0
    # Kicks resent after an error that may have followed a write: each may
    # have added its message twice (the producer's own at-least-once).
    resent_kicks: int = 0
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    # Tasks that kill their own worker each time they start: each must end
    # in the dead letters after exactly max_deliveries starts.
    planned_poison: int = 0
    poison_kicked: int = 0
    poison_dead_lettered: int = 0  # once, reason POISONED, max_deliveries starts
    poison_starts: dict[str, int] = field(default_factory=dict)  # ran, by run
    poison_starting: dict[str, int] = field(default_factory=dict)  # see Starts
    poison_deaths: int = 0  # workers that died on their own (the poison)
    unexplained_exits: int = 0  # died on their own, no poison started there
    dead_letters: int = 0
    dead_never_started: int = 0  # innocent, never started: lost by us too
    # Innocent, started max_deliveries times in workers that then died (so
    # the promise allows it); any other innocent dead letter is lost by us.
    dead_innocent_crashed: int = 0
    # The same, where a poison task killed some of those workers: allowed as
    # max_deliveries is defined (it ran and its worker died), but innocent.
    dead_innocent_beside_poison: int = 0
    accepted_before_empty: int = 0
    accepted_after_empty: int = 0
    lost_with_server_data: int = 0
    lost_by_us: int = 0
    examples: list[str] = field(default_factory=list)  # of what went wrong
    recovery_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.accepted == self.messages
            and self.kills == self.planned_kills
            and self.graceful_restarts == self.planned_graceful
            and self.aof_restarts == 1
            and self.empty_restarts == self.planned_empty
            and self.lost_by_us == 0
            and self.dead_never_started == 0
            and self.poison_kicked == self.planned_poison
            and self.poison_dead_lettered == self.poison_kicked
            and self.unexplained_exits == 0
            and self.left_pending == 0
            and self.duplicates <= self.in_flight_at_kills + self.resent_kicks
        )

    def lines(self) -> list[str]:
        recovery = sorted(self.recovery_s)
        p99 = (
            recovery[min(len(recovery) - 1, int(len(recovery) * 0.99))]
            if recovery
            else 0
        )
        return [
            f"server {self.server}, {self.workers} workers, {self.elapsed_s:.1f} s,"
            f" producer {self.rate:.0f} kicks/s, tasks {self.task_seconds:.3f} s",
            f"messages {self.messages}, accepted {self.accepted} (before the empty"
            f" restart {self.accepted_before_empty}, after"
            f" {self.accepted_after_empty}), executed {self.executed},"
            f" left pending {self.left_pending}",
            f"kills (SIGKILL) {self.kills}, graceful restarts (SIGTERM)"
            f" {self.graceful_restarts} ({self.graceful_forced} forced),"
            f" server restarts: from AOF {self.aof_restarts}, empty"
            f" {self.empty_restarts}",
            f"duplicates {self.duplicates} (allowed: in flight at the kills and"
            f" stops {self.in_flight_at_kills} + kicks resent {self.resent_kicks})",
            f"poison tasks {self.poison_kicked}: dead-lettered after"
            f" {self.max_deliveries} starts {self.poison_dead_lettered}; ran /"
            f" starting: {_by_run(self.poison_starts, self.poison_starting)};"
            " workers they killed"
            f" {self.poison_deaths}, workers that exited unexplained"
            f" {self.unexplained_exits}",
            f"dead letters {self.dead_letters}: innocent never started"
            f" {self.dead_never_started}; innocent started and crashed"
            f" {self.max_deliveries} times: in workers the chaos killed"
            f" {self.dead_innocent_crashed}, beside a poison task"
            f" {self.dead_innocent_beside_poison}",
            f"lost by us {self.lost_by_us}; lost with the server's data"
            f" {self.lost_with_server_data} (accepted before the empty restart,"
            " unfinished, gone from the stream)",
            "recovery after a kill (until the killed worker's entries were"
            f" reclaimed): median {statistics.median(recovery or [0]):.2f} s,"
            f" p99 {p99:.2f} s, max {max(recovery or [0]):.2f} s"
            f" over {len(recovery)} kills",
            *(f"  {example}" for example in self.examples),
            "PASS" if self.ok else "FAIL",
        ]


def _by_run(ran: Mapping[str, int], starting: Mapping[str, int]) -> str:
    return ", ".join(f"{run} {n}/{starting[run]}" for run, n in ran.items()) or "-"


@dataclass
class Starts:
    """The workers each run reported in: "starting" before the broker
    counted the start, "started" (ran) after."""

    ran_in: defaultdict[str, list[str]] = field(
        default_factory=lambda: defaultdict(list)
    )
    starting_in: defaultdict[str, list[str]] = field(
        default_factory=lambda: defaultdict(list)
    )


@dataclass(frozen=True)
class Letter:
    run: str
    reason: str
    deliveries: int  # the crash count the broker recorded


def judge_dead_letters(
    report: SoakReport,
    letters: list[Letter],
    starts: Starts,
    died: set[str],
    poison: Collection[str],
) -> None:
    """Every poison task in the dead letters once, with reason POISONED and
    max_deliveries starts; an innocent one only if it started max_deliveries
    times in workers that ``died`` (killed, or by a poison task), else it is
    lost by us.

    The broker counts a start between the two reports ``starts`` holds: a
    worker killed in between (a poison task beside it killed it) leaves a
    count the task never reported. So per run: ran <= counted <= starting.
    """
    limit = report.max_deliveries
    report.dead_letters = len(letters)
    report.poison_kicked = len(poison)
    report.poison_starts = {run: len(starts.ran_in[run]) for run in poison}
    report.poison_starting = {run: len(starts.starting_in[run]) for run in poison}
    poisoned = {worker for run in poison for worker in starts.ran_in[run]}
    by_run: defaultdict[str, list[Letter]] = defaultdict(list)
    for letter in letters:
        by_run[letter.run].append(letter)
    for run in poison:
        moved = [(x.reason, x.deliveries) for x in by_run.pop(run, [])]
        ran, starting = report.poison_starts[run], report.poison_starting[run]
        if moved == [(POISONED, limit)] and ran <= limit <= starting:
            report.poison_dead_lettered += 1
        else:
            _example(
                report,
                f"poison {run}: ran {ran} times, starting {starting},"
                f" dead letters {moved}",
            )
    for run, found in by_run.items():
        workers = starts.starting_in[run]
        crashed_in = [worker for worker in workers if worker in died]
        if len(crashed_in) < limit:
            report.lost_by_us += 1
            report.dead_never_started += not workers
            _example(
                report,
                f"dead letter {run} (innocent) starting {len(workers)} times,"
                f" {len(crashed_in)} in workers that died: {found[0].reason}",
            )
        elif len([w for w in crashed_in if w not in poisoned]) >= limit:
            # The chaos alone killed it often enough: allowed.
            report.dead_innocent_crashed += 1
            _example(report, f"dead letter {run}: crashed {len(crashed_in)} times")
        else:
            # A poison's neighbour: suspects run alone (suspects.py),
            # so a poison must never take it to the dead letters.
            report.lost_by_us += 1
            report.dead_innocent_beside_poison += 1
            _example(
                report,
                f"dead letter {run}: crashed {len(crashed_in)} times,"
                f" {len(poisoned.intersection(crashed_in))} beside a poison task",
            )


def _example(report: SoakReport, line: str) -> None:
    if len(report.examples) < 10:
        report.examples.append(line)


def _run_id(data: bytes | None) -> str | None:
    """The drill task's first argument (its run id) from a message's data."""
    try:
        return str(json.loads(data or b"")["args"][0])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def _pages(client: Redis, stream: str, after: str) -> list[Any]:
    """Every entry of ``stream`` after id ``after`` ("-": all), in bounded pages."""
    entries: list[Any] = []
    for _ in range(10_000):
        start = "-" if after == "-" else f"({after}"
        page: Any = await client.xrange(stream, min=start, count=PAGE)
        entries.extend(page)
        if len(page) < PAGE:
            break
        after = page[-1][0].decode()
    return entries


class ExecutionLog:
    """What the workers report, read incrementally: which runs started and
    which finished, however many times, and when each worker was seen ready."""

    def __init__(self, client: Redis, stream: str) -> None:
        self.client, self.stream = client, stream
        self.last = "-"
        self.started: Counter[str] = Counter()
        self.starts = Starts()
        self.finished: Counter[str] = Counter()
        self.ready_seen_at: dict[str, float] = {}

    async def read_new(self) -> None:
        for entry_id, fields in await _pages(self.client, self.stream, self.last):
            self.last = entry_id.decode()
            run = fields[b"run"].decode()
            if fields[b"event"] == b"started":
                self.started[run] += 1
                self.starts.ran_in[run].append(fields[b"worker"].decode())
            elif fields[b"event"] == b"starting":
                self.starts.starting_in[run].append(fields[b"worker"].decode())
            elif fields[b"event"] == b"finished":
                self.finished[run] += 1
            elif fields[b"event"] == b"ready":
                self.ready_seen_at[fields[b"worker"].decode()] = time.monotonic()

    def all_up(self, names: list[str]) -> bool:
        """Every worker named finished its startup: "ready" is reported
        before taskiq-redis's startup creates the group, so give it a second.
        """
        now = time.monotonic()
        return all(now - self.ready_seen_at.get(name, now) >= 1.0 for name in names)


class DeadLetterWatch:
    """The queue's dead letters, read as they come: an empty restart takes
    the stream with it, so what it held is kept here."""

    def __init__(self, client: Redis, queue: str) -> None:
        self.client = client
        self.stream = StreamKeys(queue, GROUP).dead_letters
        self.last = "-"
        self.letters: list[Letter] = []

    async def read_new(self) -> None:
        for entry_id, fields in await _pages(self.client, self.stream, self.last):
            self.last = entry_id.decode()
            self.letters.append(
                Letter(
                    _run_id(fields.get(b"data")) or "?",
                    fields.get(b"dead_letter_reason", b"").decode(),
                    int(fields.get(b"dead_letter_deliveries", b"0")),
                )
            )

    def forget_position(self) -> None:
        self.last = "-"  # a new stream after an empty restart


async def _run_ids_in(client: Redis, queue: str) -> set[str]:
    return {
        run
        for _, fields in await _pages(client, queue, "-")
        if (run := _run_id(fields.get(b"data"))) is not None
    }


async def _pending_by_consumer(client: Redis, queue: str) -> dict[str, int]:
    try:
        summary: Any = await client.xpending(queue, GROUP)
    except ResponseError as error:
        # After the empty restart, until a worker re-creates the group.
        if str(error).startswith("NOGROUP"):
            return {}
        raise
    return {
        c["name"].decode(): int(c["pending"]) for c in summary.get("consumers") or []
    }
