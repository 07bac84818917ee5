"""Compiled decode graphs (services/engine/compiled_forward.py) against the eager model: the same
logits for every bucket, padding included, in float32 and bfloat16, for decode-only and small mixed
steps; padding rows leave every request's KV blocks alone; no recompilation once captured; and eager
with one warning when there is no compiler or compilation fails."""

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from services.engine import compiled_forward
from services.engine.compiled_forward import DecodeGraphs, default_buckets
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import decode_forward
from services.engine.model_runner import ModelRunner
from services.engine.models.packed_linear import NATIVE_MAX_ROWS
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ScheduledChunk, SchedulerOutput

from .checkpoints import write_checkpoint
from .prefill import prefill_requests

pytestmark = [pytest.mark.slow,  # torch.compile graphs against eager
              pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 64
MAX_NUM_SEQS = 4  # buckets 1, 2, 4
# bfloat16: the fused loops keep float32 between ops that eager rounds to bfloat16 one by one, so the
# logits differ by a few bfloat16 steps (0.03 measured on a logit of 0.02, 2 of 512 entries)
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=5e-2)}


def test_default_buckets_follow_capture_sizes_up_to_max_num_seqs():
    assert default_buckets(1) == (1,)
    assert default_buckets(4) == (1, 2, 4)
    assert default_buckets(10) == (1, 2, 4, 8, 10)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_step():
    graphs = DecodeGraphs(lambda *args: None, None, (4, 1, 2, 8))
    assert graphs.buckets == (1, 2, 4, 8)
    assert [graphs.bucket_for(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Mistral with a window shorter than the contexts, so the windowed decode path is compiled too
    return write_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=12)


def make_runner(path, dtype: str, **overrides) -> ModelRunner:
    """A runner without the native step, which would otherwise serve every step a graph could here (so the
    runner would compile none): decode-only steps go to the graphs or the torch forward."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_forward, "unsupported_reason", lambda *args: "off: these tests run the graphs")
        return ModelRunner(EngineConfig(model=str(path), dtype=dtype, block_size=BLOCK_SIZE,
                                        num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS, **overrides))


def compiled_and_eager(path, dtype: str) -> tuple[ModelRunner, ModelRunner]:
    """(compiled runner, eager runner) of one dtype over the same weights."""
    compiled = make_runner(path, dtype)
    compiled.warmup()
    assert compiled.is_captured
    return compiled, make_runner(path, dtype, enforce_eager=True)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runners(request, checkpoint, inductor_cache_dir):
    return compiled_and_eager(checkpoint, request.param)


def prefilled_requests(runners: tuple[ModelRunner, ModelRunner], prompt_lens: list[int]
                       ) -> tuple[list[Request], list[list[int]]]:
    """Requests whose prompts (longer than any bucket, so prefilled eager) are in both runners' caches."""
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompt_lens))]
    return prefill_requests(runners, prompt_lens, tables), tables


