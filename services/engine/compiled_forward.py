"""Small steps (decodes, and mixed steps of few tokens) as compiled graphs over batch-size buckets,
as vLLM captures CUDA graphs for a list of batch sizes.

A step of ``n`` tokens, ``n`` at most the largest bucket, runs the model forward compiled for the
smallest bucket ``>= n``; the model runner pads the batch up to it with rows that attend only within
a scratch KV block no request owns, and never samples them. Larger steps (prefills) run eager. On the
CPU a decode-only step of at most ``packed_linear.NATIVE_MAX_ROWS`` requests goes to the native decode
step instead (``cpu_kernels/decode_forward``: the whole model in one call, ~3x faster at batch 1 than
the graph), and so does a mixed step where the prefill attention is the native kernel; the graphs
serve the other small mixed steps (bfloat16 on a CPU with AMX where that kernel cannot use the tiles,
a head_dim not a multiple of 32), larger decode batches, and the models that step does not take. Where
they would serve nothing (float32 and bfloat16 where the native prefill kernel runs, up to
``NATIVE_MAX_ROWS`` requests) the model runner builds none and compiles nothing at start-up.

On the CPU the graph is ``torch.compile`` (inductor's C++ backend) of the whole forward:
RMSNorm with the residual add, rotary, SiLU·mul and the attention glue fuse into a few loops between
the projections; attention is the opaque op ``strata::paged_attention`` (see ``paged_attention_op``),
so one graph covers every layer. The projections stay the calls they are eager, as the opaque ops
``strata::small_m_linear`` and ``strata::onednn_linear`` (``packed_linear``).

The token dimension is dynamic from 2 tokens up, so the CPU compiles two or three graphs whatever
the buckets (one for a single token, one for the rest, split where the projections switch kernels,
see ``packed_linear``): measured on the 2-core Zen 4 (shared with other jobs, load 8-12), one graph
of the small shape took 60-230 s to compile, while a static graph per bucket ran hardly faster than the dynamic
one (bfloat16, one thread, CPU time per step relative to eager in the same process: batch 1 0.96
static, 1.01 dynamic; batch 8 0.93 static, 0.99 dynamic, within the noise of that machine).
Steps are still padded to buckets: at decode batch sizes the projections cost the weight
reads, whatever the rows, and the buckets are the shapes a CUDA-graph variant captures in ``capture``
and replays in ``run``.

A graph runs on the threads it was compiled for. Inductor writes the thread count into its C++ loops,
and dynamo guards the compiled code on it: a step that ran on another count (the engine's thread
governor resizes the team under load, ``threads.ThreadGovernor``) compiled the whole forward anew, in the
middle of serving (18.7 s for the small shape on 2 cores, measured; minutes for a larger model), once per
count. So ``run`` puts the team back to the captured size for the graph's own step, and the governed size
after it.

Graphs are compiled at start-up (``capture``), one progress line per bucket, and inductor's FX-graph
and AOTAutograd caches live on disk (``TORCHINDUCTOR_CACHE_DIR``, by default
``$STRATA_CACHE_DIR/inductor/g2`` or ``~/.cache/strata/inductor/g2``): a second start loads the generated
code and its compiled C++ from there, but still traces the model with dynamo. Measured (small shape,
bfloat16, --max-num-seqs 8, shared machine): warmup with compilation 254 s on the first start,
6.6 s on the second.
"""

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.cpu_kernels.build import compiler
from services.engine.models.paged_attention_op import attention_step

log = logging.getLogger(__name__)

# vLLM's cudagraph capture sizes, up to max_num_seqs
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Every graph of every engine in the process is one cache entry of the same forward code object.
_GRAPHS_PER_CODE_OBJECT = 64

Forward = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], torch.Tensor]


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The capture sizes below ``max_num_seqs``, and ``max_num_seqs`` itself: a decode step of every
    running request fits the largest."""
    return tuple(size for size in CAPTURE_SIZES if size < max_num_seqs) + (max_num_seqs,)


# Bumped when graphs an earlier Strata compiled must not be reused: inductor's cache key does not cover
# everything a graph depends on. 2: the CPU KV pools stopped being views of one arena tensor
# (memory_arena), which the key does not see, and the graphs cached for views copy the pools each step.
GRAPH_CACHE_GENERATION = 2


def inductor_cache_dir() -> str:
    """Where inductor caches compiled graphs: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``$STRATA_CACHE_DIR/inductor/g<generation>`` or ``~/.cache/strata/inductor/g<generation>``."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return os.path.join(root, "inductor", f"g{GRAPH_CACHE_GENERATION}")


