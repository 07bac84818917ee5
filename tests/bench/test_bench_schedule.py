"""`--request-rate-schedule` and the fleet timeline: parsing, arrivals, the timeline's figures, and
`strata bench serve` end to end against the real streaming test server with a `/metrics`."""

import json
import math
import threading

import numpy as np
import pytest

from services.bench.__main__ import main as bench_main
from services.bench.results import load_result
from services.bench.schedule import RateSchedule
from services.bench.stats import RequestOutput
from services.bench.timeline import build_timeline, server_columns

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CURRENT = "strata:autoscaler_current_replicas"


def test_parse_a_schedule():
    schedule = RateSchedule.parse(" 2:60, 20:120 ,0.5:7.5,0:30")
    assert [(s.rate, s.duration_s) for s in schedule.segments] == [(2, 60), (20, 120), (0.5, 7.5), (0, 30)]
    assert str(schedule) == "2:60,20:120,0.5:7.5,0:30"
    assert schedule.total_duration_s == 217.5 and schedule.starts_s == [0.0, 60.0, 180.0, 187.5]
    assert [schedule.rate_at(t) for t in (0, 59.9, 60, 180, 187.5, 217.5, -1)] == [2, 2, 20, 0.5, 0, 0, 0]
    assert [schedule.segment_index(t) for t in (0, 60, 217.4, 217.5)] == [0, 1, 3, None]


@pytest.mark.parametrize("text, message", [
    ("", "expected RATE:SECONDS"), ("5", "expected RATE:SECONDS"), ("2:60,", "expected RATE:SECONDS"),
    ("a:1", "expected RATE:SECONDS"), ("2:60:1", "expected RATE:SECONDS"),
    ("inf:10", "inf is not allowed"), ("nan:10", "finite"), ("-1:10", ">= 0"),
    ("2:0", "must be > 0"), ("2:-5", "must be > 0"), ("2:inf", "must be > 0"), ("0:10,0:5", "send nothing"),
])
def test_schedule_errors_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        RateSchedule.parse(text)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_follow_each_segments_rate(burstiness):
    schedule = RateSchedule.parse("50:20,200:10,0:5,10:30")
    offsets = schedule.arrival_offsets(burstiness, np.random.default_rng(7))
    assert np.all(np.diff(offsets) >= 0) and offsets[0] >= 0 and offsets[-1] < schedule.total_duration_s
    assert np.array_equal(offsets, schedule.arrival_offsets(burstiness, np.random.default_rng(7)))
    counts = np.histogram(offsets, bins=[0, 20, 30, 35, 65])[0]
    for count, expected in zip(counts, (1000, 2000, 0, 300)):
        # a renewal process with gamma(k) gaps: count variance ~ mean / k
        assert abs(count - expected) <= 4 * math.sqrt(expected / burstiness), (counts, burstiness)
    inside = offsets[(offsets >= 20) & (offsets < 30)]
    assert np.diff(inside).mean() == pytest.approx(1 / 200, rel=0.1)


def _done(sent_s, ttft_s, latency_s, success=True, cancelled=False):
    """A request sent at sent_s; done latency_s later."""
    return RequestOutput(success=success, cancelled=cancelled, ttft=ttft_s, latency=latency_s, output_tokens=4,
                         sent_s=sent_s, done_s=None if sent_s is None else sent_s + latency_s)


def test_timeline_rows_are_the_client_state_at_each_sample():
    outputs = [_done(0.1, 0.2, 0.5),    # first token 0.3, done 0.6
               _done(0.2, 0.6, 1.4),    # first token 0.8, done 1.6
               _done(0.9, 0.0, 0.3, success=False),  # failed at 1.2
               _done(1.1, 0.1, 0.2),    # first token 1.2, done 1.3
               _done(None, 0.0, 0.0, success=False, cancelled=True)]  # never sent
    servers = [(0.0, {"current_replicas": 1}), (1.0, {"current_replicas": 2}), (2.0, {"current_replicas": None})]
    rows = build_timeline(servers, outputs, lambda t: 10.0 if t < 1.5 else 0.0)
    client = [{k: row[k] for k in ("num_sent", "num_in_flight", "num_completed", "num_failed")} for row in rows]
    assert client == [{"num_sent": 0, "num_in_flight": 0, "num_completed": 0, "num_failed": 0},
                      {"num_sent": 3, "num_in_flight": 2, "num_completed": 1, "num_failed": 0},
                      {"num_sent": 4, "num_in_flight": 0, "num_completed": 3, "num_failed": 1}]
    assert [(row["ttft_p50_ms"], row["ttft_max_ms"]) for row in rows] == [(None, None), (400.0, 600.0),
                                                                          (100.0, 100.0)]
    assert [row["current_replicas"] for row in rows] == [1, 2, None]
    assert [row["target_rate"] for row in rows] == [10.0, 10.0, 0.0]
    assert [row["elapsed_s"] for row in rows] == [0.0, 1.0, 2.0]


def test_server_columns_sum_series_and_prefer_the_autoscalers_waiting_count():
    engines = {'strata:num_requests_waiting{engine="0"}': ("gauge", 2.0),
               'strata:num_requests_waiting{engine="1"}': ("gauge", 3.0)}
    autoscaler = {CURRENT: ("gauge", 2.0), "strata:autoscaler_desired_replicas": ("gauge", 4.0),
                  "strata:autoscaler_num_requests_waiting": ("gauge", 9.0)}
    assert server_columns([engines, None]) == {"current_replicas": None, "desired_replicas": None,
                                               "ready_replicas": None, "num_requests_waiting": 5}
    assert server_columns([engines, autoscaler]) == {"current_replicas": 2, "desired_replicas": 4,
                                                     "ready_replicas": None, "num_requests_waiting": 9}
    assert server_columns([None, None]) == dict.fromkeys(
        ("current_replicas", "desired_replicas", "ready_replicas", "num_requests_waiting"))


