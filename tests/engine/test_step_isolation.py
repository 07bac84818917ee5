"""A failing engine step fails only the request(s) at fault (EngineCore.step re-runs the step's
chunks in halves to find them): the others get the very tokens a run without the culprit gives,
whether the forward pass or the sampler raised, and after KV was already written; a failure no
request can be blamed for fails that step's requests and no others; the engine serves on and every
KV block comes back. Driven through `EngineCore` directly, and through `AsyncEngine` for the batch
of 8 beside a poisoned request."""

import asyncio

import pytest

from services.common.errors import InvalidRequestError
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def core(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=16, num_kv_blocks=128,
                                   enforce_eager=True))


@pytest.fixture
def clean_core(core):
    """The shared core, checked to have no request and no used KV block left after the test."""
    assert core.stats().num_kv_blocks_used == 0
    yield core
    assert not core.has_unfinished_requests()
    assert core.stats().num_kv_blocks_used == 0, "KV blocks leaked"
    assert not core.take_failures()


def params(i: int, **overrides) -> SamplingParams:
    """Even rows greedy, odd rows seeded sampling: both must be reproducible beside a culprit."""
    sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.9, seed=100 + i)
    return SamplingParams(**{**sampling, "max_tokens": NUM_TOKENS, "ignore_eos": True, **overrides})


def prompt(i: int) -> list[int]:
    return [5 + i, 9, 13, 17 + 3 * i, 21]


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Runs the requests to the end; returns (tokens per request id, failures per request id)."""
    for request_id, (prompt_ids, sampling) in requests.items():
        core.add_request(request_id, prompt_ids, sampling)
    tokens = {request_id: [] for request_id in requests}
    failures = {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        failures.update(core.take_failures())
    return tokens, failures


def eight() -> dict:
    return {f"ok-{i}": (prompt(i), params(i)) for i in range(8)}


@pytest.fixture(scope="module")
def clean_tokens(core):
    tokens, failures = run(core, eight())
    assert not failures and all(len(t) == NUM_TOKENS for t in tokens.values())
    return tokens


def poison_forward(monkeypatch, core, culprit: str = "poison", after_writing_kv: bool = True) -> list[int]:
    """Every forward pass whose batch holds ``culprit`` raises, after writing the batch's K/V when
    ``after_writing_kv``; returns the sizes of the batches that ran, failed or not."""
    compute_logits = core.model_runner.compute_logits
    batch_sizes = []

    def failing(scheduler_output):
        batch_sizes.append(len(scheduler_output.chunks))
        poisoned = any(chunk.request.request_id == culprit for chunk in scheduler_output.chunks)
        if poisoned and not after_writing_kv:
            raise RuntimeError("illegal memory access")
        result = compute_logits(scheduler_output)
        if poisoned:
            raise RuntimeError("illegal memory access")
        return result

    monkeypatch.setattr(core.model_runner, "compute_logits", failing)
    return batch_sizes


def test_a_forward_pass_that_fails_for_one_request_fails_it_alone(clean_core, clean_tokens, monkeypatch):
    batch_sizes = poison_forward(monkeypatch, clean_core)
    requests = eight()
    requests["poison"] = (prompt(9), params(9))
    tokens, failures = run(clean_core, requests)
    assert list(failures) == ["poison"] and tokens.pop("poison") == []
    assert isinstance(failures["poison"], RuntimeError) and "illegal memory access" in str(failures["poison"])
    assert tokens == clean_tokens, "the others' tokens must not depend on the culprit (KV written twice)"
    assert batch_sizes[:5] == [9, 4, 5, 2, 3], "halves, recursively, down to the culprit"


def test_a_sampler_failure_after_the_draws_leaves_seeded_neighbours_unchanged(clean_core, clean_tokens, monkeypatch):
    sampler = clean_core.model_runner.sampler
    logprobs = sampler._logprobs

    def failing(raw_logprobs, tokens, params_list):  # after every row's noise was drawn
        if any(p.logprobs == 7 for p in params_list):
            raise IndexError("index 4096 is out of bounds for dimension 1 with size 4096")
        return logprobs(raw_logprobs, tokens, params_list)

    monkeypatch.setattr(sampler, "_logprobs", failing)
    requests = eight()
    requests["poison"] = (prompt(9), params(9, logprobs=7))
    tokens, failures = run(clean_core, requests)
    assert list(failures) == ["poison"] and "IndexError" in str(failures["poison"])
    del tokens["poison"]
    assert tokens == clean_tokens


def test_a_request_past_validation_with_a_stop_id_outside_the_vocabulary_fails_alone(clean_core, clean_tokens):
    """The issue's report: with min_tokens >= 1 the stop id is masked in the logits, which raised
    inside the step for the whole batch. Added past `validate` here, as a gap in validation would."""
    bad = Request("bad", prompt(9), SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=(10 ** 6,)),
                  eos_token_ids=clean_core.eos_token_ids)
    clean_core.scheduler.add_request(bad)
    tokens, failures = run(clean_core, eight())
    assert list(failures) == ["bad"] and "out of bounds" in str(failures["bad"])
    assert tokens == clean_tokens


def test_an_invalid_request_error_raised_in_the_step_reaches_the_caller_as_it_is(clean_core, monkeypatch):
    draw = clean_core.model_runner.sampler._draw

    def refusing(logits, requests):
        if any(r.request_id == "bad" for r in requests):
            raise InvalidRequestError("this grammar cannot be compiled")
        return draw(logits, requests)

    monkeypatch.setattr(clean_core.model_runner.sampler, "_draw", refusing)
    tokens, failures = run(clean_core, {"bad": (prompt(1), params(0)), "good": (prompt(2), params(2))})
    assert type(failures["bad"]) is InvalidRequestError and str(failures["bad"]) == "this grammar cannot be compiled"
    assert list(failures) == ["bad"] and len(tokens["good"]) == NUM_TOKENS


def test_a_failure_of_every_request_fails_that_step_only_and_the_engine_serves_on(default_model_dir, monkeypatch):
    """4 requests run (max_num_seqs 4) when every forward pass fails for one step: those 4 fail with
    the step's error, the 4 still waiting then run to the end."""
    core = EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=4, num_kv_blocks=64, enforce_eager=True))
    compute_logits = core.model_runner.compute_logits
    steps = []

    def failing_on_step_3(scheduler_output):
        if len(steps) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return compute_logits(scheduler_output)

    monkeypatch.setattr(core.model_runner, "compute_logits", failing_on_step_3)
    step = core.step
    monkeypatch.setattr(core, "step", lambda: (steps.append(1), step())[1])
    tokens, failures = run(core, eight())
    assert sorted(failures) == [f"ok-{i}" for i in range(4)]
    assert all("an engine step failed" in str(error) and "illegal memory access" in str(error)
               for error in failures.values())
    assert all(len(tokens[f"ok-{i}"]) == NUM_TOKENS for i in range(4, 8))
    assert core.stats().num_kv_blocks_used == 0


