"""The `strata` command: one subcommand per service, plus the tools around them.

Each subcommand hands its remaining arguments to that module's own `main(argv)`, so
`strata tokenizer --model DIR` and `python -m services.tokenizer --model DIR` are the same.
"""

import importlib
import sys

from services.bench.__main__ import TOOLS as BENCH_TOOLS
from services.engine.threads import use_openmp_wait_policy

SUBCOMMANDS = {
    "up": ("services.launcher", "start the whole stack on loopback"),
    "tokenizer": ("services.tokenizer.__main__", "run the tokenizer service"),
    "engine": ("services.engine.__main__", "run an engine replica"),
    "router": ("services.router.__main__", "run the router in front of engine replicas"),
    "gateway": ("services.gateway.__main__", "run the OpenAI HTTP gateway"),
    "autoscaler": ("services.autoscaler.__main__", "scale engine replicas on queue length and KV usage"),
    "model": ("services.default_model.cli", "build the built-in default model (`strata model init [--dir DIR]`)"),
    "generate": ("services.engine.offline", "generate offline from a checkpoint, no services"),
    "bench": ("services.bench.__main__", f"benchmarks: `strata bench {'|'.join(BENCH_TOOLS)}` (below)"),
}
RUN_THE_ENGINE_IN_PROCESS = ("engine", "generate", "bench")


def usage() -> str:
    lines = ["usage: strata <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "bench tools (`strata bench <tool> --help`):"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in BENCH_TOOLS.items()]
    lines += ["", "`strata <command> --help` lists a command's flags and their defaults."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"strata: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in RUN_THE_ENGINE_IN_PROCESS:
        use_openmp_wait_policy()  # before the subcommand's imports load torch
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
