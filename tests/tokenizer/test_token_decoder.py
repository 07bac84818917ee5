"""The checkpoint's decoding as the tokenizer hands it out (`TokenDecoder.to_proto`) and the gateway
rebuilds it (`from_proto`): for every kind of tokenizer the parity tests build (byte-level BPE, a
Llama-3 style one with added and config-only special tokens, a Llama-2 style one with byte fallback
and a rebuilt decoder), the rebuilt decoder decodes and detokenizes exactly as the service's own."""

import random

import pytest

from services.common.token_decoder import TokenDecoder

from .test_detokenizer import HARD_TEXTS


@pytest.fixture(scope="module")
def rebuilt(strata):
    return TokenDecoder.from_proto(strata.decoder.to_proto())


def test_the_rebuilt_decoder_has_the_same_vocabulary_and_id_sets(strata, rebuilt):
    assert rebuilt.backend.get_vocab_size(with_added_tokens=True) == strata.vocab_size
    assert rebuilt.special_ids == strata.decoder.special_ids and rebuilt.special_ids
    assert rebuilt.byte_fallback_ids == strata.decoder.byte_fallback_ids


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_the_rebuilt_decoder_detokenizes_as_the_original(strata, rebuilt, skip_special_tokens):
    rng = random.Random(3)
    specials = sorted(strata.decoder.special_ids)
    real = [strata.encode(text, False) for text in HARD_TEXTS]
    for _ in range(60):
        ids = [*rng.choice(real)]
        ids[rng.randrange(len(ids)):rng.randrange(len(ids))] = rng.choices(specials, k=2)
        ids += [rng.randrange(strata.vocab_size) for _ in range(rng.randint(0, 8))]
        prefix = rng.choice(real)[:rng.randint(0, 6)]
        original, copy = (decoder.detokenizer(skip_special_tokens, prefix) for decoder in (strata.decoder, rebuilt))
        assert [copy.step([i]) for i in ids] == [original.step([i]) for i in ids]
        assert copy.flush() == original.flush()
        assert rebuilt.decode(ids, skip_special_tokens) == strata.decode(ids, skip_special_tokens)


def test_an_id_past_the_vocabulary_decodes_to_nothing_as_in_transformers(rebuilt):
    """A model's vocabulary may be larger than its tokenizer's (Qwen2: 151,936 rows, 151,665 tokens):
    a sampled id the tokenizer lacks adds no text instead of failing the stream."""
    ids = rebuilt.backend.encode("ab", add_special_tokens=False).ids
    detokenizer = rebuilt.detokenizer(False)
    past_the_vocabulary = rebuilt.backend.get_vocab_size(with_added_tokens=True) + 7
    text = detokenizer.step([ids[0], past_the_vocabulary]) + detokenizer.step(ids[1:]) + detokenizer.flush()
    assert text == "ab"
