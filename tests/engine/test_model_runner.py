"""The model runner against Hugging Face on random tiny checkpoints, driven by hand-built steps:
several prompts of different lengths, chunked prefill under a token budget, and a prefix shared
through the same block ids."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine.attention.base import AttentionMetadata
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ScheduledChunk, SchedulerOutput

from .checkpoints import write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

BLOCK_SIZE = 4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CHECKPOINTS = {
    "llama-gqa-llama3-legacy": dict(arch="llama", legacy_rope=True, rope_scaling=LLAMA3_ROPE),
    "qwen2-bias-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "mistral": dict(arch="mistral"),
    "llama-head-dim-bias": dict(arch="llama", head_dim=32, attention_bias=True, mlp_bias=True),
    "llama-yarn-rope-parameters-sharded": dict(
        arch="llama", max_shard_size="100KB",
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    spec = dict(CHECKPOINTS[request.param])
    return write_checkpoint(tmp_path_factory.mktemp(request.param), spec.pop("arch"), **spec)


def make_runner(path, **overrides) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), block_size=BLOCK_SIZE, num_kv_blocks=96, enforce_eager=True,
                                    **overrides))


def drive(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int, token_budget: int,
          shared_prefix: tuple[int, int, int] | None = None) -> tuple[dict[str, list[int]], dict[str, list]]:
    """A minimal scheduler: each step runs every decode, then prompt chunks under ``token_budget``.
    ``shared_prefix=(owner, borrower, num_blocks)``: the borrower starts once the owner has computed
    those blocks, reusing them (its prompt starts with the same tokens). Returns each request's output
    tokens and the logits of each sampled step, recorded through ``compute_logits``."""
    blocks = list(range(runner.num_kv_blocks))
    random.Random(0).shuffle(blocks)
    requests, block_tables = [], {}
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
        requests.append(request)
        num_blocks = -(-(len(prompt) + max_new_tokens) // BLOCK_SIZE)
        block_tables[request.request_id] = [blocks.pop() for _ in range(num_blocks)]
    borrower = None
    if shared_prefix:
        owner, borrower_index, num_shared = shared_prefix
        owner, borrower = requests[owner], requests[borrower_index]
        block_tables[borrower.request_id][:num_shared] = block_tables[owner.request_id][:num_shared]
    logits_seen = {r.request_id: [] for r in requests}
    while any(r.num_output_tokens < max_new_tokens for r in requests):
        if borrower is not None and owner.num_computed_tokens >= num_shared * BLOCK_SIZE:
            borrower.num_computed_tokens = num_shared * BLOCK_SIZE  # a prefix-cache hit
            borrower = None
        budget, chunks = token_budget, []
        for request in sorted(requests, key=lambda r: r.num_computed_tokens < r.num_prompt_tokens):
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request is not borrower and num_new > 0 and request.num_output_tokens < max_new_tokens:
                chunks.append(ScheduledChunk(request, num_new, block_tables[request.request_id]))
                budget -= num_new
        step = SchedulerOutput(chunks)
        sampled, logits, _ = runner.compute_logits(step)
        logits = logits.clone()  # (valid until the runner's next step)
        output = runner.execute(step)  # recomputes the same K/V into the same slots
        assert set(output.sampled_token_ids) == {r.request_id for r in sampled}
        for request, row in zip(sampled, logits, strict=True):
            logits_seen[request.request_id].append(row)
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            if chunk.request.request_id in output.sampled_token_ids:
                chunk.request.append_output(output.sampled_token_ids[chunk.request.request_id])
    return {r.request_id: r.output_token_ids for r in requests}, logits_seen


@pytest.mark.slow  # HF parity over checkpoints
def test_greedy_matches_hf_generate_and_logits_match_hf_forward(checkpoint):
    torch.manual_seed(0)
    shared = torch.randint(3, 500, (12,)).tolist()
    prompts = [shared + torch.randint(3, 500, (9,)).tolist(),  # 21 tokens, 3 full blocks shared with r3
               torch.randint(3, 500, (5,)).tolist(),
               torch.randint(3, 500, (37,)).tolist(),  # split over several steps by the budget
               shared + torch.randint(3, 500, (3,)).tolist()]
    max_new = 16
    runner = make_runner(checkpoint)
    runner.warmup()
    outputs, logits_seen = drive(runner, prompts, max_new, token_budget=16, shared_prefix=(0, 3, 3))

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                   min_new_tokens=0, pad_token_id=0)[0, len(prompt):].tolist()
            full = torch.tensor([prompt + outputs[f"r{i}"]])
            hf_logits = hf(full).logits[0, len(prompt) - 1:-1]  # [max_new, vocab]
        assert outputs[f"r{i}"] == expected, f"request r{i}"
        ours = torch.stack(logits_seen[f"r{i}"])
        torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=1e-4)


def test_runner_reports_model_facts(tmp_path):
    path = write_checkpoint(tmp_path, "mistral", sliding_window=64, max_position_embeddings=256)
    runner = ModelRunner(EngineConfig(model=str(path), block_size=16, kv_cache_memory_bytes=1 << 20, max_num_seqs=2,
                                      enforce_eager=True))
    assert runner.max_model_len == 256  # the sliding window does not cap the context
    assert runner.vocab_size == 512 and runner.eos_token_ids == (2,)
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, block 16, 2 kv heads, head_dim 16, fp32
    assert runner.num_kv_blocks == min((1 << 20) // bytes_per_block, 2 * 256 // 16)
    assert runner.kv_caches[0][0].shape == (runner.num_kv_blocks, 16, 2, 16)

    # A pool that cannot hold the checkpoint's longest sequence: served shorter unless one was asked for
    fitted = ModelRunner(EngineConfig(model=str(path), block_size=16, kv_cache_memory_bytes=3 * bytes_per_block + 5,
                                      enforce_eager=True))
    assert fitted.max_model_len == 48 and fitted.num_kv_blocks == 3
    with pytest.raises(ValueError, match="holds 3 KV blocks of 16 tokens, 48 tokens, less than one request of 256 "
                                         "tokens .*estimated maximum model length is 48"):
        ModelRunner(EngineConfig(model=str(path), block_size=16, kv_cache_memory_bytes=3 * bytes_per_block,
                                 max_model_len=256))
    with pytest.raises(ValueError, match="holds 0 KV blocks"):
        ModelRunner(EngineConfig(model=str(path), block_size=16, kv_cache_memory_bytes=bytes_per_block - 1))


def test_an_engine_fitted_to_its_pool_serves_and_refuses_by_that_length(tmp_path):
    from services.common.errors import InvalidRequestError
    from services.engine.engine_core import EngineCore

    path = write_checkpoint(tmp_path, "llama", max_position_embeddings=256)
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    core = EngineCore(EngineConfig(model=str(path), block_size=16, kv_cache_memory_bytes=4 * bytes_per_block,
                                   enforce_eager=True))
    assert core.max_model_len == core.scheduler.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="maximum context length is 64 tokens"):
        core.validate(list(range(3, 67)), SamplingParams(max_tokens=1))
    core.add_request("fits", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    assert sum(len(o.new_token_ids) for o in outputs) == 24 and outputs[-1].finished


def test_kv_pools_lie_at_different_offsets_in_their_pages(tmp_path):
    # pools of 41 MB, which glibc would each map from a page start, all at the same offset (memory_arena)
    path = write_checkpoint(tmp_path, "llama")
    runner = ModelRunner(EngineConfig(model=str(path), block_size=16, num_kv_blocks=20_000, enforce_eager=True))
    pools = [pool for pair in runner.kv_caches for pool in pair]
    assert pools[0].numel() * pools[0].element_size() > 32 << 20  # glibc maps anything larger
    page_offsets = [pool.data_ptr() % 4096 for pool in pools]
    assert len(set(page_offsets)) == len(pools)
    assert not any(pool.any() for pool in pools)


def test_bfloat16_runner_tracks_float32(tmp_path):
    path = write_checkpoint(tmp_path, "llama")
    prompts = [list(range(3, 14)), list(range(20, 26))]
    outputs32, logits32 = drive(make_runner(path), prompts, 4, token_budget=64)
    outputs16, logits16 = drive(make_runner(path, dtype="bfloat16"), prompts, 4, token_budget=64)
    first32, first16 = logits32["r0"][0], logits16["r0"][0]
    assert first16.dtype == torch.float32
    torch.testing.assert_close(first16, first32, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_matches_dense_reference(dtype):
    """Decode and prefill rows over shuffled block tables against a plain per-request softmax attention."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 16, 8, 200
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, dtype)
    context_lens = [70, 5, 130, 0, 33]
    query_lens = [1, 1, 1, 19, 7]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    order = torch.randperm(num_blocks)
    tables, offset = [], 0
    for c, q in zip(context_lens, query_lens, strict=True):
        n = -(-(c + q) // block_size)
        tables.append(order[offset:offset + n])
        offset += n
    block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (c, q) in enumerate(zip(context_lens, query_lens, strict=True)) for p in range(c, c + q)]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    lens = torch.tensor(query_lens)
    metadata = AttentionMetadata(
        num_decodes=3, num_prefills=2, query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        seq_lens=torch.tensor(context_lens) + lens, context_lens=torch.tensor(context_lens),
        block_tables=block_tables, slot_mapping=torch.stack(slots), max_query_len=19, max_seq_len=130 + 1,
        block_size=block_size)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(metadata))

    k_slots = k_cache.view(-1, num_kv_heads, head_dim).float()
    v_slots = v_cache.view(-1, num_kv_heads, head_dim).float()
    row = 0
    for i, (c, n) in enumerate(zip(context_lens, query_lens, strict=True)):
        ctx = torch.stack([tables[i][p // block_size] * block_size + p % block_size for p in range(c + n)])
        keys = k_slots[ctx].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, heads, D]
        values = v_slots[ctx].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q[row:row + n].float(), keys) * head_dim ** -0.5
        causal = torch.arange(c + n).view(1, -1) <= (c + torch.arange(n)).view(-1, 1)  # [Q, S]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        expected = torch.einsum("hqs,shd->qhd", probs, values)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[row:row + n].float(), expected, atol=tol, rtol=tol)
        row += n
