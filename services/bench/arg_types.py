"""The benchmarks' flag values that argparse has no type for; a bad value is argparse's usage error
(exit 2, the flag named), not a traceback."""

import argparse


def length_range(text: str) -> tuple[int, int]:
    """``lo,hi`` (lengths uniform in it), or ``N`` (every one N): ``--input-len 64,512``."""
    try:
        bounds = [int(x) for x in text.split(",")]
    except ValueError:
        bounds = []
    if len(bounds) == 1:
        bounds *= 2
    if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need lo,hi with 1 <= lo <= hi, or one length >= 1")
    return bounds[0], bounds[1]


def shape_list(text: str) -> list[tuple[int, int]]:
    """Comma-separated ``AxB`` pairs of positive integers: ``--decode 1x1024,64x4096``."""
    shapes = []
    for item in filter(None, (item.strip() for item in text.split(","))):
        try:
            a, b = (int(x) for x in item.split("x"))
        except ValueError:
            a = b = 0
        if a < 1 or b < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: need AxB, two positive integers (as 64x1024)")
        shapes.append((a, b))
    return shapes


def positive_int(text: str) -> int:
    """A count of at least 1: ``--num-prompts``, ``--max-concurrency``, a length."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 1")
    return value
