import contextlib

import mpmath
import pytest
import torch

import rope_ext
from rope_ext import _native, reference

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


@pytest.mark.parametrize("dim,end,theta", [(64, 128, 10000.0), (7, 40, 500000.0)])
def test_llama_recipe_is_the_table_at_short_context(dim, end, theta):
    """LLaMA's float32 table (the drop-in's and the benchmarks' reference) drifts with the
    position, but below a few hundred it is the exact table to float32 rounding."""
    llama = reference.llama_precompute_freqs_cis(dim, end, theta)
    exact = reference.precompute_freqs_cis(dim, end, theta, dtype=torch.float64)
    assert llama.shape == exact.shape and llama.dtype == torch.complex64
    torch.testing.assert_close(llama.to(torch.complex128), exact, atol=5e-5, rtol=0)


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


@contextlib.contextmanager
def eager_path(monkeypatch):
    """No library at all: precompute_freqs_cis takes the eager path, making its checks itself."""
    with monkeypatch.context() as without_library:
        without_library.setattr(_native, "LOADED", False)
        without_library.setattr(_native, "NATIVE_DEVICES", frozenset())
        without_library.setattr(_native, "_warned", {"cpu"})
        yield


def test_empty_table():
    assert rope_ext.precompute_freqs_cis(8, 0).shape == (0, 4)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(dim=1, end=4), ValueError, "dim must be >= 2, got 1"),
        (dict(dim=8, end=-1), ValueError, "end must be >= 0, got -1"),
        (dict(dim=8, end=4, theta=-1.0), ValueError, "theta must be > 0, got -1"),
        (dict(dim=8, end=4, theta=0.0), ValueError, "theta must be > 0, got 0"),
        (dict(dim=8, end=4, dtype=torch.float16), TypeError, "dtype must be float32 or float64, got Half"),
    ],
)
def test_bad_arguments(kwargs, error, match, monkeypatch):
    with pytest.raises(error, match=match):
        rope_ext.precompute_freqs_cis(**kwargs)
    with eager_path(monkeypatch):
        with pytest.raises(error, match=match):
            rope_ext.precompute_freqs_cis(**kwargs)
    dtype = kwargs.pop("dtype", None)
    with pytest.raises(error, match=match):
        torch.ops.rope_ext.precompute_freqs_cis(**kwargs, dtype=dtype)


@pytest.mark.parametrize("dim,end,theta", [(2, 5, 10000.0), (3, 5, 10000.0), (8, 0, 10000.0),
                                           (8, 5, 0.5)])
def test_limits_are_accepted_on_every_path(dim, end, theta, monkeypatch):
    # One pair, an odd dim, no rows, a base below 1: the native op and the eager path build
    # the same table, the float64 reference's.
    want = reference.precompute_freqs_cis(dim, end, theta, dtype=torch.float64)
    native = rope_ext.precompute_freqs_cis(dim, end, theta, dtype=torch.float64)
    with eager_path(monkeypatch):
        fallback = rope_ext.precompute_freqs_cis(dim, end, theta, dtype=torch.float64)
    for got in (native, fallback):
        assert got.shape == (end, dim // 2)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_scaling_arguments_read_both_transformers_forms():
    """A transformers 5 rope_parameters dict and a 4.x rope_scaling dict become the op's
    theta and keyword arguments, each value of the type the schema takes."""
    from rope_ext.api import scaling_arguments

    theta, kwargs = scaling_arguments(
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4, "beta_fast": None,
         "original_max_position_embeddings": 4096.0, "truncate": 0, "mrope_section": [1, 2]},
        10000.0, max_position_embeddings=8192.0, seq_len=100.0)
    assert theta == 1e6 and kwargs == dict(rope_type="yarn", factor=4.0,
                                           original_max_position_embeddings=4096,
                                           truncate=False, max_position_embeddings=8192,
                                           seq_len=100)
    assert [type(kwargs[k]) for k in kwargs] == [str, float, int, bool, int, int]
    theta, kwargs = scaling_arguments(  # 4.x: "type", and theta from the config
        {"type": "longrope", "long_factor": [1, 2], "short_factor": (3, 4)}, 500)
    assert theta == 500.0 and type(theta) is float
    assert kwargs == dict(rope_type="longrope", long_factor=[1.0, 2.0], short_factor=[3.0, 4.0])
    assert all(type(v) is float for v in kwargs["long_factor"] + kwargs["short_factor"])
    assert scaling_arguments({"rope_theta": 2.0}, 10.0) == (2.0, dict(rope_type="default"))
    assert scaling_arguments(None, 10.0) == scaling_arguments({}, 10.0) == (10.0, {})
