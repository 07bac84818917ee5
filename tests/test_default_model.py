"""The built-in default checkpoint: deterministic, loadable by transformers, built once."""

import hashlib
import json

import pytest

from services.default_model import cli as model_cli
from services.default_model.model import MODEL_NAME, SPECIAL_TOKENS, build_default_model, ensure_default_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _hashes(directory) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in sorted(FILES)}


def test_build_is_deterministic(tmp_path, default_model_dir):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    build_default_model(first)
    build_default_model(second)
    assert sorted(p.name for p in first.iterdir()) == FILES
    assert _hashes(first) == _hashes(second) == _hashes(default_model_dir)


def test_a_different_seed_changes_only_the_weights(tmp_path, default_model_dir):
    build_default_model(tmp_path, seed=1)
    changed = {name for name, digest in _hashes(tmp_path).items() if digest != _hashes(default_model_dir)[name]}
    assert changed == {"model.safetensors"}


def test_transformers_loads_tokenizer_and_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model, loading = AutoModelForCausalLM.from_pretrained(default_model_dir, output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    config = json.loads((default_model_dir / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == 4096
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(3)] == list(SPECIAL_TOKENS)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    text = "Hello, wörld! 中文 😀\n  code()"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode(text)])).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.softmax(-1).max() > 0.05  # peaked, not uniform


def test_ensure_is_a_no_op_when_present(default_model_dir):
    cache_dir = default_model_dir.parent.parent
    before = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    assert ensure_default_model(cache_dir) == default_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == before
    assert [p.name for p in default_model_dir.parent.iterdir()] == [MODEL_NAME]  # no temporary leftovers


def test_cli_init_prints_the_path_and_force_rebuilds(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "from-env"))
    assert model_cli.main(["init"]) == 0
    path = tmp_path / "from-env" / "models" / MODEL_NAME
    assert capsys.readouterr().out.strip() == str(path)
    (path / "marker").write_text("stale")
    assert model_cli.main(["init", "--dir", str(path)]) == 0
    assert (path / "marker").exists()
    assert model_cli.main(["init", "--dir", str(path), "--force"]) == 0
    assert not (path / "marker").exists() and _hashes(path)
    assert [p.name for p in path.parent.iterdir()] == [MODEL_NAME]


def test_cli_init_dir_is_the_model_directory_itself(tmp_path, capsys, default_model_dir):
    target = tmp_path / "my-model"
    assert model_cli.main(["init", "--dir", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert _hashes(target) == _hashes(default_model_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model"]  # nothing beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert model_cli.main(["init", "--dir", str(empty)]) == 0 and _hashes(empty) == _hashes(default_model_dir)


def test_cli_init_refuses_a_directory_holding_something_else(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        model_cli.main(["init", "--dir", str(tmp_path), "--force"])
    assert exit_info.value.code == 2 and "is not the built-in model" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
