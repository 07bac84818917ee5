"""A real Prometheus (Debian's package) scrapes `strata up --replicas 2` at the /metrics URLs the
stack lists: every engine, the router and the gateway are up as targets, each engine's own series
carry its instance, and no counter of an engine or the router goes backwards while one engine is
paused and resumed (SIGSTOP/SIGCONT) under traffic."""

import json
import os
import shutil
import signal
import urllib.parse
import urllib.request

import openai
import pytest

from services.launcher import Stack, StackConfig, find_free_port
from tests.processes import ServiceProcess
from tests.waiting import wait_until


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
        prometheus = f"http://127.0.0.1:{port}"

        def all_up() -> bool:
            try:
                up = query(prometheus, "up")
            except OSError:  # not listening yet
                return False
            return len(up) == len(jobs) and all(r["value"][1] == "1" for r in up)

        with ServiceProcess("prometheus", [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                           f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                           f"--web.listen-address=127.0.0.1:{port}"],
                            tmp_path / "prometheus.log", grace_s=20) as process:
            process.wait_until(all_up, what="scraping every target")
            yield stack, prometheus


def value(result: list[dict]) -> float:
    """The one sample of an instant query's result (0 when there is none)."""
    return float(result[0]["value"][1]) if result else 0.0


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
            wait_until(lambda: value(query(prometheus, 'up{job="engine-1"}')) == 0,
                       what="Prometheus seeing the paused engine down")  # its scrapes fail meanwhile
            some_requests(4)  # the router finds the other replica
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        some_requests(6)
    wait_until(lambda: value(query(prometheus, "sum(strata:router_requests_total)")) >= 16
               and value(query(prometheus, 'sum(strata:generation_tokens_total{job=~"engine-.*"})')) >= 16 * 4,
               what="the last requests scraped")
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
