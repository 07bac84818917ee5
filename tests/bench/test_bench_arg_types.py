"""The benchmarks' own flag types: what they accept, and argparse's usage error for what they do not."""

import argparse

import pytest

from services.bench import arg_types


@pytest.mark.parametrize("value, bounds", [("64,512", (64, 512)), ("288", (288, 288)), ("7,7", (7, 7))])
def test_a_length_is_a_range_or_one_length(value, bounds):
    assert arg_types.length_range(value) == bounds


@pytest.mark.parametrize("value", ["512,64", "0", "x", "1,2,3", "", "4,"])
def test_a_length_range_refuses_what_is_not_one(value):
    with pytest.raises(argparse.ArgumentTypeError, match="need lo,hi"):
        arg_types.length_range(value)


def test_shapes_are_comma_separated_pairs():
    assert arg_types.shape_list("1x1024,64x4096") == [(1, 1024), (64, 4096)]
    assert arg_types.shape_list(" 2x8 ,") == [(2, 8)]


@pytest.mark.parametrize("value", ["1x", "1y2", "0x8", "2x3x4", "ax1"])
def test_a_bad_shape_is_named_in_the_error(value):
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{value}': need AxB"):
        arg_types.shape_list(value)


def test_a_count_is_a_positive_integer():
    assert arg_types.positive_int("64") == 64
    for value in ("0", "-3", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="need an integer >= 1"):
            arg_types.positive_int(value)
