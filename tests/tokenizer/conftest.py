import pytest

from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from tests.processes import TokenizerProcess

from .checkpoints import (
    write_llama3_style_checkpoint,
    write_sentencepiece_model_checkpoint,
    write_sentencepiece_style_checkpoint,
)


@pytest.fixture(scope="session")
def llama3_style_dir(tmp_path_factory):
    return write_llama3_style_checkpoint(tmp_path_factory.mktemp("llama3-style"))


@pytest.fixture(scope="session")
def templateless_dir(tmp_path_factory):
    return write_llama3_style_checkpoint(tmp_path_factory.mktemp("no-template"), with_chat_template=False)


@pytest.fixture(scope="session")
def sentencepiece_style_dir(tmp_path_factory):
    return write_sentencepiece_style_checkpoint(tmp_path_factory.mktemp("sentencepiece-style"))


@pytest.fixture(scope="session")
def sentencepiece_model_dir(tmp_path_factory):
    return write_sentencepiece_model_checkpoint(tmp_path_factory.mktemp("sentencepiece-model"))


PARITY_CHECKPOINTS = {"default": "default_model_dir", "llama3_style": "llama3_style_dir",
                      "sentencepiece_style": "sentencepiece_style_dir", "sentencepiece_model": "sentencepiece_model_dir"}


@pytest.fixture(scope="session", params=list(PARITY_CHECKPOINTS.values()), ids=list(PARITY_CHECKPOINTS))
def checkpoint_dir(request):
    """Each parity checkpoint in turn: the built-in model, the Llama-3-style and the Llama-2-style tokenizer,
    and a Llama-2-style one published as SentencePiece's tokenizer.model alone."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def hf(checkpoint_dir):
    """transformers' AutoTokenizer for the checkpoint: the reference the service must match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint_dir))


@pytest.fixture(scope="session")
def strata(checkpoint_dir):
    return CheckpointTokenizer.from_dir(checkpoint_dir)


@pytest.fixture(scope="session")
def default_server(default_model_dir, free_port_factory, tmp_path_factory):
    """The real service on the built-in model, trusting request templates (tests render their own),
    with its /metrics at ``server.metrics_url``."""
    log_path = tmp_path_factory.mktemp("logs") / "tokenizer-default.log"
    metrics_port = free_port_factory()
    with TokenizerProcess(default_model_dir, free_port_factory(), log_path,
                          extra_args=("--trust-request-chat-template", "--metrics-port", str(metrics_port))) as server:
        server.wait_serving()
        server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield server


@pytest.fixture(scope="session")
def templateless_server(templateless_dir, free_port_factory, tmp_path_factory):
    """The real service on a checkpoint without a chat template (request templates trusted)."""
    log_path = tmp_path_factory.mktemp("logs") / "tokenizer-no-template.log"
    with TokenizerProcess(templateless_dir, free_port_factory(), log_path,
                          extra_args=("--trust-request-chat-template",)) as server:
        server.wait_serving()
        yield server
