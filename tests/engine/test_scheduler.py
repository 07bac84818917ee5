"""Exact tests of the scheduler, driven by a fake model that returns chosen token ids through the
real ModelRunnerOutput interface. block_size 4 throughout."""

import random

import pytest

from services.common.errors import InvalidRequestError
from services.engine.config import EngineConfig
from services.engine.kv_events import BlocksStored, RecordingKvEventSink
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerStats
from services.engine.scheduler_output import ModelRunnerOutput, SampledLogprobs

EOS = 2


class FakeModel:
    """Samples, for each chunk that samples, the request's scripted token at its output position
    (``default`` past the end of the script), so a recomputed request draws the same tokens."""

    def __init__(self, scripts=None, default=1):
        self.scripts = scripts or {}
        self.default = default

    def execute(self, scheduler_output):
        sampled = {}
        for chunk in scheduler_output.chunks:
            if chunk.samples:
                script = self.scripts.get(chunk.request.request_id, [])
                position = chunk.request.num_output_tokens
                sampled[chunk.request.request_id] = script[position] if position < len(script) else self.default
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make_scheduler(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                   enable_prefix_caching=True, event_sink=None):
    config = EngineConfig(model="unused", block_size=4, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, num_kv_blocks=num_blocks, max_model_len=max_model_len, event_sink=event_sink)


def make_request(request_id, num_prompt_tokens=None, token_ids=None, max_tokens=16, eos=(EOS,), **params):
    if token_ids is None:
        base = 100 * (1 + sum(map(ord, request_id)))
        token_ids = list(range(base, base + num_prompt_tokens))
    return Request(request_id, token_ids, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def step(scheduler, model):
    scheduler_output = scheduler.schedule()
    return scheduler_output, scheduler.update_from_output(scheduler_output, model.execute(scheduler_output))


def shape(scheduler_output):
    return [(chunk.request.request_id, chunk.num_new_tokens) for chunk in scheduler_output.chunks]


def run_to_completion(scheduler, model, max_steps=200):
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return finished
        for output in step(scheduler, model)[1]:
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError("requests did not finish")


def assert_all_free(scheduler):
    pool = scheduler.kv_cache_manager.block_pool
    assert scheduler.stats().num_kv_blocks_used == 0
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests


def test_chunked_prefill_splits_exactly_under_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 10, max_tokens=2)
    scheduler.add_request(request)
    model = FakeModel({"a": [7, 8]})
    steps = [step(scheduler, model) for _ in range(4)]
    assert [shape(out) for out, _ in steps] == [[("a", 4)], [("a", 4)], [("a", 2)], [("a", 1)]]
    assert [out.chunks[0].block_ids for out, _ in steps] == [[0], [0, 1], [0, 1, 2], [0, 1, 2]]
    assert [len(outputs) for _, outputs in steps] == [0, 0, 1, 1]
    last = steps[3][1][0]
    assert (last.new_token_ids, last.finish_reason, last.num_output_tokens) == ([8], "length", 2)
    assert request.output_token_ids == [7, 8]
    assert_all_free(scheduler)


def test_one_budget_decodes_first_then_waiting_fcfs():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 6, max_tokens=4))
    model = FakeModel()
    assert shape(step(scheduler, model)[0]) == [("a", 6)]
    scheduler.add_request(make_request("b", 10, max_tokens=3))
    scheduler.add_request(make_request("c", 3, max_tokens=3))
    shapes = [shape(step(scheduler, model)[0]) for _ in range(4)]
    assert shapes == [
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 3), ("c", 3)],
        [("a", 1), ("b", 1), ("c", 1)],  # a finishes here
        [("b", 1), ("c", 1)],  # b and c finish here
    ]
    assert_all_free(scheduler)


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 4, max_tokens=2))
    model = FakeModel()
    assert shape(step(scheduler, model)[0]) == [("a", 4), ("b", 4)]
    assert (scheduler.stats().num_running, scheduler.stats().num_waiting) == (2, 1)
    assert shape(step(scheduler, model)[0]) == [("a", 1), ("b", 1)]  # both finish
    assert shape(step(scheduler, model)[0]) == [("c", 4)]
    run_to_completion(scheduler, model)
    assert_all_free(scheduler)


