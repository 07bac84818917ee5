"""``python -m services.gateway --port 8000 --tokenizer-addr H:P --engine-addr H:P`` (also
``strata gateway ...``). Flags are named like ``vllm serve``'s where the meaning is the same."""

import argparse
import logging
import os

import uvicorn

from services.common.telemetry import setup_tracing
from services.gateway.app import GatewayConfig, create_app
from services.gateway.tools import TOOL_CALL_PARSERS
from services.gateway.validation import Limits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = Limits()
    parser = argparse.ArgumentParser(prog="strata gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokenizer-addr", required=True, help="host:port of the tokenizer service")
    parser.add_argument("--engine-addr", required=True, help="host:port of an engine or the router")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the engine's model)")
    parser.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $STRATA_API_KEY)")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="largest n per request")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings)
    parser.add_argument("--max-prompts", type=int, default=defaults.max_prompts,
                        help="most prompts in one /v1/completions request")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="largest request body; more is a 413 (default: %(default)s, at most 16 MiB)")
    parser.add_argument("--max-sequences-per-request", type=int, default=defaults.max_sequences_per_request,
                        help="most sequences (n x prompts) one request may generate; more is a 400 "
                             "(default: %(default)s, below one default engine's batch and queue)")
    parser.add_argument("--max-concurrent-requests", type=int, default=GatewayConfig.max_concurrent_requests,
                        help="generation requests served at once (streams until their end); more are refused "
                             "at once with 503 and Retry-After (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=3600.0,
                        help="deadline of one generation, seconds")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='read tool calls out of the model\'s text (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the model's tool-call format (hermes: Hermes 2 Pro, Qwen2.5, Qwen3)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("strata-gateway")
    try:
        config = GatewayConfig(
            tokenizer_addr=args.tokenizer_addr, engine_addr=args.engine_addr,
            served_model_name=args.served_model_name, api_key=args.api_key,
            limits=Limits(max_n=args.max_n, max_stop_strings=args.max_stop_strings,
                          max_prompts=args.max_prompts, max_body_bytes=args.max_body_bytes,
                          max_sequences_per_request=args.max_sequences_per_request),
            request_timeout_s=args.request_timeout, max_concurrent_requests=args.max_concurrent_requests,
            tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
    except ValueError as error:
        raise SystemExit(f"strata gateway: {error}")
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
