"""RoPE fused with the KV-cache write of an inference step: q rotated, k rotated into its
cache slot, v copied into its own, in one call (torch.ops.rope_ext.rotary_kv_cache_update)."""

from __future__ import annotations

import torch

from . import _checks, _native
from .api import _table_arg, apply_rotary, apply_rotary_qk
from .qk_norm import rms_norm_rotary_qk

# The ops' arguments after slots at their schema defaults (csrc/rope_ops.cpp): positions,
# offset, seq_dim, interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
# weight_offset. A boxed call converts each argument it is passed, so the wrapper leaves off
# a tail of defaults.
KV_TAIL_DEFAULTS = (None, 0, 1, True, "NHD", None, None, None, None, 1e-6, 0.0)

_FLOAT8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# Device types whose native library holds the fused kernel (fixed at import, so that
# torch.compile sees a constant); fake and meta tensors run its fake kernel.
_KV_DEVICES = frozenset(
    device for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
    if _native.LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(
        "rope_ext::rotary_kv_cache_update", key)) | {"meta"}


def _native_kv(q: torch.Tensor) -> bool:
    """Whether a native kernel of the fused op serves q's device (CPU, and CUDA in a CUDA
    build; other devices take the composition below)."""
    return _native.serves(q) and q.device.type in _KV_DEVICES


def _is_default(value: object, default: object) -> bool:
    return value is None if default is None else (
        type(value) is type(default) and value == default)


