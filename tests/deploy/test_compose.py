"""docker-compose.yml (Docker is not available here, so the file is checked, not run): every
Strata service's command, as its shell would expand it with the file's defaults and with a model
set, is a valid invocation of that service's own argument parser, and the services address each
other by the ports they listen on."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.engine.__main__ import build_parser as engine_parser
from services.gateway.__main__ import parse_args as gateway_args
from services.router.__main__ import build_parser as router_parser
from services.tokenizer.__main__ import build_parser as tokenizer_parser

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PARSE = {"tokenizer": tokenizer_parser().parse_args, "engine": engine_parser().parse_args,
         "router": router_parser().parse_args, "gateway": gateway_args}


def compose_default(value: str) -> str:
    """``${VAR:-default}`` as compose interpolates it with VAR unset; ``$$`` → ``$``."""
    value = re.sub(r"(?<!\$)\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), value)
    return value.replace("$$", "$")


def argv_of(name: str, environment: dict[str, str]) -> list[str]:
    """The service's `strata` arguments after the subcommand, as its container would run them."""
    service = SERVICES[name]
    command = [compose_default(part) for part in service["command"]]
    if service.get("entrypoint") == ["sh", "-c"]:
        script = command[0].replace("exec strata", "printf '%s\\0'", 1)
        env = {**os.environ, **{k: compose_default(str(v)) for k, v in service["environment"].items()}, **environment}
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, check=True).stdout
        words = out.split("\0")[:-1]
    else:
        words = command
    assert words[0] == name
    return words[1:]


@pytest.mark.parametrize("model", ["", "/models/Qwen2.5 0.5B"])
@pytest.mark.parametrize("name", sorted(PARSE))
def test_each_command_parses(name, model):
    args = PARSE[name](argv_of(name, {"STRATA_MODEL": model}))
    if name in ("tokenizer", "engine"):
        assert args.model == (model or None)
    assert args.host == "0.0.0.0"


def test_services_reach_each_other_where_they_listen():
    env = {"STRATA_MODEL": ""}
    ports = {name: PARSE[name](argv_of(name, env)).port for name in PARSE}
    engine = PARSE["engine"](argv_of("engine", env))
    router = PARSE["router"](argv_of("router", env))
    gateway = PARSE["gateway"](argv_of("gateway", env))
    assert router.engine_addrs == f"engine:{ports['engine']}"
    assert gateway.tokenizer_addr == f"tokenizer:{ports['tokenizer']}"
    assert gateway.engine_addr == f"router:{ports['router']}"
    assert engine.nats_url == router.nats_url == "nats://nats:4222" and "nats" in SERVICES
    assert engine.device == "cuda" and "jaeger" in SERVICES
    for name in ("tokenizer", "engine", "router"):
        assert SERVICES[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{ports[name]}"
    assert SERVICES["gateway"]["ports"] == [f"{ports['gateway']}:{ports['gateway']}"]


def test_the_file_follows_the_compose_spec():
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec",
                             str(Path(__file__).parents[2] / "docker-compose.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_nats_is_private_and_authenticated():
    assert "ports" not in SERVICES["nats"], "NATS must not be published on the host"
    assert "authorization" in SERVICES["nats"]["command"][0] and "nats_token" in SERVICES["nats"]["secrets"]
    assert COMPOSE["secrets"]["nats_token"] == {"environment": "STRATA_NATS_TOKEN"}
    for name in ("engine", "router"):  # the services on NATS read the token from the secret's file
        assert "nats_token" in SERVICES[name]["secrets"]
        assert SERVICES[name]["environment"]["STRATA_NATS_TOKEN_FILE"] == "/run/secrets/nats_token"
