"""Each per-instruction-set CPU kernel is right, and the run-time choice follows torch's; the
AVX512_BF16 step benchmark (benchmarks/cpu_step_cycles.cpp) builds and runs."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch, rope_ext
from rope_ext import reference
print(rope_ext.build_info()["cpu_kernel"])
torch.manual_seed(0)
tol = {torch.float32: 2e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# The checks of torch.testing.assert_close in a few whole-tensor operations (its isclose was
# most of this script's time); assert_close itself reports a failure.
def assert_close(got, want, tol):
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want = got.double(), want.double()
    ok = ((got - want).abs() <= tol + tol * want.abs()) & want.isfinite() | (got == want)
    if not bool((ok | (got.isnan() & want.isnan())).all()):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)


def assert_same(got, want):  # the same values, NaN where the other has NaN
    nan = got.isnan()
    if not (torch.equal(nan, want.isnan()) and torch.equal(got.masked_fill(nan, 0),
                                                           want.masked_fill(nan, 0))):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


# Rotary dims that are 1..8 whole vector steps on every instruction set (the span path),
# ones that are not (80, and 24 with pass-through), and partial rotary on a 128 head.
for rot, head_dim in ((80, 80), (64, 64), (128, 128), (256, 256), (24, 40), (64, 128)):
    table = rope_ext.precompute_freqs_cis(rot, 80)
    real = torch.view_as_real(table).double()
    shapes = (
        (torch.randn(2, 64, 3, head_dim), 1),                     # heads share a position
        (torch.randn(2, 64, head_dim, 3).transpose(-1, -2), 1),   # strided features
        (torch.randn(5, 1, 4, head_dim), 1),                      # decode: one position
        (torch.randn(3, 8, 2 * head_dim)[..., ::2], 1),           # rows 2 * head_dim apart
        (torch.randn(2, 3, 64, head_dim), 2),                     # [B, H, S, D]
    )
    for dtype in tol:
        for interleaved in (True, False):
            for inverse in (False, True):
                for x, seq_dim in shapes:
                    x = x.to(dtype)
                    x[(0,) * (x.dim() - 1)][:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e38])
                    kw = dict(interleaved=interleaved, inverse=inverse, offset=7, seq_dim=seq_dim)
                    want = reference.apply_rotary(x.double(), real, **kw)
                    out = rope_ext.apply_rotary(x, table, **kw)
                    assert_close(out, want, tol[dtype])
                    y = x.clone()
                    rope_ext.apply_rotary(y, table, inplace=True, **kw)
                    assert_same(y, out)
# Rounding: with sin = 0 every finite output is one float32 product x * cos rounded once to
# x's dtype, so it must be bit-identical to torch's own conversion (ties, overflow, NaN, inf).
for dtype in (torch.bfloat16, torch.float16):
    for interleaved in (True, False):
        # Half the cosines with 5 significant bits, so that many products are exact ties.
        cos = torch.empty(4, 64).uniform_(0.5, 2.0)
        cos[:, ::2] = 1 + torch.randint(0, 16, (4, 32)) / 16
        table = torch.stack([cos, torch.zeros_like(cos)], -1)
        x = (torch.randn(3, 4, 5, 128) * 100).to(dtype)
        big = torch.finfo(dtype).max
        x[0, 0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), big, -big, 1.0])
        xf = x.float()
        x0, x1 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, -1)
        c, s = cos[None, :, None, :], torch.zeros(())
        y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c  # x1 * s: NaN for an infinite partner
        y = torch.stack([y0, y1], -1).flatten(-2) if interleaved else torch.cat([y0, y1], -1)
        want = y.to(dtype)
        out = rope_ext.apply_rotary(x, table, interleaved=interleaved)
        torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)
# NaN payloads. The bfloat16 rounding of rows turned by a cached rotation (and of the fused
# norm's rows) has no NaN check: the kernel makes every NaN of the table and of the norm's
# weights the default NaN, whose low 16 bits are clear. NaNs whose payload lies in those bits
# (as a float64 table's keep, converted) must still come out NaN, on every path: heads that
# share a rotation, [B, H, S, D] rows that read the table in place, float64 tables.
payloads = torch.tensor([0x7F800001, 0x7FFFFFFF, 0xFF80FFFF - 2**32, 0x7FA0F000],
                        dtype=torch.int32).view(torch.float32)
table32 = torch.view_as_real(rope_ext.precompute_freqs_cis(64, 16)).clone()
table32[3, :4, 0] = payloads  # cos of pairs 0-3 at position 3
table32[3, 4:8, 1] = payloads  # sin of pairs 4-7
for table in (table32, table32.double()):
    for interleaved in (True, False):
        for x, seq_dim in ((torch.randn(2, 8, 3, 64), 1), (torch.randn(2, 3, 8, 64), 2)):
            x = x.bfloat16()
            kw = dict(interleaved=interleaved, seq_dim=seq_dim)
            want = reference.apply_rotary(x.double(), table.double(), **kw)
            assert want.isnan().any()  # position 3's rows
            for out in (rope_ext.apply_rotary(x, table, **kw),
                        rope_ext.apply_rotary(x.clone(), table, inplace=True, **kw)):
                assert torch.equal(out.isnan(), want.isnan()), (table.dtype, interleaved, seq_dim)
                torch.testing.assert_close(out.double(), want, atol=1.6e-2, rtol=1.6e-2,
                                           equal_nan=True)
weight = torch.ones(64)
weight[[1, 2, 40, 63]] = payloads
q, k = torch.randn(1, 8, 4, 64).bfloat16(), torch.randn(1, 8, 2, 64).bfloat16()
for interleaved in (True, False):
    outs = rope_ext.rms_norm_rotary_qk(q, k, weight, weight, table32, interleaved=interleaved)
    for x, out in zip((q, k), outs):
        want = reference.rms_norm_rotary(x.double(), weight.double(), table32.double(),
                                         interleaved=interleaved)
        assert torch.equal(out.isnan(), want.isnan()), ("norm", interleaved)
        torch.testing.assert_close(out.double(), want, atol=1.6e-2, rtol=1.6e-2, equal_nan=True)
# Streaming stores (auto): at one thread, q and k that move (read and write) just more bytes
# than the threshold build_info reports stream out of place, and must match the in-place
# results (regular stores) bit for bit.
torch.set_num_threads(1)
threshold = int(rope_ext.build_info()["cpu_streaming_threshold"])
assert 0 < threshold <= 2**28, threshold
tokens = threshold // (2 * 2 * 8 * 128 * 2) + 1  # bf16 q, k [1, tokens, 8, 128], read and written
table = rope_ext.precompute_freqs_cis(128, tokens)
for dtype in (torch.bfloat16, torch.float32):
    q, k = torch.randn(1, tokens, 8, 128).to(dtype), torch.randn(1, tokens, 8, 128).to(dtype)
    for interleaved in (True, False):
        got = rope_ext.apply_rotary_qk(q, k, table, interleaved=interleaved)
        want = [q.clone(), k.clone()]
        rope_ext.apply_rotary_qk(*want, table, inplace=True, interleaved=interleaved)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), ("stream", dtype, interleaved)
print("ok")
"""


