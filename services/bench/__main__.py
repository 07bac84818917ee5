"""`strata bench <tool> ...`: hands the rest of the arguments to that tool (one of TOOLS)."""

import importlib
import sys

from services.engine.threads import use_openmp_wait_policy

TOOLS = {
    "serve": ("services.bench.serve", "load-test a running OpenAI-compatible server"),
    "offline": ("services.bench.offline", "the engine in-process against HF transformers"),
    "overhead": ("services.bench.overhead", "the whole stack against the engine in-process"),
    "routing": ("services.bench.routing", "prefix-aware routing against round-robin, on replicas"),
    "structured": ("services.bench.structured", "JSON-schema-constrained streams against unconstrained ones"),
    "compare": ("services.bench.compare", "two result files side by side, with ratios"),
    "kernels": ("services.bench.kernels", "the Triton attention kernels against torch's, on a GPU"),
    "sampler": ("services.bench.sampler", "the engine's CPU sampler against torch operators"),
    "llamacpp": ("services.bench.llamacpp", "build, convert for and start llama.cpp's server (the baseline)"),
}


def usage() -> str:
    lines = ["usage: strata bench <tool> [args...]", "", "tools:"]
    return "\n".join(lines + [f"  {name:<10} {text}" for name, (_, text) in TOOLS.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in TOOLS:
        print(f"strata bench: unknown tool {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    use_openmp_wait_policy()  # before the tool's imports load torch: offline and overhead run an engine
    module = importlib.import_module(TOOLS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
