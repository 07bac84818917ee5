import json
from collections import Counter

import pytest

from services.bench.datasets import DatasetSpec, load_conversations, sample_requests


def test_random_token_ids_have_exact_lengths_within_the_vocab():
    spec = DatasetSpec(input_len=50, output_len=20, range_ratio=0.2, vocab_size=100)
    requests = sample_requests(spec, 200, seed=1)
    assert len(requests) == 200
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 40 <= r.prompt_len <= 60 and 16 <= r.output_len <= 24
        assert all(0 <= t < 100 for t in r.prompt)
    assert len({r.prompt_len for r in requests}) > 5
    assert sample_requests(spec, 200, seed=1) == requests
    assert sample_requests(spec, 200, seed=2) != requests


def test_outputs_can_take_their_own_range_ratio():
    # issue #9's load: prompts of 64-511 tokens, outputs of 64-256
    spec = DatasetSpec(input_len=288, output_len=160, range_ratio=0.7777, output_range_ratio=0.6)
    requests = sample_requests(spec, 2000, seed=0)
    assert min(r.prompt_len for r in requests) == 64 and max(r.prompt_len for r in requests) == 511
    assert min(r.output_len for r in requests) == 64 and max(r.output_len for r in requests) == 256
    with pytest.raises(ValueError, match="--random-output-range-ratio"):
        DatasetSpec(output_range_ratio=1.0)


def test_range_ratio_zero_gives_fixed_lengths_and_text_has_one_word_per_token():
    spec = DatasetSpec(token_ids=False, input_len=30, output_len=7)
    for r in sample_requests(spec, 20, seed=0):
        assert isinstance(r.prompt, str) and len(r.prompt.split()) == 30
        assert (r.prompt_len, r.output_len) == (30, 7)


def test_chat_requests_are_messages():
    spec = DatasetSpec(chat=True, token_ids=False, input_len=5)
    r = sample_requests(spec, 1, seed=0)[0]
    assert r.prompt is None
    assert [m["role"] for m in r.messages] == ["user"] and len(r.messages[0]["content"].split()) == 5


def test_fixed_repeats_one_prompt():
    requests = sample_requests(DatasetSpec(name="fixed", input_len=10, output_len=3), 5, seed=0)
    assert len(set(map(tuple, (r.prompt for r in requests)))) == 1 and len(requests[0].prompt) == 10


def test_shared_prefix_groups_users_under_k_system_prompts_in_random_order():
    spec = DatasetSpec(name="shared-prefix", prefix_num=3, prefix_len=8, suffix_len=4, output_len=5)
    requests = sample_requests(spec, 12, seed=0)
    assert all(len(r.prompt) == 12 == r.prompt_len for r in requests)
    prefixes = [tuple(r.prompt[:8]) for r in requests]
    assert sorted(Counter(prefixes).values()) == [4, 4, 4]
    assert len({tuple(r.prompt[8:]) for r in requests}) == 12  # every user has their own question
    round_robin = [prefixes[0], prefixes[1], prefixes[2]] * 4
    assert prefixes != round_robin
    chat = sample_requests(DatasetSpec(name="shared-prefix", chat=True, token_ids=False, prefix_num=2,
                                       prefix_len=6, suffix_len=3), 4, seed=0)
    assert all([m["role"] for m in r.messages] == ["system", "user"] for r in chat)
    assert len({r.messages[0]["content"] for r in chat}) == 2


def test_custom_sharegpt_and_jsonl(tmp_path):
    sharegpt = tmp_path / "conv.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2+2?"},
                           {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]))
    assert load_conversations(sharegpt) == [("Be brief.", "What is 2+2?", 10)]
    spec = DatasetSpec(name="custom", chat=True, token_ids=False, dataset_path=str(sharegpt))
    requests = sample_requests(spec, 3, seed=0)  # one usable entry, reused
    assert len(requests) == 3 and requests[0].output_len == 10
    assert requests[0].messages == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 2+2?"}]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "hello there", "output_tokens": 12}\n{"prompt": "bye"}\n')
    spec = DatasetSpec(name="custom", token_ids=False, dataset_path=str(jsonl), output_len=99)
    pairs = sorted((r.prompt, r.output_len) for r in sample_requests(spec, 2, seed=0))
    assert pairs == [("bye", 99), ("hello there", 12)]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no usable prompts"):
        load_conversations(empty)


def test_spec_validation_says_what_to_do():
    with pytest.raises(ValueError, match="--prompt-format text"):
        DatasetSpec(chat=True, token_ids=True)
    with pytest.raises(ValueError, match="--dataset-path"):
        DatasetSpec(name="custom")
    with pytest.raises(ValueError, match="range-ratio"):
        DatasetSpec(range_ratio=1.0)
