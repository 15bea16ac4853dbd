"""Stop strings matched on decoded text. While streaming, text that could be the start of a stop
string is held back until it is resolved, so a stop string never leaks to the client."""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""     # text received but not yet released
        self.done = False

    def push(self, piece: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string was hit)."""
        if self.done:
            return "", True
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[:min(hits)]
            self.pending, self.done = "", True
            return out, True
        hold = 0  # longest tail of pending that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.done else out

    def truncate(self, text: str) -> str:
        """The full text cut before the first stop string."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[:min(hits)] if hits else text
