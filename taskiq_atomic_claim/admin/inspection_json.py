"""The JSON form of an ``Inspection``: what ``inspect --json`` prints.

JSON shape (``inspection_to_json``), format 1. Durations are integer
milliseconds; ``null`` means unknown or absent. New keys may be added within
format 1; existing keys keep their names, types and meaning::

    {
      "format": 1,
      "node": "127.0.0.1:6379",  # where it was read (host:port, or the URL)
      "server": {
        "version": "9.1.2",      # the real version (Valkey's, not its
                                 # redis_version compatibility field)
        "product": "Redis" | "Valkey",
        "name": "Valkey 9.1.2",
        "functions": true,       # FUNCTION/FCALL (else cached scripts)
        "scripting": true,       # scripts run for this connection
        "scripting_problem": "" | "FCALL refused for this user (...)",
        "native_claim": false,   # XREADGROUP ... CLAIM (Redis >= 8.4)
        "acked_trimming": false, # XADD/XTRIM ACKED, XACKDEL (Redis >= 8.2)
        "reclaim_path": "lua claim script",  # what this release uses here
        "trimming": "maxlen not sent (MAXLEN here trims unread and unacked entries)"
      },
      "library": {
        "name": "taskiq_atomic_claim_<version>",  # what this release loads
        "version": "<version>",
        "mode": "function library" | "cached scripts",
        "state": "current" | "missing" | "outdated",
        "other_versions": ["taskiq_atomic_claim_<other>", ...]
      },
      "discovery": {
        "discovered": true,      # false: streams were named with --queue
        "truncated": false       # true: the SCAN bound was hit; list incomplete
      },
      "streams": [{
        "stream": "taskiq",
        "type": "stream",        # TYPE of the key: "stream", "none", ...
        "length": 12,            # XLEN; 0 when the key is absent
        "groups": [{
          "group": "taskiq",
          "exists": true,        # false only for a --group the stream lacks
          "pending": 3,          # PEL size (XPENDING)
          "last_delivered_id": "1700000000000-0" | null,
          "lag": 0 | null,       # entries not yet delivered (Redis >= 7)
          "oldest_pending_idle_ms": 61000 | null,  # over the whole PEL
          "pel_scanned": 3,      # PEL entries read for consumers' idle times
          "pel_scan_complete": true,  # false: consumers' oldest are lower bounds
          "consumer_count": 1,   # all of the group's consumers
          "last_read_idle_ms": 120 | null,  # the least idle of all of them
                                 # (null without consumers)
          "consumers": [{        # serve lists at most its --consumers of them
            "name": "worker-1",
            "pending": 2,
            "idle_ms": 120,      # since the consumer last talked to the server
            "oldest_pending_idle_ms": 61000 | null
          }],
          "lease": {"key": "...", "holder": "worker-1" | null, "ttl_ms": 840 | null},
          "cursor": {"key": "...", "value": "0-0" | null, "ttl_ms": 1800 | null},
          "dead_letters": {"key": "...", "count": 0},
          "reclaimed": {"key": "...", "count": 0}  # entries the workers
                                 # reclaimed lately (their count lapses a day
                                 # after the last one; 0 when absent)
        }]
      }]
    }

With ``--cluster`` the CLI prints one such object per primary, in a list,
and an ``error`` in place of a primary it could not read::

    {"format": 1, "nodes": [{"format": 1, "node": "10.0.0.1:6379", ...},
                            {"node": "10.0.0.2:6379", "error": "ConnectionError: ..."}]}

``serve`` adds to that object ``"page": {"refresh_s": 2.0, "read_at_ms":
1700000000000, "changes": false}`` (when it was read; whether requeue and
delete are allowed), and pages through dead letters, newest first, in this
shape (``dead_letter_page_to_json``)::

    {
      "format": 1,
      "stream": "taskiq", "group": "taskiq",
      "key": "...",              # the dead-letter stream
      "count": 120,              # XLEN: all of them
      "letters": [{
        "id": "1700000000000-0", # in the dead-letter stream
        "at_ms": 1700000000000,  # when it was dead-lettered
        "original_id": "1699999990000-0",
        "deliveries": 3,
        "reason": "max_deliveries",
        "task": "app.tasks.send" | null,  # null: the message did not parse
        "task_id": "..." | null,
        "arguments": "1, 'a', key='v'" | null
      }],
      "next_before": "1700000000000-0" | null  # ?before= for the next page
    }
"""