def test_waiting_head_that_does_not_fit_blocks_later_requests():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", 17, max_tokens=3))  # 5 blocks
    scheduler.add_request(make_request("b", 13, max_tokens=1))  # 4 blocks: does not fit beside a
    scheduler.add_request(make_request("c", 3, max_tokens=1))  # would fit, but b is first
    model = FakeModel()
    assert shape(step(scheduler, model)[0]) == [("a", 17)]
    assert [request.request_id for request in scheduler.waiting] == ["b", "c"]
    assert shape(step(scheduler, model)[0]) == [("a", 1)]
    assert shape(step(scheduler, model)[0]) == [("a", 1)]  # a finishes
    assert shape(step(scheduler, model)[0]) == [("b", 13), ("c", 3)]
    run_to_completion(scheduler, model)
    assert_all_free(scheduler)


def test_preemption_takes_the_newest_and_puts_it_at_the_head_of_waiting():
    scheduler = make_scheduler(num_blocks=6)
    requests = {request_id: make_request(request_id, 7, max_tokens=4) for request_id in "abc"}
    for request in requests.values():
        scheduler.add_request(request)
    model = FakeModel()
    assert shape(step(scheduler, model)[0]) == [("a", 7), ("b", 7), ("c", 7)]  # all 6 blocks
    assert shape(step(scheduler, model)[0]) == [("a", 1), ("b", 1), ("c", 1)]  # 8 tokens: still fits
    scheduler.add_request(make_request("d", 3, max_tokens=1))
    out, _ = step(scheduler, model)  # each needs a third block
    assert shape(out) == [("a", 1), ("b", 1)]
    c = requests["c"]
    assert out.preempted == [c]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.output_token_ids == [1, 1] and c.num_preemptions == 1
    assert [request.request_id for request in scheduler.waiting] == ["c", "d"]
    assert scheduler.kv_cache_manager.block_ids(c) == []
    assert scheduler.stats().num_preemptions == 1
    finished = run_to_completion(scheduler, model)
    assert {request_id: output.num_output_tokens for request_id, output in finished.items()} == {
        "a": 4, "b": 4, "c": 4, "d": 1}
    assert c.output_token_ids == [1, 1, 1, 1]
    assert_all_free(scheduler)


