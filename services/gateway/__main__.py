"""``python -m services.gateway --port 8000 --tokenizer-addr H:P --engine-addr H:P`` (also
``strata gateway ...``). Flags are named like ``vllm serve``'s where the meaning is the same."""

import argparse
import json
import os
from pathlib import Path

import uvicorn

from services.common.gc_heap import freeze_startup_heap
from services.common.logging_setup import add_logging_args, setup_logging
from services.common.telemetry import setup_tracing
from services.common.tls import add_tls_args, tls_from_args
from services.gateway.access_log import quiet_probes
from services.gateway.app import MAX_BODY_BYTES_LIMIT, CorsPolicy, GatewayConfig, create_app
from services.gateway.reasoning import REASONING_PARSERS
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from services.gateway.validation import Limits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = Limits()
    parser = argparse.ArgumentParser(prog="strata gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--tokenizer-addr", required=True, help="host:port of the tokenizer service")
    parser.add_argument("--engine-addr", required=True, help="host:port of an engine or the router")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name clients send, or several: any is accepted, the first is the one "
                             "/v1/models lists first and answers carry by default (default: the engine's model)")
    parser.add_argument("--api-key-file", type=Path,
                        help="read the API key from this file (a mounted secret); not echoed anywhere")
    parser.add_argument("--shutdown-timeout", type=float, default=60.0,
                        help="seconds running streams may take to finish after SIGTERM; new requests get 503 "
                             "meanwhile, and a stream still running then ends with an error event "
                             "(default: %(default)s)")
    add_tls_args(parser)
    parser.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $STRATA_API_KEY)")
    parser.add_argument("--max-n", type=int, default=defaults.max_n,
                        help="largest n per request; more is a 400 (default: %(default)s)")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help="most stop strings per request; more is a 400 (default: %(default)s)")
    parser.add_argument("--max-prompts", type=int, default=defaults.max_prompts,
                        help="most prompts in one /v1/completions request; more is a 400 (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help=f"largest request body, bytes; more is a 413 (default: %(default)s; at most "
                              f"{MAX_BODY_BYTES_LIMIT >> 20} MiB)")
    parser.add_argument("--max-sequences-per-request", type=int, default=defaults.max_sequences_per_request,
                        help="most sequences (n x prompts) one request may generate; more is a 400 "
                             "(default: %(default)s, below one default engine's batch and queue)")
    parser.add_argument("--max-concurrent-requests", type=int, default=GatewayConfig.max_concurrent_requests,
                        help="generation requests served at once (streams until their end); more are refused "
                             "at once with 503 and Retry-After (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=GatewayConfig.request_timeout_s,
                        help="seconds one generation may take, from its Generate call to its last token "
                             "(the deadline of its gRPC calls) (default: %(default)s)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='read tool calls out of the model\'s text (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the model's tool-call format (hermes: Hermes 2 Pro, Qwen2.5, Qwen3; llama3_json: Llama 3.1, "
                             "3.2; pythonic: Llama 3.2 1B/3B with a pythonic template; mistral: Mistral 7B Instruct "
                             "v0.3 and later) (default: none)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="the model thinks before it answers; its thinking goes to chat messages' reasoning "
                             "(deepseek_r1: <think>...</think>, DeepSeek-R1 and its distills, QwQ) (default: none)")
    cors = CorsPolicy()
    parser.add_argument("--allowed-origins", type=_json_strings, default=list(cors.allowed_origins),
                        help="JSON list of the origins whose web pages may call the API (CORS), as vLLM's flag "
                             "(default: %(default)s)")
    parser.add_argument("--allowed-methods", type=_json_strings, default=list(cors.allowed_methods),
                        help="JSON list of the methods they may use (default: %(default)s)")
    parser.add_argument("--allowed-headers", type=_json_strings, default=list(cors.allowed_headers),
                        help="JSON list of the headers they may send (default: %(default)s)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="let them send cookies and HTTP auth with their requests (default: off)")
    add_logging_args(parser)
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.api_key_file is not None:
        try:
            args.api_key = args.api_key_file.read_text().strip()
        except OSError as error:
            parser.error(f"--api-key-file: {error}")
        if not args.api_key:
            parser.error(f"--api-key-file {args.api_key_file} is empty")
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be >= 0")
    args.tls = tls_from_args(args, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format, service="strata-gateway")
    quiet_probes()
    setup_tracing("strata-gateway")
    try:
        config = GatewayConfig(
            tokenizer_addr=args.tokenizer_addr, engine_addr=args.engine_addr,
            served_model_name=args.served_model_name[0] if args.served_model_name else None,
            served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
            api_key=args.api_key,
            limits=Limits(max_n=args.max_n, max_stop_strings=args.max_stop_strings,
                          max_prompts=args.max_prompts, max_body_bytes=args.max_body_bytes,
                          max_sequences_per_request=args.max_sequences_per_request),
            request_timeout_s=args.request_timeout, max_concurrent_requests=args.max_concurrent_requests,
            tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
            reasoning_parser=args.reasoning_parser, tls=args.tls,
            cors=cors_policy(args))
    except ValueError as error:
        raise SystemExit(f"strata gateway: {error}")
    app = create_app(config)
    # uvicorn waits a little past the drain's deadline, so the streams' last error events go out first
    # log_config=None: uvicorn's own lines (its access lines too) go through setup_logging's handler
    server = _DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                            log_config=None, timeout_graceful_shutdown=args.shutdown_timeout + 2.0),
                             app.state.drain, args.shutdown_timeout)
    freeze_startup_heap("gateway")
    server.run()
    return 0


def cors_policy(args: argparse.Namespace) -> CorsPolicy:
    """The CORS flags' policy."""
    return CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                      args.allow_credentials)


def _json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings ('["http://localhost:3000"]'), as vLLM's CORS flags take them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, not {text!r}")
    return value


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, beginning the gateway's drain when it is asked to exit (SIGTERM, Ctrl-C)."""

    def __init__(self, config: uvicorn.Config, drain, timeout_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._timeout_s = timeout_s

    def handle_exit(self, sig, frame) -> None:
        self._drain.begin_threadsafe(self._timeout_s)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    raise SystemExit(main())