def rotary_kv_cache_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    freqs_cis: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offset: int = 0,
    seq_dim: int = 1,
    interleaved: bool = True,
    cache_layout: str = "NHD",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotates q, and writes each token's rotated k and its v into the caches, in one call.

    Args:
        q, k, v: [B, S, H, D] (seq_dim=1), Hugging Face's [B, H, S, D] (seq_dim=2) or packed
            [T, H, D] (seq_dim=0, with positions); one dtype (float16, bfloat16, float32 or
            float64), features contiguous. k and v have H_kv heads (GQA: H_kv may be fewer
            than q's); v's head_dim may differ from k's. k and v are only read.
        freqs_cis: the table, as for apply_rotary; features past its width pass through.
        k_cache, v_cache: paged [num_blocks, block_size, H_kv, D] (cache_layout="NHD") or
            [num_blocks, H_kv, block_size, D] ("HND"); a static [B, H_kv, max_len, D] cache is
            HND with num_blocks = B and block_size = max_len (see static_cache_slots). q's
            dtype, or float8_e4m3fn / float8_e5m2 with k_scale / v_scale.
        slots: int32/int64, one per token, broadcastable to k.shape[:-1] with size 1 along the
            heads ([B, S, 1], [B, 1, S] or [T, 1]): block * block_size + index in the block.
            A negative slot writes nothing (padding); that token's q is still rotated.
        positions, offset: a token's position, as for apply_rotary (one per token).
        interleaved: the pairing, as for apply_rotary.
        k_scale, v_scale: float32, 1 value or [H_kv], for float8 caches only. The stored value
            is saturate(x / scale) rounded to nearest even, x the float32 rotated value, so
            the row is rounded once.
        q_weight, k_weight, eps, weight_offset: the fused QK-norm of rms_norm_rotary_qk,
            applied to q and k before the rotation (both weights or neither). With a float8
            k cache, x is k's row normed and rotated as float32 rows are.
        inplace: rotate q in place and return it; else into a new tensor.

    Returns:
        q rotated (and normed). Not differentiable: an inference op.

    Checks every argument before anything is written. On CPU, a slot >= num_blocks *
    block_size and a non-negative slot given to two tokens are errors too.
    """
    compiling = torch.compiler.is_compiling()
    table = _table_arg(freqs_cis, compiling)
    op = "rotary_kv_cache_update_" if inplace else "rotary_kv_cache_update"
    if _native_kv(q):
        if not compiling:
            out = _native.EAGER_ENTRIES[op](
                q, k, v, table, k_cache, v_cache, slots, positions, offset, seq_dim,
                interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
                weight_offset)
            if out is not NotImplemented:
                return q if inplace else out
        tail = (positions, offset, seq_dim, interleaved, cache_layout, k_scale, v_scale,
                q_weight, k_weight, eps, weight_offset)
        last = len(tail)
        while last > 0 and _is_default(tail[last - 1], KV_TAIL_DEFAULTS[last - 1]):
            last -= 1
        out = _native.op(op)(q, k, v, table, k_cache, v_cache, slots, *tail[:last])
        return q if inplace else out
    return _composed(op, q, k, v, table, k_cache, v_cache, slots, positions, offset, seq_dim,
                     interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
                     weight_offset, inplace, compiling)


def _composed(op, q, k, v, table, k_cache, v_cache, slots, positions, offset, seq_dim,
              interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
              weight_offset, inplace, compiling) -> torch.Tensor:
    """The fused op as a composition, where no native kernel serves the device: the rotation
    ops (native where they are), then an indexed write of the rows."""
    heads_dim = _checks.check_kv_cache_args(
        op, q, k, v, table, k_cache, v_cache, slots, positions, offset, seq_dim, cache_layout,
        k_scale, v_scale, q_weight, k_weight, eps, inplace)
    hnd = cache_layout == "HND"
    block_size = k_cache.shape[2 if hnd else 1]
    lead = k.shape[:-1]
    token_slots = slots.expand(lead).select(heads_dim, 0).reshape(-1)
    if not compiling:
        if positions is not None and positions.numel() > 0:
            _checks.check_positions_in_range(op, positions, offset, table.shape[0])
        _checks.check_slots_in_range(op, token_slots, k_cache.shape[0] * block_size)
    kwargs = dict(positions=positions, offset=offset, seq_dim=seq_dim, interleaved=interleaved)
    k_float8 = k_cache.dtype in _FLOAT8_MAX
    # k is never written: q and k rotate out of place, and q is copied back for inplace.
    if q_weight is None:
        q_out, k_rows = apply_rotary_qk(q, k, table, **kwargs)
        if k_float8:  # the float32 rows, rounded once into the cache
            k_rows = apply_rotary(k.float(), table, **kwargs)
    else:
        norm = dict(eps=eps, weight_offset=weight_offset, **kwargs)
        q_out, k_rows = rms_norm_rotary_qk(q, k, q_weight, k_weight, table, **norm)
        if k_float8:
            _, k_rows = rms_norm_rotary_qk(q, k.float(), q_weight, k_weight.float(), table,
                                           **norm)
    if inplace:
        q_out = q.copy_(q_out)
    keep = token_slots >= 0
    where = token_slots[keep]
    block, index = where // block_size, where % block_size
    for rows, cache, scale in ((k_rows, k_cache, k_scale), (v, v_cache, v_scale)):
        values = rows.movedim(heads_dim, -2).reshape(-1, rows.shape[heads_dim], rows.shape[-1])
        values = values[keep]
        if cache.dtype in _FLOAT8_MAX:
            limit = _FLOAT8_MAX[cache.dtype]
            values = (values.float() / scale.reshape(-1, 1)).clamp(-limit, limit)
        if hnd:
            cache[block, :, index] = values.to(cache.dtype)
        else:
            cache[block, index] = values.to(cache.dtype)
    return q_out


def static_cache_slots(positions: torch.Tensor, max_len: int, *, seq_dim: int = 1
                       ) -> torch.Tensor:
    """The slots of a static cache [B, H_kv, max_len, D] (cache_layout="HND", num_blocks = B,
    block_size = max_len) for tokens at `positions` [B, S]: b * max_len + positions[b, s],
    shaped [B, S, 1] for q, k, v [B, S, H, D] (seq_dim=1) or [B, 1, S] for [B, H, S, D]
    (seq_dim=2)."""
    if positions.dim() != 2:
        raise ValueError(f"static_cache_slots: positions must be [B, S], got shape "
                         f"{list(positions.shape)}")
    if seq_dim not in (1, 2):
        raise ValueError(f"static_cache_slots: seq_dim must be 1 ([B, S, H, D]) or 2 "
                         f"([B, H, S, D]), got {seq_dim}")
    batch = torch.arange(positions.shape[0], device=positions.device,
                         dtype=positions.dtype).unsqueeze(1)
    slots = batch * max_len + positions
    return slots.unsqueeze(-1) if seq_dim == 1 else slots.unsqueeze(1)


__all__ = ["rotary_kv_cache_update", "static_cache_slots"]
