"""The live page of one server, as an ASGI app (Starlette).

``create_app(client)`` is what ``taskiq-atomic-claim serve`` runs under
uvicorn, and what a FastAPI or Starlette app can mount::

    app.mount("/queues", create_app(Redis.from_url(URL)))

Routes, relative to where it is mounted:

- ``GET /``: the page; it polls ``api/state`` and redraws in place.
- ``GET /api/state``: ``inspect --json``'s format (``inspection_json.py``)
  plus a ``page`` object: ``{"refresh_s": 2.0, "read_at_ms": ...,
  "changes": false}``, a ``diagnosis`` object: ``{"idle_timeout_ms": ...,
  "findings": [...]}`` (``doctor --json``'s findings, ranked, from the same
  code: ``admin/doctor.inspection_findings``) and each consumer's
  ``"liveness"``: ``live``, ``dead`` or ``quiet``
  (``admin/doctor.consumer_liveness``). When the server cannot be read: a
  503 with ``error`` and an ``unreadable`` finding.
- ``GET /api/history``: serve's own samples (``history.py``), one per
  ``sample_s``, of the last hour.
- ``GET /api/tasks?q=ID_OR_NAME``: the tasks of that id or name, waiting,
  pending, acked or dead-lettered, in the newest entries of each stream
  (``admin/tasks.py``; the answer says how many it read).
- ``GET /api/dead-letters?stream=S&group=G&before=ID&count=N``: one page
  of dead letters, newest first (``dead_letter_page_to_json``).
- ``POST /api/dead-letters/requeue`` and ``POST /api/dead-letters/delete``
  with ``{"stream": S, "group": G}`` and one of ``"ids": [...]``,
  ``"task": NAME`` or ``"all": true`` (``"dry_run": true``: the ids it would
  act on, nothing changed), and the header ``Authorization: Bearer TOKEN``:
  only when made with ``token``; never a GET. An unknown stream or group
  is a 404.
- ``GET /metrics``: the gauges of ``taskiq_atomic_claim.gauges``, from the
  same reading as the page.

Once asked anything, it also reads on its own every ``sample_s`` (or
``refresh_s``, whichever is longer) so that the history has no gaps.

Reads are bounded per refresh and shared: the server is read at most once
per ``refresh_s`` whoever asks (page, JSON, scrape), and reading takes at
most a fifth of the time (``gauges.next_gap``); discovery (a SCAN) runs
once per ``discover_s``, and each group lists at most ``consumer_limit``
consumers. No lifespan is needed, so it works mounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Route

from taskiq_atomic_claim.admin.dead_letters import (
    chosen_dead_letter_ids,
    dead_letters_page,
    delete_dead_letters,
    requeue_dead_letters,
    unknown_pair,
)
from taskiq_atomic_claim.admin.doctor import (
    Finding,
    Severity,
    Thresholds,
    consumer_liveness,
    inspection_findings,
)
from taskiq_atomic_claim.admin.inspection import (
    Inspection,
    discover_streams,
    inspect_server,
)
from taskiq_atomic_claim.admin.inspection_json import (
    FORMAT,
    dead_letter_page_to_json,
    inspection_to_json,
)
from taskiq_atomic_claim.admin.report_json import finding_to_json
from taskiq_atomic_claim.admin.tasks import find_tasks, task_search_to_json
from taskiq_atomic_claim.gauges import (
    declare,
    forget,
    next_gap,
    publish,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import require_name
from taskiq_atomic_claim.web.history import History

MAX_PAGE = 200
MAX_QUERY_CHARS = 200
# How the page spells the connection options in a command it advises.
REACH = "--url URL"
MIN_TOKEN_CHARS = 16


class Reader:
    """The latest reading of the server, renewed when older than
    ``refresh_s``; concurrent askers share one renewal."""

    def __init__(
        self,
        client: Redis,
        streams: list[str] | None,
        group: str | None,
        refresh_s: float,
        discover_s: float,
        consumer_limit: int,
        node: str | None,
        thresholds: Thresholds,
        sample_s: float,
    ) -> None:
        self.client = client
        self.thresholds = thresholds
        self.history = History(sample_s)
        self.findings: list[Finding] = []
        self._sampler: asyncio.Task[None] | None = None
        self.streams = streams
        self.group = group
        self.refresh_s = refresh_s
        self.discover_s = discover_s
        self.consumer_limit = consumer_limit
        self.node = node
        self.runner = ScriptRunner()
        self._lock = asyncio.Lock()
        self._next_read = -float("inf")
        self._discovered_at = -float("inf")
        self._found: tuple[list[str], bool] = ([], False)
        self.inspection: Inspection | None = None
        self.read_at_ms = 0
        self._metrics: tuple[Any, dict[str, Any]] | None = None
        self._published: set[tuple[str, str]] = set()

    async def latest(self) -> Inspection:
        async with self._lock:
            now = time.monotonic()
            if self.inspection is None or now >= self._next_read:
                self.inspection = await self._read(now)
                self.read_at_ms = int(time.time() * 1000)
                self.history.add(self.inspection, self.read_at_ms)
                self.findings, _ = await inspection_findings(
                    self.client,
                    self.inspection,
                    self.thresholds,
                    self.history.dead_letters_added(),
                )
                took = time.monotonic() - now
                self._next_read = now + took + next_gap(self.refresh_s, took)
                self._publish(self.inspection)
            return self.inspection

    def sample(self) -> None:
        """From the first ask on, read every ``sample_s`` whoever asks: the
        history has no gaps while nobody looks (started here, in the app's
        own loop: no lifespan needed when mounted)."""
        if self._sampler is None:
            self._sampler = asyncio.create_task(self._sample_forever())

    async def _sample_forever(self) -> None:
        gap = max(self.history.sample_s, self.refresh_s)
        while True:
            # A failed reading is the page's to show; sampling goes on.
            with contextlib.suppress(RedisError, OSError):
                await self.latest()
            await asyncio.sleep(gap)

    def expire(self) -> None:
        """The next ask reads again (after a change made through the page)."""
        self._next_read = -float("inf")

    async def _read(self, now: float) -> Inspection:
        streams = self.streams
        if streams is None and now - self._discovered_at >= self.discover_s:
            self._found = await discover_streams(self.client)
            self._discovered_at = now
        named = self.streams is not None
        inspection = await inspect_server(
            self.client,
            streams if named else self._found[0],
            self.group,
            self.runner,
            self.consumer_limit,
        )
        if named:
            return inspection
        if self.group is not None:  # discovered streams without it: not ours
            kept = [v for v in inspection.streams if any(g.exists for g in v.groups)]
            inspection = dataclasses.replace(inspection, streams=kept)
        return dataclasses.replace(
            inspection, discovered=True, truncated=self._found[1]
        )

    def metrics(self) -> tuple[Any, dict[str, Any]]:
        """This app's own registry: mounted beside a worker's middleware, its
        series must not clash with the default registry's."""
        if self._metrics is None:
            from prometheus_client import CollectorRegistry  # noqa: PLC0415

            from taskiq_atomic_claim.gauges import prometheus_gauges  # noqa: PLC0415

            registry = CollectorRegistry()
            self._metrics = (registry, prometheus_gauges(registry))
        return self._metrics

    def _publish(self, inspection: Inspection) -> None:
        _, families = self.metrics()
        seen = set()
        for stream in inspection.streams:
            for group in stream.groups:
                if not group.exists:
                    continue
                seen.add((stream.name, group.name))
                declare(families, stream.name, group.name)
                publish(families, stream.name, group.name, group.gauges)
        for stream_name, group_name in self._published - seen:
            forget(families, stream_name, group_name)
        self._published = seen


