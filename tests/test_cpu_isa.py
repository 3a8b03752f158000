"""Each per-instruction-set CPU kernel is right, and the run-time choice follows torch's."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch, rope_ext
from rope_ext import reference
print(rope_ext.build_info()["cpu_kernel"])
torch.manual_seed(0)
table = rope_ext.precompute_freqs_cis(80, 64)
real = torch.view_as_real(table).double()
tol = {torch.float32: 2e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
for dtype in tol:
    for interleaved in (True, False):
        for x in (torch.randn(2, 64, 3, 80), torch.randn(2, 64, 80, 3).transpose(-1, -2)):
            x = x.to(dtype)
            x[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e38])
            out = rope_ext.apply_rotary(x, table, interleaved=interleaved)
            want = reference.apply_rotary(x.double(), real, interleaved=interleaved)
            torch.testing.assert_close(out.double(), want, atol=tol[dtype], rtol=tol[dtype], equal_nan=True)
print("ok")
"""


VARIANTS = ["DEFAULT", "AVX2", "AVX512", "AVX512_BF16"]
CPU_FLAGS = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
NEEDS = {"DEFAULT": [], "AVX2": ["avx2", "fma", "f16c"], "AVX512": ["avx512f", "avx512bw"],
         "AVX512_BF16": ["avx512f", "avx512bw", "avx512_bf16"]}


def run(env):
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=dict(os.environ, **env))


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_variant(variant):
    if any(flag not in CPU_FLAGS.split() for flag in NEEDS[variant]):
        pytest.skip(f"this processor cannot run {variant}")
    result = run({"ROPE_EXT_CPU_KERNEL": variant})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [variant, "ok"]


@pytest.mark.parametrize("capability,widest", [("default", "DEFAULT"), ("avx2", "AVX2")])
def test_choice_follows_aten_cpu_capability(capability, widest):
    result = run({"ATEN_CPU_CAPABILITY": capability})
    assert result.returncode == 0, result.stderr
    kernel = result.stdout.split()[0]
    assert kernel == widest or (widest == "AVX2" and "avx2" not in CPU_FLAGS)
