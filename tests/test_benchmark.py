"""rope_ext.benchmark's ratios, on made-up timings (no timing runs here)."""

import statistics

import pytest
import torch

from rope_ext import benchmark
from rope_ext.benchmark import Case, Result


CASE = Case(1, 16, 2, 1, 64, torch.bfloat16, "cpu", qk_norm=True, name="t")


def result(provider, rounds):
    return Result(CASE, provider, statistics.median(rounds), tuple(rounds))


def test_paired_ratio_takes_the_median_of_round_by_round_ratios():
    # Rounds 2 and 3 ran at half speed for both providers, round 5 for the first only: the
    # medians (2.4 and 1.0) say 2.4, each round's own ratio says 1.2 in four rounds of five.
    num = result("a", [1.2, 2.4, 2.4, 1.2, 2.4])
    den = result("b", [1.0, 2.0, 2.0, 1.0, 1.0])
    assert num.seconds / den.seconds == pytest.approx(2.4)
    assert benchmark.paired_ratio(num, den) == pytest.approx(1.2)


def test_paired_ratio_without_rounds_divides_the_medians():
    num, den = Result(CASE, "a", 3.0), Result(CASE, "b", 2.0)
    assert benchmark.paired_ratio(num, den) == 1.5
    # Rounds of different lengths (not timed together) cannot be paired either.
    assert benchmark.paired_ratio(result("a", [3.0, 3.0, 3.0]), result("b", [2.0])) == 1.5


def test_target_ratios_are_paired_and_judged():
    rounds = {
        benchmark.FUSED_INPLACE: [1.2, 2.4, 2.4, 1.2, 2.4],  # medians: 2.4 / 1.0
        benchmark.ROPE_INPLACE: [1.0, 2.0, 2.0, 1.0, 1.0],
        benchmark.FUSED: [1.0] * 5,
        benchmark.F_RMS_ROPE: [1.6] * 5,
    }
    rows = {r["ratio"]: r for r in benchmark.target_ratios(
        [result(name, t) for name, t in rounds.items()])}
    inplace = rows["fused in-place / RoPE alone in-place"]
    assert inplace["value"] == pytest.approx(1.2) and inplace["met"] is True
    assert inplace["target"] == "<= 1.25"
    unfused = rows["(F.rms_norm + rope_ext) / fused"]
    assert unfused["value"] == pytest.approx(1.6) and unfused["met"] is False
    # Ratios whose providers were not timed are left out; the table shows the rest.
    assert "compiled HF / fused" not in rows
    table = benchmark.markdown_table([result(name, t) for name, t in rounds.items()]
                                     + [result("copy_ (bound, in-place)", [1.0] * 5),
                                        result("clone (bound, out-of-place)", [1.0] * 5)])
    assert "| fused in-place / RoPE alone in-place | 1.20 | <= 1.25 | yes |" in table


def test_cuda_graph_times_get_their_own_columns_and_target_rows():
    """On a GPU each plain provider is also timed in a replayed CUDA graph: eager calls of a
    small shape are bound by the host's launch cost (an H200 decode step: copy_ 21 us, every
    rope_ext row about as much), so the 1.1x fused-norm target is judged on graph times too."""
    gpu = Case(1, 16, 2, 1, 64, torch.bfloat16, "cuda", qk_norm=True, name="g")
    timed = {  # provider: (eager seconds, graph seconds)
        "copy_ (bound, in-place)": (20e-6, 4e-6),
        "clone (bound, out-of-place)": (24e-6, 5e-6),
        benchmark.ROPE_INPLACE: (16e-6, 5e-6),
        benchmark.FUSED_INPLACE: (19e-6, 5.25e-6),
        "compiled rotate_half (HF)": (30e-6, None),
    }
    results = [Result(gpu, name, eager, (eager,) * 3, graph)
               for name, (eager, graph) in timed.items()]
    rows = [r for r in benchmark.target_ratios(results)
            if r["ratio"].startswith("fused in-place / RoPE alone in-place")]
    assert [(r["ratio"].endswith("(CUDA graph)"), round(r["value"], 4), r["met"]) for r in rows] \
        == [(False, 1.1875, False), (True, 1.05, True)]
    table = benchmark.markdown_table(results)
    assert "| GPU us, CUDA graph | graph time / copy_'s |" in table
    assert "| copy_ (bound, in-place) | 0.020 |" in table and "| 4.0 | 1.00 |" in table
    assert f"| {benchmark.FUSED_INPLACE} | 0.019 |" in table and "| 5.2 | 1.31 |" in table
    assert "| compiled rotate_half (HF) | 0.030 |" in table and table.count("| - | - |") == 1
    # CPU tables keep their five columns.
    assert "CUDA graph" not in benchmark.markdown_table(
        [result("copy_ (bound, in-place)", [1.0] * 3),
         result("clone (bound, out-of-place)", [1.0] * 3), result(benchmark.FUSED, [1.0] * 3)])


def test_graph_timing_is_skipped_where_it_cannot_capture():
    assert not benchmark.graphable("compiled rotate_half (HF)")
    assert benchmark.graphable("rope_ext fused fwd+bwd")
    assert benchmark.graphable("rope_ext in-place")
    assert benchmark.graphable("clone (bound, out-of-place)")
    if not torch.cuda.is_available():  # no stream to capture on: no graph time, no error
        assert benchmark.graph_time(lambda: None) is None
