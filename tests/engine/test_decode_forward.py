"""The native decode step (services/engine/cpu_kernels/decode_forward.py) against the torch forward
of the same weights: the same hidden states and the same K/V written, for Llama (biases everywhere),
Qwen2 (q/k/v bias, tied embeddings) and Mistral (sliding window), float32 and bfloat16, batches with
short and long contexts (split across threads and merged), and steps with prompt chunks beside the
decoding requests; the runner routes every step to it but those gathering prompt logprobs."""

import os

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.cpu_kernels import decode_forward
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ScheduledChunk, SchedulerOutput

from .checkpoints import write_checkpoint
from .prefill import prefill_requests

pytestmark = pytest.mark.skipif(decode_forward._kernel() is None, reason="no C++ compiler for the native kernels")

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 256
ARCHS = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(tie_word_embeddings=True),
    "mistral": dict(num_key_value_heads=1, sliding_window=12, head_dim=32),  # 32: bfloat16 prompts on AMX tiles
}
# float32: the norms' sums in another order; bfloat16: that, one rounding step away now and then
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **ARCHS[request.param])


def make_runner(path, dtype: str) -> ModelRunner:
    """``dtype`` "int8": bfloat16 with int8 weights (``--quantization int8``)."""
    quantization = "int8" if dtype == "int8" else None
    return ModelRunner(EngineConfig(model=str(path), dtype="bfloat16" if quantization else dtype,
                                    quantization=quantization, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
                                    enforce_eager=True))


def prefill(runners: list[ModelRunner], prompt_lens: list[int]) -> tuple[list[Request], list[list[int]]]:
    """Requests whose prompts are in every runner's cache, each with one sampled token to decode, and
    their block tables (room for a few more tokens each)."""
    tables, first = [], 0
    for length in prompt_lens:
        num_blocks = -(-(length + 4) // BLOCK_SIZE)
        tables.append(list(range(first, first + num_blocks)))
        first += num_blocks
    return prefill_requests(runners, prompt_lens, tables), tables


@pytest.mark.slow  # parity over three architectures
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("min_chunk_tokens", [256, 4])  # 4: every context split in chunks, then merged
# 4 rows; 21 rows, where bfloat16 projections take AMX tiles if the CPU has them (16 rows and a tail)
@pytest.mark.parametrize("prompt_lens", [[1, 7, 30, 150], list(range(1, 64, 3))], ids=["4rows", "21rows"])
def test_native_step_matches_the_torch_forward(checkpoint, dtype, min_chunk_tokens, prompt_lens):
    native, torch_forward = make_runner(checkpoint, dtype), make_runner(checkpoint, dtype)
    assert native.decode_step is not None
    native.decode_step.min_chunk_tokens = min_chunk_tokens
    torch_forward.decode_step = None
    requests, tables = prefill([native, torch_forward], prompt_lens)
    for _ in range(3):
        step = SchedulerOutput([ScheduledChunk(r, 1, t) for r, t in zip(requests, tables)])
        (_, logits, _), (_, expected, _) = native.compute_logits(step), torch_forward.compute_logits(step)
        torch.testing.assert_close(logits, expected, **TOLERANCE[native.dtype])
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        for request in requests:
            request.num_computed_tokens += 1
            request.append_output(int(expected[0].argmax()))
    for (k, v), (k_expected, v_expected) in zip(native.kv_caches, torch_forward.kv_caches, strict=True):
        torch.testing.assert_close(k, k_expected, **TOLERANCE[native.dtype])
        torch.testing.assert_close(v, v_expected, **TOLERANCE[native.dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0], []], ids=["all", "some-reordered", "none"])
def test_logits_in_the_native_call_are_the_heads_on_its_hidden_states(checkpoint, dtype, rows):
    """``DecodeStep.logits`` runs the model's head inside the step, on the rows asked for (a step's
    one-token prefill chunks do not sample): the same numbers as ``compute_logits`` on the step's
    hidden states, rounded to the model's dtype the same way."""
    runner = make_runner(checkpoint, dtype)
    step = runner.decode_step
    requests, tables = prefill([runner], [5, 17, 40])
    batch = runner._prepare([ScheduledChunk(r, 1, t) for r, t in zip(requests, tables)])
    md = batch.metadata
    inputs = (batch.input_ids, batch.positions, md.slot_mapping, md.block_tables, md.seq_lens)
    picked = torch.tensor(rows, dtype=torch.int64)
    logits = step.logits(*inputs, picked)
    assert logits.shape == (len(rows), runner.vocab_size) and logits.dtype == torch.float32
    assert torch.equal(logits, runner.model.compute_logits(step(*inputs).index_select(0, picked)))


