"""Stopping the stack drains it (issue: SIGTERM cut 4 of 4 streams with more than ~5 s left): the
gateway, asked to stop first, takes no new request and lets its 4 running streams finish, every
hop behind it serving them; with a short --shutdown-timeout, the 4 streams end with an OpenAI error
event and [DONE] instead of a cut connection."""

import json
import threading
import time

import httpx

from services.launcher import Stack, StackConfig, find_free_port
from tests.waiting import wait_until

MAX_TOKENS = 600


def start(default_model_dir, tmp_path, shutdown_timeout: int) -> Stack:
    config = StackConfig(model=str(default_model_dir), port=find_free_port(),
                         engine_args=["--num-kv-blocks", "256", "--max-num-seqs", "4", "--enforce-eager"],
                         gateway_args=["--shutdown-timeout", str(shutdown_timeout)],
                         log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=120, grace_s=60)
    stack = Stack(config)
    stack.start()
    return stack


def stream(base_url: str, model: str, i: int, started: threading.Event, result: dict, max_tokens: int) -> None:
    body = {"model": model, "prompt": f"story {i}:", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = result[i] = []  # filled as the events come
    try:
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as error:  # a cut connection: what the drain must never do
        events.append(f"cut: {error!r}")


def run_four_and_stop(stack: Stack, max_tokens: int = MAX_TOKENS) -> tuple[dict, float]:
    result: dict = {}
    started = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=stream,
                                args=(stack.base_url, stack.model_name, i, started[i], result, max_tokens))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60)
    wait_until(lambda: all(len(result[i]) >= 5 for i in range(4)), what="every stream a few tokens in")
    stopping = time.monotonic()
    stopper = threading.Thread(target=stack.stop)
    stopper.start()
    gateway_log = stack.config.log_dir / "gateway.log"  # uvicorn's line once it stops taking connections
    wait_until(lambda: "Shutting down" in gateway_log.read_text(), what="the gateway draining")
    # the gateway is draining now: a new request is refused, not queued
    try:  # a new connection is refused (the listener is closed); one on an open connection gets a 503
        refused = httpx.post(f"{stack.base_url}/v1/completions", json={"model": stack.model_name, "prompt": "x",
                                                                       "max_tokens": 2}, timeout=10).status_code
    except httpx.ConnectError:
        refused = "connection refused"
    for thread in threads:
        thread.join(timeout=120)
    stopper.join(timeout=120)
    result["refused"] = refused
    return result, time.monotonic() - stopping


def usage_of(events: list[str]) -> int | None:
    for event in reversed(events):
        if event != "[DONE]":
            payload = json.loads(event)
            if payload.get("usage"):
                return payload["usage"]["completion_tokens"]
    return None


def test_stopping_lets_the_running_streams_finish(default_model_dir, tmp_path):
    stack = start(default_model_dir, tmp_path, shutdown_timeout=60)
    result, took = run_four_and_stop(stack)
    refused = result.pop("refused", None)
    assert sorted(result) == [0, 1, 2, 3]
    for i, events in result.items():
        assert events[-1] == "[DONE]" and usage_of(events) == MAX_TOKENS, (i, events[-3:])
    assert refused in ("connection refused", 503), refused
    assert all(service.exit_code is not None for service in stack.services)
    print(f"4 streams of {MAX_TOKENS} tokens finished; the stack stopped {took:.1f} s after stop()")


def test_at_the_drain_timeout_streams_end_with_an_error_event_and_done(default_model_dir, tmp_path):
    stack = start(default_model_dir, tmp_path, shutdown_timeout=1)
    result, _ = run_four_and_stop(stack, max_tokens=1900)  # ~10 s of streaming: far past the timeout
    result.pop("refused", None)
    assert sorted(result) == [0, 1, 2, 3]
    for i, events in result.items():
        assert events[-1] == "[DONE]", (i, events[-3:])
        error = json.loads(events[-2])
        assert "error" in error and error["error"]["code"] == "shutting_down", (i, events[-3:])
