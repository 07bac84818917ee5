"""Batched sampling for the requests that sample in a step.

Order, as in vLLM: raw logits (whose distribution the logprobs report) → min_tokens eos/stop mask →
repetition, frequency and presence penalties → logit_bias → the structured-output mask (tokens that
would break a request's constraint) → greedy argmax, or temperature → min_p →
top_k → top_p → a draw. A draw takes one uniform number per request (inverse transform sampling,
``inverse_cdf.py``; on the CPU, temperature, the filters and the draw in one native call,
``cpu_kernels/sampling.py``), and a request with a seed takes it only from its own ``torch.Generator``: the
same seed gives the same tokens alone or in any batch. The sampler owns those generators, keyed by
request id; the engine calls ``free(request_id)`` when a request finishes.
"""

import torch

from services.engine.cpu_kernels import sampling
from services.engine.inverse_cdf import inverse_cdf_draw
from services.engine.logit_edits import LogitEdits
from services.engine.request import Request
from services.engine.scheduler_output import SampledLogprobs
from services.engine.structured_output.masks import StepMasks


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's highest logit's index, the first of equal ones (NaN counts as highest), as
    ``argmax`` gives it: on the CPU in one native call (``cpu_kernels/sampling.py``), else ``max``,
    which finds the same index ~3x faster than ``argmax`` (64 rows of 8,192 float32 logits on the
    CPU: 112 us against 357 with torch 2.13)."""
    if sampling.can_run(logits):
        return sampling.argmax(logits)
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # requests without a seed
        self.request_generators: dict[str, torch.Generator] = {}
        self._masked = torch.empty(0, device=device)  # the masked steps' copy of their logits, kept (`_copy`)
        if self.device.type == "cpu":
            sampling.is_available()  # built now, not at the first sampled request

    def free(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request], masks: StepMasks | None = None
                 ) -> tuple[list[int], list[SampledLogprobs | None]]:
        """``logits: [n, vocab]`` float32, row i for ``requests[i]`` → (token ids, logprobs or None per row).
        ``masks``: the step's structured-output masks (`structured_output.masks`), if any request has one.

        A call that raises leaves every seeded request's generator as it found it, so sampling the
        rows again (each alone, to find the request at fault) draws the same tokens a call without
        the faulty request would have."""
        saved = {r.request_id: generator.get_state() for r in requests
                 if (generator := self.request_generators.get(r.request_id)) is not None}
        try:
            return self._sample(logits, requests, masks)
        except Exception:
            for request in requests:
                state = saved.get(request.request_id)
                if state is None:
                    self.request_generators.pop(request.request_id, None)  # made in this call: reseeded next time
                else:
                    self.request_generators[request.request_id].set_state(state)
            raise

    def _sample(self, logits: torch.Tensor, requests: list[Request], masks: StepMasks | None
                ) -> tuple[list[int], list[SampledLogprobs | None]]:
        params = [r.sampling_params for r in requests]
        if masks is None:
            tokens = self._draw_edited_in_place(logits, requests)
        else:  # the masks write whole rows: on a copy (the caller's logits stay as they came)
            processed = self._copy(logits)
            edits = LogitEdits.of(requests, logits.dtype, self.device)
            if edits is not None:
                edits.apply(processed)
            masks.apply(processed, requests, unprocessed=logits)
            tokens = self._draw(processed, requests)
        token_list = tokens.tolist()
        if all(p.logprobs is None for p in params):
            return token_list, [None] * len(requests)
        return token_list, self._logprobs(logits, tokens, params)  # of the raw distribution

    def process_logits(self, logits: torch.Tensor, requests: list[Request], native: bool = True) -> torch.Tensor:
        """Penalties, logit bias and the min_tokens mask (`logit_edits`), in a new tensor; ``logits``
        itself when none of them applies. ``native``: the penalties in the native pass where it runs."""
        edits = LogitEdits.of(requests, logits.dtype, self.device)
        if edits is None:
            return logits
        logits = logits.clone()
        edits.apply(logits, native)
        return logits

    def _copy(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` in a buffer the sampler keeps across steps, as the native step keeps the
        logits themselves (`DecodeStep`: a new one past 32 MB faults its pages in every step)."""
        if self._masked.numel() < logits.numel() or self._masked.dtype != logits.dtype:
            self._masked = torch.empty(logits.numel(), dtype=logits.dtype, device=logits.device)
        return self._masked[:logits.numel()].view(logits.shape).copy_(logits)

    def _draw_edited_in_place(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The draw from ``logits`` with the penalties, logit bias and min_tokens mask applied to them in
        place, and the values they replaced put back after it (also where it raises): a copy of the
        batch took longer than the draw (64 rows of a 152k vocabulary with Qwen2.5 Instruct's defaults,
        repetition_penalty 1.05, top_k 20, top_p 0.8 and temperature 0.7: the sampler took 18.7 ms a step on
        2 cores with the copy, 6.6 without; with presence_penalty 0.5 alone, 14.3 and 2.8)."""
        edits = LogitEdits.of(requests, logits.dtype, self.device)
        if edits is None:
            return self._draw(logits, requests)
        if not logits.is_contiguous():  # (a view whose rows may share memory, such as an expanded row)
            processed = logits.clone()
            edits.apply(processed)
            return self._draw(processed, requests)
        with edits.applied(logits):
            return self._draw(logits, requests)

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return greedy_tokens(logits)
        rows = None if len(random_rows) == len(params) else torch.tensor(random_rows, device=self.device)
        chosen = [params[i] for i in random_rows]
        sampled = logits if rows is None else logits.index_select(0, rows)  # [m, vocab]
        uniforms = self._uniforms(chosen, [requests[i] for i in random_rows])
        if sampling.can_run(sampled):  # one native call
            drawn = sampling.sample(sampled, uniforms, [p.temperature for p in chosen], [p.top_k for p in chosen],
                                    [p.top_p for p in chosen], [p.min_p for p in chosen])
        else:
            drawn = inverse_cdf_draw(self.probabilities(sampled, chosen), uniforms)
        return drawn if rows is None else greedy_tokens(logits).index_copy(0, rows, drawn)

    def _uniforms(self, params: list, requests: list[Request]) -> torch.Tensor:
        """One uniform in [0, 1) per row (float64 ``[m]``): a request with a seed draws it from its own
        generator, the others in row order from the sampler's. Without seeds (most steps) that is one
        operator call: each torch call of a step's host work runs with the caches the model's weights
        just went through, ~30 us each at one row of the small model (the draw took 0.11 ms of a
        1.66 ms step through `strata up` before, when it filled and indexed a tensor)."""
        if all(p.seed is None for p in params):
            return torch.rand(len(params), dtype=torch.float64, device=self.device, generator=self.generator)
        uniforms = torch.empty(len(params), dtype=torch.float64, device=self.device)
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=self.device,
                                            generator=self.generator)
        for j, p in enumerate(params):
            if p.seed is not None:
                uniforms[j] = torch.rand(1, dtype=torch.float64, device=self.device,
                                         generator=self._request_generator(requests[j]))[0]
        return uniforms

    def probabilities(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, then min_p, top_k and top_p masks; returns the renormalised distribution."""
        logits = logits / self._column([p.temperature for p in params])
        if any(p.min_p > 0 for p in params):
            probs = logits.softmax(dim=-1)
            threshold = self._column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, params)
        return logits.softmax(dim=-1)

    def _top_k_top_p(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Keep each row's ``top_k`` largest logits, then the smallest prefix of those (by descending
        probability) whose mass reaches ``top_p``."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [m, vocab]
        rank = torch.arange(logits.shape[1], device=self.device)
        top_k = torch.tensor([min(p.top_k or logits.shape[1], logits.shape[1]) for p in params], device=self.device)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = self._column([p.top_p if p.top_p < 1.0 else 2.0 for p in params])  # 2: rounding never cuts
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

    def _request_generator(self, request: Request) -> torch.Generator:
        generator = self.request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)
            self.request_generators[request.request_id] = generator
        return generator

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, params: list) -> list[SampledLogprobs | None]:
        """The rows that asked for logprobs: theirs under the raw logits (``token_logprobs``)."""
        asking = [row for row, p in enumerate(params) if p.logprobs is not None]
        if len(asking) < len(params):
            index = torch.tensor(asking, device=self.device)
            logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
        out: list[SampledLogprobs | None] = [None] * len(params)
        for row, entry in zip(asking, token_logprobs(logits, tokens, [params[row].logprobs for row in asking]),
                              strict=True):
            out[row] = entry
        return out

    def _column(self, values: list[float]) -> torch.Tensor:
        return self._values(values).unsqueeze(1)  # [n, 1]

    def _values(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)  # [n]



def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> list[SampledLogprobs]:
    """Per row of ``logits [n, vocab]``: the log-probability of ``tokens[row]`` under log_softmax(logits),
    its rank and the ``counts[row]`` most likely alternatives (on the CPU in one native call,
    ``cpu_kernels/sampling.py``)."""
    max_top = max(counts, default=0)
    if sampling.can_run(logits):
        logprobs, ranks, top_ids, top_values = sampling.logprobs(logits, tokens, max_top)
    else:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > logprobs.unsqueeze(1)).sum(dim=-1) + 1
        top_values, top_ids = raw_logprobs.topk(max_top, dim=-1)
    logprobs, ranks, tokens = logprobs.tolist(), ranks.tolist(), tokens.tolist()
    top_ids, top_values = top_ids.tolist(), top_values.tolist()
    return [SampledLogprobs(tokens[i], logprobs[i], ranks[i], list(zip(top_ids[i][:k], top_values[i][:k], strict=True)))
            for i, k in enumerate(counts)]
