"""Stop strings over a stream of text deltas.

The matcher holds back the longest tail of the unreleased text that could still grow into a stop
string, so a client never sees the start of a stop string that later completes, and a stop string
that spans several tokens (or several deltas) is still found. Text is released only when it can no
longer be part of a match, which is why searching the held-back text alone is enough.
"""

from dataclasses import dataclass

from services.gateway.held_back import held_back_length


@dataclass
class StopMatch:
    """The outcome of one ``feed``: text safe to release, and the stop string if one was hit."""
    text: str
    stop: str | None = None


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop_in_output: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop_in_output
        self._pending = ""
        self.stopped: str | None = None

    def feed(self, delta: str, can_stop: bool = True) -> StopMatch:
        """Adds ``delta``; returns what may be released now. After a hit, the matcher is done and
        the returned text ends before the stop string (or after it, when it is included).

        ``can_stop=False`` (min_tokens not reached yet) releases everything without matching.
        """
        if self.stopped is not None:
            return StopMatch("", self.stopped)
        self._pending += delta
        if not self._stops or not can_stop:
            return self._release(len(self._pending))
        hit = self._earliest_match()
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self._include else index
            self.stopped = stop
            text, self._pending = self._pending[:end], ""
            return StopMatch(text, stop)
        return self._release(len(self._pending) - self._held_back_len())

    def flush(self) -> str:
        """Releases everything held back (the generation ended without a stop string)."""
        text, self._pending = self._pending, ""
        return text

    def _release(self, end: int) -> StopMatch:
        text, self._pending = self._pending[:end], self._pending[end:]
        return StopMatch(text)

    def _earliest_match(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._pending.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        return held_back_length(self._pending, self._stops)
