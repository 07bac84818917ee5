"""`python -m services.tokenizer [--model DIR] [--host H] [--port P]` (also `strata tokenizer`)."""

import argparse

import uvloop

from services.common.gc_heap import freeze_startup_heap
from services.common.logging_setup import add_logging_args, setup_logging
from services.common.metrics_http import start_metrics_server
from services.common.model_source import resolve_model_dir
from services.common.telemetry import setup_tracing
from services.common.tls import add_tls_args, tls_from_args
from services.default_model.model import ensure_default_model
from services.tokenizer.chat_template import server_chat_template
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from services.tokenizer.server import TokenizerServicer, serve
from services.tokenizer.template_budget import TemplateLimits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata tokenizer", description="Run the tokenizer gRPC service.")
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in default model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="port, 0 for any free one (default: %(default)s)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (a template is code the server runs; "
                             "off by default, as in vLLM); it still renders in the sandbox, within the limits below")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template to use instead of the checkpoint's (for a checkpoint without one): "
                             "a file, or the template itself (default: the checkpoint's)")
    parser.add_argument("--chat-template-timeout", type=float, default=1.0,
                        help="seconds one chat template render may take (default: %(default)s)")
    parser.add_argument("--max-chat-template-chars", type=int, default=4 << 20,
                        help="most characters (or items) a render may build or output, unless twice the size of "
                             "the messages is more (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=4,
                        help="threads that encode, render and decode off the event loop (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default: none)")
    parser.add_argument("--shutdown-timeout", type=float, default=60.0,
                        help="seconds open Detokenize streams may take to finish after SIGTERM (default: %(default)s)")
    add_tls_args(parser)
    add_logging_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tls = tls_from_args(args, parser)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    try:
        limits = TemplateLimits(timeout_s=args.chat_template_timeout, max_chars=args.max_chat_template_chars)
    except ValueError as error:
        parser.error(str(error))
    setup_logging(args.log_level, args.log_format, service="strata-tokenizer")
    setup_tracing("strata-tokenizer")
    try:
        chat_template = server_chat_template(args.chat_template) if args.chat_template else None
        model_dir = resolve_model_dir(args.model) if args.model else ensure_default_model()
        tokenizer = CheckpointTokenizer.from_dir(model_dir, chat_template)
    except (ValueError, FileNotFoundError) as error:  # the checkpoint's: its message says which file
        raise SystemExit(f"strata tokenizer: {error}") from None
    servicer = TokenizerServicer(tokenizer, args.trust_request_chat_template, args.workers, limits)
    if args.metrics_port is not None:
        start_metrics_server(args.host, args.metrics_port, servicer.metrics.registry)
    freeze_startup_heap("tokenizer")
    # grpc.aio on uvloop: less CPU per streamed token
    uvloop.run(serve(tokenizer, args.host, args.port, servicer, tls, args.shutdown_timeout))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
