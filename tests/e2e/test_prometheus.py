"""A real Prometheus (Debian's package) scrapes `strata up --replicas 2` at the /metrics URLs the
stack lists: every engine, the router and the gateway are up as targets, each engine's own series
carry its instance, and no counter of an engine or the router goes backwards while one engine is
paused and resumed (SIGSTOP/SIGCONT) under traffic."""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import openai
import pytest

from services.launcher import Stack, StackConfig, find_free_port


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def scraped_stack(default_model_dir, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: scripts/setup.sh installs Debian's prometheus package"
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), replicas=2,
                         engine_args=["--num-kv-blocks", "128", "--max-num-seqs", "4", "--enforce-eager"],
                         log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=120, grace_s=5)
    with Stack(config) as stack:
        jobs = [{"job_name": name, "metrics_path": "/metrics",
                 "static_configs": [{"targets": [url.split("/")[2]]}]} for name, url in stack.metrics_urls.items()]
        (tmp_path / "prometheus.yml").write_text(json.dumps(
            {"global": {"scrape_interval": "250ms"}, "scrape_configs": jobs}))
        port = find_free_port()
        process = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        prometheus = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    up = query(prometheus, "up")
                    if len(up) == len(jobs) and all(r["value"][1] == "1" for r in up):
                        break
                except OSError:
                    pass
                assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"targets not up: {up}"
                time.sleep(0.25)
            yield stack, prometheus
        finally:
            process.terminate()
            process.wait(timeout=20)


def test_every_service_is_scraped_and_no_counter_goes_backwards(scraped_stack):
    stack, prometheus = scraped_stack
    paused = stack.service("engine-1")
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        def some_requests(n: int) -> None:
            for i in range(n):
                client.completions.create(model=stack.model_name, prompt=f"count {i}", max_tokens=4)

        some_requests(6)
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # its scrapes fail meanwhile
            some_requests(4)  # the router finds the other replica
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        some_requests(6)
        time.sleep(1.0)
    generated = query(prometheus, 'strata:generation_tokens_total{job=~"engine-.*"}')
    assert {r["metric"]["job"] for r in generated} == {"engine-0", "engine-1"}
    assert sum(float(r["value"][1]) for r in generated) >= 16 * 4
    routed = query(prometheus, "sum(strata:router_requests_total)")
    assert float(routed[0]["value"][1]) >= 16
    selector = '{__name__=~"strata:.*_total", job=~"engine-.*|router"}'
    counters = {r["metric"]["__name__"] for r in query(prometheus, f"count by (__name__) ({selector})")}
    assert "strata:router_requests_total" in counters and "strata:prompt_tokens_total" in counters
    for name in counters:
        resets = query(prometheus, f'resets({name}{{job=~"engine-.*|router"}}[5m]) > 0')
        assert resets == [], f"{name} went backwards: {resets}"
