import mpmath
import pytest
import torch

import rope_ext
from rope_ext import reference

from conftest import DEVICES


def exact_entry(t: int, i: int, dim: int, theta: float) -> tuple[float, float]:
    mpmath.mp.prec = 128
    angle = mpmath.mpf(t) * mpmath.power(mpmath.mpf(theta), -mpmath.mpf(2 * i) / dim)
    return float(mpmath.cos(angle)), float(mpmath.sin(angle))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_table_is_within_1_2e_7_of_exact_below_2_pow_20(device):
    dim, end = 128, 2**20
    table = rope_ext.precompute_freqs_cis(dim, end, device=device)
    assert table.shape == (end, dim // 2) and table.dtype == torch.complex64
    positions = [0, 1, 7, 4095, 65537, 524287, 1000003, end - 2, end - 1]
    pairs = [0, 1, 5, 31, 63]
    llama = reference.llama_precompute_freqs_cis(dim, end)
    worst_ours = worst_llama = 0.0
    for t in positions:
        for i in pairs:
            c, s = exact_entry(t, i, dim, 10000.0)
            ours = complex(table[t, i])
            worst_ours = max(worst_ours, abs(ours.real - c), abs(ours.imag - s))
            theirs = complex(llama[t, i])
            worst_llama = max(worst_llama, abs(theirs.real - c), abs(theirs.imag - s))
    assert worst_ours <= 1.2e-7
    assert worst_llama > 1e-2  # the float32 recipe the float64 angles fix


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim,end,theta", [(128, 300, 10000.0), (64, 17, 500000.0), (7, 5, 10.0)])
def test_matches_float64_reference(device, dim, end, theta):
    got = rope_ext.precompute_freqs_cis(dim, end, theta, device=device, dtype=torch.float64)
    assert got.dtype == torch.complex128 and got.shape == (end, dim // 2)
    want = reference.precompute_freqs_cis(dim, end, theta, device=device, dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_op_returns_real_view():
    table = torch.ops.rope_ext.precompute_freqs_cis(16, 4)
    assert table.shape == (4, 8, 2) and table.dtype == torch.float32
    torch.testing.assert_close(table[:, :, 0], torch.view_as_real(
        rope_ext.precompute_freqs_cis(16, 4))[:, :, 0])


def test_empty_table():
    assert rope_ext.precompute_freqs_cis(8, 0).shape == (0, 4)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(dim=1, end=4), ValueError, "dim must be >= 2, got 1"),
        (dict(dim=8, end=-1), ValueError, "end must be >= 0, got -1"),
        (dict(dim=8, end=4, theta=-1.0), ValueError, "theta must be > 0, got -1"),
        (dict(dim=8, end=4, dtype=torch.float16), TypeError, "dtype must be float32 or float64, got Half"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        rope_ext.precompute_freqs_cis(**kwargs)
    dtype = kwargs.pop("dtype", None)
    with pytest.raises(error, match=match):
        torch.ops.rope_ext.precompute_freqs_cis(**kwargs, dtype=dtype)
