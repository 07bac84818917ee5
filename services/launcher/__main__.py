"""`python -m services.launcher` (also `strata up`)."""

from services.launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
