"""Gradients: x's is the inverse rotation (native op), the table's matches the eager path."""

import pytest
import torch

import rope_ext
from rope_ext import reference


def complex_leaf(dim, end, device):
    return rope_ext.precompute_freqs_cis(dim, end, device=device, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("with_positions", [False, True])
@pytest.mark.parametrize("offset", [0, 3])
def test_gradcheck(device, interleaved, inverse, inplace, with_positions, offset):
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(
        8, 15, device=device, dtype=torch.float64)).clone().requires_grad_()
    x = torch.randn(2, 5, 2, 10, device=device, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[3], [0], [11], [3], [7]], device=device) if with_positions else None

    def f(x, table):
        x = x * 1.0 if inplace else x  # in-place needs a non-leaf
        return rope_ext.apply_rotary(x, table, positions=positions, offset=offset, seq_dim=1,
                                     interleaved=interleaved, inverse=inverse, inplace=inplace)

    assert torch.autograd.gradcheck(f, (x, table))
    assert torch.autograd.gradgradcheck(f, (x, table))


@pytest.mark.parametrize("inplace", [False, True])
def test_gradcheck_qk(device, inplace):
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(
        8, 6, device=device, dtype=torch.float64)).clone().requires_grad_()
    q = torch.randn(2, 6, 3, 8, device=device, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 6, 1, 8, device=device, dtype=torch.float64, requires_grad=True)

    def f(q, k, table):
        if inplace:
            q, k = q * 1.0, k * 1.0
        return rope_ext.apply_rotary_qk(q, k, table, interleaved=False, inplace=inplace)

    assert torch.autograd.gradcheck(f, (q, k, table))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_eager_path(device, inplace, dtype):
    """Complex table leaf as LLaMA keeps it; gradients equal the eager complex product's."""
    x0 = torch.randn(2, 16, 4, 32, device=device).to(dtype)
    weight = torch.randn(2, 16, 4, 32, device=device)

    def run(fn):
        table = complex_leaf(32, 16, device).to(torch.complex64).detach().requires_grad_()
        x = x0.clone().requires_grad_()
        out = fn(x * 1, table)
        (out.float() * weight).sum().backward()
        return x.grad.float(), table.grad

    got = run(lambda x, t: rope_ext.apply_rotary(x, t, inplace=inplace))
    want = run(lambda x, t: reference.apply_rotary(x, t))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    # In-place calls recover x for the table's gradient by rotating the rounded output back,
    # so in bfloat16 that gradient carries the output's rounding (docs/guides/semantics.md).
    table_tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 or not inplace else \
        dict(atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(got[1], want[1], **table_tol)
    assert got[1].dtype == torch.complex64


def rotated_by_hand(x, table, rows, interleaved):
    """x [..., D] rotated with stock ops, pair i of each row by table[rows[..., i], i]."""
    pairs = table.shape[1]
    pair = torch.arange(pairs, device=x.device)
    cos, sin = table[rows, pair, 0], table[rows, pair, 1]
    rotated = x[..., :2 * pairs]
    if interleaved:
        x0, x1 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x0, x1 = rotated[..., :pairs], rotated[..., pairs:]
    y0, y1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    y = torch.stack([y0, y1], -1).flatten(-2) if interleaved else torch.cat([y0, y1], -1)
    return torch.cat([y, x[..., 2 * pairs:]], -1)


# MRoPE cases for 4 rotary pairs: the sections and the axis each pair turns by, written out.
MROPE_AXES = {
    "qwen2": (dict(mrope_section=[1, 2, 1]), [0, 1, 1, 2]),
    "qwen3": (dict(mrope_section=[2, 1, 1], mrope_interleaved=True), [0, 1, 2, 0]),
}


@pytest.mark.parametrize("mrope", [None, *MROPE_AXES])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_table_gradient_with_positions_and_offset(device, mrope, interleaved, inplace):
    """With positions, row s of x reads table row offset + positions[s]: the gradients of x
    and of the table against the rotation composed of stock ops in float64."""
    gen = torch.Generator().manual_seed(6)
    rows_in_table, offset = 20, 7
    table0 = torch.view_as_real(rope_ext.precompute_freqs_cis(8, rows_in_table,
                                                              dtype=torch.float64))
    x0 = torch.randn(2, 5, 3, 12, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, 5, 3, 12, generator=gen, dtype=torch.float64).to(device)
    kwargs = dict(interleaved=interleaved)
    if mrope is None:
        positions = torch.randint(0, rows_in_table - offset, (2, 5, 1), generator=gen)
        rows = (positions + offset).expand(2, 5, 3).unsqueeze(-1).expand(2, 5, 3, 4)
    else:
        kwargs.update(MROPE_AXES[mrope][0])
        positions = torch.randint(0, rows_in_table - offset, (3, 2, 5, 1), generator=gen)
        per_axis = (positions + offset).expand(3, 2, 5, 3).movedim(0, -1)  # [2, 5, 3, axes]
        rows = per_axis[..., MROPE_AXES[mrope][1]]
    positions, rows = positions.to(device), rows.to(device)

    def gradients(rotate):
        table = table0.clone().to(device).requires_grad_()
        x = x0.clone().to(device).requires_grad_()
        (rotate(x * 1, table) * weight).sum().backward()
        return x.grad, table.grad

    got = gradients(lambda x, table: rope_ext.apply_rotary(
        x, table, positions=positions, offset=offset, inplace=inplace, **kwargs))
    want = gradients(lambda x, table: rotated_by_hand(x, table, rows, interleaved))
    assert want[1].abs().sum() > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("seq_dim", [0, 1, 2, -2, -3, -4])
def test_table_gradient_along_any_seq_dim(device, seq_dim):
    """Without positions, row i along seq_dim (given either way) reads table row offset + i:
    the table's gradient against the rotation composed of stock ops in float64."""
    gen = torch.Generator().manual_seed(7)
    offset = 2
    x0 = torch.randn(4, 5, 3, 12, generator=gen, dtype=torch.float64).to(device)
    weight = torch.randn(4, 5, 3, 12, generator=gen, dtype=torch.float64).to(device)
    table0 = torch.view_as_real(rope_ext.precompute_freqs_cis(8, 10, device=device,
                                                              dtype=torch.float64))
    dim = seq_dim % 4
    shape = [1, 1, 1]
    shape[dim] = x0.shape[dim]
    rows = (torch.arange(x0.shape[dim], device=device) + offset).view(shape).expand(4, 5, 3)
    rows = rows.unsqueeze(-1).expand(4, 5, 3, 4)

    def table_gradient(rotate):
        table = table0.clone().requires_grad_()
        (rotate(x0, table) * weight).sum().backward()
        return table.grad

    got = table_gradient(lambda x, table: rope_ext.apply_rotary(x, table, offset=offset,
                                                                seq_dim=seq_dim))
    want = table_gradient(lambda x, table: rotated_by_hand(x, table, rows, True))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_inplace_on_leaf_requiring_grad_is_refused(device):
    x = torch.randn(1, 4, 16, device=device, requires_grad=True)
    table = rope_ext.precompute_freqs_cis(16, 4, device=device)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        rope_ext.apply_rotary(x, table, inplace=True)


def test_inplace_bumps_version_so_stale_saves_are_caught(device):
    x = torch.randn(1, 4, 16, device=device, requires_grad=True)
    h = x * 1.0
    y = h.sigmoid()  # saves h's output for backward
    v = y._version
    rope_ext.apply_rotary(y, rope_ext.precompute_freqs_cis(16, 4, device=device), inplace=True)
    assert y._version == v + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_no_grad_calls_skip_the_autograd_layer_and_agree(device):
    table = rope_ext.precompute_freqs_cis(16, 8, device=device)
    x = torch.randn(2, 8, 3, 16, device=device, requires_grad=True)
    tracked = rope_ext.apply_rotary(x, table)
    assert tracked.grad_fn is not None
    with torch.no_grad():
        untracked = rope_ext.apply_rotary(x, table)
    plain = rope_ext.apply_rotary(x.detach(), table)
    assert untracked.grad_fn is None and plain.grad_fn is None
    assert torch.equal(untracked, tracked.detach()) and torch.equal(plain, tracked.detach())
