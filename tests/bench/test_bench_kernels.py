"""`strata bench kernels` compares like with like: its torch references (SDPA over the gathered
contexts, causal SDPA over the contiguous rows) agree with the Triton kernels on the same pools (in
Triton's interpreter here; timed on a GPU)."""

import argparse

import pytest
import torch

from services.bench import kernels

pytest.importorskip("triton")


@pytest.fixture
def untimed(monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda run: (run(), 1.0)[1])  # one call, 1 ms


def test_decode_and_prefill_references_match_the_kernels(untimed):
    args = argparse.Namespace(heads=4, kv_heads=2, head_dim=16, block_size=16)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    decode = kernels.bench_decode(args, 3, 40, 1e9, torch.float32, device)
    assert decode["max_error"] < 1e-4 and decode["requests"] == 3 and decode["context"] == 40
    assert decode["floor_ms"] == pytest.approx(2 * 3 * 40 * 2 * 16 * 4 / 1e9 * 1e3)
    prefill = kernels.bench_prefill(args, 2, 20, torch.float32, device)
    assert prefill["max_error"] < 1e-4 and prefill["kernel_tflops"] > 0

