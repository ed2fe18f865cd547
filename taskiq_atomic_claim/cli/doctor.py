"""``doctor``: what needs attention, and ``--fix``; the findings come from
``admin/doctor.py``, the advice on which command to run is spelled here."""

from __future__ import annotations

import argparse
import asyncio
import shlex
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim.admin.doctor import (
    DEFAULT_CONSUMER_IDLE_MS,
    DEFAULT_LOCK_EXPIRY_MS,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_RETAINED,
    DEFAULT_STALE_PENDING_MS,
    UNREAD_TIMEOUTS,
    Action,
    Diagnosis,
    Finding,
    Thresholds,
    apply_fixes,
    diagnose,
)
from taskiq_atomic_claim.admin.inspection import plural
from taskiq_atomic_claim.admin.report_json import diagnosis_to_json
from taskiq_atomic_claim.cli.arguments import PROG, count, milliseconds
from taskiq_atomic_claim.cli.servers import (
    Target,
    add_scope_options,
    heading,
    on_each_target,
    print_json,
    reach,
    resolve_targets,
)
from taskiq_atomic_claim.settings import DEFAULT_IDLE_TIMEOUT_MS

# The option that sets the threshold behind each kind of finding.
_TUNING = {
    "legacy-lock": "--lock-expiry-ms",
    "idle-consumer": "--consumer-idle-ms",
    "pel-size": "--max-pending",
    "stale-pending": "--stale-pending-ms",
    "unread-backlog": "--idle-timeout-ms",
    "dead-consumer": "--idle-timeout-ms",
    "overdue-pending": "--idle-timeout-ms",
    "unbounded-stream": "--max-retained",
}


def add_parser(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="find what needs attention; --fix repairs what is safe to",
        description="Check, most urgent first: a server refusing writes, a"
        " backlog no live worker reads, dead consumers holding entries, entries"
        " pending past the idle timeout, large or stale PELs, dead letters,"
        " streams growing without bound, no-expiry taskiq-redis <= 1.1.x locks,"
        " idle empty consumers, a missing or outdated library and streams"
        " nobody consumes. Exit 0 healthy, 1 needs attention, 2 on errors.",
    )
    add_scope_options(doctor)
    doctor.add_argument(
        "--fix",
        action="store_true",
        help="expire legacy locks, delete idle empty consumers, load the library",
    )
    doctor.add_argument(
        "--consumer-idle-ms",
        type=milliseconds,
        default=DEFAULT_CONSUMER_IDLE_MS,
        help="a consumer with nothing pending idle this long is stale (default: 24 h)",
    )
    doctor.add_argument(
        "--max-pending",
        type=count,
        default=DEFAULT_MAX_PENDING,
        help=f"PEL size that needs attention (default: {DEFAULT_MAX_PENDING})",
    )
    doctor.add_argument(
        "--stale-pending-ms",
        type=milliseconds,
        default=DEFAULT_STALE_PENDING_MS,
        help="an entry pending this long means nobody reclaims (default: 1 h)",
    )
    doctor.add_argument(
        "--lock-expiry-ms",
        type=milliseconds,
        default=DEFAULT_LOCK_EXPIRY_MS,
        help="expiry --fix gives legacy locks: the old workers' idle_timeout"
        f" (default: {DEFAULT_LOCK_EXPIRY_MS})",
    )
    doctor.add_argument(
        "--idle-timeout-ms",
        type=milliseconds,
        default=DEFAULT_IDLE_TIMEOUT_MS,
        help="the workers' idle_timeout: entries waiting that no consumer read"
        f" for {UNREAD_TIMEOUTS}x this are a backlog nobody reads"
        f" (default: {DEFAULT_IDLE_TIMEOUT_MS})",
    )
    doctor.add_argument(
        "--max-retained",
        type=count,
        default=DEFAULT_MAX_RETAINED,
        help="entries a stream may keep that no group needs before it counts as"
        f" growing without bound (default: {DEFAULT_MAX_RETAINED})",
    )
    doctor.add_argument(
        "--json", action="store_true", help="stable JSON (see admin/report_json.py)"
    )
    doctor.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_doctor(args))


