"""What a consumer finished, kept from its own reads while they can still
return it."""

from __future__ import annotations

from typing import Any, TypeVar

# (stream, entry id, ...) as the reads give them.
Entry = TypeVar("Entry", bound=tuple[Any, ...])


class FinishedEntries:
    """Entries this consumer finished (acked, dead-lettered, declined), each
    kept until every read in flight when it finished has completed: only
    such a read can still return it (``XREADGROUP ... CLAIM`` on Redis >=
    8.4 reclaims an entry whose ack the server had not yet run, and the
    ack's reply can come first). A read sent later cannot: the server ran
    the ack before it. Reads are numbered as they are sent, and done once
    their entries are held."""

    def __init__(self) -> None:
        self.sent = 0
        self.in_flight: set[int] = set()
        # (stream, entry id) -> the last read number sent when it finished.
        self.finished: dict[tuple[str, str], int] = {}

    def add(self, stream: str, entry_id: str) -> None:
        if self.in_flight:
            self.finished[(stream, entry_id)] = self.sent

    def read_sent(self) -> int:
        self.sent += 1
        self.in_flight.add(self.sent)
        return self.sent

    def screened(self, read_number: int, read: list[Entry]) -> list[Entry]:
        """What read ``read_number`` returned, minus what finished while it
        was in flight (no ack needed: the ack took it off the PEL)."""
        finished = self.finished
        if not finished:
            return read
        return [
            entry
            for entry in read
            if finished.get((entry[0], entry[1]), -1) < read_number
        ]

    def read_done(self, read_number: int) -> None:
        self.in_flight.discard(read_number)
        if self.finished:
            oldest = min(self.in_flight, default=self.sent + 1)
            self.finished = {
                key: last for key, last in self.finished.items() if last >= oldest
            }
