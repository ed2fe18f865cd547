"""Poison and data-less entries go to the dead letters; requeue brings them back."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from typing import Any

import pytest
from redis.asyncio import Redis
from taskiq import TaskiqMessage
from taskiq.formatters.json_formatter import JSONFormatter
from taskiq.message import BrokerMessage
from taskiq.utils import maybe_awaitable
from taskiq_redis import RedisAsyncResultBackend

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.admin.dead_letters import (
    entry_time,
    list_dead_letters,
    requeue_dead_letters,
)
from taskiq_atomic_claim.claim import claim_idle_entries
from taskiq_atomic_claim.dead_letter_policy import (
    MAX_DELIVERIES_EXCEEDED,
    NO_DATA_FIELD,
)
from taskiq_atomic_claim.dead_letter_results import DeadLettered
from taskiq_atomic_claim.dead_letters import move_to_dead_letters
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.task_records import record_starts
from tests.conftest import Server
from tests.test_cli import cli, cli_in_process

STREAM, GROUP = "jobs", "workers"
KEYS = StreamKeys(STREAM, GROUP)


def settings(max_deliveries: int | None) -> ClaimSettings:
    return ClaimSettings.from_broker_arguments(
        idle_timeout=20,
        claim_interval=None,
        unacknowledged_batch_size=100,
        unacknowledged_lock_timeout=None,
        max_deliveries=max_deliveries,
    )


async def record_start(runner: ScriptRunner, redis: Redis, entry_id: str) -> None:
    """What a worker's StartRecorder does just before the task runs."""
    await record_starts(redis, KEYS.started, 60_000, [entry_id])


async def test_entry_whose_task_crashed_too_often_is_dead_lettered_atomically(
    redis: Redis,
) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    poison = text(await redis.xadd(STREAM, {"data": b"\x00poison"}))
    await redis.xreadgroup(GROUP, "victim-0", {STREAM: ">"})
    runner = ScriptRunner()
    # Each victim starts the task and dies; crashes 1 and 2 are below
    # max_deliveries=3, the reclaim after crash 3 dead-letters it.
    await record_start(runner, redis, poison)
    for victim in (1, 2):
        await asyncio.sleep(0.03)
        outcome = await claim_idle_entries(
            runner, redis, KEYS, f"victim-{victim}", settings(3)
        )
        assert [entry.id for entry in outcome.entries] == [poison]
        await record_start(runner, redis, poison)
    await asyncio.sleep(0.03)
    outcome = await claim_idle_entries(runner, redis, KEYS, "victim-3", settings(3))
    assert outcome.entries == []
    assert outcome.dead_lettered == [poison]
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0
    assert await redis.xlen(STREAM) == 1, "the original stays for other groups"
    [dead] = await list_dead_letters(redis, KEYS)
    assert dead.original_id == poison
    assert dead.deliveries == 3, "the crashes, not the deliveries"
    assert dead.reason == "max_deliveries exceeded"
    # claim.lua compares and writes server-side: the policy's reason.
    assert dead.reason == MAX_DELIVERIES_EXCEEDED
    assert dead.fields == {b"data": b"\x00poison"}
    assert await redis.pttl(KEYS.dead_letters) == -1, "dead letters are data"
    assert not await redis.hexists(KEYS.started, poison), "its count went with it"


async def test_deliveries_that_never_started_never_count(redis: Redis) -> None:
    # Prefetched by workers that died (or handed back) before running it:
    # reclaimed any number of times, it is never dead-lettered.
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    await redis.xadd(STREAM, {"data": "innocent"})
    await redis.xreadgroup(GROUP, "c-0", {STREAM: ">"})
    runner = ScriptRunner()
    for victim in range(1, 8):
        await asyncio.sleep(0.03)
        outcome = await claim_idle_entries(
            runner, redis, KEYS, f"c-{victim}", settings(1)
        )
        assert len(outcome.entries) == 1
        assert outcome.dead_lettered == []
    [pending] = await redis.xpending_range(STREAM, GROUP, "-", "+", 1)
    assert pending["times_delivered"] == 8
    assert await redis.exists(KEYS.dead_letters) == 0


async def test_without_max_deliveries_nothing_is_dead_lettered(redis: Redis) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    await redis.xadd(STREAM, {"data": "x"})
    await redis.xreadgroup(GROUP, "c", {STREAM: ">"})
    runner = ScriptRunner()
    for _ in range(8):
        await asyncio.sleep(0.03)
        outcome = await claim_idle_entries(runner, redis, KEYS, "c", settings(None))
        assert len(outcome.entries) == 1
    assert await redis.exists(KEYS.dead_letters) == 0


