"""The service's tokenizer against transformers' AutoTokenizer, in process, on two different checkpoints."""

import json
import random

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
    generation_config = json.loads((checkpoint_dir / "generation_config.json").read_text())
    assert set(strata.eos_token_ids) == {hf.eos_token_id, *generation_config["eos_token_id"]}
    assert strata.has_chat_template


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
