"""Stop strings, applied by the router on the detokenized stream.

Text that could be the beginning of a stop string is held back until it is either completed
(generation stops there; the stop string itself is not returned, as in the OpenAI API) or
ruled out. So a client never sees part of a stop string, whatever the token boundaries.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # text received but not yet released
        self.stopped = False

    def push(self, text: str) -> str:
        """Adds generated text; returns what may be released now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        if not self.stop:
            out, self._pending = self._pending, ""
            return out
        # Release all but the tail that could still start a stop string.
        cut = len(self._pending) - self._hold
        for start in range(max(0, cut), len(self._pending)):
            if any(s.startswith(self._pending[start:]) for s in self.stop):
                cut = start
                break
        else:
            cut = len(self._pending)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """Generation ended without a match: the held-back tail is ordinary text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