def _keys(source: dict[str, Any] | Any) -> StreamKeys:
    try:
        stream = require_name("stream", source.get("stream"))
        group = require_name("group", source.get("group"))
    except (ValueError, TypeError) as error:
        raise _BadRequestError(str(error)) from None
    return StreamKeys(stream, group)


class _BadRequestError(Exception):
    pass


class _Routes:
    """The handlers of one app, over one ``Reader``."""

    def __init__(self, reader: Reader, token: str | None) -> None:
        self.reader = reader
        self.client = reader.client
        self.token = token
        self.page = resources.files(__package__).joinpath("page.html").read_text()

    async def index(self, request: Request) -> Response:
        # The page's URLs are relative: mounted at /queues, it must be
        # /queues/ for them to resolve under the mount.
        if not request.url.path.endswith("/"):
            return RedirectResponse(request.url.replace(path=request.url.path + "/"))
        return HTMLResponse(self.page)

    async def state(self, _: Request) -> Response:
        reader = self.reader
        reader.sample()
        inspection = await reader.latest()
        body = inspection_to_json(inspection, node=reader.node)
        body["page"] = {
            "refresh_s": reader.refresh_s,
            "read_at_ms": reader.read_at_ms,
            "changes": self.token is not None,
        }
        idle_timeout = reader.thresholds.idle_timeout_ms
        body["diagnosis"] = {
            "idle_timeout_ms": idle_timeout,
            "findings": [spelled(f) for f in reader.findings],
        }
        for stream_json, stream in zip(
            body["streams"], inspection.streams, strict=True
        ):
            for group_json, group in zip(
                stream_json["groups"], stream.groups, strict=True
            ):
                for consumer_json, consumer in zip(
                    group_json["consumers"], group.consumers, strict=True
                ):
                    liveness = consumer_liveness(consumer, idle_timeout)
                    consumer_json["liveness"] = liveness.value
        return JSONResponse(body)

    async def history(self, _: Request) -> Response:
        self.reader.sample()
        return JSONResponse(self.reader.history.to_json())

    async def tasks(self, request: Request) -> Response:
        query = request.query_params.get("q", "").strip()
        if not 0 < len(query) <= MAX_QUERY_CHARS:
            raise _BadRequestError(
                f"q must be a task id or name of 1..{MAX_QUERY_CHARS} characters"
            )
        inspection = await self.reader.latest()
        groups = [
            (stream.name, group.name, group.last_delivered_id)
            for stream in inspection.streams
            for group in stream.groups
            if group.exists
        ]
        found = await find_tasks(self.client, groups, query)
        return JSONResponse(task_search_to_json(found))

    async def letters(self, request: Request) -> Response:
        keys = _keys(request.query_params)
        try:
            count = int(request.query_params.get("count", "50"))
        except ValueError:
            raise _BadRequestError("count must be a whole number") from None
        if not 1 <= count <= MAX_PAGE:
            raise _BadRequestError(f"count must be 1..{MAX_PAGE}, got {count}")
        before = request.query_params.get("before") or None
        found = await dead_letters_page(self.client, keys, before, count + 1)
        total = int(await self.client.xlen(keys.dead_letters))
        return JSONResponse(dead_letter_page_to_json(keys, found, count, total))

    async def change(self, request: Request) -> Response:
        """Requeue or delete dead letters: POST only, with the token."""
        if self.token is None:
            return JSONResponse(
                {"error": "read-only: serve was started without --allow-changes"},
                status_code=403,
            )
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
            return JSONResponse({"error": "wrong or missing token"}, status_code=401)
        change = _change_request(await request.body())
        keys = change.keys
        problem = await unknown_pair(self.client, keys)
        if problem is not None:
            return JSONResponse({"error": problem}, status_code=404)
        ids = await chosen_dead_letter_ids(self.client, keys, change.ids, change.task)
        if change.dry_run:
            # What the same request without dry_run acts on, as of now.
            return JSONResponse(
                {"format": FORMAT, "dry_run": True, "ids": ids, "count": len(ids)}
            )
        if request.url.path.endswith("/requeue"):
            runner = self.reader.runner
            moved = await requeue_dead_letters(runner, self.client, keys, ids)
            result: dict[str, Any] = {"requeued": [new for _, new in moved]}
        else:
            result = {"deleted": await delete_dead_letters(self.client, keys, ids)}
        self.reader.expire()
        return JSONResponse({"format": FORMAT, **result})

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import (  # noqa: PLC0415
            CONTENT_TYPE_LATEST,
            generate_latest,
        )

        await self.reader.latest()
        registry = self.reader.metrics()[0]
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@dataclasses.dataclass(frozen=True)
class _Change:
    keys: StreamKeys
    ids: list[str] | None  # None: by task name, or all
    task: str | None
    dry_run: bool


