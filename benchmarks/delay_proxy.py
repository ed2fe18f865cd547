"""A loopback TCP proxy that delays each direction by a fixed time.

The fallback latency injector when netem in a network namespace is not
available. ``python -m benchmarks.delay_proxy --target 127.0.0.1:PORT
--one-way-us N`` listens on a free 127.0.0.1 port, prints it, and forwards
to the target only (loopback, by construction).

Each direction of each connection has a reader thread, which stamps every
chunk with when it is due (arrival + delay), and a writer thread, which
sends chunks in order once due. So the delay is added once per direction
however the bytes are chunked, and a slow chunk never delays a later one
by more than its own lateness. Threads and ``time.sleep`` rather than
asyncio, whose selector rounds timeouts up to whole milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import socket
import sys
import threading
import time

from benchmarks import safety

# Over the proxy's lifetime: 64 claimers per contention run reconnect often.
_MAX_CONNECTIONS = 20_000
_CHUNK = 65536


def _nodelay(sock: socket.socket) -> None:
    # Without it Nagle would hold small writes back: latency we did not ask for.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
    due: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

    def read() -> None:
        try:
            while data := source.recv(_CHUNK):
                due.put((time.monotonic() + delay_s, data))
        except OSError:
            pass
        due.put(None)

    def write() -> None:
        try:
            while (item := due.get()) is not None:
                when, data = item
                wait = when - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=write, daemon=True).start()


def _serve(listener: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    client, _ = listener.accept()
    upstream = socket.create_connection(target, timeout=5)
    upstream.settimeout(None)
    for sock in (client, upstream):
        _nodelay(sock)
    _pump(client, upstream, delay_s)
    _pump(upstream, client, delay_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="127.0.0.1:PORT")
    parser.add_argument("--one-way-us", type=float, required=True)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    if not host.startswith("127."):
        parser.error("the proxy only forwards to loopback")
    safety.die_with_parent()
    safety.precise_sleeps()
    parent = os.getppid()
    deadline = time.monotonic() + args.max_seconds
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(0.5)
        print(listener.getsockname()[1], flush=True)
        accepted = 0
        # Bounded: by lifetime, by connection count, and by the parent living.
        while (
            time.monotonic() < deadline
            and accepted < _MAX_CONNECTIONS
            and os.getppid() == parent
        ):
            with contextlib.suppress(TimeoutError):
                _serve(listener, (host, int(port)), args.one_way_us / 1e6)
                accepted += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
