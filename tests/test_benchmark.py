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