def _change_request(raw: bytes) -> _Change:
    try:
        body = json.loads(raw)
    except ValueError:
        raise _BadRequestError("the body must be JSON") from None
    if not isinstance(body, dict):
        raise _BadRequestError("the body must be a JSON object")
    keys = _keys(body)
    chosen = [name for name in ("ids", "task", "all") if name in body]
    if len(chosen) != 1:
        raise _BadRequestError("name the dead letters: one of ids, task or all")
    ids, task = body.get("ids"), body.get("task")
    if "ids" in body and (
        not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)
    ):
        raise _BadRequestError("ids must be a list of dead-letter ids")
    if "ids" in body and not ids:
        raise _BadRequestError("ids is empty: name the dead letters")
    if "task" in body and (not isinstance(task, str) or not task):
        raise _BadRequestError("task must be a task name")
    if "all" in body and body["all"] is not True:
        raise _BadRequestError("all must be true")
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise _BadRequestError("dry_run must be true or false")
    return _Change(keys, ids, task, dry_run)


async def _bad_request(_: Request, error: Exception) -> Response:
    return JSONResponse({"error": str(error)}, status_code=400)


def spelled(finding: Finding) -> dict[str, Any]:
    from taskiq_atomic_claim.cli.doctor import advice  # noqa: PLC0415

    return finding_to_json(finding, lambda f: advice(f, REACH))


