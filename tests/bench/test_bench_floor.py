"""The floor's work count, checked by hand on one request, and its measured rates being sane."""

import torch

from services.bench.checkpoints import write_random_llama
from services.bench.floor import measure_gemm_flops, measure_read_bandwidth, workload_cost
from services.engine.models.config import load_model_config


def test_work_of_one_request_counted_by_hand(tmp_path):
    mc = load_model_config(write_random_llama(tmp_path / "tiny", "tiny"))
    h, inter, vocab, layers = mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.num_layers
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    # prompt of 3, 2 outputs: the prefill feeds positions 0..2 and samples output 1; one decode step
    # feeds output 1 at position 3, attends 4 positions, and samples output 2.
    cost = workload_cost(mc, 4, [3], [2])
    per_token = 2 * (h * (q + 2 * kv) + q * h + 3 * h * inter) * layers
    prefill_attention = layers * 2 * 2 * q * (1 + 2 + 3)  # causal pairs of 3 queries
    assert cost.flops == 4 * per_token + 2 * 2 * h * vocab + prefill_attention
    assert cost.kv_bytes == 4 * layers * 2 * kv * 4
    # a request of one output never decodes
    assert workload_cost(mc, 2, [5], [1]).kv_bytes == 0


def test_measured_rates_are_plausible(tmp_path):
    mc = load_model_config(write_random_llama(tmp_path / "tiny", "tiny"))
    assert 1e9 < measure_gemm_flops(mc, torch.float32, rows=64, repeats=2) < 1e14
    assert 1e8 < measure_read_bandwidth(num_bytes=64 << 20, repeats=2) < 1e13
