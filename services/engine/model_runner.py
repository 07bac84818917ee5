"""Runs one scheduled step: builds the flat batch, runs the model over the paged KV cache, samples."""

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.attention import AttentionMetadata, get_attention_backend
from services.engine.compiled_forward import DecodeGraphs, can_compile, default_buckets, use_inductor_cache_dir
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import decode_forward
from services.engine.cpu_kernels import linear as native_linear
from services.engine.cuda_graphs import CudaGraphs
from services.engine.memory_arena import staggered_zeros
from services.engine.models.config import load_model_config
from services.engine.models.loader import load_model
from services.engine.models.packed_linear import NATIVE_MAX_ROWS
from services.engine.models.quantized_weights import INT8_AT_LOAD, check_requested
from services.engine.request import Request
from services.engine.sampler import Sampler, token_logprobs
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler_output import ModelRunnerOutput, SampledLogprobs, ScheduledChunk, SchedulerOutput
from services.engine.structured_output.manager import StructuredOutputManager
from services.engine.structured_output.masks import StepMasks
from services.engine.threads import binding_cores

log = logging.getLogger(__name__)


# Most logits computed at once for prompt logprobs (float32 elements: 64 MB)
_PROMPT_LOGITS_ELEMENTS = 1 << 24


def _predicts_prompt_tokens(chunk: ScheduledChunk) -> bool:
    """Whether ``chunk`` computes a position whose next token is a prompt token its request gathers the
    logprob of."""
    request = chunk.request
    return request.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens - 1


@dataclass
class _InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [n]: the last new token of each chunk that samples
    sample_requests: list[Request]
    chunks: list[ScheduledChunk]  # in row order
    first_rows: list[int]  # the first row of each of them


@dataclass
class _DecodeRows:
    """A native decode step's inputs, one row per request (int64 tensors on the CPU)."""
    input_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    slot_mapping: torch.Tensor  # [n]
    block_tables: torch.Tensor  # [n, blocks]
    seq_lens: torch.Tensor  # [n]
    sample_rows: torch.Tensor  # [s]: the rows that sample
    sample_requests: list[Request]


