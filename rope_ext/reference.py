"""The eager path: Meta LLaMA's complex-multiply RoPE, generalised to rope_ext's arguments.

It backs the public API wherever no native kernel is available, and, run in float64, it is
the tests' oracle. Plain torch, written for reading, not speed.
"""

from __future__ import annotations

import torch


def llama_precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """LLaMA's original table, float32 throughout (its angles drift at long context)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def llama_apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA's apply_rotary_emb for x [B, S, H, D] and freqs_cis [S, D/2] (complex)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    shape = [d if i == 1 or i == xq_.ndim - 1 else 1 for i, d in enumerate(xq_.shape)]
    freqs_cis = freqs_cis.view(*shape)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's half-split rotation helper."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Hugging Face's apply_rotary_pos_emb: cos/sin [B, S, D], q/k [B, H, S, D]."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def precompute_freqs_cis(
    dim: int,
    end: int,
    theta: float = 10000.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The LLaMA table with angles computed in float64 and rounded once to dtype."""
    i = torch.arange(dim // 2, dtype=torch.float64, device=device)
    inv_freq = torch.pow(theta, -2.0 * i / dim)
    angles = torch.outer(torch.arange(end, dtype=torch.float64, device=device), inv_freq)
    table = torch.polar(torch.ones_like(angles), angles)
    return table.to(torch.complex64 if dtype == torch.float32 else torch.complex128)


def as_complex(freqs_cis: torch.Tensor) -> torch.Tensor:
    """[P, R/2] complex from either form of the table."""
    return freqs_cis if freqs_cis.is_complex() else torch.view_as_complex(freqs_cis)


def row_positions(
    lead_shape: torch.Size | list[int],
    positions: torch.Tensor | None,
    offset,
    seq_dim: int,
    device: torch.device,
) -> torch.Tensor:
    """int64 position of every row of x (x.shape[:-1] == lead_shape)."""
    if positions is not None:
        return (positions.to(torch.int64) + offset).expand(lead_shape)
    shape = [1] * len(lead_shape)
    shape[seq_dim] = lead_shape[seq_dim]
    index = torch.arange(lead_shape[seq_dim], device=device, dtype=torch.int64) + offset
    return index.view(shape).expand(lead_shape)


def mrope_pair_axes(pairs: int, mrope_section, mrope_interleaved: bool = False) -> list[int]:
    """The position axis each of the R/2 rotary pairs turns by (MRoPE): the contiguous
    sections in order (Qwen2-VL, Qwen2.5-VL), or Qwen3-VL's interleaving: height when
    i % 3 == 1 and i < 3 * section[1], width when i % 3 == 2 and i < 3 * section[2], time
    otherwise."""
    section = list(mrope_section)
    if mrope_interleaved:
        return [i % 3 if i % 3 and i < 3 * section[i % 3] else 0 for i in range(pairs)]
    return [a for a, n in enumerate(section) for _ in range(n)]


def pair_positions(
    lead_shape: torch.Size | list[int],
    pairs: int,
    positions: torch.Tensor,
    offset,
    mrope_section,
    mrope_interleaved: bool,
) -> torch.Tensor:
    """int64 position of every pair of every row [*lead_shape, R/2] under MRoPE: pair i of
    a row takes offset + positions[axis(i), ...]."""
    axes = torch.tensor(mrope_pair_axes(pairs, mrope_section, mrope_interleaved),
                        device=positions.device)
    per_axis = torch.stack([(p.to(torch.int64) + offset).expand(lead_shape)
                            for p in positions.unbind(0)])  # [A, *lead_shape]
    return per_axis[axes].movedim(0, -1)


def apply_rotary(
    x: torch.Tensor,
    freqs_cis: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offset: int = 0,
    seq_dim: int = 1,
    interleaved: bool = True,
    inverse: bool = False,
    inplace: bool = False,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> torch.Tensor:
    """rope_ext.apply_rotary by complex multiplication (arguments assumed checked)."""
    table = as_complex(freqs_cis)
    pairs = table.shape[1]
    rotary_dim = 2 * pairs
    seq_dim = seq_dim + x.dim() if seq_dim < 0 else seq_dim
    real = torch.float64 if x.dtype == torch.float64 else torch.float32
    cplx = torch.complex128 if real == torch.float64 else torch.complex64

    if mrope_section is not None:
        rows = pair_positions(x.shape[:-1], pairs, positions, offset, mrope_section,
                              mrope_interleaved)
        rotation = table.to(cplx)[rows, torch.arange(pairs, device=x.device)]
    else:
        rows = row_positions(x.shape[:-1], positions, offset, seq_dim, x.device)
        rotation = table.to(cplx)[rows]  # [*x.shape[:-1], R/2]
    if inverse:
        rotation = rotation.conj()
    xr = x[..., :rotary_dim].to(real)
    if interleaved:
        xc = torch.view_as_complex(xr.unflatten(-1, (pairs, 2)).contiguous())
    else:
        xc = torch.complex(xr[..., :pairs], xr[..., pairs:])
    y = xc * rotation
    yr = torch.view_as_real(y).flatten(-2) if interleaved else torch.cat([y.real, y.imag], -1)
    out = torch.cat([yr.to(x.dtype), x[..., rotary_dim:]], -1)
    if inplace:
        return x.copy_(out)
    return out


def rms_norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    freqs_cis: torch.Tensor,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    positions: torch.Tensor | None = None,
    offset: int = 0,
    seq_dim: int = 1,
    interleaved: bool = True,
    inplace: bool = False,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> torch.Tensor:
    """rope_ext.rms_norm_rotary_qk on one tensor: per-head RMSNorm over head_dim, then the
    rotation, in float32 (float64 for float64 x) and rounded once to x's dtype."""
    real = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(real)
    scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = xf * scale * (weight.to(real) + weight_offset)
    out = apply_rotary(normed, freqs_cis, positions=positions, offset=offset, seq_dim=seq_dim,
                       interleaved=interleaved, mrope_section=mrope_section,
                       mrope_interleaved=mrope_interleaved).to(x.dtype)
    if inplace:
        return x.copy_(out)
    return out
