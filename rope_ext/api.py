"""The public functions: thin, typed wrappers over torch.ops.rope_ext, falling back to the
eager path (rope_ext.reference) where no native kernel serves the tensors' device."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from . import _checks, _native, reference


def _real_table(freqs_cis: torch.Tensor) -> torch.Tensor:
    """The real view [P, R/2, 2] (cos, sin) of a complex table."""
    return torch.view_as_real(freqs_cis) if freqs_cis.is_complex() else freqs_cis


def _table_arg(freqs_cis: torch.Tensor, compiling: bool) -> torch.Tensor:
    """The table as the ops get it: as given in eager mode (the ops read a complex table
    through its real view themselves; a Python view_as_real costs ~1 us a call), the real view
    under torch.compile (`compiling`: Inductor cannot reinplace a mutating custom op with a
    complex input: "auto_functionalized_v2 was not removed")."""
    if compiling and freqs_cis.is_complex():
        return torch.view_as_real(freqs_cis)
    return freqs_cis


# The rotation ops' arguments after offset at their schema defaults: seq_dim, interleaved,
# inverse, mrope_section, mrope_interleaved (tests/test_apply.py reads them back from the
# schemas). A boxed torch.ops call converts each argument it is passed, ~0.1-0.4 us apiece,
# so the wrappers leave off a tail of defaults.
ROTARY_TAIL_DEFAULTS = (1, True, False, None, False)


def _op_args(head: tuple, tail: tuple, defaults: tuple, keep: int) -> tuple:
    """head + tail, less a tail of the schema's defaults: none of tail when it is all
    defaults, its first `keep` entries when only those differ (the common calls: rope_ext.hf
    passes seq_dim and interleaved), else all of it."""
    if tail == defaults:
        return head
    if tail[keep:] == defaults[keep:]:
        return head + tail[:keep]
    return head + tail


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether t is a DTensor; costs nothing where DTensor was never imported."""
    if type(t) is torch.Tensor:
        return False
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _dtensor_inputs(op, xs, table, positions, offset, seq_dim, mrope_section):
    """table, positions for a call whose inputs may be DTensors (rope_ext.distributed): as
    given for plain tensors."""
    if not is_dtensor(xs[0]):
        return table, positions
    from . import distributed

    return distributed.prepare(op, xs, _real_table(table), positions, offset, seq_dim,
                               mrope_section)


def native_available() -> bool:
    """True when the compiled kernels are loaded (see `python -m rope_ext` for which)."""
    return bool(_native.NATIVE_DEVICES)


# Keys of a transformers rope_parameters / rope_scaling dict that the native op takes.
_SCALING_KEYS = (
    "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
    "long_factor", "short_factor", "partial_rotary_factor",
)