class ModelRunner:
    """Owns the model weights and the KV pools (one K and one V pool per layer,
    ``[num_kv_blocks, block_size, num_kv_heads, head_dim]``, zero-initialised; every block is usable;
    with compiled graphs one more block, the scratch block, takes the K/V of padding rows; on the CPU
    in one arena, on huge pages and staggered, see ``memory_arena``).
    It never modifies Request objects: the scheduler advances them from the returned tokens.

    Unless ``enforce_eager``, ``warmup`` compiles the model forward for small steps (on the CPU,
    ``compiled_forward``, where the native step does not already serve them all) or captures it as
    CUDA graphs for decode steps (on a GPU, ``cuda_graphs``);
    from then on such a step of at most the largest bucket's tokens runs its bucket's graph, padded,
    and any other step runs eager."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = mc = load_model_config(config.model)
        check_requested(config.quantization, mc.quantization, config.model)
        self.device = torch.device(config.device)
        self.dtype = mc.resolve_dtype(config.dtype, self.device)
        if config.quantization == INT8_AT_LOAD and config.dtype == "auto" and self.dtype != torch.bfloat16:
            log.info("--quantization int8 multiplies bfloat16 activations: the model runs in bfloat16 (--dtype auto)")
            self.dtype = torch.bfloat16
        if not config.enforce_eager:
            use_inductor_cache_dir()
        self.block_size = config.block_size
        self.num_kv_blocks, self.max_model_len = self._kv_pool_and_max_model_len(
            mc.resolve_max_model_len(config.max_model_len))
        self.attention = get_attention_backend(config.attention_backend, mc.num_heads, mc.num_kv_heads,
                                               mc.head_dim, self.dtype, self.device, config.block_size)
        loading = time.perf_counter()
        self.model = load_model(config.model, mc, self.attention, self.max_model_len, self.dtype, self.device,
                                int8_weights=config.quantization == INT8_AT_LOAD)
        log.info("loaded %s in %s%s in %.1f s", config.model, str(self.dtype).removeprefix("torch."),
                 " with int8 weights" if config.quantization == INT8_AT_LOAD else "", time.perf_counter() - loading)
        self.graphs = None if config.enforce_eager else self._decode_graphs()
        self.scratch_block = self.num_kv_blocks  # padding rows' K/V; only with graphs
        pool_shape = (self.num_kv_blocks + (self.graphs is not None), self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = self._kv_pools(pool_shape, mc.num_layers)
        self.sampler = Sampler(mc.vocab_size, self.device, config.seed)
        self.structured_output = StructuredOutputManager(config.model, mc.vocab_size, mc.eos_token_ids)
        self.is_captured = False  # whether steps run the compiled graphs (after warmup)
        self.decode_step = self._native_decode_step()
        self._native_prefill_attention = getattr(self.attention, "use_native_prefill", False)

    @property
    def prompt_steps_run_natively(self) -> bool:
        """Whether steps with prompt chunks run in the native step too: where the torch forward's prefill
        attention is the same native kernel, so both compute the same numbers (not while a request
        gathers prompt logprobs: the native step keeps no hidden states but the sampled rows')."""
        return self.decode_step is not None and self._native_prefill_attention

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        masks = self.structured_output.start_masks(scheduler_output.chunks)  # filled while the model runs
        requests, logits, prompt_logprobs = self.compute_logits(scheduler_output)
        output = ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        if not requests:
            return output
        try:
            tokens, logprobs = self.sampler(logits, requests, masks)
        except Exception:  # find the request(s) at fault: sample each alone; the others go on
            return self._sample_one_by_one(logits, requests, masks)
        for request, token, logprob in zip(requests, tokens, logprobs, strict=True):
            output.sampled_token_ids[request.request_id] = token
            if logprob is not None:
                output.logprobs[request.request_id] = logprob
        return output

    def _sample_one_by_one(self, logits: torch.Tensor, requests: list[Request],
                           masks: StepMasks | None) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        for row, request in enumerate(requests):
            try:
                (token,), (logprob,) = self.sampler(logits[row:row + 1], [request], masks)
            except Exception as error:
                log.exception("request %s failed in sampling; the rest of its batch goes on", request.request_id)
                output.failed[request.request_id] = error
                continue
            output.sampled_token_ids[request.request_id] = token
            if logprob is not None:
                output.logprobs[request.request_id] = logprob
        return output

    @torch.inference_mode()
    def compute_logits(self, scheduler_output: SchedulerOutput
                       ) -> tuple[list[Request], torch.Tensor, dict[str, tuple[int, list[SampledLogprobs]]]]:
        """The step without sampling: writes the chunks' K/V and returns the requests that sample with
        their float32 logits ``[n, vocab]`` (row i for request i; valid until the runner's next step,
        whose native call writes the same buffer), and the prompt logprobs it computed for requests
        gathering them (``ModelRunnerOutput.prompt_logprobs``)."""
        if scheduler_output.is_empty:
            return [], torch.empty(0, self.vocab_size), {}
        num_tokens = scheduler_output.num_batched_tokens
        gathering = any(_predicts_prompt_tokens(chunk) for chunk in scheduler_output.chunks)
        if (self.decode_step is not None and scheduler_output.one_token_each and num_tokens <= NATIVE_MAX_ROWS
                and not gathering):  # (the native step keeps no hidden states but the sampled rows')
            rows = self._prepare_rows(scheduler_output.chunks)  # one token each: a decode step, in one native call
            return rows.sample_requests, self.decode_step.logits(rows.input_ids, rows.positions, rows.slot_mapping,
                                                                 rows.block_tables, rows.seq_lens, rows.sample_rows), {}
        if (self.prompt_steps_run_natively and not scheduler_output.one_token_each and not gathering
                and num_tokens <= self.decode_step.max_rows):
            return self._native_prompt_step(scheduler_output.chunks)
        graphed = self.is_captured and (scheduler_output.one_token_each or not self.graphs.decode_only)
        bucket = self.graphs.bucket_for(num_tokens) if graphed else None
        batch = self._prepare(scheduler_output.chunks, bucket - num_tokens if bucket else 0)
        hidden = self._forward(batch, compiled=bucket is not None)  # [T, H]
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        return batch.sample_requests, logits, self._prompt_logprobs(batch, hidden) if gathering else {}

    def _native_prompt_step(self, chunks: list[ScheduledChunk]
                            ) -> tuple[list[Request], torch.Tensor, dict[str, tuple[int, list[SampledLogprobs]]]]:
        """A step with prompt chunks (and decoding requests beside them) in one native call: the general
        batch's rows, decodes first, then the chunks'."""
        batch = self._prepare(chunks)
        md = batch.metadata
        starts = md.query_start_loc[md.num_decodes:]
        prompts = decode_forward.PromptChunks(starts - starts[0], md.context_lens[md.num_decodes:])
        logits = self.decode_step.logits(batch.input_ids, batch.positions, md.slot_mapping, md.block_tables,
                                         md.seq_lens[:md.num_decodes], batch.sample_rows, prompts)
        return batch.sample_requests, logits, {}

    def _prompt_logprobs(self, batch: _InputBatch, hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list[SampledLogprobs]]]:
        """For each request gathering prompt logprobs: (j, the logprobs of its prompt tokens j + 1, j + 2, ...
        that this step's positions j, j + 1, ... predict). Logits for at most ``_PROMPT_LOGITS_ELEMENTS``
        at a time: a 2,048-token chunk of a 152k vocabulary would take 1.2 GB at once."""
        out = {}
        rows_per_slice = max(1, _PROMPT_LOGITS_ELEMENTS // self.vocab_size)
        for chunk, first_row in zip(batch.chunks, batch.first_rows, strict=True):
            if not _predicts_prompt_tokens(chunk):
                continue
            request = chunk.request
            start = request.num_computed_tokens
            end = min(start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
            count = request.sampling_params.prompt_logprobs
            entries = []
            for lo in range(start, end, rows_per_slice):
                hi = min(lo + rows_per_slice, end)
                rows = torch.arange(first_row + lo - start, first_row + hi - start, device=hidden.device)
                targets = torch.tensor(request.prompt_token_ids[lo + 1:hi + 1], dtype=torch.int64, device=hidden.device)
                entries += token_logprobs(self.model.compute_logits(hidden.index_select(0, rows)), targets,
                                          [count] * (hi - lo))
            out[request.request_id] = (start, entries)
        return out

    def _forward(self, batch: _InputBatch, compiled: bool) -> torch.Tensor:
        metadata = self.attention.prepare(batch.metadata)
        forward = self.graphs.run if compiled else self.model
        return forward(batch.input_ids, batch.positions, self.kv_caches, metadata)

    def _decode_graphs(self) -> DecodeGraphs | CudaGraphs | None:
        """The graphs small steps run as, where this device and backend have them."""
        buckets = default_buckets(self.config.max_num_seqs)
        if self.device.type == "cuda" and self.attention.use_triton_kernels:
            return CudaGraphs(self.model, self.attention, buckets, -(-self.max_model_len // self.block_size),
                              self.device)
        if self._native_step_serves_small_steps(buckets[-1]):
            log.info("no compiled graphs: the native step serves every decode and mixed step of up to %d tokens "
                     "(one that gathers prompt logprobs runs the torch forward)", buckets[-1])
            return None
        if not can_compile(self.device, self.attention):
            return None
        return DecodeGraphs(self.model, self.attention, buckets)

    def _native_step_serves_small_steps(self, num_tokens: int) -> bool:
        """Whether the native step (``_native_decode_step``) will run every step of up to ``num_tokens``
        tokens that a compiled graph could: decodes, and mixed steps where the prefill attention is the
        native kernel. Then compiling graphs at start-up (a minute on a first start) would buy nothing."""
        return (num_tokens <= NATIVE_MAX_ROWS and not self.attention.use_triton_kernels
                and getattr(self.attention, "use_native_prefill", False)
                and decode_forward.unsupported_reason(self.model, self.dtype, self.device) is None)

    def _native_decode_step(self) -> decode_forward.DecodeStep | None:
        """The whole decode step as one native call (``cpu_kernels/decode_forward``), where it can run."""
        if self.attention.use_triton_kernels:
            return None
        reason = decode_forward.unsupported_reason(self.model, self.dtype, self.device, self.kv_caches)
        if reason is not None:
            log.info("decode steps run the model forward: the native decode step is off (%s)", reason)
            return None
        if self.dtype == torch.bfloat16 and native_linear.uses_amx(NATIVE_MAX_ROWS, self.model_config.hidden_size):
            log.info("bfloat16 projections of more than a few rows run on this CPU's AMX tiles")
        cores = binding_cores(self.config.bind_threads, self.config.num_threads, os.environ)
        if cores:
            log.info("kernel threads bound one per core (cores %s) while a step runs on two or more",
                     ",".join(map(str, cores)))
        return decode_forward.DecodeStep(self.model, self.kv_caches, self.attention.scale, thread_cores=cores)

    def free_request(self, request_id: str) -> None:
        """Drop a finished request's sampler state (its seeded generator)."""
        self.sampler.free(request_id)

    def warmup(self) -> None:
        """One prefill step and one decode step of a dummy request in the first blocks (whose contents
        are garbage afterwards, which is fine: no request has computed them); then, with graphs,
        compiles every bucket, or falls back to eager with a warning when compilation fails."""
        num_prompt = min(8, self.max_model_len - 1)
        request = Request("__warmup__", list(range(num_prompt)), SamplingParams(temperature=0.0))
        block_ids = list(range(min(self.num_kv_blocks, -(-(num_prompt + 1) // self.block_size))))
        requests, logits, _ = self.compute_logits(SchedulerOutput([ScheduledChunk(request, num_prompt, block_ids)]))
        request.num_computed_tokens = num_prompt
        request.append_output(int(logits[0].argmax()))
        self.execute(SchedulerOutput([ScheduledChunk(request, 1, block_ids)]))
        self.free_request(request.request_id)
        if self.graphs is not None:
            self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Compiles (or captures) the graph of every bucket on a batch of padding rows only."""
        try:
            self.graphs.capture(lambda bucket: self._forward(self._prepare([], bucket), compiled=True))
        except Exception:  # inductor fails in many ways (no headers, a compiler error...): stay correct
            log.warning("compiling the decode graphs failed: the model runs eager", exc_info=True)
            return
        self.is_captured = True

    def _prepare(self, chunks: list[ScheduledChunk], num_padding: int = 0) -> _InputBatch:
        """The flat batch of ``chunks``, decodes first, then ``num_padding`` rows that no request owns:
        padding decodes (context 0) when every chunk decodes, else padding prefills (of at most
        ``max_model_len`` tokens each), so that decodes still come first. Padding rows store their K/V
        in the scratch block and attend only to it."""
        # Single-token chunks first: attention handles them on its decode path.
        chunks = [c for c in chunks if c.num_new_tokens == 1] + [c for c in chunks if c.num_new_tokens != 1]
        num_real_decodes = sum(c.num_new_tokens == 1 for c in chunks)
        pads_as_decodes = num_real_decodes == len(chunks)
        padding_size = 1 if pads_as_decodes else self.max_model_len
        padding = [padding_size] * (num_padding // padding_size) + [num_padding % padding_size] * bool(
            num_padding % padding_size)
        num_reqs = len(chunks) + len(padding)
        num_new = np.fromiter((*(c.num_new_tokens for c in chunks), *padding), np.int64, num_reqs)
        context_lens = np.fromiter((*(c.request.num_computed_tokens for c in chunks), *(0 for _ in padding)),
                                   np.int64, num_reqs)
        seq_lens = context_lens + num_new
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        block_ids = [c.block_ids for c in chunks] + [[self.scratch_block] * -(-n // self.block_size) for n in padding]
        num_blocks = np.fromiter((len(b) for b in block_ids), np.int64, num_reqs)
        if (seq_lens > num_blocks * self.block_size).any() or seq_lens.max() > self.max_model_len:
            bad = int(np.argmax((seq_lens > num_blocks * self.block_size) | (seq_lens > self.max_model_len)))
            raise ValueError(f"request {chunks[bad].request.request_id!r} reaches {seq_lens[bad]} tokens with "
                             f"{num_blocks[bad]} blocks of {self.block_size} (max_model_len {self.max_model_len})")
        block_tables = np.zeros((num_reqs, int(num_blocks.max())), np.int64)
        input_ids = np.zeros(num_tokens, np.int64)  # padding rows: token 0
        for i, blocks in enumerate(block_ids):
            block_tables[i, :num_blocks[i]] = blocks
        for i, chunk in enumerate(chunks):
            start = context_lens[i]
            input_ids[query_start_loc[i]:query_start_loc[i + 1]] = chunk.request.all_token_ids[start:start + num_new[i]]

        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - context_lens, num_new)
        request_of_token = np.repeat(np.arange(num_reqs), num_new)
        slot_mapping = (block_tables[request_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)
        samples = np.fromiter((*(c.samples for c in chunks), *(False for _ in padding)), bool, num_reqs)
        num_decodes = num_real_decodes + (len(padding) if pads_as_decodes else 0)
        metadata = AttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=num_reqs - num_decodes,
            query_start_loc=self._tensor(query_start_loc),
            seq_lens=self._tensor(seq_lens),
            context_lens=self._tensor(context_lens),
            block_tables=self._tensor(block_tables),
            slot_mapping=self._tensor(slot_mapping),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        return _InputBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            metadata=metadata,
            sample_rows=self._tensor(query_start_loc[1:][samples] - 1),
            sample_requests=[c.request for c in chunks if c.samples],
            chunks=chunks,
            first_rows=query_start_loc[:len(chunks)].tolist(),
        )

    def _prepare_rows(self, chunks: list[ScheduledChunk]) -> _DecodeRows:
        """What the native decode step takes for ``chunks`` of one new token each (no padding): the rows of
        `_prepare`, in one loop over the requests instead of its general numpy, which took 0.11 ms of a
        1.9 ms bfloat16 step at one row and 0.35 ms at 64 (this: 0.02 and 0.10)."""
        block_size = self.block_size
        num_rows = len(chunks)
        input_ids, positions, slots = [0] * num_rows, [0] * num_rows, [0] * num_rows
        block_tables = np.zeros((num_rows, max(len(chunk.block_ids) for chunk in chunks)), np.int64)
        for row, chunk in enumerate(chunks):
            request, blocks = chunk.request, chunk.block_ids
            position = request.num_computed_tokens
            if position >= len(blocks) * block_size or position >= self.max_model_len:
                raise ValueError(f"request {request.request_id!r} reaches {position + 1} tokens with {len(blocks)} "
                                 f"blocks of {block_size} (max_model_len {self.max_model_len})")
            input_ids[row], positions[row] = request.all_token_ids[position], position
            slots[row] = blocks[position // block_size] * block_size + position % block_size
            block_tables[row, :len(blocks)] = blocks
        sampling = [row for row, chunk in enumerate(chunks) if chunk.samples]
        position_tensor = torch.tensor(positions, dtype=torch.int64)
        return _DecodeRows(
            input_ids=torch.tensor(input_ids, dtype=torch.int64), positions=position_tensor,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=torch.from_numpy(block_tables),
            seq_lens=position_tensor + 1, sample_rows=torch.tensor(sampling, dtype=torch.int64),
            sample_requests=[chunks[row].request for row in sampling])

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _kv_pools(self, pool_shape: tuple[int, ...], num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) pools, zero."""
        if self.device.type == "cpu":
            pools = staggered_zeros(2 * num_layers, pool_shape, self.dtype)
            return [(pools[2 * layer], pools[2 * layer + 1]) for layer in range(num_layers)]
        return [(torch.zeros(pool_shape, dtype=self.dtype, device=self.device),
                 torch.zeros(pool_shape, dtype=self.dtype, device=self.device)) for _ in range(num_layers)]

    def _kv_pool_and_max_model_len(self, max_model_len: int) -> tuple[int, int]:
        """The KV blocks in the pool and the longest sequence served (``max_model_len``, the requested or
        the checkpoint's). The blocks: ``num_kv_blocks`` when given; else what ``kv_cache_memory_bytes``
        holds, capped at enough for ``max_num_seqs`` requests of the longest sequence.

        Where that memory holds less than one request of the checkpoint's longest sequence and no
        ``--max-model-len`` was asked for (a long-context checkpoint: Llama 3.1's 131,072 tokens take
        16 GiB of bfloat16 K/V at 8B), the engine serves the longest sequence the pool holds and says
        so, as TGI sizes its context to its memory; an explicit ``--max-model-len`` that does not fit
        is refused with that length, as vLLM refuses it."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks, max_model_len
        mc = self.model_config
        bytes_per_block = (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                           * torch.empty(0, dtype=self.dtype).element_size())
        memory = self.config.kv_cache_memory_bytes
        blocks_per_seq = -(-max_model_len // self.block_size)
        held = memory // bytes_per_block
        if held < blocks_per_seq:
            longest = int(held * self.block_size)
            problem = (f"--kv-cache-memory-bytes {memory} ({_size(memory)}) holds {held} KV blocks of "
                       f"{self.block_size} tokens, {longest} tokens, less than one request of {max_model_len} "
                       f"tokens needs ({_size(blocks_per_seq * bytes_per_block)})")
            if self.config.max_model_len is not None or longest < self.block_size:
                raise ValueError(f"{problem}; the estimated maximum model length is {longest}: raise "
                                 f"--kv-cache-memory-bytes or lower --max-model-len")
            log.warning("%s: serving a max model len of %d tokens instead of the checkpoint's %d; raise "
                        "--kv-cache-memory-bytes to serve longer sequences", problem, longest, max_model_len)
            max_model_len, blocks_per_seq = longest, held
        return int(min(held, self.config.max_num_seqs * blocks_per_seq)), max_model_len


def _size(num_bytes: int) -> str:
    """``num_bytes`` in GiB, or MiB below one GiB."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.2f} MiB"