async def _doctor(args: argparse.Namespace) -> int:
    thresholds = Thresholds(
        consumer_idle_ms=args.consumer_idle_ms,
        max_pending=args.max_pending,
        stale_pending_ms=args.stale_pending_ms,
        lock_expiry_ms=args.lock_expiry_ms,
        idle_timeout_ms=args.idle_timeout_ms,
        max_retained=args.max_retained,
    )
    targets = await resolve_targets(args, args.queues)

    async def diagnosed(client: Redis, target: Target) -> Diagnosis:
        diagnosis = await diagnose(client, target.streams, args.group, thresholds)
        if args.fix:
            await apply_fixes(client, diagnosis, thresholds)
        return diagnosis

    async def doctor(client: Redis, target: Target) -> bool:
        diagnosis = await diagnosed(client, target)
        heading(target)
        _report(diagnosis, args.fix, reach(args))
        if len(targets) > 1:
            print()
        return diagnosis.healthy

    async def as_json(client: Redis, target: Target) -> tuple[dict[str, Any], bool]:
        diagnosis = await diagnosed(client, target)
        spelled = diagnosis_to_json(
            diagnosis, target.where, lambda finding: advice(finding, reach(args))
        )
        return spelled, diagnosis.healthy

    if args.json:
        return await print_json(args, targets, as_json)
    return await on_each_target(targets, doctor, "healthy")


def advice(finding: Finding, reach: str) -> str:
    """What to do about ``finding``, naming the command to run."""
    words = finding.advice
    if finding.action is Action.LOAD:
        words = f"run `{PROG} load {reach}` ({words})"
    elif finding.action is Action.FIX:
        words = f"`{PROG} doctor --fix` {words}"
    elif finding.action is Action.RERUN_AFTER_FIX:
        words = "run doctor again after --fix"
    elif finding.action is Action.REVIEW_DEAD_LETTERS:
        scope = (
            f"{reach} --queue={shlex.quote(str(finding.stream))}"
            f" --group={shlex.quote(str(finding.group))}"
        )
        words = (
            f"review: `{PROG} dead-letters {scope}`; then"
            f" `{PROG} requeue {scope} --all` or `{PROG} delete {scope} --all`"
            " (--task NAME for one task's, --dry-run to see which first)"
        )
    if finding.kind in _TUNING and finding.action is not Action.RERUN_AFTER_FIX:
        words += f" ({_TUNING[finding.kind]} to tune)"
    return words


def _report(diagnosis: Diagnosis, fixing: bool, reach: str) -> None:
    for finding in diagnosis.findings:
        print(f"[{finding.kind}] {finding.subject}: {finding.problem}")
        if finding.fixed:
            print(f"    fixed: {finding.outcome}")
        else:
            if finding.outcome:
                print(f"    not fixed: {finding.outcome}")
            print(f"    what to do: {advice(finding, reach)}")
    checked = (
        f"{plural(diagnosis.streams_checked, 'stream')},"
        f" {plural(diagnosis.groups_checked, 'group')} checked on"
        f" {diagnosis.server.describe()}"
    )
    open_findings = [f for f in diagnosis.findings if not f.fixed]
    fixed = len(diagnosis.findings) - len(open_findings)
    if not diagnosis.findings:
        print(f"healthy: {checked}")
    elif not open_findings:
        print(f"healthy after fixing {fixed}: {checked}")
    else:
        fixable = sum(f.fixable for f in open_findings)
        hint = f" ({fixable} fixable with --fix)" if fixable and not fixing else ""
        print(
            f"{len(open_findings)} need attention{hint}"
            f"{f', {fixed} fixed' if fixed else ''}: {checked}"
        )
    for warning in diagnosis.warnings:
        print(f"warning [{warning.kind}] {warning.subject}: {warning.problem}")
        print(f"    to keep tasks: {warning.advice}")