def scaling_arguments(
    rope_scaling: dict | None,
    theta: float,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[float, dict]:
    """theta and the op's keyword arguments for a transformers rope dict.

    Accepts transformers 5 `config.rope_parameters` (rope_type, rope_theta, ...) and 4.x
    `config.rope_scaling` (rope_type or type, ...). Keys the table does not depend on
    (e.g. mrope_section) are ignored.
    """
    kwargs: dict = {}
    if rope_scaling:
        params = dict(rope_scaling)
        kwargs["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        theta = params.get("rope_theta") or theta
        for key in _SCALING_KEYS:
            value = params.get(key)
            if value is None:
                continue
            if key in ("long_factor", "short_factor"):
                value = [float(v) for v in value]
            elif key == "original_max_position_embeddings":
                value = int(value)
            elif key == "truncate":
                value = bool(value)
            else:
                value = float(value)
            kwargs[key] = value
    if max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = int(max_position_embeddings)
    if seq_len is not None:
        kwargs["seq_len"] = int(seq_len)
    return float(theta), kwargs


def precompute_freqs_cis(
    dim: int,
    end: int,
    theta: float = 10000.0,
    *,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """LLaMA's rotary table `polar(1, outer(arange(end), theta^(-2i/dim)))`, complex [end, dim//2].

    Angles are computed in float64 and rounded once, so every entry is within 1.2e-7 of the
    exact value for positions below 2**20. dtype float32 gives complex64, float64 complex128.

    rope_scaling: a transformers rope dict (`config.rope_parameters` in transformers 5,
        `config.rope_scaling` in 4.x) for default, linear, dynamic, yarn, longrope, llama3 or
        proportional RoPE; its rope_theta, when present, replaces theta. The attention factor
        (yarn, longrope) is the entries' magnitude. dim is the rotary dim, except for
        proportional, where it is the head dim and partial_rotary_factor picks the rotated part.
    max_position_embeddings, seq_len: the model's and the current length, for the variants
        that depend on them (dynamic, longrope; yarn without factor).
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    theta, scaling = scaling_arguments(rope_scaling, theta, max_position_embeddings, seq_len)
    _checks.check_precompute_args(dim, end, theta, dtype)
    op = torch.ops.rope_ext.precompute_freqs_cis.default if _native.LOADED else None
    if _native.supports(device):
        table = op(dim, end, theta, dtype=dtype, device=device, **scaling)
        return torch.view_as_complex(table)
    _native.warn_fallback(device)
    if op is not None:  # the native CPU kernel, then a copy to the device
        return torch.view_as_complex(op(dim, end, theta, dtype=dtype, **scaling)).to(device)
    if scaling.get("rope_type", "default") != "default":
        raise RuntimeError(
            f"precompute_freqs_cis: rope_type {scaling['rope_type']!r} needs the compiled "
            f"extension, which did not load ({_native.LOAD_ERROR})")
    return reference.precompute_freqs_cis(dim, end, theta, device=device, dtype=dtype)


def rope_frequencies(
    dim: int,
    theta: float = 10000.0,
    *,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """The float64 inverse frequencies [dim // 2] and attention factor behind the table."""
    theta, scaling = scaling_arguments(rope_scaling, theta, max_position_embeddings, seq_len)
    return torch.ops.rope_ext.rope_frequencies.default(dim, theta, **scaling)


def _fallback_checks(op, tensors, names, table, positions, offset, seq_dim, inplace,
                     mrope_section, mrope_interleaved):
    """The checks the native op would make, in its order, for the eager path."""
    if len(tensors) == 2:
        _checks.check_qk_args(op, *tensors, table, positions, offset, seq_dim, mrope_section,
                              mrope_interleaved)
    else:
        (x,), (name,) = tensors, names
        _checks.check_apply_args(op, name, x, table, positions, offset, seq_dim, mrope_section,
                                 mrope_interleaved)
    if inplace:
        for t, name in zip(tensors, names):
            _checks.check_inplace_target(op, name, t)
        if len(tensors) == 2:
            _checks.check_qk_disjoint(op, *tensors)
    if positions is not None:
        _checks.check_positions_in_range(op, positions, offset, table.shape[0])


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
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> torch.Tensor:
    """Rotates the pairs of x's last dim by the angles in freqs_cis.

    Args:
        x: [..., head_dim], float16/bfloat16/float32/float64, any strides.
        freqs_cis: complex [P, R/2] or its real view [P, R/2, 2] (cos, sin), float32/64;
            R <= head_dim, features R.. pass through unchanged (partial rotary).
        positions: int32/int64, broadcastable to x.shape[:-1]; a row's position is
            offset + positions[...]. Without it, offset + the row's index along seq_dim.
        interleaved: pairs (2i, 2i+1) as LLaMA / GPT-J; False pairs (i, i + R/2) as GPT-NeoX
            and Hugging Face's rotate_half.
        inverse: rotate by the negative angle (undoes a rotation).
        inplace: write into x and return it.
        mrope_section: multi-axis RoPE (Qwen2-VL and later) with A = len(mrope_section)
            position axes: positions is then [A, *b] (*b broadcastable to x.shape[:-1]) and
            pair i turns by offset + positions[axis(i), ...], axis(i) the section holding i
            (the sections sum to R/2), e.g. [16, 24, 24] for (time, height, width).
        mrope_interleaved: Qwen3-VL's layout instead (A = 3): pair i takes height when
            i % 3 == 1 and i < 3 * section[1], width when i % 3 == 2 and i < 3 * section[2],
            time otherwise.
    """
    mrope_section = None if mrope_section is None else list(mrope_section)
    compiling = torch.compiler.is_compiling()  # ~0.15 us: asked once a call
    table = _table_arg(freqs_cis, compiling)
    if type(x) is not torch.Tensor:
        table, positions = _dtensor_inputs("apply_rotary_" if inplace else "apply_rotary", [x],
                                           table, positions, offset, seq_dim, mrope_section)
    if _native.serves(x):
        if not compiling:
            out = _native.EAGER_ENTRIES["apply_rotary_" if inplace else "apply_rotary"](
                x, table, positions, offset, seq_dim, interleaved, inverse, mrope_section,
                mrope_interleaved)
            if out is not NotImplemented:
                return x if inplace else out
        args = _op_args((table, positions, offset),
                        (seq_dim, interleaved, inverse, mrope_section, mrope_interleaved),
                        ROTARY_TAIL_DEFAULTS, 2)
        if inplace:
            _native.op("apply_rotary_")(x, *args)
            return x
        return _native.op("apply_rotary")(x, *args)
    op = "apply_rotary_" if inplace else "apply_rotary"
    _fallback_checks(op, (x,), ("x",), table, positions, offset, seq_dim, inplace,
                     mrope_section, mrope_interleaved)
    _native.warn_fallback(x.device)
    return reference.apply_rotary(
        x, table, positions=positions, offset=offset, seq_dim=seq_dim,
        interleaved=interleaved, inverse=inverse, inplace=inplace,
        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
    )


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs_cis: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offset: int = 0,
    seq_dim: int = 1,
    interleaved: bool = True,
    inverse: bool = False,
    inplace: bool = False,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q and k in one kernel launch; their head counts may differ (GQA).

    q and k must agree on head_dim; without positions also on their rank, dim 0 (batch) and
    seq_dim, while with positions each need only broadcast with them (seq_dim then plays no
    part). With inplace=True they must not overlap each other. DTensor q and k: see
    rope_ext.distributed. mrope_section / mrope_interleaved: as for apply_rotary.
    """
    mrope_section = None if mrope_section is None else list(mrope_section)
    compiling = torch.compiler.is_compiling()
    table = _table_arg(freqs_cis, compiling)
    if type(q) is not torch.Tensor:
        table, positions = _dtensor_inputs("apply_rotary_qk_" if inplace else "apply_rotary_qk",
                                           [q, k], table, positions, offset, seq_dim,
                                           mrope_section)
    if _native.serves(q):
        if not compiling:
            out = _native.EAGER_ENTRIES["apply_rotary_qk_" if inplace else "apply_rotary_qk"](
                q, k, table, positions, offset, seq_dim, interleaved, inverse, mrope_section,
                mrope_interleaved)
            if out is not NotImplemented:
                return (q, k) if inplace else out
        args = _op_args((table, positions, offset),
                        (seq_dim, interleaved, inverse, mrope_section, mrope_interleaved),
                        ROTARY_TAIL_DEFAULTS, 2)
        if inplace:
            _native.op("apply_rotary_qk_")(q, k, *args)
            return q, k
        return _native.op("apply_rotary_qk")(q, k, *args)
    op = "apply_rotary_qk_" if inplace else "apply_rotary_qk"
    _fallback_checks(op, (q, k), ("q", "k"), table, positions, offset, seq_dim, inplace,
                     mrope_section, mrope_interleaved)
    _native.warn_fallback(q.device)
    kwargs = dict(positions=positions, offset=offset, seq_dim=seq_dim,
                  interleaved=interleaved, inverse=inverse, inplace=inplace,
                  mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    return reference.apply_rotary(q, table, **kwargs), reference.apply_rotary(k, table, **kwargs)


def positions_from_cu_seqlens(
    cu_seqlens: torch.Tensor, total_tokens: int | None = None
) -> torch.Tensor:
    """Per-token positions [T, 1] of a packed batch, from flash-attn's cu_seqlens.

    cu_seqlens: int32/int64 [num_seqs + 1], 0 first, cumulative sequence lengths. Pass
    total_tokens (cu_seqlens[-1]) to avoid reading it back from the device. The result
    broadcasts against packed q and k [T, heads, head_dim] (`seq_dim=0`).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"positions_from_cu_seqlens: cu_seqlens must be 1-D with at least one "
                         f"entry, got shape {list(cu_seqlens.shape)}")
    total = int(cu_seqlens[-1]) if total_tokens is None else total_tokens
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return (tokens - cu_seqlens[sequence]).unsqueeze(-1)


def mrope_positions(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    video_time_interval: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MRoPE positions [3, *mm_token_type_ids.shape] (time, height, width) of text + image +
    video sequences, as transformers' get_rope_index of Qwen2-VL, Qwen2.5-VL and Qwen3-VL lays
    them out, for `positions=` with `mrope_section`.

    mm_token_type_ids: [T] or [B, T], 0 text, 1 image, 2 video, one entry per token (no
        padding; pass each sequence of a padded batch alone). Text tokens count up on all three
        axes; a vision block of grid (t, h, w) patches (merged spatial_merge_size^2 to a token)
        takes time start + frame * video_time_interval (images: start), height start + row,
        width start + column, and the text after it continues from start + max(h, w) /
        spatial_merge_size.
    image_grid_thw, video_grid_thw: [N, 3] grids of the images and videos in token order.

    Returns the positions and, per sequence, max position + 1 - length (transformers'
    rope_deltas: decode step positions are length + delta).
    """
    shape = mm_token_type_ids.shape
    # Not reshape(-1, S): with S = 0 the -1 is ambiguous.
    types = mm_token_type_ids.reshape(shape[:-1].numel(), shape[-1]).tolist()
    grids = {1: iter([] if image_grid_thw is None else image_grid_thw.tolist()),
             2: iter([] if video_grid_thw is None else video_grid_thw.tolist())}
    out, deltas = [], []
    for sequence in types:
        parts, start, i = [], 0, 0
        while i < len(sequence):
            kind, j = sequence[i], i
            while j < len(sequence) and sequence[j] == kind:
                j += 1
            if kind == 0:
                parts.append(torch.arange(start, start + j - i).expand(3, -1))
                start += j - i
            else:
                thw = next(grids[kind])  # the grid as given, for the message
                t, h, w = thw[0], thw[1] // spatial_merge_size, thw[2] // spatial_merge_size
                interval = video_time_interval if kind == 2 else 1.0
                frames = (torch.arange(t) * interval).long()
                grid = torch.stack(torch.meshgrid(frames, torch.arange(h), torch.arange(w),
                                                  indexing="ij")).reshape(3, -1) + start
                if grid.shape[1] != j - i:
                    raise ValueError(f"mrope_positions: a vision block of {j - i} tokens at "
                                     f"token {i} does not match its grid {thw} "
                                     f"({grid.shape[1]} tokens after the spatial merge)")
                parts.append(grid)
                start += max(h, w)
            i = j
        positions = torch.cat(parts, 1) if parts else torch.zeros(3, 0, dtype=torch.long)
        out.append(positions)
        deltas.append(int(positions.max()) + 1 - len(sequence) if sequence else 0)
    positions = torch.stack(out, 1).view(3, *mm_token_type_ids.shape)
    return positions.to(mm_token_type_ids.device), torch.tensor(deltas)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for LLaMA's apply_rotary_emb.

    xq, xk: [B, S, H, D] or [B, S, D]; freqs_cis: at least S rows, row s rotating sequence
    index s; interleaved pairs; outputs in the inputs' dtypes.
    """
    return apply_rotary_qk(xq, xk, freqs_cis, seq_dim=1, interleaved=True)
