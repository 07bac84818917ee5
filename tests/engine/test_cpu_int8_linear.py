"""Weight-only int8 projections (``--quantization int8``): ``quantize_int8`` rounds a weight to int8 with a
scale per output row, and ``int8_linear`` multiplies bfloat16 x by it as a float32 reference on the
same integers does, over odd shapes and every path (x as int16 blocks up to 8 rows, AMX tiles from 9
where the CPU has them), with x's dynamic range and non-finite values handled."""

import math

import pytest
import torch

from services.engine.cpu_kernels.linear import (
    PANEL,
    block_int8,
    can_run,
    dequantize_int8,
    int8_linear,
    quantize_int8,
    unblock_weight,
    uses_amx,
)

pytestmark = pytest.mark.skipif(not can_run(torch.bfloat16), reason="no C++ compiler for the native CPU kernels")


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).div_(k ** 0.5)
    x = torch.randn(m, k, generator=generator).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    return x, weight, b


def reference(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, b: torch.Tensor | None,
              n: int) -> torch.Tensor:
    """What int8_linear computes, in float64: the integers' sums, times each output's scale, plus the bias."""
    q = unblock_weight(blocked, n, x.shape[1]).double()
    y = (x.double() @ q.T) * scales.double()
    return (y + b.double() if b is not None else y).float()


