"""rope_ext.benchmark's ratios, on made-up timings, and its third-party peers: how each is
loaded, called and checked against the float64 reference before it is timed."""

import dataclasses
import importlib.util
import os
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from rope_ext import benchmark, reference
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


# Third-party peers. Their kernels need a GPU; here each peer's API is played by plain torch
# code that keeps its contract (layout, pairing, table form, in place or not), so that the
# benchmark's calls into it and the check against the float64 reference run on CPU.


def _rotate_half_split(x, cos, sin):
    """x[..., :R] rotated in place through .data (as a kernel writes, unseen by autograd),
    pairs (i, i + R/2), with cos and sin [..., R/2] broadcasting against x[..., :R/2]."""
    r = cos.shape[-1]
    x1, x2 = x[..., :r].float(), x[..., r:2 * r].float()
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # both before x changes
    x.data[..., :r], x.data[..., r:2 * r] = out1.to(x.dtype), out2.to(x.dtype)
    return x


class FakeFlashInfer:
    """flashinfer.rope's two in-place calls: tokens [T, heads * D] or [T, heads, D]."""

    @staticmethod
    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                              is_neox=True):
        assert cos_sin_cache.dtype == torch.float32 and is_neox
        half = cos_sin_cache.shape[1] // 2
        cos, sin = cos_sin_cache[positions, None, :half], cos_sin_cache[positions, None, half:]
        for x in (query, key):
            _rotate_half_split(x.view(x.shape[0], -1, head_size), cos, sin)

    @staticmethod
    def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                   rope_scale=1, rope_theta=1e4):
        assert not interleave
        inv_freq = rope_theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                                  / rotary_dim)
        angles = (pos_ids[:, None].double() * inv_freq)[:, None].float()
        for x in (q, k):
            _rotate_half_split(x, angles.cos(), angles.sin())


