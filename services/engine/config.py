"""Engine settings, validated at construction. Flag names follow `vllm serve` where the meaning is the same."""

from dataclasses import dataclass

from services.common.block_hash import DEFAULT_HASH_SEED

DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class EngineConfig:
    model: str  # a Hugging Face checkpoint directory
    dtype: str = "auto"  # the checkpoint's own dtype (float32 when it names none)
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    prefix_cache_hash_seed: int = DEFAULT_HASH_SEED
    max_logprobs: int = 20
    attention_backend: str = "auto"  # "torch", "triton", or "auto" (triton on CUDA, torch on CPU)
    replica_id: str = "engine-0"
    seed: int = 0  # seeds the engine's random generator for requests without a seed
    enforce_eager: bool = False  # run the model op by op: no compiled decode graphs (as vLLM's flag)
    num_threads: int | None = None  # CPU threads of the model's kernels, fixed; None: adapted (threads.ThreadGovernor)
    stream_interval: int = 1  # tokens per streamed output after the first (as vLLM's --stream-interval)
    # Requests that may wait beyond a full running batch before new ones are refused (RESOURCE_EXHAUSTED);
    # None: 4 x max_num_seqs, so the last in line waits about four batch turnovers; -1: unbounded.
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
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
