"""The claim cycles under comparison, each one ``cycle()`` call.

- ``atomic``: the project's claim script, called the way the broker calls it.
- ``plain_lock``: a redis-py ``Lock`` with a timeout around XAUTOCLAIM:
  ``locked()`` check, acquire, XAUTOCLAIM, release.
- ``bare_xautoclaim``: XAUTOCLAIM alone, no lock: the floor.
- ``upstream_1_2_4``: the commands taskiq-redis 1.2.4's ``listen()`` sends for
  its claim step (see ``UpstreamClaimer``; ``roundtrips.upstream_fidelity``
  checks them against the real broker under MONITOR).
- ``lua_xautoclaim`` (claim-cycle part only): XAUTOCLAIM inside a script
  that does nothing else. What any claim script costs before it does any
  work of its own: the server converts every claimed entry into Lua values
  and back.
- ``native_claim`` (claim-cycle part only, Redis >= 8.4): one
  ``XREADGROUP ... CLAIM idle COUNT n STREAMS s >``, the read the broker
  reclaims through on such servers. The benchmark stream has no new entries,
  so the read returns only idle pending ones.

The cursor-keeping variants keep their XAUTOCLAIM cursor in the client, so
they scan the PEL the way the script does; upstream starts at 0-0 every time,
as 1.2.4 does.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import LockNotOwnedError

from benchmarks.config import BrokerArguments
from taskiq_atomic_claim.claim import claim_idle_entries
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.reads import read_entries
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_info import read_server_info
from taskiq_atomic_claim.settings import ClaimSettings

VARIANTS = ("atomic", "plain_lock", "bare_xautoclaim", "upstream_1_2_4")
LUA_FLOOR = "lua_xautoclaim"
NATIVE_CLAIM = "native_claim"
# Every variant the claim-cycle part may run, in report order.
CYCLE_VARIANTS = (*VARIANTS, LUA_FLOOR, NATIVE_CLAIM)


@dataclass(frozen=True)
class CycleResult:
    skipped: bool
    ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    """Where and as whom to claim, with which settings."""

    stream: str
    group: str
    consumer: str
    settings: ClaimSettings
    # What the broker was given as unacknowledged_lock_timeout (seconds);
    # taskiq-redis passes it to its lock unchanged, None meaning no expiry.
    lock_timeout_s: float | None

    @classmethod
    def of(
        cls, stream: str, group: str, consumer: str, arguments: BrokerArguments
    ) -> Target:
        """Claim as the broker given ``arguments`` would."""
        return cls(
            stream, group, consumer, arguments.settings(), arguments.lock_timeout_s
        )


class Claimer(Protocol):
    name: str

    async def prepare(self) -> None: ...

    async def cycle(self) -> CycleResult: ...

    def counters(self) -> dict[str, int]: ...


def _ids(entries: list[Any]) -> list[str]:
    # Redis 6.2 puts a nil where a claimed entry was deleted from the stream.
    return [text(entry[0]) for entry in entries if entry]


class AtomicClaimer:
    name = "atomic"

    def __init__(self, client: Redis, target: Target) -> None:
        self.client = client
        self.target = target
        self.keys = StreamKeys(target.stream, target.group)
        self.runner = ScriptRunner()
        self.dead_lettered = 0

    async def prepare(self) -> None:
        await self.runner.load(self.client)

    async def cycle(self) -> CycleResult:
        outcome = await claim_idle_entries(
            self.runner,
            self.client,
            self.keys,
            self.target.consumer,
            self.target.settings,
        )
        self.dead_lettered += len(getattr(outcome, "dead_lettered", ()))
        return CycleResult(outcome.skipped, [entry.id for entry in outcome.entries])

    def counters(self) -> dict[str, int]:
        return {"dead_lettered": self.dead_lettered}


class BareClaimer:
    name = "bare_xautoclaim"

    def __init__(self, client: Redis, target: Target) -> None:
        self.client = client
        self.target = target
        self.cursor = "0-0"

    async def prepare(self) -> None:
        return None

    async def cycle(self) -> CycleResult:
        settings = self.target.settings
        reply: Any = await self.client.xautoclaim(
            self.target.stream,
            self.target.group,
            self.target.consumer,
            settings.idle_timeout,
            start_id=self.cursor,
            count=settings.batch_size,
        )
        self.cursor = text(reply[0])
        return CycleResult(False, _ids(reply[1]))

    def counters(self) -> dict[str, int]:
        return {}


class LuaFloorClaimer(BareClaimer):
    """The bare cycle run by a script that only calls XAUTOCLAIM."""

    name = LUA_FLOOR
    # KEYS[1] stream; ARGV: group, consumer, min-idle-time, start, count.
    SCRIPT = (
        "return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3],"
        " ARGV[4], 'COUNT', ARGV[5])"
    )

    async def prepare(self) -> None:
        self.sha = await self.client.script_load(self.SCRIPT)

    async def cycle(self) -> CycleResult:
        settings = self.target.settings
        reply: Any = await self.client.evalsha(
            self.sha,
            1,
            self.target.stream,
            self.target.group,
            self.target.consumer,
            settings.idle_timeout,
            self.cursor,
            settings.batch_size,
        )
        self.cursor = text(reply[0])
        return CycleResult(False, _ids(reply[1]))


class PlainLockClaimer(BareClaimer):
    """The bare cycle inside a redis-py ``Lock``."""

    name = "plain_lock"

    def __init__(self, client: Redis, target: Target) -> None:
        super().__init__(client, target)
        self.lock = Lock(
            client,
            f"bench-plain-lock:{target.group}:{target.stream}",
            timeout=target.settings.lease / 1000,
            blocking=False,
        )
        # Releases that found the lock gone: the holder's timeout ran out
        # mid-cycle, so another claimer may have held it at the same time.
        self.lost_locks = 0

    async def cycle(self) -> CycleResult:
        if await self.lock.locked():
            return CycleResult(skipped=True)
        if not await self.lock.acquire():
            return CycleResult(skipped=True)
        try:
            return await super().cycle()
        finally:
            try:
                await self.lock.release()
            except LockNotOwnedError:
                self.lost_locks += 1

    def counters(self) -> dict[str, int]:
        return {"lost_locks": self.lost_locks}


class UpstreamClaimer:
    """taskiq-redis 1.2.4's claim step, command for command.

    1.2.4 builds a redis-py lock on a *pipeline*, so acquiring and releasing
    only queue commands. What reaches the server (MONITOR) is: SCRIPT EXISTS
    for the lock's release script (plus SCRIPT LOAD the first time), then one
    MULTI with SET lock token NX [PX timeout], XAUTOCLAIM from 0-0 and EVALSHA
    release, EXEC. The SET NX result is never looked at, so the lock excludes
    nobody; the transaction is what serialises claimers.
    """

    name = "upstream_1_2_4"
    # redis-py's own release script, referenced rather than copied, so the
    # server sees the very SHA 1.2.4 sends.
    RELEASE_SCRIPT = Lock.LUA_RELEASE_SCRIPT

    def __init__(self, client: Redis, target: Target) -> None:
        self.client = client
        self.target = target
        self.lock_name = f"autoclaim:{target.group}:{target.stream}"
        self.release_sha = hashlib.sha1(
            self.RELEASE_SCRIPT.encode(), usedforsecurity=False
        ).hexdigest()
        timeout = target.lock_timeout_s
        self.px = int(timeout * 1000) if timeout else None

    async def prepare(self) -> None:
        return None

    async def cycle(self) -> CycleResult:
        exists = await self.client.script_exists(self.release_sha)
        if not all(exists):
            await self.client.script_load(self.RELEASE_SCRIPT)
        # redis-py's Lock makes a fresh uuid1 token for every acquire.
        token = uuid.uuid1().hex
        settings = self.target.settings
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.lock_name, token, nx=True, px=self.px)
        pipe.xautoclaim(
            self.target.stream,
            self.target.group,
            self.target.consumer,
            settings.idle_timeout,
            start_id="0-0",
            count=settings.batch_size,
        )
        pipe.evalsha(self.release_sha, 1, self.lock_name, token)
        results = await pipe.execute()
        return CycleResult(False, _ids(results[1][1]))

    def counters(self) -> dict[str, int]:
        return {}


class NativeClaimer:
    """Redis >= 8.4's reclaiming read: one XREADGROUP ... CLAIM per cycle."""

    name = NATIVE_CLAIM

    def __init__(self, client: Redis, target: Target) -> None:
        self.client = client
        self.target = target

    async def prepare(self) -> None:
        server = await read_server_info(self.client)
        if not server.native_claim:
            raise NativeClaimUnavailableError(server.name)

    async def cycle(self) -> CycleResult:
        settings = self.target.settings
        reply: Any = await self.client.xreadgroup(
            self.target.group,
            self.target.consumer,
            {self.target.stream: ">"},
            count=settings.batch_size,
            claim_min_idle_time=settings.idle_timeout,
        )
        return CycleResult(
            False, [entry_id for _, entry_id, _, _ in read_entries(reply)]
        )

    def counters(self) -> dict[str, int]:
        return {}