def assert_same_step(runners: tuple[ModelRunner, ModelRunner], step: SchedulerOutput, dtype: torch.dtype) -> None:
    """The compiled runner's logits and request KV blocks equal the eager runner's."""
    (sampled, logits, _), (sampled_eager, logits_eager, _) = (runner.compute_logits(step) for runner in runners)
    assert sampled == sampled_eager
    torch.testing.assert_close(logits, logits_eager, **TOLERANCE[dtype])
    compiled, eager = runners
    for (k, v), (k_eager, v_eager) in zip(compiled.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(k[:NUM_KV_BLOCKS], k_eager, **TOLERANCE[dtype])
        torch.testing.assert_close(v[:NUM_KV_BLOCKS], v_eager, **TOLERANCE[dtype])


def assert_decode_steps_match_eager(runners: tuple[ModelRunner, ModelRunner], dtype: torch.dtype) -> None:
    """Steps of 1, 2 and 3 decodes (buckets 1, 2 and 4) give the eager logits, with no recompilation."""
    requests, tables = prefilled_requests(runners, [13, 21, 9])
    graphs_before = counters["stats"]["unique_graphs"]
    for num_decodes in (1, 2, 3):
        step = SchedulerOutput([ScheduledChunk(r, 1, t) for r, t in zip(requests[:num_decodes], tables)])
        assert_same_step(runners, step, dtype)
    assert counters["stats"]["unique_graphs"] == graphs_before


@pytest.mark.parametrize("num_decodes", [1, 2, 3, 4])  # 3 runs bucket 4 with a padding row
def test_decode_steps_match_eager(runners, num_decodes):
    compiled, _ = runners
    requests, tables = prefilled_requests(runners, [13, 21, 9, 17][:num_decodes])
    graphs_before = counters["stats"]["unique_graphs"]
    for _ in range(3):
        step = SchedulerOutput([ScheduledChunk(r, 1, t) for r, t in zip(requests, tables)])
        assert compiled.graphs.bucket_for(step.num_batched_tokens) is not None
        assert_same_step(runners, step, compiled.dtype)
        for request in requests:
            request.num_computed_tokens += 1
            request.append_output(5)
    assert counters["stats"]["unique_graphs"] == graphs_before  # no recompilation


def test_small_mixed_step_matches_eager(runners):
    """One decode and a 2-token prompt chunk: 3 tokens, bucket 4, padded by a padding prefill."""
    compiled, _ = runners
    (decoding,), (table,) = prefilled_requests(runners, [15])
    prompt = Request("p", [11, 12, 13, 14, 15], SamplingParams(temperature=0.0))
    prompt.num_computed_tokens = 3
    step = SchedulerOutput([ScheduledChunk(decoding, 1, table), ScheduledChunk(prompt, 2, [40, 41])])
    assert compiled.graphs.bucket_for(step.num_batched_tokens) == 4
    assert_same_step(runners, step, compiled.dtype)


def test_graphs_compile_with_the_projections_on_onednn(checkpoint, inductor_cache_dir, monkeypatch):
    """Without the native linear kernel every projection runs on oneDNN's prepacked weights: the graphs
    still compile and match eager."""
    from services.engine.cpu_kernels import linear as native_linear

    monkeypatch.setattr(native_linear, "can_run", lambda dtype: False)
    assert_decode_steps_match_eager(compiled_and_eager(checkpoint, "float32"), torch.float32)


def test_graphs_split_where_the_projections_switch_kernels(checkpoint, inductor_cache_dir, monkeypatch):
    """Buckets on both sides of ``NATIVE_MAX_ROWS`` (64 by default: --max-num-seqs above it) compile, as
    graphs split at the switch, and match eager; here the switch is moved to 2 rows."""
    from services.engine.models import packed_linear

    monkeypatch.setattr(packed_linear, "NATIVE_MAX_ROWS", 2)
    assert_decode_steps_match_eager(compiled_and_eager(checkpoint, "float32"), torch.float32)


def test_no_compiler_runs_eager_with_one_warning(checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(compiled_forward, "compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        runner = make_runner(checkpoint, "float32")
    assert runner.graphs is None
    assert [r.message for r in caplog.records if r.levelno == logging.WARNING] == [
        "no C++ compiler found (g++, c++, clang++ or $CXX): decode steps run eager, without compiled graphs "
        "(slower); install one, or pass --enforce-eager to silence this"]


def test_failed_compilation_runs_eager_with_a_warning(checkpoint, monkeypatch, caplog):
    runner = make_runner(checkpoint, "float32")

    def fail(run_padding_step):
        raise RuntimeError("no cpp headers")

    monkeypatch.setattr(runner.graphs, "capture", fail)
    with caplog.at_level(logging.WARNING):
        runner.warmup()
    assert not runner.is_captured
    assert [r.message for r in caplog.records if r.levelno == logging.WARNING] == [
        "compiling the decode graphs failed: the model runs eager"]


def test_no_graphs_where_the_native_step_serves_every_small_step(checkpoint, caplog):
    """In float32 the native step runs decode steps and mixed steps alike (its prefill attention is the
    torch forward's): graphs would serve none of them, so none are built, up to ``NATIVE_MAX_ROWS``
    requests; a larger ``--max-num-seqs`` has decode steps the native step does not take."""
    config = dict(model=str(checkpoint), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    with caplog.at_level(logging.INFO, logger="services.engine.model_runner"):
        runner = ModelRunner(EngineConfig(**config, max_num_seqs=NATIVE_MAX_ROWS))
    if runner.decode_step is None:
        pytest.skip("the native step is not built here")
    assert runner.prompt_steps_run_natively and runner.graphs is None
    assert any(r.message.startswith("no compiled graphs: the native step serves") for r in caplog.records)
    assert runner.kv_caches[0][0].shape[0] == NUM_KV_BLOCKS  # no scratch block
    runner.warmup()
    assert not runner.is_captured
    wider = ModelRunner(EngineConfig(**config, max_num_seqs=NATIVE_MAX_ROWS + 1))
    assert isinstance(wider.graphs, DecodeGraphs) and wider.graphs.buckets[-1] == NATIVE_MAX_ROWS + 1


def test_enforce_eager_builds_no_graphs(checkpoint):
    runner = make_runner(checkpoint, "float32", enforce_eager=True)
    runner.warmup()
    assert runner.graphs is None and not runner.is_captured
    assert runner.kv_caches[0][0].shape[0] == NUM_KV_BLOCKS  # no scratch block


def test_a_step_on_a_resized_team_runs_the_graph_compiled_at_start(runners):
    """The thread governor resizes the team under load; dynamo guards compiled code on the thread count,
    so a graph step on another count compiled the whole forward again in the middle of serving. It runs
    on the captured count instead, and the governed count is back for the steps after it."""
    compiled, _ = runners
    captured = compiled.graphs.num_threads
    governed = 1 if captured > 1 else 2
    (decoding,), (table,) = prefilled_requests(runners, [15])
    prompt = Request("q", [11, 12, 13, 14, 15, 16], SamplingParams(temperature=0.0))
    prompt.num_computed_tokens = 2
    step = SchedulerOutput([ScheduledChunk(decoding, 1, table), ScheduledChunk(prompt, 4, [50, 51])])
    graphs_before = counters["stats"]["unique_graphs"]
    torch.set_num_threads(governed)
    try:
        assert_same_step(runners, step, compiled.dtype)
        assert torch.get_num_threads() == governed
    finally:
        torch.set_num_threads(captured)
    assert counters["stats"]["unique_graphs"] == graphs_before  # no recompilation
