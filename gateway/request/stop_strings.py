"""Stop strings over a stream of text deltas.

Text that might be the start of a stop string is held back until the next
delta decides it, so a stop string split across tokens (or across chunks)
is still found and never leaks to the client:

    stops ["END"]   feed("the E") -> "the "   (holds "E")
                    feed("ND!")   -> ""       stopped: "END" trimmed, the rest dropped
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop string to complete in the stream; emits only text before it.

    "First to complete" (the match that ends earliest; of two ending together, the
    longer) is what a token-by-token stream can decide, so the result is the same
    however the text is split into deltas: with stops ``a`` and ``!aa`` the text
    ``!aa`` stops at ``a`` (complete after ``!a``), in one delta or three.

    Args:
        stops: Stop strings (empty strings are ignored).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False
        self.matched = ""

    def feed(self, text: str) -> str:
        """Add a delta; return the text that is now safe to emit.

        After a match, ``stopped`` is True, ``matched`` holds the stop string,
        and every later call returns "".
        """
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        best, best_end = -1, -1
        for stop in self.stops:
            i = buf.find(stop)  # the earliest start of this stop is also its earliest end
            end = i + len(stop)
            if i >= 0 and (best < 0 or end < best_end or (end == best_end and i < best)):
                best, best_end, self.matched = i, end, stop
        if best >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:best]
        hold = self._held_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of the stream: release what was held back (it matched nothing)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
