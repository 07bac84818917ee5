"""`strata up --autoscale --min-replicas 1 --max-replicas 3` under a ramp (low → high → low) driven
by `strata bench serve --request-rate-schedule`: the replicas rise to at least 2 while requests wait
and return to 1 after the load ends; no request fails; no request reaches a replica before it is
SERVING (one that did would fail there and show as a router failover); no scale action happens
while a scale-up is still warming; the replica count over time is in the bench's result and plot."""

import json
import re
import subprocess
import sys
import time
import urllib.request
from datetime import datetime

from services.launcher import Stack, StackConfig, find_free_port

SCHEDULE = "2:4,24:5,1:4,0:8"  # requests/s : seconds; the pause shows the scale-down


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def scale_events(log_text: str) -> list[tuple[float, str, str]]:
    """(time, kind, text) of the autoscaler's scale actions and of replicas becoming healthy."""
    events = []
    for line in log_text.splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)", line)
        if not match:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        text = match.group(2)
        if text.startswith("scale "):
            events.append((at, "scale", text))
        elif re.match(r"replica engine-\d+ healthy", text):
            events.append((at, "healthy", text))
    return events


def test_autoscaling_follows_a_ramp_without_failing_a_request(default_model_dir, tmp_path):
    router_metrics_port = find_free_port()
    config = StackConfig(
        model=str(default_model_dir), port=find_free_port(), autoscale=True, min_replicas=1, max_replicas=3,
        # The queue is the signal here: unbounded, not refused (--max-waiting-requests' default is 4 x the
        # batch). One sequence at a time and 96 tokens each keep a replica under ~15 requests/s even where a
        # decode step takes 0.7 ms, so the ramp's 24/s builds a queue on any machine (with 4 sequences and
        # 48 tokens a fast one kept up alone and never scaled).
        engine_args=["--num-kv-blocks", "256", "--max-num-seqs", "1", "--enforce-eager", "--max-waiting-requests", "-1"],
        autoscaler_args=["--interval", "0.5", "--cooldown", "2", "--scale-down-stabilization", "6",
                         "--target-waiting", "2"],
        router_args=["--metrics-port", str(router_metrics_port)],
        log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=120, grace_s=10)
    with Stack(config) as stack:
        assert scrape(stack.autoscaler_metrics_url)["strata:autoscaler_current_replicas"] == 1
        bench = subprocess.run(
            [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", stack.base_url,
             "--model", stack.model_name, "--random-input-len", "32", "--random-output-len", "96",
             "--ignore-eos",  # a random model's EOS as a first token is a stream without tokens: a failure
             "--request-rate-schedule", SCHEDULE, "--timeline-metrics-url", stack.autoscaler_metrics_url,
             "--timeline-interval", "0.5", "--save-result", "--result-dir", str(tmp_path),
             "--result-filename", "ramp.json"],
            capture_output=True, text=True, timeout=240)
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        load_ended = time.monotonic()
        while scrape(stack.autoscaler_metrics_url)["strata:autoscaler_current_replicas"] != 1:
            assert time.monotonic() - load_ended < 60, "the fleet did not shrink back to 1 after the load"
            time.sleep(0.5)
        router = scrape(f"http://127.0.0.1:{router_metrics_port}/metrics")
        autoscaler_log = (tmp_path / "logs" / "autoscaler.log").read_text()

    run = json.loads((tmp_path / "ramp.json").read_text())["runs"][0]
    assert run["metrics"]["completed"] > 0 and run["metrics"]["failed"] == 0, run["metrics"]
    timeline = run["timeline"]
    assert max(sample["current_replicas"] or 0 for sample in timeline) >= 2, "never scaled up"
    assert list(tmp_path.glob("*timeline*.png")), "no timeline plot"
    failovers = {k: v for k, v in router.items() if k.startswith("strata:router_failovers_total")}
    assert not any(failovers.values()), f"requests reached replicas that were not serving: {failovers}"
    # No scale action while a scale-up is warming: after "scale up a -> b", the next action comes only
    # once b - a replicas have become healthy.
    events = scale_events(autoscaler_log)
    assert any(kind == "scale" and "scale up" in text for _, kind, text in events), autoscaler_log[-2000:]
    waiting_for = 0
    for _, kind, text in events:
        if kind == "healthy":
            waiting_for = max(0, waiting_for - 1)
        elif text.startswith("scale up"):
            assert waiting_for == 0, f"scaled while a scale-up was warming: {text}\n{autoscaler_log[-3000:]}"
            before, after = map(int, re.search(r"(\d+) -> (\d+)", text).groups())
            waiting_for = after - before
        else:
            assert waiting_for == 0, f"scaled while a scale-up was warming: {text}"
