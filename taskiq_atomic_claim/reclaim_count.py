"""The server's count of reclaims per (stream, group): what ``serve``'s
history draws as reclaimed/s, whoever reclaimed.

``StreamKeys.reclaimed`` is a coordination key: a string that the worker
which reclaims entries raises by their number (``INCRBY``) and gives a fresh
expiry of ``RECLAIMED_TTL_MS`` in the same step, so it never exists without
one. On the Lua path ``lua/claim.lua`` does it inside the claim; where reads
reclaim (``XREADGROUP ... CLAIM``) ``ReclaimCounter`` does it after a read
that reclaimed, in one MULTI/EXEC, never after one that did not. Counted:
entries handed to a consumer to run again; the ones dead-lettered instead
are the dead letters' count.

The count is an observation, never a reason to fail a claim or a read: a
server refusing it (an ACL from before this key, out of memory) leaves it
behind: silently inside the script, with one warning after a read. It
lapses after a day without reclaims, or is deleted: a reader takes a
decrease for a reset (``increase``).
"""

from __future__ import annotations

import logging
from typing import Any

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.server_calls import REPLY_MARGIN_S, within
from taskiq_atomic_claim.server_errors import classify

logger = logging.getLogger("taskiq.atomic_claim")

# Long enough for any reader sampling it (serve every few seconds) to see
# differences; refreshed at each increment.
RECLAIMED_TTL_MS = 86_400_000


class ReclaimCounter:
    """Where reads reclaim: raises the count after a read that reclaimed
    (``lua/claim.lua`` does it on the Lua path)."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._refused = False  # warned once

    async def add(self, client: Any, stream: str, amount: int) -> None:
        """``amount`` entries of ``stream`` reclaimed: INCRBY and PEXPIRE in
        one MULTI/EXEC (on Cluster on the slot's primary: one key). Errors
        are logged, never raised: the entries are this consumer's already."""
        if amount <= 0:
            return
        key = StreamKeys(stream, self.group).reclaimed
        try:
            async with client.pipeline(transaction=True) as pipe:
                pipe.execute_command("INCRBY", key, amount)
                pipe.execute_command("PEXPIRE", key, RECLAIMED_TTL_MS)
                await within(REPLY_MARGIN_S, pipe.execute())
        except Exception as error:
            # Out of memory the MULTI is refused; an ACL from before this
            # key (re-run `acl`) refuses it too: only the count is missing.
            if classify(error).is_outage or self._refused:
                logger.debug("Reclaims on %r not counted: %s", stream, error)
                return
            logger.warning(
                "Reclaims on stream %r cannot be counted on the server (%s);"
                " serve's history shows none",
                stream,
                error,
            )
            self._refused = True


def increase(previous: int, current: int) -> int:
    """What a count read ``previous`` then ``current`` rose by: a decrease
    is a reset (the key lapsed or was deleted), counted again from 0. A
    reset followed by ``previous`` reclaims or more before the next read
    looks like growth: ``previous`` of them are missed."""
    return current - previous if current >= previous else current