async def _unreachable(_: Request, error: Exception) -> Response:
    """The server could not be read: the page says so, greys what it
    showed, and polls on."""
    message = f"{type(error).__name__}: {error}"
    unreadable = Finding(
        "unreadable",
        "server",
        f"the server cannot be read: {message}; the numbers shown are the last"
        " ones read",
        "check that the server runs and this page's user may connect (network,"
        " password, ACL); workers are likely failing the same way",
        severity=Severity.CRITICAL,
    )
    return JSONResponse(
        {"error": message, "findings": [spelled(unreadable)]}, status_code=503
    )


def create_app(
    client: Redis,
    *,
    streams: list[str] | None = None,
    group: str | None = None,
    refresh_s: float = 2.0,
    discover_s: float = 60.0,
    consumer_limit: int = 200,
    token: str | None = None,
    node: str | None = None,
    idle_timeout_ms: int = Thresholds.idle_timeout_ms,
    sample_s: float = 10.0,
) -> Starlette:
    """The page of the server ``client`` reaches (a redis.asyncio client).

    Read-only unless ``token`` is given: then requeue and delete of dead
    letters are allowed to POSTs that carry it (``Authorization: Bearer``).
    ``idle_timeout_ms``: the workers' idle_timeout (ms), what the diagnosis
    measures overdue entries and dead consumers against.
    """
    if not refresh_s > 0 or not discover_s > 0 or not sample_s > 0:
        raise ValueError(
            "refresh_s, discover_s and sample_s must be > 0, got"
            f" {refresh_s}, {discover_s}, {sample_s}"
        )
    if idle_timeout_ms < 1:
        raise ValueError(f"idle_timeout_ms must be >= 1, got {idle_timeout_ms}")
    if consumer_limit < 1:
        raise ValueError(f"consumer_limit must be >= 1, got {consumer_limit}")
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"token must have at least {MIN_TOKEN_CHARS} characters")
    thresholds = Thresholds(idle_timeout_ms=idle_timeout_ms)
    reader = Reader(
        client,
        streams,
        group,
        refresh_s,
        discover_s,
        consumer_limit,
        node,
        thresholds,
        sample_s,
    )
    routes = _Routes(reader, token)
    app = Starlette(
        routes=[
            Route("/", routes.index),
            Route("/api/state", routes.state),
            Route("/api/history", routes.history),
            Route("/api/tasks", routes.tasks),
            Route("/api/dead-letters", routes.letters),
            Route("/api/dead-letters/requeue", routes.change, methods=["POST"]),
            Route("/api/dead-letters/delete", routes.change, methods=["POST"]),
            Route("/metrics", routes.metrics),
        ],
        exception_handlers={
            _BadRequestError: _bad_request,
            RedisError: _unreachable,
            OSError: _unreachable,
        },
    )
    app.state.reader = reader
    return app
