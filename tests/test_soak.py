"""Chaos soak: a live producer, 3 real workers SIGKILLed and SIGTERMed,
a server restart from the AOF and an empty one.

Short here, on every server the suite found (about 30 s each), with 3 poison
tasks kicked after the empty restart; the long run
with --slow. The queue's server is one this suite starts itself, with an
fsync-always AOF; the workers report to a second server, which the empty
restart leaves alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.harness.embedded_server import LocalServer
from tests.conftest import _BINARIES, Server
from tests.soak import durable_server, run_soak
from tests.soak_accounting import (
    Letter,
    SoakReport,
    Starts,
    judge_dead_letters,
)
from tests.test_broker import message


def soak(label: str, tmp_path: Path, **settings: Any) -> SoakReport:
    binary = _BINARIES[label]
    with durable_server(binary) as server, LocalServer(binary) as events:
        report = asyncio.run(run_soak(server, events.url, log_dir=tmp_path, **settings))
    print("\n".join(report.lines()))
    return report


def check(report: SoakReport) -> None:
    lines = "\n".join(report.lines())
    assert report.accepted == report.messages, lines
    assert report.lost_by_us == 0, lines
    assert report.dead_never_started == 0, lines
    assert report.left_pending == 0, lines
    assert report.duplicates <= report.in_flight_at_kills + report.resent_kicks, lines
    assert report.poison_kicked == report.poison_dead_lettered == 3, lines
    assert report.dead_innocent_crashed == 0, lines
    assert report.ok, lines


MAX = 3  # max_deliveries in the crafted runs below
POISONED = Letter("p0", "max_deliveries exceeded", MAX)


def judged(
    letters: list[Letter],
    ran_in: dict[str, list[str]],
    starting_in: dict[str, list[str]] | None = None,
) -> SoakReport:
    """A soak that otherwise passed, judged on these dead letters: poison p0
    was kicked; workers k1..k9 died (killed, or by the poison). Each run
    reported "starting" where it ran unless ``starting_in`` says otherwise."""
    report = SoakReport("crafted", 10, 3, planned_kills=1, planned_graceful=1)
    report.accepted, report.kills, report.graceful_restarts = 10, 1, 1
    report.aof_restarts, report.max_deliveries, report.planned_poison = 1, MAX, 1
    died = {f"k{n}" for n in range(1, 10)}
    starts = Starts()
    starts.ran_in.update(ran_in)
    starts.starting_in.update(ran_in if starting_in is None else starting_in)
    judge_dead_letters(report, letters, starts, died, ["p0"])
    return report


def test_the_accounting_passes_a_poison_dead_lettered_after_max_deliveries() -> None:
    report = judged([POISONED], {"p0": ["k1", "k2", "k3"], "m1": ["live"]})
    assert (report.poison_kicked, report.poison_dead_lettered) == (1, 1)
    assert report.poison_starts == {"p0": MAX}
    assert report.ok, report.lines()


def test_a_poison_start_cut_before_it_ran_still_counts() -> None:
    # Another poison killed k3 after the broker counted p0's start there.
    report = judged([POISONED], {"p0": ["k1", "k2"]}, {"p0": ["k1", "k2", "k3"]})
    assert report.poison_dead_lettered == 1, report.lines()
    assert report.ok


@pytest.mark.parametrize(
    ("letters", "starts"),
    [
        ([], ["k1", "k2", "k3"]),  # never dead-lettered
        ([POISONED], ["k1", "k2", "k3", "k4"]),  # ran once more than allowed
        ([POISONED], ["k1", "k2"]),  # dead-lettered early
        ([POISONED, POISONED], ["k1", "k2", "k3"]),  # twice
        ([Letter("p0", "no worker knows its task", MAX)], ["k1", "k2", "k3"]),
    ],
)
def test_the_accounting_fails_a_poison_not_dead_lettered_after_max_deliveries(
    letters: list[Letter], starts: list[str]
) -> None:
    report = judged(letters, {"p0": starts})
    assert not report.ok, report.lines()


@pytest.mark.parametrize(
    "starts",
    [
        [],  # never started
        ["k1", "k2"],  # started, fewer crashes than max_deliveries
        ["k1", "k2", "live"],  # as often as max_deliveries, once in a live worker
    ],
)
def test_an_innocent_task_in_the_dead_letters_is_lost_by_us(starts: list[str]) -> None:
    innocent = Letter("m1", "max_deliveries exceeded", MAX)
    report = judged([POISONED, innocent], {"p0": ["k1", "k2", "k3"], "m1": starts})
    assert report.lost_by_us == 1, report.lines()
    assert report.dead_never_started == (not starts)
    assert not report.ok
    assert any("m1" in example for example in report.examples), report.examples


def test_an_innocent_task_that_crashed_max_deliveries_times_is_counted_apart() -> None:
    innocent = Letter("m1", "max_deliveries exceeded", MAX)
    report = judged(
        [POISONED, innocent], {"p0": ["k4", "k5", "k6"], "m1": ["k1", "k2", "k3"]}
    )
    assert report.lost_by_us == 0, report.lines()
    assert (report.dead_innocent_crashed, report.dead_innocent_beside_poison) == (1, 0)
    assert "m1" in "\n".join(report.examples)


def test_an_innocent_task_dead_lettered_beside_the_poison_is_lost_by_us() -> None:
    # Suspects run alone (suspects.py): a poison must not take a
    # neighbour to the dead letters, even one that crashed max_deliveries times.
    innocent = Letter("m1", "max_deliveries exceeded", MAX)
    report = judged(
        [POISONED, innocent],
        {"p0": ["k1", "k2", "k3"], "m1": ["k1", "k2"]},
        {"p0": ["k1", "k2", "k3"], "m1": ["k1", "k2", "k3"]},
    )
    assert report.lost_by_us == 1, report.lines()
    assert (report.dead_innocent_crashed, report.dead_innocent_beside_poison) == (0, 1)
    assert not report.ok


# Scripts loaded with EVALSHA (6.2), to keep .ci/run within its budget: the
# function library's path (7.0+, Valkey) and the native CLAIM path (8.6) are
# what most real-worker tests run on. --all-servers soaks every server.
SOAK_SERVERS = ("redis-6.2.14",)


@pytest.mark.parametrize("label", list(_BINARIES))
def test_short_soak_loses_nothing(
    label: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    chosen = request.config.getoption("--server")
    if chosen:
        if label not in chosen:
            pytest.skip(f"--server {', '.join(chosen)}")
    elif not request.config.getoption("--all-servers"):
        found = [server for server in SOAK_SERVERS if server in _BINARIES]
        if label not in (found or list(_BINARIES)[:1]):
            pytest.skip(f"soaked on {', '.join(found)}; --all-servers runs it here")
    report = soak(
        label,
        tmp_path,
        messages=2000,
        backlog=500,  # queued work at the first stops and the AOF restart
        kills=5,
        graceful=3,
        kill_every=2.5,
        time_limit=90,
    )
    assert (report.kills, report.graceful_restarts) == (5, 3)
    assert (report.aof_restarts, report.empty_restarts) == (1, 1)
    # The empty restart happened under the live producer: it accepted
    # tasks on both sides of it, and those after it all ran.
    assert report.accepted_before_empty > 0
    assert report.accepted_after_empty > 0
    check(report)


@pytest.mark.slow
def test_long_soak_loses_nothing(tmp_path: Path) -> None:
    label = "redis-7.0.15" if "redis-7.0.15" in _BINARIES else next(iter(_BINARIES))
    report = soak(
        label,
        tmp_path,
        messages=10_000,
        kills=30,
        graceful=10,
        kill_every=3.0,
        time_limit=720,
    )
    assert (report.kills, report.graceful_restarts) == (30, 10)
    check(report)


async def test_a_worker_started_after_an_empty_restart_skips_nothing(
    server: Server, redis: Redis
) -> None:
    """Found by the soak on redis-6.2.14 at 300 kicks/s: a replacement worker
    started right after the empty restart, before the running workers saw
    NOGROUP; its startup (taskiq-redis's ``_declare_consumer_group``, XGROUP
    CREATE at ``$`` MKSTREAM) put the group after the 4 tasks the producer had
    already re-added, and they were never run ("lost by us 4")."""
    settings: dict[str, Any] = {"idle_timeout": 2000, "claim_interval": 100}
    before = AtomicRedisStreamBroker(server.url, **settings)
    await before.startup()  # the group exists, as it did before the restart
    await before.shutdown()
    await redis.delete("taskiq")  # what the empty restart leaves of it
    await before.kick(message("accepted-after-the-restart"))
    replacement = AtomicRedisStreamBroker(server.url, xread_block=100, **settings)
    await replacement.startup()
    try:
        delivered: Any = await asyncio.wait_for(replacement.listen().__anext__(), 5)
        assert delivered.data == b"accepted-after-the-restart"
        await delivered.ack()
    except asyncio.TimeoutError:
        pytest.fail("the task accepted after the restart was never delivered")
    finally:
        await replacement.shutdown()
