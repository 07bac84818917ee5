"""The real tokenizer service over gRPC: every RPC, health, reflection, bad input and shutdown."""

import os
import random
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.pb import tokenizer_pb2 as pb
from services.common.token_decoder import TokenDecoder
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from tests.processes import TokenizerProcess

from .samples import HAND_PICKED, conversations

pytestmark = pytest.mark.slow  # starts tokenizer processes


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def test_health_is_serving_and_reflection_lists_the_service(default_server):
    health = health_pb2_grpc.HealthStub(default_server.channel)
    for service in ("", "strata.v1.Tokenizer"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(default_server.channel)
    [response] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {service.name for service in response.list_services_response.service}
    assert {"strata.v1.Tokenizer", "grpc.health.v1.Health"} <= names


def test_encode_and_decode_match_transformers(default_server, hf):
    for text in HAND_PICKED + ["hi <|im_end|> there"]:
        for add_special_tokens in (True, False):
            request = pb.EncodeRequest(text=text, add_special_tokens=add_special_tokens)
            ids = list(default_server.stub.Encode(request).token_ids)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            decoded = default_server.stub.Decode(pb.DecodeRequest(token_ids=ids, skip_special_tokens=skip))
            assert decoded.text == hf.decode(ids, skip_special_tokens=skip)


def test_encode_chat_matches_apply_chat_template(default_server, hf):
    for messages in conversations("<|im_end|>"):
        request = pb.EncodeChatRequest(messages=[pb.ChatMessage(**m) for m in messages], add_generation_prompt=True)
        response = default_server.stub.EncodeChat(request)
        expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert list(response.token_ids) == list(expected["input_ids"])
        assert response.prompt_text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_detokenize_streams_deltas_that_join_to_decode(default_server, default_model_dir):
    tokenizer = CheckpointTokenizer.from_dir(default_model_dir)
    rng = random.Random(3)
    real = tokenizer.encode("中文 café 😀 👨‍👩‍👧‍👦 and <|im_end|> done", False)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 10))] + real[rng.randrange(5) :]
        chunks = [ids[i : i + 2] for i in range(0, len(ids), 2)]
        skip = rng.random() < 0.5
        requests = [pb.DetokenizeRequest(token_ids=chunk, skip_special_tokens=skip) for chunk in chunks]
        responses = list(default_server.stub.Detokenize(iter(requests)))
        assert len(responses) in (len(requests), len(requests) + 1)  # one per message, then the held-back rest
        counts = [r.num_token_ids for r in responses]
        assert counts == sorted(counts) and (not ids or counts[-1] == len(ids))
        assert "".join(r.text_delta for r in responses) == tokenizer.decode(ids, skip)


def test_detokenize_continues_after_prefix(default_server, hf):
    prefix = hf.encode("User wrote: 中文")
    ids = hf.encode(" then the model said 😀")
    requests = [pb.DetokenizeRequest(token_ids=ids[:3], prefix_token_ids=prefix)]
    requests += [pb.DetokenizeRequest(token_ids=[i]) for i in ids[3:]]
    responses = list(default_server.stub.Detokenize(iter(requests)))
    assert "".join(r.text_delta for r in responses) == " then the model said 😀"


def test_info_describes_the_checkpoint(default_server, default_model_dir):
    info = default_server.stub.Info(pb.TokenizerInfoRequest())
    assert (info.vocab_size, list(info.eos_token_ids), info.bos_token_id) == (4096, [2, 0], 0)
    assert (info.max_model_len, info.has_chat_template, info.model) == (2048, True, str(default_model_dir))


BAD_CHAT_REQUESTS = {
    "no messages": (pb.EncodeChatRequest(), "at least one message"),
    "no role": (pb.EncodeChatRequest(messages=[pb.ChatMessage(content="hi")]), "messages[0] has no role"),
    "template syntax": (
        pb.EncodeChatRequest(messages=[pb.ChatMessage(role="user", content="x")], chat_template="{% for %}"),
        "chat template error",
    ),
    "raise_exception": (
        pb.EncodeChatRequest(
            messages=[pb.ChatMessage(role="user", content="x")],
            chat_template="{{ raise_exception('system messages only, please') }}",
        ),
        "system messages only, please",
    ),
    "kwargs not json": (
        pb.EncodeChatRequest(messages=[pb.ChatMessage(role="user", content="x")], template_kwargs_json="{oops"),
        "template_kwargs_json is not valid JSON",
    ),
    "kwargs not an object": (
        pb.EncodeChatRequest(messages=[pb.ChatMessage(role="user", content="x")], template_kwargs_json="[1]"),
        "must be a JSON object",
    ),
}


@pytest.mark.parametrize("name", BAD_CHAT_REQUESTS)
def test_bad_chat_requests_are_invalid_argument(default_server, name):
    request, message = BAD_CHAT_REQUESTS[name]
    _assert_invalid(lambda: default_server.stub.EncodeChat(request), message)
    _assert_still_serving(default_server)


def test_out_of_range_ids_are_invalid_argument(default_server):
    _assert_invalid(lambda: default_server.stub.Decode(pb.DecodeRequest(token_ids=[5, 4096])), "token id 4096")
    requests = iter([pb.DetokenizeRequest(token_ids=[5]), pb.DetokenizeRequest(token_ids=[70000])])
    _assert_invalid(lambda: list(default_server.stub.Detokenize(requests)), "token id 70000")
    _assert_still_serving(default_server)


