"""The prefix cache's events (a block stored, a block removed) in a bounded log.

The step thread appends as the block pool caches and evicts full blocks; the
service's event streams (smg-grpc-proto SubscribeKvEvents) read from another thread.
Nothing is recorded while nobody subscribes, and the log keeps at most ``capacity``
events: a reader that falls behind further, or resumes from a number recorded while
nobody listened, is told it missed some (``since`` returns ``complete=False``) and
starts over from what follows.

Numbers: every event gets the next sequence number, recorded or not, so a gap is
always visible to a reader holding a cursor. A log starts numbering at the wall clock's
microseconds, so an engine that restarted numbers above every cursor its previous
process gave out: a reader resuming across the restart sees a gap, never the new
process's events taken for the old one's. A cursor past the numbers given so far is a
gap too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from engine_svc.core.block_pool import BlockHash

DEFAULT_CAPACITY = 8192


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One prefix-cache change.

    Attributes:
        seq: Its sequence number.
        block: The block stored (None: ``removed`` says which was removed).
        removed: The hash value of the block evicted (None for a store).
        root: The stored block starts its chain (no parent block; under ``salt``).
        salt: The cache salt the stored block's chain was started under.
    """

    seq: int
    block: BlockHash | None = None
    removed: int | None = None
    root: bool = False
    salt: str = ""


class KvEventLog:
    """Prefix-cache events, numbered, the last ``capacity`` kept while someone listens.

    Writers: the engine's step thread only. Readers: any thread.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, first_seq: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._next = time.time_ns() // 1000 if first_seq is None else first_seq
        self.subscribers = 0

    @property
    def next_seq(self) -> int:
        """The number the next event will get."""
        return self._next

    def subscribe(self) -> int:
        """Start listening; returns the number of the first event recorded for it."""
        with self._lock:
            if self.subscribers == 0:
                self._events.clear()  # what was kept predates a gap
            self.subscribers += 1
            return self._next

    def unsubscribe(self) -> None:
        with self._lock:
            self.subscribers = max(0, self.subscribers - 1)

    def stored(self, block: BlockHash, root: bool, salt: str) -> None:
        """A full block was cached under ``block`` (``root``: first of its chain)."""
        self._record(block, None, root, salt)

    def removed(self, value: int) -> None:
        """The cached block hashing to ``value`` was evicted."""
        self._record(None, value, False, "")

    def _record(self, block: BlockHash | None, removed: int | None, root: bool, salt: str) -> None:
        if not self.subscribers:
            self._next += 1  # unrecorded, but numbered: a resumed cursor sees the gap
            return
        with self._lock:
            self._events.append(KvEvent(self._next, block, removed, root, salt))
            self._next += 1

    def since(self, seq: int, limit: int = 1024) -> tuple[list[KvEvent], bool, int]:
        """Events numbered ``seq`` and later (at most ``limit``), whether none before
        them since ``seq`` was lost (False: start over from these), and the cursor to
        ask from next."""
        with self._lock:
            events = self._events
            if seq > self._next:  # numbers this log never gave: another engine's (a restart)
                return [], False, self._next
            if seq == self._next:
                return [], True, seq
            complete = bool(events) and events[0].seq <= seq
            start = seq - events[0].seq if complete else 0
            out = [events[i] for i in range(start, min(len(events), start + limit))]
            return out, complete, out[-1].seq + 1 if out else self._next
