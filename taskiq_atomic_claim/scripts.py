"""The server-side operations in ``lua/``: building, loading and calling them.

Each top-level ``lua/<operation>.lua`` file is one operation; shared pieces in
``lua/includes/`` are pulled in by a ``--- @include "name"`` line. The files
are read once, at import. On servers with functions (Redis/Valkey >= 7) the
operations are loaded as one function library, which persists and replicates;
on Redis 6.2 each is a cached script called by SHA. The library's name and its
functions' names carry a version derived from the Lua source and the
functions' flags (``Operation.allow_oom``), so releases with different scripts
can share a server without replacing each other's.

Keys and values only ever travel as KEYS and ARGV; the source never changes
after import, which is what makes script caching, ACL key patterns and Cluster
slot routing work. Callers pass ``run`` an ``OperationCall`` built by the
operation's ``<name>_call`` function (see ``operations.py``, which declares
the operations; this module loads and runs them).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.operations import OPERATIONS, Operation, OperationCall
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_errors import is_missing_script
from taskiq_atomic_claim.server_info import ServerInfo, read_server_info

LIBRARY_PREFIX = "taskiq_atomic_claim_"
_INCLUDE = re.compile(r'^--- @include "([a-z_]+)"$', re.MULTILINE)
_OPERATION_NAME = re.compile(r"^[a-z_]+$")
# A "  KEYS[n]  what it is" line of a Lua file's header comment (a column
# of its own, unlike KEYS[n] mentioned in the prose).
# "KEYS[2]", or "KEYS[5i+2]" for an operation taking a group of keys per item.
_KEYS_LINE = re.compile(r"^  KEYS\[(?:(\d+)i\+)?(\d+)\]  ", re.MULTILINE)
# A "  ARGV[n]  name  what it is" line: "ARGV[3]", or "ARGV[5..]",
# "ARGV[5..n]" or "ARGV[8+i]" for one taking the rest.
_ARGV_LINE = re.compile(r"^  ARGV\[(\d+)(\.\.n?|\+i)?\]  (.*)$", re.MULTILINE)

ReplyT = TypeVar("ReplyT")


def lua_directory() -> Path:
    """Where the Lua files are: inside the wheel, or at the source tree's root."""
    packaged = Path(str(resources.files("taskiq_atomic_claim"))) / "lua"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "lua"


def _resolve_includes(source: str, includes: Path, seen: tuple[str, ...] = ()) -> str:
    def include(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            raise ValueError(f"Lua include cycle: {' -> '.join((*seen, name))}")
        included = (includes / f"{name}.lua").read_text(encoding="utf-8")
        return _resolve_includes(included, includes, (*seen, name)).rstrip("\n")

    return _INCLUDE.sub(include, source)


def declared_keys(source: str) -> tuple[int, bool]:
    """The keys a Lua file's header declares, and whether per item: its
    ``KEYS[n]`` lines numbered 1..n in order, or ``KEYS[ni+1]`` ..
    ``KEYS[ni+n]`` for a group of n keys per item."""
    header = source.split("]]", 1)[0]
    lines = _KEYS_LINE.findall(header)
    numbers = [int(n) for _, n in lines]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"header KEYS lines must be KEYS[1]..KEYS[n]: {numbers}")
    strides = {stride for stride, _ in lines}
    if strides == {str(len(numbers))}:
        return len(numbers), True
    if strides not in (set(), {""}):
        raise ValueError(
            f"header KEYS lines must all be KEYS[{len(numbers)}i+k] or none: {lines}"
        )
    return len(numbers), False


def declared_key_count(source: str) -> int:
    return declared_keys(source)[0]


@dataclass(frozen=True)
class ArgvDeclaration:
    """One ``ARGV[n]  name`` line of a Lua file's header; ``rest``: it takes
    ARGV[n] onward (``ARGV[n..]``, ``ARGV[n..n]``, ``ARGV[n+i]``)."""

    position: int
    name: str
    rest: bool


def declared_argv(source: str) -> tuple[ArgvDeclaration, ...]:
    """The ARGV a Lua file's header declares, in order: ``ARGV[1]`` ..
    ``ARGV[n]``, the last one possibly taking the rest. Its name is its
    column's text up to two spaces, in words (``entry id``)."""
    header = source.split("]]", 1)[0]
    declared = []
    for position, rest, label in _ARGV_LINE.findall(header):
        name = re.split(r"\s{2}|\s\(", label.strip(), maxsplit=1)[0]
        declared.append(
            ArgvDeclaration(int(position), re.sub(r"[-_ ]+", " ", name), bool(rest))
        )
    positions = [d.position for d in declared]
    if positions != list(range(1, len(declared) + 1)):
        raise ValueError(f"header ARGV lines must be ARGV[1]..ARGV[n]: {positions}")
    if any(d.rest for d in declared[:-1]):
        raise ValueError("only the last header ARGV line may take the rest")
    return tuple(declared)


