"""Incremental detokenization: joined deltas equal Decode, no delta ends in half a character, O(window)."""

import random

import pytest

from services.common.detokenizer import IncrementalDetokenizer
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer

HARD_TEXTS = [
    "中文 café 😀 👨‍👩‍👧‍👦 🇫🇷", "你好，世界！日本語のテキスト한국어", "emoji👍in😀the🎉middle ❤️✨🔥", "Zażółć gęślą jaźń ∑π→",
]


@pytest.fixture(scope="module", params=["default_model_dir", "sentencepiece_style_dir"],
                ids=["byte_level", "byte_fallback"])
def tokenizer(request):
    """The built-in byte-level BPE, then the Llama-2-style BPE whose rare characters are <0xNN> tokens."""
    return CheckpointTokenizer.from_dir(request.getfixturevalue(request.param))


def _byte_ids(tokenizer, data: bytes) -> list[int]:
    """The ids of the single-byte tokens spelling `data`: <0xNN> (byte fallback), else GPT-2's alphabet."""
    if tokenizer.backend.token_to_id("<0x00>") is not None:
        return [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in data]
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [tokenizer.backend.token_to_id(byte_char[b]) for b in data]


def _partial_char_ids(tokenizer) -> list[int]:
    """Ids whose own text is not whole UTF-8: single bytes >= 0x80 and merges that split a character."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i], False)]


def _random_sequences(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    partial = _partial_char_ids(tokenizer)
    real = [tokenizer.encode(text, False) for text in HARD_TEXTS]
    sequences = []
    for _ in range(count):
        ids = []
        while len(ids) < rng.randint(1, 80):
            kind = rng.random()
            if kind < 0.4:
                ids += rng.choices(partial, k=rng.randint(1, 4))
            elif kind < 0.7:
                ids += rng.choice(real)[rng.randrange(4) :]
            elif kind < 0.95:
                ids.append(rng.randrange(tokenizer.vocab_size))
            else:
                ids.append(rng.choice(tokenizer.eos_token_ids))
        sequences.append(ids)
    return sequences


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.choice([0, 1, 1, 1, 2, 3, 5])
        chunks.append(ids[start : start + size])
        start += size
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_joined_deltas_equal_decode_and_never_split_a_character(tokenizer, skip_special_tokens):
    rng = random.Random(11)
    sequences = _random_sequences(tokenizer, 250, seed=int(skip_special_tokens))
    assert any("\ufffd" in tokenizer.decode(ids, skip_special_tokens) for ids in sequences)  # the hard case occurs
    for ids in sequences:
        detokenizer = tokenizer.decoder.detokenizer(skip_special_tokens)
        emitted = ""
        for chunk in _chunks(ids, rng):
            emitted += detokenizer.step(chunk)
            # What was emitted is exactly the final text of the ids it covers: no split character.
            assert emitted == tokenizer.decode(ids[: detokenizer.num_emitted_ids], skip_special_tokens), ids
        emitted += detokenizer.flush()
        assert emitted == tokenizer.decode(ids, skip_special_tokens), ids
        assert detokenizer.num_emitted_ids == len(ids)


def test_an_unfinished_character_is_held_until_complete(tokenizer):
    a, b = tokenizer.backend.token_to_id("a"), tokenizer.backend.token_to_id("b")
    ids = [a, *_byte_ids(tokenizer, "😀".encode()), b]
    assert tokenizer.decode(ids, False) == "a😀b"
    detokenizer = tokenizer.decoder.detokenizer(False)
    deltas = [detokenizer.step([i]) for i in ids]
    if tokenizer.decoder.byte_fallback_ids:  # a run of <0xNN> ids has its text once an id with text ends it
        assert deltas == ["a", "", "", "", "", "😀b"]
    else:
        assert deltas == ["a", "", "", "", "😀", "b"]
    assert detokenizer.num_emitted_ids == 6


def test_invalid_bytes_are_emitted_once_final(tokenizer):
    [lead] = _byte_ids(tokenizer, b"\xe4")
    detokenizer = tokenizer.decoder.detokenizer(False)
    deltas = [detokenizer.step([lead]) for _ in range(4)]
    if tokenizer.decoder.byte_fallback_ids:
        # ByteFallback decodes the run as a whole (one U+FFFD per byte when it is not UTF-8), so
        # its text is final once an id with text ends the run.
        assert deltas == ["", "", "", ""]
        assert detokenizer.step([tokenizer.backend.token_to_id("a")]) == "\ufffd" * 4 + "a"
    else:
        # Each lead byte is followed by another lead byte, so every one but the last is a final U+FFFD.
        assert deltas == ["", "\ufffd", "\ufffd", "\ufffd"]
        assert detokenizer.flush() == "\ufffd"


def test_skipped_special_tokens_neither_end_nor_split_a_byte_run(sentencepiece_style_dir):
    tokenizer = CheckpointTokenizer.from_dir(sentencepiece_style_dir)
    first, *rest = _byte_ids(tokenizer, "中".encode())
    ids = [first, tokenizer.eos_token_ids[0], *rest, tokenizer.backend.token_to_id("a")]
    for skip_special_tokens, expected in ((True, ["", "", "", "", "中a"]),
                                          (False, ["", "\ufffd</s>", "", "", "\ufffd\ufffda"])):
        detokenizer = tokenizer.decoder.detokenizer(skip_special_tokens)
        assert [detokenizer.step([i]) for i in ids] == expected
        assert "".join(expected) == tokenizer.decode(ids, skip_special_tokens)


def test_prefix_gives_context_but_no_text(tokenizer):
    prefix = tokenizer.encode("The prompt, 中文", False)
    ids = tokenizer.encode(" and the answer 😀", False)
    detokenizer = tokenizer.decoder.detokenizer(False, prefix)
    text = "".join(detokenizer.step([i]) for i in ids) + detokenizer.flush()
    assert text == " and the answer 😀"


def test_each_step_decodes_a_window_not_the_sequence(tokenizer):
    decoded_lengths = []

    def decode(ids):
        decoded_lengths.append(len(ids))
        return tokenizer.decode(ids, False)

    ids = tokenizer.encode(" ".join(HARD_TEXTS) * 50, False)
    assert len(ids) > 1000
    detokenizer = IncrementalDetokenizer(decode, byte_fallback_ids=tokenizer.decoder.byte_fallback_ids)
    text = "".join(detokenizer.step([i]) for i in ids) + detokenizer.flush()
    assert text == tokenizer.decode(ids, False)
    # The window also holds a run of byte-fallback ids until it ends (25 for the family emoji).
    assert max(decoded_lengths) <= 12 + _longest_run(ids, tokenizer.decoder.byte_fallback_ids)


def _longest_run(ids: list[int], members: frozenset[int]) -> int:
    longest = length = 0
    for i in ids:
        length = length + 1 if i in members else 0
        longest = max(longest, length)
    return longest
