"""`strata bench sampler`: a row per batch and way of sampling, ours beside torch operators and the floor;
both draw tokens the sampling allows (the filters keep only the most likely few of a peaked row)."""

import pytest
import torch

from services.bench import sampler as bench_sampler
from services.engine.cpu_kernels import sampling
from services.engine.sampler import Sampler
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sampling.can_run(torch.zeros(1, 1)), reason="native CPU kernels not built here")


def test_prints_each_batch_and_sampling_beside_torch_ops_and_the_floor(capsys):
    assert bench_sampler.main(["--batches", "2x512,1x700", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("read bandwidth ")
    rows = [line for line in lines[2:] if line.strip()]
    assert len(rows) == 2 * len(bench_sampler.SAMPLINGS)
    for line in rows:
        fields = line.split()
        assert fields[-1].endswith("x") and fields[-3].endswith("x")
        assert float(fields[-1][:-1]) > 0 and float(fields[-3][:-1]) > 0


def test_an_unknown_sampling_is_refused():
    with pytest.raises(SystemExit, match="unknown sampling 'greedy'"):
        bench_sampler.main(["--samplings", "greedy"])


def test_both_paths_draw_only_the_tokens_top_k_keeps():
    generator = torch.Generator().manual_seed(0)
    logits = bench_sampler.language_model_logits(8, 3000, generator)
    requests = bench_sampler.requests_for(8, 3000, SamplingParams(top_k=5), seed=1)
    allowed = logits.topk(5, dim=-1).indices
    sampler = Sampler(3000, torch.device("cpu"))
    for tokens in (torch.tensor(sampler(logits, requests)[0]), bench_sampler.with_torch_ops(sampler, logits, requests)):
        assert (allowed == tokens.unsqueeze(1)).any(dim=1).all()
