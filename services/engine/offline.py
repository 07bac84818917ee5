"""`strata generate`: run prompts through the engine in-process, no services, and print the text.

    strata generate --prompt "Once upon a time" --max-tokens 32
    strata generate --model DIR --chat --prompt "Hello!" --temperature 0.7 --seed 1
"""

import argparse
import json
import sys
import time

from services.engine.engine_args import add_engine_args, config_from_args, with_local_model
from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt; repeat the flag for several, run together in one batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt "
                        "(default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="tokens generated before EOS or a stop token may end a prompt's output "
                             "(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens whose probability adds up to this "
                             "(default: %(default)s: every token)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample from the k most likely tokens; 0: off (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than this fraction of the most likely one "
                             "(default: %(default)s: off)")
    parser.add_argument("--sampling-seed", type=int,
                        help="per-request seed (reproducible sampling) (default: the engine's generator, --seed)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past EOS, up to --max-tokens (default: stop at EOS)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt (ids and text) (default: the text)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = with_local_model(config_from_args(args))
    tokenizer = CheckpointTokenizer.from_dir(config.model)
    if args.chat:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)[0]
                   for p in args.prompt]
    else:
        prompts = [tokenizer.encode(p, add_special_tokens=True) for p in args.prompt]
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                                ignore_eos=args.ignore_eos)
        llm = LLM(config)
        for prompt in prompts:  # a prompt the engine would refuse, before any runs
            llm.core.validate(prompt, params)
    except ValueError as exc:  # flags, a checkpoint or a request the engine refuses: its reason, not a traceback
        raise SystemExit(f"strata generate: {exc}") from None
    started = time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    for prompt_text, completion in zip(args.prompt, completions):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": prompt_text, "prompt_token_ids": completion.prompt_token_ids,
                              "token_ids": completion.token_ids, "text": text,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"--- {prompt_text!r} ({completion.finish_reason})\n{text}")
    num_tokens = sum(len(c.token_ids) for c in completions)
    print(f"{num_tokens} tokens in {seconds:.2f}s ({num_tokens / seconds:.1f} tok/s)", file=sys.stderr)
    return 0
