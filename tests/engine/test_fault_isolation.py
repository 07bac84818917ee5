"""One bad request must not take its batch down (issue: `stop_token_ids` outside the vocabulary with
`min_tokens` raised inside the engine step and failed all 8 running streams with INTERNAL):
every field is validated before the scheduler, a request whose own sampling fails is failed alone
while the 8 beside it complete, a failed step aborts only its own requests, the engine keeps
serving, no KV block leaks, and a full queue refuses new requests at once."""

import asyncio
import math

import pytest

from services.common.errors import InvalidRequestError, ResourceExhaustedError
from services.common.pb import engine_pb2
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.protocol import sampling_params_from_proto
from services.engine.sampling_params import SamplingParams
from tests.waiting import until

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def core(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=16, num_kv_blocks=128,
                                   enforce_eager=True, max_waiting_requests=2))


@pytest.fixture
def engine(core):
    engine = AsyncEngine(core)
    engine.start()
    yield engine
    engine.shutdown()
    assert core.stats().num_kv_blocks_used == 0, "KV blocks leaked"


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], **params) -> list[int] | Exception:
    tokens = []
    try:
        async for output in engine.generate(request_id, prompt, SamplingParams(**params)):
            tokens += output.new_token_ids
    except Exception as error:  # noqa: BLE001 (what the caller of that request sees)
        return error
    return tokens


def batch(engine: AsyncEngine, poisoned: str | None = None) -> dict:
    async def run():
        ids = [f"ok-{i}" for i in range(8)] + ([poisoned] if poisoned else [])
        results = await asyncio.gather(*(collect(engine, rid, [5 + i, 9, 13], max_tokens=MAX_TOKENS, ignore_eos=True)
                                         for i, rid in enumerate(ids)))
        return dict(zip(ids, results))

    return asyncio.run(run())


def test_a_request_whose_sampling_fails_fails_alone(engine, core, monkeypatch):
    draw = core.model_runner.sampler._draw

    def poisoned(logits, requests):
        if any(r.request_id == "poison" for r in requests):
            raise IndexError("index 999999 is out of bounds for dimension 1")
        return draw(logits, requests)

    monkeypatch.setattr(core.model_runner.sampler, "_draw", poisoned)
    results = batch(engine, poisoned="poison")
    assert isinstance(results.pop("poison"), RuntimeError)
    assert all(len(tokens) == MAX_TOKENS for tokens in results.values()), results


def test_a_failed_step_aborts_only_its_requests_and_the_engine_serves_on(engine, core, monkeypatch):
    compute_logits = core.model_runner.compute_logits
    failures = []

    def failing_once(scheduler_output):
        if not failures and any(c.request.request_id == "boom" for c in scheduler_output.chunks):
            failures.append(1)
            raise RuntimeError("device error")
        return compute_logits(scheduler_output)

    monkeypatch.setattr(core.model_runner, "compute_logits", failing_once)

    async def run():
        boom = await collect(engine, "boom", [1, 2, 3], max_tokens=4)
        after = await collect(engine, "after", [1, 2, 3], max_tokens=4, ignore_eos=True)
        return boom, after

    boom, after = asyncio.run(run())
    assert isinstance(boom, RuntimeError) and "device error" in str(boom)
    assert len(after) == 4


@pytest.mark.parametrize("fields, message", [
    (dict(stop=engine_pb2.StopCriteria(max_tokens=4, min_tokens=1, stop_token_ids=[10 ** 6])), "stop_token_ids"),
    (dict(sampling=engine_pb2.SamplingParams(logit_bias={10 ** 6: 1.0})), "logit_bias"),
    (dict(sampling=engine_pb2.SamplingParams(temperature=math.nan)), "temperature"),
    (dict(sampling=engine_pb2.SamplingParams(temperature=math.inf)), "temperature"),
    (dict(sampling=engine_pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(sampling=engine_pb2.SamplingParams(top_p=0)), "top_p"),
    (dict(sampling=engine_pb2.SamplingParams(top_p=math.nan)), "top_p"),
    (dict(sampling=engine_pb2.SamplingParams(top_k=-2)), "top_k"),
    (dict(sampling=engine_pb2.SamplingParams(min_p=1.5)), "min_p"),
    (dict(sampling=engine_pb2.SamplingParams(presence_penalty=3)), "presence_penalty"),
    (dict(sampling=engine_pb2.SamplingParams(frequency_penalty=math.inf)), "frequency_penalty"),
    (dict(sampling=engine_pb2.SamplingParams(repetition_penalty=0)), "repetition_penalty"),
    (dict(sampling=engine_pb2.SamplingParams(logit_bias={3: math.nan})), "logit_bias"),
    (dict(sampling=engine_pb2.SamplingParams(logprobs=10 ** 6)), "logprobs"),
    (dict(stop=engine_pb2.StopCriteria(max_tokens=0)), "max_tokens"),
    (dict(stop=engine_pb2.StopCriteria(max_tokens=4, min_tokens=5)), "min_tokens"),
    (dict(prompt_token_ids=[10 ** 6]), "prompt token id"),
    (dict(prompt_token_ids=[1] * 100_000), "context length"),
])
def test_every_field_is_validated_before_the_scheduler(core, fields, message):
    request = engine_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], stop=engine_pb2.StopCriteria(max_tokens=4))
    for name, value in fields.items():
        if name == "prompt_token_ids":
            del request.prompt_token_ids[:]
            request.prompt_token_ids.extend(value)
        else:
            getattr(request, name).CopyFrom(value)
    with pytest.raises(InvalidRequestError, match=message):
        core.validate(list(request.prompt_token_ids), sampling_params_from_proto(request))


def test_a_tiny_temperature_is_greedy(engine):
    async def run():
        greedy = await collect(engine, "g", [7, 8, 9], max_tokens=8, temperature=0.0, ignore_eos=True)
        tiny = await collect(engine, "t", [7, 8, 9], max_tokens=8, temperature=1e-40, ignore_eos=True)
        return greedy, tiny

    greedy, tiny = asyncio.run(run())
    assert tiny == greedy and len(tiny) == 8


def test_a_full_queue_refuses_new_requests_at_once(engine):
    async def run():
        long = [asyncio.create_task(collect(engine, f"long-{i}", [3, i], max_tokens=200, ignore_eos=True))
                for i in range(engine.max_active)]
        await until(lambda: engine.num_active_requests == engine.max_active, what="the queue full")
        refused = await collect(engine, "one-too-many", [3, 4], max_tokens=2)
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
        return refused

    refused = asyncio.run(run())
    assert isinstance(refused, ResourceExhaustedError) and "capacity" in str(refused)
