"""Requests prefilled into model runners' caches, each with one token to decode next."""

from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ScheduledChunk, SchedulerOutput


def prefill_requests(runners, prompt_lens: list[int], tables: list[list[int]]) -> list[Request]:
    """One greedy request per prompt length (token ids from a fixed pattern), prefilled in one step in
    every runner at its block table, then given a sampled token (5) to decode next."""
    requests = [Request(f"r{i}", [(7 * i + 3 * j) % 500 + 3 for j in range(length)], SamplingParams(temperature=0.0))
                for i, length in enumerate(prompt_lens)]
    for runner in runners:
        runner.compute_logits(SchedulerOutput([ScheduledChunk(r, r.num_tokens, t) for r, t in zip(requests, tables)]))
    for request in requests:
        request.num_computed_tokens = request.num_tokens
        request.append_output(5)
    return requests
