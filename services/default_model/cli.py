"""`strata model init [--dir DIR] [--force]`: builds the built-in default model and prints its path."""

import argparse

from services.default_model.model import MODEL_NAME, default_cache_dir, ensure_default_model, ensure_model_at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata model", description="Manage the built-in default model.")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help=f"build {MODEL_NAME} (a no-op when it is already there)",
                               description=f"Build the built-in model, {MODEL_NAME}, and print its directory.")
    init.add_argument("--dir", help="the model's directory itself, built unless it holds the model already; it must "
                                    "be new, empty or hold the model (default: CACHE/models/" + MODEL_NAME + ", CACHE "
                                    "being $STRATA_CACHE_DIR or ~/.cache/strata, now " + str(default_cache_dir()) +
                                    ": where commands look for it when given no --model)")
    init.add_argument("--force", action="store_true", help="rebuild even when the model is already there")
    args = parser.parse_args(argv)
    try:
        print(ensure_model_at(args.dir, force=args.force) if args.dir else ensure_default_model(force=args.force))
    except ValueError as error:
        parser.exit(2, f"strata model init: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
