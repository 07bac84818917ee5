"""The service's tokenizer against transformers' AutoTokenizer, in process, on three different checkpoints."""

import json
import random
import shutil

import pytest

from services.common.errors import InvalidRequestError
from services.default_model.model import CORPUS_PATH
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer

from . import checkpoints
from .samples import conversations, parity_texts


def _special_tokens(hf) -> list[str]:
    return [token for token in hf.get_added_vocab()]


def _mismatches(cases, ours, theirs) -> list:
    return [(case, ours(case), theirs(case)) for case in cases if ours(case) != theirs(case)]


def test_encode_matches_transformers(hf, strata):
    texts = parity_texts(_special_tokens(hf))
    assert len(texts) >= 200
    for add_special_tokens in (True, False):
        mismatches = _mismatches(
            texts,
            lambda text: strata.encode(text, add_special_tokens),
            lambda text: hf.encode(text, add_special_tokens=add_special_tokens),
        )
        assert not mismatches[:5], f"add_special_tokens={add_special_tokens}"


def test_decode_matches_transformers(hf, strata):
    rng = random.Random(7)
    id_lists = [tuple(strata.encode(text, True)) for text in parity_texts(_special_tokens(hf))]
    special_ids = sorted(hf.get_added_vocab().values())
    for _ in range(200):
        pool = [rng.randrange(strata.vocab_size) for _ in range(20)] + special_ids
        id_lists.append(tuple(rng.choice(pool) for _ in range(rng.randint(1, 30))))
    for skip_special_tokens in (False, True):
        mismatches = _mismatches(
            id_lists,
            lambda ids: strata.decode(list(ids), skip_special_tokens),
            lambda ids: hf.decode(list(ids), skip_special_tokens=skip_special_tokens),
        )
        assert not mismatches[:5], f"skip_special_tokens={skip_special_tokens}"


def test_encode_chat_matches_apply_chat_template(hf, strata):
    for messages in conversations(_special_tokens(hf)[0]):
        for add_generation_prompt in (False, True):
            ids, text = strata.encode_chat(messages, add_generation_prompt)
            # transformers 5 returns a BatchEncoding when tokenizing: compare its input_ids.
            expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
            expected_text = hf.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
            assert (text, ids) == (expected_text, list(expected["input_ids"])), messages


def test_continue_final_message_matches_apply_chat_template(hf, strata):
    """An assistant turn begun by the client is left open, as transformers cuts it (spacing kept or trimmed)."""
    for messages in conversations(_special_tokens(hf)[0]):
        for start in ("The answer is", "  Sure, here:  ", "{\"name\": \"", "é ü"):
            chat = [*messages, {"role": "assistant", "content": start}]
            ids, text = strata.encode_chat(chat, False, continue_final_message=True)
            expected = hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
            assert text == expected and start.strip() in text[-len(start) - 8:], chat
            assert ids == list(hf.apply_chat_template(chat, tokenize=True, continue_final_message=True)["input_ids"])
    with pytest.raises(InvalidRequestError, match="the chat template does not render the final message"):
        strata.encode_chat([{"role": "user", "content": "hi"}], False, chat_template="{{ messages | length }}",
                           continue_final_message=True)


def test_request_template_overrides_the_checkpoints(hf, strata):
    template = (  # block tags on their own indented lines: trim_blocks and lstrip_blocks keep them out
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'system' %}\n"
        "[SYS] {{ m['content'] }}\n"
        "  {% else %}\n"
        "[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n"
        "  {% endif %}\n"
        "{% endfor %}\n"
    )
    messages = conversations("")[2]
    ids, text = strata.encode_chat(messages, True, chat_template=template)
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True)
    assert text.startswith("[SYS] Answer briefly.\n[USER] What is 2+2?")
    assert ids == list(expected["input_ids"])


def test_info_facts_match_the_checkpoint(checkpoint_dir, hf, strata):
    assert strata.vocab_size == len(hf)
    assert strata.bos_token_id == hf.bos_token_id
    assert strata.eos_token_ids[0] == hf.eos_token_id
    configured = json.loads((checkpoint_dir / "generation_config.json").read_text())["eos_token_id"]
    configured = configured if isinstance(configured, list) else [configured]  # Llama-2 has one int
    assert set(strata.eos_token_ids) == {hf.eos_token_id, *configured}
    assert strata.has_chat_template


