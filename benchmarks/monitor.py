"""MONITOR capture: which commands an idle fleet really runs on the server.

MONITOR prints every command with the client address it came from; commands
a script runs carry ``lua`` instead. Commands queued between MULTI and EXEC
on a connection run inside EXEC. Both kinds are "nested": their server time
is already part of the FCALL/EVALSHA/EXEC that ran them, which matters when
commandstats are turned into server time.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

_LINE = re.compile(r"^\+?\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$")
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"')
# Commands whose first argument names the real operation.
_CONTAINERS = {"SCRIPT", "CLIENT", "CONFIG", "FUNCTION", "XGROUP", "XINFO", "OBJECT"}
_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Command:
    source: str  # client "host:port", or "lua"
    tokens: tuple[str, ...]

    @property
    def name(self) -> str:
        head = self.tokens[0].upper()
        if head in _CONTAINERS and len(self.tokens) > 1:
            return f"{head} {self.tokens[1].upper()}"
        return head

    @property
    def base(self) -> str:
        """commandstats' key, lowercase and without the subcommand."""
        return self.tokens[0].lower()


def parse(text: str) -> list[Command]:
    commands = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            tokens = tuple(_TOKEN.findall(match.group(2)))
            if tokens:
                commands.append(Command(match.group(1), tokens))
    return commands


@dataclass
class CommandCounts:
    """Commands from some clients, split into outer and nested."""

    outer: Counter[str] = field(default_factory=Counter)
    nested: Counter[str] = field(default_factory=Counter)
    outer_base: Counter[str] = field(default_factory=Counter)
    nested_base: Counter[str] = field(default_factory=Counter)


def count(commands: list[Command], sources: set[str]) -> CommandCounts:
    """Commands from ``sources`` and the scripts they ran."""
    counts = CommandCounts()
    in_multi: set[str] = set()
    for command in commands:
        if command.source != "lua" and command.source not in sources:
            continue
        name = command.name
        nested = command.source == "lua" or (
            command.source in in_multi and name not in ("EXEC", "DISCARD")
        )
        if name == "MULTI":
            in_multi.add(command.source)
        elif name in ("EXEC", "DISCARD"):
            in_multi.discard(command.source)
        if nested:
            counts.nested[name] += 1
            counts.nested_base[command.base] += 1
        else:
            counts.outer[name] += 1
            counts.outer_base[command.base] += 1
    return counts


class Monitor:
    """A raw MONITOR connection read by a thread, until a sentinel is seen."""

    def __init__(self, port: int, max_seconds: float = 60.0) -> None:
        self.port = port
        self.max_seconds = max_seconds
        self.sentinel = f"bench-monitor-end-{uuid.uuid4().hex}"
        self._buffer = bytearray()
        self._seen_sentinel = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Monitor:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.sendall(b"MONITOR\r\n")
        if not sock.recv(16).startswith(b"+OK"):
            sock.close()
            raise RuntimeError("MONITOR refused")
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._sock is not None
        needle = self.sentinel.encode()
        deadline = time.monotonic() + self.max_seconds
        while time.monotonic() < deadline and len(self._buffer) < _MAX_BYTES:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            self._buffer += data
            if needle in self._buffer[-len(data) - len(needle) :]:
                self._seen_sentinel.set()
                break

    def stop(self) -> list[Command]:
        """Send the sentinel from a connection of its own; return what was seen."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(f"PING {self.sentinel}\r\n".encode())
            conn.recv(256)
        self._seen_sentinel.wait(timeout=10)
        return parse(self._buffer.decode(errors="replace"))

    def __exit__(self, *_: object) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
