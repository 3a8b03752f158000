"""The table-gradient op that the ops' C++ autograd (csrc/rope_autograd.cpp) calls.

d/dx of a rotation is the inverse rotation, so grad_x is the native op with `inverse`
flipped (in C++). The table's gradient, when it requires one, is composed of stock torch ops.
"""

from __future__ import annotations

import torch

from .api import is_dtensor
from .reference import pair_positions, row_positions

_lib = torch.library.Library("rope_ext", "IMPL")


def rotary_table_grad(grad, x, freqs_cis, positions, offset, seq_dim, interleaved, inverse,
                      mrope_section, mrope_interleaved):
    """Gradient of sum(grad * apply_rotary(x, freqs_cis, ...)) w.r.t. freqs_cis [P, R/2, 2].

    With y0 = x0 c - x1 s and y1 = x0 s + x1 c: dc = g0 x0 + g1 x1, ds = g1 x0 - g0 x1 (negated
    for inverse calls), summed over every row that used the table row. This matches the eager
    complex product's gradient, grad * conj(x).
    """
    if is_dtensor(grad):
        from . import distributed

        return distributed.table_grad(rotary_table_grad, grad, x, freqs_cis, positions,
                                      offset, seq_dim, interleaved, inverse, mrope_section,
                                      mrope_interleaved)
    if freqs_cis.is_complex():  # the gradient of the real view, as a complex tensor
        real = rotary_table_grad(grad, x, torch.view_as_real(freqs_cis), positions, offset,
                                 seq_dim, interleaved, inverse, mrope_section,
                                 mrope_interleaved)
        return torch.view_as_complex(real)
    pairs = freqs_cis.shape[1]
    rotary_dim = 2 * pairs
    g = grad[..., :rotary_dim].to(freqs_cis.dtype)
    xr = x[..., :rotary_dim].to(freqs_cis.dtype)
    if interleaved:
        g0, g1 = g.unflatten(-1, (pairs, 2)).unbind(-1)
        x0, x1 = xr.unflatten(-1, (pairs, 2)).unbind(-1)
    else:
        g0, g1 = g[..., :pairs], g[..., pairs:]
        x0, x1 = xr[..., :pairs], xr[..., pairs:]
    d_cos = g0 * x0 + g1 * x1
    d_sin = g1 * x0 - g0 * x1
    if inverse:
        d_sin = -d_sin
    contributions = torch.stack([d_cos, d_sin], -1).reshape(-1, pairs, 2)
    if mrope_section is not None:  # each pair to the table row of its axis' position
        rows = pair_positions(x.shape[:-1], pairs, positions, offset, mrope_section,
                              mrope_interleaved).reshape(-1, pairs)
        entries = rows * pairs + torch.arange(pairs, device=x.device)
        flat = freqs_cis.new_zeros(freqs_cis.shape[0] * pairs, 2)
        return _sum_rows(flat, entries.reshape(-1), contributions.reshape(-1, 2)).view(
            freqs_cis.shape)
    seq_dim = seq_dim + x.dim() if seq_dim < 0 else seq_dim
    rows = row_positions(x.shape[:-1], positions, offset, seq_dim, x.device).reshape(-1)
    return _sum_rows(torch.zeros_like(freqs_cis), rows, contributions)


def _sum_rows(out, rows, contributions):
    """out[rows[i]] += contributions[i], summed in the same order on every run.

    On CUDA, index_add_ sums with atomics, in a different order each run: the first H200 run
    found the in-place op's double backward "not reentrant" (gradgradcheck). index_put_ with
    accumulate sorts the rows there and sums each run of equal rows in order. On CPU
    index_add_ is already sequential, and 4x faster than index_put_ (bf16-sized q [4, 2048,
    32, 64 pairs]: 13 against 59 ms)."""
    if out.device.type == "cpu":
        return out.index_add_(0, rows, contributions)
    return out.index_put_((rows,), contributions, accumulate=True)


_lib.impl("rotary_table_grad", rotary_table_grad, "CompositeImplicitAutograd")
