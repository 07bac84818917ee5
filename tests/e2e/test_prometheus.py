"""`strata up --replicas 2` as a user runs it, scraped by a real Prometheus (Debian's package) every
0.2 s at the /metrics URLs its banner prints: every service (tokenizer, both engines, router,
gateway) is a target, each engine's series name their replica, no counter of any process goes
backwards while one engine is paused and resumed (SIGSTOP/SIGCONT) under traffic, and a Ctrl-C
(SIGINT to the terminal's whole process group) stops it all with no traceback and no ERROR line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest

from services.launcher import find_free_port
from tests.e2e.conftest import MODEL
from tests.processes import ServiceProcess
from tests.waiting import wait_until

BANNER = re.compile(r"Prometheus /metrics: (.+)")


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def value(result: list[dict]) -> float:
    """The one sample of an instant query's result (0 when there is none)."""
    return float(result[0]["value"][1]) if result else 0.0


def pid_of_child(parent: int, argument: str) -> int:
    """The pid of ``parent``'s child process whose command line has ``argument``."""
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"\nPPid:\t{parent}\n" in status and argument.encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no child of {parent} runs with {argument}")


@pytest.fixture
def strata_up(default_model_dir, tmp_path):
    """`strata up --replicas 2` in a session of its own (as a terminal runs it); yields (process, output
    file, {service: metrics URL} from its banner)."""
    output = tmp_path / "strata-up.txt"
    port = find_free_port()
    with output.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--model", str(default_model_dir), "--served-model-name", MODEL,
             "--port", str(port),
             "--replicas", "2", "--engine-args", "--num-kv-blocks 128 --max-num-seqs 4 --enforce-eager",
             "--startup-timeout", "120", "--grace", "20"],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def banner() -> dict[str, str] | None:
            match = BANNER.search(output.read_text())
            return dict(item.split(" ") for item in match.group(1).split(", ")) if match else None

        def started() -> bool:
            assert process.poll() is None, f"strata up exited:\n{output.read_text()[-3000:]}"
            return banner() is not None

        wait_until(started, timeout_s=180, what="strata up's banner")
        yield process, output, banner(), f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_scraped_every_0_2_s_no_counter_goes_backwards_and_ctrl_c_stops_cleanly(strata_up, tmp_path):
    process, output, metrics_urls, base_url = strata_up
    assert set(metrics_urls) == {"tokenizer", "engine-0", "engine-1", "router", "gateway"}
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: scripts/setup.sh installs Debian's prometheus package"
    jobs = [{"job_name": name, "metrics_path": "/metrics", "static_configs": [{"targets": [url.split("/")[2]]}]}
            for name, url in metrics_urls.items()]
    (tmp_path / "prometheus.yml").write_text(json.dumps(
        {"global": {"scrape_interval": "200ms", "scrape_timeout": "200ms"}, "scrape_configs": jobs}))
    prometheus = f"http://127.0.0.1:{find_free_port()}"

    def all_up() -> bool:
        try:
            up = query(prometheus, "up")
        except OSError:  # not listening yet
            return False
        return len(up) == len(jobs) and all(r["value"][1] == "1" for r in up)

    with ServiceProcess("prometheus", [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                       f"--web.listen-address={prometheus.split('//')[1]}"],
                        tmp_path / "prometheus.log", grace_s=20) as prometheus_process:
        prometheus_process.wait_until(all_up, what="scraping every target")
        paused = pid_of_child(process.pid, "engine-1")
        with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            def some_requests(n: int) -> None:
                for i in range(n):
                    client.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=4)

            some_requests(6)
            os.kill(paused, signal.SIGSTOP)
            try:
                wait_until(lambda: value(query(prometheus, 'up{job="engine-1"}')) == 0,
                           what="Prometheus seeing the paused engine down")  # its scrapes fail meanwhile
                some_requests(4)  # the router finds the other replica
            finally:
                os.kill(paused, signal.SIGCONT)
            some_requests(6)
        wait_until(lambda: value(query(prometheus, "sum(strata:router_requests_total)")) >= 16
                   and value(query(prometheus, 'sum(strata:generation_tokens_total{job=~"engine-.*"})')) >= 16 * 4,
                   what="the last requests scraped")
        generated = query(prometheus, 'strata:generation_tokens_total{job=~"engine-.*"}')
        assert {(r["metric"]["job"], r["metric"]["replica"]) for r in generated} == {("engine-0", "engine-0"),
                                                                                     ("engine-1", "engine-1")}
        assert sum(float(r["value"][1]) for r in generated) >= 16 * 4
        counters = {(r["metric"]["job"], r["metric"]["__name__"])
                    for r in query(prometheus, 'count by (job, __name__) ({__name__=~"strata:.*_total"})')}
        assert {job for job, _ in counters} == set(metrics_urls), counters  # every process has counters
        for job, name in counters:
            resets = query(prometheus, f'resets({name}{{job="{job}"}}[5m]) > 0')
            assert resets == [], f"{job}'s {name} went backwards: {resets}"

    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal: every process of the group gets it
    assert process.wait(timeout=60) == 0
    text = output.read_text()
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b|\[ERR\]", line)]
    assert not errors, "\n".join(errors)
