"""One large request must not starve others. Exact scheduler tests (the fake model of
test_scheduler.py, block_size 4): a long prompt's chunked prefill never stalls running decodes;
without fairness keys admission is first come, first served; with them, the key with the fewest
running requests is admitted first, and a fan-out filling the whole batch gives a seat to a new
caller within one step (preempting its own newest request, recomputed later with the same tokens).
Then the same on the real engine, counted in steps: a small request's time to first token next
to a queued fan-out of 64."""

import pytest

from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from tests.engine.test_scheduler import FakeModel, assert_all_free, make_scheduler, run_to_completion, shape, step


def keyed(request_id: str, key: str, num_prompt_tokens: int = 3, max_tokens: int = 8) -> Request:
    base = 100 * (1 + sum(map(ord, request_id)))
    return Request(request_id, list(range(base, base + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), fairness_key=key)


def test_decodes_get_a_token_every_step_while_a_long_prompt_is_prefilled_in_chunks():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)
    for request_id in "ab":
        scheduler.add_request(keyed(request_id, "", max_tokens=20))
    model = FakeModel()
    step(scheduler, model)  # both prompts
    scheduler.add_request(keyed("long", "", num_prompt_tokens=100, max_tokens=2))
    scheduler.add_request(keyed("c", "", max_tokens=2))
    shapes = [shape(step(scheduler, model)[0]) for _ in range(8)]
    assert shapes == [[("a", 1), ("b", 1), ("long", 14)]] * 7 + [[("a", 1), ("b", 1), ("long", 2), ("c", 3)]]
    run_to_completion(scheduler, model)
    assert_all_free(scheduler)


def test_without_keys_admission_is_first_come_first_served():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(6):
        scheduler.add_request(keyed(f"fan-{i}", "", max_tokens=3))
    scheduler.add_request(keyed("small", "", max_tokens=3))
    model = FakeModel()
    admitted = []
    while scheduler.has_unfinished_requests:
        out, _ = step(scheduler, model)
        assert not out.preempted
        admitted += [c.request.request_id for c in out.chunks if c.num_new_tokens > 1]  # prompts
    assert admitted == [f"fan-{i}" for i in range(6)] + ["small"]
    assert_all_free(scheduler)


def test_admission_takes_the_key_with_the_fewest_running_requests_first():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=3)
    for i in range(4):
        scheduler.add_request(keyed(f"a-{i}", "A", max_tokens=2))
    for i in range(2):
        scheduler.add_request(keyed(f"b-{i}", "B", max_tokens=2))
    model = FakeModel()
    out, _ = step(scheduler, model)
    assert shape(out) == [("a-0", 3), ("b-0", 3), ("a-1", 3)]  # B's first before A's second
    step(scheduler, model)  # all three finish
    out, _ = step(scheduler, model)
    assert shape(out) == [("a-2", 3), ("b-1", 3), ("a-3", 3)]
    run_to_completion(scheduler, model)
    assert_all_free(scheduler)


def test_a_fan_out_filling_the_batch_gives_a_new_caller_a_seat_within_one_step():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4)
    fan_out = [keyed(f"fan-{i}", "big-call", max_tokens=10) for i in range(12)]
    for request in fan_out:
        scheduler.add_request(request)
    scripts = {r.request_id: [10 + i for i in range(10)] for r in fan_out}
    model = FakeModel(scripts)
    step(scheduler, model)
    step(scheduler, model)
    scheduler.add_request(keyed("small", "other-call", max_tokens=2))
    out, outputs = step(scheduler, model)
    assert [r.request_id for r in out.preempted] == ["fan-3"]  # the newest of the key holding every seat
    assert shape(out) == [("fan-0", 1), ("fan-1", 1), ("fan-2", 1), ("small", 3)]
    assert [o.request_id for o in outputs if o.new_token_ids][-1] == "small"  # its first token, now
    assert [r.request_id for r in scheduler.waiting][:2] == ["fan-3", "fan-4"]  # first in line again
    for _ in range(3):  # the new caller has its seat: no more preemption
        assert not step(scheduler, model)[0].preempted
    finished = run_to_completion(scheduler, model)
    assert {request_id for request_id in finished} | {"fan-0", "fan-1", "fan-2"} >= {r.request_id for r in fan_out}
    assert all(r.output_token_ids == scripts[r.request_id] for r in fan_out), "recomputed with the same tokens"
    assert_all_free(scheduler)


def test_no_preemption_for_fairness_while_no_key_holds_two_seats():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    scheduler.add_request(keyed("a", "A", max_tokens=5))
    scheduler.add_request(keyed("b", "B", max_tokens=5))
    model = FakeModel()
    step(scheduler, model)
    scheduler.add_request(keyed("c", "C", max_tokens=5))
    for _ in range(4):
        out, _ = step(scheduler, model)
        assert not out.preempted and shape(out) == [("a", 1), ("b", 1)]
    run_to_completion(scheduler, model)
    assert_all_free(scheduler)


@pytest.fixture(scope="module")
def core(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=8, num_kv_blocks=256,
                                   max_num_batched_tokens=256, enforce_eager=True))


@pytest.mark.parametrize("fan_out_key", ["call-1", ""], ids=["one-key", "no-keys"])
def test_a_small_request_next_to_a_queued_fan_out_of_64(core, fan_out_key):
    """8 seats. With the fan-out's 64 requests sharing a key, the small request's first token
    comes in the step after it arrives; without keys (first come, first served) only once all 64
    have finished: the rest of the first wave of 8, then 7 more waves of 8 steps."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(64):
        core.add_request(f"fan-{i}", [5 + i % 50, 6, 7, 8], params, fairness_key=fan_out_key)
    core.step()
    core.add_request("small", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=2), fairness_key="call-2")
    steps_to_first_token = None
    num_tokens = {}
    num_steps = 0
    while core.has_unfinished_requests():
        num_steps += 1
        for output in core.step():
            num_tokens[output.request_id] = output.num_output_tokens
            if output.request_id == "small" and steps_to_first_token is None:
                steps_to_first_token = num_steps
    assert not core.take_failures()
    assert all(num_tokens[f"fan-{i}"] == 8 for i in range(64)) and num_tokens["small"] == 2
    assert steps_to_first_token == (1 if fan_out_key else 7 + 7 * 8 + 1)
    assert core.stats().num_kv_blocks_used == 0