def serve(base_url, tmp_path, *extra):
    return bench_main(["serve", "--base-url", base_url, "--save-result", "--result-dir", str(tmp_path),
                       "--disable-tqdm", "--random-input-len", "6", "--random-output-len", "4", *extra])


@pytest.mark.slow  # a timed run of seconds
def test_schedule_run_records_the_fleet_scaling_mid_run(start_server, tmp_path, capsys):
    base_url, state = start_server(metrics=True)
    state.gauges.update({CURRENT: 1, 'strata:num_requests_waiting{engine="0"}': 2,
                         'strata:num_requests_waiting{engine="1"}': 3})
    scale_up = threading.Timer(1.0, state.gauges.__setitem__, (CURRENT, 3))
    scale_up.start()
    try:
        rc = serve(base_url, tmp_path, "--request-rate-schedule", "20:1,5:1", "--timeline-interval", "0.1",
                   "--seed", "5", "--result-filename", "ramp.json")
    finally:
        scale_up.cancel()
    assert rc == 0

    expected = len(RateSchedule.parse("20:1,5:1").arrival_offsets(1.0, np.random.default_rng(5)))
    result = load_result(tmp_path / "ramp.json")
    assert result.config["request_rate_schedule"] == [{"rate": 20.0, "duration_s": 1.0},
                                                      {"rate": 5.0, "duration_s": 1.0}]
    run = result.runs[0]
    assert run.label == "schedule=20:1,5:1" and run.params["request_rate_schedule"] == "20:1,5:1"
    assert state.num_requests == run.params["num_prompts"] == run.metrics["completed"] == expected
    assert run.metrics["duration"] >= 2.0  # the schedule runs to its end

    timeline = run.timeline
    assert len(timeline) >= 10 and timeline[0]["elapsed_s"] < 0.05 and timeline[-1]["elapsed_s"] >= 2.0
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(timeline, timeline[1:]))
    replicas = [row["current_replicas"] for row in timeline]
    assert replicas[0] == 1 and replicas[-1] == 3 and replicas == sorted(replicas)
    assert {row["num_requests_waiting"] for row in timeline} == {5}  # summed over the engines' series
    assert [row["target_rate"] for row in timeline if row["elapsed_s"] < 1.0] == [20.0] * sum(
        row["elapsed_s"] < 1.0 for row in timeline)
    assert timeline[-1]["num_completed"] == expected and timeline[-1]["num_in_flight"] == 0
    assert sum(row["ttft_p50_ms"] is not None for row in timeline) >= 3

    first, second = run.segments
    assert (first["rate"], first["start_s"], first["end_s"]) == (20.0, 0.0, 1.0)
    assert first["num_sent"] + second["num_sent"] == expected and first["num_sent"] > second["num_sent"]
    assert first["min_replicas"] == 1 and second["max_replicas"] == 3
    assert first["num_failed"] == second["num_failed"] == 0 and first["median_ttft_ms"] > 0

    out = capsys.readouterr().out
    assert "Schedule segments" in out and "Request rate schedule (RPS:s):           20:1,5:1" in out
    data = (tmp_path / "ramp_timeline.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20000
    assert json.loads((tmp_path / "ramp.json").read_text())["runs"][0]["timeline"][0]["elapsed_s"] < 0.05


@pytest.mark.slow  # a timed run of seconds
def test_timeline_without_a_schedule_skips_an_unreachable_metrics_url(start_server, tmp_path):
    base_url, state = start_server()
    rc = serve(base_url, tmp_path, "--num-prompts", "6", "--request-rate", "30", "--timeline-interval", "0.05",
               "--timeline-metrics-url", "http://127.0.0.1:9/metrics", "--result-filename", "plain.json")
    assert rc == 0 and state.num_requests == 6
    run = load_result(tmp_path / "plain.json").runs[0]
    assert run.segments is None and len(run.timeline) >= 2
    assert {row["current_replicas"] for row in run.timeline} == {None}
    assert {row["target_rate"] for row in run.timeline} == {30.0}
    assert run.timeline[-1]["num_completed"] == 6
    assert (tmp_path / "plain_timeline.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow  # a timed run of seconds
def test_without_the_flags_there_is_no_timeline(start_server, tmp_path):
    base_url, state = start_server(metrics=True)
    state.gauges[CURRENT] = 2
    assert serve(base_url, tmp_path, "--num-prompts", "3", "--result-filename", "old.json") == 0
    run = load_result(tmp_path / "old.json").runs[0]
    assert run.timeline is None and run.segments is None and run.params["request_rate"] == "inf"
    assert state.num_scrapes == 2  # before and after, as ever
    assert not list(tmp_path.glob("*timeline*"))


@pytest.mark.parametrize("extra, message", [
    (["--request-rate-schedule", "5:1", "--request-rate", "2"], "leave out --request-rate"),
    (["--request-rate-schedule", "50:2", "--num-prompts", "10"], "more than --num-prompts 10"),
    (["--request-rate-schedule", "0.001:1"], "generates no request"),
    (["--timeline-metrics-url", ","], "--timeline-metrics-url is empty"),
    (["--request-rate-schedule", "5:1", "--timeline-interval", "0"], "--timeline-interval 0"),
])
def test_inconsistent_flags_are_a_clean_error(extra, message, capsys):
    # the port is never reached: the flags are checked first
    assert bench_main(["serve", "--base-url", "http://127.0.0.1:9", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_schedule_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["serve", "--request-rate-schedule", "inf:10"])
    assert exit_info.value.code == 2 and "inf is not allowed in a schedule" in capsys.readouterr().err
