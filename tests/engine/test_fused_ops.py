"""The native row passes of the torch forward on the CPU (services/engine/cpu_kernels/fused_ops.py)
against the torch ops they replace: the residual add with RMSNorm, rotary and silu(gate) * up, in
float32 and bfloat16, on widths that are and are not multiples of a vector (16 lanes), and on
strided rows. The residual sum and bfloat16's rotary and activation round exactly as torch; the norm
differs only in the order of its float32 sum, and float32's activation in exp's last bit."""

import pytest
import torch
import torch.nn.functional as F

from services.engine.cpu_kernels import fused_ops
from services.engine.models.layers import GatedMLP, RMSNorm
from services.engine.models.rope import apply_rotary_

pytestmark = pytest.mark.skipif(fused_ops._library() is None, reason="no C++ compiler for the native kernels")

DTYPES = (torch.float32, torch.bfloat16)
WIDTHS = (512, 100, 7)  # a multiple of 16 lanes, and two that leave a partial vector


def torch_norm(x, residual, weight, eps):
    """What RMSNorm computes with torch ops (models/layers.py)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def assert_close_in_dtype(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    else:  # a different float32 sum may round a value to the neighbouring bfloat16, rarely
        assert (actual != expected).float().mean() < 1e-3
        torch.testing.assert_close(actual, expected, atol=0, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("with_residual", (True, False))
def test_add_rms_norm_matches_torch(dtype, width, with_residual):
    torch.manual_seed(width)
    x, weight = torch.randn(37, width, dtype=dtype), torch.randn(width, dtype=dtype)
    residual = torch.randn(37, width, dtype=dtype) if with_residual else None
    expected_residual = None if residual is None else residual.clone()
    expected = torch_norm(x, expected_residual, weight, 1e-6)
    out = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    if with_residual:
        assert torch.equal(residual, expected_residual)  # the sum, rounded as torch's add_
    assert_close_in_dtype(out, expected)


def test_bfloat16_sums_round_as_torch_at_subnormals_infinities_and_nans():
    """The CPU's own bfloat16 conversion turns a subnormal into zero where torch keeps it: a vector
    holding one must round the other way. Sums in 16-lane vectors with and without subnormals, bits
    compared (NaN included)."""
    tiny = torch.tensor([1e-39, -2.5e-39, 5e-41, 1.1e-38, 1.2e-38, -1e-45, 0.0, -0.0], dtype=torch.bfloat16)
    big = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38, -3.0e38, 1.0, 1.0 + 2**-8, -7.5])
    residual = torch.cat([tiny.repeat(2), big.to(torch.bfloat16).repeat(2), torch.randn(16, dtype=torch.bfloat16)])
    residual = torch.stack([residual, residual.flip(0), residual.roll(5), residual * 0.5])
    x = torch.cat([tiny.flip(0).repeat(2), big.flip(0).to(torch.bfloat16).repeat(2),
                   torch.randn(16, dtype=torch.bfloat16) * 2**-8]).expand(4, -1).contiguous()
    expected = residual.clone().add_(x)
    fused_ops.add_rms_norm(x, residual, torch.ones(48, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(residual.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_mul_matches_torch(dtype, width):
    torch.manual_seed(width)
    gate_up = torch.randn(29, 2 * width, dtype=dtype) * 4
    gate, up = gate_up.clone().split(width, dim=-1)
    expected = F.silu(gate).mul_(up)
    out = fused_ops.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 40, 6))
def test_rotary_matches_torch_on_the_q_and_k_heads_of_a_strided_row(dtype, head_dim):
    torch.manual_seed(head_dim)
    qkv = torch.randn(23, 7, head_dim, dtype=dtype)  # 4 q heads, 1 k, then 2 v heads that stay as they are
    angles = torch.rand(23, 1, head_dim // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), -angles.sin()), dim=-1).to(dtype)  # as RotaryEmbedding's tables
    expected = qkv.clone()
    apply_rotary_(expected[:, :5], cos, sin)
    qk = qkv[:, :5]
    assert fused_ops.can_rotate(qk, cos, sin)
    fused_ops.rotary_(qk, cos, sin)
    assert torch.equal(qkv[:, 5:], expected[:, 5:])
    torch.testing.assert_close(qkv, expected, atol=1e-6 if dtype == torch.float32 else 0,
                               rtol=1e-6 if dtype == torch.float32 else 0)


def test_the_layers_use_them_on_the_cpu_and_fall_back_elsewhere():
    norm = RMSNorm(16, 1e-6, torch.bfloat16, torch.device("cpu"))
    norm.weight.data.normal_()
    x, residual = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    expected_residual = residual.clone()
    out, summed = norm(x, residual)
    assert summed is residual and torch.equal(residual, expected_residual + x)
    assert_close_in_dtype(out, torch_norm(x, expected_residual.clone(), norm.weight, 1e-6))
    assert not fused_ops.serves(torch.randn(2, 2, dtype=torch.float16))
    assert not fused_ops.serves(x, torch.randn(16))  # mixed dtypes: the torch ops
    assert not fused_ops.can_norm(x, torch.randn(16, 3, dtype=torch.bfloat16).T, norm.weight)  # strided residual
    strided = torch.randn(3, 32, dtype=torch.bfloat16)[:, ::2]
    expected_sum = strided + x
    out, summed = norm(x, strided)  # the torch ops
    assert summed is strided and torch.equal(strided, expected_sum)
    assert_close_in_dtype(out, torch_norm(expected_sum, None, norm.weight, 1e-6))
    assert not fused_ops.can_rotate(torch.randn(4, 3, 8)[:, :, ::2], torch.randn(4, 1, 4), torch.randn(4, 1, 4))

    mlp = GatedMLP(16, 24, False, torch.float32, torch.device("cpu"))
    for p in mlp.parameters():
        p.data.normal_()
    h = torch.randn(5, 16)
    gate, up = mlp.gate_up_proj(h).split(24, dim=-1)
    torch.testing.assert_close(mlp(h), mlp.down_proj(F.silu(gate) * up), atol=1e-5, rtol=1e-5)
