"""Parse time of one XREADGROUP reply of 32 entries, with redis-py's own
parser and with hiredis (``pip install 'taskiq-atomic-claim[hiredis]'``).

    python -m benchmarks.reply_parsing --url redis://127.0.0.1:6379

Reads the same 32 pending entries again and again (``XREADGROUP ... 0``)
and prints the client's CPU time per read (the server's share is in
another process). Writes a stream ``bench-reply-parsing``, then deletes it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import DefaultParser
from redis.utils import HIREDIS_AVAILABLE

STREAM = "bench-reply-parsing"
ENTRIES = 32
# A taskiq message of a no-op task, about as long as taskiq's.
PAYLOAD = (
    b'{"task_id":"0f6b3c1e5d0a4c8e9a7b2d4f6e8a0c1b","task_name":"app:noop",'
    b'"labels":{},"labels_types":{},"args":[],"kwargs":{}}'
)


async def cpu_per_read_us(url: str, parser: Any, reads: int) -> float:
    client = Redis.from_url(url, parser_class=parser)
    try:
        for _ in range(50):  # warm
            await client.xreadgroup("g", "c", {STREAM: "0"}, count=ENTRIES)
        start = time.process_time()
        for _ in range(reads):
            await client.xreadgroup("g", "c", {STREAM: "0"}, count=ENTRIES)
        return (time.process_time() - start) / reads * 1e6
    finally:
        await client.aclose()


async def main(url: str, reads: int, rounds: int) -> None:
    admin = Redis.from_url(url)
    await admin.delete(STREAM)
    await admin.xgroup_create(STREAM, "g", id="0", mkstream=True)
    for _ in range(ENTRIES):
        await admin.xadd(STREAM, {"data": PAYLOAD})
    await admin.xreadgroup("g", "c", {STREAM: ">"}, count=ENTRIES)
    from redis.asyncio.connection import _AsyncRESP2Parser  # noqa: PLC0415

    parsers: dict[str, Any] = {"redis-py (python)": _AsyncRESP2Parser}
    if HIREDIS_AVAILABLE:
        parsers["hiredis"] = DefaultParser
    try:
        results: dict[str, list[float]] = {name: [] for name in parsers}
        for _ in range(rounds):  # interleaved: the machine's noise hits both
            for name, parser in parsers.items():
                results[name].append(await cpu_per_read_us(url, parser, reads))
        print(f"XREADGROUP of {ENTRIES} entries ({len(PAYLOAD)} B each), client CPU")
        for name, values in results.items():
            print(
                f"  {name:18} median {statistics.median(values):6.1f} us per read"
                f"  (rounds: {', '.join(f'{v:.1f}' for v in values)})"
            )
        if not HIREDIS_AVAILABLE:
            print("  hiredis: not installed (pip install hiredis)")
    finally:
        await admin.delete(STREAM)
        await admin.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379")
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.reads, args.rounds))
