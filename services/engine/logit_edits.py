"""What the penalties, the logit bias and the min_tokens mask of a step's sampled rows do to their logits,
as vLLM and OpenAI define them: min_tokens sets a request's EOS and stop token ids to -inf until it has
that many outputs; repetition_penalty divides a positive logit (multiplies a negative one) once for each
token seen in the prompt or output; frequency_penalty subtracts once per occurrence in the output,
presence_penalty once per token that occurred there; logit_bias adds.

They touch only the logits of some tokens per row (the distinct tokens seen, `seen_tokens.py`; the
banned ids, the biased ids), never a row's whole vocabulary (64 rows of 32,000 tokens: 15-20 ms for a
repetition penalty that way), so the sampler edits the step's logits in place and puts the values they
replaced back after its draw (`LogitEdits.applied`), instead of copying the batch (64 rows of a 152k
vocabulary: 39 MB).

On the CPU (float32 logits, the native library built) the penalties are one native pass over each row's
seen tokens (`cpu_kernels/sampling.penalize`), which also keeps the values it replaces; elsewhere (a GPU)
they are torch's gathers and scatters over (row, token id) pairs. The pairs cost with the context: the
sampler at 64 rows of 152k logits with 8,000-token prompts (~7,800 distinct tokens each) and a repetition
penalty took 22-41 ms a step that way on 2 cores (each gather or scatter of the pairs 7-8 ms, building
them 3 ms), 4.4-5.5 ms with the native pass, the draw included.
"""

import contextlib
import functools
from collections.abc import Iterator

import numpy as np
import torch

from services.engine.cpu_kernels import sampling
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.seen_tokens import SeenTokens

Pairs = tuple[torch.Tensor, torch.Tensor]  # (rows, token ids), one entry per distinct token of a row
_NONE, _NO_COUNTS = np.empty(0, np.int64), np.empty(0, np.float32)


