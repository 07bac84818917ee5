"""The engine's Prometheus series take in the steps the engine loop queued: at every collection (a
scrape), and by themselves once `MAX_QUEUED_OUTPUTS` outputs wait; none is lost or counted twice
while a scrape runs beside the loop."""

import threading

from services.engine.metrics import MAX_QUEUED_OUTPUTS, EngineMetrics
from services.engine.request import RequestTimes
from services.engine.scheduler import SchedulerStats
from services.engine.scheduler_output import RequestOutput

LABELS = {"model_name": "m", "replica": "engine-0"}


def decode_output(request_id: str, num_output_tokens: int) -> RequestOutput:
    times = RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=0.2, previous_token=0.29, last_token=0.3)
    return RequestOutput(request_id, [7], [], None, num_prompt_tokens=5, num_output_tokens=num_output_tokens,
                         num_cached_tokens=0, times=times)


def stats(num_running: int) -> SchedulerStats:
    return SchedulerStats(num_running=num_running, num_waiting=0, num_kv_blocks_used=3, num_kv_blocks_total=12,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)


def sample(metrics: EngineMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"strata:{name}", LABELS)


def test_a_scrape_sees_every_step_observed_before_it():
    metrics = EngineMetrics("m", "engine-0")
    metrics.observe_step([decode_output("a", 1)], stats(1), 0.01, 1)  # a's first token
    metrics.observe_step([decode_output("a", 2), decode_output("b", 1)], stats(2), 0.02, 2)
    assert sample(metrics, "generation_tokens_total") == 3
    assert sample(metrics, "prompt_tokens_total") == 10  # two first tokens
    assert sample(metrics, "num_requests_running") == 2  # as of the last step
    assert sample(metrics, "kv_cache_usage_perc") == 0.25
    assert sample(metrics, "engine_step_seconds_count") == 2
    assert sample(metrics, "inter_token_latency_seconds_count") == 3


def test_the_loop_catches_up_by_itself_once_enough_outputs_wait():
    metrics = EngineMetrics("m", "engine-0")
    catch_ups = []
    metrics.on_catch_up(lambda: catch_ups.append(1))
    batch = [decode_output(f"r{i}", 2) for i in range(8)]
    for _ in range(MAX_QUEUED_OUTPUTS // len(batch) - 1):
        metrics.observe_step(batch, stats(8), 0.01, 8)
    assert catch_ups == []  # nothing scraped, not enough waiting yet
    metrics.observe_step(batch, stats(8), 0.01, 8)
    assert catch_ups == [1]
    assert sample(metrics, "generation_tokens_total") == MAX_QUEUED_OUTPUTS and catch_ups == [1, 1]


def test_no_step_is_lost_or_counted_twice_while_scrapes_run_beside_the_loop():
    metrics = EngineMetrics("m", "engine-0")
    done = threading.Event()

    def scrape_until_done():
        while not done.is_set():
            sample(metrics, "generation_tokens_total")

    scraper = threading.Thread(target=scrape_until_done)
    scraper.start()
    try:
        for step in range(5000):
            metrics.observe_step([decode_output("a", step + 2), decode_output("b", step + 2)], stats(2), 0.01, 2)
    finally:
        done.set()
        scraper.join()
    assert sample(metrics, "generation_tokens_total") == 10_000
    assert sample(metrics, "engine_step_seconds_count") == 5000


def test_every_series_is_there_at_zero_before_the_first_request():
    """As vLLM makes its request_success series for every finish reason at start: a series that appears
    at its first increment hides that increment from Prometheus' rate() and increase(), and a query
    for a reason not seen yet answers nothing instead of 0."""
    metrics = EngineMetrics("m", "engine-0")
    for reason in ("stop", "length"):
        assert metrics.registry.get_sample_value("strata:request_success_total",
                                                 {**LABELS, "finished_reason": reason}) == 0
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "request_queue_time_seconds_count", "request_prompt_tokens_count"):
        assert sample(metrics, name) == 0, name