def test_a_scheduler_failure_fails_the_running_requests_and_the_one_being_admitted(clean_core, monkeypatch):
    schedule = clean_core.scheduler.schedule
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("a scheduler bug")
        return schedule()

    monkeypatch.setattr(clean_core.scheduler, "schedule", failing_once)
    clean_core.add_request("first", prompt(1), params(0))
    clean_core.step()
    clean_core.add_request("second", prompt(2), params(2))
    clean_core.add_request("third", prompt(3), params(4))
    clean_core.step()  # admits "second" and "third"
    clean_core.add_request("later-1", prompt(4), params(6))
    clean_core.add_request("later-2", prompt(5), params(8))
    assert clean_core.step() == []
    failures = clean_core.take_failures()
    assert sorted(failures) == ["first", "later-1", "second", "third"]
    assert all("KeyError" in str(error) for error in failures.values())
    tokens, more_failures = run(clean_core, {})
    assert not more_failures and len(tokens["later-2"]) == NUM_TOKENS


def test_a_poisoned_request_beside_8_through_the_async_engine(clean_core, clean_tokens, monkeypatch):
    poison_forward(monkeypatch, clean_core)
    engine = AsyncEngine(clean_core)
    engine.start()

    async def collect(request_id: str, prompt_ids: list[int], sampling: SamplingParams):
        tokens = []
        try:
            async for output in engine.generate(request_id, prompt_ids, sampling):
                tokens += output.new_token_ids
        except Exception as error:  # noqa: BLE001 (what that request's caller sees)
            return error
        return tokens

    async def batch():
        requests = eight()
        requests["poison"] = (prompt(9), params(9))
        results = await asyncio.gather(*(collect(rid, *request) for rid, request in requests.items()))
        after = await collect("after", prompt(3), params(0))
        return dict(zip(requests, results)), after

    try:
        results, after = asyncio.run(batch())
    finally:
        engine.shutdown()
    poisoned = results.pop("poison")
    assert isinstance(poisoned, RuntimeError) and "this request failed in the engine" in str(poisoned)
    assert results == clean_tokens
    assert len(after) == NUM_TOKENS
