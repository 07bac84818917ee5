"""The CPU's prepacked projections compute what ``F.linear`` computes, for every row count and layout."""

import pytest
import torch
import torch.nn.functional as F

from services.engine.models.packed_linear import PACKED_MIN_ROWS, PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch without oneDNN")


@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_float32(rows, bias):
    torch.manual_seed(rows)
    weight, b = torch.randn(96, 80), (torch.randn(96) if bias else None)
    x = torch.randn(rows, 80)
    torch.testing.assert_close(PackedLinear(weight, b)(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 32])
def test_strided_input_and_bfloat16(rows):
    torch.manual_seed(0)
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 96, dtype=torch.bfloat16)
    x = gate_up[:, :48]  # a strided view, as the MLP's gate half is
    assert not x.is_contiguous() or rows == 1
    linear = PackedLinear(weight, None)
    assert linear.weight is None  # bfloat16 runs packed at every batch size: the original is not kept
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=2e-2, atol=2e-2)


def test_pack_linears_replaces_every_linear_and_shares_the_weights():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    weights = [model[0].weight, model[2].weight]
    x = torch.randn(12, 8)
    expected = model(x)
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear"]
    assert model[0].weight is weights[0] and model[2].weight is weights[1]
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_cuda_and_float16_are_left_alone():
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)