class NativeClaimUnavailableError(RuntimeError):
    """The server has no XREADGROUP ... CLAIM (before Redis 8.4, Valkey)."""

    def __init__(self, server: str) -> None:
        super().__init__(f"{server} has no XREADGROUP ... CLAIM (Redis >= 8.4)")


_CLASSES: dict[
    str,
    type[
        AtomicClaimer
        | PlainLockClaimer
        | BareClaimer
        | LuaFloorClaimer
        | UpstreamClaimer
        | NativeClaimer
    ],
] = {
    cls.name: cls
    for cls in (
        AtomicClaimer,
        PlainLockClaimer,
        BareClaimer,
        LuaFloorClaimer,
        UpstreamClaimer,
        NativeClaimer,
    )
}


def make_claimer(variant: str, client: Redis, target: Target) -> Claimer:
    return _CLASSES[variant](client, target)


def coordination_keys(stream: str, group: str) -> list[str]:
    """Every key a variant writes beside the stream, to reset between runs."""
    keys = StreamKeys(stream, group)
    names = [keys.lease, keys.cursor]
    dead = getattr(keys, "dead_letters", None)
    if dead:
        names.append(dead)
    return [*names, f"bench-plain-lock:{group}:{stream}", f"autoclaim:{group}:{stream}"]