def test_chat_without_a_template_is_invalid_argument(templateless_server):
    assert not templateless_server.stub.Info(pb.TokenizerInfoRequest()).has_chat_template
    request = pb.EncodeChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    _assert_invalid(lambda: templateless_server.stub.EncodeChat(request), "has no chat template")
    request.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert templateless_server.stub.EncodeChat(request).prompt_text == "hi"


def test_a_server_chat_template_serves_a_checkpoint_without_one(templateless_dir, free_port_factory, tmp_path):
    """--chat-template takes a file or the template itself (vLLM's flag); one that does not compile stops the start."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    (tmp_path / "chat.jinja").write_text(template)
    request = pb.EncodeChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], add_generation_prompt=True)
    for value in (str(tmp_path / "chat.jinja"), template):
        with TokenizerProcess(templateless_dir, free_port_factory(), tmp_path / "tokenizer.log",
                              extra_args=("--chat-template", value)) as server:
            server.wait_serving()
            assert server.stub.Info(pb.TokenizerInfoRequest()).has_chat_template
            assert server.stub.EncodeChat(request).prompt_text == "<user>hi<a>"
    for value, message in (("{% for m in messages %}", "does not compile"),
                           (str(tmp_path / "missing.jinja"), "is neither a file nor a template")):
        result = subprocess.run([sys.executable, "-m", "services.tokenizer", "--model", str(templateless_dir),
                                 "--chat-template", value], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and message in result.stderr


def test_default_model_without_flag_and_graceful_sigterm(default_model_dir, free_port, tmp_path):
    env = {**os.environ, "STRATA_CACHE_DIR": str(default_model_dir.parent.parent)}
    with TokenizerProcess(None, free_port, tmp_path / "tokenizer.log", env=env) as server:
        server.wait_serving()
        assert server.stub.Info(pb.TokenizerInfoRequest()).model == str(default_model_dir)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0, server.log()


def _assert_invalid(call, message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert message in caught.value.details()


def _assert_still_serving(server) -> None:
    assert list(server.stub.Encode(pb.EncodeRequest(text="still here")).token_ids)


def _tokenizer_metrics(server) -> dict[str, float]:
    """Every ``strata:tokenizer_*`` sample of the server's /metrics, by its line's name and labels."""
    import urllib.request

    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("strata:tokenizer_")}


def test_metrics_count_calls_outcomes_tokens_and_open_streams(default_server):
    before = _tokenizer_metrics(default_server)
    ids = list(default_server.stub.Encode(pb.EncodeRequest(text="hello there world", add_special_tokens=False)).token_ids)
    default_server.stub.Decode(pb.DecodeRequest(token_ids=ids))
    with pytest.raises(grpc.RpcError):
        default_server.stub.Decode(pb.DecodeRequest(token_ids=[10**9]))  # out of the vocabulary
    replies = list(default_server.stub.Detokenize(iter([pb.DetokenizeRequest(token_ids=ids[:1]),
                                                        pb.DetokenizeRequest(token_ids=ids[1:])])))
    assert "".join(r.text_delta for r in replies) == "hello there world"
    after = _tokenizer_metrics(default_server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('strata:tokenizer_requests_total{outcome="ok",rpc="Encode"}') == 1
    assert delta('strata:tokenizer_requests_total{outcome="ok",rpc="Decode"}') == 1
    assert delta('strata:tokenizer_requests_total{outcome="error",rpc="Decode"}') == 1
    assert delta('strata:tokenizer_requests_total{outcome="ok",rpc="Detokenize"}') == 1
    assert delta('strata:tokenizer_request_duration_seconds_count{rpc="Encode"}') == 1
    assert delta('strata:tokenizer_tokens_total{direction="encoded"}') == len(ids)
    assert delta('strata:tokenizer_tokens_total{direction="decoded"}') == 2 * len(ids)
    assert after["strata:tokenizer_detokenize_streams"] == 0


def test_a_decoder_from_the_decoder_rpc_detokenizes_as_the_detokenize_stream_does(default_server, default_model_dir):
    """What the gateway does with the Decoder reply (`TokenDecoder.from_proto`) gives each generation,
    its ids split differently, with a prompt prefix and either skip_special_tokens, the deltas the
    service's own Detokenize stream answers."""
    tokenizer = CheckpointTokenizer.from_dir(default_model_dir)
    decoder = TokenDecoder.from_proto(default_server.stub.Decoder(pb.DecoderRequest()))
    assert decoder.special_ids == tokenizer.decoder.special_ids
    rng = random.Random(5)
    real = tokenizer.encode("中文 café 😀 👨‍👩‍👧‍👦 and <|im_end|> done", False)
    for _ in range(8):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 6))] + real[rng.randrange(5):]
        size, skip, prefix = rng.randint(1, 3), rng.random() < 0.5, real[:rng.randint(0, 4)]
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        own = list(default_server.stub.Detokenize(iter(
            [pb.DetokenizeRequest(token_ids=chunks[0], skip_special_tokens=skip, prefix_token_ids=prefix)]
            + [pb.DetokenizeRequest(token_ids=chunk) for chunk in chunks[1:]])))
        local = decoder.detokenizer(skip, prefix)
        deltas = [local.step(chunk) for chunk in chunks]
        deltas[-1] += local.flush()
        served = [reply.text_delta for reply in own]
        if len(served) > len(chunks):  # the held-back rest comes in a reply of its own after the last ids'
            served[-2:] = ["".join(served[-2:])]
        assert deltas == served
    assert _tokenizer_metrics(default_server)["strata:tokenizer_detokenize_streams"] == 0
