"""Decode steps as CUDA graphs, one per batch-size bucket, as vLLM captures them.

A graph records every kernel launch of one decode forward (the projections, the Triton RMSNorm,
rotary, SiLU·mul, KV-store and paged-decode kernels of every layer) once, at start-up; a step then
replays it with one launch, so a small batch costs the GPU's time, not Python's (an eager step of
a 32-layer model is ~500 launches, some milliseconds of CPU, more than the GPU needs at batch 1).

A graph reads its inputs from fixed addresses: the step's token ids, positions, KV slots, sequence
lengths and block tables are copied into static buffers sized for the largest bucket, and the graph
of a bucket reads their first rows. The Triton kernels take every per-request bound from those
buffers (``paged_decode`` loops to each row's ``seq_lens``), never from the host, so one graph
serves any contexts up to ``max_model_len``. The batch is padded to its bucket by the model runner
(padding rows write their K/V to the scratch block and attend only to it) and the graph's output
rows beyond the real ones are never sampled.

Only decode steps (one new token per request) replay graphs (vLLM's FULL_DECODE_ONLY); prefills and
mixed steps run eager. The graphs of all buckets share one memory pool, captured largest first; an
output is valid until the next replay, which the model runner never interleaves.
"""

import logging
import time
from collections.abc import Callable, Sequence

import torch

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.compiled_forward import BucketedGraphs

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], torch.Tensor]


class CudaGraphs(BucketedGraphs):
    """``capture`` records a graph per bucket; ``run`` replays one for a decode batch already padded to a
    bucket. Same interface as ``compiled_forward.DecodeGraphs``. Not thread-safe: one engine loop."""

    decode_only = True  # steps with a prefill run eager

    def __init__(self, forward: Forward, attention: AttentionBackend, buckets: Sequence[int],
                 max_blocks_per_seq: int, device: torch.device) -> None:
        super().__init__(buckets)
        self.forward = forward
        self.attention = attention
        n = self.buckets[-1]
        ints = dict(dtype=torch.int64, device=device)
        self._input_ids = torch.zeros(n, **ints)
        self._positions = torch.zeros(n, **ints)
        self._slot_mapping = torch.zeros(n, **ints)
        self._seq_lens = torch.ones(n, **ints)
        self._context_lens = torch.zeros(n, **ints)
        self._query_start_loc = torch.arange(n + 1, **ints)  # one token per request, always
        self._block_tables = torch.zeros(n, max_blocks_per_seq, **ints)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None  # the memory pool the graphs share

    def capture(self, run_padding_step: Callable[[int], None]) -> None:
        """Captures every bucket, largest first (its memory is the pool the smaller ones reuse), by
        calling ``run_padding_step(bucket)``, which must ``run`` a decode batch of ``bucket`` padding rows."""
        started = time.perf_counter()
        for bucket in reversed(self.buckets):
            run_padding_step(bucket)
        log.info("captured %d CUDA graphs (decode batches of %s) in %.1f s", len(self.buckets),
                 ", ".join(map(str, self.buckets)), time.perf_counter() - started)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            metadata: AttentionMetadata) -> torch.Tensor:
        """The forward of a decode batch of exactly a bucket's requests (padded): ``hidden [T, H]``,
        valid until the next ``run``."""
        n = input_ids.shape[0]
        if n not in self.buckets or metadata.num_prefills or metadata.num_decodes != n:
            raise ValueError(f"a CUDA graph replays a decode batch of a bucket's {self.buckets} requests, got "
                             f"{metadata.num_decodes} decodes and {metadata.num_prefills} prefills")
        self._stage(input_ids, positions, metadata)
        graph = self._graphs.get(n)
        if graph is None:
            graph = self._capture(n, kv_caches, metadata.block_size)
        graph.replay()
        return self._outputs[n]

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Copies the step's inputs into the first rows of the static buffers."""
        n = input_ids.shape[0]
        width = metadata.block_tables.shape[1]
        if width > self._block_tables.shape[1]:
            raise ValueError(f"block tables of {width} blocks exceed the graphs' {self._block_tables.shape[1]}")
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self._slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self._seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self._context_lens[:n].copy_(metadata.context_lens, non_blocking=True)
        # Columns past `width` keep older blocks: a row reads only its first ceil(seq_len / block_size).
        self._block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)

    def _static_metadata(self, n: int, block_size: int) -> AttentionMetadata:
        return self.attention.prepare(AttentionMetadata(
            num_decodes=n, num_prefills=0, query_start_loc=self._query_start_loc[:n + 1],
            seq_lens=self._seq_lens[:n], context_lens=self._context_lens[:n], block_tables=self._block_tables[:n],
            slot_mapping=self._slot_mapping[:n], max_query_len=1,
            max_seq_len=self._block_tables.shape[1] * block_size, block_size=block_size))

    def _capture(self, n: int, kv_caches: list, block_size: int) -> torch.cuda.CUDAGraph:
        """Runs the forward of the staged batch once eager (Triton compiles its kernels, the allocator
        warms up), then records it."""
        started = time.perf_counter()
        args = (self._input_ids[:n], self._positions[:n], kv_caches, self._static_metadata(n, block_size))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[n] = self.forward(*args)
        self._pool = graph.pool()
        self._graphs[n] = graph
        log.info("captured the CUDA graph of %d-request decode steps in %.2f s", n, time.perf_counter() - started)
        return graph