from __future__ import annotations

from typing import Any

from taskiq_atomic_claim.admin.dead_letters import DeadLetter
from taskiq_atomic_claim.admin.inspection import Inspection, KeyView
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.server_info import ServerInfo

FORMAT = 1


def _server_json(server: ServerInfo) -> dict[str, Any]:
    return {
        "version": server.version,
        "product": server.product,
        "name": server.name,
        "functions": server.functions,
        "scripting": server.scripting,
        "scripting_problem": server.scripting_problem,
        "native_claim": server.native_claim,
        "acked_trimming": server.acked_trimming,
        "reclaim_path": server.reclaim_path,
        "trimming": server.trimming_policy,
    }


def _key_json(view: KeyView, value_name: str) -> dict[str, Any]:
    return {"key": view.key, value_name: view.value, "ttl_ms": view.ttl_ms}


def inspection_to_json(
    inspection: Inspection, node: str | None = None
) -> dict[str, Any]:
    """The documented JSON shape (module docstring), as plain data; ``node``
    is where it was read (``host:port``), when known."""
    where = {} if node is None else {"node": node}
    return {
        "format": FORMAT,
        **where,
        "server": _server_json(inspection.server),
        "library": {
            "name": inspection.library.name,
            "version": inspection.library.version,
            "mode": inspection.library.mode,
            "state": inspection.library.state,
            "other_versions": inspection.library.other_versions,
        },
        "discovery": {
            "discovered": inspection.discovered,
            "truncated": inspection.truncated,
        },
        "streams": [
            {
                "stream": stream.name,
                "type": stream.type,
                "length": stream.length,
                "groups": [
                    {
                        "group": group.name,
                        "exists": group.exists,
                        "pending": group.pending,
                        "last_delivered_id": group.last_delivered_id,
                        "lag": group.lag,
                        "oldest_pending_idle_ms": group.oldest_pending_idle_ms,
                        "pel_scanned": group.pel_scanned,
                        "pel_scan_complete": group.pel_scan_complete,
                        "consumer_count": group.consumer_count,
                        "last_read_idle_ms": group.last_read_idle_ms,
                        "consumers": [
                            {
                                "name": consumer.name,
                                "pending": consumer.pending,
                                "idle_ms": consumer.idle_ms,
                                "oldest_pending_idle_ms": (
                                    consumer.oldest_pending_idle_ms
                                ),
                            }
                            for consumer in group.consumers
                        ],
                        "lease": _key_json(group.lease, "holder"),
                        "cursor": _key_json(group.cursor, "value"),
                        "dead_letters": {
                            "key": group.dead_letters_key,
                            "count": group.dead_letters,
                        },
                        "reclaimed": {
                            "key": StreamKeys(stream.name, group.name).reclaimed,
                            "count": group.reclaimed,
                        },
                    }
                    for group in stream.groups
                ],
            }
            for stream in inspection.streams
        ],
    }


def dead_letter_page_to_json(
    keys: StreamKeys, found: list[DeadLetter], count: int, total: int
) -> dict[str, Any]:
    """One page (module docstring): the first ``count`` of ``found``, which
    holds one more when another page follows."""
    letters = []
    for letter in found[:count]:
        task = letter.task()
        letters.append(
            {
                "id": letter.id,
                "at_ms": int(letter.id.partition("-")[0]),
                "original_id": letter.original_id,
                "deliveries": letter.deliveries,
                "reason": letter.reason,
                "task": None if task is None else task.name,
                "task_id": None if task is None else task.task_id,
                "arguments": None if task is None else task.arguments,
            }
        )
    more = len(found) > count and letters
    return {
        "format": FORMAT,
        "stream": keys.stream,
        "group": keys.group,
        "key": keys.dead_letters,
        "count": total,
        "letters": letters,
        "next_before": letters[-1]["id"] if more else None,
    }