# Streaming stores everywhere (ROPE_EXT_STREAMING_STORES=1): every out-of-place call of
# aligned rows of whole steps streams (span and tile walks, the fused norm's span walk), and
# must match the in-place results (regular stores, the same arithmetic) bit for bit, beside
# rows that cannot stream (head_dim 80, partial rotary's pass-through, a misaligned input).
STREAM_SCRIPT = r"""
import torch, rope_ext
torch.manual_seed(0)
for rot, head_dim in ((128, 128), (64, 128), (64, 64), (256, 256), (80, 80)):
    table = rope_ext.precompute_freqs_cis(rot, 64)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        q, k = torch.randn(2, 64, 4, head_dim).to(dtype), torch.randn(2, 64, 2, head_dim).to(dtype)
        for interleaved in (True, False):
            for seq_dim, view in ((1, lambda t: t), (2, lambda t: t.transpose(1, 2))):
                for kw in (dict(), dict(offset=0), dict(positions=torch.arange(64).view(1, 64, 1))):
                    kw = dict(kw, interleaved=interleaved, seq_dim=seq_dim)
                    if "positions" in kw and seq_dim == 2:
                        kw["positions"] = kw["positions"].view(1, 1, 64)
                    got = rope_ext.apply_rotary_qk(view(q), view(k), table, **kw)
                    want = [view(q).clone(), view(k).clone()]
                    rope_ext.apply_rotary_qk(*want, table, inplace=True, **kw)
                    for g, w in zip(got, want):
                        assert torch.equal(g, w), (rot, head_dim, dtype, interleaved, seq_dim, kw)
        shifted = torch.randn(q.numel() + 1).to(dtype)[1:].view(q.shape)
        want = shifted.clone()
        rope_ext.apply_rotary(want, table, inplace=True)
        assert torch.equal(rope_ext.apply_rotary(shifted, table), want), ("shifted", rot, dtype)
        if rot == head_dim:
            wq, wk = torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5
            for interleaved in (True, False):
                for seq_dim, view in ((1, lambda t: t), (2, lambda t: t.transpose(1, 2))):
                    kw = dict(interleaved=interleaved, seq_dim=seq_dim)
                    got = rope_ext.rms_norm_rotary_qk(view(q), view(k), wq, wk, table, **kw)
                    want = [view(q).clone(), view(k).clone()]
                    rope_ext.rms_norm_rotary_qk(*want, wq, wk, table, inplace=True, **kw)
                    for g, w in zip(got, want):
                        assert torch.equal(g, w), ("norm", head_dim, dtype, interleaved, seq_dim)
print("ok")
"""


