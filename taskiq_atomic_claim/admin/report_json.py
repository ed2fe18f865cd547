"""The JSON of ``doctor --json`` and ``dead-letters --json``: the versioned
format of ``inspect --json`` (``inspection_json.FORMAT``), with the same
envelope: one object per server, and with ``--cluster``
``{"format": 1, "nodes": [...]}`` holding one per primary (or
``{"node": ..., "error": ...}`` for a primary it could not read). New keys
may be added within format 1; existing keys keep their names, types and
meaning. ``null`` means unknown or absent.

``doctor --json``::

    {
      "format": 1,
      "node": "127.0.0.1:6379",
      "server": "Redis 7.0.15",
      "healthy": false,          # every finding fixed (the exit code says the same)
      "streams_checked": 2,
      "groups_checked": 1,
      "findings": [{
        "kind": "stale-pending", # the kinds of admin/doctor.py
        "severity": "critical" | "warning" | "notice",  # ranked by it, most
                                 # urgent first; an outage first of all
        "subject": "jobs / workers",
        "problem": "an entry held by consumer 'w-1' has been pending for 2 h ...",
        "advice": "what to do, naming the command to run",
        "fixable": false,
        "fixed": false,
        "outcome": null,         # what --fix did, when it ran
        "stream": "jobs" | null,
        "group": "workers" | null,
        "consumer": "w-1" | null,  # stale-pending: who holds the oldest entry
        "key": null              # legacy-lock: the key
      }],
      "warnings": [...]          # the same shape; never make it unhealthy
    }

``dead-letters --json``::

    {
      "format": 1,
      "node": "127.0.0.1:6379",
      "discovered": true,        # false: the queue was named with --queue
      "truncated": false,        # true: the key scan hit its bound
      "queues": [{
        "stream": "jobs",
        "group": "workers",
        "key": "taskiq-atomic-claim:dead:...",
        "count": 3,              # all its dead letters (XLEN)
        "entries": [{
          "id": "1700000000100-0",      # the dead letter's id (requeue --id)
          "original_id": "1700000000000-0" | null,
          "deliveries": 5,
          "reason": "max_deliveries exceeded",
          "task": {"name": "app:resize", "task_id": "4f2a", "arguments": "42"}
                  | null,               # null: not a taskiq JSON message
          "fields": {"data": "..."}     # the entry's own fields, as text
        }],
        "next_after": "1700000000100-0" | null  # --after for the next page
      }]
    }
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from taskiq_atomic_claim.admin.dead_letters import DeadLetter
from taskiq_atomic_claim.admin.doctor import Diagnosis, Finding
from taskiq_atomic_claim.admin.inspection_json import FORMAT
from taskiq_atomic_claim.keys import StreamKeys


def finding_to_json(
    finding: Finding, advice: Callable[[Finding], str]
) -> dict[str, Any]:
    return {
        "kind": finding.kind,
        "severity": finding.severity.value,
        "subject": finding.subject,
        "problem": finding.problem,
        "advice": advice(finding),
        "fixable": finding.fixable,
        "fixed": finding.fixed,
        "outcome": finding.outcome,
        "stream": finding.stream,
        "group": finding.group,
        "consumer": finding.consumer,
        "key": finding.key,
    }


def diagnosis_to_json(
    diagnosis: Diagnosis, node: str, advice: Callable[[Finding], str]
) -> dict[str, Any]:
    """``doctor --json`` for one server; ``advice`` spells what to do."""
    return {
        "format": FORMAT,
        "node": node,
        "server": diagnosis.server.describe(),
        "healthy": diagnosis.healthy,
        "streams_checked": diagnosis.streams_checked,
        "groups_checked": diagnosis.groups_checked,
        "findings": [finding_to_json(f, advice) for f in diagnosis.findings],
        "warnings": [finding_to_json(w, advice) for w in diagnosis.warnings],
    }


def _text(value: bytes) -> str:
    return value.decode("utf-8", "backslashreplace")


def _letter_json(letter: DeadLetter) -> dict[str, Any]:
    task = letter.task()
    return {
        "id": letter.id,
        "original_id": letter.original_id or None,
        "deliveries": letter.deliveries,
        "reason": letter.reason,
        "task": None
        if task is None
        else {"name": task.name, "task_id": task.task_id, "arguments": task.arguments},
        "fields": {_text(k): _text(v) for k, v in letter.fields.items()},
    }


def dead_letters_queue_json(
    keys: StreamKeys, count: int, letters: list[DeadLetter], more: bool
) -> dict[str, Any]:
    """One stream and group's page of dead letters (``count`` in all);
    ``more``: others follow the page."""
    return {
        "stream": keys.stream,
        "group": keys.group,
        "key": keys.dead_letters,
        "count": count,
        "entries": [_letter_json(letter) for letter in letters],
        "next_after": letters[-1].id if more and letters else None,
    }


def dead_letters_to_json(
    queues: list[dict[str, Any]], node: str, discovered: bool, truncated: bool
) -> dict[str, Any]:
    """``dead-letters --json`` for one server."""
    return {
        "format": FORMAT,
        "node": node,
        "discovered": discovered,
        "truncated": truncated,
        "queues": queues,
    }
