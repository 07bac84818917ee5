"""The README walked through: every `curl` and `openai` client example in its fenced code blocks runs,
as written (only the host and port rewritten), against a stack started as the README starts it
(`strata up`: the built-in model under its default name, no API key), and each answers with a body
that makes sense for what it asked (the constraint it gave is met, the tool it forced is called)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import StackConfig, find_free_port
from tests.e2e.conftest import serving

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
README_BASE_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang == language]


def curl_commands() -> list[str]:
    """Each `curl` command of the README's bash blocks, with its continuation lines (a trailing
    backslash, or a quoted body still open)."""
    commands = []
    for body in blocks("bash"):
        lines = iter(body.splitlines())
        for line in lines:
            if not line.startswith("curl "):
                continue
            command = line
            while command.endswith("\\") or command.count("'") % 2:
                command += "\n" + next(lines)
            commands.append(command)
    return commands


def client_examples() -> list[str]:
    return [body for body in blocks("python") if "OpenAI(" in body]


CURLS = curl_commands()
CLIENT_EXAMPLES = client_examples()


def test_the_readme_has_the_examples_this_test_runs():
    assert len(CURLS) >= 5 and all(README_BASE_URL in command for command in CURLS)
    assert len(CLIENT_EXAMPLES) >= 2 and all(README_BASE_URL in example for example in CLIENT_EXAMPLES)
    assert all("max_tokens" in example for example in CURLS + CLIENT_EXAMPLES), "every example is bounded"


@pytest.fixture(scope="module")
def base_url(default_model_dir, tmp_path_factory):
    """`strata up` as the README runs it (no --model: the built-in model, served as strata-tiny-v1), on
    a free port; --enforce-eager only spares the test the engine's graph compilation."""
    config = StackConfig(cache_dir=default_model_dir.parent.parent, port=find_free_port(),
                         engine_args=["--enforce-eager"], log_dir=tmp_path_factory.mktemp("readme-logs"),
                         echo_logs=False, startup_timeout_s=180, grace_s=10)
    for stack in serving(config):
        yield stack.base_url


def request_body(command: str) -> dict:
    words = shlex.split(command)
    return json.loads(words[words.index("-d") + 1])


def check_answer(body: dict, answer: dict) -> None:
    """What the request asked for is what came back."""
    assert "error" not in answer, answer
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert answer["usage"]["completion_tokens"] <= body["max_tokens"]
    if body.get("tool_choice") == "required":
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert [call["function"]["name"] for call in calls] == ["get_weather"]
        assert set(json.loads(calls[0]["function"]["arguments"])) == {"city"}
        return
    assert text or choice["finish_reason"] == "stop", answer  # a random model may sample EOS first
    if choice["finish_reason"] != "stop":
        return  # cut at max_tokens: a constraint cannot be complete
    schema = body.get("response_format", {}).get("json_schema", {}).get("schema")
    if schema is not None:
        assert set(json.loads(text)) == set(schema["required"])
    constraint = body.get("structured_outputs", {})
    if "choice" in constraint:
        assert text in constraint["choice"]
    if "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text


@pytest.mark.parametrize("command", CURLS, ids=[f"curl-{i}" for i in range(len(CURLS))])
def test_curl_example(base_url, command):
    result = subprocess.run(["bash", "-c", command.replace(README_BASE_URL, base_url) + " --silent --show-error"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    check_answer(request_body(command), json.loads(result.stdout))


@pytest.mark.parametrize("example", CLIENT_EXAMPLES, ids=[f"openai-{i}" for i in range(len(CLIENT_EXAMPLES))])
def test_openai_client_example(base_url, example):
    result = subprocess.run([sys.executable, "-c", example.replace(README_BASE_URL, base_url)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the example printed nothing"
    if "response_format=City" in example:
        assert re.fullmatch(r"name=.* population=\d+", result.stdout.strip(), re.DOTALL), result.stdout
