"""How big each part of the run is (smoke, quick, full) and the claim settings.

Every variant in a part gets the same server, data and settings. Settings
are built from broker arguments, exactly as ``AtomicRedisStreamBroker``
builds them, and the lock variants take their lock timeout from the same
values.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskiq_atomic_claim.settings import ClaimSettings

# Child processes run ``python -m benchmarks.*`` from here.
REPO_ROOT = Path(__file__).resolve().parent.parent

# One idle entry, as big as a small taskiq message.
PAYLOAD = (
    b'{"task_id":"'
    + b"0" * 32
    + b'","task_name":"bench.work","args":'
    + (b'["' + b"x" * 180 + b'"]}')
)
# Entries handed back between cycles look this long idle: far past any
# idle_timeout used here except the "scan" workload's.
AGED_IDLE_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class BrokerArguments:
    """The broker's reclaim arguments, in its units; one set per experiment."""

    idle_timeout: int
    claim_interval: int
    batch_size: int
    lock_timeout_s: float | None = None
    # False switches the project's dead lettering off (max_deliveries=None):
    # the contention runs re-claim entries many times on purpose, and the lock
    # variants have no such feature. True keeps the broker's default.
    dead_letters: bool = True

    def settings(self) -> ClaimSettings:
        extra: dict[str, Any] = {}
        if not self.dead_letters and _accepts("max_deliveries"):
            extra["max_deliveries"] = None
        return ClaimSettings.from_broker_arguments(
            idle_timeout=self.idle_timeout,
            claim_interval=self.claim_interval,
            unacknowledged_batch_size=self.batch_size,
            unacknowledged_lock_timeout=self.lock_timeout_s,
            **extra,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "idle_timeout": self.idle_timeout,
            "claim_interval": self.claim_interval,
            "batch_size": self.batch_size,
            "lock_timeout_s": self.lock_timeout_s,
            "dead_letters": self.dead_letters,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BrokerArguments:
        return cls(**data)


def _accepts(parameter: str) -> bool:
    return (
        parameter in inspect.signature(ClaimSettings.from_broker_arguments).parameters
    )


# The claim-cycle and scale parts: a recovery cycle that always finds a full
# batch of idle entries (see workload.py).
CYCLE_ARGUMENTS = BrokerArguments(
    idle_timeout=60_000, claim_interval=1_000, batch_size=10
)
# Nothing idle: the cycle a healthy broker runs every interval, a bounded
# scan of the PEL that claims nothing.
SCAN_ARGUMENTS = BrokerArguments(
    idle_timeout=10 * AGED_IDLE_MS, claim_interval=1_000, batch_size=10
)


@dataclass(frozen=True)
class Regime:
    """One contention workload: claimers never ack, so entries idle out again.

    ``back_off``: after a skipped cycle (lease or lock held by another) a
    claimer waits one claim interval, as the broker does, and after a
    productive one goes again at once (a backlog to work through); the same
    rule for every variant. Without it every claimer spins, and on a small
    machine the spinners starve whoever holds the lease or lock.
    """

    name: str
    arguments: BrokerArguments
    back_off: bool
    why: str
    # Injected client-server RTT (0: plain loopback).
    rtt_ms: float = 0.0


_DEFAULT_LEASE = BrokerArguments(
    idle_timeout=200, claim_interval=100, batch_size=10, dead_letters=False
)
REGIMES = (
    Regime(
        "lease_lt_idle",
        _DEFAULT_LEASE,
        back_off=True,
        why="lease (= claim interval, 100 ms) shorter than idle_timeout (200 ms), as"
        " the broker has it by default; skipped claimers wait one interval",
    ),
    Regime(
        "lease_lt_idle_spin",
        _DEFAULT_LEASE,
        back_off=False,
        why="the same, but every claimer retries at once after a skip",
    ),
    Regime(
        "lease_lt_idle_rtt2ms",
        _DEFAULT_LEASE,
        back_off=True,
        rtt_ms=2.0,
        why="the default regime with 2 ms RTT between every claimer and the server,"
        " injected like the claim-cycle part's: round trips, not client CPU, decide",
    ),
    Regime(
        "lease_gt_idle",
        BrokerArguments(
            idle_timeout=100,
            claim_interval=50,
            batch_size=10,
            lock_timeout_s=0.4,
            dead_letters=False,
        ),
        back_off=True,
        why="lease/lock timeout (400 ms) outlives idle_timeout (100 ms): entries idle"
        " out again within one lease, so a second claimer can get them unless the"
        " lease keeps them with its holder",
    ),
)


@dataclass(frozen=True)
class Mode:
    name: str
    rtts_ms: tuple[float, ...] = (0.0, 0.5, 2.0)
    cycles: int = 2000
    warmup: int = 100
    count_cycles: int = 20
    cpu_cycles: int = 5000
    cycle_pending: int = 10_000
    claimers: tuple[int, ...] = (1, 4, 16, 64)
    # Regime name -> claimer counts it runs at; absent: all of ``claimers``.
    regime_claimers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    contention_s: float = 3.0
    contention_pending: int = 30_000
    scale_sizes: tuple[int, ...] = (100, 10_000, 100_000)
    scale_cycles: int = 1000
    e2e_rounds: int = 20
    # 1.2.4 on an idle queue never recovers: each of its rounds waits out
    # e2e_give_up_s, so quick runs keep this one short.
    e2e_upstream_idle_rounds: int = 20
    e2e_give_up_s: float = 8.0
    e2e_idle_timeout: int = 2000
    e2e_claim_interval: int = 500
    throughput_messages: int = 10_000
    throughput_reps: int = 5
    # The hot path: tasks drained per repetition, repetitions, tasks drained
    # through the turn-counting proxy, light-load tasks per variant.
    hotpath_tasks: int = 20_000
    hotpath_reps: int = 3
    hotpath_rt_tasks: int = 3000
    hotpath_light: int = 1500
    # Mass recovery: orphans left by dead consumers, a live
    # fleet of workers x slots running tasks of task_s, new tasks kicked at a
    # steady rate; each broker's run is cut at mass_cap_s.
    mass_orphans: int = 20_000
    mass_dead: int = 20
    mass_workers: int = 4
    # taskiq worker's default max_async_tasks.
    mass_slots: int = 100
    mass_task_s: float = 1.0
    mass_new_per_s: float = 20.0
    mass_cap_s: float = 300.0
    # Idle fleet cost (part 3): (workers, streams, idle_timeout ms or None for
    # the brokers' default), each idle for fleet_idle_s; fleet_monitor_s of
    # MONITOR from the workers' start tells top-level from nested commands
    # (each broker claims and reads once at once; a longer window sees more).
    fleet_shapes: tuple[tuple[int, int, int | None], ...] = (
        (50, 10, None),
        (10, 1, 60_000),
    )
    # A multiple of the 2 s blocking read (xread_block): a blocked
    # XREADGROUP is counted when it returns, so each idle upstream worker
    # lands the same whole number of reads in the window.
    fleet_idle_s: float = 30.0
    fleet_monitor_s: float = 5.0
    # Longest calls: orphans of payload bytes, recovered at each batch size
    # (unacknowledged_batch_size and xread_count; 10,000 is the largest the
    # broker accepts). 5000 x 100 KB: 0.5 GB on the server.
    longest_orphans: int = 5000
    longest_payload: int = 100_000
    longest_batches: tuple[int, ...] = (100, 1000, 10_000)
    # Kick throughput, with and without IDMP: kicks per variant and run.
    kick_messages: int = 20_000
    kick_reps: int = 3
    # The longest a run may go without a progress line before the watchdog
    # prints its stacks and stops it: above the longest silent step (a mass
    # recovery capped at mass_cap_s).
    stall_limit_s: float = 900.0

    def claimers_for(self, regime: str) -> tuple[int, ...]:
        return self.regime_claimers.get(regime, self.claimers)

    @property
    def mass_large_batch(self) -> int:
        """The large-batch fleet's unacknowledged_batch_size: one worker's
        share of the orphans, so within a few claims every worker holds a
        hoard and none is left to read new tasks (10,000 of 200k). 10,000 of
        20k would leave two of four workers free to take every new task."""
        return max(1, self.mass_orphans // self.mass_workers)


FULL = Mode("full")
QUICK = Mode(
    "quick",
    cycles=250,
    warmup=20,
    cpu_cycles=1000,
    regime_claimers={
        "lease_lt_idle_spin": (16,),
        "lease_lt_idle_rtt2ms": (16,),
        "lease_gt_idle": (16,),
    },
    contention_s=0.7,
    contention_pending=10_000,
    scale_cycles=200,
    e2e_rounds=2,
    e2e_upstream_idle_rounds=1,
    e2e_give_up_s=5.0,
    throughput_messages=2000,
    throughput_reps=2,
    hotpath_tasks=5000,
    hotpath_reps=2,
    hotpath_rt_tasks=1000,
    hotpath_light=300,
    mass_orphans=2000,
    # With 0.1 s tasks, 10 slots run 100 tasks/s per worker, as a default
    # worker's 100 slots do with the full run's 1 s tasks (floor 5 s).
    mass_slots=10,
    mass_task_s=0.1,
    mass_cap_s=45.0,
    fleet_shapes=((10, 2, None), (10, 1, 60_000)),
    fleet_idle_s=6.0,
    fleet_monitor_s=2.5,
    longest_orphans=1000,
    longest_batches=(100, 1000),
    kick_messages=5000,
    kick_reps=2,
)
# For the test suite: every part, briefly; figures are not meaningful.
SMOKE = Mode(
    "smoke",
    rtts_ms=(0.0, 2.0),
    cycles=40,
    warmup=5,
    count_cycles=5,
    cpu_cycles=100,
    cycle_pending=1000,
    claimers=(1, 4),
    regime_claimers={
        "lease_lt_idle_spin": (4,),
        "lease_lt_idle_rtt2ms": (4,),
        "lease_gt_idle": (4,),
    },
    contention_s=0.3,
    contention_pending=5000,
    scale_sizes=(100, 10_000),
    scale_cycles=30,
    e2e_rounds=1,
    e2e_upstream_idle_rounds=1,
    # Shorter than quick's, so the smoke test stays under a minute.
    e2e_give_up_s=3.0,
    e2e_idle_timeout=1000,
    e2e_claim_interval=250,
    throughput_messages=300,
    throughput_reps=1,
    hotpath_tasks=200,
    hotpath_reps=1,
    # No round-trip drain: the smoke run stays short.
    hotpath_rt_tasks=0,
    # Two sets of light-load workers (hotpath._LIGHT_MIN_PER_PROCESS each).
    hotpath_light=100,
    # The whole smoke run takes under a minute.
    stall_limit_s=120.0,
    mass_orphans=300,
    mass_dead=3,
    mass_workers=2,
    mass_slots=10,
    mass_task_s=0.05,
    mass_new_per_s=20.0,
    mass_cap_s=10.0,
    fleet_shapes=((3, 2, None),),
    fleet_idle_s=1.0,
    fleet_monitor_s=0.6,
    longest_orphans=30,
    longest_payload=1000,
    longest_batches=(10,),
    kick_messages=200,
    kick_reps=1,
)
MODES = {mode.name: mode for mode in (FULL, QUICK, SMOKE)}
