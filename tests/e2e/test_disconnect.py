"""A client that goes away aborts its requests upstream: the engine's Load reports nothing
running and no KV blocks in use within a second, and so do its Prometheus gauges (what KEDA scales on)."""

import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MODEL, engine_load

LONG = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 2000, "temperature": 1.0,
        "ignore_eos": True}


def wait_until_idle(engine, stack, within_s: float = 30.0):
    """The engine has nothing running and no KV blocks in use, and the gateway nothing in flight."""
    deadline = time.monotonic() + within_s
    while True:
        load = engine_load(engine)
        gateway_running = httpx.get(stack.base_url + "/metrics").text.count(
            f'strata:gateway_num_requests_running{{model_name="{MODEL}"}} 0.0')
        if (load.num_running, load.num_waiting, load.num_kv_blocks_used, gateway_running) == (0, 0, 0, 1):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still busy {within_s} s after the disconnect: engine {load}, "
                        f"gateway idle: {bool(gateway_running)}")
        time.sleep(0.05)


def wait_until_running(engine, count: int, within_s: float = 30.0):
    deadline = time.monotonic() + within_s
    while engine_load(engine).num_running < count:
        assert time.monotonic() < deadline, "the requests never started running"
        time.sleep(0.02)


@pytest.fixture
def raw_client(stack):
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_streaming_disconnect_aborts_every_choice(stack, raw_client, engine):
    with raw_client.stream("POST", "/v1/completions", json={**LONG, "stream": True, "n": 3}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        assert engine_load(engine).num_running == 3
    wait_until_idle(engine, stack)


def test_non_streaming_disconnect_aborts(stack, engine):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.base_url + "/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.0),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_until_idle(engine, stack)


def test_disconnect_while_queued_before_first_token(stack, raw_client, engine):
    """Several clients vanish at once, some of them before their first token."""
    clients = [httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"})
               for _ in range(4)]
    streams = [c.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500,
        "ignore_eos": True, "stream": True}) for c in clients]
    responses = [s.__enter__() for s in streams]
    wait_until_running(engine, 1)
    for stream, client in zip(streams, clients):
        stream.__exit__(None, None, None)
        client.close()
    assert all(r.status_code == 200 for r in responses)
    wait_until_idle(engine, stack)
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in httpx.get(stack.metrics_urls["engine"], timeout=10).text.splitlines()
              if line.startswith(("strata:num_requests_running{", "strata:num_requests_waiting{",
                                  "strata:kv_cache_usage_perc{"))}
    # no step ran after the last abort: the gauges are the engine's state now, not its last step's
    assert gauges == {"strata:num_requests_running": 0, "strata:num_requests_waiting": 0,
                      "strata:kv_cache_usage_perc": 0}