class FakeLigerRope(torch.autograd.Function):
    """LigerRopeFunction: q and k [B, H, S, D] views of [B, S, H, D], cos and sin [1 or B, S, R]
    (halves repeated); rotates in place, and its backward rotates the gradients in place."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        r = cos.shape[-1] // 2
        ctx.cos_sin = cos[:, :, None, :r].float(), sin[:, :, None, :r].float()
        for x in (q, k):
            _rotate_half_split(x.transpose(1, 2), *ctx.cos_sin)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.cos_sin
        return (*(_rotate_half_split(g.transpose(1, 2), cos, -sin).transpose(1, 2)
                  for g in (dq, dk)), None, None)


class FakeFlashAttnRotary:
    """flash_attn.ops.triton.rotary: apply_rotary of x [B, S, H, D] (or [T, H, D] with
    cu_seqlens), cos and sin [P, R/2], positions seqlen_offsets + 0, 1, ... per sequence."""

    @staticmethod
    def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None,
                     interleaved=False, inplace=False, conjugate=False):
        assert not interleaved
        out = x if inplace else x.clone()
        if cu_seqlens is None:  # an offset for the batch, or one per sequence ([B] int32)
            rows = torch.as_tensor(seqlen_offsets).view(-1, 1) + torch.arange(x.shape[1])
            cos, sin = cos[rows][:, :, None], sin[rows][:, :, None]
        else:
            rows = torch.cat([torch.arange(int(n)) for n in cu_seqlens.diff()])
            cos, sin = cos[rows, None], sin[rows, None]
        return _rotate_half_split(out, cos.float(), -sin.float() if conjugate else sin.float())


FAKE_PEERS = {"FlashInfer": benchmark.Peer("fake", FakeFlashInfer),
              "Liger": benchmark.Peer("fake", FakeLigerRope),
              "flash-attn": benchmark.Peer("fake", FakeFlashAttnRotary)}

PEER_CASES = [
    Case(2, 12, 4, 2, 32, torch.float16, "cpu", name="prefill"),
    Case(3, 1, 4, 2, 32, torch.float16, "cpu", decode_offset=40, name="decode"),
    Case(2, 12, 4, 2, 32, torch.float16, "cpu", rotary_dim=16, name="partial"),
    Case(1, 300, 4, 2, 32, torch.float16, "cpu", varlen=True, name="packed"),
    Case(2, 12, 4, 2, 32, torch.float32, "cpu", name="float32"),
    Case(5, 1, 4, 2, 32, torch.float16, "cpu", decode_offset=40, per_sequence=True,
         name="decode per sequence"),
    Case(2, 3, 4, 2, 32, torch.float16, "cpu", decode_offset=40, per_sequence=True,
         name="chunk per sequence"),
]


@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: c.name)
def test_peer_providers_agree_with_the_reference(case):
    """Every peer provider, fwd+bwd ones included, is handed the tables, positions and layout
    that make it compute what rope_ext computes; float16 runs the peers' float16 paths
    (FlashInfer takes no float32: that case lists why)."""
    inputs = benchmark.make_inputs(case)
    calls = benchmark.third_party(dataclasses.replace(case, device="cuda"), inputs,
                                  include_backward=True, loaded=FAKE_PEERS)
    assert set(calls) == {"FlashInfer cos_sin_cache in-place", "FlashInfer pos_ids in-place",
                          "Liger in-place", "Liger fwd+bwd", "flash-attn in-place",
                          "flash-attn fwd+bwd"}
    for name, call in calls.items():
        check = benchmark.check_peer(case, inputs, name, call)
        if case.dtype == torch.float32 and name.startswith("FlashInfer"):
            assert check.failure == "FlashInfer's rope kernels take float16 and bfloat16 only"
            continue
        assert check.ok, (name, check)
        # Each output rounded once, from float32: well inside the tolerance.
        assert check.error < 2 * torch.finfo(case.dtype).eps, (name, check.error)


@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: c.name)
def test_every_provider_rotates_as_the_reference(case):
    """rope_ext's providers and the eager paths of a plain case (the compiled ones are these
    functions compiled) turn each token by its rows of the table, per sequence too, and their
    fwd+bwd forms rotate the gradients back: each run once on fresh inputs, in its pairing
    and layout."""
    first = benchmark.providers(case, benchmark.make_inputs(case), include_compile=False,
                                include_backward=True)
    names = [n for n in first if "(bound," not in n]
    assert len(names) >= 10, names
    for name in names:
        inputs = benchmark.make_inputs(case)
        q, k = inputs.q.clone(), inputs.k.clone()  # in-place providers write inputs'
        got = benchmark.providers(case, inputs, include_compile=False,
                                  include_backward=True)[name]()
        if "[B,H,S,D]" in name:
            got = [g.transpose(1, 2) for g in got]
        interleaved = "half-split" not in name and "rotate_half" not in name
        where = dict(interleaved=interleaved, **benchmark._where(case, inputs))
        want = [reference.apply_rotary(x.double(), inputs.freqs_cis, **where) for x in (q, k)]
        if name.endswith("fwd+bwd"):  # and the gradients, rotated back
            want += [reference.apply_rotary(g.double(), inputs.freqs_cis, inverse=True, **where)
                     for g in benchmark.backward_grads(q, k)]
        error = max(((g.double() - w).abs().max() / w.abs().max()).item()
                    for g, w in zip(got, want, strict=True))
        assert error <= benchmark.peer_tolerance(case.dtype), (name, error)


def test_peer_tolerance_admits_rounding_not_a_mistaken_convention():
    assert benchmark.peer_tolerance(torch.bfloat16) == 2 ** -5
    assert benchmark.peer_tolerance(torch.float16) == 2 ** -8
    assert benchmark.peer_tolerance(torch.float32) == 2 ** -10


def _wrong_pairing(q, k):
    """Interleaved pairs where half-split ones were promised."""
    table = benchmark.make_inputs(WRONG_CASE).freqs_cis
    return (benchmark.api.apply_rotary(q, table, interleaved=True),
            benchmark.api.apply_rotary(k, table, interleaved=True))


WRONG_CASE = Case(1, 16, 2, 1, 32, torch.float32, "cpu", name="w")


def test_a_wrong_provider_is_caught_reported_and_not_timed(monkeypatch):
    inputs = benchmark.make_inputs(WRONG_CASE)
    table = inputs.freqs_cis

    def right(q, k):
        return benchmark.api.apply_rotary_qk(q, k, table, interleaved=False)

    def nan_in_k(q, k):
        return right(q, k)[0], torch.full_like(k, float("nan"))

    def raises(q, k):
        raise RuntimeError("no kernel image for this device\nmore")

    # Named as the peers' providers are, after their library (what run_case's `only` reads).
    calls = {"Liger right": benchmark.PeerCall(right),
             "Liger wrong pairing": benchmark.PeerCall(_wrong_pairing),
             "flash-attn NaN in k": benchmark.PeerCall(nan_in_k),
             "FlashInfer raises": benchmark.PeerCall(raises),
             "FlashInfer unsupported": "float16 and bfloat16 only"}
    monkeypatch.setattr(benchmark, "third_party", lambda *args: calls)
    checks = []
    results = benchmark.run_case(WRONG_CASE, include_compile=False, min_run_time=0.005,
                                 rounds=1, only=["rope_ext"] + list(calls), checks=checks)
    assert sorted(r.provider for r in results) == [
        "Liger right", "clone (bound, out-of-place)", "copy_ (bound, in-place)", "rope_ext"]
    by = {c.provider: c for c in checks}
    assert list(by) == list(calls)
    assert by["Liger right"].ok and by["Liger right"].error < 1e-6
    assert not by["Liger wrong pairing"].ok and by["Liger wrong pairing"].error > 0.1
    nan = by["flash-attn NaN in k"].error
    assert not by["flash-attn NaN in k"].ok and nan != nan
    assert by["FlashInfer raises"].failure == "RuntimeError: no kernel image for this device"
    assert by["FlashInfer unsupported"].failure == "float16 and bfloat16 only"
    table_md = benchmark.markdown_table(results, checks)
    assert "| Liger wrong pairing |" in table_md and "| **wrong**: not timed |" in table_md
    assert ("| FlashInfer raises | - | 0.00098 | not timed: RuntimeError: no kernel image"
            in table_md)
    assert "| Liger right | " in table_md.split("checked against float64")[1]
    # Without a peer among the providers asked for, no peer is built, checked or timed.
    checks.clear()
    benchmark.run_case(WRONG_CASE, include_compile=False, min_run_time=0.005, rounds=1,
                       only=["rope_ext"], checks=checks)
    assert checks == []


def test_a_peer_that_cannot_load_is_listed_with_its_reason():
    def gone():
        import rope_ext_peer_that_is_not_installed  # noqa: F401

    def broken():
        raise OSError("libcuda.so.1: cannot open shared object file\n(and a traceback)")

    libraries = {"Gone": benchmark.PeerLibrary(gone, dict),
                 "Broken": benchmark.PeerLibrary(broken, dict),
                 "Fine": benchmark.PeerLibrary(lambda: benchmark.Peer("1.2", None), dict)}
    loaded, missing = benchmark.load_peers(libraries)
    assert list(loaded) == ["Fine"] and loaded["Fine"].version == "1.2"
    assert missing == {
        "Gone": "ModuleNotFoundError: No module named 'rope_ext_peer_that_is_not_installed'",
        "Broken": "OSError: libcuda.so.1: cannot open shared object file",
        **benchmark.NOT_MEASURED}
    assert "TransformerEngine" in missing


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="flash_attn is installed: its own module is loaded")
def test_flash_attn_loads_from_the_carried_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ROPE_EXT_PEERS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="benchmarks/peers.sh fetches it"):
        benchmark._load_flash_attn()
    (tmp_path / "flash-attn").mkdir()
    (tmp_path / "flash-attn" / "rotary.py").write_text("def apply_rotary(x):\n    return x\n")
    (tmp_path / "flash-attn" / "VERSION").write_text("2.8.3.post2\n")
    monkeypatch.delitem(sys.modules, "rope_ext_peer_flash_attn_rotary", raising=False)
    peer = benchmark._load_flash_attn()
    assert peer.version == f"2.8.3.post2, {tmp_path / 'flash-attn' / 'rotary.py'}"
    assert peer.api.apply_rotary(3) == 3


# The real Liger and flash-attn code that benchmarks/peers.sh fetched, run on CPU by Triton's
# interpreter (TRITON_INTERPRET=1). FlashInfer's kernels are CUDA C++: only a GPU runs them.
INTERPRETED = '''
import contextlib, dataclasses, sys, torch
torch.cuda.device = lambda index: contextlib.nullcontext()  # flash-attn enters x's CUDA device
from rope_ext import benchmark, reference
loaded, missing = benchmark.load_peers({name: benchmark.PEERS[name] for name in sys.argv[1:]})
assert not set(sys.argv[1:]) & set(missing), missing
failed = 0
for case in CASES:
    inputs = benchmark.make_inputs(case)
    calls = benchmark.third_party(dataclasses.replace(case, device="cuda"), inputs, True, loaded)
    for name, call in calls.items():
        check = benchmark.check_peer(case, inputs, name, call)
        failed += not check.ok
        print(f"{case.name} {case.dtype} {name}: {check.error} {check.failure}")
sys.exit(failed)
'''


@pytest.mark.skipif(not (benchmark.peers_dir() / "flash-attn" / "rotary.py").exists()
                    or not list(benchmark.peers_dir().glob("wheels/liger_kernel-*.whl")),
                    reason="benchmarks/peers.sh has not fetched the peers here")
def test_the_carried_liger_and_flash_attn_agree_with_the_reference_in_triton_s_interpreter(
        tmp_path):
    # float32 and float16: the interpreter (Triton 3.8) computes bfloat16 products wrongly.
    cases = [dataclasses.replace(c, dtype=dt) for c in PEER_CASES if c.name != "float32"
             for dt in (torch.float32, torch.float16)]
    site = tmp_path / "site"
    zipfile.ZipFile(next(benchmark.peers_dir().glob("wheels/liger_kernel-*.whl"))).extractall(site)
    root = Path(__file__).resolve().parents[1]
    script = f"from rope_ext.benchmark import Case\nimport torch\nCASES = {cases!r}\n" + INTERPRETED
    run = subprocess.run([sys.executable, "-c", script, "Liger", "flash-attn"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "TRITON_INTERPRET": "1",
                              "PYTHONPATH": os.pathsep.join([str(site), str(root)]),
                              "ROPE_EXT_PEERS": str(benchmark.peers_dir())})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ") == len(cases) * 4, run.stdout  # two providers per peer