def test_preempted_request_recomputes_prompt_and_output():
    scheduler = make_scheduler(num_blocks=4)
    a = make_request("a", 7, max_tokens=4)
    b = make_request("b", 7, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel({"b": [50, 51, 52, 53]})
    step(scheduler, model)
    step(scheduler, model)
    out, _ = step(scheduler, model)  # a needs a third block: b is preempted
    assert shape(out) == [("a", 1)] and out.preempted == [b]
    assert shape(step(scheduler, model)[0]) == [("a", 1)]  # a finishes; b does not fit until then
    out, outputs = step(scheduler, model)
    # b's first block is still cached; the rest of prompt + output is recomputed and b samples again
    assert shape(out) == [("b", 5)] and b.num_computed_tokens == 9
    assert outputs[0].new_token_ids == [52] and outputs[0].num_output_tokens == 3
    assert outputs[0].num_cached_tokens == 0  # cached tokens are those found at first admission
    assert b.output_token_ids == [50, 51, 52]
    run_to_completion(scheduler, model)
    assert b.output_token_ids == [50, 51, 52, 53]
    assert_all_free(scheduler)


def test_stage_times_follow_the_steps_and_a_preemption_keeps_the_first_schedule():
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=4), make_request("b", 7, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel()
    _, outputs = step(scheduler, model)
    times = b.times
    first_scheduled, first_token = times.first_scheduled, times.first_token
    assert times.arrival <= first_scheduled <= first_token == times.last_token
    assert [output.times.inter_token_s for output in outputs] == [None, None]
    _, outputs = step(scheduler, model)
    assert [output.times.inter_token_s >= 0 for output in outputs] == [True, True]
    assert outputs[1].times is not times and outputs[1].times == times  # a copy, as of the output
    out, _ = step(scheduler, model)
    assert out.preempted == [b]
    finished = run_to_completion(scheduler, model)
    assert (times.first_scheduled, times.first_token) == (first_scheduled, first_token)
    assert finished["b"].times.finished == times.finished >= times.last_token >= times.previous_token
    assert finished["a"].times.finished <= times.previous_token  # b waited, preempted, until a finished
    assert times.decode_s == times.finished - first_token and times.queue_s == first_scheduled - times.arrival
    assert_all_free(scheduler)


def test_preempted_request_without_prefix_caching_recomputes_everything():
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a, b = make_request("a", 7, max_tokens=4), make_request("b", 7, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel()
    for _ in range(4):
        step(scheduler, model)
    out, _ = step(scheduler, model)
    assert shape(out) == [("b", 9)]
    run_to_completion(scheduler, model)
    assert scheduler.stats().prefix_cache_queries == 0
    assert_all_free(scheduler)


def test_a_step_that_preempts_admits_no_one():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=3, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    scheduler.add_request(make_request("b", 7, max_tokens=8))
    model = FakeModel()
    steps = [step(scheduler, model)[0] for _ in range(6)]
    assert [shape(out) for out in steps] == [
        [("a", 3)], [("a", 3)], [("a", 1), ("b", 2)], [("a", 1), ("b", 2)],
        [("a", 1)],  # b preempted: its first chunk would fit the block left over, but not this step
        [("a", 1), ("b", 2)],
    ]
    assert [request.request_id for request in steps[4].preempted] == ["b"]
    run_to_completion(scheduler, model)
    assert_all_free(scheduler)


@pytest.mark.parametrize("target, num_steps, status", [
    ("b", 1, RequestStatus.WAITING),
    ("a", 1, RequestStatus.RUNNING),  # 4 of its 7 prompt tokens computed
    ("a", 3, RequestStatus.RUNNING),  # decoding
    ("b", 4, RequestStatus.PREEMPTED),
])
def test_abort_at_any_moment_frees_everything(target, num_steps, status):
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    scheduler.add_request(make_request("b", 7, max_tokens=8))
    model = FakeModel()
    for _ in range(num_steps):
        step(scheduler, model)
    request = scheduler.requests[target]
    assert request.status == status
    (output,) = scheduler.abort_request(target)
    assert output.finish_reason == "abort" and output.new_token_ids == []
    assert output.num_output_tokens == request.num_output_tokens
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.abort_request(target) == []
    assert scheduler.kv_cache_manager.block_ids(request) == []
    finished = run_to_completion(scheduler, model)
    assert target not in finished
    assert_all_free(scheduler)


def test_abort_between_schedule_and_update_ignores_the_chunk():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5, max_tokens=1))
    model = FakeModel()
    scheduler_output = scheduler.schedule()
    scheduler.abort_request("a")
    outputs = scheduler.update_from_output(scheduler_output, model.execute(scheduler_output))
    assert [output.request_id for output in outputs] == ["b"]
    assert_all_free(scheduler)


def test_abort_unknown_request_returns_nothing():
    assert make_scheduler().abort_request("nope") == []


@pytest.mark.parametrize("params, script, expected", [
    ({}, [5, EOS, 7], ([5, EOS], "stop", None)),
    ({"stop_token_ids": (9,)}, [5, 9, 7], ([5, 9], "stop", 9)),
    ({"min_tokens": 3}, [EOS, EOS, EOS, EOS], ([EOS, EOS, EOS], "stop", None)),
    ({"min_tokens": 2, "stop_token_ids": (9,)}, [9, 9, 9], ([9, 9], "stop", 9)),
    ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS, EOS], ([EOS, EOS, EOS], "length", None)),
    ({"ignore_eos": True, "stop_token_ids": (9,)}, [EOS, 9], ([EOS, 9], "stop", 9)),
    ({"max_tokens": 3}, [5, 6, 7, 8], ([5, 6, 7], "length", None)),
    ({"max_tokens": 2}, [5, EOS], ([5, EOS], "stop", None)),  # a stop token wins on the last token
    ({"eos": (EOS, 11)}, [5, 11, 7], ([5, 11], "stop", 11)),  # generation_config.json's extra EOS: reported
    ({"eos": (EOS, 11), "ignore_eos": True, "max_tokens": 3}, [11, EOS, 11], ([11, EOS, 11], "length", None)),
])
def test_stop_conditions(params, script, expected):
    scheduler = make_scheduler()
    request = make_request("a", 5, **{"max_tokens": 16, **params})
    scheduler.add_request(request)
    finished = run_to_completion(scheduler, FakeModel({"a": script}))
    output = finished["a"]
    assert (request.output_token_ids, output.finish_reason, output.stop_token_id) == expected
    assert output.num_output_tokens == len(expected[0])
    assert_all_free(scheduler)


