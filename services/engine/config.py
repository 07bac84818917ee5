"""Engine settings, validated at construction. Flag names follow `vllm serve` where the meaning is the same.

Each field is also a command-line flag (`--block-size` for `block_size`): its default is the field's,
and its help text sits beside it (`flag(...)`), so `engine_args.add_engine_args` builds the parser
from this class alone and a default cannot differ between the flag and the class.
"""

import argparse
from dataclasses import dataclass, field

from services.common.block_hash import DEFAULT_HASH_SEED

DTYPES = ("float32", "bfloat16", "float16", "auto")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_MEMORY_BYTES = 1 << 30


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """A count flag as vLLM reads one: ``32768``, or a number with a suffix, decimal in lower case
    (``25.6k``: 25,600; ``m``, ``g``, ``t``) or binary in upper case (``32K``: 32,768; ``M``, ``G``, ``T``,
    whole numbers only)."""
    value = text.strip()
    suffix = value[-1:]
    try:
        if suffix in _DECIMAL_SUFFIXES:
            return int(float(value[:-1]) * _DECIMAL_SUFFIXES[suffix])
        if suffix in _BINARY_SUFFIXES:
            return int(value[:-1]) * _BINARY_SUFFIXES[suffix]
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number, nor one with a suffix (25.6k = 25,600, 32K = 32,768)") from None


def human_readable_int_or_auto(text: str) -> int | None:
    """`human_readable_int`, or None (the engine decides) for ``auto`` or ``-1``, as vLLM's --max-model-len."""
    return None if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


