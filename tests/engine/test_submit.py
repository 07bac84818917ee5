"""`AsyncEngine.submit` (GenerateMany's way in): outputs come to the request's callback on the event
loop as `generate()` would yield them; a callback that raises ends its own request (aborted, its
blocks freed, the exception passed to it) while the other requests of the same steps go on; and
`cancel()` aborts a request, after which nothing more reaches its callback."""

import asyncio

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams


def run_engine(default_model_dir, body):
    core = EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=4, num_kv_blocks=64, enforce_eager=True))
    engine = AsyncEngine(core)
    engine.start()
    try:
        return asyncio.run(asyncio.wait_for(body(engine), timeout=60))
    finally:
        engine.shutdown()


class Collector:
    def __init__(self, fail_on_first: bool = False) -> None:
        self.items: list = []
        self.done = asyncio.get_running_loop().create_future()
        self.fail_on_first = fail_on_first

    def __call__(self, item) -> None:
        self.items.append(item)
        if isinstance(item, BaseException) or item.finished:
            if not self.done.done():
                self.done.set_result(None)
        elif self.fail_on_first and len(self.items) == 1:
            raise RuntimeError("a bug in the callback")


async def wait_idle(engine: AsyncEngine) -> None:
    while engine.num_active_requests or engine.stats.num_running or engine.stats.num_kv_blocks_used:
        await asyncio.sleep(0.01)


def test_a_failing_callback_ends_only_its_own_request(default_model_dir):
    async def body(engine: AsyncEngine):
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
        bad, good = Collector(fail_on_first=True), Collector()
        engine.submit("bad", [3, 4, 5], params, bad)
        engine.submit("good", [3, 4, 6], params, good)
        await asyncio.gather(bad.done, good.done)
        await wait_idle(engine)
        return bad.items, good.items

    bad, good = run_engine(default_model_dir, body)
    assert len(bad) == 2 and isinstance(bad[1], RuntimeError)  # its one output, then the callback's own error
    assert sum(len(o.new_token_ids) for o in good) == 6 and good[-1].finish_reason == "length"


def test_cancel_aborts_and_nothing_more_arrives(default_model_dir):
    async def body(engine: AsyncEngine):
        collector = Collector()
        first = asyncio.get_running_loop().create_future()

        def on_output(item) -> None:
            collector(item)
            if not first.done():
                first.set_result(None)

        submitted = engine.submit("long", [3, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True), on_output)
        await first
        submitted.cancel()
        seen = len(collector.items)
        await wait_idle(engine)
        await asyncio.sleep(0.05)
        return seen, collector.items

    seen, items = run_engine(default_model_dir, body)
    assert len(items) == seen and not any(isinstance(i, BaseException) or i.finished for i in items)
