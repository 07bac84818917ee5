"""The native small-M linear kernel computes what its torch reference computes, over odd shapes."""

import pytest
import torch

from services.engine.cpu_kernels.linear import PANEL, block_weight, can_run, linear_ref, small_m_linear, unblock_weight

pytestmark = pytest.mark.skipif(not can_run(torch.float32), reason="no C++ compiler for the native CPU kernels")

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).div_(k ** 0.5).to(dtype)
    x = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.slow  # a 288-case shape sweep
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# bfloat16 from 5 rows with K a multiple of 32 runs on AMX tiles where the CPU has them: 16 rows a
# tile, four tiles a pass over the weight (100 rows: two passes, the last tile partial)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 64, 100])
@pytest.mark.parametrize("n, k", [(7, 5), (123, 123), (1024, 512), (123, 1023), (7, 1376), (1024, 1376)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, m, n, k, bias):
    x, weight, b = _case(m, n, k, dtype, bias, seed=m * 7 + n + k)
    y = small_m_linear(x, block_weight(weight), b, n)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y, linear_ref(x, weight, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 128 rows a block of rows per item (kPassesPerRowBlock passes of 8): 129 ends in a block of one row,
# 300 in a block of six passes, the last partial
@pytest.mark.parametrize("m", [129, 300])
def test_many_rows_in_row_blocks(dtype, m):
    x, weight, b = _case(m, 1024, 1376, dtype, bias=True, seed=m)
    blocked = block_weight(weight)
    y = small_m_linear(x, blocked, b, 1024)
    torch.testing.assert_close(y, linear_ref(x, weight, b), **TOLERANCES[dtype])
    if dtype == torch.float32:  # each output sums in k order whatever rows run beside it: the same bits
        whole = m - m % 8  # (one row alone runs another kernel)
        by_pass = torch.cat([small_m_linear(x[r:r + 8], blocked, b, 1024) for r in range(0, whole, 8)])
        assert torch.equal(y[:whole], by_pass)


@pytest.mark.parametrize("k", [5, 1376])
def test_one_row_sums_each_panel_as_alone(k):
    # float32's one row streams three panels at once (panel_group_f32<1, 3>): each output still sums as
    # its panel would alone, the same bits
    x, weight, _ = _case(1, 123, k, torch.float32, bias=False)
    together = small_m_linear(x, block_weight(weight), None, 123)
    alone = torch.cat([small_m_linear(x, block_weight(weight[o:o + PANEL]), None, min(PANEL, 123 - o))
                       for o in range(0, 123, PANEL)], dim=1)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_logits_shape(dtype, m):
    x, weight, _ = _case(m, 8192, 512, dtype, bias=False)
    torch.testing.assert_close(small_m_linear(x, block_weight(weight), None, 8192), linear_ref(x, weight, None),
                               **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs(dtype):
    x, weight, b = _case(5, 123, 123, dtype, bias=True)
    expected = linear_ref(x, weight, b)
    blocked = block_weight(weight)
    row_strided = torch.cat([x, torch.randn(5, 40).to(dtype)], dim=1)[:, :123]  # as the MLP's gate half
    column_strided = torch.randn(123, 5).to(dtype).T.copy_(x)
    assert not row_strided.is_contiguous() and not column_strided.is_contiguous()
    for view in (row_strided, column_strided):
        torch.testing.assert_close(small_m_linear(view, blocked, b, 123), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [5, 21])
def test_row_strided_input_with_whole_k_tiles(dtype, m):
    """As above where bfloat16 may take the AMX path, which reads the rows where they lie."""
    x, weight, b = _case(m, 100, 512, dtype, bias=True)
    row_strided = torch.cat([x, torch.randn(m, 64).to(dtype)], dim=1)[:, :512]
    torch.testing.assert_close(small_m_linear(row_strided, block_weight(weight), b, 100), linear_ref(x, weight, b),
                               **TOLERANCES[dtype])


def test_block_layout_float32_and_bfloat16():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    blocked = block_weight(weight)
    assert blocked.shape == (2, 3, PANEL)
    assert blocked[1, 2, 3].item() == weight[PANEL + 3, 2].item()
    assert blocked[1, :, 4:].count_nonzero() == 0  # padded outputs
    blocked16 = block_weight(weight.bfloat16())
    assert blocked16.shape == (2, 2, PANEL, 2)
    assert blocked16[1, 0, 3].tolist() == weight[PANEL + 3, :2].tolist()
    assert blocked16[:, 1, :, 1].count_nonzero() == 0  # K padded to pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(7, 5), (123, 1023), (32, 16)])
def test_unblock_gives_the_weight_back(dtype, n, k):
    weight = torch.randn(n, k).to(dtype)
    torch.testing.assert_close(unblock_weight(block_weight(weight), n, k), weight, rtol=0, atol=0)


def test_rejects_mismatched_arguments():
    x, weight, b = _case(2, 32, 16, torch.float32, bias=True)
    blocked = block_weight(weight)
    with pytest.raises(ValueError, match="does not fit"):
        small_m_linear(x[:, :15], blocked, b, 32)
    with pytest.raises(ValueError, match="does not fit"):
        small_m_linear(x.bfloat16(), blocked, b, 32)
    with pytest.raises(ValueError, match="bias"):
        small_m_linear(x, blocked, b[:31], 32)
    with pytest.raises(ValueError, match="2-d float32 or bfloat16"):
        block_weight(weight.half())


def test_compiled_caller_sees_an_opaque_op():
    x, weight, b = _case(3, 40, 24, torch.float32, bias=True)
    blocked = block_weight(weight)
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module

    compiled = torch.compile(lambda t: torch.relu(small_m_linear(t, blocked, b, 40)), backend=record, fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(linear_ref(x, weight, b)), **TOLERANCES[torch.float32])
    assert len(graphs) == 1 and "torch.ops.strata.small_m_linear" in graphs[0]


def test_custom_op_registration():
    x, weight, b = _case(3, 40, 24, torch.bfloat16, bias=True)
    torch.library.opcheck(torch.ops.strata.small_m_linear.default, (x, block_weight(weight), b, 40))
