"""--model as vLLM takes it: a directory as is, a Hugging Face Hub id from the local Hugging Face cache
(offline here: the cache is laid out as huggingface_hub lays it out), and clear errors otherwise."""

import shutil

import pytest

from services.common.model_source import resolve_model_dir

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, default_model_dir):
    """An offline Hugging Face cache holding the built-in model as "strata-test/tiny"."""
    cache = tmp_path / "hub"
    repo = cache / "models--strata-test--tiny"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for file in default_model_dir.iterdir():
        shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_directory_is_itself(default_model_dir):
    assert resolve_model_dir(str(default_model_dir)) == str(default_model_dir)


def test_a_hub_id_is_its_cached_snapshot(hub_cache):
    assert resolve_model_dir("strata-test/tiny") == str(hub_cache)


@pytest.mark.parametrize("model, message", [
    ("strata-test/not-cached", "not in the Hugging Face cache and not downloadable here"),
    ("./no/such/dir", "no such directory"),
    ("a/b/c", "no such directory"),
])
def test_what_cannot_be_found_says_what_to_do(hub_cache, model, message):
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(model)


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a file; it takes a Hugging Face checkpoint directory"):
        resolve_model_dir(str(tmp_path / "model.gguf"))
