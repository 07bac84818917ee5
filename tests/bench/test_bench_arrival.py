import asyncio
import math
import time

import numpy as np
import pytest

from services.bench.client import RequestSettings, open_session
from services.bench.datasets import DatasetSpec, sample_requests
from services.bench.runner import RunPlan, arrival_offsets, error_counts, send_all


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_have_the_asked_rate_and_burstiness(burstiness):
    offsets = arrival_offsets(20000, 10.0, burstiness, np.random.default_rng(0))
    assert len(offsets) == 20000 and offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # a gamma of shape k has squared coefficient of variation 1/k (1 for Poisson)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / burstiness, rel=0.08)


def test_plan_rejects_nonsense():
    for kwargs in ({"request_rate": 0}, {"burstiness": 0}, {"max_concurrency": 0}, {"max_duration": -1}):
        with pytest.raises(ValueError):
            RunPlan(**kwargs)


def run(base_url, plan, num_requests, output_len=4):
    requests = sample_requests(DatasetSpec(input_len=4, output_len=output_len), num_requests, seed=0)
    settings = RequestSettings(url=f"{base_url}/v1/completions", model="m", chat=False)

    async def go():
        async with open_session(30) as session:
            return await send_all(session, settings, requests, plan)

    started = time.perf_counter()
    outputs, duration = asyncio.run(go())
    return outputs, duration, time.perf_counter() - started


def test_poisson_run_sends_every_request_then_stops(start_server):
    base_url, state = start_server()
    plan = RunPlan(request_rate=50.0, burstiness=1.0, seed=3)
    outputs, duration, _ = run(base_url, plan, 25)
    assert state.num_requests == 25
    assert sum(o.success for o in outputs) == 25
    last_send = arrival_offsets(25, 50.0, 1.0, np.random.default_rng(3))[-1]
    assert duration >= last_send


def test_max_duration_drops_unsent_requests(start_server):
    base_url, state = start_server()
    outputs, duration, wall = run(base_url, RunPlan(request_rate=5.0, max_duration=0.6, seed=0), 200)
    assert wall < 3.0 and duration == pytest.approx(0.6, abs=0.3)
    assert 1 <= state.num_requests < 20
    assert sum(o.success for o in outputs) == state.num_requests
    assert sum(o.cancelled for o in outputs) == 200 - state.num_requests
    assert error_counts(outputs) == {}  # cancelled is not failed


def test_max_duration_cancels_requests_in_flight(start_server):
    base_url, state = start_server(token_delay_s=0.05)  # 100 tokens take 5 s
    outputs, _, wall = run(base_url, RunPlan(max_concurrency=2, max_duration=0.5), 6, output_len=100)
    assert wall < 3.0
    assert state.num_requests == 2  # only the two slots ever sent
    assert all(o.cancelled and not o.success for o in outputs)


def test_streams_are_read_after_the_run_or_past_the_unread_cap(start_server, monkeypatch):
    from services.bench import runner
    base_url, _ = start_server()
    requests = sample_requests(DatasetSpec(input_len=4, output_len=5), 6, seed=0)
    settings = RequestSettings(url=f"{base_url}/v1/completions", model="m", chat=False)
    seen_during_run = []

    async def go(**kwargs):
        async with open_session(30) as session:
            return await send_all(session, settings, requests, RunPlan(max_concurrency=2),
                                  on_done=lambda: seen_during_run.append(None), **kwargs)

    outputs, _ = asyncio.run(go(settle=False))
    assert all(o.unread is not None and not o.success for o in outputs)  # kept as they came
    runner.settle_all(outputs)
    assert all(o.unread is None and o.success and o.output_tokens == 5 for o in outputs)

    monkeypatch.setattr(runner, "MAX_UNREAD_BYTES", 1)  # every finished stream is read at once
    read_at_once = []
    monkeypatch.setattr(runner, "settle_all", lambda outs, real=runner.settle_all: (
        read_at_once.append(sum(o.unread is not None for o in outs)), real(outs)))
    outputs, _ = asyncio.run(go(settle=False))
    assert read_at_once == [1] * 6 and all(o.success and o.output_tokens == 5 for o in outputs)


def test_a_stream_that_cannot_be_read_fails_its_request_not_the_run():
    from services.bench.client import _Unread
    from services.bench.http_stream import RecordedEvents
    from services.bench.runner import settle_all
    from services.bench.stats import RequestOutput

    def streamed(*pieces: bytes) -> RequestOutput:
        events = RecordedEvents()
        for k, piece in enumerate(pieces):
            events.add(piece, 1.0 + k)
        return RequestOutput(latency=3.0, unread=_Unread(0.5, events))

    good = streamed(b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
    odd = streamed(b'data: {"choices": ["not a choice"]}\n\n')
    settle_all([good, odd])
    assert good.success and good.ttft == 0.5 and good.itl == [1.0] and good.output_tokens == 2
    assert not odd.success and odd.error.startswith("client error: AttributeError")