async def test_requeue_puts_dead_letters_back_on_their_stream(redis: Redis) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for number in range(3):
        await redis.xadd(
            KEYS.dead_letters,
            {
                "data": f"task-{number}",
                "dead_letter_stream": STREAM,
                "dead_letter_id": f"1-{number}",
                "dead_letter_reason": "test",
            },
        )
    dead = await list_dead_letters(redis, KEYS)
    runner = ScriptRunner()
    moved = await requeue_dead_letters(runner, redis, KEYS, [dead[1].id, "9-9"])
    assert [old for old, _ in moved] == [dead[1].id]
    entries: Any = await redis.xrange(STREAM)
    [(_, fields)] = entries
    assert fields == {b"data": b"task-1"}
    rest = await requeue_dead_letters(runner, redis, KEYS)
    assert len(rest) == 2
    assert await redis.xlen(KEYS.dead_letters) == 0
    assert await redis.xlen(STREAM) == 3
    # Requeued entries are new messages the group reads normally.
    reply: Any = await redis.xreadgroup(GROUP, "c", {STREAM: ">"})
    assert len(reply[0][1]) == 3


async def test_broker_dead_letters_entries_without_data(
    server: Server, redis: Redis
) -> None:
    broker = AtomicRedisStreamBroker(
        server.url, idle_timeout=500, claim_interval=100, xread_block=200
    )
    await broker.startup()
    try:
        await redis.xadd("taskiq", {"written-by": "someone else"})
        await broker.kick(
            BrokerMessage(task_id="1", task_name="t", message=b"real", labels={})
        )
        received = await asyncio.wait_for(broker.listen().__anext__(), 3)
        assert received.data == b"real", "the bad entry did not stop listen()"
        await maybe_awaitable(received.ack())
        keys = StreamKeys("taskiq", "taskiq")
        [dead] = await list_dead_letters(redis, keys)
        assert dead.reason == "no data field" == NO_DATA_FIELD
        assert dead.fields == {b"written-by": b"someone else"}
        assert (await redis.xpending("taskiq", "taskiq"))["pending"] == 0
        assert broker.metrics.snapshot()["dead_lettered"] == 1
    finally:
        await broker.shutdown()


async def dead_letter(redis: Redis, data: bytes, field: str = "data") -> str:
    """``data`` sent, delivered, and moved to the dead letters by the script."""
    entry_id = text(await redis.xadd(STREAM, {field: data}))
    await redis.xreadgroup(GROUP, "c", {STREAM: ">"})
    await move_to_dead_letters(
        ScriptRunner(),
        redis,
        KEYS,
        entry_id,
        "max_deliveries exceeded",
        delete_acked=False,
    )
    return entry_id


def call(task_name: str, task_id: str, *args: object, **kwargs: object) -> bytes:
    message = TaskiqMessage(
        task_id=task_id, task_name=task_name, labels={}, args=list(args), kwargs=kwargs
    )
    return JSONFormatter().dumps(message).message


async def test_the_dead_letters_command_shows_what_a_person_decides_on(
    server: Server, redis: Redis
) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    sent = await dead_letter(redis, call("app.tasks:resize", "id-1", 42, size="x" * 99))
    await dead_letter(redis, b"\x00poison")
    await dead_letter(redis, b"someone else", field="written-by")
    listed = cli(
        "dead-letters", "--url", server.admin_url, "--queue", STREAM, "--group", GROUP
    )
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == f"3 dead letters in {KEYS.dead_letters}"
    sent_at = f"{entry_time(sent):%Y-%m-%d %H:%M:%S} UTC"
    assert "task app.tasks:resize  id id-1  args (42, size='xxxxxxxxx" in lines[1]
    assert lines[1].endswith("...)"), "long arguments are cut"
    assert "max_deliveries exceeded after 1 delivery; dead since 20" in lines[2]
    assert f"sent {sent_at} (original {sent})" in lines[2]
    assert "not a taskiq JSON message: b'\\x00poison'" in lines[3]
    assert "fields {b'written-by': b'someone else'}" in lines[5]


async def test_requeue_by_task_name_moves_only_that_task(
    server: Server, redis: Redis
) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    await dead_letter(redis, call("app:a", "a-1"))
    await dead_letter(redis, call("app:b", "b-1"))
    await dead_letter(redis, b"not json")
    await dead_letter(redis, call("app:a", "a-2"))
    where = ("--url", server.admin_url, "--queue", STREAM, "--group", GROUP)
    moved = cli("requeue", *where, "--task", "app:a")
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.splitlines()[-1] == f"2 requeued to {STREAM}"
    left = [letter.task() for letter in await list_dead_letters(redis, KEYS)]
    assert [task.name if task else None for task in left] == ["app:b", None]
    none_left = cli("requeue", *where, "--task", "app:a")
    assert none_left.returncode == 1
    assert "no dead letters of task 'app:a'" in none_left.stdout


