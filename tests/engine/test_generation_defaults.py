"""generation_config.json's recommended sampling as the defaults of what a request leaves unset (vLLM's
`--generation-config auto`), and the engine's conversion of a request that leaves fields unset."""

import json

import pytest

from services.common.pb import engine_pb2
from services.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from services.engine.protocol import sampling_params_from_proto

# Qwen2.5-7B-Instruct's generation_config.json as published
QWEN_INSTRUCT = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                 "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                 "transformers_version": "4.37.0"}


def checkpoint(tmp_path, generation_config: dict | None):
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_the_checkpoints_recommended_sampling_is_read_and_nothing_else(tmp_path):
    defaults = load_generation_defaults(checkpoint(tmp_path, QWEN_INSTRUCT))
    assert defaults == GenerationDefaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
    assert defaults.max_tokens is None


def test_max_new_tokens_is_the_default_max_tokens_and_nulls_are_not_values(tmp_path):
    defaults = load_generation_defaults(checkpoint(tmp_path, {"max_new_tokens": 256, "temperature": None,
                                                              "min_p": 0.05, "top_k": 40.0}))
    assert defaults == GenerationDefaults({"top_k": 40, "min_p": 0.05}, max_tokens=256)
    assert isinstance(defaults.sampling["top_k"], int)


@pytest.mark.parametrize("generation_config", [None, {"bos_token_id": 1, "eos_token_id": [2, 0]}])
def test_a_checkpoint_without_a_recommendation_gets_none(tmp_path, generation_config):
    assert load_generation_defaults(checkpoint(tmp_path, generation_config)) == GenerationDefaults()


def test_vllm_source_ignores_the_file_and_a_folder_source_reads_its_own(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    checkpoint(model, QWEN_INSTRUCT)
    assert load_generation_defaults(model, "vllm") == GenerationDefaults()
    other = tmp_path / "other"
    other.mkdir()
    checkpoint(other, {"temperature": 0.2})
    assert load_generation_defaults(model, str(other)) == GenerationDefaults({"temperature": 0.2})
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        load_generation_defaults(model, str(tmp_path / "missing"))


def test_overrides_are_set_over_the_file(tmp_path):
    model = checkpoint(tmp_path, QWEN_INSTRUCT)
    defaults = load_generation_defaults(model, "auto", '{"temperature": 0.5, "max_new_tokens": 32}')
    assert defaults.sampling == {"temperature": 0.5, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert defaults.max_tokens == 32
    assert load_generation_defaults(model, "vllm", {"top_p": 0.9}) == GenerationDefaults({"top_p": 0.9})


@pytest.mark.parametrize("overrides, message", [
    ('{"presence_penalty": 1}', "presence_penalty cannot be set"),
    ("[1, 2]", "must be a JSON object"),
    ("{temperature: 1}", "must be a JSON object"),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be an integer of at least 1"),
])
def test_an_unusable_override_stops_the_start(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_generation_defaults(checkpoint(tmp_path, None), "auto", overrides)


def test_a_value_no_request_could_carry_names_the_file_and_the_way_out(tmp_path):
    model = checkpoint(tmp_path, {"top_p": 0.0})
    with pytest.raises(ValueError) as raised:
        load_generation_defaults(model)
    assert str(model / "generation_config.json") in str(raised.value)
    assert "top_p must be in (0, 1]" in str(raised.value) and "--generation-config vllm" in str(raised.value)


def request(**sampling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2],
                                      sampling=engine_pb2.SamplingParams(**sampling),
                                      stop=engine_pb2.StopCriteria(max_tokens=4))


def test_unset_fields_take_the_defaults_and_a_sent_value_wins_even_a_neutral_one():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    params = sampling_params_from_proto(request(), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    params = sampling_params_from_proto(request(temperature=1.0, top_k=0, seed=3), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, pytest.approx(0.8), 0, 3)
    neutral = sampling_params_from_proto(request())
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty) == (1.0, 1.0, 0, 1.0)
