"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character.

The algorithm is vLLM's and TGI's "prefix offset / read offset": decode a small window of ids that
starts a few ids before the text already emitted, and emit what the window's text gained past the
emitted part. Decoding from a little before keeps decoders that look at neighbours (such as
SentencePiece's leading space) consistent. Two kinds of text at the window's end may still change:
- a trailing run of byte-fallback ids (`<0xNN>`, SentencePiece-style tokenizers): ByteFallback
  decodes a run of them together, as its text if the bytes are valid UTF-8, else as one U+FFFD per
  byte, whole characters in it included. So a run is held back until an id with text ends it;
- text ending in U+FFFD, whose last character may be unfinished (byte-level BPE). It is held back
  except the part that is provably final: a split of the window into ids whose text is unchanged
  by what follows (see `_final_part`).
"""

from collections.abc import Callable, Collection, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Ids of the prefix decoded with the first new ids, for context (vLLM's initial offset).
NUM_PREFIX_CONTEXT_IDS = 5
# A UTF-8 character has at most 4 bytes, so an unfinished one at most 3, from at most 3 ids.
MAX_IDS_IN_UNFINISHED_CHAR = 3


class IncrementalDetokenizer:
    """Decodes one generation incrementally with `decode(ids) -> str`.

    `byte_fallback_ids` are the ids that a ByteFallback decoder turns into bytes (none for other
    decoders); `dropped_ids` the ids that `decode` leaves out (special tokens when skipping them):
    they neither end a run of byte-fallback ids nor split one.

    Guarantees, for byte-level BPE and byte fallback decoders: the deltas of `step()` and `flush()`
    joined equal `decode(all new ids)` (after the prefix); a delta never ends in a U+FFFD made by an
    unfinished character, nor holds text that later ids would decode differently; each `step`
    decodes only the window, the ids since the last-but-one emission (so also a run of byte-fallback
    ids until it ends), never the whole sequence.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        prefix_token_ids: Sequence[int] = (),
        byte_fallback_ids: Collection[int] = frozenset(),
        dropped_ids: Collection[int] = frozenset(),
    ) -> None:
        self._decode = decode
        self._byte_fallback_ids = byte_fallback_ids
        self._dropped_ids = dropped_ids
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
        end = self._open_run_start()
        if end <= self._read:
            return ""
        emitted, text = self._decode(self._window[: self._read]), self._decode(self._window[:end])
        if text.endswith(REPLACEMENT_CHAR):
            end, text = self._final_part(end, text)
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

    def _open_run_start(self) -> int:
        """Where the window's trailing run of byte-fallback ids starts; the window's end without one."""
        start = end = len(self._window)
        while start > self._read and (
            self._window[start - 1] in self._byte_fallback_ids or self._window[start - 1] in self._dropped_ids
        ):
            start -= 1
        while start < end and self._window[start] in self._dropped_ids:  # a run starts at a byte
            start += 1
        return start

    def _final_part(self, stop: int, text: str) -> tuple[int, str]:
        """The longest prefix `window[:end]` of `window[:stop]` (whose text is `text`) with final text.

        Its text is final when the rest has text of its own and decoding the two apart gives the
        same whole: `decode(window[:end]) + decode(window[end:stop]) == text`. Had `window[:end]`
        ended inside a character that the following bytes continue, the split would show U+FFFD on
        both sides where the whole has one character. (A rest without text, such as a skipped
        special token, shows nothing about the bytes that follow, so it proves nothing.)
        """
        lowest = max(self._read + 1, stop - MAX_IDS_IN_UNFINISHED_CHAR)
        for end in range(stop - 1, lowest - 1, -1):
            head, rest = self._decode(self._window[:end]), self._decode(self._window[end:stop])
            if rest and head + rest == text:
                return end, head
        return self._read, ""

    def _advance(self, end: int) -> None:
        """Marks window[:end] emitted; the window now starts where the last emission began."""
        self._window = self._window[self._read :]
        self._read = end - self._read
