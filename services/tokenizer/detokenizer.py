"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character.

The algorithm is vLLM's and TGI's "prefix offset / read offset": decode a small window of ids that
starts a few ids before the text already emitted, and emit what the window's text gained past the
emitted part. Decoding from a little before keeps decoders that look at neighbours (such as
SentencePiece's leading space) consistent. When the window's text ends in U+FFFD, the last
character may still be incomplete, so the text is held back, except the part that is provably
final: a split of the window into ids whose text is unchanged by what follows (see `step`).
"""

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Ids of the prefix decoded with the first new ids, for context (vLLM's initial offset).
NUM_PREFIX_CONTEXT_IDS = 5
# A UTF-8 character has at most 4 bytes, so an unfinished one at most 3, from at most 3 ids.
MAX_IDS_IN_UNFINISHED_CHAR = 3


class IncrementalDetokenizer:
    """Decodes one generation incrementally with `decode(ids) -> str`.

    Guarantees, for decoders whose text of a byte stream splits at character boundaries (byte-level
    BPE, byte fallback): the deltas of `step()` and `flush()` joined equal `decode(all new ids)` (after
    the prefix); a delta never ends in a U+FFFD made by an unfinished character; each `step` decodes
    only the window, the ids since the last-but-one emission, never the whole sequence.
    """

    def __init__(self, decode: Callable[[list[int]], str], prefix_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._window = list(prefix_token_ids[-NUM_PREFIX_CONTEXT_IDS:])  # ids from the prefix offset on
        self._read = len(self._window)  # the ids of window[:read] are emitted text
        self._num_ids = 0  # new ids received (the prefix excluded)

    @property
    def num_emitted_ids(self) -> int:
        """How many of the new ids have their text in the deltas returned so far."""
        return self._num_ids - (len(self._window) - self._read)

    def step(self, token_ids: Sequence[int]) -> str:
        """Appends ids; returns the text that became final (possibly empty)."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        self._num_ids += len(token_ids)
        emitted = self._decode(self._window[: self._read])
        end, text = len(self._window), self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR):
            end, text = self._final_part(text)
        if len(text) <= len(emitted):
            return ""
        self._advance(end)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Ends the generation: returns all text still held back, unfinished characters included."""
        if self._read == len(self._window):
            return ""
        emitted, text = self._decode(self._window[: self._read]), self._decode(self._window)
        self._advance(len(self._window))
        return text[len(emitted) :]

    def _final_part(self, text: str) -> tuple[int, str]:
        """The longest window prefix `window[:end]` whose text is final, with that text.

        Its text is final when the rest has text of its own and decoding the two apart gives the
        same whole: `decode(window[:end]) + decode(window[end:]) == text`. Had `window[:end]` ended
        inside a character that the following bytes continue, the split would show U+FFFD on both
        sides where the whole has one character. (A rest without text, such as a skipped special
        token, shows nothing about the bytes that follow, so it proves nothing.)
        """
        lowest = max(self._read + 1, len(self._window) - MAX_IDS_IN_UNFINISHED_CHAR)
        for end in range(len(self._window) - 1, lowest - 1, -1):
            head, rest = self._decode(self._window[:end]), self._decode(self._window[end:])
            if rest and head + rest == text:
                return end, head
        return self._read, ""

    def _advance(self, end: int) -> None:
        """Marks window[:end] emitted; the window now starts where the last emission began."""
        self._window = self._window[self._read :]
        self._read = end - self._read
