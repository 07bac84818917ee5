"""CORS, as vLLM answers browsers: a web page's preflight is answered before the API key is checked
(browsers send none with it), every answer carries the headers that let the page read it (a 401
too), and the allowed origins, methods, headers and credentials follow the flags."""

import pytest
from fastapi.testclient import TestClient

from services.gateway.__main__ import cors_policy, parse_args
from services.gateway.app import CorsPolicy, GatewayConfig, create_app

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


def gateway(**config) -> TestClient:
    # Nothing listens on these: every request below is answered before an upstream is called.
    return TestClient(create_app(GatewayConfig(tokenizer_addr="127.0.0.1:9", engine_addr="127.0.0.1:9",
                                               api_key="sk-test", **config)))


def test_by_default_any_page_may_call_and_a_preflight_needs_no_key():
    with gateway() as client:
        preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "x-stainless-os" in preflight.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in preflight.headers

        refused = client.post("/v1/chat/completions", json={}, headers={"Origin": PAGE})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["access-control-allow-origin"] == "*"  # the page can read why

        version = client.get("/version", headers={"Origin": PAGE})
        assert version.status_code == 200 and version.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-origin" not in client.get("/version").headers  # not a browser


def test_the_flags_narrow_origins_and_methods_and_allow_credentials():
    args = parse_args(["--tokenizer-addr", "t:1", "--engine-addr", "e:1", "--allowed-origins", f'["{PAGE}"]',
                       "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]',
                       "--allow-credentials"])
    policy = cors_policy(args)
    assert policy == CorsPolicy((PAGE,), ("GET", "POST"), ("authorization",), True)
    with gateway(cors=policy) as client:
        allowed = client.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers":
                                                              "authorization"})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == PAGE
        assert allowed.headers["access-control-allow-credentials"] == "true"
        other_page = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other_page.status_code == 400 and "access-control-allow-origin" not in other_page.headers
        delete = client.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"})
        assert delete.status_code == 400


@pytest.mark.parametrize("value", ["*", '{"a": 1}', '["ok", 2]', "[not json"])
def test_a_flag_that_is_not_a_json_list_of_strings_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer-addr", "t:1", "--engine-addr", "e:1", "--allowed-origins", value])
    assert "--allowed-origins" in capsys.readouterr().err
