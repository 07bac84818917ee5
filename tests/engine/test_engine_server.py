"""The engine's gRPC service as a real process on loopback: health, reflection, streaming,
errors as status codes, cancellation freeing KV blocks, and draining on SIGTERM."""

import collections
import itertools
import os
import queue
import re
import shutil
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.pb import engine_pb2
from services.engine.threads import openmp_wait_env
from tests.many_entries import as_outputs
from tests.processes import EngineProcess, generate_request
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # starts engine processes

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def engine(default_model_dir, tmp_path_factory, free_port_factory):
    with EngineProcess(default_model_dir, free_port_factory(), tmp_path_factory.mktemp("engine") / "engine.log",
                       ("--num-threads", "1")) as server:
        server.statuses = server.wait_serving()
        yield server


def test_health_not_serving_until_loaded_then_serving(engine):
    assert engine.statuses[0] == NOT_SERVING, "health must say NOT_SERVING while the model loads"
    assert engine.statuses[-1] == SERVING


def test_the_engine_runs_its_num_threads_with_the_short_openmp_spin(engine):
    log = engine.log_path.read_text()
    assert "engine-0: 1 kernel threads, OpenMP wait " in log
    if openmp_wait_env(os.environ):  # else this environment names its own policy, which the engine keeps
        assert re.search(r"OpenMP wait GOMP_SPINCOUNT=\d+\n", log)  # timed for this CPU


