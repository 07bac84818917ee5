"""The bound on waiting work per engine: --max-waiting-requests (default 4 x --max-num-seqs, -1
unbounded) beyond a full running batch, refused at once with RESOURCE_EXHAUSTED."""

import argparse
import asyncio

import pytest

from services.common.errors import ResourceExhaustedError
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_args import add_engine_args, config_from_args
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams
from tests.waiting import until


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(["--model", "unused", *argv]))


@pytest.mark.parametrize("argv, expected", [
    ((), 4 * 64),
    (("--max-num-seqs", "8"), 32),
    (("--max-waiting-requests", "0"), 0),
    (("--max-waiting-requests", "-1"), -1),
])
def test_the_default_bound_follows_max_num_seqs(argv, expected):
    assert parse(*argv).max_waiting_requests == expected


def test_a_bound_below_minus_1_is_refused_with_what_to_do():
    with pytest.raises(SystemExit, match="--max-waiting-requests must be >= 0"):
        parse("--max-waiting-requests", "-2")


@pytest.mark.parametrize("max_waiting_requests", [0, 3, -1])
def test_generate_is_refused_at_once_past_the_bound_and_admitted_again_below_it(default_model_dir,
                                                                             max_waiting_requests):
    core = EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=2, num_kv_blocks=64,
                                   enforce_eager=True, max_waiting_requests=max_waiting_requests))
    engine = AsyncEngine(core)
    engine.start()
    num_admitted = 2 + max_waiting_requests if max_waiting_requests >= 0 else 12

    async def first_output(request_id: str, stream):
        return request_id, await anext(stream)

    async def run():
        streams = [engine.generate(f"long-{i}", [3, 4, i], SamplingParams(max_tokens=500, ignore_eos=True))
                   for i in range(num_admitted)]
        started = await asyncio.gather(*(first_output(f"long-{i}", s) for i, s in enumerate(streams[:2])))
        assert [request_id for request_id, _ in started] == ["long-0", "long-1"]
        queued = [asyncio.ensure_future(anext(s)) for s in streams[2:]]
        await until(lambda: engine.num_active_requests == num_admitted, what=f"{num_admitted} requests admitted")
        extra = engine.generate("one-too-many", [3, 4], SamplingParams(max_tokens=2))
        try:
            refused = await asyncio.wait_for(anext(extra), timeout=0.5)
        except (ResourceExhaustedError, TimeoutError) as error:  # TimeoutError: admitted, it waits its turn
            refused = error
        await streams[0].aclose()  # one leaves: there is room again
        retry = engine.generate("retry", [3, 4], SamplingParams(max_tokens=2))
        try:
            retried = await asyncio.wait_for(anext(retry), timeout=0.5)
        except (ResourceExhaustedError, TimeoutError) as error:  # TimeoutError: admitted, it waits its turn
            retried = error
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        for stream in streams[1:]:
            await stream.aclose()
        return refused, retried

    try:
        refused, retried = asyncio.run(run())
    finally:
        engine.shutdown()
    if max_waiting_requests == -1:
        assert isinstance(refused, TimeoutError)
    else:
        assert isinstance(refused, ResourceExhaustedError)
        assert "at capacity" in str(refused) and "--max-waiting-requests" in str(refused)
    assert not isinstance(retried, ResourceExhaustedError)
    assert core.stats().num_kv_blocks_used == 0
