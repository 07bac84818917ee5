"""Decode steps as CUDA graphs (``services/engine/cuda_graphs.py``).

On a GPU: after warmup every decode step of at most ``max_num_seqs`` requests replays a captured
graph, padded to its bucket, and the tokens are HF transformers' greedy ones and the eager engine's,
while batches shrink across buckets and contexts grow across blocks; prefills stay eager. Anywhere:
the staging of a step into the graphs' static buffers, and the refusals."""

import pytest
import torch

from services.engine.attention.base import AttentionMetadata
from services.engine.cuda_graphs import CudaGraphs
from tests.engine.checkpoints import write_checkpoint

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")


def decode_metadata(seq_lens: list[int], block_tables: list[list[int]], block_size: int = 4) -> AttentionMetadata:
    n = len(seq_lens)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return AttentionMetadata(
        num_decodes=n, num_prefills=0, query_start_loc=torch.arange(n + 1), seq_lens=as_tensor(seq_lens),
        context_lens=as_tensor([s - 1 for s in seq_lens]), block_tables=as_tensor(block_tables),
        slot_mapping=as_tensor([t[(s - 1) // block_size] * block_size + (s - 1) % block_size
                                for s, t in zip(seq_lens, block_tables)]),
        max_query_len=1, max_seq_len=max(seq_lens), block_size=block_size)


def test_a_step_is_staged_into_the_first_rows_of_the_static_buffers():
    graphs = CudaGraphs(lambda *args: None, None, (4, 1, 2), max_blocks_per_seq=5, device=torch.device("cpu"))
    assert graphs.buckets == (1, 2, 4) and graphs.bucket_for(3) == 4 and graphs.bucket_for(5) is None
    wide = decode_metadata([9, 2], [[7, 8, 9], [3, 0, 0]])
    graphs._stage(torch.tensor([11, 12]), torch.tensor([8, 1]), wide)
    assert graphs._input_ids[:2].tolist() == [11, 12] and graphs._positions[:2].tolist() == [8, 1]
    assert graphs._seq_lens[:2].tolist() == [9, 2] and graphs._slot_mapping[:2].tolist() == [36, 13]
    narrow = decode_metadata([1], [[5]])
    graphs._stage(torch.tensor([13]), torch.tensor([0]), narrow)
    # columns past the step's width keep older blocks, which a row of seq_len 1 never reads
    assert graphs._block_tables[0].tolist() == [5, 8, 9, 0, 0]
    assert graphs._seq_lens[:2].tolist() == [1, 2]


def test_a_graph_takes_only_decode_batches_of_a_bucket():
    graphs = CudaGraphs(lambda *args: None, None, (1, 2, 4), max_blocks_per_seq=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="decode batch of a bucket"):
        graphs.run(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), [],
                   decode_metadata([1, 1, 1], [[0]] * 3))
    with pytest.raises(ValueError, match="exceed"):
        graphs.run(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), [],
                   decode_metadata([9], [[0, 1, 2]]))
    with pytest.raises(ValueError, match="buckets must be positive"):
        CudaGraphs(lambda *args: None, None, (), max_blocks_per_seq=2, device=torch.device("cpu"))


@needs_cuda
@pytest.mark.slow  # HF parity on the GPU
@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("mistral", {"num_key_value_heads": 1, "sliding_window": 20}),
])
def test_decode_steps_replay_graphs_and_match_eager_and_hf(tmp_path, arch, overrides):
    from services.engine.config import EngineConfig
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams
    from tests.engine.test_triton_backend import hf_greedy

    path = write_checkpoint(tmp_path, arch, **overrides)
    prompts = [list(range(40, 75)), list(range(100, 109)), [3, 4], list(range(40, 72)) + [9], [5] * 20]
    lengths = [40, 7, 19, 30, 12]  # batches shrink 5 -> 4 -> 3 -> 2 -> 1 across the buckets (8, 4, 2, 1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    config = EngineConfig(model=str(path), device="cuda", max_num_seqs=8, num_kv_blocks=64, block_size=16)
    llm = LLM(config)
    llm.core.warmup()
    runner = llm.core.model_runner
    assert isinstance(runner.graphs, CudaGraphs) and runner.is_captured
    assert sorted(runner.graphs._graphs) == [1, 2, 4, 8]
    replayed = []
    run = runner.graphs.run
    runner.graphs.run = lambda input_ids, *args: replayed.append(input_ids.shape[0]) or run(input_ids, *args)
    graphed = [c.token_ids for c in llm.generate(prompts, params)]
    assert set(replayed) == {1, 2, 4, 8}
    assert len(replayed) >= max(lengths) - 1  # every decode step
    eager = LLM(EngineConfig(model=str(path), device="cuda", max_num_seqs=8, num_kv_blocks=64, block_size=16,
                             enforce_eager=True))
    assert eager.core.model_runner.graphs is None
    assert [c.token_ids for c in eager.generate(prompts, params)] == graphed
    assert graphed == hf_greedy(path, prompts, lengths)
