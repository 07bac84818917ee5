"""--stream-interval (as vLLM's): a request's first token goes out at once, then one output per N
tokens, and the finish with whatever is left; the tokens and their logprobs are the same as with
every token streamed. Both ways of taking a request's outputs keep it: iterating `generate()` and
the callback of `submit()` (GenerateMany's)."""

import asyncio

import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams


def stream(default_model_dir, interval: int, max_tokens: int, via: str = "generate"):
    core = EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=2, num_kv_blocks=64,
                                   enforce_eager=True, stream_interval=interval))
    engine = AsyncEngine(core)
    engine.start()

    async def collect():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, logprobs=1)
        if via == "generate":
            return [output async for output in engine.generate("r", [3, 4, 5, 6], params)]
        outputs, late, done = [], [], asyncio.get_running_loop().create_future()

        def on_output(output) -> None:  # an assert here would be caught and logged by the engine: record instead
            if done.done():
                late.append(output)
                return
            if isinstance(output, BaseException):
                done.set_exception(output)
                return
            outputs.append(output)
            if output.finished:
                done.set_result(outputs)

        engine.submit("r", [3, 4, 5, 6], params, on_output)
        await done
        await asyncio.sleep(0.05)
        assert not late, f"outputs after the last: {late}"
        return outputs

    try:
        return asyncio.run(collect())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("via", ["generate", "submit"])
@pytest.mark.parametrize("interval, max_tokens", [(3, 9), (4, 5), (8, 3)])
def test_outputs_carry_the_first_token_then_n_at_a_time_then_the_rest(default_model_dir, interval, max_tokens, via):
    outputs = stream(default_model_dir, interval, max_tokens, via)
    every_token = stream(default_model_dir, 1, max_tokens)
    sizes = [len(o.new_token_ids) for o in outputs if o.new_token_ids]
    # The first output as soon as it is read (one token, or more if the reader fell behind: a consumer
    # that falls behind gets the steps it missed in one output, as always), then at least N at a time.
    assert all(size >= interval for size in sizes[1:-1]) and sum(sizes) == max_tokens
    assert len(sizes) <= 2 + (max_tokens - 1) // interval
    assert outputs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outputs[:-1])
    assert [t for o in outputs for t in o.new_token_ids] == [t for o in every_token for t in o.new_token_ids]
    assert len([lp for o in outputs for lp in o.logprobs]) == max_tokens


def test_an_interval_below_1_is_refused():
    with pytest.raises(ValueError, match="--stream-interval must be >= 1"):
        EngineConfig(model="unused", stream_interval=0)
