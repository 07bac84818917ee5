"""What a stream of text deltas holds back: the end of the text that may be the start of a marker (a
stop string, a tool-call tag, a reasoning tag) until the next delta says whether it is one."""

from collections.abc import Iterable


def held_back_length(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``markers`` (0: none)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
