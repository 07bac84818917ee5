"""`strata bench sampler`: the engine's sampler on the CPU against the same sampling done with torch
operators, on the same logits in one run, and against the floor of one read of the logits.

For each batch (rows x vocabulary) and each way of sampling, the logits have a language model's shape
(a few tokens hold most of the mass: each row's tokens ranked at random, logit -2.5 log(1 + rank) plus
noise) and every row a 400-token prompt (`--prompt-tokens`) and 160 outputs (what the penalties look at):

- **ours**: `Sampler` as the engine calls it: the penalties written into the logits in place and put
  back after the draw (`logit_edits.py`), then temperature, the filters and the draw in one native
  call per step (`cpu_kernels/sampling.py`).
- **torch ops**: the penalties on a copy of the logits with torch's gathers and scatters
  (`Sampler.process_logits(native=False)`), then
  `Sampler.probabilities` (temperature, min_p, a sort of every row for top_k and top_p, softmax) and
  `inverse_cdf_draw`: what the sampler does without its native library, as on a GPU.
- **floor**: the logits read once at the read bandwidth measured in this run.

The default sizes are Llama 2's and Qwen2's vocabularies at one and 64 rows.
"""

import argparse
import random
import statistics
import time

import torch

from services.bench.arg_types import shape_list
from services.bench.floor import measure_read_bandwidth
from services.engine.inverse_cdf import inverse_cdf_draw
from services.engine.request import Request
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams

SAMPLINGS = {
    "temperature 1": dict(),
    "Qwen2.5 defaults": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "top_k 50": dict(top_k=50),
    "presence 0.5": dict(presence_penalty=0.5),
}
PROMPT_TOKENS, OUTPUT_TOKENS = 400, 160


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata bench sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=shape_list, default="1x32000,64x32000,1x151936,64x151936",
                        help="rows x vocabulary, comma-separated (default: %(default)s)")
    parser.add_argument("--samplings", default=",".join(SAMPLINGS),
                        help=f"comma-separated, of: {', '.join(SAMPLINGS)} (default: all)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help="random prompt tokens of each row, before its outputs (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each, median (default: %(default)s)")
    return parser


def language_model_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)]).float()
    return -2.5 * torch.log1p(ranks) + 0.3 * torch.randn(rows, vocab, generator=generator)


def requests_for(rows: int, vocab: int, params: SamplingParams, seed: int,
                 prompt_tokens: int = PROMPT_TOKENS) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for row in range(rows):
        request = Request(f"bench-{row}", [rng.randrange(vocab) for _ in range(prompt_tokens)], params,
                          eos_token_ids=(vocab - 1,))
        for _ in range(OUTPUT_TOKENS):
            request.append_output(rng.randrange(vocab))
        requests.append(request)
    return requests


def with_torch_ops(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The same sampling with torch operators: the penalties on a copy, a sort per row for the filters."""
    params = [r.sampling_params for r in requests]
    processed = sampler.process_logits(logits, requests, native=False)
    uniforms = torch.rand(len(requests), dtype=torch.float64, generator=sampler.generator)
    return inverse_cdf_draw(sampler.probabilities(processed, params), uniforms)


def median_seconds(call, repeats: int) -> float:
    call()  # warm-up (and the native library's build)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    samplings = [name.strip() for name in args.samplings.split(",") if name.strip()]
    unknown = [name for name in samplings if name not in SAMPLINGS]
    if unknown:
        raise SystemExit(f"strata bench sampler: unknown sampling {unknown[0]!r} (known: {', '.join(SAMPLINGS)})")
    bandwidth = measure_read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads, "
          f"{args.prompt_tokens}-token prompts and {OUTPUT_TOKENS} outputs")
    print(f"{'batch':>12}  {'sampling':<18} {'ours ms':>9} {'torch ops ms':>13} {'torch/ours':>11} "
          f"{'floor ms':>9} {'ours/floor':>11}")
    for rows, vocab in args.batches:
        generator = torch.Generator().manual_seed(rows * vocab)
        logits = language_model_logits(rows, vocab, generator)
        floor = logits.numel() * logits.element_size() / bandwidth
        for name in samplings:
            requests = requests_for(rows, vocab, SamplingParams(**SAMPLINGS[name]), seed=rows,
                                    prompt_tokens=args.prompt_tokens)
            sampler = Sampler(vocab, torch.device("cpu"))
            ours = median_seconds(lambda: sampler(logits, requests), args.repeats)
            torch_ops = median_seconds(lambda: with_torch_ops(sampler, logits, requests), args.repeats)
            print(f"{rows:>5} x {vocab:<6} {name:<18} {ours * 1e3:>9.2f} {torch_ops * 1e3:>13.2f} "
                  f"{torch_ops / ours:>10.1f}x {floor * 1e3:>9.3f} {ours / floor:>10.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
