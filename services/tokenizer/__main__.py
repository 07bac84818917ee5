"""`python -m services.tokenizer [--model DIR] [--host H] [--port P]` (also `strata tokenizer`)."""

import argparse
import logging

import uvloop

from services.common.default_model import ensure_default_model
from services.common.telemetry import setup_tracing
from services.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from services.tokenizer.server import serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata tokenizer", description="Run the tokenizer gRPC service.")
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in default model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="port, 0 for any free one (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("strata-tokenizer")
    tokenizer = CheckpointTokenizer.from_dir(args.model or ensure_default_model())
    uvloop.run(serve(tokenizer, args.host, args.port))  # grpc.aio on uvloop: less CPU per streamed token
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
