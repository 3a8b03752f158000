"""Fused per-head RMSNorm + RoPE for QK-norm models (Qwen3, Qwen3-MoE, Gemma 3): q and k are
normalised over head_dim and rotated in one pass over their memory, forward and backward
(torch.ops.rope_ext.rms_norm_rotary_qk, csrc/qk_norm.h)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks, _native, reference
from .api import _dtensor_inputs, _op_args, _table_arg, is_dtensor


# rms_norm_rotary_qk's arguments after offset at their schema defaults: seq_dim,
# interleaved, eps, weight_offset, mrope_section, mrope_interleaved (see
# api.ROTARY_TAIL_DEFAULTS).
NORM_TAIL_DEFAULTS = (1, True, 1e-6, 0.0, None, False)


def rms_norm_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    freqs_cis: torch.Tensor,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    positions: torch.Tensor | None = None,
    offset: int = 0,
    seq_dim: int = 1,
    interleaved: bool = True,
    inplace: bool = False,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each head of q and k, then RoPE: each row x (one head of one token) becomes
    rotate(x / sqrt(mean(x**2) + eps) * (weight + weight_offset)).

    The statistics and products are float32 (float64 for float64 inputs), rounded once to the
    output dtype. The norm covers the whole head_dim, the rotation the table's R features.

    Args:
        q, k: as for apply_rotary_qk (layouts, GQA head counts, strides).
        q_weight, k_weight: [head_dim], float32 or their tensor's dtype.
        eps: added to the mean square; > 0.
        weight_offset: added to the weights: 1.0 for Gemma's (1 + weight) form.
        positions, offset, seq_dim, interleaved, mrope_section, mrope_interleaved: as for
            apply_rotary_qk.
        inplace: write into q and k and return them.

    Differentiable in q, k, the weights (their gradients summed over rows in float32) and
    the table. DTensor q and k: as for apply_rotary_qk (rope_ext.distributed), never Partial;
    plain weights are taken as replicated.
    """
    mrope_section = None if mrope_section is None else list(mrope_section)
    op = "rms_norm_rotary_qk_" if inplace else "rms_norm_rotary_qk"
    compiling = torch.compiler.is_compiling()
    table = _table_arg(freqs_cis, compiling)
    if is_dtensor(q):  # DTensor table and positions; plain weights: every rank's whole copy
        from . import distributed

        table, positions = _dtensor_inputs(op, [q, k], table, positions, offset, seq_dim,
                                           mrope_section)
        q_weight, k_weight = (distributed.replicate(w, q.device_mesh)
                              for w in (q_weight, k_weight))
    if _native.serves(q):
        if not compiling:
            out = _native.EAGER_ENTRIES[op](q, k, q_weight, k_weight, table, positions, offset,
                                            seq_dim, interleaved, eps, weight_offset,
                                            mrope_section, mrope_interleaved)
            if out is not NotImplemented:
                return (q, k) if inplace else out
        # Qwen3 and Gemma 3 differ from the defaults at most before the MRoPE arguments.
        args = _op_args((q_weight, k_weight, table, positions, offset),
                        (seq_dim, interleaved, eps, weight_offset, mrope_section,
                         mrope_interleaved), NORM_TAIL_DEFAULTS, 4)
        if inplace:
            _native.op(op)(q, k, *args)
            return q, k
        return _native.op(op)(q, k, *args)
    _checks.check_norm_args(op, q, k, q_weight, k_weight, table, positions, offset, seq_dim, eps,
                            mrope_section, mrope_interleaved)
    if inplace:
        _checks.check_inplace_target(op, "q", q)
        _checks.check_inplace_target(op, "k", k)
        _checks.check_qk_disjoint(op, q, k)
    if positions is not None:
        _checks.check_positions_in_range(op, positions, offset, table.shape[0])
    _native.warn_fallback(q.device)
    kwargs = dict(eps=eps, weight_offset=weight_offset, positions=positions, offset=offset,
                  seq_dim=seq_dim, interleaved=interleaved, inplace=inplace,
                  mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    return (reference.rms_norm_rotary(q, q_weight, table, **kwargs),
            reference.rms_norm_rotary(k, k_weight, table, **kwargs))
