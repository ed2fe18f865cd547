"""The one place that decides what an exception from redis-py means.

A loop that talks to the server asks ``classify(error)`` and acts on the
answer: wait an outage out, recreate a missing group, or raise a usage error
(a bug or a misconfiguration that retrying cannot fix). Nothing else in the
package matches error texts.

An error reply's first word is its code (``NOGROUP``, ``OOM``, ...). Where
redis-py has an exception class for the code (``OOM`` ->
``OutOfMemoryError``, and ``ERR``) it strips the code from the message and
keeps it as ``status_code`` (redis-py >= 7.2); replies it has no class for
arrive as a plain ``ResponseError`` whose message still starts with the
code. Redis 6.2 wraps an error raised inside a script as ``ERR Error
running script ...: -OOM ...``; the inner reply's code is what counts.

While a Cluster hash slot migrates between primaries, a call whose keys the
source holds only some of is refused (TRYAGAIN), and one it holds none of is
redirected (ASK), where the target refuses it too unless it holds them all;
redis-py follows redirections and retries TRYAGAIN 16 times, then raises
``ClusterError("TTL exhausted.")``. All of that is the slot moving, not a
usage error: the call works once the slot has moved.
"""

from __future__ import annotations

import asyncio
import re
from enum import Enum

from redis.exceptions import (
    AuthenticationError,
    ClusterError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What a call raises when the server gave no answer: connection refused,
# reset, timed out (LOADING is a ConnectionError subclass in redis-py too).
# For ``except`` clauses; ``classify`` calls these UNREACHABLE.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class PermissionRefusedError(RuntimeError):
    """The server's ACL refuses a worker a command it needs from the start."""


class LoginRefusedError(RuntimeError):
    """The server refused the broker's login: no password, or a wrong one.
    One line naming where and the user, in place of redis-py's text."""


class Fault(Enum):
    """What an error means to a loop that keeps talking to the server."""

    # No answer: connection refused, reset, timed out (LOADING is a
    # ConnectionError subclass in redis-py as well).
    UNREACHABLE = "Redis unreachable"
    # The server stopped being a primary under us (failover, REPLICAOF).
    DEMOTED = "Redis is not a primary now"
    # The server answers but refuses for now: out of memory, busy with a
    # script, a cluster changing its topology.
    REFUSING = "Redis refusing commands for now"
    # A Cluster hash slot moving between primaries (a reshard): calls with
    # keys on both nodes are refused, single-key ones redirected, until the
    # slot has moved. Unlike REFUSING, reads of the slot's stream still work.
    MIGRATING = "hash slot migrating between primaries"
    # NOGROUP: the stream or its consumer group is gone (also UNBLOCKED
    # for a read blocked on a stream that was deleted).
    GROUP_MISSING = "consumer group missing"
    # NOPERM: the ACL refuses this user a command or a key. At startup a
    # usage error; while running, an operator changing the ACL, waited out
    # (``waited_out_while_running``) rather than failing tasks or listen().
    FORBIDDEN = "permission refused by the server's ACL"
    # The server refused the login: no password where one is needed, or a
    # wrong one. At startup a usage error; while running, a password changed
    # under the worker (met when it reconnects), waited out like FORBIDDEN.
    LOGIN_REFUSED = "login refused"
    # Anything else: retrying cannot help; raise.
    USAGE = "usage error"

    @property
    def is_outage(self) -> bool:
        """Whether waiting (with backoff) and retrying is the answer."""
        return self in (
            Fault.UNREACHABLE,
            Fault.DEMOTED,
            Fault.REFUSING,
            Fault.MIGRATING,
        )

    @property
    def passing(self) -> bool:
        """Whether a running worker retries it without a warning: an outage,
        or a login refused under it (a password changed, met on a
        reconnect). A revoked permission is waited out too, but said once
        (``waited_out_while_running``)."""
        return self.is_outage or self is Fault.LOGIN_REFUSED

    @property
    def waited_out_while_running(self) -> bool:
        """Whether a running worker waits it out: an outage, a permission
        revoked or a password changed under it (refused at startup, see
        ``is_outage``)."""
        return self.is_outage or self in (Fault.FORBIDDEN, Fault.LOGIN_REFUSED)


# Error reply codes (first word) that retrying can get past; any other
# reply is a usage error.
_CODE_FAULTS = {
    "NOGROUP": Fault.GROUP_MISSING,
    "READONLY": Fault.DEMOTED,
    "UNBLOCKED": Fault.DEMOTED,
    "MASTERDOWN": Fault.DEMOTED,
    "OOM": Fault.REFUSING,
    "BUSY": Fault.REFUSING,
    "LOADING": Fault.REFUSING,
    "CLUSTERDOWN": Fault.REFUSING,
    "TRYAGAIN": Fault.MIGRATING,
    # Redirections redis-py did not follow to the end (it follows them).
    "ASK": Fault.MIGRATING,
    "MOVED": Fault.MIGRATING,
    # A primary configured with min-replicas-to-write that has too few
    # replicas (one that a failover is leaving): the write was refused.
    "NOREPLICAS": Fault.REFUSING,
    # Reaches a loop only when loading the script and calling it again
    # failed too: a failover or a flush racing the reload. Try again later.
    "NOSCRIPT": Fault.REFUSING,
    "NOPERM": Fault.FORBIDDEN,
}
# Redis 6.2: "ERR Error running script (call to f_...): @user_script:1:
# @user_script: 1: -OOM command not allowed ..." (a refused command) or
# "... @user_script:77: NOGROUP No such key ..." (a command's error reply);
# a refused command under pcall, as the script returns it: "@user_script:
# 121: -READONLY You can't write ..." (claim.lua's "failed" reply).
_SCRIPT_INNER_CODE = re.compile(
    r"^(?:Error running script \(.*?\): )?(?:@user_script: ?\d+: )+-?([A-Z]+) "
)
# Client-side errors of redis-py's cluster client that mean "no node serves
# this now" (as opposed to usage errors such as keys in different slots).
# redis-py has no class for them; these are its own messages, not replies.
_CLUSTER_IN_FLUX_TEXTS = ("cannot be connected", "not covered", "could not agree")


def reply_code(error: ResponseError) -> str:
    """The error reply's code: its first word (``NOGROUP``, ``OOM``, ...);
    for an error inside a script on Redis 6.2, the inner reply's."""
    text = str(error)
    inner = _SCRIPT_INNER_CODE.match(text)
    if inner is not None:
        return inner.group(1)
    code: str | None = getattr(error, "status_code", None)
    return code or text.split(" ", 1)[0]


def _message(error: ResponseError) -> str:
    """The reply's text after its code, lower case."""
    text = str(error)
    if getattr(error, "status_code", None) is None:
        text = text.split(" ", 1)[-1]
    return text.lower()


def classify(error: BaseException) -> Fault:
    """What ``error`` means: an outage, a missing group, or a usage error."""
    # asyncio.TimeoutError: a reply that never came within our own bound
    # (an OSError itself from Python 3.11 on).
    if isinstance(error, (AuthenticationError, LoginRefusedError)):
        # A ConnectionError to redis-py, but no outage: it never passes.
        return Fault.LOGIN_REFUSED
    if isinstance(error, (*UNREACHABLE, asyncio.TimeoutError)):
        return Fault.UNREACHABLE
    if isinstance(error, ResponseError):
        code = "NOSCRIPT" if is_missing_script(error) else reply_code(error)
        if stream_vanished(error):
            # A read blocked on a stream deleted (or moved away by a
            # reshard), not a demotion.
            return Fault.GROUP_MISSING
        return _CODE_FAULTS.get(code, Fault.USAGE)
    if isinstance(error, ClusterError):
        # redis-py's "TTL exhausted.": redirected or told TRYAGAIN 16 times.
        return Fault.MIGRATING
    cluster_in_flux = isinstance(error, SlotNotCoveredError) or (
        isinstance(error, RedisClusterException)
        and any(text in str(error) for text in _CLUSTER_IN_FLUX_TEXTS)
    )
    return Fault.REFUSING if cluster_in_flux else Fault.USAGE


# redis-py's wording around a reply refused inside a pipeline or a
# transaction ("Command # 1 (HINCRBY k f 1) of pipeline caused error: 137
# 127.0.0.1:7001"): the command and its position, not what happened.
_PIPELINE_WORDING = re.compile(
    r"^Command # \d+ \(.*?\) of pipeline caused error: ", re.S
)


def reply_text(error: BaseException) -> str:
    """``error`` as a log line shows it: the server's reply with its code
    (redis-py strips the code of replies it has a class for: an ASK reply
    reads "137 127.0.0.1:7001"), without redis-py's pipeline wording."""
    text = _PIPELINE_WORDING.sub("", str(error), count=1)
    code = None
    if isinstance(error, ResponseError):
        code = getattr(error, "status_code", None)
    if code and code != "ERR" and not text.startswith(code):
        text = f"{code} {text}"
    return text


def describe(error: BaseException) -> str:
    """What happened, in our words, then the server's reply: "hash slot
    migrating between primaries (ASK 137 127.0.0.1:7001)"."""
    fault = classify(error)
    what = fault.value if fault is not Fault.USAGE else type(error).__name__
    return f"{what} ({reply_text(error)})"


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` is waited out and retried rather than raised."""
    return classify(error).is_outage


def is_passing(error: BaseException) -> bool:
    """Whether ``error`` is retried quietly while running (``Fault.passing``)."""
    return classify(error).passing


def waited_out_while_running(error: BaseException) -> bool:
    """Whether a running worker waits ``error`` out (an outage, or a
    permission an operator revoked) rather than raising it."""
    return classify(error).waited_out_while_running


def login_problem(
    error: BaseException, where: str, has_password: bool, user: str
) -> str:
    """One line for a refused login, not the server's text about HELLO or
    NOAUTH: ``where`` is host:port, ``has_password`` whether the client
    sent one, ``user`` the user it logs in as."""
    if not has_password:
        return (
            f"{where} requires a password, and the URL has none (user"
            f" {user!r}): give it as redis://USER:PASSWORD@HOST:PORT"
        )
    return f"{where} refused the URL's username and password (user {user!r}): {error}"


def permission_refused(error: BaseException, who: str) -> PermissionRefusedError:
    """The one-line error for a permission missing from the start."""
    return PermissionRefusedError(
        f"the server's ACL refuses {who}: {missing_permission(error)}; give its"
        " user the rule `taskiq-atomic-claim acl` prints"
    )


def missing_permission(error: BaseException) -> str:
    """What a NOPERM reply refuses, as the server says it ("this user has
    no permissions to run the 'xack' command"), without script wrappings."""
    text = str(error).strip()
    return text.rsplit("NOPERM", 1)[-1].strip(" :-") or text


# redis-py's own messages for a connection that failed before the command
# was written: connecting (refused, timed out, no master known to the
# sentinels) or a pooled connection found broken before use.
_NOT_SENT_TEXTS = (
    "connecting to",
    "Timeout connecting",
    "No master found",
    "Connection has data",
    "Connection not ready",
)


# Replies that refuse a command (or redirect it) before it runs.
_REFUSALS = (Fault.DEMOTED, Fault.REFUSING, Fault.MIGRATING)


def certainly_not_written(error: BaseException) -> bool:
    """Whether a write that failed with ``error`` certainly changed nothing:
    it never reached the server (the connection could not be made) or the
    server refused it (OOM, READONLY, LOADING, MASTERDOWN, NOREPLICAS, BUSY,
    TRYAGAIN, CLUSTERDOWN, also when a Sentinel connection turned that reply into a
    ``ConnectionError``). A timeout or a connection lost after sending is
    ambiguous: the server may have run the command and the reply was lost."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ResponseError):
            return classify(seen) in _REFUSALS
        if isinstance(seen, ConnectionRefusedError):
            return True
        if isinstance(seen, RedisConnectionError | RedisTimeoutError) and any(
            text in str(seen) for text in _NOT_SENT_TEXTS
        ):
            return True
        if classify(seen) in _REFUSALS:
            # The cluster client's own "no node serves this slot now".
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def stream_vanished(error: BaseException) -> bool:
    """UNBLOCKED "the stream key no longer exists": a read blocked on a
    stream that left the server (DEL, or MIGRATE in a Cluster reshard)."""
    return (
        isinstance(error, ResponseError)
        and reply_code(error) == "UNBLOCKED"
        and "no longer exists" in _message(error)
    )


def group_exists(error: ResponseError) -> bool:
    """BUSYGROUP: XGROUP CREATE found the group already there."""
    return reply_code(error) == "BUSYGROUP"


def stream_missing(error: ResponseError) -> bool:
    """XGROUP CREATE without MKSTREAM on a stream that does not exist."""
    return "requires the key to exist" in _message(error)


def is_missing_key(error: ResponseError) -> bool:
    """A command that needs its key (XINFO) found none."""
    return reply_code(error) == "ERR" and _message(error).startswith("no such key")


def is_missing_script(error: ResponseError) -> bool:
    """A script or function the server does not have (restart, flush,
    failover to a node that never had it): load it and call again."""
    return reply_code(error) == "NOSCRIPT" or "function not found" in _message(error)


def is_permission_denied(error: ResponseError) -> bool:
    """NOPERM: the ACL does not let this user run the command (or touch
    the key)."""
    return reply_code(error) == "NOPERM"


def refused_inside_script(error: ResponseError) -> bool:
    """The ACL refused a command a script called, or the key it touched:
    NOPERM, or an ``ERR`` that says so, under ``redis.call`` and
    ``redis.pcall`` alike ("The user executing the script can't run this
    command ..." to Redis 7.x, "ACL failure in script: ..." on 8.x)."""
    message = _message(error)
    return is_permission_denied(error) or any(
        words in message
        for words in ("user executing the script can't", "acl failure in script")
    )