@dataclass(frozen=True)
class Script:
    name: str
    source: str

    @cached_property
    def num_keys(self) -> int:
        return declared_keys(self.source)[0]

    @cached_property
    def repeated_keys(self) -> bool:
        return declared_keys(self.source)[1]

    # Computed once: every EVALSHA call names it.
    @cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class ScriptLibrary:
    """All operations, and the function library built from them."""

    scripts: dict[str, Script]
    # The operations a function library lets run out of memory (see
    # ``Operation.allow_oom``).
    allow_oom: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_directory(
        cls, directory: Path, allow_oom: frozenset[str] = frozenset()
    ) -> ScriptLibrary:
        scripts = {}
        for path in sorted(directory.glob("*.lua")):
            if not _OPERATION_NAME.match(path.stem):
                raise ValueError(f"Lua operation file name must be [a-z_]: {path}")
            source = _resolve_includes(
                path.read_text(encoding="utf-8"), directory / "includes"
            )
            scripts[path.stem] = Script(path.stem, source)
        if not scripts:
            raise FileNotFoundError(f"no Lua operations found in {directory}")
        return cls(scripts, allow_oom)

    # The version, names and code are computed once: every FCALL names a
    # function, and hashing all sources per call would cost more than the call.
    @cached_property
    def version(self) -> str:
        # The flags are part of what a version is: a server holding the
        # library without them must see it as outdated.
        digest = hashlib.sha1(usedforsecurity=False)
        for script in self.scripts.values():
            flags = self.function_flags(script.name)
            digest.update(f"{script.name}\0{flags}\0{script.source}\0".encode())
        return digest.hexdigest()[:12]

    @cached_property
    def name(self) -> str:
        return LIBRARY_PREFIX + self.version

    @cached_property
    def function_names(self) -> dict[str, str]:
        return {name: f"tac_{self.version}_{name}" for name in self.scripts}

    def function_name(self, operation: str) -> str:
        return self.function_names[operation]

    def function_flags(self, operation: str) -> str:
        """The flags its function is registered with, as a Lua table."""
        return "{'allow-oom'}" if operation in self.allow_oom else "{}"

    @cached_property
    def function_code(self) -> str:
        parts = [f"#!lua name={self.name}"]
        for script in self.scripts.values():
            parts.append(
                f"local function {script.name}(KEYS, ARGV)\n{script.source}\nend\n"
                "redis.register_function{"
                f"function_name='{self.function_name(script.name)}',"
                f" callback={script.name}, flags={self.function_flags(script.name)}}}"
            )
        return "\n".join(parts) + "\n"


LIBRARY = ScriptLibrary.from_directory(
    lua_directory(), frozenset(op.name for op in OPERATIONS if op.allow_oom)
)


def check_declarations(
    library: ScriptLibrary, operations: tuple[Operation[Any], ...] = OPERATIONS
) -> None:
    """Raise unless ``operations`` and the library's Lua files match: the
    same names, and each with the key count its header declares."""
    declared = {operation.name: operation for operation in operations}
    if set(declared) != set(library.scripts):
        raise RuntimeError(
            "lua/ and operations.py disagree: undeclared"
            f" {sorted(set(library.scripts) - set(declared))}, without a Lua"
            f" file {sorted(set(declared) - set(library.scripts))}"
        )
    for name, script in library.scripts.items():
        if script.repeated_keys != declared[name].repeated:
            raise RuntimeError(
                f"lua/{name}.lua and operations.py disagree on whether its keys"
                " come in a group per item"
            )
        if script.num_keys != declared[name].num_keys:
            raise RuntimeError(
                f"lua/{name}.lua declares {script.num_keys} KEYS, operations.py"
                f" {declared[name].num_keys} ({', '.join(declared[name].keys)})"
            )


check_declarations(LIBRARY)


class LoadMode(Enum):
    FUNCTIONS = "function library"
    SCRIPTS = "cached scripts"


class LibraryState(Enum):
    CURRENT = "current"
    MISSING = "missing"
    OUTDATED = "outdated"


@dataclass(frozen=True)
class LibraryStatus:
    mode: LoadMode
    state: LibraryState
    # Other versions of this package's library found on the server.
    other_versions: tuple[str, ...] = ()


def mode_for(server: ServerInfo) -> LoadMode:
    return LoadMode.FUNCTIONS if server.functions else LoadMode.SCRIPTS


