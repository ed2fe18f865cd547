"""``taskiq-atomic-claim serve`` as a real process against a real server: the
page in a real headless Chromium (Debian's ``chromium``, driven by
Playwright), its JSON, its gauges and its guarded changes.

Without a browser the browser test skips, saying why; under CI=true it
fails instead (.ci/run installs one). With SERVE_SCREENSHOT=docs/serve.png
it refreshes the README's screenshot; otherwise it writes its shot to a
temporary directory, so a test run never changes the tracked tree.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from taskiq_atomic_claim import AtomicRedisStreamBroker
from taskiq_atomic_claim.claim import claim_idle_entries
from taskiq_atomic_claim.cli.main import main
from taskiq_atomic_claim.dead_letters import move_to_dead_letters
from taskiq_atomic_claim.harness.embedded_server import free_port
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.web.history import FIELDS
from tests.conftest import Server
from tests.test_cli import cli_in_process
from tests.test_oom import until

GROUP = "taskiq"
TOKEN = "a-token-of-the-operators-own"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TASK = "reports.send_weekly"
# Counts, over ``ms`` milliseconds of live refreshes, the times the page
# held no dead-letter row after holding some.
BLANKED_ROWS = """ms => new Promise(done => {
  let blanked = 0;
  const rows = () => document.querySelectorAll("tr[data-letter]").length;
  const watch = new MutationObserver(() => { if (rows() === 0) blanked += 1; });
  watch.observe(document.body, {childList: true, subtree: true});
  setTimeout(() => { watch.disconnect(); done(blanked); }, ms);
})"""


def chromium_or_skip() -> str:
    """Debian's chromium, or skip saying why (fail under CI, which has it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    problem = None
    if path is None:
        problem = "no chromium on PATH (apt-get install chromium)"
    else:
        try:
            import playwright.async_api  # noqa: F401, PLC0415
        except ImportError:
            problem = "playwright is not installed (the test extra)"
    if problem is None:
        assert path is not None
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test needs a browser in CI: {problem}")
    pytest.skip(problem)