async def test_doctor_advises_delete_and_it_deletes_by_task_after_a_dry_run(
    server: Server, redis: Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for data in (call("app:a", "a-1"), call("app:b", "b-1"), b"not json"):
        await dead_letter(redis, data)
    await dead_letter(redis, call("app:a", "a-2"))
    where = ("--url", server.admin_url, "--queue", STREAM, "--group", GROUP)

    # The command doctor advises runs as spelled.
    _, advice, _ = await cli_in_process(capsys, "doctor", *where)
    advised = re.search(r"`taskiq-atomic-claim (delete [^`]*--all)`", advice)
    assert advised is not None, advice
    spelled = advised.group(1).replace("--url URL", f"--url {server.admin_url}")
    code, out, err = await cli_in_process(capsys, *shlex.split(spelled), "--dry-run")
    assert code == 0, err
    assert out.splitlines()[-1] == (
        "4 dead letters would be deleted for good (dry run: nothing changed)"
    )
    code, out, _ = await cli_in_process(capsys, "requeue", *where, "--all", "--dry-run")
    assert code == 0
    assert "would requeue" in out and "task app:b  id b-1" in out
    assert "4 dead letters would be requeued to jobs" in out
    assert await redis.xlen(KEYS.dead_letters) == 4, "a dry run changes nothing"
    assert await redis.xlen(STREAM) == 4

    code, out, _ = await cli_in_process(
        capsys, "delete", *where, "--task", "app:a", "--dry-run"
    )
    assert (code, out.count("would delete")) == (0, 2)
    code, out, _ = await cli_in_process(capsys, "delete", *where, "--task", "app:a")
    assert code == 0
    assert out.splitlines()[-1] == f"2 deleted from {KEYS.dead_letters}"
    left = await list_dead_letters(redis, KEYS)
    tasks = [letter.task() for letter in left]
    assert [task.name if task else None for task in tasks] == ["app:b", None]

    code, _, err = await cli_in_process(
        capsys, "delete", *where, "--id", left[1].id, "--id", "9-9"
    )
    assert code == 1 and "9-9" in err, "an id that is not there is reported"
    assert [letter.id for letter in await list_dead_letters(redis, KEYS)] == [
        left[0].id
    ]
    code, out, _ = await cli_in_process(capsys, "requeue", *where, "--all")
    assert (code, out.splitlines()[-1]) == (0, f"1 requeued to {STREAM}")
    assert await redis.xlen(KEYS.dead_letters) == 0


@pytest.mark.parametrize(
    "command",
    [
        ["dead-letters"],
        ["requeue", "--all"],
        ["requeue", "--all", "--dry-run"],
        ["delete", "--all"],
        ["delete", "--task", "app:a", "--dry-run"],
    ],
)
async def test_an_unknown_queue_or_group_is_an_error_not_success(
    server: Server,
    redis: Redis,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    await dead_letter(redis, call("app:a", "a-1"))
    url = ("--url", server.admin_url)
    code, out, err = await cli_in_process(
        capsys, *command, *url, "--queue", "jbos", "--group", GROUP
    )
    assert (code, out) == (2, "")
    assert err == (
        "taskiq-atomic-claim: error: no queue 'jbos' on this server: no such"
        " stream, no dead letters: check --queue and --group\n"
    )
    code, out, err = await cli_in_process(
        capsys, *command, *url, "--queue", STREAM, "--group", "wrokers"
    )
    assert (code, out) == (2, "")
    assert "queue 'jobs' has no group 'wrokers' (its groups: 'workers')" in err
    assert err.count("\n") == 1
    await redis.set("a-string", "x")
    code, _, err = await cli_in_process(capsys, *command, *url, "--queue", "a-string")
    assert code == 2 and "'a-string' holds a string, not a queue's stream" in err
    await redis.delete("a-string")
    # The right names still work.
    code, _, err = await cli_in_process(
        capsys, *command, *url, "--queue", STREAM, "--group", GROUP
    )
    assert code == 0, err


async def test_a_waiter_learns_at_once_that_its_task_was_dead_lettered(
    server: Server, redis: Redis
) -> None:
    # A victim started the task and died; the claimer's reclaim (the claim
    # script, or the read itself on Redis >= 8.4) dead-letters it.
    results: RedisAsyncResultBackend[Any] = RedisAsyncResultBackend(
        server.admin_url, result_ex_time=60
    )
    keys = StreamKeys("taskiq", "taskiq")
    await redis.xgroup_create("taskiq", "taskiq", id="0", mkstream=True)
    poison = text(await redis.xadd("taskiq", {"data": call("app:crash", "crash-1")}))
    await redis.xreadgroup("taskiq", "victim", {"taskiq": ">"})
    await record_starts(redis, keys.started, 60_000, [poison])
    claimer = AtomicRedisStreamBroker(
        server.url,
        consumer_name="claimer",
        idle_timeout=200,
        claim_interval=100,
        xread_block=100,
        max_deliveries=1,
    ).with_result_backend(results)
    await claimer.startup()
    listening = asyncio.create_task(anext(claimer.listen()))
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while not await results.is_result_ready("crash-1"):
            assert asyncio.get_running_loop().time() < deadline, "no result stored"
            assert not listening.done(), "the poison was delivered"
            await asyncio.sleep(0.05)
        result = await results.get_result("crash-1")
        assert result.is_err
        assert isinstance(result.error, DeadLettered), result.error
        assert result.error.reason == "max_deliveries exceeded"
        assert (result.error.stream, result.error.entry_id) == ("taskiq", poison)
        [dead] = await list_dead_letters(redis, keys)
        assert dead.original_id == poison
    finally:
        listening.cancel()
        await claimer.shutdown()


async def test_dead_letters_of_every_queue_as_text_and_paged_json(
    server: Server, redis: Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without --queue it read queue "taskiq" only and printed "0 dead letters"
    # while another queue held some.
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    ids = [await dead_letter(redis, call("app:a", f"a-{n}")) for n in range(3)]
    other = StreamKeys("other", "g2")
    await redis.xadd(
        other.dead_letters,
        {"data": b"x", "dead_letter_stream": "other", "dead_letter_group": "g2"},
    )
    url = ("--url", server.admin_url)
    code, out, err = await cli_in_process(capsys, "dead-letters", *url)
    assert code == 0, err
    assert (
        f"3 dead letters in {KEYS.dead_letters} (queue 'jobs', group 'workers')" in out
    )
    assert f"1 dead letters in {other.dead_letters} (queue 'other', group 'g2')" in out
    _, out, _ = await cli_in_process(capsys, "dead-letters", *url, "--json")
    everything = json.loads(out)
    assert (everything["format"], everything["discovered"]) == (1, True)
    assert [(q["stream"], q["group"], q["count"]) for q in everything["queues"]] == [
        ("jobs", "workers", 3),
        ("other", "g2", 1),
    ]
    where = (*url, "--queue", STREAM, "--group", GROUP, "--json", "--count", "2")
    seen: list[str] = []
    after: list[str] = []
    for _ in range(3):
        code, out, err = await cli_in_process(capsys, "dead-letters", *where, *after)
        assert code == 0, err
        [queue] = json.loads(out)["queues"]
        seen += [entry["original_id"] for entry in queue["entries"]]
        if queue["next_after"] is None:
            break
        after = ["--after", queue["next_after"]]
    assert seen == ids
    assert queue["entries"][0]["task"] == {
        "name": "app:a",
        "task_id": "a-2",
        "arguments": "",
    }
    code, _, err = await cli_in_process(capsys, "dead-letters", *url, "--after", "1-0")
    assert code == 2
    assert "--after pages through one queue" in err


async def test_entry_due_for_dead_letters_but_gone_is_dropped_as_trimmed(
    redis: Redis,
) -> None:
    # The claim copies a dead entry's fields itself (XRANGE): one deleted
    # while pending has none to copy, and leaves the PEL as trimmed (Redis
    # 6.2's XAUTOCLAIM claims such entries; 7.x drops them itself).
    await redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    gone = text(await redis.xadd(STREAM, {"data": b"gone"}))
    kept = text(await redis.xadd(STREAM, {"data": b"kept"}))
    await redis.xreadgroup(GROUP, "victim", {STREAM: ">"})
    runner = ScriptRunner()
    for _ in range(2):
        await record_start(runner, redis, gone)
    await redis.xdel(STREAM, gone)
    await asyncio.sleep(0.03)
    outcome = await claim_idle_entries(runner, redis, KEYS, "alive", settings(2))
    assert [entry.id for entry in outcome.entries] == [kept]
    assert outcome.trimmed == [gone]
    assert outcome.dead_lettered == []
    assert await redis.xlen(KEYS.dead_letters) == 0
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 1
    assert not await redis.hexists(KEYS.started, gone)
