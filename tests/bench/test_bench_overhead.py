"""`strata bench overhead` end to end on a tiny random model: the same requests in-process and
through a real stack, every pair of runs printed, the median of the pairs' ratios, and the CPU each
stack process spent per token."""

import os
import re

import pytest

from services.bench.overhead import main


@pytest.mark.slow
def test_pairs_alternate_and_the_median_ratio_is_reported(capsys):
    rc = main(["--shape", "tiny", "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "16",
               "--output-len", "8", "--range-ratio", "0", "--repeats", "2", "--enforce-eager",
               "--num-kv-blocks", "64", "--dtype", "float32", "--num-threads", str(len(os.sched_getaffinity(0)))])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0, out
    assert "every in-process run first" not in captured.err  # both tiny engines fit: the runs alternate
    rows = re.findall(r"^(engine in-process|gateway, streamed) #(\d)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      out, re.MULTILINE)
    assert [(name, k) for name, k, *_ in rows] == [("engine in-process", "1"), ("gateway, streamed", "1"),
                                                   ("engine in-process", "2"), ("gateway, streamed", "2")]
    assert all(int(tokens) == 4 * 8 and float(tpot) > 0 for *_, tokens, _, _, tpot in rows)
    (throughput, tpot), = re.findall(r"^median of 2 pairs: ([\d.]+)x tok/s, ([\d.]+)x TPOT", out, re.MULTILINE)
    assert float(throughput) > 0 and float(tpot) > 0
    (cpu,) = re.findall(r"^stack CPU per output token: (.*) \(sum", out, re.MULTILINE)
    per_process = dict(re.findall(r"(\w+) ([\d.]+) ms", cpu))
    assert set(per_process) == {"tokenizer", "engine", "gateway"}, cpu
    assert float(per_process["engine"]) > 0  # the engine computed every token
    # the engine's threads fill the cores: what the others' CPU leaves it
    (bound, tpot_bound), = re.findall(r"^cores shared: .* the stack would keep ([\d.]+)x of the in-process tok/s "
                                      r"\(([\d.]+)x its TPOT\)$", out, re.MULTILINE)
    assert 0 < float(bound) <= 1 <= float(tpot_bound)
    (engine_idle, stack_idle), = re.findall(r"^cores idle: ([\d.]+)% of the cores' time in the in-process runs, "
                                            r"([\d.]+)% in the stack's", out, re.MULTILINE)
    assert 0 <= float(engine_idle) <= 100 and 0 <= float(stack_idle) <= 100
    cores = sorted(os.sched_getaffinity(0))
    placed = re.findall(r"^placement: the stack's tokenizer and gateway, and the clients, on cores ([\d,]+) ", out,
                        re.MULTILINE)
    assert placed == ([",".join(map(str, cores[1:]))] if len(cores) >= 2 else [])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_the_clients_run_on_the_cores_given_and_then_where_they_ran():
    from services.bench.overhead import clients_on

    before = os.sched_getaffinity(0)
    one = {min(before)}
    with clients_on(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with clients_on(None):
        assert os.sched_getaffinity(0) == before


def test_both_engines_get_the_same_thread_binding():
    from services.bench.overhead import _engine_argv, build_parser
    from services.engine.engine_args import config_from_args

    def argv(*flags: str) -> list[str]:
        return _engine_argv(config_from_args(build_parser().parse_args(["--model", "m", *flags])))

    assert "--no-bind-threads" in argv("--no-bind-threads")
    assert "--no-bind-threads" not in argv()


def test_the_shared_cores_rate_is_the_engines_share_of_the_cpu():
    from services.bench.overhead import shared_cores_rate

    # 64 streams on 2 cores: the engine 1.2 ms per token in-process, gateway + tokenizer + clients 0.13
    assert shared_cores_rate(1.2, 0.13) == pytest.approx(1.2 / 1.33)
    assert shared_cores_rate(4.0, 0.0) == 1.0


def test_the_idle_share_is_the_idle_part_of_the_cores_time_between_two_readings():
    from services.bench.overhead import core_times, idle_share

    assert idle_share((100, 1000), (150, 1200)) == pytest.approx(0.25)
    assert idle_share(None, (150, 1200)) is None and idle_share((100, 1000), (100, 1000)) is None
    before = core_times()
    assert before is None or 0 <= before[0] <= before[1]  # None off Linux


def test_repeats_below_one_are_refused():
    with pytest.raises(SystemExit, match="--repeats 0"):
        main(["--shape", "tiny", "--repeats", "0"])


def test_each_pair_draws_new_requests_that_no_prefix_cache_holds_yet():
    from services.bench.overhead import build_parser, make_workload

    args = build_parser().parse_args(["--num-prompts", "8", "--input-len", "32"])
    first, again, second = make_workload(args, 4096, 0), make_workload(args, 4096, 0), make_workload(args, 4096, 1)
    assert first == again  # a pair's two runs see the same requests
    assert not {tuple(p[:16]) for p in first[0]} & {tuple(p[:16]) for p in second[0]}  # no shared first block


def test_the_stack_runs_after_the_in_process_runs_where_two_engines_would_not_fit():
    from services.bench.overhead import both_engines_fit

    gib = 2**30
    assert both_engines_fit(4 * gib, 8 * gib)
    assert not both_engines_fit(4 * gib, 4 * gib)  # a tenth to spare
    assert not both_engines_fit(14 * gib, 10 * gib)  # a 7B model in bfloat16 on a 24 GiB machine
    assert both_engines_fit(None, 8 * gib) and both_engines_fit(4 * gib, None)  # unknown: alternate


@pytest.mark.slow
def test_phased_runs_every_in_process_run_then_the_stack(capsys):
    rc = main(["--shape", "tiny", "--num-prompts", "2", "--max-concurrency", "2", "--input-len", "16",
               "--output-len", "4", "--range-ratio", "0", "--repeats", "2", "--enforce-eager",
               "--num-kv-blocks", "64", "--dtype", "float32", "--run-order", "phased"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "--run-order phased: every in-process run first, then the stack's" in captured.err
    rows = re.findall(r"^(engine in-process|gateway, streamed) #(\d)\s+(\d+)", captured.out, re.MULTILINE)
    assert [(name, k, int(tokens)) for name, k, tokens in rows] == [
        ("engine in-process", "1", 8), ("gateway, streamed", "1", 8),
        ("engine in-process", "2", 8), ("gateway, streamed", "2", 8)]
    assert re.search(r"^median of 2 pairs: [\d.]+x tok/s", captured.out, re.MULTILINE)
