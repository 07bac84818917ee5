"""The engine's latency breakdown (issue #12): with one seat (max_num_seqs=1) and three requests in
at once, the later ones wait for the earlier ones, and the wait shows as queue time in the
`strata:request_*_seconds` histograms and on each request's engine span (events `queued`,
`scheduled`, `first_token` at the times they happened). Real engine, real servicer; the
requests are all in before the engine loop starts, so the order of events is fixed and the
checks are relations between the engine's own timestamps, not latencies."""

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.metrics import EngineMetrics
from services.engine.sampling_params import SamplingParams
from services.engine.server import EngineServicer
from tests.waiting import until

from .traced_generate import generate_in_a_span

MAX_TOKENS = {"a": 6, "b": 9, "c": 12}  # arrival order
PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11], "c": [12, 13, 14, 15, 16]}
SLACK_NS = 10**9


@pytest.fixture(scope="module")
def core(default_model_dir):
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=1, num_kv_blocks=32, enforce_eager=True))


def run_all_queued(engine: AsyncEngine, consume) -> dict:
    """Runs ``consume(request_id)`` for every request at once, starts the engine loop only once all
    of them arrived, and returns their results by request id."""

    async def run():
        tasks = {request_id: asyncio.create_task(consume(request_id)) for request_id in MAX_TOKENS}
        await until(lambda: engine.num_active_requests == len(tasks), what="every request arrived", poll_s=0.001)
        engine.start()
        return {request_id: await task for request_id, task in tasks.items()}

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def sample(metrics: EngineMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"strata:{name}", {"model_name": "m", "replica": "engine-0"})


def test_queued_requests_show_their_wait_as_queue_time_and_every_histogram_counts_right(core):
    metrics = EngineMetrics("m", "engine-0")
    engine = AsyncEngine(core, on_step=metrics.observe_step)

    async def consume(request_id):
        params = SamplingParams(max_tokens=MAX_TOKENS[request_id], ignore_eos=True)
        return [output async for output in engine.generate(request_id, PROMPTS[request_id], params)][-1]

    finals = run_all_queued(engine, consume)
    a, b, c = (finals[request_id].times for request_id in MAX_TOKENS)
    assert [finals[request_id].num_output_tokens for request_id in MAX_TOKENS] == list(MAX_TOKENS.values())
    for earlier, later in ((a, b), (b, c)):  # one seat: each starts once the one before it finished
        assert earlier.arrival <= later.arrival < earlier.first_scheduled
        assert later.first_scheduled >= earlier.finished
    assert 0 < a.queue_s < b.queue_s < c.queue_s
    assert b.queue_s >= a.inference_s > 0 and c.queue_s >= a.inference_s + b.inference_s
    for times in (a, b, c):
        assert times.arrival < times.first_scheduled <= times.first_token < times.finished
        assert times.inference_s == pytest.approx(times.prefill_s + times.decode_s)

    for name, values in (("request_queue_time_seconds", [t.queue_s for t in (a, b, c)]),
                         ("request_prefill_time_seconds", [t.prefill_s for t in (a, b, c)]),
                         ("request_decode_time_seconds", [t.decode_s for t in (a, b, c)]),
                         ("request_inference_time_seconds", [t.inference_s for t in (a, b, c)]),
                         ("request_prompt_tokens", [len(p) for p in PROMPTS.values()]),
                         ("request_generation_tokens", list(MAX_TOKENS.values()))):
        assert sample(metrics, f"{name}_count") == 3, name
        assert sample(metrics, f"{name}_sum") == pytest.approx(sum(values)), name
    # one observation per token after each request's first; they add up to its decode time
    assert sample(metrics, "inter_token_latency_seconds_count") == sum(n - 1 for n in MAX_TOKENS.values())
    assert sample(metrics, "inter_token_latency_seconds_sum") == pytest.approx(sum(t.decode_s for t in (a, b, c)))


def test_a_queued_requests_engine_span_has_its_stages_in_order(core):
    engine = AsyncEngine(core)
    servicer = EngineServicer(core.config, "m")
    servicer.engine, servicer.accepting = engine, True
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def consume(request_id):
        return await generate_in_a_span(servicer, tracer, request_id, PROMPTS[request_id], MAX_TOKENS[request_id])

    run_all_queued(engine, consume)
    spans = {span.attributes["strata.engine_request_id"]: span for span in exporter.get_finished_spans()}
    assert set(spans) == set(MAX_TOKENS)
    for request_id, span in spans.items():
        events = {event.name: event.timestamp for event in span.events}
        assert list(events) == ["queued", "scheduled", "first_token"], request_id
        assert events["queued"] < events["scheduled"] <= events["first_token"]
        # wall clock, within the span (give or take a thread switch between the two clock reads)
        assert span.start_time - SLACK_NS <= events["queued"] and events["first_token"] <= span.end_time + SLACK_NS
        attributes = span.attributes
        assert (events["scheduled"] - events["queued"]) / 1e9 == pytest.approx(attributes["strata.queue_time_s"],
                                                                               abs=1e-6)
        assert attributes["strata.inference_time_s"] == pytest.approx(
            attributes["strata.prefill_time_s"] + attributes["strata.decode_time_s"])
    a, b, c = (spans[request_id] for request_id in MAX_TOKENS)
    assert 0 < a.attributes["strata.queue_time_s"] < b.attributes["strata.queue_time_s"] \
        < c.attributes["strata.queue_time_s"]
    scheduled = {request_id: dict((e.name, e.timestamp) for e in span.events)["scheduled"]
                 for request_id, span in spans.items()}
    assert scheduled["a"] < scheduled["b"] < scheduled["c"]
    assert b.attributes["strata.queue_time_s"] >= a.attributes["strata.inference_time_s"]


def test_a_copy_holds_every_field_and_is_its_own():
    from dataclasses import astuple, fields

    from services.engine.request import RequestTimes

    times = RequestTimes(*(float(i + 1) for i in range(len(fields(RequestTimes)))))
    copied = times.copy()
    assert astuple(copied) == astuple(times) and copied is not times
    copied.finished = 99.0
    assert times.finished != 99.0