def test_reflection_lists_the_engine_service(engine):
    stub = reflection_pb2_grpc.ServerReflectionStub(engine.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {service.name for response in responses for service in response.list_services_response.service}
    assert {"strata.v1.Engine", "grpc.health.v1.Health"} <= names


def test_generate_streams_tokens_as_sampled_with_usage(engine):
    responses = list(engine.stub.Generate(generate_request("stream", [5, 6, 7, 8, 9], 6, temperature=0.0,
                                                             logprobs=3), timeout=30))
    # One message per step, unless the reader fell behind: then queued steps travel together (six steps
    # of this model can all pass before the gRPC thread sends the first: how many messages is timing).
    assert sum(len(r.token_ids) for r in responses) == 6
    assert [r.finish_reason for r in responses][-1] == engine_pb2.FINISH_REASON_LENGTH
    assert all(r.finish_reason == 0 for r in responses[:-1])
    counts = [r.usage.completion_tokens for r in responses]
    assert counts == list(itertools.accumulate(len(r.token_ids) for r in responses))
    assert all(r.usage.prompt_tokens == 5 and r.replica_id == "engine-0" for r in responses)
    for r in responses:
        assert [lp.sampled.token_id for lp in r.logprobs] == list(r.token_ids)
        assert all(lp.sampled_rank == 1 and len(lp.top) == 3 for lp in r.logprobs)
    info = engine.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
    assert info.vocab_size == 4096 and info.max_model_len == 2048 and info.num_kv_blocks == 256


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(prompt=[1] * 2048, max_tokens=1), "maximum context length is 2048"),
    (dict(prompt=[1] * 2000, max_tokens=100), "'max_tokens' is too large"),
    (dict(prompt=[], max_tokens=4), "empty"),
    (dict(prompt=[999_999], max_tokens=4), "out of range"),
    (dict(prompt=[1, 2], max_tokens=4, top_p=1.5), "top_p"),
    (dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
    (dict(prompt=[1, 2], max_tokens=4, logprobs=21), "logprobs"),
])
def test_bad_requests_are_invalid_argument_and_server_keeps_serving(engine, request_kwargs, message):
    kwargs = dict(request_kwargs)
    request = generate_request("bad", kwargs.pop("prompt"), kwargs.pop("max_tokens"), **kwargs)
    with pytest.raises(grpc.RpcError) as error:
        list(engine.stub.Generate(request, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    good = list(engine.stub.Generate(generate_request("good", [3, 4], 2), timeout=10))
    assert sum(len(r.token_ids) for r in good) == 2 and good[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH


def test_cancelled_streams_free_their_blocks(engine):
    calls = [engine.stub.Generate(generate_request(f"cancel-{i}", list(range(3, 100)), 1500), timeout=60)
             for i in range(4)]
    for call in calls:
        next(call)  # every request is running and holds blocks
    load = engine.stub.Load(engine_pb2.LoadRequest(), timeout=5)
    assert load.num_running == 4 and load.num_kv_blocks_used > 0
    for call in calls:
        call.cancel()
    loads = []

    def idle() -> bool:
        loads.append(engine.stub.Load(engine_pb2.LoadRequest(), timeout=5))
        return loads[-1].num_running == loads[-1].num_waiting == loads[-1].num_kv_blocks_used == 0

    wait_until(idle, what=lambda: f"the cancelled requests still hold the engine: {loads[-1]}")


class _ManyCall:
    """A GenerateMany call whose request messages a test sends one by one; outputs by request id."""

    def __init__(self, stub) -> None:
        self._messages: queue.Queue = queue.Queue()
        self._call = stub.GenerateMany(iter(self._messages.get, None), timeout=60)
        self.outputs: dict[str, list] = collections.defaultdict(list)

    def send(self, requests=(), aborts=(), next_token_entries=True) -> None:
        self._messages.put(engine_pb2.GenerateManyRequest(requests=requests, abort_request_ids=aborts,
                                                          next_token_entries=next_token_entries))

    def read_until(self, done) -> None:
        while not done():
            for output in next(self._call).outputs:
                self.outputs[output.request_id].append(output)

    def close(self) -> list:
        """Half-closes; returns what came after (the stream ends once its requests have)."""
        self._messages.put(None)
        return [output for reply in self._call for output in reply.outputs]


def _finished(outputs: list) -> bool:
    return bool(outputs) and (outputs[-1].HasField("error") or outputs[-1].output.finish_reason != 0)


def test_generate_many_serves_requests_as_their_own_generate_streams_would(engine):
    """Requests started together on one GenerateMany stream get the tokens their own Generate streams
    get (greedy); a bad request and a duplicate id get the error entry their own stream's status would
    carry, and the others go on; an aborted request gets nothing more and frees its blocks; outputs of one
    token go as next_token entries to a caller that reads them."""
    assert engine.stub.Info(engine_pb2.EngineInfoRequest(), timeout=5).generate_many
    prompts = {f"many-{i}": [3 + i, 9, 27, 81 % 50 + i] for i in range(3)}
    many = _ManyCall(engine.stub)
    many.send([generate_request(rid, prompt, 5 + i, temperature=0.0) for i, (rid, prompt) in enumerate(prompts.items())]
              + [generate_request("many-bad", [1, 2], 4, top_p=1.5), generate_request("many-long", [5] * 40, 1500)])
    # a caller from before next_token entries (no next_token_entries on its message) gets every output in full
    many.send([generate_request("many-old", [4, 9, 27, 33], 5, temperature=0.0)], next_token_entries=False)
    many.read_until(lambda: all(_finished(many.outputs[rid]) for rid in [*prompts, "many-bad", "many-old"])
                    and many.outputs["many-long"])
    old = many.outputs["many-old"]
    assert [e.WhichOneof("result") for e in old] == ["output"] * 5
    assert [o.usage.completion_tokens for o in as_outputs(old)] == [1, 2, 3, 4, 5]
    many.send([generate_request("many-long", [6, 7], 3)], aborts=[])  # the same id again, while it runs
    many.read_until(lambda: any(o.HasField("error") for o in many.outputs["many-long"]))
    load = engine.stub.Load(engine_pb2.LoadRequest(), timeout=5)  # before the abort: the long request runs
    many.send(aborts=["many-long"])
    for i, (rid, prompt) in enumerate(prompts.items()):
        own = list(engine.stub.Generate(generate_request(f"own-{i}", prompt, 5 + i, temperature=0.0), timeout=30))
        entries = many.outputs[rid]
        outputs = as_outputs(entries)
        assert [t for o in outputs for t in o.token_ids] == [t for r in own for t in r.token_ids]
        # each output's usage counts the tokens so far (a next_token's too), its replica is the engine's
        assert [(o.usage.prompt_tokens, o.usage.completion_tokens, o.replica_id) for o in outputs] == [
            (len(prompt), k + 1, "engine-0") for k in range(5 + i)]
        assert outputs[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        # (the first output, with the prompt's usage, and the last, with its finish reason, in full)
        assert [e.WhichOneof("result") for e in entries] == ["output"] + ["next_token"] * (3 + i) + ["output"]
    bad = many.outputs["many-bad"][-1].error
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "top_p" in bad.message
    duplicate = next(o for o in many.outputs["many-long"] if o.HasField("error")).error
    assert duplicate.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already running" in duplicate.message
    after = many.close()
    assert not any(o.request_id == "many-long" and o.HasField("output") and o.output.finish_reason for o in after)
    assert load.num_running >= 1
    loads = []

    def idle() -> bool:
        loads.append(engine.stub.Load(engine_pb2.LoadRequest(), timeout=5))
        return loads[-1].num_running == loads[-1].num_waiting == loads[-1].num_kv_blocks_used == 0

    wait_until(idle, what=lambda: f"the aborted request still holds the engine: {loads[-1]}")


def test_sigterm_while_the_model_loads_stops_cleanly(default_model_dir, tmp_path, free_port):
    with EngineProcess(default_model_dir, free_port, tmp_path / "engine.log") as server:
        server.wait_until(lambda: "listening on" in server.log(), what="listening (the model loads next)")
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
        assert "Task was destroyed" not in server.log() and " ERROR " not in server.log(), server.log_tail()


@pytest.mark.parametrize("problem", ["a broken generation_config.json", "a default no request could use"])
def test_a_model_that_does_not_load_ends_the_process_with_its_reason(default_model_dir, tmp_path, free_port, problem):
    """Not a process that serves NOT_SERVING for ever (which `strata up` would wait on): exit code 1 and one
    line that names the file or the flag, no traceback."""
    checkpoint, extra = default_model_dir, ()
    if problem == "a broken generation_config.json":
        checkpoint = tmp_path / "checkpoint"
        shutil.copytree(default_model_dir, checkpoint)
        (checkpoint / "generation_config.json").write_text('{"temperature": 0.7,')
    else:
        extra = ("--override-generation-config", '{"top_p": 0}')
    with EngineProcess(checkpoint, free_port, tmp_path / "engine.log", extra) as server:
        assert server.process.wait(timeout=60) == 1
        last_line = server.log().strip().splitlines()[-1]
    assert last_line.startswith("strata engine: ") and "Traceback" not in server.log(), server.log_tail()
    assert ("generation_config.json is not valid JSON" if "broken" in problem else "top_p must be in (0, 1]") in last_line


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones(default_model_dir, tmp_path, free_port):
    with EngineProcess(default_model_dir, free_port, tmp_path / "engine.log") as server:
        server.wait_serving()
        in_flight = server.stub.Generate(generate_request("long", [3, 4, 5], 300), timeout=60)
        first = next(in_flight)
        server.process.send_signal(signal.SIGTERM)
        server.wait_until(lambda: server.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                          == NOT_SERVING, what="NOT_SERVING after SIGTERM")
        with pytest.raises(grpc.RpcError) as error:
            list(server.stub.Generate(generate_request("late", [3, 4], 2), timeout=10))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(in_flight)
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 300
        assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert server.process.wait(timeout=30) == 0
