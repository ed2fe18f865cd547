"""How big each part of the run is (smoke, quick, full), and which broker
configurations the brokers refuse."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from taskiq_atomic_claim.settings import ClaimSettings

# Child processes run ``python -m benchmarks.*`` from here.
REPO_ROOT = Path(__file__).resolve().parent.parent

# Orphans are backdated this far: past any idle_timeout a part uses.
AGED_IDLE_MS = 24 * 3600 * 1000
# taskiq-redis's default unacknowledged_batch_size.
DEFAULT_BATCH = 100


def refusal(
    idle_timeout: int | None = None,
    claim_interval: int | None = None,
    batch_size: int | None = None,
    lock_timeout_s: float | None = None,
) -> str | None:
    """Why the brokers would not run this configuration as given, or None.

    ``None`` arguments take the brokers' defaults. A lease (lock timeout)
    longer than idle_timeout is cut to idle_timeout by the brokers: a figure
    measured with it describes a configuration no broker runs.
    """
    try:
        settings = ClaimSettings.from_broker_arguments(
            idle_timeout=600_000 if idle_timeout is None else idle_timeout,
            claim_interval=claim_interval,
            unacknowledged_batch_size=(
                DEFAULT_BATCH if batch_size is None else batch_size
            ),
            unacknowledged_lock_timeout=lock_timeout_s,
        )
    except ValueError as error:
        return str(error)
    if settings.lease > settings.idle_timeout:
        return (
            f"a lease of {settings.lease} ms outlives idle_timeout"
            f" ({settings.idle_timeout} ms): the brokers cut it to idle_timeout"
        )
    return None


@dataclass(frozen=True)
class Mode:
    name: str
    e2e_rounds: int = 20
    # taskiq-redis 1.2.4 on an idle queue never recovers: each of its rounds
    # waits out e2e_give_up_s, so quick runs keep this one short.
    e2e_upstream_idle_rounds: int = 20
    e2e_give_up_s: float = 8.0
    e2e_idle_timeout: int = 2000
    e2e_claim_interval: int = 500
    # The hot path: tasks drained per repetition, repetitions, tasks drained
    # through the turn-counting proxy, light-load tasks per variant.
    hotpath_tasks: int = 20_000
    hotpath_reps: int = 3
    hotpath_rt_tasks: int = 3000
    hotpath_light: int = 1500
    # Mass recovery: orphans left by dead consumers, a live fleet of workers x
    # slots running tasks of task_s, new tasks kicked at a steady rate; each
    # broker's run is cut at mass_cap_s.
    mass_orphans: int = 20_000
    mass_dead: int = 20
    mass_workers: int = 4
    # taskiq worker's default max_async_tasks.
    mass_slots: int = 100
    mass_task_s: float = 1.0
    mass_new_per_s: float = 20.0
    mass_cap_s: float = 300.0
    # Orphan drain: no-op orphans worked off by real workers at defaults,
    # each repetition cut at drain_cap_s.
    drain_orphans: int = 30_000
    drain_workers: int = 2
    drain_reps: int = 3
    drain_cap_s: float = 120.0
    # Idle fleet cost: (workers, streams, idle_timeout ms or None for the
    # brokers' default), each idle for fleet_idle_s; fleet_monitor_s of
    # MONITOR from the workers' start tells top-level from nested commands.
    fleet_shapes: tuple[tuple[int, int, int | None], ...] = (
        (10, 10, None),
        (50, 10, None),
        (10, 1, 60_000),
    )
    # A multiple of the 2 s blocking read (xread_block): a blocked
    # XREADGROUP is counted when it returns, so each idle upstream worker
    # lands the same whole number of reads in the window.
    fleet_idle_s: float = 30.0
    fleet_monitor_s: float = 5.0
    # Interleaved rounds of each shape (atomic, upstream, atomic, ...): the
    # report takes medians, and upstream's own spread is the A/A noise.
    fleet_rounds: int = 3
    # The longest a run may go without a progress line before the watchdog
    # prints its stacks and stops it: above the longest silent step (a mass
    # recovery capped at mass_cap_s).
    stall_limit_s: float = 900.0

    @property
    def mass_large_batch(self) -> int:
        """The large-batch fleet's unacknowledged_batch_size: one worker's
        share of the orphans, so within a few claims every worker holds a
        hoard and none is left to read new tasks."""
        return max(1, self.mass_orphans // self.mass_workers)

    def configurations(self) -> list[dict[str, int | None]]:
        """Every broker configuration this mode measures (see ``refusal``)."""
        return [
            {
                "idle_timeout": self.e2e_idle_timeout,
                "claim_interval": self.e2e_claim_interval,
            },
            {"batch_size": self.mass_large_batch},
            *({"idle_timeout": idle} for _, _, idle in self.fleet_shapes),
        ]


FULL = Mode("full")
QUICK = Mode(
    "quick",
    e2e_rounds=2,
    e2e_upstream_idle_rounds=1,
    e2e_give_up_s=5.0,
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
    drain_orphans=10_000,
    drain_reps=2,
    drain_cap_s=60.0,
    fleet_shapes=((10, 10, None), (10, 1, 60_000)),
    fleet_idle_s=6.0,
    fleet_monitor_s=2.5,
    fleet_rounds=1,
)
# For the test suite: every part, briefly; figures are not meaningful.
SMOKE = Mode(
    "smoke",
    e2e_rounds=1,
    e2e_upstream_idle_rounds=1,
    e2e_give_up_s=3.0,
    e2e_idle_timeout=1000,
    e2e_claim_interval=250,
    hotpath_tasks=200,
    hotpath_reps=1,
    # No round-trip drain: the smoke run stays short.
    hotpath_rt_tasks=0,
    # Two sets of light-load workers (hotpath._LIGHT_MIN_PER_PROCESS each).
    hotpath_light=100,
    stall_limit_s=120.0,
    mass_orphans=300,
    mass_dead=3,
    mass_workers=2,
    mass_slots=10,
    mass_task_s=0.05,
    mass_new_per_s=20.0,
    mass_cap_s=10.0,
    drain_orphans=300,
    drain_workers=1,
    drain_reps=1,
    drain_cap_s=20.0,
    fleet_shapes=((3, 2, None),),
    fleet_idle_s=1.0,
    fleet_monitor_s=0.6,
    fleet_rounds=1,
)
MODES = {mode.name: mode for mode in (FULL, QUICK, SMOKE)}
