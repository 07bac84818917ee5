import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.bench.client import open_session
from services.bench.server_metrics import diff, metrics_url, parse_metrics, scrape


def exposition():
    """A registry exposing vLLM-shaped `strata:` metrics, rendered by prometheus_client itself."""
    registry = CollectorRegistry()
    labels = ["model_name"]
    series = {
        "prompt": Counter("strata:prompt_tokens", "prompt tokens", labels, registry=registry).labels("tiny"),
        "generation": Counter("strata:generation_tokens", "generated tokens", labels, registry=registry).labels("tiny"),
        "preemptions": Counter("strata:num_preemptions", "preemptions", labels, registry=registry).labels("tiny"),
        "running": Gauge("strata:num_requests_running", "running", labels, registry=registry).labels("tiny"),
        "ttft": Histogram("strata:time_to_first_token_seconds", "ttft", labels, registry=registry).labels("tiny"),
    }
    return registry, series


def test_metrics_url_keeps_scheme_host_port():
    assert metrics_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("https://host.example") == "https://host.example/metrics"


def test_deltas_of_changed_counters_and_gauges_after():
    registry, s = exposition()
    s["prompt"].inc(100)
    s["generation"].inc(40)
    s["preemptions"].inc(2)
    s["running"].set(3)
    s["ttft"].observe(0.25)
    before = parse_metrics(generate_latest(registry).decode())
    s["prompt"].inc(60)
    s["generation"].inc(30)
    s["running"].set(0)
    s["ttft"].observe(0.5)
    s["ttft"].observe(1.0)
    after = parse_metrics(generate_latest(registry).decode())
    result = diff(before, after)
    assert result["counters"] == {  # preemptions did not change: left out
        'strata:generation_tokens_total{model_name="tiny"}': 30.0,
        'strata:prompt_tokens_total{model_name="tiny"}': 60.0,
        'strata:time_to_first_token_seconds_count{model_name="tiny"}': 2.0,
        'strata:time_to_first_token_seconds_sum{model_name="tiny"}': 1.5,
    }
    assert result["gauges"] == {'strata:num_requests_running{model_name="tiny"}': 0.0}


def test_untyped_total_is_a_counter_and_a_new_series_counts_from_zero():
    before = parse_metrics("up 1\n")
    after = parse_metrics('up 1\nstrata:prefix_cache_hits_total{model_name="tiny"} 16\n')
    assert diff(before, after) == {"counters": {'strata:prefix_cache_hits_total{model_name="tiny"}': 16.0},
                                   "gauges": {"up": 1.0}}


def test_missing_snapshot_gives_nothing():
    assert diff(None, parse_metrics("up 1\n")) == {}
    assert diff(parse_metrics("up 1\n"), None) == {}


def test_scrape_without_metrics_endpoint_is_none(start_server):
    base_url, _ = start_server()

    async def go():
        async with open_session(30) as session:
            return (await scrape(session, metrics_url(base_url)),
                    await scrape(session, "http://127.0.0.1:9/metrics"))  # nothing listens on port 9

    assert asyncio.run(go()) == (None, None)
