"""Scale-down drains (DESIGN.md, "The autoscaler"): a replica asked to stop (SIGTERM) tells the
router at once over NATS, so no new request goes there even though the router's health checks are a
minute apart; it finishes all 8 streams it was running and exits 0. At its drain timeout, what is
still running ends with UNAVAILABLE instead of hanging."""

import threading

import grpc
import pytest

from tests.processes import EngineProcess, generate_request, start_fleet

pytestmark = pytest.mark.slow  # starts NATS, engines and a router

MAX_TOKENS = 96


@pytest.fixture
def drain_fleet(default_model_dir, tmp_path, free_port_factory):
    with start_fleet(default_model_dir, tmp_path, free_port_factory, ("d0", "d1"),
                     ("--load-report-interval", "0.2", "--shutdown-timeout", "120")) as running:
        yield running.router, running.engines


def stream_tokens(stub, request_id: str, first_token: threading.Event, results: dict) -> None:
    try:
        count = 0
        for output in stub.Generate(generate_request(request_id, [3, 5, 7, len(results)], MAX_TOKENS), timeout=120):
            count += len(output.token_ids)
            first_token.set()
        results[request_id] = count
    except grpc.RpcError as error:
        results[request_id] = error


def test_a_draining_replica_finishes_its_8_streams_and_gets_no_new_request(drain_fleet):
    router, engines = drain_fleet
    victim = engines["d0"]
    results: dict = {}
    started = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=stream_tokens, args=(victim.stub, f"s{i}", started[i], results))
               for i in range(8)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "a stream produced nothing"
    victim.process.terminate()  # SIGTERM: what the autoscaler's local provider sends on scale-down
    router.wait_until(lambda: "draining" in router.log(), what="told of the drain over NATS")
    assert victim.process.poll() is None, "exited before its streams finished"
    served = [list(router.stub.Generate(generate_request(f"new{i}", [900 + i] * 20, 2), timeout=30))[-1].replica_id
              for i in range(6)]
    assert served == ["d1"] * 6
    assert router.metric_values().get('strata:router_failovers_total{replica="d0"}', 0) == 0, \
        "a request was sent to the draining replica"
    for thread in threads:
        thread.join(timeout=120)
    assert results == {f"s{i}": MAX_TOKENS for i in range(8)}
    assert victim.process.wait(timeout=30) == 0
    assert "draining" in router.log()


def test_the_drain_timeout_ends_what_is_left_with_unavailable(default_model_dir, tmp_path, free_port_factory):
    with EngineProcess(default_model_dir, free_port_factory(), tmp_path / "engine.log",
                       ("--shutdown-timeout", "1")) as engine:
        engine.wait_serving()
        results: dict = {}
        first = threading.Event()
        request = generate_request("long", [3, 5, 7], 2000)
        thread = threading.Thread(target=lambda: results.update(
            long=_consume(engine.stub.Generate(request, timeout=120), first)))
        thread.start()
        assert first.wait(60)
        engine.process.terminate()
        thread.join(timeout=30)
        error = results["long"]
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "drain timed out" in error.details()
        assert engine.process.wait(timeout=30) == 0


def _consume(call, first: threading.Event):
    try:
        for _ in call:
            first.set()
    except grpc.RpcError as error:
        return error
    return "finished"
