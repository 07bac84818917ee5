"""Step spans (`--trace-steps`, issue #12 item 2): a real engine with two seats serves three requests
queued before its loop starts, so the steps are fixed: each step's span is a root linked to the
engine spans of exactly the requests it computed, and its token split adds up to what each request
computed (its prompt, then one decode per token after the first)."""

import asyncio
import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from services.engine.server import EngineServicer
from services.engine.step_tracing import STEP_SPAN_NAME, StepTracer
from tests.waiting import until

from .traced_generate import generate_in_a_span

MAX_TOKENS = {"a": 4, "b": 7, "c": 5}  # arrival order; c waits for a's seat
PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11], "c": [12, 13, 14, 15, 16]}


@pytest.fixture(scope="module")
def core(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=2, num_kv_blocks=32,
                                   enforce_eager=True, enable_prefix_caching=False))


def test_each_step_span_links_to_the_requests_it_served(core):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    step_tracer = StepTracer(1.0, "engine-7", tracer=tracer)
    engine = AsyncEngine(core, step_tracer=step_tracer)
    servicer = EngineServicer(core.config, "m")
    servicer.engine, servicer.accepting = engine, True

    async def consume(request_id):
        return await generate_in_a_span(servicer, tracer, request_id, PROMPTS[request_id], MAX_TOKENS[request_id])

    async def run():
        tasks = [asyncio.create_task(consume(request_id)) for request_id in MAX_TOKENS]
        await until(lambda: engine.num_active_requests == len(tasks), what="every request arrived", poll_s=0.001)
        engine.start()
        await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    spans = exporter.get_finished_spans()
    requests = {s.attributes["strata.engine_request_id"]: s for s in spans if s.name != STEP_SPAN_NAME}
    steps = sorted((s for s in spans if s.name == STEP_SPAN_NAME), key=lambda s: s.start_time)
    by_span_id = {s.context.span_id: request_id for request_id, s in requests.items()}
    computed = {request_id: [] for request_id in MAX_TOKENS}  # per request, its tokens in each step it was in
    for step in steps:
        attributes = step.attributes
        assert step.parent is None and step.kind is SpanKind.INTERNAL  # a trace of its own, linked
        assert step.context.trace_id not in {s.context.trace_id for s in requests.values()}
        assert attributes["strata.replica_id"] == "engine-7"
        assert attributes["strata.step.batch_size"] == len(step.links) <= 2
        num_new = [link.attributes["strata.step.num_new_tokens"] for link in step.links]
        num_computed = attributes["strata.step.num_prefill_tokens"] + attributes["strata.step.num_decode_tokens"]
        assert num_computed == sum(num_new)
        assert attributes["strata.step.num_decode_tokens"] == num_new.count(1)  # tiny prompts: one chunk each
        assert attributes["strata.step.time_s"] == pytest.approx((step.end_time - step.start_time) / 1e9, abs=1e-6)
        assert attributes["strata.step.num_preemptions"] == 0
        for link in step.links:
            request_id = by_span_id[link.context.span_id]
            assert link.context.trace_id == requests[request_id].context.trace_id
            assert link.attributes["strata.engine_request_id"] == request_id
            computed[request_id].append(link.attributes["strata.step.num_new_tokens"])
    for request_id, tokens in computed.items():  # its prompt in one step, then a decode per later token
        assert tokens == [len(PROMPTS[request_id])] + [1] * (MAX_TOKENS[request_id] - 1), request_id
    assert steps[0].attributes["strata.step.num_waiting"] == 1  # c, until a finishes
    assert sum(s.attributes["strata.step.num_prefill_tokens"] for s in steps) == sum(map(len, PROMPTS.values()))
    assert step_tracer._span_contexts == {}  # every request forgotten once done


def test_steps_are_sampled_at_the_ratio_and_a_ratio_outside_0_1_is_refused():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    step_tracer = StepTracer(0.25, tracer=provider.get_tracer("test"), seed=3)
    request = Request("r", [1, 2, 3], SamplingParams())
    for _ in range(400):
        step_tracer.observe(SchedulerOutput([ScheduledChunk(request, 3, [0])]), 0.001, 0)
    step_tracer.observe(SchedulerOutput(), 0.001, 0)  # a step that ran nothing: no span
    draws = random.Random(3)
    expected = sum(draws.random() < 0.25 for _ in range(400))
    assert len(exporter.get_finished_spans()) == expected and 60 < expected < 140
    assert all(not span.links for span in exporter.get_finished_spans())  # "r" was never registered
    for ratio in (0.0, 1.5):
        with pytest.raises(ValueError, match="--trace-steps-sample"):
            StepTracer(ratio)
