"""`strata model init [--dir DIR] [--force]`: builds the built-in default model and prints its path."""

import argparse

from services.common.default_model import MODEL_NAME, default_cache_dir, ensure_default_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata model", description="Manage the built-in default model.")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help=f"build {MODEL_NAME} (a no-op when it is already there)")
    init.add_argument("--dir", help=f"cache directory (default: $STRATA_CACHE_DIR or {default_cache_dir()})")
    init.add_argument("--force", action="store_true", help="rebuild even when the model is already there")
    args = parser.parse_args(argv)
    print(ensure_default_model(args.dir, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
