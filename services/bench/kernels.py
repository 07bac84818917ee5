"""`strata bench kernels`: the Triton attention kernels on a GPU beside torch's, same shapes, same run.

- **paged decode** (one query token per request over a paged context, blocks scattered in the pool),
  against torch's SDPA over the same contexts gathered contiguous first (what an engine without a
  paged kernel does each step, gather included) and against the floor: the K/V read once at the
  read bandwidth measured in this run.
- **paged prefill** (a chunk of new tokens per request, causal, over the pool), against torch's
  causal SDPA (flash attention) over the same rows held contiguous, as TFLOP/s.

Llama-3-8B's attention shape by default (32 query heads, 8 KV heads, head dim 128), bfloat16.
"""

import argparse
import sys

import torch

from services.bench.arg_types import shape_list
from services.bench.floor import measure_read_bandwidth


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="(default: %(default)s)")
    parser.add_argument("--decode", type=shape_list, default="1x1024,1x8192,16x2048,64x1024,64x4096",
                        help="decode shapes, requests x context (default: %(default)s)")
    parser.add_argument("--prefill", type=shape_list, default="1x2048,8x512",
                        help="prefill shapes, requests x new tokens (default: %(default)s)")
    return parser


def scattered_pools(num_reqs: int, context: int, kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V pools holding ``num_reqs`` contexts of ``context`` tokens in shuffled blocks, and the
    block tables ``[num_reqs, blocks per request]``."""
    per_req = -(-context // block_size)
    num_blocks = num_reqs * per_req
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device).view(num_reqs, per_req)
    return k_cache, v_cache, tables


def bench_decode(args, num_reqs: int, context: int, read_bytes_per_s: float, dtype: torch.dtype,
                 device: torch.device) -> dict[str, float]:
    from triton.testing import do_bench

    from services.engine.kernels.paged_decode import paged_decode

    k_cache, v_cache, tables = scattered_pools(num_reqs, context, args.kv_heads, args.head_dim, args.block_size,
                                               dtype, device)
    q = torch.randn(num_reqs, args.heads, args.head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((num_reqs,), context, dtype=torch.int64, device=device)
    scale = args.head_dim ** -0.5

    def gathered_sdpa() -> torch.Tensor:
        k = k_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2)  # [R, kv_heads, context, D]
        v = v_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    kernel = paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    reference = gathered_sdpa().squeeze(2)
    error = (kernel.float() - reference.float()).abs().max().item()
    kernel_ms = do_bench(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, scale))
    sdpa_ms = do_bench(gathered_sdpa)
    kv_bytes = 2 * num_reqs * context * args.kv_heads * args.head_dim * k_cache.element_size()
    return {"requests": num_reqs, "context": context, "kernel_ms": kernel_ms, "sdpa_ms": sdpa_ms,
            "floor_ms": kv_bytes / read_bytes_per_s * 1e3, "gb_per_s": kv_bytes / kernel_ms / 1e6, "max_error": error}


def bench_prefill(args, num_reqs: int, new_tokens: int, dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    from triton.testing import do_bench

    from services.engine.kernels.paged_prefill import paged_prefill

    k_cache, v_cache, tables = scattered_pools(num_reqs, new_tokens, args.kv_heads, args.head_dim, args.block_size,
                                               dtype, device)
    q = torch.randn(num_reqs * new_tokens, args.heads, args.head_dim, dtype=dtype, device=device)
    starts = torch.arange(0, num_reqs * new_tokens + 1, new_tokens, device=device)
    context_lens = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5
    k = k_cache[tables].flatten(1, 2)[:, :new_tokens].transpose(1, 2)  # contiguous copies, made once
    v = v_cache[tables].flatten(1, 2)[:, :new_tokens].transpose(1, 2)
    qs = q.view(num_reqs, new_tokens, args.heads, args.head_dim).transpose(1, 2)

    def kernel() -> None:
        paged_prefill(q, k_cache, v_cache, tables, starts, context_lens, 0, num_reqs, new_tokens, scale, out)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=True)

    kernel()
    error = (out.view(num_reqs, new_tokens, args.heads, -1).transpose(1, 2).float() - sdpa().float()).abs().max().item()
    kernel_ms, sdpa_ms = do_bench(kernel), do_bench(sdpa)
    flops = num_reqs * args.heads * 2 * 2 * args.head_dim * new_tokens * (new_tokens + 1) / 2  # causal
    return {"requests": num_reqs, "new_tokens": new_tokens, "kernel_ms": kernel_ms, "sdpa_ms": sdpa_ms,
            "kernel_tflops": flops / kernel_ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9, "max_error": error}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("strata bench kernels: needs a CUDA GPU (the Triton kernels run compiled there)", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    read_bytes_per_s = measure_read_bandwidth(device=device)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, "
          f"blocks of {args.block_size}; read bandwidth {read_bytes_per_s / 1e9:.0f} GB/s")
    print("=========== paged decode: kernel vs torch SDPA over gathered contexts ===========")
    print(f"{'reqs':>5}{'context':>9}{'kernel ms':>11}{'SDPA ms':>10}{'SDPA/kernel':>13}{'floor ms':>10}"
          f"{'kernel/floor':>14}{'GB/s':>8}{'max err':>9}")
    for num_reqs, context in args.decode:
        r = bench_decode(args, num_reqs, context, read_bytes_per_s, dtype, device)
        print(f"{num_reqs:>5}{context:>9}{r['kernel_ms']:>11.3f}{r['sdpa_ms']:>10.3f}{r['sdpa_ms'] / r['kernel_ms']:>12.2f}x"
              f"{r['floor_ms']:>10.3f}{r['kernel_ms'] / r['floor_ms']:>13.2f}x{r['gb_per_s']:>8.0f}{r['max_error']:>9.1e}")
    print("=========== paged prefill: kernel vs torch causal SDPA (contiguous) ===========")
    print(f"{'reqs':>5}{'tokens':>8}{'kernel ms':>11}{'SDPA ms':>10}{'SDPA/kernel':>13}{'kernel TF/s':>13}"
          f"{'SDPA TF/s':>11}{'max err':>9}")
    for num_reqs, new_tokens in args.prefill:
        r = bench_prefill(args, num_reqs, new_tokens, dtype, device)
        print(f"{num_reqs:>5}{new_tokens:>8}{r['kernel_ms']:>11.3f}{r['sdpa_ms']:>10.3f}"
              f"{r['sdpa_ms'] / r['kernel_ms']:>12.2f}x{r['kernel_tflops']:>13.1f}{r['sdpa_tflops']:>11.1f}"
              f"{r['max_error']:>9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
