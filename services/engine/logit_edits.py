"""What the penalties, the logit bias and the min_tokens mask of a step's sampled rows do to their logits,
as vLLM and OpenAI define them: min_tokens sets a request's EOS and stop token ids to -inf until it has
that many outputs; repetition_penalty divides a positive logit (multiplies a negative one) once for each
token seen in the prompt or output; frequency_penalty subtracts once per occurrence in the output,
presence_penalty once per token that occurred there; logit_bias adds.

They touch only the logits of some tokens per row (the distinct tokens seen, `seen_tokens.py`; the
banned ids, the biased ids), never a row's whole vocabulary (64 rows of 32,000 tokens: 15-20 ms for a
repetition penalty that way): `LogitEdits.positions` are those logits, so the sampler can edit the
step's logits in place and put those values back after its draw, instead of copying the batch (64
rows of a 152k vocabulary: 39 MB).
"""

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.request import Request
from services.engine.sampling_params import SamplingParams

Pairs = tuple[torch.Tensor, torch.Tensor]  # (rows, token ids), one entry per distinct token of a row
_NONE, _NO_COUNTS = np.empty(0, np.int64), np.empty(0, np.float32)


@dataclass(frozen=True)
class LogitEdits:
    params: list[SamplingParams]
    banned: dict[int, list[int]]  # row -> the token ids min_tokens forbids for now
    seen_anywhere: Pairs | None  # the distinct tokens of each row's prompt and output (repetition_penalty)
    seen_in_output: Pairs | None  # the distinct tokens of each row's output (frequency and presence penalties)
    output_counts: torch.Tensor | None  # how often each of seen_in_output occurred (frequency_penalty)
    biased: list[tuple[int, torch.Tensor, torch.Tensor]]  # (row, token ids, bias)
    device: torch.device

    @classmethod
    def of(cls, requests: list[Request], dtype: torch.dtype, device: torch.device) -> "LogitEdits | None":
        """The edits of ``requests`` (row i: ``requests[i]``), or None where none applies (most steps)."""
        params = [r.sampling_params for r in requests]
        banned = stop_tokens_before_min(requests)
        if not banned and not any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                                  or p.logit_bias for p in params):
            return None
        seen_anywhere = seen_in_output = output_counts = None  # (a row without the penalty: no tokens)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = [r.seen() if p.repetition_penalty != 1.0 else None for r, p in zip(requests, params)]
            seen_anywhere = _pairs([s.anywhere[:s.num_anywhere] if s else _NONE for s in seen], device)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            seen = [r.seen() if p.frequency_penalty or p.presence_penalty else None for r, p in zip(requests, params)]
            seen_in_output = _pairs([s.output_ids[:s.num_output] if s else _NONE for s in seen], device)
            output_counts = torch.from_numpy(np.concatenate(
                [s.output_counts[:s.num_output] if s else _NO_COUNTS for s in seen])).to(device)
        biased = [(row, torch.tensor(list(p.logit_bias.keys()), device=device),
                   torch.tensor(list(p.logit_bias.values()), dtype=dtype, device=device))
                  for row, p in enumerate(params) if p.logit_bias]
        return cls(params, banned, seen_anywhere, seen_in_output, output_counts, biased, device)

    def positions(self) -> Pairs:
        """Every (row, token id) whose logit `apply` writes, repeats included."""
        pairs = [pair for pair in (self.seen_anywhere, self.seen_in_output) if pair is not None]
        pairs += [(torch.full((len(ids),), row, device=self.device), torch.tensor(ids, device=self.device))
                  for row, ids in self.banned.items()]
        pairs += [(torch.full((len(ids),), row, device=self.device), ids) for row, ids, _ in self.biased]
        return torch.cat([rows for rows, _ in pairs]), torch.cat([ids for _, ids in pairs])

    def apply(self, logits: torch.Tensor) -> None:
        """Edits ``logits`` ``[rows, vocab]`` in place."""
        params = self.params
        for row, token_ids in self.banned.items():
            logits[row, token_ids] = float("-inf")
        if self.seen_anywhere is not None:
            rows, token_ids = self.seen_anywhere
            penalty = self._values([p.repetition_penalty for p in params])[rows]
            seen = logits[rows, token_ids]
            logits[rows, token_ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        if self.seen_in_output is not None:
            rows, token_ids = self.seen_in_output
            frequency = self._values([p.frequency_penalty for p in params])[rows] * self.output_counts
            presence = self._values([p.presence_penalty for p in params])[rows]
            logits[rows, token_ids] = logits[rows, token_ids] - frequency - presence
        for row, ids, bias in self.biased:
            logits[row].index_add_(0, ids, bias)

    def _values(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)


def _pairs(token_ids: list[np.ndarray], device: torch.device) -> Pairs:
    """Each row's token ids as (row, token id) pairs."""
    rows = np.repeat(np.arange(len(token_ids), dtype=np.int64), [len(ids) for ids in token_ids])
    return torch.from_numpy(rows).to(device), torch.from_numpy(np.concatenate(token_ids)).to(device)


def stop_tokens_before_min(requests: list[Request]) -> dict[int, list[int]]:
    """The token ids each row cannot draw yet: until a request has ``min_tokens`` outputs, its eos
    (unless ignored) and stop token ids."""
    banned = {}
    for row, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            token_ids = p.stop_token_id_set if p.ignore_eos else p.stop_token_id_set | r.eos_token_ids
            if token_ids:
                banned[row] = list(token_ids)
    return banned