class ScriptRunner:
    """Calls the library's operations on one server, loading them on demand.

    A missing script or function (server restart, SCRIPT/FUNCTION FLUSH,
    failover to a node that never had it) is loaded and the call retried once.
    """

    def __init__(
        self,
        library: ScriptLibrary = LIBRARY,
        on_reload: Callable[[], None] | None = None,
    ) -> None:
        self.library = library
        self._server: ServerInfo | None = None
        self._on_reload = on_reload
        # Loads of operations that had run or been loaded here before and
        # went missing (restart, flush, failover); a first load is none.
        self.reloads = 0
        self._loaded = False
        # Loads made after a call found the library missing (see
        # reload_after_missing).
        self._loads = 0
        self._load_lock = asyncio.Lock()

    async def server(self, client: ScriptClient) -> ServerInfo:
        """The server, read once (INFO server) until ``forget_server``."""
        if self._server is None:
            self._server = await read_server_info(client)
        return self._server

    def _note_reload(self) -> None:
        """An operation went missing and is loaded again (not a first load)."""
        if self._loaded:
            self.reloads += 1
            if self._on_reload is not None:
                self._on_reload()

    def forget_server(self) -> None:
        """The server may have changed (a restart on another binary, a
        failover): read it again at the next call."""
        self._server = None

    async def mode(self, client: ScriptClient) -> LoadMode:
        return mode_for(await self.server(client))

    async def probe_server(self, client: ScriptClient) -> ServerInfo:
        """The server read afresh, with whether scripts run for this client."""
        self._server = await read_server_info(client, probe=True)
        return self._server

    async def require_scripting(self, client: ScriptClient) -> ServerInfo:
        """At startup: refuse, saying why, a server that runs no scripts for
        this connection (unless the reclaim path needs none)."""
        server = await self.probe_server(client)
        server.require_scripting()
        return server

    async def load(self, client: ScriptClient) -> LoadMode:
        """Load every operation; idempotent.

        FUNCTION LOAD, SCRIPT LOAD and SCRIPT EXISTS are named in one string:
        the same on the wire, and how redis-py's cluster client knows to send
        them to every primary."""
        mode = await self.mode(client)
        if mode is LoadMode.FUNCTIONS:
            # REPLACE only ever touches this exact version's library.
            await client.execute_command(
                "FUNCTION LOAD", "REPLACE", self.library.function_code
            )
        else:
            for script in self.library.scripts.values():
                await client.execute_command("SCRIPT LOAD", script.source)
        self._loaded = True
        return mode

    async def status(self, client: ScriptClient) -> LibraryStatus:
        mode = await self.mode(client)
        if mode is LoadMode.SCRIPTS:
            shas = [script.sha for script in self.library.scripts.values()]
            loaded = await client.execute_command("SCRIPT EXISTS", *shas)
            state = LibraryState.CURRENT if all(loaded) else LibraryState.MISSING
            return LibraryStatus(mode, state)
        listing = await client.execute_command(
            "FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_PREFIX + "*"
        )
        names = sorted(_library_name(entry) for entry in listing)
        others = tuple(name for name in names if name != self.library.name)
        if self.library.name in names:
            return LibraryStatus(mode, LibraryState.CURRENT, others)
        state = LibraryState.OUTDATED if others else LibraryState.MISSING
        return LibraryStatus(mode, state, others)

    async def run(self, client: ScriptClient, call: OperationCall[ReplyT]) -> ReplyT:
        """Make ``call`` (built by its operation's ``<name>_call`` function)."""
        loads_before = self._loads
        try:
            reply = await self._invoke(client, call)
        except ResponseError as error:
            if not is_missing_script(error):
                raise
        else:
            self._loaded = True
            return reply
        await self.reload_after_missing(client, loads_before)
        return await self._invoke(client, call)

    @property
    def loads(self) -> int:
        """Loads made after a call found the library missing: a call notes
        it before it is sent, for ``reload_after_missing``."""
        return self._loads

    async def reload_after_missing(
        self, client: ScriptClient, loads_before: int
    ) -> None:
        """Load the library after a call found it missing, one load at a
        time: every call in flight finds it missing at once after a restart,
        flush or failover, and those that waited here call again on the load
        made since they were sent."""
        async with self._load_lock:
            if self._loads != loads_before:
                return
            self._note_reload()
            await self.load(client)
            self._loads += 1

    def command(self, operation: Operation[Any], functions: bool) -> tuple[str, str]:
        """How a call of ``operation`` starts: FCALL or EVALSHA, and what."""
        if functions:
            return ("FCALL", self.library.function_name(operation.name))
        return ("EVALSHA", self.library.scripts[operation.name].sha)

    async def _invoke(
        self, client: ScriptClient, call: OperationCall[ReplyT]
    ) -> ReplyT:
        functions = (await self.server(client)).functions
        reply: ReplyT = await client.execute_command(
            *self.command(call.operation, functions),
            len(call.keys),
            *call.keys,
            *call.args,
        )
        return reply


def _library_name(entry: Any) -> str:
    # FUNCTION LIST replies with a flat [key, value, ...] list per library
    # under RESP2 and a map under RESP3.
    if isinstance(entry, dict):
        fields = {text(k): v for k, v in entry.items()}
    else:
        fields = {text(k): v for k, v in zip(entry[::2], entry[1::2], strict=True)}
    return text(fields["library_name"])