def assert_matches(y: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the bfloat16 rounding of the output (half a step, and a step where the float32 sums land
    on a rounding boundary)."""
    assert y.dtype == torch.bfloat16
    step = torch.finfo(torch.bfloat16).eps * expected.abs().clamp(min=1e-3)
    assert ((y.float() - expected).abs() <= step + 1e-4).all()


@pytest.mark.slow  # a 110-case shape sweep
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 100])
@pytest.mark.parametrize("n, k", [(7, 5), (123, 123), (40, 512), (33, 1376), (300, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference(m, n, k, bias):
    x, weight, b = _case(m, n, k, bias, seed=m * 7 + n + k)
    blocked, scales = quantize_int8(weight)
    y = int8_linear(x, blocked, scales, b, n)
    assert y.shape == (m, n)
    assert_matches(y, reference(x, blocked, scales, b, n))


@pytest.mark.parametrize("m", [1, 3, 20, 600])  # 600: on AMX, two blocks of rows (512 and 88)
def test_many_more_rows_and_long_k(m):
    x, weight, b = _case(m, 2048, 4864, bias=True, seed=m)
    blocked, scales = quantize_int8(weight)
    assert_matches(int8_linear(x, blocked, scales, b, 2048), reference(x, blocked, scales, b, 2048))


def test_quantize_rounds_each_row_to_its_own_scale():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.0, -0.01]])
    blocked, scales = quantize_int8(weight)
    assert blocked.dtype == torch.int8 and blocked.shape == (1, 2, PANEL, 2)
    torch.testing.assert_close(scales, torch.tensor([1.0 / 127, 1.0, 3.0 / 127]))
    q = unblock_weight(blocked, 3, 3)
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 42, 0]]  # 63.5 rounds to even, -0.42 to 0
    dequantized = dequantize_int8(blocked, scales, 3, 3)
    assert ((dequantized - weight).abs() <= scales[:, None] / 2 + 1e-7).all()
    assert dequantize_int8(blocked, scales, 3, 3, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("m", [1, 9])  # int16 blocks; and AMX where the CPU has it
def test_a_checkpoints_own_integers_down_to_minus_128(m):
    """``block_int8`` lays out integers as stored (a published checkpoint's, -128 included) for the same kernels."""
    generator = torch.Generator().manual_seed(m)
    q = torch.randint(-128, 128, (40, 96), generator=generator, dtype=torch.int8)
    q[:, 0] = -128
    scales = torch.rand(40, generator=generator) / 100
    x = torch.randn(m, 96, generator=generator).bfloat16()
    blocked = block_int8(q)
    assert torch.equal(unblock_weight(blocked, 40, 96), q)
    assert_matches(int8_linear(x, blocked, scales, None, 40), reference(x, blocked, scales, None, 40))


def test_a_wide_range_within_a_block_of_x():
    """x's int16 blocks (32 elements, a power-of-two scale each) are exact within 2^7 of a block's largest
    element and round smaller ones at 2^-15 of it: one huge element beside small ones stays within the
    output's rounding, and the small ones still count where the huge one meets a zero weight."""
    n, k = 16, 64
    weight = torch.randn(n, k)
    weight[:, 0] = 0.0  # the huge element's weights
    blocked, scales = quantize_int8(weight)
    x = torch.randn(1, k).bfloat16()
    x[0, 0] = 3.0e4
    y = int8_linear(x, blocked, scales, None, n)
    expected = reference(x, blocked, scales, None, n)
    tolerance = 3.0e4 * 2.0 ** -15 * unblock_weight(blocked, n, k).abs().sum(1) * scales  # the rounding's bound
    assert ((y.float() - expected).abs() <= tolerance + torch.finfo(torch.bfloat16).eps * expected.abs()).all()


@pytest.mark.parametrize("m", [1, 9])  # int16 blocks; and AMX where the CPU has it
def test_non_finite_x_gives_non_finite_outputs_only_in_its_rows(m):
    x, weight, _ = _case(m, 32, 64, bias=False)
    x[0, 5] = math.inf if m == 1 else math.nan
    blocked, scales = quantize_int8(weight)
    y = int8_linear(x, blocked, scales, None, 32)
    assert not y[0].isfinite().any()
    assert y[1:].isfinite().all()


def test_tiny_and_zero_blocks():
    x, weight, _ = _case(2, 16, 64, bias=False)
    x[0] = 0.0
    x[1, :32] = 1e-36  # under 2^-113: counted as zeros
    blocked, scales = quantize_int8(weight)
    y = int8_linear(x, blocked, scales, None, 16)
    assert torch.equal(y[0], torch.zeros(16, dtype=torch.bfloat16))
    assert_matches(y[1:], reference(x[1:], blocked, scales, None, 16).nan_to_num())


def test_row_strided_input():
    x, weight, b = _case(5, 100, 512, bias=True)
    row_strided = torch.cat([x, torch.randn(5, 64).bfloat16()], dim=1)[:, :512]
    blocked, scales = quantize_int8(weight)
    assert_matches(int8_linear(row_strided, blocked, scales, b, 100), reference(x, blocked, scales, b, 100))


def test_amx_is_used_past_one_pass_of_rows_where_the_cpu_has_it():
    """(Where the CPU lacks AMX, both paths are still checked above: every shape runs the int16 blocks.)"""
    if not uses_amx(9, 512, int8=True):
        pytest.skip("no AMX tiles here")
    assert not uses_amx(8, 512, int8=True) and uses_amx(8, 512)


def test_rejects_mismatched_arguments():
    x, weight, b = _case(2, 32, 16, bias=True)
    blocked, scales = quantize_int8(weight)
    with pytest.raises(ValueError, match="does not fit"):
        int8_linear(x.float(), blocked, scales, b, 32)
    with pytest.raises(ValueError, match="does not fit"):
        int8_linear(x[:, :13], blocked, scales, b, 32)
    with pytest.raises(ValueError, match="scales"):
        int8_linear(x, blocked, scales[:31], b, 32)
    with pytest.raises(ValueError, match="bias"):
        int8_linear(x, blocked, scales, b.float(), 32)
    with pytest.raises(ValueError, match="2-d float"):
        quantize_int8(weight.to(torch.int8))


def test_compiled_caller_sees_an_opaque_op():
    x, weight, b = _case(3, 40, 24, bias=True)
    blocked, scales = quantize_int8(weight)
    compiled = torch.compile(lambda t: torch.relu(int8_linear(t, blocked, scales, b, 40)), backend="eager",
                             fullgraph=True)
    assert torch.equal(compiled(x), torch.relu(int8_linear(x, blocked, scales, b, 40)))
