"""Property-based tests: random shapes, strides, storage offsets, dtypes, pairings, positions,
offsets, in-place and inverse calls against the float64 reference; invalid draws must raise
the documented error and leave in-place inputs untouched."""

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

import rope_ext
from rope_ext import reference

from conftest import DEVICES, TOLERANCES

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HEAD_DIMS = [2, 3, 4, 6, 8, 10, 16, 18, 32, 40, 72, 80, 96, 128]


@st.composite
def rotary_calls(draw, device):
    """x (possibly a strided view), the table and the call's keyword arguments."""
    dtype = draw(st.sampled_from(DTYPES))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    pairs = draw(st.integers(1, head_dim // 2))
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    seq_dim = draw(st.integers(-len(lead) - 1, len(lead) - 1))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    # Build a bigger buffer and view into it: permuted leading dims, steps, a storage offset,
    # strided features (the feature dim not last in memory), or a slice of a fused buffer.
    layout = draw(st.sampled_from(["contiguous", "permuted", "stepped", "offset",
                                   "strided_features", "fused"]))
    shape = [*lead, head_dim]
    if layout == "permuted":
        perm = draw(st.permutations(range(len(lead))))
        base = torch.randn([shape[p] for p in perm] + [head_dim], generator=gen)
        inverse_perm = [perm.index(i) for i in range(len(lead))] + [len(lead)]
        x = base.permute(inverse_perm)
    elif layout == "stepped":
        step = draw(st.integers(2, 3))
        x = torch.randn([lead[0] * step, *lead[1:], head_dim], generator=gen)[::step]
    elif layout == "offset":
        extra = draw(st.integers(1, 7))
        x = torch.randn(extra + torch.Size(shape).numel(), generator=gen)[extra:].view(shape)
    elif layout == "strided_features":
        x = torch.randn([*lead[:-1], head_dim, lead[-1]], generator=gen).transpose(-1, -2)
    elif layout == "fused":
        fused = torch.randn([*lead[:-1], lead[-1] * head_dim * 3], generator=gen)
        x = fused[..., lead[-1] * head_dim:2 * lead[-1] * head_dim].unflatten(
            -1, (lead[-1], head_dim))
    else:
        x = torch.randn(shape, generator=gen)
    x = x.to(dtype=dtype, device=device) if dtype != torch.float32 or device != "cpu" else x
    assert list(x.shape) == shape or layout == "fused"

    lead_shape = list(x.shape[:-1])
    sd = seq_dim + len(lead_shape) + 1 if seq_dim < 0 else seq_dim
    kwargs = dict(interleaved=draw(st.booleans()), inverse=draw(st.booleans()), seq_dim=seq_dim)
    use_positions = draw(st.booleans())
    if use_positions:
        ndim = draw(st.integers(0, len(lead_shape)))
        pshape = [draw(st.sampled_from([1, n])) for n in lead_shape[len(lead_shape) - ndim:]]
        table_rows = draw(st.integers(1, 40))
        kwargs["offset"] = draw(st.integers(0, table_rows - 1))
        hi = table_rows - kwargs["offset"]
        kwargs["positions"] = torch.randint(0, hi, pshape, generator=gen).to(
            device=device, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    elif 0 <= sd < len(lead_shape):
        kwargs["offset"] = draw(st.integers(0, 6))
        table_rows = kwargs["offset"] + lead_shape[sd] + draw(st.integers(0, 4))
    else:
        table_rows = 8  # seq_dim is invalid: the call must be refused
    table = rope_ext.precompute_freqs_cis(2 * pairs, table_rows, device=device,
                                          dtype=draw(st.sampled_from([torch.float32, torch.float64])))
    return x, table, kwargs


def oracle(x, table, kwargs):
    real = torch.view_as_real(table).double()
    return reference.apply_rotary(x.double(), real, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_matches_reference_and_inverts(device, data):
    x, table, kwargs = data.draw(rotary_calls(device))
    note(f"x {tuple(x.shape)} strides {x.stride()} {x.dtype} table {tuple(table.shape)} {kwargs}")
    seq_dim = kwargs["seq_dim"]
    # With positions seq_dim plays no part (any value is accepted); without, it must be valid.
    assume("positions" in kwargs or 0 <= (seq_dim + x.dim() if seq_dim < 0 else seq_dim) <= x.dim() - 2)
    inplace = data.draw(st.booleans())
    want = oracle(x, table, kwargs)  # before an in-place call writes
    before = x.clone()
    got = rope_ext.apply_rotary(x, table, inplace=inplace, **kwargs)
    torch.testing.assert_close(got.double(), want, **TOLERANCES[x.dtype])
    if not inplace:
        torch.testing.assert_close(x, before, atol=0, rtol=0)
    # Rotating back undoes the rotation up to two roundings of x, and the table's own rounding
    # (float32 entries have cos^2 + sin^2 = 1 only to ~1e-7).
    back = rope_ext.apply_rotary(got, table, **{**kwargs, "inverse": not kwargs["inverse"]})
    table_eps = 1e-6 if table.dtype == torch.complex64 else 0.0
    tol = {k: 2 * v + table_eps for k, v in TOLERANCES[x.dtype].items()}
    torch.testing.assert_close(back.double(), before.double(), **tol)


@st.composite
def invalid_calls(draw, device):
    x, table, kwargs = draw(rotary_calls(device))
    kwargs["seq_dim"] = 0  # valid, so the drawn breakage is the only fault
    breakage = draw(st.sampled_from(["position_high", "position_negative", "seq_dim",
                                     "rotary_too_big", "positions_shape", "offset_past_end"]))
    table_rows = table.shape[0]
    if breakage == "position_high":
        kwargs["positions"] = torch.full(x.shape[:-1], table_rows, device=device)
        kwargs["offset"] = 0
        error = IndexError
    elif breakage == "position_negative":
        kwargs["positions"] = torch.full(x.shape[:-1], -1, device=device)
        kwargs["offset"] = 0
        error = IndexError
    elif breakage == "seq_dim":  # refused only without positions
        kwargs.pop("positions", None)
        kwargs["seq_dim"] = draw(st.sampled_from([x.dim() - 1, x.dim(), -1, -x.dim() - 1]))
        error = ValueError
    elif breakage == "rotary_too_big":
        table = rope_ext.precompute_freqs_cis(2 * (x.shape[-1] // 2 + 1), table_rows, device=device)
        error = ValueError
    elif breakage == "positions_shape":
        kwargs["positions"] = torch.zeros(*x.shape[:-1], 2, dtype=torch.long, device=device)
        error = ValueError
    else:
        kwargs.pop("positions", None)
        kwargs["seq_dim"] = 0
        kwargs["offset"] = table_rows - x.shape[0] + 1
        error = ValueError
    return x, table, kwargs, error


@pytest.mark.parametrize("device", ["cpu"])  # CUDA checks positions with a device assert
@given(data=st.data())
def test_invalid_calls_raise_and_write_nothing(device, data):
    x, table, kwargs, error = data.draw(invalid_calls(device))
    note(f"x {tuple(x.shape)} {x.dtype} table {tuple(table.shape)} {kwargs}")
    before = x.clone()
    with pytest.raises(error):
        rope_ext.apply_rotary(x, table, inplace=True, **kwargs)
    torch.testing.assert_close(x, before, atol=0, rtol=0, equal_nan=True)
