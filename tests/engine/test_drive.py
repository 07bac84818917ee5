"""`AsyncEngine.drive()`, the engine loop as the server runs it: on the event loop, short steps on the
loop's own thread and the others on a step thread, while the loop goes on serving; the same tokens
as the loop on a background thread; `shutdown()` ends it and fails what still runs."""

import asyncio
import threading

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.sampling_params import SamplingParams
from services.engine.step_placement import StepPlacement

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]


def new_core(default_model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(default_model_dir), max_num_seqs=4, num_kv_blocks=64, enforce_eager=True))


class StepThreads:
    """Wraps ``core.run`` to record the thread each step ran on (and to run ``during_step`` in it)."""

    def __init__(self, core: EngineCore, during_step=None) -> None:
        self.threads: list[int] = []
        run = core.run

        def recorded(scheduled):
            self.threads.append(threading.get_ident())
            if during_step is not None:
                during_step()
            return run(scheduled)

        core.run = recorded


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    return [token for output in [o async for o in engine.generate(request_id, prompt, GREEDY)]
            for token in output.new_token_ids]


async def drive_and(engine: AsyncEngine, body):
    driving = asyncio.create_task(engine.drive())
    try:
        return await asyncio.wait_for(body(), timeout=60)
    finally:
        engine.shutdown()
        await asyncio.wait_for(driving, timeout=10)


def test_drive_gives_the_tokens_of_the_background_thread(default_model_dir):
    threaded = AsyncEngine(new_core(default_model_dir))
    threaded.start()
    try:
        async def all_threaded():
            return await asyncio.gather(*(collect(threaded, f"t{i}", p) for i, p in enumerate(PROMPTS)))

        expected = asyncio.run(all_threaded())
    finally:
        threaded.shutdown()
    driven = AsyncEngine(new_core(default_model_dir))

    async def all_driven():
        return await drive_and(driven, lambda: asyncio.gather(*(collect(driven, f"d{i}", p) for i, p in enumerate(PROMPTS))))

    assert asyncio.run(all_driven()) == expected
    assert all(len(tokens) == 12 for tokens in expected)


def test_short_steps_run_on_the_loop_thread_and_unknown_ones_off_it(default_model_dir):
    core = new_core(default_model_dir)
    steps = StepThreads(core)
    engine = AsyncEngine(core, placement=StepPlacement(inline_max_s=10.0))

    async def body():
        await collect(engine, "r", PROMPTS[0])
        return threading.get_ident()

    loop_thread = asyncio.run(drive_and(engine, body))
    assert len(steps.threads) == 12
    # the prefill and the first decode step: nothing seen like them yet; the rest: short decode steps
    assert steps.threads[0] != loop_thread and steps.threads[1] != loop_thread
    assert steps.threads[2:] == [loop_thread] * 10


def test_a_steps_output_reaches_its_reader_before_the_next_step(default_model_dir):
    # else each token would go out a step late: at 64 streams, a step of 20-200 ms on each TTFT
    core = new_core(default_model_dir)
    steps = StepThreads(core)
    engine = AsyncEngine(core, placement=StepPlacement(inline_max_s=10.0))

    async def body():
        return [len(steps.threads) async for _ in engine.generate("r", PROMPTS[2], GREEDY)]

    assert asyncio.run(drive_and(engine, body)) == list(range(1, 13))  # the steps begun at each output


def test_the_loop_serves_while_a_long_step_runs(default_model_dir):
    core = new_core(default_model_dir)
    answered = threading.Event()
    waited: list[bool] = []
    loop_holder: list[asyncio.AbstractEventLoop] = []

    def during_step() -> None:  # a step that lasts until the event loop has run a callback meanwhile
        loop_holder[0].call_soon_threadsafe(answered.set)
        waited.append(answered.wait(timeout=5))
        answered.clear()

    steps = StepThreads(core, during_step)
    engine = AsyncEngine(core, placement=StepPlacement(inline_max_s=0.0))  # every step is long

    async def body():
        loop_holder.append(asyncio.get_running_loop())
        return await collect(engine, "r", PROMPTS[1])

    tokens = asyncio.run(drive_and(engine, body))
    assert len(tokens) == 12 and len(steps.threads) == 12
    assert all(waited)  # the loop ran a callback during every step
    assert threading.get_ident() not in steps.threads


def test_shutdown_ends_drive_and_fails_the_running_requests(default_model_dir):
    engine = AsyncEngine(new_core(default_model_dir))

    async def body():
        driving = asyncio.create_task(engine.drive())
        stream = engine.generate("long", [3, 4, 5], SamplingParams(max_tokens=1000, ignore_eos=True))
        await anext(stream)
        engine.shutdown()
        try:
            while True:
                await anext(stream)
        except RuntimeError as error:
            failure = error
        await asyncio.wait_for(driving, timeout=10)
        return failure, engine.core.stats()

    failure, stats = asyncio.run(asyncio.wait_for(body(), timeout=60))
    assert "shutting down" in str(failure)
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0