def use_inductor_cache_dir() -> None:
    """Points inductor at ``inductor_cache_dir()`` unless the user chose a dir. Call it before the model
    loads: the first import of dynamo (the loader's custom ops and oneDNN calls bring it in) has
    inductor look at its cache dir, which writes the default (/tmp/torchinductor_$USER) into the
    variable, and every later look reads it from there."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())


def can_compile(device: torch.device, attention: AttentionBackend) -> bool:
    """Whether this engine compiles its small steps; says why not, once, when it cannot."""
    if device.type != "cpu" or attention.use_triton_kernels:
        log.info("compiled decode graphs are CPU-only, and CUDA graphs need the triton attention backend: "
                 "the model runs eager")
        return False
    if compiler() is None:
        log.warning("no C++ compiler found (g++, c++, clang++ or $CXX): decode steps run eager, "
                    "without compiled graphs (slower); install one, or pass --enforce-eager to silence this")
        return False
    return True


class BucketedGraphs:
    """What the CPU's compiled graphs and the GPU's CUDA graphs (``cuda_graphs``) share: the sorted
    buckets (token counts) and the choice of one for a step."""

    def __init__(self, buckets: Sequence[int]) -> None:
        self.buckets = tuple(sorted(set(buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive token counts, got {buckets}")

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds ``num_tokens``; None when the step is too large (eager)."""
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None


class DecodeGraphs(BucketedGraphs):
    """The model forward compiled for each of ``buckets`` (token counts). ``capture`` compiles them
    all; ``run`` then executes a batch already padded to a bucket. Not thread-safe: one engine loop."""

    decode_only = False  # small mixed steps run compiled too

    def __init__(self, forward: Forward, attention: AttentionBackend, buckets: Sequence[int]) -> None:
        super().__init__(buckets)
        self.attention = attention
        self.num_threads: int | None = None  # the team the graphs were compiled for (capture's)
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _GRAPHS_PER_CODE_OBJECT)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, _GRAPHS_PER_CODE_OBJECT)
        self._compiled = torch.compile(forward, fullgraph=True, dynamic=False)

    def capture(self, run_padding_step: Callable[[int], None]) -> None:
        """Compiles every bucket, largest first (so that the memory peak comes first), by calling
        ``run_padding_step(bucket)``, which must run ``run`` on a batch of ``bucket`` padding rows.
        Raises what compilation raises."""
        started = time.perf_counter()
        self.num_threads = torch.get_num_threads()
        log.info("compiling %d decode graphs (%s tokens), largest first: minutes on a first start, seconds once "
                 "they are cached in %s (--enforce-eager: none)", len(self.buckets),
                 ", ".join(str(b) for b in reversed(self.buckets)), inductor_cache_dir())
        for i, bucket in enumerate(reversed(self.buckets)):
            bucket_started = time.perf_counter()
            run_padding_step(bucket)
            log.info("compiled decode graph %d/%d (%d tokens) in %.1f s", i + 1, len(self.buckets), bucket,
                     time.perf_counter() - bucket_started)
        log.info("compiled %d decode graphs in %.1f s (cache: %s)", len(self.buckets),
                 time.perf_counter() - started, inductor_cache_dir())

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            metadata: AttentionMetadata) -> torch.Tensor:
        """The forward of a batch of exactly a bucket's tokens (padded): ``hidden [T, H]``."""
        if input_ids.shape[0] not in self.buckets:
            raise ValueError(f"a compiled step takes a bucket's {self.buckets} tokens, got {input_ids.shape[0]}")
        if input_ids.shape[0] > 1:  # one graph for the buckets from 2 tokens up, split where the code branches
            torch._dynamo.maybe_mark_dynamic(input_ids, 0)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
        governed = torch.get_num_threads()
        if self.num_threads is not None and governed != self.num_threads:
            torch.set_num_threads(self.num_threads)  # else dynamo compiles the forward again (see above)
        try:
            with attention_step(self.attention, metadata):
                return self._compiled(input_ids, positions, kv_caches, metadata)
        finally:
            if torch.get_num_threads() != governed:
                torch.set_num_threads(governed)
