"""The CPU engine's arenas: blocked weights moved onto huge pages bit for bit (the layers compute the
same on them), KV pools zero and staggered within their pages, with or without huge pages."""

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from services.engine import memory_arena
from services.engine.cpu_kernels import linear as native_linear
from services.engine.memory_arena import (
    ALIGNMENT,
    HUGE_PAGE_BYTES,
    PAGE_BYTES,
    POOL_STAGGER_BYTES,
    Arena,
    copies_in_arena,
    staggered_zeros,
)
from services.engine.models.packed_linear import PackedLinear, blocked_weights_onto_huge_pages, can_pack

needs_huge_pages = pytest.mark.skipif(not memory_arena.huge_pages_available(),
                                      reason="no transparent huge pages for advised mappings here")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_huge_pages
def test_arena_cuts_aligned_zero_tensors_from_a_huge_page_boundary():
    arena = Arena(3 * 1000 * 4 + 2 * ALIGNMENT)
    tensors = [arena.take((1000,), torch.float32), arena.take((3, 5), torch.bfloat16), arena.take((1000, 2), torch.float32)]
    assert tensors[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 and not t.any()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))  # no overlap
    assert "hg" in _vm_flags(tensors[0].data_ptr())  # advised for huge pages
    with pytest.raises(ValueError, match="arena full"):
        arena.take((HUGE_PAGE_BYTES,), torch.float32)


@pytest.mark.parametrize("huge", [True, False])
def test_pools_are_zero_and_staggered_within_their_pages(monkeypatch, huge):
    if huge and not memory_arena.huge_pages_available():
        pytest.skip("no transparent huge pages for advised mappings here")
    monkeypatch.setattr(memory_arena, "huge_pages_available", lambda: huge)
    shape = (5, 16, 2, 64)  # whole pages per pool: where separate allocations all start alike
    pools = staggered_zeros(70, shape, torch.bfloat16)
    offsets = [p.data_ptr() % PAGE_BYTES for p in pools]
    assert offsets[:64] == [i * POOL_STAGGER_BYTES % PAGE_BYTES for i in range(64)]
    assert len(set(offsets[:64])) == 64  # 64 pools in a row at 64 different places in the page
    for pool in pools:
        assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous() and not pool.any()
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in pools)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    pools[3].fill_(1)
    assert not pools[2].any() and not pools[4].any()
    assert ("hg" in _vm_flags(pools[0].data_ptr())) == huge  # the arena's own mapping, advised only for huge pages
    # each pool a tensor of its own storage, not a view: torch.compile writes a view through its base
    assert all(pool._base is None for pool in pools)
    assert len({pool.untyped_storage().data_ptr() for pool in pools}) == len(pools)


@needs_huge_pages
def test_copies_are_exact_and_keep_their_mapping_alive():
    torch.manual_seed(0)
    originals = [torch.randn(300, 7), torch.randn(5, 3, 2).to(torch.bfloat16), torch.arange(10)]
    copies = copies_in_arena(originals)
    gc.collect()  # the arena object is gone; the copies still hold the mapping
    for original, copy in zip(originals, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
    copies[0].add_(1)  # writable
    assert torch.equal(copies[0], originals[0] + 1)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32) or not native_linear.can_run(torch.float32),
                    reason="no packed linears with the native kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_compute_the_same_on_huge_pages(dtype):
    torch.manual_seed(1)
    model = nn.Sequential(PackedLinear(torch.randn(96, 80).to(dtype), None),
                          PackedLinear(torch.randn(40, 96).to(dtype), torch.randn(40).to(dtype)))
    x = torch.randn(3, 80).to(dtype)
    before = model(x)
    blocked = [layer.blocked.clone() for layer in model]
    moved = blocked_weights_onto_huge_pages(model)
    if not memory_arena.huge_pages_available():
        assert moved == 0
        return
    assert moved == sum(b.numel() * b.element_size() for b in blocked)
    for layer, original in zip(model, blocked, strict=True):
        assert torch.equal(layer.blocked, original)
        assert "hg" in _vm_flags(layer.blocked.data_ptr())
    assert torch.equal(model(x), before)