class LogitEdits:
    """The edits of one step's rows (row i: ``requests[i]``). ``repeated[i]`` / ``in_output[i]``: row i's
    seen tokens where it has a repetition penalty / a frequency or presence penalty, else None."""

    def __init__(self, params: list[SamplingParams], banned: dict[int, list[int]],
                 repeated: list[SeenTokens | None] | None, in_output: list[SeenTokens | None] | None,
                 biased: list[tuple[int, torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.params = params
        self.banned = banned  # row -> the token ids min_tokens forbids for now
        self.repeated = repeated
        self.in_output = in_output
        self.biased = biased  # (row, token ids, bias)
        self.device = device

    @classmethod
    def of(cls, requests: list[Request], dtype: torch.dtype, device: torch.device) -> "LogitEdits | None":
        """The edits of ``requests`` (row i: ``requests[i]``), or None where none applies (most steps)."""
        params = [r.sampling_params for r in requests]
        banned = stop_tokens_before_min(requests)
        if not banned and not any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                                  or p.logit_bias for p in params):
            return None
        repeated = in_output = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repeated = [r.seen() if p.repetition_penalty != 1.0 else None for r, p in zip(requests, params)]
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            in_output = [r.seen() if p.frequency_penalty or p.presence_penalty else None
                         for r, p in zip(requests, params)]
        biased = [(row, torch.tensor(list(p.logit_bias.keys()), device=device),
                   torch.tensor(list(p.logit_bias.values()), dtype=dtype, device=device))
                  for row, p in enumerate(params) if p.logit_bias]
        return cls(params, banned, repeated, in_output, biased, device)

    @property
    def has_penalties(self) -> bool:
        return self.repeated is not None or self.in_output is not None

    def apply(self, logits: torch.Tensor, native: bool = True) -> None:
        """Edits ``logits`` ``[rows, vocab]`` in place. ``native``: the penalties in one native pass where
        it takes these logits (the same values); else with torch operators."""
        self._ban(logits)
        if self._penalizes_natively(logits, native):
            sampling.penalize(logits, self._penalty_rows())
        else:
            self._penalize(logits)
        self._bias(logits)

    @contextlib.contextmanager
    def applied(self, logits: torch.Tensor) -> Iterator[None]:
        """``logits`` (contiguous: rows that share memory would be edited twice) edited in place for the
        body of the ``with``, and the values they had put back after it, also where it raises."""
        native = self._penalizes_natively(logits, True)
        rows, token_ids = self._positions(with_penalties=not native)
        originals = logits[rows, token_ids] if len(rows) else None
        penalty_rows = saved = None
        try:
            self._ban(logits)
            if native:
                penalty_rows = self._penalty_rows()
                saved = sampling.penalize(logits, penalty_rows)
            else:
                self._penalize(logits)
            self._bias(logits)
            yield
        finally:
            if saved is not None:  # first: the other positions' originals predate the penalties
                sampling.unpenalize(logits, penalty_rows, saved)
            if originals is not None:
                logits[rows, token_ids] = originals

    def _penalizes_natively(self, logits: torch.Tensor, native: bool) -> bool:
        return native and self.has_penalties and sampling.can_run(logits)

    def _ban(self, logits: torch.Tensor) -> None:
        for row, token_ids in self.banned.items():
            logits[row, token_ids] = float("-inf")

    def _bias(self, logits: torch.Tensor) -> None:
        for row, ids, bias in self.biased:
            logits[row].index_add_(0, ids, bias)

    def _penalize(self, logits: torch.Tensor) -> None:
        params = self.params
        if self.repeated is not None:
            rows, token_ids = self._repeated_pairs
            penalty = self._values([p.repetition_penalty for p in params])[rows]
            seen = logits[rows, token_ids]
            logits[rows, token_ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        if self.in_output is not None:
            rows, token_ids = self._output_pairs
            counts = torch.from_numpy(np.concatenate(
                [s.output_counts[:s.num_output] if s else _NO_COUNTS for s in self.in_output])).to(self.device)
            frequency = self._values([p.frequency_penalty for p in params])[rows] * counts
            presence = self._values([p.presence_penalty for p in params])[rows]
            logits[rows, token_ids] = logits[rows, token_ids] - frequency - presence

    def _penalty_rows(self) -> sampling.PenaltyRows:
        columns = sampling.PenaltyRows.empty()
        for row, p in enumerate(self.params):
            repeated = self.repeated[row] if self.repeated is not None else None
            in_output = self.in_output[row] if self.in_output is not None else None
            columns.seen_at.append(repeated.addresses[0] if repeated else 0)
            columns.num_seen.append(repeated.num_anywhere if repeated else 0)
            columns.repetition.append(p.repetition_penalty)
            columns.output_at.append(in_output.addresses[1] if in_output else 0)
            columns.counts_at.append(in_output.addresses[2] if in_output else 0)
            columns.num_output.append(in_output.num_output if in_output else 0)
            columns.frequency.append(p.frequency_penalty)
            columns.presence.append(p.presence_penalty)
        return columns

    def _positions(self, with_penalties: bool) -> Pairs:
        """The (row, token id) pairs whose logits the edits write, repeats included: the banned and biased
        ones, and the penalized ones ``with_penalties``."""
        pairs = [self._repeated_pairs, self._output_pairs] if with_penalties else []
        pairs += [(torch.full((len(ids),), row, device=self.device), torch.tensor(ids, device=self.device))
                  for row, ids in self.banned.items()]
        pairs += [(torch.full((len(ids),), row, device=self.device), ids) for row, ids, _ in self.biased]
        pairs = [pair for pair in pairs if pair is not None]
        if not pairs:
            return _NO_PAIRS
        return torch.cat([rows for rows, _ in pairs]), torch.cat([ids for _, ids in pairs])

    @functools.cached_property
    def _repeated_pairs(self) -> Pairs | None:
        if self.repeated is None:
            return None
        return _pairs([s.anywhere[:s.num_anywhere] if s else _NONE for s in self.repeated], self.device)

    @functools.cached_property
    def _output_pairs(self) -> Pairs | None:
        if self.in_output is None:
            return None
        return _pairs([s.output_ids[:s.num_output] if s else _NONE for s in self.in_output], self.device)

    def _values(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)


_NO_PAIRS: Pairs = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


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
