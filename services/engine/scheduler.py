"""Iteration-level continuous batching with chunked prefill and preemption by recompute.

Each ``schedule()`` builds one step under one token budget (``max_num_batched_tokens``) and at
most ``max_num_seqs`` running requests: running requests first, in admission order (a decode
takes one token, a partly prefilled prompt continues with the next chunk), then waiting requests,
each starting after its prefix-cache hits. A partly prefilled prompt is always the last running
request (it took the budget that was left, so no one was admitted behind it): every decode gets
its token in every step, however long the prompt being prefilled. When a running request
cannot get blocks, the newest running request is preempted (its blocks freed, its progress reset,
back at the head of the waiting queue) until it can; a preempted request later recomputes its
prompt and the output it already has. The scheduler owns the only KVCacheManager.

Fairness between callers: each request has a fairness key (one API call's n x prompts fan-out, or
a tenant; by default its own id). Admission takes the waiting request whose key has the fewest
running requests, the earliest among equals, which with the default keys is first come, first
served. When the batch is full and a key waits with nothing running, the newest running request
of the key with the most (two or more) is preempted for it, so a fan-out that fills every seat
delays another caller by a step, not by a whole generation.

A sequence stops with "length" at max_tokens, at max_model_len, or when it fills the whole KV pool
(only possible when the pool holds fewer than max_model_len tokens).

The engine loop calls ``schedule()``, runs the model on the result, and hands what was sampled to
``update_from_output()``, which returns what each request produced. Not thread-safe: call
``add_request`` and ``abort_request`` from the engine loop, between steps.
"""

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_events import KvEventSink
from services.engine.request import Request, RequestStatus
from services.engine.scheduler_output import (
    ModelRunnerOutput,
    RequestOutput,
    SampledLogprobs,
    ScheduledChunk,
    SchedulerOutput,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for load reports and metrics; the prefix-cache and preemption counts are totals
    since start."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_kv_blocks: int, max_model_len: int, event_sink: KvEventSink | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, config.prefix_cache_hash_seed, event_sink)
        # A sequence never grows past what the whole pool holds, so the oldest running request
        # can always make progress by preempting the others.
        self._kv_capacity_tokens = num_kv_blocks * config.block_size
        self._max_seq_len = min(max_model_len, self._kv_capacity_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.last_output: SchedulerOutput | None = None  # the latest schedule()'s, for step tracing

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises InvalidRequestError for one that can never run: an empty
        prompt, a prompt of at least max_model_len tokens, a prompt the whole KV pool cannot
        hold with one more token, or a request id already in use."""
        self.check_prompt_fits(request.num_prompt_tokens)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_prompt_fits(self, num_prompt: int) -> None:
        """Raises InvalidRequestError for a prompt this scheduler can never run. Reads only settings
        fixed at construction, so any thread may call it."""
        if num_prompt == 0:
            raise InvalidRequestError("The prompt is empty; it must have at least one token.", param="prompt")
        if num_prompt >= self.max_model_len:  # vLLM's words
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{num_prompt} input tokens. Please reduce the length of the input messages.",
                param="input_tokens", code="context_length_exceeded")
        if num_prompt >= self._kv_capacity_tokens:
            raise InvalidRequestError(
                f"The prompt has {num_prompt} tokens but this replica's KV cache holds only "
                f"{self._kv_capacity_tokens}; shorten the prompt to at most {self._kv_capacity_tokens - 1} tokens.",
                param="input_tokens", code="context_length_exceeded")

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a waiting, running or preempted request now and free its blocks. Returns its final
        output (finish_reason "abort") directly, not from a later update: a one-element list, or
        an empty one when the id is unknown or already finished. A chunk of it in a step already
        scheduled is ignored by ``update_from_output``."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return []
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.times.finished = time.monotonic()
        return [_request_output(request, [], [])]

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Requests preempted here are in ``preempted`` (and back in the
        waiting queue); their blocks may already be given to requests of this same step."""
        kv = self.kv_cache_manager
        output = self.last_output = SchedulerOutput()
        running_per_key = Counter(r.fairness_key for r in self.running) if self.waiting else Counter()
        self._preempt_for_a_new_key(running_per_key, output.preempted)
        num_preempted_for_fairness = len(output.preempted)
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new_tokens, output.preempted):
                break  # it was the newest itself, so the rest of the running queue is gone too
            output.chunks.append(ScheduledChunk(request, num_new_tokens, kv.block_ids(request)))
            if num_new_tokens == 1 and request.output_token_ids:
                output.num_decode_tokens += 1
            budget -= num_new_tokens
            index += 1
        short_of_blocks = len(output.preempted) > num_preempted_for_fairness

        # Admit no one in a step that had to preempt for blocks: they are short.
        while self.waiting and not short_of_blocks and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_to_admit(running_per_key)
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_computed_tokens, budget)
            if kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                break
            self.waiting.remove(request)
            running_per_key[request.fairness_key] += 1
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:  # its first admission (not a return after preemption)
                request.num_cached_tokens = num_computed_tokens
                request.times.first_scheduled = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.chunks.append(ScheduledChunk(request, num_new_tokens, kv.block_ids(request)))
            budget -= num_new_tokens
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply one executed step: advance each chunk's request, cache the blocks it filled,
        append the token sampled for each chunk that samples, and finish requests that hit a stop
        condition (freeing their blocks). Returns one output per request that got a token."""
        outputs = []
        num_finished = 0
        now = time.monotonic()  # when this step's tokens were sampled
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted after this step was scheduled
            if request.request_id in model_runner_output.failed:
                continue  # its sampling failed: the engine aborts it
            gathered = model_runner_output.prompt_logprobs.get(request.request_id)
            if gathered is not None and request.prompt_logprobs is not None:
                first, entries = gathered
                request.prompt_logprobs[first:first + len(entries)] = entries
            request.num_computed_tokens += chunk.num_new_tokens
            self.kv_cache_manager.cache_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            token_id = model_runner_output.sampled_token_ids[request.request_id]
            request.append_output(token_id)
            if request.grammar is not None and not request.grammar.consume_token(token_id):
                log.error("request %s: token %d breaks its structured-output constraint (%s); it stops here",
                          request.request_id, token_id, request.grammar.get_error())
            elif request.dormant_grammar is not None:
                _wake_grammar(request)
            times = request.times
            times.previous_token, times.last_token = times.last_token, now
            if times.first_token is None:
                times.first_token = now
            logprobs = model_runner_output.logprobs.get(request.request_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                times.finished = now
                self._finish(request, status)
                num_finished += 1
            output = _request_output(request, [token_id], [logprobs] if logprobs else [])
            if request.prompt_logprobs is not None:  # complete with the prompt: delivered with the first token
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            outputs.append(output)
        if num_finished:
            self.running = [request for request in self.running if not request.status.is_finished]
        return outputs

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks,
            prefix_cache_queries=kv.prefix_cache_stats.num_queries,
            prefix_cache_hits=kv.prefix_cache_stats.num_hits,
            num_preemptions=self.num_preemptions,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Stop tokens (EOS unless ignore_eos, then stop_token_ids) count only once min_tokens
        outputs exist, and win over the length limits when both hold for the same token. A request
        with a structured-output constraint stops as soon as the constraint is complete (nothing
        may follow), and also if its matcher refuses the token (which its mask never lets happen)."""
        params = request.sampling_params
        if request.grammar is not None and request.grammar.is_stopped():  # also true in its error state
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                if token_id != request.primary_eos_token_id:  # generation_config.json's: a stop token
                    request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_id_set:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self._max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, preempted: list[Request]) -> bool:
        """Allocate slots for a running request, preempting the newest running requests until
        they fit. False when the request had to preempt itself."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _next_to_admit(self, running_per_key: Counter) -> Request:
        """The waiting request whose fairness key has the fewest running requests; the earliest of
        those (the queue's head is a preempted request, or the oldest). With a key per request
        (the default) that is always the head: first come, first served."""
        best, best_count = self.waiting[0], running_per_key[self.waiting[0].fairness_key]
        for request in self.waiting:
            if best_count == 0:
                break
            count = running_per_key[request.fairness_key]
            if count < best_count:
                best, best_count = request, count
        return best

    def _preempt_for_a_new_key(self, running_per_key: Counter, preempted: list[Request]) -> None:
        """When the running batch is full and a request waits whose key has nothing running, preempt
        the newest running request of the key that has the most (if it has two or more), so the
        newcomer starts in this step instead of after a whole generation: one request of many
        (an n x prompts fan-out) cannot hold every seat while another caller waits. At most one
        per step; never with a key per request (no key then holds two)."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        largest, count = running_per_key.most_common(1)[0]
        if count < 2 or all(running_per_key[r.fairness_key] for r in self.waiting):
            return
        victim = next(r for r in reversed(self.running) if r.fairness_key == largest)
        self.running.remove(victim)
        self._preempt(victim)
        preempted.append(victim)
        running_per_key[largest] -= 1

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def _request_output(
    request: Request, new_token_ids: list[int], logprobs: list[SampledLogprobs]
) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        logprobs=logprobs,
        finish_reason=request.status.value if request.status.is_finished else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        stop_token_id=request.stop_token_id,
        times=request.times.copy(),
    )


def _wake_grammar(request: Request) -> None:
    """The constraint that starts after some tokens applies from the token after the output ends with them."""
    starts_after = request.sampling_params.structured_output.starts_after
    if tuple(request.output_token_ids[-len(starts_after):]) == starts_after:
        request.grammar, request.dormant_grammar = request.dormant_grammar, None