VARIANTS = ["DEFAULT", "AVX2", "AVX512", "AVX512_BF16"]
CPU_FLAGS = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
NEEDS = {"DEFAULT": [], "AVX2": ["avx2", "fma", "f16c"], "AVX512": ["avx512f", "avx512bw"],
         "AVX512_BF16": ["avx512f", "avx512bw", "avx512_bf16"]}


def run(env, script=SCRIPT):
    # A kernel or streaming mode forced in the caller's environment (the narrower-kernel
    # runs) is not the choice these tests make.
    base = {k: v for k, v in os.environ.items()
            if k not in ("ROPE_EXT_CPU_KERNEL", "ROPE_EXT_STREAMING_STORES")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(base, **env))


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_variant(variant):
    if any(flag not in CPU_FLAGS.split() for flag in NEEDS[variant]):
        pytest.skip(f"this processor cannot run {variant}")
    result = run({"ROPE_EXT_CPU_KERNEL": variant})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [variant, "ok"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_streaming_stores_match_regular_ones(variant):
    if any(flag not in CPU_FLAGS.split() for flag in NEEDS[variant]):
        pytest.skip(f"this processor cannot run {variant}")
    result = run({"ROPE_EXT_CPU_KERNEL": variant, "ROPE_EXT_STREAMING_STORES": "1"},
                 STREAM_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


def test_streaming_stores_mode_is_checked():
    script = ("import torch, rope_ext\n"
              "rope_ext.apply_rotary(torch.randn(1, 4, 2, 64), rope_ext.precompute_freqs_cis(64, 4))")
    result = run({"ROPE_EXT_STREAMING_STORES": "yes"}, script)
    assert result.returncode != 0
    assert "ROPE_EXT_STREAMING_STORES=yes: expected 0, 1 or auto" in result.stderr
    assert run({"ROPE_EXT_STREAMING_STORES": "0"}, script).returncode == 0


def test_streaming_threshold_follows_mode_and_threads():
    script = ("import torch, rope_ext\n"
              "for n in (1, 2):\n"
              "    torch.set_num_threads(n)\n"
              "    print(rope_ext.build_info()['cpu_streaming_threshold'])")
    said = {}
    for mode in ("0", "1", "auto", ""):
        result = run({"ROPE_EXT_STREAMING_STORES": mode}, script)
        assert result.returncode == 0, result.stderr
        said[mode] = [int(v) for v in result.stdout.split()]
    assert said["0"] == [2**63 - 1] * 2
    assert said["1"] == [0, 0]
    assert said[""] == said["auto"]
    one, two = said["auto"]
    # max(threads x L2, a shared share): a second thread at most doubles it.
    assert 0 < one <= two <= 2 * one, said


@pytest.mark.parametrize("capability,widest", [("default", "DEFAULT"), ("avx2", "AVX2")])
def test_choice_follows_aten_cpu_capability(capability, widest):
    # Only the choice: test_kernel_variant runs each kernel (a capability picks one of them).
    result = run({"ATEN_CPU_CAPABILITY": capability},
                 "import rope_ext; print(rope_ext.build_info()['cpu_kernel'])")
    assert result.returncode == 0, result.stderr
    kernel = result.stdout.split()[0]
    assert kernel == widest or (widest == "AVX2" and "avx2" not in CPU_FLAGS)


def test_step_cycles_benchmark_builds_and_runs(tmp_path):
    """benchmarks/cpu_step_cycles.cpp (what bounds the fused norm on a Zen 4: its results are
    benchmarks/results/zen4-epyc/step-cycles.md) compiles with the flags of the command in its
    header and prints its two tables, each row a positive cycle count, or says that the CPU
    has no AVX512_BF16."""
    import re
    import shutil
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_step_cycles.cpp"
    command = next(line for line in source.read_text().splitlines() if line.startswith("//   g++ "))
    flags = command.split("g++ ", 1)[1].split(" -o ", 1)[0].split()
    assert "-march=native" not in flags and "-mavx512bf16" in flags, flags
    exe = tmp_path / "cpu_step_cycles"
    compiler = shutil.which("g++") or shutil.which("c++")
    subprocess.run([compiler, *flags, "-o", str(exe), str(source)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    with open("/proc/cpuinfo") as f:
        has_bf16 = " avx512_bf16" in f.read()
    if not has_bf16:
        assert out.strip() == "this CPU has no AVX512_BF16; nothing to measure", out
        return
    assert re.search(r"core cycles per TSC tick", out), out
    rows = re.findall(r"^\| ([^|]+) \| ([0-9.]+) \| ?([0-9.]*) ?\|$", out, flags=re.M)
    names = [name for name, _, _ in rows]
    for want in ("RoPE alone (4 mul/FMA, vcvtne2ps2bf16 + vpermw)",
                 "fused, both passes (+ load, vdpbf16ps, a reduction a row)", "VFMADD231PS",
                 "VDPBF16PS", "VCVTNE2PS2BF16", "VPTERNLOGD"):
        assert want in names, (want, out)
    assert len(rows) == 14, out
    assert all(float(cycles) > 0 for _, cycles, _ in rows), out