def flag(default, help: str, **argparse_kwargs) -> field:
    """A field with a default that is also an engine flag: ``help`` is its help text ("%(default)s"
    reads the default), ``argparse_kwargs`` what `add_argument` needs beyond the flag's type and
    default (``choices``, ``action``, ``metavar``)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class EngineConfig:
    # a Hugging Face checkpoint directory; the flag's default, None, is the built-in model
    model: str = field(metadata={"help": "Hugging Face checkpoint directory (default: the built-in default model)"})
    dtype: str = flag("auto", "weights dtype; auto takes the checkpoint's (float32 when it names none; on the "
                              "CPU, bfloat16 for a float16 one) (default: %(default)s)", choices=DTYPES)
    device: str = flag("cpu", "cpu or cuda[:N] (default: %(default)s)")
    block_size: int = flag(16, "tokens per KV block (default: %(default)s)")
    num_kv_blocks: int | None = flag(None, "KV blocks in the pool (default: from --kv-cache-memory-bytes)")
    kv_cache_memory_bytes: int = flag(KV_CACHE_MEMORY_BYTES,
                                      "memory for the KV pool when --num-kv-blocks is not given, in bytes or "
                                      f"as 4G (default: %(default)s bytes, {KV_CACHE_MEMORY_BYTES >> 30} GiB)",
                                      type=human_readable_int)
    max_num_seqs: int = flag(64, "most sequences per step (default: %(default)s)")
    max_num_batched_tokens: int = flag(2048, "token budget of one step, prefill and decode together "
                                             "(default: %(default)s)", type=human_readable_int)
    max_model_len: int | None = flag(None, "longest prompt + output, as 32768 or 32K (default, or auto: the "
                                           "checkpoint's longest sequence, max_position_embeddings with its rope "
                                           "scaling, or what the KV pool holds where that is less)",
                                     type=human_readable_int_or_auto)
    enable_prefix_caching: bool = flag(True, "automatic prefix caching (default: on)",
                                       action=argparse.BooleanOptionalAction)
    prefix_cache_hash_seed: int = flag(DEFAULT_HASH_SEED, "seed of the block hashes; must match the router's "
                                                          "(default: %(default)s)")
    max_logprobs: int = flag(20, "most logprobs per token (default: %(default)s)")
    attention_backend: str = flag("auto", "attention kernels: torch (the CPU path and the reference), triton (GPU "
                                          "kernels), or auto: triton on CUDA when it is installed and --block-size "
                                          "is a power of two, else torch (default: %(default)s)",
                                  choices=ATTENTION_BACKENDS)
    replica_id: str = flag("engine-0", "this replica's id in events and responses (default: %(default)s)")
    seed: int = flag(0, "seed of the engine's random generator, for requests without their own "
                        "(default: %(default)s)")
    enforce_eager: bool = flag(False, "run the model op by op, without compiled decode graphs, as vLLM's flag "
                                      "(default: compiled where possible)", action="store_true")
    num_threads: int | None = flag(None, "CPU threads for the model's kernels, fixed (default: adapted to the load "
                                         "between one and OMP_NUM_THREADS or the cores this process may use, by "
                                         "timing decode steps; threads.ThreadGovernor)")
    bind_threads: bool = flag(True, "on the CPU, one kernel thread per core while a step runs on two or more: "
                                    "each thread bound to one of the cores this process may use, where its "
                                    "threads may fill them all (default: on; OpenMP's own binding, "
                                    "OMP_PROC_BIND or OMP_PLACES, turns it off)",
                              action=argparse.BooleanOptionalAction)
    stream_interval: int = flag(1, "tokens per streamed output after the first one (which goes at once) and before "
                                   "the last, as vLLM's flag: 1 streams every token as it is made; larger values "
                                   "send fewer, bigger messages through the stack, which leaves more CPU to the "
                                   "model under load (default: %(default)s)")
    generation_config: str = flag("auto", "where requests that leave temperature, top_p, top_k, min_p, "
                                          "repetition_penalty or max_tokens unset get their defaults, as vLLM's "
                                          "flag: auto, the checkpoint's generation_config.json; vllm, OpenAI's "
                                          "neutral defaults; or a folder with a generation_config.json "
                                          "(default: %(default)s)")
    override_generation_config: str | None = flag(None, "JSON object of defaults set over the generation config's, "
                                                        "e.g. '{\"temperature\": 0.5}' (default: none)")
    quantization: str | None = flag(None, "the checkpoint's quantization method, checked against its config.json "
                                          "as vLLM's flag (gptq, awq, compressed-tensors, fp8, fbgemm_fp8; "
                                          "gptq_marlin and awq_marlin name gptq and awq); quantized weights are "
                                          "dequantized as they load. Or int8: an unquantized checkpoint's "
                                          "projections rounded to int8 as they load (weight-only, a scale per "
                                          "output row; bfloat16 on the CPU): half the memory and, at small "
                                          "batches, faster decoding (default: the checkpoint's)")
    trust_remote_code: bool = flag(False, "accepted for vLLM's command lines: Strata runs no code from a checkpoint, "
                                          "so it changes nothing (default: off)", action="store_true")
    tensor_parallel_size: int = flag(1, "accepted for vLLM's command lines at 1: an engine holds one whole copy of "
                                        "the model (more copies: strata up --replicas N) (default: %(default)s)")
    kv_cache_dtype: str = flag("auto", "the KV cache's dtype, as vLLM's flag: auto, the model's dtype (no fp8 K/V "
                                       "here) (default: %(default)s)")
    # Requests that may wait beyond a full running batch before new ones are refused (RESOURCE_EXHAUSTED);
    # None: 4 x max_num_seqs, so the last in line waits about four batch turnovers; -1: unbounded.
    max_waiting_requests: int | None = flag(
        None, "requests that may wait beyond a full running batch; more are refused at once with "
              "RESOURCE_EXHAUSTED (the router tries another replica, the gateway answers 503 with Retry-After), "
              "so the queue and its waiting time stay bounded; -1: unbounded (default: 4 x --max-num-seqs)")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1 (or auto), got {self.max_model_len}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory-bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.max_waiting_requests is None:
            self.max_waiting_requests = 4 * self.max_num_seqs
        if self.max_waiting_requests < -1:
            raise ValueError(f"--max-waiting-requests must be >= 0 (or -1: unbounded), got {self.max_waiting_requests}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: an engine holds the whole model "
                             "on one device; serve more copies with strata up --replicas N")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: the KV cache takes the model's dtype "
                             "(auto); fp8 K/V is not supported")