def test_the_native_steps_rows_are_the_general_batchs(checkpoint):
    """``_prepare_rows`` (the native step's inputs, built row by row) gives what ``_prepare`` gives for the
    same one-token chunks, a chunk that does not sample (one token of a longer prompt) included, and
    refuses a request whose blocks cannot hold its next token, as ``_prepare`` does."""
    runner = make_runner(checkpoint, "float32")
    requests, tables = prefill([runner], [5, 17, 40])
    chunked = Request("chunked", list(range(3, 13)), SamplingParams(temperature=0.0))
    chunked.num_computed_tokens = 4  # token 5 of 10: this step does not sample it
    chunks = [ScheduledChunk(r, 1, t) for r, t in zip(requests, tables)] + [ScheduledChunk(chunked, 1, [60, 61, 62])]
    batch, rows = runner._prepare(chunks), runner._prepare_rows(chunks)
    md = batch.metadata
    for name, expected in (("input_ids", batch.input_ids), ("positions", batch.positions),
                           ("slot_mapping", md.slot_mapping), ("block_tables", md.block_tables),
                           ("seq_lens", md.seq_lens), ("sample_rows", batch.sample_rows)):
        assert torch.equal(getattr(rows, name), expected), name
    assert rows.sample_requests == batch.sample_requests == requests
    full = Request("full", [1] * BLOCK_SIZE, SamplingParams(temperature=0.0))
    full.num_computed_tokens = BLOCK_SIZE  # its one block is full: the next token has no slot
    with pytest.raises(ValueError, match="'full' reaches"):
        runner._prepare_rows([ScheduledChunk(full, 1, [7])])


