"""The engine's periodic stats line (services.engine.stats_logger), as vLLM prints it: throughput,
running/waiting, KV cache usage and prefix cache hit rate while there is traffic, one line more once it
stops, then silence."""

from services.engine.request import RequestTimes
from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput
from services.engine.stats_logger import StatsLogger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stats(running=0, waiting=0, used=0, queries=0, hits=0) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, num_kv_blocks_used=used, num_kv_blocks_total=200,
                          prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=0)


def output(num_new: int, num_output: int, num_prompt: int = 100) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=[1] * num_new, logprobs=[], finish_reason=None,
                         num_prompt_tokens=num_prompt, num_output_tokens=num_output, num_cached_tokens=0,
                         times=RequestTimes(arrival=0.0))


def test_the_line_under_traffic_then_one_more_then_silence():
    clock = Clock()
    logger = StatsLogger("engine-0", clock=clock)
    assert logger.log_stats(stats()) is None  # idle from the start: nothing
    logger.observe_step([output(1, 1), output(1, 1, num_prompt=50)])  # two first tokens: 150 prompt tokens
    logger.observe_step([output(1, 2), output(1, 2)])
    clock.now = 10.0
    line = logger.log_stats(stats(running=2, waiting=1, used=50, queries=160, hits=40))
    assert line == ("Engine engine-0: Avg prompt throughput: 15.0 tokens/s, Avg generation throughput: 0.4 tokens/s, "
                    "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    clock.now = 20.0
    line = logger.log_stats(stats(queries=160, hits=40))  # traffic stopped: the line that says so
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in line
    assert line.endswith("Prefix cache hit rate: 25.0%")  # no lookups since: the rate over all of them
    clock.now = 30.0
    assert logger.log_stats(stats(queries=160, hits=40)) is None


def test_the_hit_rate_is_over_the_interval_and_waiting_requests_count_as_traffic():
    clock = Clock()
    logger = StatsLogger("e", clock=clock)
    clock.now = 10.0
    assert "Prefix cache hit rate: 0.0%" in logger.log_stats(stats(waiting=3, queries=100, hits=0))
    clock.now = 20.0
    assert "Prefix cache hit rate: 100.0%" in logger.log_stats(stats(waiting=3, queries=200, hits=100))
