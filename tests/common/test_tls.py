"""mTLS on the gRPC hops, on real processes with certificates made by openssl: an engine and a
router serve TLS with client certificates required; a client with the stack's certificate is served
(through the router, which presents its own certificate to the engine), while a plaintext client, a
client without a certificate and one whose certificate another CA signed are all refused."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.health_probe import serving
from services.common.pb import engine_pb2_grpc
from services.common.tls import TlsFiles, sync_channel
from tests.processes import EngineProcess, NatsServer, RouterProcess, generate_request
from tests.tls_certs import make_tls

pytestmark = pytest.mark.slow  # starts engines, a router and a stack


@pytest.fixture(scope="module")
def tls_fleet(default_model_dir, tmp_path_factory, free_port_factory):
    directory = tmp_path_factory.mktemp("tls")
    stack_tls, stranger_tls = make_tls(directory)
    engine_port, router_port = free_port_factory(), free_port_factory()
    with NatsServer(free_port_factory()) as nats, \
            EngineProcess(default_model_dir, engine_port, directory / "engine.log",
                          ("--replica-id", "tls-0", *stack_tls.flags())) as engine, \
            RouterProcess(router_port, [f"127.0.0.1:{engine_port}"], nats.url, directory / "router.log",
                          free_port_factory(), check_interval_s=0.5, extra_args=tuple(stack_tls.flags())) as router:
        engine.wait_until(lambda: serving(engine.address, timeout_s=1.0, tls=stack_tls), what="SERVING over TLS")
        router.wait_until(lambda: serving(router.address, timeout_s=1.0, tls=stack_tls), what="SERVING over TLS")
        yield router.address, engine.address, stack_tls, stranger_tls


def generate(address: str, tls: TlsFiles | None) -> int:
    with sync_channel(address, tls) as channel:
        outputs = engine_pb2_grpc.EngineStub(channel).Generate(generate_request("t", [3, 5, 7], 4), timeout=10)
        return sum(len(o.token_ids) for o in outputs)


def test_a_client_with_the_stacks_certificate_is_served_through_the_router(tls_fleet):
    router, engine, stack_tls, _ = tls_fleet
    assert generate(router, stack_tls) == 4
    assert generate(engine, stack_tls) == 4


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "another CA's certificate"])
def test_other_clients_are_refused(tls_fleet, who):
    router, engine, stack_tls, stranger_tls = tls_fleet
    tls = {"plaintext": None, "no client certificate": TlsFiles(ca=stack_tls.ca),
           "another CA's certificate": stranger_tls}[who]
    for address in (router, engine):
        with pytest.raises(grpc.RpcError) as refused:
            with sync_channel(address, tls) as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_whole_stack_over_mutual_tls(default_model_dir, tmp_path):
    """`strata up` with TLS files: every gRPC hop (gateway -> tokenizer, gateway -> router -> two
    engines) is mutual TLS, and a request through the gateway works end to end."""
    import openai

    from services.launcher import Stack, StackConfig, find_free_port

    stack_tls, _ = make_tls(tmp_path / "certs")
    config = StackConfig(model=str(default_model_dir), port=find_free_port(), replicas=2, tls=stack_tls,
                         engine_args=["--num-kv-blocks", "64", "--max-num-seqs", "4", "--enforce-eager"],
                         log_dir=tmp_path / "logs", echo_logs=False, startup_timeout_s=120, grace_s=10)
    with Stack(config) as stack:
        with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as client:
            response = client.completions.create(model=stack.model_name, prompt="over TLS", max_tokens=3)
        assert response.usage.completion_tokens == 3
        for address in (stack.tokenizer_addr, stack.engine_addr):
            assert not serving(address, timeout_s=1.0), f"{address} answered a plaintext client"
