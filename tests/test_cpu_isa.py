"""Each per-instruction-set CPU kernel (picked like ATen's, ATEN_CPU_CAPABILITY) is right."""

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


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_kernel_variant(capability):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    kernel, status = run.stdout.split()
    # The variant torch chose, unless this processor lacks it (then a narrower one).
    assert kernel == capability.upper() or capability != "default"
    assert status == "ok"
