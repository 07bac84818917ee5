import math

import pytest

from services.bench.stats import RequestOutput, compute_metrics, count_good, parse_goodput, summarize


def known_outputs() -> list[RequestOutput]:
    return [
        RequestOutput(success=True, ttft=0.1, latency=1.0, itl=[0.1] * 9, prompt_tokens=5, output_tokens=10),
        RequestOutput(success=True, ttft=0.2, latency=0.5, itl=[0.1] * 3, prompt_tokens=7, output_tokens=4),
        RequestOutput(success=True, ttft=0.3, latency=0.3, itl=[], prompt_tokens=3, output_tokens=1),
        RequestOutput(success=False, error="HTTP 500: boom", prompt_tokens=9),
        RequestOutput(cancelled=True, error="stopped by --max-duration"),
    ]


def test_summarize_exact():
    s = summarize([1.0, 2.0, 3.0, 4.0], [50, 90, 99.9])
    assert s["mean"] == 2.5 and s["median"] == 2.5
    assert s["std"] == pytest.approx(math.sqrt(1.25))
    assert s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7)  # linear: index 2.7 -> 3 + 0.7
    assert s["p99.9"] == pytest.approx(3.997)


def test_summarize_empty_is_zero():
    assert summarize([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_compute_metrics_exact():
    m = compute_metrics(known_outputs(), duration_s=2.0, percentiles=[90, 99])
    assert (m["completed"], m["failed"], m["cancelled"]) == (3, 1, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (15, 15)
    assert m["request_throughput"] == 1.5
    assert m["output_throughput"] == 7.5
    assert m["total_token_throughput"] == 15.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT leaves out the one-token request: (1.0-0.1)/9 and (0.5-0.2)/3, both 100 ms
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["std_tpot_ms"] == pytest.approx(0.0, abs=1e-9)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    assert m["median_e2el_ms"] == pytest.approx(500.0)
    assert m["p90_e2el_ms"] == pytest.approx(900.0)
    assert "request_goodput" not in m
    assert "total_cached_input_tokens" not in m  # no server said


def test_cached_input_tokens_sum_what_the_completed_requests_reported():
    outputs = known_outputs()
    outputs[0].cached_tokens, outputs[1].cached_tokens = 4, 0
    outputs[3].cached_tokens = 8  # failed: not counted
    assert compute_metrics(outputs, duration_s=2.0, percentiles=[99])["total_cached_input_tokens"] == 4


def test_goodput_counts_requests_meeting_every_slo():
    outputs = known_outputs()
    assert count_good(outputs, {"ttft": 250}) == 2
    # the one-token request has TPOT 0, so it alone meets tpot:50
    assert count_good(outputs, {"ttft": 350, "tpot": 50}) == 1
    assert count_good(outputs, {"e2el": 500}) == 2
    m = compute_metrics(outputs, duration_s=2.0, percentiles=[99], goodput_slos_ms={"ttft": 250})
    assert m["request_goodput"] == 1.0


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
