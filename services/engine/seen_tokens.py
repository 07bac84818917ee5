"""The distinct tokens a request has seen, kept as it grows: what its penalties look at each step.

repetition_penalty acts once on each distinct token of the prompt and output, presence_penalty once on
each distinct output token, frequency_penalty by how often each occurred in the output. Gathering those
from the request's token lists every step is a pass over its whole context (64 requests of 8,000 tokens:
29 ms a step); a request whose sampling has a penalty keeps them here instead, updated with each output
token (`Request.append_output`), and the step reads them as arrays.
"""

from collections.abc import Sequence

import numpy as np


class SeenTokens:
    """``anywhere[:num_anywhere]``: the distinct tokens of the prompt and output, in first-seen order;
    ``output_ids[:num_output]`` the distinct output tokens and ``output_counts`` how often each occurred.
    ``addresses``: the three arrays' data addresses, for the native penalty pass (``logit_edits``; kept
    here because numpy takes microseconds to give one, and a step wants three per row)."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self._anywhere: set[int] = set()
        self._output_slot: dict[int, int] = {}
        self.anywhere = np.empty(max(64, len(prompt) + len(output)), np.int64)
        self.num_anywhere = 0
        self.output_ids = np.empty(max(16, len(output)), np.int64)
        self.output_counts = np.zeros(len(self.output_ids), np.float32)
        self.num_output = 0
        self._note_addresses()
        for token_id in prompt:
            self._see(token_id)
        for token_id in output:
            self.add_output(token_id)

    def add_output(self, token_id: int) -> None:
        self._see(token_id)
        slot = self._output_slot.get(token_id)
        if slot is None:
            slot = self._output_slot[token_id] = self.num_output
            if slot == len(self.output_ids):
                self.output_ids, self.output_counts = _doubled(self.output_ids), _doubled(self.output_counts)
                self._note_addresses()
            self.output_ids[slot] = token_id
            self.num_output += 1
        self.output_counts[slot] += 1

    def _see(self, token_id: int) -> None:
        if token_id in self._anywhere:
            return
        self._anywhere.add(token_id)
        if self.num_anywhere == len(self.anywhere):
            self.anywhere = _doubled(self.anywhere)
            self._note_addresses()
        self.anywhere[self.num_anywhere] = token_id
        self.num_anywhere += 1

    def _note_addresses(self) -> None:
        self.addresses = (self.anywhere.ctypes.data, self.output_ids.ctypes.data, self.output_counts.ctypes.data)


def _doubled(array: np.ndarray) -> np.ndarray:
    """``array`` followed by as many zeros: room to grow into."""
    return np.concatenate([array, np.zeros_like(array)])
