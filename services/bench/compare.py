"""`strata bench compare A.json B.json`: two results metric by metric, with the ratio B/A.

Reads any result of the shared format (`serve` or `offline`); runs are paired by label (a single
run on each side pairs regardless), and only metrics both carry are listed.
"""

import argparse
import sys

from services.bench.report import format_comparison
from services.bench.results import load_result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="baseline result JSON")
    p.add_argument("b", help="result JSON to compare against the baseline")
    args = p.parse_args(argv)
    try:
        a, b = load_result(args.a), load_result(args.b)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"strata bench compare: {exc}", file=sys.stderr)
        return 2
    print(f"A = {args.a} ({a.kind})\nB = {args.b} ({b.kind})\n")
    print(format_comparison(a, b))
    return 0
