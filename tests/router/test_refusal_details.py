"""An engine's refusal reaches the router's client with its status details: the parameter at fault
(and OpenAI's error code) that the gateway names in its 400."""

import grpc
import pytest

from services.common import error_details
from tests.processes import generate_request
from tests.router.test_router import fleet  # noqa: F401  (the module's fleet: a router before two engines)

pytestmark = pytest.mark.slow  # starts NATS, engines and a router (test_router's fleet)


@pytest.mark.parametrize("request_, param, code", [
    (generate_request("bad-temperature", [5, 6], 2, temperature=-1.0), "temperature", None),
    (generate_request("too-long", [5] * 2048, 2), "input_tokens", "context_length_exceeded"),
])
def test_a_refusal_keeps_its_parameter_through_the_router(fleet, request_, param, code):  # noqa: F811
    router = fleet[0]
    with pytest.raises(grpc.RpcError) as error:
        list(router.stub.Generate(request_, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details.param_and_code(error.value) == (param, code)