def test_llama2_template_refuses_what_transformers_refuses(sentencepiece_style_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(sentencepiece_style_dir))
    strata = CheckpointTokenizer.from_dir(sentencepiece_style_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]
    with pytest.raises(Exception, match="roles must alternate"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strata.encode_chat(messages, add_generation_prompt=True)


def test_llama3_style_checkpoint_facts(llama3_style_dir):
    strata = CheckpointTokenizer.from_dir(llama3_style_dir)
    assert strata.max_model_len == checkpoints.MODEL_MAX_LENGTH  # no config.json: from model_max_length
    assert strata.eos_token_ids == tuple(strata.backend.token_to_id(t) for t in (checkpoints.EOT, checkpoints.END))
    assert strata.encode("hi", True)[0] == strata.bos_token_id
    python_tag = strata.backend.token_to_id(checkpoints.CONFIG_ONLY_SPECIAL_TOKEN)
    assert python_tag == checkpoints.VOCAB_SIZE + 1  # appended at load, after the added token
    assert strata.decode([python_tag], skip_special_tokens=True) == ""


def test_tools_reach_the_template_as_transformers_passes_them(llama3_style_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(llama3_style_dir))
    strata = CheckpointTokenizer.from_dir(llama3_style_dir)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    ids, text = strata.encode_chat(messages, True, template_kwargs={"tools": tools})
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    assert '"name": "météo"' in text
    assert ids == list(expected["input_ids"])



def test_a_request_with_tools_renders_the_tool_use_template(llama3_style_dir, tmp_path):
    """A checkpoint with named templates (tokenizer_config.json's list, as Hermes-2-Pro's): a request with tools
    renders by "tool_use", one without by "default", as transformers' apply_chat_template picks them;
    --chat-template renders both. Tools went through "default", which does not show them."""
    from transformers import AutoTokenizer

    model_dir = shutil.copytree(llama3_style_dir, tmp_path / "named-templates")
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)  # it would be the only template
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}{% for m in messages %}[{{ m.content }}]{% endfor %}"},
    ]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    strata = CheckpointTokenizer.from_dir(model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Add 1 and 2"}]
    for kwargs in ({"tools": tools}, {}):
        _, text = strata.encode_chat(messages, False, template_kwargs=kwargs)
        assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert strata.encode_chat(messages, False, template_kwargs={"tools": tools})[1].startswith("TOOLS ")
    server = CheckpointTokenizer.from_dir(model_dir, "{{ messages[0].content }}")
    assert server.encode_chat(messages, False, template_kwargs={"tools": tools})[1] == "Add 1 and 2"

# Checkpoint variants: (base checkpoint fixture, file, keys to change). AutoTokenizer must load each
# as the service does: with LlamaTokenizer's rebuilt pipeline, or with tokenizer.json as written.
VARIANTS = {
    "legacy": ("sentencepiece_style_dir", "tokenizer_config.json", {"legacy": True}),  # "▁" after specials too
    "no_prefix_space": ("sentencepiece_style_dir", "tokenizer_config.json", {"add_prefix_space": False}),
    "bos_eos_flags": (  # ignored: tokenizer.json's post-processor decides
        "sentencepiece_style_dir", "tokenizer_config.json", {"add_bos_token": False, "add_eos_token": True}
    ),
    "mistral": ("sentencepiece_style_dir", "config.json", {"model_type": "mistral"}),  # tokenizer.json as is
    "byte_level_declared_llama": (  # tokenizer.json as is: LlamaTokenizer would make it Metaspace
        "llama3_style_dir", "tokenizer_config.json", {"tokenizer_class": "LlamaTokenizerFast"}
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_tokenizer_variants_match_transformers(request, tmp_path, variant):
    from transformers import AutoTokenizer

    base, file_name, changes = VARIANTS[variant]
    directory = shutil.copytree(request.getfixturevalue(base), tmp_path / "checkpoint")
    path = directory / file_name
    path.write_text(json.dumps((json.loads(path.read_text()) if path.is_file() else {}) | changes))
    hf = AutoTokenizer.from_pretrained(str(directory))
    strata = CheckpointTokenizer.from_dir(directory)
    specials = _special_tokens(hf)
    texts = parity_texts(specials, num_random=40) + [f"{specials[0]}[INST] Hi [/INST] Hello {specials[-1]} 中文 "]
    for add_special_tokens in (True, False):
        assert not _mismatches(texts, lambda t: strata.encode(t, add_special_tokens),
                               lambda t: hf.encode(t, add_special_tokens=add_special_tokens))[:5]
    id_lists = [tuple(hf.encode(text)) for text in texts]
    for skip_special_tokens in (False, True):
        assert not _mismatches(id_lists, lambda ids: strata.decode(list(ids), skip_special_tokens),
                               lambda ids: hf.decode(list(ids), skip_special_tokens=skip_special_tokens))[:5]


@pytest.mark.parametrize("legacy, add_eos_token", [(True, False), (False, True)])
def test_sentencepiece_model_variants_match_transformers(tmp_path, legacy, add_eos_token):
    """legacy (a dummy prefix after each special token too) and add_eos_token, read as LlamaTokenizer reads them."""
    from transformers import AutoTokenizer

    path = checkpoints.write_sentencepiece_model_checkpoint(tmp_path, legacy=legacy, add_eos_token=add_eos_token)
    hf, strata = AutoTokenizer.from_pretrained(str(path)), CheckpointTokenizer.from_dir(path)
    texts = parity_texts(_special_tokens(hf), num_random=60)
    assert not _mismatches(texts, lambda text: strata.encode(text, True), lambda text: hf.encode(text))[:5]
    assert strata.encode("x", True)[-1] == 2 if add_eos_token else strata.encode("x", True)[-1] != 2


def test_a_sentencepiece_unigram_model_is_refused_by_name(tmp_path):
    import sentencepiece

    path = checkpoints.write_sentencepiece_model_checkpoint(tmp_path)
    lines = [line for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(path / "tokenizer"),
                                             model_type="unigram", vocab_size=1200, minloglevel=2)
    with pytest.raises(ValueError, match="SentencePiece Unigram model; only BPE"):
        CheckpointTokenizer.from_dir(path)