def test_the_runner_routes_decode_and_prompt_steps_to_the_native_step(checkpoint, monkeypatch):
    runner = make_runner(checkpoint, "float32")
    calls = []
    logits = runner.decode_step.logits
    monkeypatch.setattr(runner.decode_step, "logits",
                        lambda *args: calls.append((args[0].shape[0], len(args) == 7)) or logits(*args))
    (decoding,), (table,) = prefill([runner], [9])
    assert calls == [(9, True)]  # the prefill: 9 prompt rows
    runner.compute_logits(SchedulerOutput([ScheduledChunk(decoding, 1, table)]))
    assert calls[-1] == (1, False)  # decode only: no prompt chunks
    prompt = Request("p", [3, 4, 5], SamplingParams(temperature=0.0))
    runner.compute_logits(SchedulerOutput([ScheduledChunk(decoding, 1, table), ScheduledChunk(prompt, 3, [90])]))
    assert calls[-1] == (4, True)  # a mixed step: one decode row and a chunk of three
    gathering = Request("g", [3, 4, 5], SamplingParams(temperature=0.0, prompt_logprobs=1))
    runner.compute_logits(SchedulerOutput([ScheduledChunk(gathering, 3, [91])]))
    assert len(calls) == 3  # prompt logprobs need every row's hidden state: the torch forward
    runner.decode_step.max_rows = 2  # more rows than its arena may hold: the torch forward
    runner.compute_logits(SchedulerOutput([ScheduledChunk(Request("q", [6, 7, 8], SamplingParams()), 3, [92])]))
    assert len(calls) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_the_arena_holds_what_arena_bytes_per_row_says(checkpoint, dtype):
    """``arena_bytes_per_row`` is what bounds a step's rows (``max_rows``): a prompt step of R rows takes
    at most R times it, beside the head's few rows, and in float32 (x's packed copies at 4 bytes, as
    counted) not much less."""
    runner = make_runner(checkpoint, dtype)
    step = runner.decode_step
    per_row = decode_forward.arena_bytes_per_row(runner.model_config, runner.dtype)
    assert step.max_rows == max(64, min(decode_forward.MAX_NATIVE_ROWS, decode_forward.MAX_ARENA_BYTES // per_row))
    rows = 200
    prompt = Request("p", [(5 * j) % 400 + 2 for j in range(rows)], SamplingParams(temperature=0.0))
    runner.compute_logits(SchedulerOutput([ScheduledChunk(prompt, rows, list(range(-(-rows // BLOCK_SIZE))))]))
    mc = runner.model_config
    head = 2 * 16 * (mc.hidden_size + 1) * 4 + 64 * 64  # the head's packed rows, and each buffer's alignment
    assert step._arena.num_bytes <= rows * per_row + head
    if dtype == "float32":
        assert step._arena.num_bytes >= 0.95 * rows * per_row


@pytest.mark.slow  # parity over three architectures
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_steps_with_prompt_chunks_match_the_torch_forward(checkpoint, dtype):
    """Prompt chunks beside decoding requests in one native step: a whole prompt, the middle chunk of a
    longer one (its first chunk cached, its last to come, so it does not sample), a one-token chunk
    (which the batch puts with the decodes) and prompts longer than the sliding window, against the torch
    forward: the same logits and the same K/V written, over a few steps."""
    native, torch_forward = make_runner(checkpoint, dtype), make_runner(checkpoint, dtype)
    torch_forward.decode_step = None
    assert native.prompt_steps_run_natively or dtype != "float32"  # bfloat16 keeps SDPA on a CPU with AMX
    if not native.prompt_steps_run_natively:
        pytest.skip("bfloat16 prefill attention runs SDPA on this CPU")
    decoding, tables = prefill([native, torch_forward], [3, 30, 70])
    prompts = [Request(f"p{i}", [(11 * i + 5 * j) % 400 + 2 for j in range(n)], SamplingParams(temperature=0.0))
               for i, n in enumerate((45, 61, 17))]
    prompt_tables = [list(range(200 + 20 * i, 220 + 20 * i)) for i in range(len(prompts))]
    first_chunks = (45, 20, 16)  # whole; 20 of 61, then 25, then 16; 16 of 17, then the last one alone
    for step_number in range(3):
        chunks = [ScheduledChunk(r, 1, t) for r, t in zip(decoding, tables)]
        for request, table, first in zip(prompts, prompt_tables, first_chunks):
            left = request.num_prompt_tokens - request.num_computed_tokens
            if left > 0:
                size = first if step_number == 0 else min(left, 25)
                chunks.append(ScheduledChunk(request, size, table))
        step = SchedulerOutput(chunks)
        (requests, logits, _), (expected_requests, expected, _) = (native.compute_logits(step),
                                                                   torch_forward.compute_logits(step))
        assert requests == expected_requests
        torch.testing.assert_close(logits, expected, **TOLERANCE[native.dtype])
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            if chunk.request.num_computed_tokens >= chunk.request.num_tokens:
                chunk.request.append_output(int(expected[requests.index(chunk.request)].argmax()))
    for (k, v), (k_expected, v_expected) in zip(native.kv_caches, torch_forward.kv_caches, strict=True):
        torch.testing.assert_close(k, k_expected, **TOLERANCE[native.dtype])
        torch.testing.assert_close(v, v_expected, **TOLERANCE[native.dtype])


def test_unsupported_dtype_keeps_the_torch_forward(checkpoint):
    assert make_runner(checkpoint, "float16").decode_step is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("min_chunk_tokens", [256, 4])  # 4: contexts split in chunks, then merged
def test_more_threads_than_cores_compute_the_same_bits(checkpoint, dtype, min_chunk_tokens):
    """Threads beyond the cores are taken away by the OS all the time, mid-step: a phase then ends
    without them (work_split.h's ProgressSplit), a run of items one held for long is taken over by
    the threads still running (test_work_split.py), and it catches up later. Each work item is
    computed the same way whichever thread takes it, and twice where it was taken over, so the step's
    output is the same bits every time: with contexts too short to split, the same bits as on one
    thread."""
    runner = make_runner(checkpoint, dtype)
    runner.decode_step.min_chunk_tokens = min_chunk_tokens
    prompt_lens = list(range(1, 40, 3))
    requests, tables = prefill([runner], prompt_lens)
    step = SchedulerOutput([ScheduledChunk(r, 1, t) for r, t in zip(requests, tables)])
    batch = runner._prepare(step.chunks)
    md = batch.metadata

    def hidden() -> torch.Tensor:
        return runner.decode_step(batch.input_ids, batch.positions, md.slot_mapping, md.block_tables, md.seq_lens)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = hidden()
        torch.set_num_threads(2 * len(os.sched_getaffinity(0)) + 1)
        first = hidden()
        if min_chunk_tokens > max(prompt_lens) + 1:  # no context split: the same work items as one thread's
            assert torch.equal(first, alone)
        else:
            torch.testing.assert_close(first, alone, **TOLERANCE[runner.dtype])
        for _ in range(30):
            assert torch.equal(hidden(), first)
    finally:
        torch.set_num_threads(threads)


def _threads_on_one_core(core: int) -> int:
    """This process's threads whose CPU affinity is ``core`` alone."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as status:
                allowed = next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            continue
        count += allowed == str(core)
    return count


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binds threads to two cores")
def test_threads_bound_one_per_core_compute_the_same_bits_and_give_the_caller_its_cores_back(checkpoint):
    """core_binding.h: a step on two threads binds OpenMP's other thread to the second core for good and
    the calling thread to the first for the step only, then gives it its mask back (threads and
    processes it starts later inherit that)."""
    runner = make_runner(checkpoint, "float32")
    # the second core first: an engine's own order binds OpenMP's other thread to the second, so no thread
    # of this process sits on the first alone before these steps (the caller is only bound for a step)
    cores = tuple(sorted(os.sched_getaffinity(0)))[1::-1]
    bound = decode_forward.DecodeStep(runner.model, runner.kv_caches, runner.attention.scale, thread_cores=cores)
    free = decode_forward.DecodeStep(runner.model, runner.kv_caches, runner.attention.scale)
    requests, tables = prefill([runner], list(range(1, 40, 3)))
    batch = runner._prepare(SchedulerOutput([ScheduledChunk(r, 1, t) for r, t in zip(requests, tables)]).chunks)
    md = batch.metadata
    mask = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = free(batch.input_ids, batch.positions, md.slot_mapping, md.block_tables, md.seq_lens)
        assert _threads_on_one_core(cores[1]) == 0
        for _ in range(5):
            hidden = bound(batch.input_ids, batch.positions, md.slot_mapping, md.block_tables, md.seq_lens)
            assert torch.equal(hidden, expected)
            assert os.sched_getaffinity(0) == mask
        assert _threads_on_one_core(cores[1]) >= 1
    finally:
        torch.set_num_threads(threads)