@dataclass
class Serve:
    base: str
    # None: not a serve process (an app mounted in this one).
    process: subprocess.Popen[bytes] | None = None

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=10) as reply:
            return str(reply.read().decode())

    def get(self, path: str) -> Any:
        body = self.get_text(path)
        return body if path == "/metrics" else json.loads(body)

    def post(self, path: str, body: Any, token: str | None = TOKEN) -> int:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(
            self.base + path, json.dumps(body).encode(), headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as error:
            return int(error.code)


def start_serve(url: str, *extra: str, token: str | None = None) -> Serve:
    port = free_port()
    env = {**os.environ}
    if token is not None:
        env["TASKIQ_ATOMIC_CLAIM_TOKEN"] = token
    process = subprocess.Popen(
        [sys.executable, "-m", "taskiq_atomic_claim.cli", "serve", "--url", url,
         "--port", str(port), "--refresh", "0.3", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    return Serve(f"http://127.0.0.1:{port}", process)


async def ready(serve: Serve) -> None:
    assert serve.process is not None

    def answers() -> bool:
        try:
            serve.get("/api/state")
        except OSError:
            assert serve.process is not None
            return serve.process.poll() is not None  # died: stop waiting
        return True

    assert await until(answers, 30)
    if serve.process.poll() is not None:
        assert serve.process.stderr is not None
        pytest.fail(serve.process.stderr.read().decode(errors="replace"))


def stop(serve: Serve) -> None:
    assert serve.process is not None
    serve.process.terminate()
    try:
        serve.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        serve.process.kill()
        serve.process.wait(timeout=10)


@pytest.fixture
async def queue(redis: Redis, server: Server) -> AsyncIterator[str]:
    """5 tasks kicked; a consumer that died holding 3 of them, 2 of them
    dead-lettered by the worker's own script; a live consumer holding none."""
    name = f"reports-{uuid.uuid4().hex[:6]}"
    keys = StreamKeys(name, GROUP)
    await redis.xgroup_create(name, GROUP, id="0", mkstream=True)
    broker = AtomicRedisStreamBroker(server.admin_url, queue_name=name)
    task = broker.register_task(lambda *a, **k: None, TASK)
    for week in range(5):
        await task.kiq(week, team="ops")
    await broker.shutdown()
    ids = [text(entry_id) for entry_id, _ in await redis.xrange(name) or []]
    await redis.xreadgroup(GROUP, "worker-dead", {name: ">"}, count=5)
    runner = ScriptRunner()
    for entry_id in ids[:2]:
        await move_to_dead_letters(
            runner,
            redis,
            keys,
            entry_id,
            "max_deliveries: started 3 times in workers that died",
            delete_acked=False,
            deliveries=3,
        )
    await redis.xgroup_createconsumer(name, GROUP, "worker-live")
    yield name
    await redis.delete(name, keys.dead_letters)


@pytest.fixture
async def serve(server: Server, queue: str) -> AsyncIterator[Serve]:
    started = start_serve(
        server.admin_url, "--queue", queue, "--allow-changes", token=TOKEN
    )
    try:
        await ready(started)
        yield started
    finally:
        stop(started)


@pytest.fixture
def chromium() -> Iterator[str]:
    yield chromium_or_skip()


async def test_the_page_shows_the_server_live_in_a_browser(
    chromium: str,
    serve: Serve,
    redis: Redis,
    server: Server,
    queue: str,
) -> None:
    from playwright.async_api import async_playwright, expect  # noqa: PLC0415

    keys = StreamKeys(queue, GROUP)
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(
            executable_path=chromium, args=CHROMIUM_FLAGS
        )
        try:
            page = await browser.new_page(viewport={"width": 1100, "height": 760})
            await page.goto(serve.base + "/")
            group = page.locator(f'section.group[data-group="{GROUP}"]')
            stream = page.locator(f'section.stream[data-stream="{queue}"]')
            await expect(group.locator('[data-k="pending"]').first).to_have_text("3")
            # The numbers on screen are the server's.
            info = {g["name"].decode(): g for g in await redis.xinfo_groups(queue)}
            length = await redis.xlen(queue)
            shown = stream.locator('.numbers [data-k="length"]')
            await expect(shown).to_have_text(str(length))
            assert info[GROUP]["pending"] == 3
            dead = await redis.xlen(keys.dead_letters)
            await expect(group.locator('[data-k="dead"]')).to_have_text(str(dead))
            consumers = group.locator("tr[data-consumer]")
            await expect(consumers).to_have_count(2)
            listed = await redis.xinfo_consumers(queue, GROUP)
            shown_consumers = group.locator('[data-k="consumers"]')
            await expect(shown_consumers).to_have_text(str(len(listed)))
            await expect(group.locator('[data-k="last-read"]')).to_contain_text("ago")
            dead_row = group.locator('tr[data-consumer="worker-dead"]')
            await expect(dead_row.locator('[data-k="pending"]')).to_have_text("3")
            letters = group.locator("tr[data-letter]")
            await expect(letters).to_have_count(2)
            await expect(letters.first.locator('[data-k="task"]')).to_have_text(TASK)
            await expect(letters.first.locator('[data-k="arguments"]')).to_contain_text(
                "team='ops'"
            )
            await expect(letters.first.locator('[data-k="reason"]')).to_contain_text(
                "max_deliveries"
            )
            if server.major >= 7:
                await expect(group.locator('[data-k="lag"]')).to_have_text("0")
            # A redraw keeps what is on screen until the new reading is in:
            # no refresh blanks the dead letters, even for a frame.
            blanked = await page.evaluate(BLANKED_ROWS, 1500)
            assert blanked == 0, f"dead letters blanked {blanked} times in 1.5 s"
            await expect(page.locator("#age")).not_to_have_text("-")

            # A task kicked: the page shows it without a reload.
            kicker = AtomicRedisStreamBroker(server.admin_url, queue_name=queue)
            await kicker.register_task(lambda *a, **k: None, TASK).kiq(9)
            await kicker.shutdown()
            await expect(shown).to_have_text(str(length + 1))
            if server.major >= 7:
                await expect(group.locator('[data-k="lag"]')).to_have_text("1")

            # Requeue through the page, with the operator's token.
            await page.fill("#token", TOKEN)
            await letters.first.locator('button[data-action="requeue"]').click()
            await expect(group.locator('[data-k="dead"]')).to_have_text(str(dead - 1))
            await expect(shown).to_have_text(str(length + 2))
            assert await redis.xlen(keys.dead_letters) == dead - 1
        finally:
            await browser.close()


async def test_the_page_asks_before_deleting_and_shows_refusals(
    chromium: str, serve: Serve, redis: Redis, queue: str
) -> None:
    from playwright.async_api import Dialog, async_playwright, expect  # noqa: PLC0415

    keys = StreamKeys(queue, GROUP)
    asked: list[str] = []
    answer = {"accept": True}

    async def on_dialog(dialog: Dialog) -> None:
        asked.append(dialog.message)
        await (dialog.accept() if answer["accept"] else dialog.dismiss())

    async with async_playwright() as driver:
        browser = await driver.chromium.launch(
            executable_path=chromium, args=CHROMIUM_FLAGS
        )
        try:
            page = await browser.new_page(viewport={"width": 1100, "height": 760})
            page.on("dialog", on_dialog)
            await page.goto(serve.base + "/")
            group = page.locator(f'section.group[data-group="{GROUP}"]')
            letters = group.locator("tr[data-letter]")
            await expect(letters).to_have_count(2)
            first = await letters.first.get_attribute("data-letter")
            delete = letters.first.locator('button[data-action="delete"]')
            shown = page.locator("#outcome")

            # A wrong token: asked first, then the 401 shows and stays
            # through redraws (serve refreshes every 0.3 s).
            await page.fill("#token", "not-the-token-at-all")
            await delete.click()
            await expect(shown).to_have_text(
                "delete refused (401): wrong or missing token"
            )
            assert asked == [
                f"Delete dead letter {first} (task {TASK}) of {queue} / {GROUP}"
                " for good?"
            ]
            await page.wait_for_timeout(1000)
            await expect(shown).to_have_text(
                "delete refused (401): wrong or missing token"
            )
            assert await redis.xlen(keys.dead_letters) == 2

            # The right token, but the operator says no: nothing is sent.
            await page.fill("#token", TOKEN)
            answer["accept"] = False
            await delete.click()
            assert await until(lambda: len(asked) == 2, 10)
            await page.wait_for_timeout(500)
            assert await redis.xlen(keys.dead_letters) == 2

            # Bulk by task name: a dry run counts them, the confirm names
            # the count; what is typed survives redraws.
            bulk_task = group.locator('[data-k="bulk-task"]')
            await bulk_task.fill("reports.nothing")
            await group.locator('button[data-bulk="delete"]').click()
            await expect(shown).to_have_text(
                f"no dead letters of task reports.nothing in {queue} / {GROUP}"
            )
            assert len(asked) == 2, "nothing to delete: nothing asked"
            await bulk_task.fill(TASK)
            await page.wait_for_timeout(1000)
            await expect(bulk_task).to_have_value(TASK)
            answer["accept"] = True
            await group.locator('button[data-bulk="delete"]').click()
            await expect(shown).to_have_text(
                f"deleted 2 ({queue} / {GROUP} of task {TASK})"
            )
            assert asked[-1] == (
                f"Delete 2 dead letters of task {TASK} of {queue} / {GROUP} for good?"
            )
            assert await redis.xlen(keys.dead_letters) == 0
            await expect(group.locator('[data-k="dead"]')).to_have_text("0")
        finally:
            await browser.close()


def task_ids(entries: Any) -> list[str]:
    """The taskiq task ids of stream entries, in order."""
    return [json.loads(fields[b"data"])["task_id"] for _, fields in entries or []]


async def test_the_page_diagnoses_finds_tasks_and_draws_history_in_a_browser(
    chromium: str, redis: Redis, server: Server, queue: str, tmp_path: Path
) -> None:
    """Three problem states at once (a backlog no consumer reads, a dead
    consumer holding entries past the idle timeout, dead letters): each
    appears at the top within one refresh; a task is found where it is."""
    from playwright.async_api import async_playwright, expect  # noqa: PLC0415

    keys = StreamKeys(queue, GROUP)
    backlog = f"mail-{uuid.uuid4().hex[:6]}"
    await redis.xgroup_create(backlog, GROUP, id="0", mkstream=True)
    kicker = AtomicRedisStreamBroker(server.admin_url, queue_name=backlog)
    mail = kicker.register_task(lambda *a, **k: None, "mail.send")
    for n in range(4):
        await mail.kiq(n, to="ops@example.com " + "x" * 200)  # a long argument
    await kicker.shutdown()
    async with redis.pipeline(transaction=False) as pipe:
        for n in range(15):
            pipe.xgroup_createconsumer(queue, GROUP, f"spare-{n:02d}")
        await pipe.execute()
    waiting_id = task_ids(await redis.xrange(backlog, count=1))[0]
    pending = await redis.xpending_range(queue, GROUP, "-", "+", 1)
    pending_entry = pending[0]["message_id"]
    pending_id = task_ids(await redis.xrange(queue, pending_entry, pending_entry))[0]
    dead_id = task_ids(await redis.xrange(keys.dead_letters, count=1))[0]

    started = start_serve(
        server.admin_url, "--queue", queue, "--queue", backlog,
        "--idle-timeout-ms", "300", "--sample", "0.3",
    )  # fmt: skip
    try:
        await ready(started)
        async with async_playwright() as driver:
            browser = await driver.chromium.launch(
                executable_path=chromium, args=CHROMIUM_FLAGS
            )
            try:
                page = await browser.new_page(viewport={"width": 1100, "height": 900})
                await page.goto(started.base + "/")
                findings = page.locator("#findings .finding")
                first = findings.first
                await expect(first).to_have_attribute("data-kind", "unread-backlog")
                await expect(first).to_have_attribute("data-severity", "critical")
                await expect(first).to_contain_text(f"{backlog} / {GROUP}")
                await expect(first).to_contain_text("what to do: start workers")
                dead = page.locator('#findings [data-kind="dead-consumer"]')
                await expect(dead).to_contain_text(f"{queue} / {GROUP} / worker-dead")
                letters = page.locator('#findings [data-kind="dead-letters"]')
                await expect(letters).to_contain_text("2 dead letters")
                # At the top, in colour: above the streams, in the first screen.
                # One evaluate: the page redraws every 0.3 s.
                top, streams_top, colour = await page.evaluate(
                    """() => {
                      const first = document.querySelector("#findings .finding");
                      return [first.getBoundingClientRect().y,
                              document.getElementById("streams").getBoundingClientRect().y,
                              getComputedStyle(first).backgroundColor];
                    }"""
                )
                assert top < 200 and top < streams_top, (top, streams_top)
                assert colour == "rgb(253, 231, 231)", colour

                group = page.locator(
                    f'section.stream[data-stream="{queue}"] section.group'
                )
                gone = group.locator('tr[data-consumer="worker-dead"]')
                await expect(gone).to_have_attribute("data-liveness", "dead")
                # 17 consumers: the 10 holding most listed, the rest folded.
                await expect(group.locator("tr[data-consumer]:visible")).to_have_count(
                    10
                )
                more = group.locator('[data-k="more-consumers"] summary')
                await expect(more).to_have_text("and 7 more")

                # History: each sparkline drawn from serve's own samples.
                spark = group.locator('[data-k="spark-backlog"] polyline')
                await expect(spark).to_have_count(1)
                points = await spark.get_attribute("points")
                assert points is not None and len(points.split()) >= 2
                await expect(
                    group.locator('[data-k="spark-kicked"] svg')
                ).to_have_count(1)

                # Find a task in each place, by its id; and by its name.
                for task_id, place, where in (
                    (waiting_id, "waiting", "waiting"),
                    (pending_id, "pending", "held by worker-dead for"),
                    (dead_id, "dead", "dead-lettered"),
                ):
                    await page.fill("#q", task_id)
                    await page.click("#search button")
                    row = page.locator(f'#tasks tr[data-place="{place}"]')
                    await expect(row).to_have_count(1)
                    # Its own view (a dead letter is also "acked" in the
                    # stream: dead-lettering acks it).
                    await row.locator("td").first.click()
                    view = page.locator('[data-k="task-view"]')
                    await expect(view.locator('[data-k="task id"]')).to_have_text(
                        task_id
                    )
                    await expect(view.locator('[data-k="where"]')).to_contain_text(
                        where
                    )
                view = page.locator('[data-k="task-view"]')
                await expect(
                    view.locator('[data-k="dead-letter reason"]')
                ).to_contain_text("max_deliveries")
                await page.fill("#q", "mail.send")
                await page.click("#search button")
                await expect(page.locator("#tasks tr[data-task]")).to_have_count(4)
                await expect(page.locator("#searched")).to_contain_text(
                    "searched the newest 10000 entries of each stream"
                )
                # A long argument is cut to one line, whole on a click.
                cell = page.locator("#tasks tr[data-task] .cut").nth(1)
                cut_height = (await cell.bounding_box() or {"height": 0})["height"]
                await cell.click()
                full = (await cell.bounding_box() or {"height": 0})["height"]
                assert full > 2 * cut_height, (cut_height, full)
                await page.click('[data-k="close-search"]')
                await page.fill("#q", "")

                # Tasks kicked in two bursts: the history follows.
                kicker = AtomicRedisStreamBroker(server.admin_url, queue_name=backlog)
                mail = kicker.register_task(lambda *a, **k: None, "mail.send")
                for burst in (2, 4):
                    for n in range(burst):
                        await mail.kiq(n)
                    await asyncio.sleep(0.8)
                await kicker.shutdown()
                mail_group = page.locator(
                    f'section.stream[data-stream="{backlog}"] section.group'
                )
                await expect(
                    mail_group.locator('[data-k="spark-backlog"] figcaption')
                ).to_contain_text("backlog 10")

                # Dead-letter rows show task ids.
                ids = group.locator('tr[data-letter] [data-k="task-id"]')
                await expect(ids).to_have_count(2)
                shot = Path(
                    os.environ.get("SERVE_SCREENSHOT") or tmp_path / "serve.png"
                )
                png = await page.screenshot(path=str(shot), full_page=True)
                assert png.startswith(b"\x89PNG")

                # Reclaims, as the workers count them: drawn as a rate.
                reclaimed = group.locator('[data-k="spark-reclaimed"]')
                await expect(reclaimed.locator("figcaption")).to_have_text(
                    "reclaimed 0.00/s"
                )
                settings = ClaimSettings.from_broker_arguments(
                    idle_timeout=300,
                    claim_interval=None,
                    unacknowledged_batch_size=100,
                    unacknowledged_lock_timeout=None,
                )
                outcome = await claim_idle_entries(
                    ScriptRunner(), redis, keys, "worker-live", settings
                )
                assert len(outcome.entries) == 3  # worker-dead's
                await expect(reclaimed.locator("svg title")).to_have_text(
                    re.compile(r"^reclaimed: max (?!0\.00/s)[0-9.]+/s over")
                )
            finally:
                await browser.close()
    finally:
        stop(started)
        await redis.delete(backlog)


async def test_the_page_greys_its_numbers_when_the_server_is_unreadable_in_a_browser(
    chromium: str, redis: Redis, server: Server, queue: str
) -> None:
    from playwright.async_api import async_playwright, expect  # noqa: PLC0415

    user, password = f"page-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    await redis.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"],
        channels=["*"], commands=["+@all"],
    )  # fmt: skip
    host_port = server.admin_url.rsplit("@", 1)[-1].removeprefix("redis://")
    started = start_serve(f"redis://{user}:{password}@{host_port}", "--queue", queue)
    try:
        await ready(started)
        async with async_playwright() as driver:
            browser = await driver.chromium.launch(
                executable_path=chromium, args=CHROMIUM_FLAGS
            )
            try:
                page = await browser.new_page(viewport={"width": 1100, "height": 760})
                await page.goto(started.base + "/")
                pending = page.locator('section.group [data-k="pending"]').first
                await expect(pending).to_have_text("3")
                await expect(page.locator("#streams")).not_to_have_class("stale")
                # The page's user is shut out: its connections dropped, and
                # every reconnection refused.
                await redis.acl_setuser(user, enabled=False)
                await redis.client_kill_filter(user=user)
                unreadable = page.locator('#findings [data-kind="unreadable"]')
                await expect(unreadable).to_have_attribute("data-severity", "critical")
                await expect(unreadable).to_contain_text("the server cannot be read")
                await expect(page.locator("#streams")).to_have_class("stale")
                await expect(pending).to_have_text("3")  # the last reading, greyed
                await redis.acl_setuser(user, enabled=True)
                await expect(page.locator("#streams")).not_to_have_class("stale")
                await expect(unreadable).to_have_count(0)
            finally:
                await browser.close()
    finally:
        stop(started)
        await redis.acl_deluser(user)


def post_json(serve: Serve, path: str, body: Any) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    request = urllib.request.Request(
        serve.base + path, json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read())


async def test_bulk_changes_have_a_dry_run_and_unknown_names_are_404(
    serve: Serve, redis: Redis, queue: str
) -> None:
    keys = StreamKeys(queue, GROUP)
    where = {"stream": queue, "group": GROUP}
    code, body = post_json(
        serve, "/api/dead-letters/requeue", {**where, "all": True, "dry_run": True}
    )
    assert (code, body["count"], len(body["ids"])) == (200, 2, 2)
    code, body = post_json(
        serve, "/api/dead-letters/delete", {**where, "task": "other", "dry_run": True}
    )
    assert (code, body["ids"]) == (200, [])
    assert await redis.xlen(keys.dead_letters) == 2, "a dry run changes nothing"

    code, body = post_json(
        serve, "/api/dead-letters/delete", {**where, "group": "tasikq", "all": True}
    )
    assert code == 404
    assert body["error"] == (
        f"queue {queue!r} has no group 'tasikq' (its groups: {GROUP!r})"
    )
    code, body = post_json(
        serve, "/api/dead-letters/delete", {**where, "stream": "nope", "all": True}
    )
    assert code == 404 and "no queue 'nope'" in body["error"]
    code, body = post_json(
        serve, "/api/dead-letters/delete", {**where, "all": True, "task": TASK}
    )
    assert code == 400 and "one of ids, task or all" in body["error"]

    code, body = post_json(serve, "/api/dead-letters/requeue", {**where, "task": TASK})
    assert (code, len(body["requeued"])) == (200, 2)
    assert await redis.xlen(keys.dead_letters) == 0


def shape(value: Any) -> Any:
    """A JSON document's keys, nested, without its values."""
    if isinstance(value, dict):
        return {key: shape(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


async def test_json_gauges_and_changes_are_guarded(
    serve: Serve,
    redis: Redis,
    server: Server,
    queue: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    keys = StreamKeys(queue, GROUP)
    state = serve.get("/api/state")
    assert state["format"] == 1 and state["page"]["changes"] is True
    # inspect --json's document, in its format, plus the page's own part.
    code, out, err = await cli_in_process(
        capsys, "inspect", "--url", server.admin_url, "--queue", queue, "--json"
    )
    assert code == 0, err
    inspected = json.loads(out)
    # serve adds its page, its diagnosis and each consumer's liveness.
    for consumer in state["streams"][0]["groups"][0]["consumers"]:
        assert consumer.pop("liveness") in ("live", "dead", "quiet")
    assert shape(state) == {
        **shape(inspected),
        "page": shape(state["page"]),
        "diagnosis": shape(state["diagnosis"]),
    }
    assert state["streams"][0]["length"] == inspected["streams"][0]["length"]
    # Bound to 127.0.0.1 only: another loopback address gets no answer.
    port = serve.base.rpartition(":")[2]
    with pytest.raises(urllib.error.URLError):
        Serve(f"http://127.0.0.2:{port}").get("/api/state")
    [stream] = state["streams"]
    [group] = stream["groups"]
    assert (stream["length"], group["pending"], group["consumer_count"]) == (5, 3, 2)
    assert group["dead_letters"]["count"] == 2

    # Gauges: the same numbers, one series per (stream, group).
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(serve.get("/metrics"))
        for sample in family.samples
        if sample.labels.get("stream") == queue
    }
    assert samples["taskiq_atomic_claim_stream_length"] == 5
    assert samples["taskiq_atomic_claim_pending"] == 3
    assert samples["taskiq_atomic_claim_dead_letters"] == 2
    assert samples["taskiq_atomic_claim_consumers"] == 2

    # Dead letters page newest first, one at a time.
    first = serve.get(f"/api/dead-letters?stream={queue}&group={GROUP}&count=1")
    assert first["count"] == 2 and len(first["letters"]) == 1
    assert first["letters"][0]["task"] == TASK
    older = serve.get(
        f"/api/dead-letters?stream={queue}&group={GROUP}&count=1"
        f"&before={first['next_before']}"
    )
    assert older["letters"][0]["id"] < first["letters"][0]["id"]
    assert older["next_before"] is None

    # Changes: POST with the token only; a GET never changes anything.
    target = {"stream": queue, "group": GROUP, "ids": [first["letters"][0]["id"]]}
    with pytest.raises(urllib.error.HTTPError) as refused:
        serve.get("/api/dead-letters/delete")
    assert refused.value.code == 405
    assert serve.post("/api/dead-letters/delete", target, token=None) == 401
    assert serve.post("/api/dead-letters/delete", target, token="x" * 30) == 401
    assert serve.post("/api/dead-letters/delete", {**target, "ids": 1}) == 400
    assert await redis.xlen(keys.dead_letters) == 2
    assert serve.post("/api/dead-letters/delete", target) == 200
    assert await redis.xlen(keys.dead_letters) == 1

    # Thousands of consumers and pending entries: the page lists a bounded
    # number of consumers, reads a bounded part of the PEL, and asking
    # often reads the server no more often.
    async with redis.pipeline(transaction=False) as pipe:
        for n in range(2000):
            pipe.xgroup_createconsumer(queue, GROUP, f"idle-{n:04d}")
        for _ in range(3000):
            pipe.xadd(queue, {"data": b"{}"})
        await pipe.execute()
    await redis.xreadgroup(GROUP, "worker-busy", {queue: ">"}, count=3000)
    read_only = start_serve(
        server.admin_url, "--queue", queue, "--consumers", "50", "--refresh", "60"
    )
    try:
        await ready(read_only)
        before = await command_calls(redis)
        for _ in range(20):
            read_only.get("/api/state")
            read_only.get("/metrics")
        assert await command_calls(redis) == before, "read per request"
        [busy] = read_only.get("/api/state")["streams"][0]["groups"]
        assert (busy["consumer_count"], busy["pending"]) == (2003, 3003)
        assert len(busy["consumers"]) == 50
        assert (busy["pel_scanned"], busy["pel_scan_complete"]) == (1000, False)
        assert {"worker-dead", "worker-busy"} <= {c["name"] for c in busy["consumers"]}
        assert read_only.post("/api/dead-letters/delete", target) == 403
    finally:
        stop(read_only)


async def command_calls(redis: Redis) -> dict[str, int]:
    """Calls per command the server has run, but for INFO itself."""
    stats = await redis.info("commandstats")
    return {
        name: int(stat["calls"])
        for name, stat in stats.items()
        if name != "cmdstat_info"
    }


async def test_streams_are_discovered_once_a_minute_not_per_reading(
    redis: Redis, queue: str
) -> None:
    from taskiq_atomic_claim.web import create_app  # noqa: PLC0415

    reader = create_app(redis, refresh_s=60, discover_s=60).state.reader
    await reader.latest()
    first = await command_calls(redis)
    for _ in range(3):
        reader.expire()  # as after a change: the next ask reads again
        await reader.latest()
    again = await command_calls(redis)
    assert again.get("cmdstat_scan") == first.get("cmdstat_scan")
    groups = "cmdstat_xinfo|groups"
    assert again[groups] == first[groups] + 3, "read once per ask after expire"
    [shown] = (await reader.latest()).streams
    assert shown.name == queue


def test_allow_changes_needs_a_token(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TASKIQ_ATOMIC_CLAIM_TOKEN", raising=False)
    arguments = ["serve", "--url", server.admin_url, "--allow-changes"]
    assert main(arguments) == 2
    assert "TASKIQ_ATOMIC_CLAIM_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("TASKIQ_ATOMIC_CLAIM_TOKEN", "short")
    assert main(arguments) == 2


async def test_the_app_mounts_inside_another_starlette_app(
    server: Server, redis: Redis, queue: str
) -> None:
    import uvicorn  # noqa: PLC0415
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.routing import Mount  # noqa: PLC0415

    from taskiq_atomic_claim.web import create_app  # noqa: PLC0415

    port = free_port()
    nobody = Redis.from_url(f"redis://127.0.0.1:{free_port()}")
    app = Starlette(
        routes=[
            Mount("/queues", create_app(redis, streams=[queue])),
            Mount("/gone", create_app(nobody, streams=[queue])),
        ]
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    running = uvicorn.Server(config)
    task = asyncio.create_task(running.serve())
    try:
        assert await until(lambda: running.started, 30)
        mounted = Serve(f"http://127.0.0.1:{port}/queues")
        page = await asyncio.to_thread(mounted.get_text, "")  # redirected to /
        assert "api/state" in page
        state = await asyncio.to_thread(mounted.get, "/api/state")
        assert state["streams"][0]["groups"][0]["pending"] == 3
        assert state["page"]["changes"] is False
        # A server that cannot be read: an answer saying why, not a crash.
        gone = Serve(f"http://127.0.0.1:{port}/gone")
        with pytest.raises(urllib.error.HTTPError) as unreadable:
            await asyncio.to_thread(gone.get, "/api/state")
        assert unreadable.value.code == 503
        assert "ConnectionError" in json.loads(unreadable.value.read())["error"]
    finally:
        running.should_exit = True
        await task
        await nobody.aclose()


async def test_the_gauges_are_the_whole_groups_not_the_consumers_listed(
    redis: Redis, queue: str
) -> None:
    # --consumers bounds the consumers the page lists (those holding most);
    # the gauges count every one, and the last read is whoever read last,
    # listed or not.
    from taskiq_atomic_claim.web import create_app  # noqa: PLC0415

    await asyncio.sleep(0.5)
    await redis.xadd(queue, {"data": b"{}"})
    await redis.xreadgroup(GROUP, "worker-live", {queue: ">"}, count=1)
    reader = create_app(redis, streams=[queue], consumer_limit=1).state.reader
    [group] = (await reader.latest()).streams[0].groups
    assert [c.name for c in group.consumers] == ["worker-dead"]
    registry = reader.metrics()[0]
    labels = {"stream": queue, "group": GROUP}

    def gauge(name: str) -> float:
        value = registry.get_sample_value(f"taskiq_atomic_claim_{name}", labels)
        assert value is not None, name
        return float(value)

    idle = {
        text(c["name"]): int(c["idle"])
        for c in await redis.xinfo_consumers(queue, GROUP)
    }
    assert idle["worker-dead"] >= 500
    assert gauge("consumers") == 2
    assert gauge("last_read_age_seconds") * 1000 <= idle["worker-live"]
    assert group.last_read_idle_ms is not None
    assert group.last_read_idle_ms <= idle["worker-live"]


async def test_dead_letters_added_lately_are_told_from_old_ones(
    redis: Redis, queue: str
) -> None:
    # serve's own history tells the diagnosis how many dead letters came
    # lately: none, a notice; some, a warning that counts them.
    from taskiq_atomic_claim.web import create_app  # noqa: PLC0415

    reader = create_app(redis, streams=[queue], sample_s=0.05).state.reader

    async def dead_letters_finding() -> Any:
        await asyncio.sleep(0.06)
        reader.expire()
        await reader.latest()
        [finding] = [f for f in reader.findings if f.kind == "dead-letters"]
        return finding

    await dead_letters_finding()  # one sample: nothing to compare yet
    quiet = await dead_letters_finding()
    assert (quiet.severity.value, quiet.problem.split(" in ")[0]) == (
        "notice",
        "2 dead letters",
    )
    ids = [text(i) for i, _ in await redis.xrange(queue, count=3) or []]
    await move_to_dead_letters(
        ScriptRunner(), redis, StreamKeys(queue, GROUP), ids[2], "max_deliveries",
        delete_acked=False, deliveries=3,
    )  # fmt: skip
    growing = await dead_letters_finding()
    assert growing.severity.value == "warning"
    assert growing.problem.startswith("3 dead letters, 1 added in the last ")
    history = reader.history.to_json()
    [samples] = [g["samples"] for g in history["groups"] if g["stream"] == queue]
    assert [s[3] for s in samples] == [2, 2, 3]


async def test_the_history_counts_reclaims_through_a_reset_of_the_count(
    redis: Redis, queue: str
) -> None:
    # The workers' count (reclaim_count.py) as serve samples it: a running
    # total that a lapsed or deleted count does not lower (a decrease is a
    # reset: what the count reads after it was reclaimed since).
    from taskiq_atomic_claim.web import create_app  # noqa: PLC0415

    reader = create_app(redis, streams=[queue], sample_s=0.05).state.reader
    keys = StreamKeys(queue, GROUP)

    def settings(batch: int) -> ClaimSettings:
        return ClaimSettings.from_broker_arguments(
            idle_timeout=20,
            claim_interval=None,
            unacknowledged_batch_size=batch,
            unacknowledged_lock_timeout=0.01,
        )

    async def sample() -> None:
        await asyncio.sleep(0.06)
        reader.expire()
        await reader.latest()

    async def reclaim(consumer: str, batch: int) -> int:
        await asyncio.sleep(0.03)  # idle past idle_timeout, the lease gone
        outcome = await claim_idle_entries(
            ScriptRunner(), redis, keys, consumer, settings(batch)
        )
        return len(outcome.entries)

    await sample()
    assert await reclaim("worker-live", 100) == 3  # worker-dead's
    await sample()
    await sample()
    await redis.delete(keys.reclaimed)  # as its expiry would
    assert await reclaim("worker-other", 2) == 2
    await sample()
    assert await redis.get(keys.reclaimed) == b"2"
    [samples] = [g["samples"] for g in reader.history.to_json()["groups"]]
    assert [s[FIELDS.index("reclaimed")] for s in samples] == [0, 3, 3, 5]
