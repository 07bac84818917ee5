"""Engine flags shared by `strata engine`, `strata generate` and `strata bench offline`.

Named like `vllm serve`'s flags where the meaning is the same."""

import argparse

from services.engine.config import DTYPES, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in default model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights dtype; auto takes the checkpoint's (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    parser.add_argument("--num-kv-blocks", type=int, help="KV blocks in the pool (default: from --kv-cache-memory-bytes)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                        help="memory for the KV pool when --num-kv-blocks is not given (default: 1 GiB)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default: %(default)s)")
    parser.add_argument("--max-waiting-requests", type=int,
                        help="requests that may wait beyond a full running batch; more are refused at once with "
                             "RESOURCE_EXHAUSTED (the router tries another replica, the gateway answers 503 with "
                             "Retry-After), so the queue and its waiting time stay bounded; -1: unbounded "
                             "(default: 4 x --max-num-seqs)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one step, prefill and decode together (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="automatic prefix caching (default: on)")
    parser.add_argument("--prefix-cache-hash-seed", type=int, default=0,
                        help="seed of the block hashes; must match the router's (default: %(default)s)")
    parser.add_argument("--max-logprobs", type=int, default=20, help="most logprobs per token (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without their own (default: %(default)s)")
    parser.add_argument("--replica-id", default="engine-0", help="this replica's id in events and responses")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run the model op by op, without compiled decode graphs (default: compiled where possible)")
    parser.add_argument("--num-threads", type=int,
                        help="CPU threads for the model's kernels, fixed (default: adapted to the load between one "
                             "and OMP_NUM_THREADS or the cores this process may use, by timing decode steps)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens per streamed output after the first one (which goes at once) and before the last: "
                             "1 streams every token as it is made; larger values send fewer, bigger messages through "
                             "the stack, which leaves more CPU to the model under load (default: %(default)s)")


def model_dir_from_args(args: argparse.Namespace) -> str:
    """--model, or the built-in default model (built on first use)."""
    if args.model:
        return args.model
    from services.common.default_model import ensure_default_model

    return str(ensure_default_model())


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises SystemExit with the config's own message for an invalid combination of flags."""
    try:
        return EngineConfig(
            model=model_dir_from_args(args), dtype=args.dtype, device=args.device, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_hash_seed=args.prefix_cache_hash_seed, max_logprobs=args.max_logprobs,
            attention_backend=args.attention_backend, replica_id=args.replica_id, seed=args.seed,
            enforce_eager=args.enforce_eager, num_threads=args.num_threads, stream_interval=args.stream_interval,
            max_waiting_requests=args.max_waiting_requests,
        )
    except ValueError as exc:
        raise SystemExit(f"strata: {exc}")
