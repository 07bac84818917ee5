"""Text correctness end to end: stop strings (spanning tokens, never leaked while streaming) and
multi-byte characters arriving intact through the Detokenize stream.

The default model has random weights, so the tests take their expectations from the stack itself:
a greedy run without a stop string gives the text to cut, and the engine's own token ids, decoded
by the tokenizer in one piece, give the text the gateway must have streamed.
"""

from services.common.pb import engine_pb2
from tests.e2e.conftest import MODEL, decode, encode

PROMPT = "The lighthouse keeper said"


def greedy(client, prompt=PROMPT, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                      extra_body={"ignore_eos": True}, **kwargs)


def spanning_stop(client) -> tuple[str, str]:
    """A stop string made of the end of one generated token and the start of the next."""
    full = greedy(client, logprobs=0)
    text, tokens = full.choices[0].text, full.choices[0].logprobs.tokens
    for left, right in zip(tokens[3:], tokens[4:]):
        if left and right and "\ufffd" not in left + right:
            return text, left[-1] + right[0]
    raise AssertionError(f"no two clean adjacent tokens in {tokens}")


def test_stop_string_spanning_tokens_cuts_before_it(client):
    text, stop = spanning_stop(client)
    cut = greedy(client, stop=[stop]).choices[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.model_extra.get("stop_reason") == stop


def test_streamed_stop_string_is_never_leaked(client):
    text, stop = spanning_stop(client)
    deltas, finishes = [], []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24,
                                           stop=stop, stream=True, extra_body={"ignore_eos": True}):
        deltas.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert "".join(deltas) == text[:text.index(stop)]
    assert finishes == ["stop"]


def test_chat_stop_string_and_include_stop_str(client):
    messages = [{"role": "user", "content": "Say something long."}]
    text = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = text[6:8]
    kept = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=20, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == text[:text.index(stop) + len(stop)]
    assert kept.finish_reason == "stop"


def test_the_token_that_stopped_a_choice_is_not_in_its_text(client, tokenizer):
    """As vLLM renders it: the EOS or stop token that ends a choice adds no text (even with special tokens
    kept), unless include_stop_str_in_output; its token still counts."""
    eos = encode(tokenizer, "<|im_end|>")
    assert len(eos) == 1
    for stream in (False, True):
        for include, expected in ((False, ""), (True, "<|im_end|>")):
            response = client.completions.create(
                model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, logit_bias={str(eos[0]): 100},
                stream=stream, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": include})
            choices = [c.choices[0] for c in response] if stream else response.choices
            assert "".join(c.text for c in choices) == expected and choices[-1].finish_reason == "stop"
    tokens = greedy(client, logprobs=0).choices[0].logprobs.tokens
    # a token of the free run that is one vocabulary entry (its text encodes to it alone), first at k
    k, stop_id = next((k, ids[0]) for k, token in enumerate(tokens[2:], 2)
                      if len(ids := encode(tokenizer, token)) == 1 and token not in tokens[:k])
    cut = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24, logprobs=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra.get("stop_reason") == stop_id
    assert cut.text == "".join(tokens[:k]) and len(cut.logprobs.tokens) == k + 1


def test_generation_configs_extra_eos_ends_a_choice_with_its_id_as_stop_reason(client, tokenizer):
    """The default model's generation_config.json ends generation on <|endoftext|> besides its tokenizer's
    <|im_end|> (as Qwen2.5's): vLLM makes such an extra EOS id a stop token, reported as the stop_reason;
    the tokenizer's own EOS has none."""
    for token, reason in (("<|im_end|>", None), ("<|endoftext|>", encode(tokenizer, "<|endoftext|>")[0])):
        (eos,) = encode(tokenizer, token)
        for stream in (False, True):
            response = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5,
                                                 logit_bias={str(eos): 100}, stream=stream)
            last = [c.choices[0] for c in response][-1] if stream else response.choices[0]
            assert (last.finish_reason, last.model_extra.get("stop_reason")) == ("stop", reason)


def test_multibyte_text_arrives_intact(client, engine, tokenizer):
    """The greedy output for prompts full of emoji and CJK is streamed delta by delta; joined, the
    deltas must equal the tokenizer's decode of the engine's own ids for the same prompt."""
    multibyte_seen = False
    for prompt in ("😀🎉 你好，世界！", "東京タワー🗼 and café ☕", "🇯🇵🇫🇷 한국어 😊"):
        prompt_ids = encode(tokenizer, prompt)
        request = engine_pb2.GenerateRequest(
            request_id=f"e2e-direct-{hash(prompt)}", prompt_token_ids=prompt_ids,
            sampling=engine_pb2.SamplingParams(temperature=0),
            stop=engine_pb2.StopCriteria(max_tokens=24, ignore_eos=True))
        ids = [i for out in engine.Generate(request, timeout=60) for i in out.token_ids]
        expected = decode(tokenizer, ids)

        deltas = [chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=prompt_ids, temperature=0, max_tokens=24, stream=True,
            extra_body={"ignore_eos": True})]
        full = client.completions.create(model=MODEL, prompt=prompt_ids, temperature=0, max_tokens=24,
                                         extra_body={"ignore_eos": True}).choices[0].text
        # Decoding each token alone would break characters made of several tokens; the joined
        # deltas only equal the one-piece decode if the Detokenize stream held them back correctly.
        assert "".join(deltas) == full == expected
        multibyte_seen |= any(ord(ch) > 0x7FF for ch in expected.replace("\ufffd", ""))
    assert multibyte_seen, "the model produced no 3- or 4-byte character; the test proved nothing"