def test_max_model_len_stops_with_length():
    scheduler = make_scheduler(max_model_len=12)
    request = make_request("a", 10, max_tokens=16)
    scheduler.add_request(request)
    assert run_to_completion(scheduler, FakeModel())["a"].finish_reason == "length"
    assert request.num_tokens == 12
    assert_all_free(scheduler)


def test_a_sequence_that_fills_the_whole_pool_stops_with_length():
    scheduler = make_scheduler(num_blocks=3, max_model_len=64)
    request = make_request("a", 10, max_tokens=16)
    scheduler.add_request(request)
    assert run_to_completion(scheduler, FakeModel())["a"].finish_reason == "length"
    assert request.num_tokens == 12
    assert_all_free(scheduler)


@pytest.mark.parametrize("num_prompt_tokens, message", [
    (0, "empty"),
    (32, "maximum context length is 32"),
    (40, "maximum context length is 32"),
])
def test_prompt_that_can_never_run_is_rejected(num_prompt_tokens, message):
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(InvalidRequestError, match=message):
        scheduler.add_request(make_request("a", num_prompt_tokens))
    assert not scheduler.waiting and not scheduler.requests


def test_prompt_longer_than_the_kv_pool_is_rejected():
    scheduler = make_scheduler(num_blocks=2, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="KV cache holds only 8"):
        scheduler.add_request(make_request("a", 8))  # 8 + 1 tokens need 3 blocks
    scheduler.add_request(make_request("b", 7, max_tokens=4))
    assert run_to_completion(scheduler, FakeModel())["b"].num_output_tokens == 1  # the pool is full
    assert_all_free(scheduler)


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("a", 4))


def test_prefix_cache_hit_skips_cached_tokens_and_is_reported():
    sink = RecordingKvEventSink()
    scheduler = make_scheduler(event_sink=sink)
    prompt = list(range(10, 19))
    scheduler.add_request(make_request("a", token_ids=prompt, max_tokens=1))
    run_to_completion(scheduler, FakeModel())
    assert [type(event) for event in sink.events] == [BlocksStored]
    assert len(sink.events[0].block_hashes) == 2
    scheduler.add_request(make_request("b", token_ids=prompt, max_tokens=1))
    out, outputs = step(scheduler, FakeModel())
    assert shape(out) == [("b", 1)] and out.chunks[0].block_ids == [0, 1, 3]
    assert outputs[0].num_cached_tokens == 8 and outputs[0].finish_reason == "length"
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert_all_free(scheduler)


def test_logprobs_are_passed_through():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=1, logprobs=1))
    scheduler_output = scheduler.schedule()
    logprobs = SampledLogprobs(token_id=4, logprob=-0.5, rank=1, top=[(4, -0.5)])
    outputs = scheduler.update_from_output(
        scheduler_output, ModelRunnerOutput(sampled_token_ids={"a": 4}, logprobs={"a": logprobs}))
    assert outputs[0].logprobs == [logprobs] and outputs[0].new_token_ids == [4]


def test_stats_snapshot():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    step(scheduler, FakeModel())
    stats = scheduler.stats()
    assert stats == SchedulerStats(num_running=1, num_waiting=1, num_kv_blocks_used=2, num_kv_blocks_total=8,
                                   prefix_cache_queries=5, prefix_cache_hits=0, num_preemptions=0)
    assert stats.kv_cache_usage == 0.25


def test_random_workload_keeps_invariants_and_leaks_nothing():
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=10, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=32)
    pool = scheduler.kv_cache_manager.block_pool
    model = FakeModel(default=EOS + 1)
    shared_prefix = list(range(500, 508))
    for i in range(30):
        prompt = (shared_prefix if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        scheduler.add_request(make_request(f"r{i}", token_ids=prompt, max_tokens=rng.randrange(1, 12)))
        out, _ = step(scheduler, model)
        if i % 7 == 3 and scheduler.requests:
            scheduler.abort_request(rng.choice(sorted(scheduler.requests)))
        assert out.num_batched_tokens <= 8 and len(scheduler.running) <= 3
        holders = [block_id for request in scheduler.running
                   for block_id in scheduler.kv_cache_manager.block_ids(request)]
        assert all(block.ref_cnt == holders.count(block.block_id) for block in pool.blocks)
    run_to_completion(scheduler, model)
    assert scheduler.stats().num_preemptions > 0 and scheduler.stats().prefix_cache_hits > 0
    assert_all_free(scheduler)
