"""The CPU's packed projections compute what ``F.linear`` computes, for every row count and layout, with
and without the native kernel, keeping two copies of each weight at most."""

import pytest
import torch
import torch.nn.functional as F

from services.engine.cpu_kernels import linear as native_linear
from services.engine.models.packed_linear import (
    NATIVE_MAX_ROWS,
    PACKED_MIN_ROWS,
    PackedLinear,
    can_pack,
    onednn_packs,
    pack_linears,
)

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch without oneDNN")
ROWS = [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 64, 300]


@pytest.fixture(params=["native", "without_native"])
def native(request, monkeypatch):
    """Runs a test with the native kernel (where it builds) and as on a machine without a compiler."""
    if request.param == "native" and not native_linear.can_run(torch.float32):
        pytest.skip("no C++ compiler for the native CPU kernels")
    if request.param == "without_native":
        monkeypatch.setattr(native_linear, "can_run", lambda dtype: False)
    return request.param == "native"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_float32(native, rows, bias):
    torch.manual_seed(rows)
    weight, b = torch.randn(96, 80), (torch.randn(96) if bias else None)
    x = torch.randn(rows, 80)
    linear = PackedLinear(weight, b)
    assert (linear.blocked is not None) == native
    assert (linear.original is not None) == (not native)  # without the native kernel float32 keeps it for few rows
    torch.testing.assert_close(linear.weight, weight, rtol=0, atol=0)
    torch.testing.assert_close(linear(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, NATIVE_MAX_ROWS, 32, NATIVE_MAX_ROWS + 36])
def test_strided_input_and_bfloat16(native, rows):
    torch.manual_seed(0)
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 96, dtype=torch.bfloat16)
    x = gate_up[:, :48]  # a strided view, as the MLP's gate half is
    assert not x.is_contiguous() or rows == 1
    linear = PackedLinear(weight, None)
    # bfloat16 keeps the original only where neither oneDNN (no AVX-512 here) nor the native kernel runs it
    assert (linear.original is None) == (onednn_packs(torch.bfloat16) or native)
    assert (linear.packed is None) != onednn_packs(torch.bfloat16)
    assert linear.native_for_all_rows == (native and not onednn_packs(torch.bfloat16))
    if native:
        torch.testing.assert_close(linear.weight, weight, rtol=0, atol=0)
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", ROWS)
def test_shared_weight_is_the_second_copy(native, rows):
    torch.manual_seed(rows)
    embedding = torch.randn(200, 32)
    x = torch.randn(rows, 32)
    linear = PackedLinear(embedding, None, weight_is_shared=True)
    assert linear.original is embedding and linear.weight is embedding
    assert (linear.packed is None) == native  # blocked + the embedding itself, no oneDNN copy
    torch.testing.assert_close(linear(x), F.linear(x, embedding), rtol=1e-5, atol=1e-4)


def test_pack_linears_replaces_every_linear(native):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    bias = model[0].bias
    x = torch.randn(12, 8)
    expected = model(x)
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear"]
    assert model[0].bias is bias
    for rows in (1, 12):
        torch.testing.assert_close(model(x[:rows]), expected[:rows], rtol=1e-5, atol=1e-5)


def test_cuda_and_float16_are_left_alone():
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)
