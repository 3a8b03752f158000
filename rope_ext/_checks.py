"""Argument checks, word for word those of csrc/rope_checks.cpp.

The fake kernels (torch.compile) and the eager fallback both run them, so a bad call fails the
same way on every path.
"""

from __future__ import annotations

import math

import torch

try:  # torch >= 2.10: decides without guarding on symbolic sizes (False when undecidable)
    from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense
except ImportError:
    def _dense(t: torch.Tensor) -> bool:
        """Whether t's elements fill one block of memory exactly once, in some dim order."""
        expected = 1
        for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1),
                                   key=lambda d: d[1]):
            if stride != expected:
                return False
            expected *= size
        return True


def _check(error: type[Exception], cond, message) -> None:
    """Raises error(message()) unless cond. A plain bool is tested in Python, which dynamo
    traces on every supported torch (before 2.13 it cannot trace torch._check_type with a
    message callable); a symbolic condition goes to torch._check_with, which keeps symbolic
    sizes symbolic (a runtime assert rather than a guard)."""
    if isinstance(cond, bool):
        if not cond:
            raise error(message())
        return
    torch._check_with(error, cond, message)

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TABLE_DTYPES = (torch.float32, torch.float64)
POSITION_DTYPES = (torch.int32, torch.int64)
MAX_DIMS = 9  # kMaxDims leading dims (csrc/rope_math.h) and the feature dim

# c10's names, which the C++ messages print.
_C10_NAMES = {
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.float8_e4m3fn: "Float8_e4m3fn",
    torch.float8_e5m2: "Float8_e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype))


def _check_table(op: str, table: torch.Tensor) -> None:
    if table.is_complex():
        _check(
            TypeError,
            table.dtype in (torch.complex64, torch.complex128),
            lambda: f"{op}: freqs_cis must be complex64 or complex128 [P, R/2] (or its real "
            f"view, float32 or float64 [P, R/2, 2]), got {dtype_name(table.dtype)}",
        )
        _check(
            ValueError,
            table.dim() == 2,
            lambda: f"{op}: complex freqs_cis must have shape [P, R/2], got {list(table.shape)}",
        )
    else:
        _check(
            TypeError,
            table.dtype in TABLE_DTYPES,
            lambda: f"{op}: freqs_cis must be float32 or float64 (the real view [P, R/2, 2] of "
            f"the complex table) or complex64 or complex128 [P, R/2], got "
            f"{dtype_name(table.dtype)}",
        )
        _check(
            ValueError,
            table.dim() == 3 and table.shape[2] == 2,
            lambda: f"{op}: freqs_cis must have shape [P, R/2, 2] holding (cos, sin), "
            f"got {list(table.shape)}",
        )
    _check(
        ValueError,
        table.shape[1] > 0,
        lambda: f"{op}: freqs_cis must hold at least one rotary pair, got shape "
        f"{list(table.shape)}",
    )


MAX_MROPE_AXES = 4  # kMaxMropeAxes (csrc/rope_math.h)


def _check_mrope(op, table, positions, mrope_section, mrope_interleaved) -> None:
    """The MRoPE arguments: sections, and positions with a leading dim of one per axis."""
    if mrope_section is None:
        _check(
            ValueError,
            not mrope_interleaved,
            lambda: f"{op}: mrope_interleaved=True needs mrope_section (3 section lengths)",
        )
        return
    section = list(mrope_section)
    axes = len(section)
    _check(
        ValueError,
        1 <= axes <= MAX_MROPE_AXES,
        lambda: f"{op}: mrope_section must hold 1 to {MAX_MROPE_AXES} section lengths, "
        f"got {axes}",
    )
    _check(
        ValueError,
        all(n >= 0 for n in section),
        lambda: f"{op}: mrope_section lengths must be >= 0, got {section}",
    )
    pairs = table.shape[1]
    total = sum(section)
    if mrope_interleaved:
        _check(
            ValueError,
            axes == 3,
            lambda: f"{op}: mrope_interleaved=True needs 3 sections (time, height, width), "
            f"got {axes}",
        )
        _check(
            ValueError,
            total <= pairs,
            lambda: f"{op}: mrope_section {section} sums to {total}, more than the R/2 = "
            f"{pairs} pairs of freqs_cis",
        )
    else:
        _check(
            ValueError,
            total == pairs,
            lambda: f"{op}: mrope_section {section} must sum to R/2 = {pairs} "
            f"(freqs_cis.shape[1]), got {total}",
        )
    _check(
        ValueError,
        positions is not None,
        lambda: f"{op}: mrope_section needs positions of shape [{axes}, ...] (one position "
        "per axis), got none",
    )
    _check(
        ValueError,
        positions.dim() >= 1 and positions.shape[0] == axes,
        lambda: f"{op}: positions must have a leading dim of len(mrope_section) = {axes}, "
        f"got shape {list(positions.shape)}",
    )


def check_apply_args(
    op: str,
    name: str,
    x: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor | None,
    offset,
    seq_dim: int,
    mrope_section,
    mrope_interleaved: bool,
) -> int:
    """Returns seq_dim normalised to [0, x.dim() - 2], or -1 when positions are given
    (they define every row's position; seq_dim then plays no part). With mrope_section,
    positions is [A, *b], *b broadcasting to x.shape[:-1]."""
    _check(
        TypeError,
        x.dtype in X_DTYPES,
        lambda: f"{op}: {name} must be a float16, bfloat16, float32 or float64 tensor, "
        f"got {dtype_name(x.dtype)}",
    )
    _check(
        ValueError,
        x.dim() >= 2,
        lambda: f"{op}: {name} must have at least 2 dims (a sequence dim and head_dim), "
        f"got {x.dim()}",
    )
    _check(
        ValueError,
        x.dim() <= MAX_DIMS,
        lambda: f"{op}: {name} must have at most {MAX_DIMS} dims, got {x.dim()}",
    )
    _check_table(op, table)
    _check(
        ValueError,
        table.device == x.device,
        lambda: f"{op}: freqs_cis is on {table.device} but {name} is on {x.device}",
    )
    ndim = x.dim()
    sd = -1 if positions is not None else seq_dim + ndim if seq_dim < 0 else seq_dim
    _check(
        ValueError,
        positions is not None or 0 <= sd <= ndim - 2,
        lambda: f"{op}: seq_dim must name a dim of {name} other than the last, in "
        f"[{-ndim}, -2] or [0, {ndim - 2}], got {seq_dim}",
    )
    rotary_dim = 2 * table.shape[1]
    _check(
        ValueError,
        rotary_dim <= x.shape[-1],
        lambda: f"{op}: rotary dim 2 * freqs_cis.shape[1] = {rotary_dim} exceeds {name}'s "
        f"head_dim {x.shape[-1]}",
    )
    _check(ValueError, offset >= 0, lambda: f"{op}: offset must be >= 0, got {offset}")
    _check_mrope(op, table, positions, mrope_section, mrope_interleaved)
    if positions is not None:
        _check(
        TypeError,
            positions.dtype in POSITION_DTYPES,
            lambda: f"{op}: positions must be an int32 or int64 tensor, got "
            f"{dtype_name(positions.dtype)}",
        )
        _check(
        ValueError,
            positions.device == x.device,
            lambda: f"{op}: positions is on {positions.device} but {name} is on {x.device}",
        )
        lead = list(x.shape[:-1])
        # With MRoPE the leading dim holds the axes; the rest broadcasts.
        rows = list(positions.shape[1:] if mrope_section is not None else positions.shape)
        broadcastable = len(rows) <= len(lead) and all(
            rows[-d] == 1 or rows[-d] == lead[-d] for d in range(1, len(rows) + 1)
        )
        after_axes = " (after its leading axis dim)" if mrope_section is not None else ""
        _check(
        ValueError,
            broadcastable,
            lambda: f"{op}: positions of shape {list(positions.shape)}{after_axes} is not "
            f"broadcastable to {name}.shape[:-1] = {lead}",
        )
    else:
        _check(
        ValueError,
            offset + x.shape[sd] <= table.shape[0],
            lambda: f"{op}: offset + {name}.shape[seq_dim] = {offset} + {x.shape[sd]} exceeds "
            f"the {table.shape[0]} rows of freqs_cis",
        )
    return sd


def check_qk_pair(op: str, q: torch.Tensor, k: torch.Tensor, seq_dim: int) -> None:
    """seq_dim as check_apply_args returns it: -1 when positions are given."""
    _check(
        ValueError,
        q.shape[-1] == k.shape[-1],
        lambda: f"{op}: q and k must have the same head_dim, got {q.shape[-1]} and "
        f"{k.shape[-1]}",
    )
    if seq_dim < 0:
        return  # positions given: each of q and k only has to broadcast with them
    _check(
        ValueError,
        q.dim() == k.dim(),
        lambda: f"{op}: q and k must have the same number of dims, got {q.dim()} and {k.dim()}",
    )
    for d in (0, seq_dim):
        _check(
        ValueError,
            q.shape[d] == k.shape[d],
            lambda d=d: f"{op}: q and k must agree on dim {d} (batch and seq_dim; only head counts "
            f"may differ), got {q.shape[d]} and {k.shape[d]}",
        )


def check_qk_args(op, q, k, table, positions, offset, seq_dim, mrope_section=None,
                  mrope_interleaved=False) -> int:
    sd = check_apply_args(op, "q", q, table, positions, offset, seq_dim, mrope_section,
                          mrope_interleaved)
    check_apply_args(op, "k", k, table, positions, offset, seq_dim, mrope_section,
                     mrope_interleaved)
    check_qk_pair(op, q, k, sd)
    return sd


def check_norm_weight(op: str, name: str, weight: torch.Tensor, x_name: str,
                      x: torch.Tensor) -> None:
    """The norm weight of a fused RMSNorm + RoPE call: [head_dim] of x, float32 or x's dtype,
    on x's device."""
    _check(
        TypeError,
        weight.dtype in (torch.float32, x.dtype),
        lambda: f"{op}: {name} must be float32 or {x_name}'s dtype {dtype_name(x.dtype)}, got "
        f"{dtype_name(weight.dtype)}",
    )
    _check(
        ValueError,
        weight.dim() == 1 and weight.shape[0] == x.shape[-1],
        lambda: f"{op}: {name} must have shape [{x.shape[-1]}] (the head_dim of {x_name}), got "
        f"{list(weight.shape)}",
    )
    _check(
        ValueError,
        weight.device == x.device,
        lambda: f"{op}: {name} is on {weight.device} but {x_name} is on {x.device}",
    )


def check_norm_eps(op: str, eps: float) -> None:
    _check(
        ValueError,
        eps > 0 and math.isfinite(eps),
        lambda: f"{op}: eps must be a positive finite number, got {eps:g}",
    )


def check_norm_grads(op: str, grad_q, grad_k, q, k) -> None:
    """The incoming gradients of rms_norm_rotary_qk_backward: q's and k's shapes and dtypes."""
    _check(
        ValueError,
        grad_q.shape == q.shape and grad_k.shape == k.shape,
        lambda: f"{op}: grad_q and grad_k must have the shapes of q and k, {list(q.shape)} and "
        f"{list(k.shape)}, got {list(grad_q.shape)} and {list(grad_k.shape)}",
    )
    _check(
        TypeError,
        grad_q.dtype == q.dtype and grad_k.dtype == k.dtype,
        lambda: f"{op}: grad_q and grad_k must have the dtypes of q and k, "
        f"{dtype_name(q.dtype)} and {dtype_name(k.dtype)}, got {dtype_name(grad_q.dtype)} and "
        f"{dtype_name(grad_k.dtype)}",
    )


def check_norm_args(op, q, k, q_weight, k_weight, table, positions, offset, seq_dim, eps,
                    mrope_section, mrope_interleaved) -> int:
    """The checks of the fused RMSNorm + RoPE ops, in csrc/qk_norm_ops.h's order."""
    sd = check_qk_args(op, q, k, table, positions, offset, seq_dim, mrope_section,
                       mrope_interleaved)
    check_norm_weight(op, "q_weight", q_weight, "q", q)
    check_norm_weight(op, "k_weight", k_weight, "k", k)
    check_norm_eps(op, eps)
    return sd


# Overlap questions answered "cannot prove" after this many steps (csrc/rope_checks.cpp).
_OVERLAP_BUDGET = 100000


class _Layout:
    """Where a strided tensor's elements lie, in bytes from its first element: its dims of
    size > 1 and nonzero stride, largest stride first (csrc/rope_checks.cpp's Layout)."""

    def __init__(self, t: torch.Tensor):
        width = t.element_size()
        dims = sorted(((t.stride(d) * width, t.shape[d]) for d in range(t.dim())
                       if t.shape[d] > 1 and t.stride(d) != 0), reverse=True)
        self.n = len(dims)
        self.strides = [s for s, _ in dims]
        self.sizes = [n for _, n in dims]
        self.spans = [0] * self.n + [width]
        for d in range(self.n - 1, -1, -1):
            self.spans[d] = self.spans[d + 1] + (self.sizes[d] - 1) * self.strides[d]


def _may_overlap(a: _Layout, da: int, b: _Layout, db: int, delta: int, budget: list) -> bool:
    """Whether an element of a (dims da..) and one of b (dims db..), b's first element delta
    bytes after a's, share a byte; True once the budget is spent (see the C++ twin)."""
    budget[0] -= 1
    if budget[0] < 0:
        return True
    if delta >= a.spans[da] or -delta >= b.spans[db]:
        return False
    if da == a.n and db == b.n:
        return True
    sa = a.strides[da] if da < a.n else -1
    sb = b.strides[db] if db < b.n else -1
    if sa == sb and sa > 0:
        lo = max(-(a.sizes[da] - 1), (-b.spans[db + 1] - delta) // sa + 1)
        hi = min(b.sizes[db] - 1, (a.spans[da + 1] - delta - 1) // sa)
        return any(_may_overlap(a, da + 1, b, db + 1, delta + t * sa, budget)
                   for t in range(lo, hi + 1))
    if sa > sb:
        lo = max(0, (delta - a.spans[da + 1]) // sa + 1)
        hi = min(a.sizes[da] - 1, (delta + b.spans[db] - 1) // sa)
        return any(_may_overlap(a, da + 1, b, db, delta - i * sa, budget)
                   for i in range(lo, hi + 1))
    lo = max(0, (-b.spans[db + 1] - delta) // sb + 1)
    hi = min(b.sizes[db] - 1, (a.spans[da] - delta - 1) // sb)
    return any(_may_overlap(a, da, b, db + 1, delta + j * sb, budget)
               for j in range(lo, hi + 1))


def _internal_overlap(a: _Layout, d: int, budget: list) -> bool:
    if d == a.n:
        return False
    if _internal_overlap(a, d + 1, budget):
        return True
    t = 1
    while t < a.sizes[d] and t * a.strides[d] < a.spans[d + 1]:
        if _may_overlap(a, d + 1, a, d + 1, t * a.strides[d], budget):
            return True
        t += 1
    return False


def _concrete(*tensors: torch.Tensor) -> bool:
    """Whether the layouts are plain ints (not symbolic sizes of a dynamic-shape trace, where
    the exact overlap questions are left to the op at run time)."""
    return all(isinstance(v, int) for t in tensors
               for v in (*t.shape, *t.stride(), t.storage_offset()))


def _describe(t: torch.Tensor) -> str:
    return f"sizes {list(t.shape)}, strides {list(t.stride())}"


def check_inplace_target(op: str, name: str, x: torch.Tensor,
                         needs: str = "an in-place call needs",
                         fix: str = "use the out-of-place op") -> None:
    for d in range(x.dim()):
        _check(
            ValueError,
            x.stride(d) != 0 or x.shape[d] <= 1,
            lambda d=d: f"{op}: {name} has overlapping memory (dim {d} of size {x.shape[d]} has "
            f"stride 0, e.g. from expand); {needs} distinct elements, {fix}",
        )
    if x.numel() == 0 or not _concrete(x):
        return
    budget = [_OVERLAP_BUDGET]
    overlap = _internal_overlap(_Layout(x), 0, budget)
    _check(
        ValueError,
        budget[0] >= 0,
        lambda: f"{op}: cannot prove that the elements of {name} are distinct ({_describe(x)}); "
        f"{needs} that: make it contiguous or {fix}",
    )
    _check(
        ValueError,
        not overlap,
        lambda: f"{op}: {name} has overlapping memory ({_describe(x)}: two of its elements "
        f"share memory); {needs} distinct elements, {fix}",
    )


def check_disjoint(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor,
                   needs: str, fix: str) -> None:
    """a and b share no memory (csrc/rope_checks.cpp's check_disjoint)."""
    if a.numel() == 0 or b.numel() == 0 or not torch._C._is_alias_of(a, b):
        return
    if not _concrete(a, b):  # a dynamic-shape trace: the dense case, the op checks the rest
        if _dense(a) and _dense(b):
            a_begin = a.storage_offset() * a.element_size()
            b_begin = b.storage_offset() * b.element_size()
            _check(
                ValueError,
                not (a_begin < b_begin + b.numel() * b.element_size()
                     and b_begin < a_begin + a.numel() * a.element_size()),
                lambda: f"{op}: {a_name} and {b_name} overlap in memory; {needs} them disjoint",
            )
        return
    delta = b.storage_offset() * b.element_size() - a.storage_offset() * a.element_size()
    budget = [_OVERLAP_BUDGET]
    overlap = _may_overlap(_Layout(a), 0, _Layout(b), 0, delta, budget)
    _check(
        ValueError,
        budget[0] >= 0,
        lambda: f"{op}: cannot prove that {a_name} and {b_name} are disjoint in memory "
        f"({a_name}: {_describe(a)}; {b_name}: {_describe(b)}); {needs} that: make them "
        f"contiguous or {fix}",
    )
    _check(
        ValueError,
        not overlap,
        lambda: f"{op}: {a_name} and {b_name} overlap in memory; {needs} them disjoint",
    )


def check_qk_disjoint(op: str, q: torch.Tensor, k: torch.Tensor) -> None:
    check_disjoint(op, "q", q, "k", k, "an in-place call needs", "use the out-of-place op")


def check_positions_in_range(op: str, positions: torch.Tensor, offset: int, rows: int) -> None:
    """The value check the CPU kernel makes before writing (the fallback path runs it too)."""
    if positions.numel() == 0:
        return
    first = int(positions.min()) + offset
    last = int(positions.max()) + offset
    if not (first >= 0 and last < rows):
        raise IndexError(
            f"{op}: offset + positions must lie in [0, {rows}) (the rows of freqs_cis), "
            f"got values in [{first}, {last}]"
        )


def check_precompute_args(dim: int, end: int, theta: float, dtype: torch.dtype) -> None:
    """The checks precompute_freqs_cis makes before the scaling parameters' own."""
    op = "precompute_freqs_cis"
    _check(
        TypeError,
        dtype in TABLE_DTYPES,
        lambda: f"{op}: dtype must be float32 or float64, got {dtype_name(dtype)}",
    )
    _check(ValueError, dim >= 2, lambda: f"{op}: dim must be >= 2, got {dim}")
    _check(ValueError, end >= 0, lambda: f"{op}: end must be >= 0, got {end}")
    _check(ValueError, theta > 0, lambda: f"{op}: theta must be > 0, got {theta:g}")


def check_freqs_table(out: torch.Tensor, inv_freq: torch.Tensor) -> None:
    op = "fill_freqs_cis_"
    _check(
        TypeError,
        out.dtype in TABLE_DTYPES,
        lambda: f"{op}: out must be float32 or float64, got {dtype_name(out.dtype)}",
    )
    _check(
        TypeError,
        inv_freq.dtype == torch.float64,
        lambda: f"{op}: inv_freq must be float64, got {dtype_name(inv_freq.dtype)}",
    )
    _check(
        ValueError,
        inv_freq.dim() == 1,
        lambda: f"{op}: inv_freq must be 1-D, got shape {list(inv_freq.shape)}",
    )
    _check(
        ValueError,
        out.dim() == 3 and out.shape[1] == inv_freq.shape[0] and out.shape[2] == 2,
        lambda: f"{op}: out must have shape [end, inv_freq.shape[0], 2] = "
        f"[end, {inv_freq.shape[0]}, 2], got {list(out.shape)}",
    )
    _check(
        ValueError,
        inv_freq.device == out.device,
        lambda: f"{op}: inv_freq is on {inv_freq.device} but out is on {out.device}",
    )


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _per_token(sizes, lead, heads_dim: int) -> bool:
    """Whether a tensor of `sizes` broadcasts to k's leading dims `lead` with size 1 (or no
    dim) at heads_dim: one value per token."""
    if len(sizes) > len(lead):
        return False
    for i in range(1, len(sizes) + 1):
        d = len(lead) - i
        if not (sizes[-i] == 1 or (sizes[-i] == lead[d] and d != heads_dim)):
            return False
    return True


def _check_cache(op, name, cache, hnd, q, x, x_name, heads, scale, scale_name) -> None:
    layout = "H_kv, block_size" if hnd else "block_size, H_kv"
    _check(
        ValueError,
        cache.dim() == 4,
        lambda: f"{op}: {name} must have 4 dims, [num_blocks, {layout}, head_dim] for "
        f"cache_layout=\"{'HND' if hnd else 'NHD'}\", got shape {list(cache.shape)}",
    )
    _check(ValueError, cache.device == q.device,
           lambda: f"{op}: {name} is on {cache.device} but q is on {q.device}")
    _check(
        TypeError,
        cache.dtype == q.dtype or cache.dtype in FLOAT8_DTYPES,
        lambda: f"{op}: {name} must have q's dtype ({dtype_name(q.dtype)}) or be float8_e4m3fn "
        f"or float8_e5m2, got {dtype_name(cache.dtype)}",
    )
    head_dim = 1 if hnd else 2
    _check(
        ValueError,
        cache.shape[head_dim] == heads,
        lambda: f"{op}: {name} holds {cache.shape[head_dim]} heads (dim {head_dim}) but "
        f"{x_name} has {heads}",
    )
    _check(
        ValueError,
        cache.shape[3] == x.shape[-1],
        lambda: f"{op}: {name}'s head_dim {cache.shape[3]} differs from {x_name}'s "
        f"{x.shape[-1]}",
    )
    _check(
        ValueError,
        cache.stride(3) == 1 or cache.shape[3] <= 1,
        lambda: f"{op}: {name} must have contiguous features (stride 1 along head_dim), got "
        f"strides {list(cache.stride())}",
    )
    if cache.dtype not in FLOAT8_DTYPES:
        _check(
            ValueError,
            scale is None,
            lambda: f"{op}: {scale_name} is only for float8 caches; {name} is "
            f"{dtype_name(cache.dtype)}",
        )
        return
    _check(ValueError, scale is not None,
           lambda: f"{op}: a float8 {name} needs {scale_name} (float32, 1 value or one per head)")
    _check(TypeError, scale.dtype == torch.float32,
           lambda: f"{op}: {scale_name} must be float32, got {dtype_name(scale.dtype)}")
    _check(
        ValueError,
        scale.dim() <= 1 and (scale.numel() == 1 or scale.numel() == heads),
        lambda: f"{op}: {scale_name} must hold 1 value or one per head ({heads}), got shape "
        f"{list(scale.shape)}",
    )
    _check(ValueError, scale.device == q.device,
           lambda: f"{op}: {scale_name} is on {scale.device} but q is on {q.device}")


def check_kv_cache_args(op, q, k, v, table, k_cache, v_cache, slots, positions, offset,
                        seq_dim, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
                        inplace: bool) -> int:
    """The checks of the fused RoPE + KV-cache write, in csrc/kv_cache_ops.cpp's order.
    Returns the heads dim of q and k."""
    _check(
        ValueError,
        q.dim() in (3, 4),
        lambda: f"{op}: q must have 3 or 4 dims ([T, H, D], [B, S, H, D] or [B, H, S, D]), "
        f"got {q.dim()}",
    )
    ndim = q.dim()
    sd = seq_dim + ndim if seq_dim < 0 else seq_dim
    _check(
        ValueError,
        0 <= sd <= ndim - 2,
        lambda: f"{op}: seq_dim must name a dim of q other than the last, in [{-ndim}, -2] or "
        f"[0, {ndim - 2}], got {seq_dim}",
    )
    heads_dim = ndim - 3 if sd == ndim - 2 else ndim - 2
    check_qk_args(op, q, k, table, positions, offset, seq_dim)
    _check(
        TypeError,
        k.dtype == q.dtype and v.dtype == q.dtype,
        lambda: f"{op}: q, k and v must have one dtype, got {dtype_name(q.dtype)}, "
        f"{dtype_name(k.dtype)} and {dtype_name(v.dtype)}",
    )
    _check(
        ValueError,
        k.dim() == ndim and v.dim() == ndim,
        lambda: f"{op}: q, k and v must have the same number of dims, got {ndim}, {k.dim()} and "
        f"{v.dim()}",
    )
    for d in range(ndim):
        if d != heads_dim:
            _check(
                ValueError,
                q.shape[d] == k.shape[d],
                lambda: f"{op}: q and k must agree on every dim but the heads (dim {heads_dim}), "
                f"got shapes {list(q.shape)} and {list(k.shape)}",
            )
    for d in range(ndim - 1):
        _check(
            ValueError,
            v.shape[d] == k.shape[d],
            lambda: f"{op}: v must match k on every dim but head_dim, got shapes "
            f"{list(v.shape)} and {list(k.shape)}",
        )
    _check(ValueError, v.device == q.device,
           lambda: f"{op}: v is on {v.device} but q is on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(
            ValueError,
            t.stride(-1) == 1 or t.shape[-1] <= 1,
            lambda name=name, t=t: f"{op}: {name} must have contiguous features (stride 1 "
            f"along head_dim), got strides {list(t.stride())}",
        )
    _check(
        ValueError,
        cache_layout in ("NHD", "HND"),
        lambda: f"{op}: cache_layout must be \"NHD\" or \"HND\", got \"{cache_layout}\"",
    )
    hnd = cache_layout == "HND"
    heads = k.shape[heads_dim]
    _check_cache(op, "k_cache", k_cache, hnd, q, k, "k", heads, k_scale, "k_scale")
    _check_cache(op, "v_cache", v_cache, hnd, q, v, "v", heads, v_scale, "v_scale")
    block_dim = 2 if hnd else 1
    _check(
        ValueError,
        v_cache.shape[0] == k_cache.shape[0] and v_cache.shape[block_dim] == k_cache.shape[block_dim],
        lambda: f"{op}: k_cache and v_cache must have the same num_blocks and block_size, got "
        f"shapes {list(k_cache.shape)} and {list(v_cache.shape)}",
    )
    lead = list(k.shape[:-1])
    _check(
        TypeError,
        slots.dtype in POSITION_DTYPES,
        lambda: f"{op}: slots must be an int32 or int64 tensor, got {dtype_name(slots.dtype)}",
    )
    _check(ValueError, slots.device == q.device,
           lambda: f"{op}: slots is on {slots.device} but q is on {q.device}")
    _check(
        ValueError,
        _per_token(list(slots.shape), lead, heads_dim),
        lambda: f"{op}: slots of shape {list(slots.shape)} must broadcast to k.shape[:-1] = "
        f"{lead} with size 1 along the heads (dim {heads_dim}): one slot per token",
    )
    if positions is not None:
        _check(
            ValueError,
            _per_token(list(positions.shape), lead, heads_dim),
            lambda: f"{op}: positions of shape {list(positions.shape)} must broadcast to "
            f"k.shape[:-1] = {lead} with size 1 along the heads (dim {heads_dim}): one position "
            "per token",
        )
    _check(
        ValueError,
        (q_weight is None) == (k_weight is None),
        lambda: f"{op}: q_weight and k_weight go together (the fused QK-norm), got only "
        f"{'q_weight' if q_weight is not None else 'k_weight'}",
    )
    if q_weight is not None:
        check_norm_weight(op, "q_weight", q_weight, "q", q)
        check_norm_weight(op, "k_weight", k_weight, "k", k)
        check_norm_eps(op, eps)
    cache_needs, cache_fix = "the cache write needs", "pass caches whose elements are distinct"
    check_inplace_target(op, "k_cache", k_cache, cache_needs, cache_fix)
    check_inplace_target(op, "v_cache", v_cache, cache_needs, cache_fix)
    if inplace:
        check_inplace_target(op, "q", q)
    needs, fix = "the call needs", "pass tensors that do not share memory"
    check_disjoint(op, "k_cache", k_cache, "v_cache", v_cache, needs, fix)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_disjoint(op, name, t, "k_cache", k_cache, needs, fix)
        check_disjoint(op, name, t, "v_cache", v_cache, needs, fix)
    if inplace:
        check_disjoint(op, "q", q, "k", k, needs, fix)
        check_disjoint(op, "q", q, "v", v, needs, fix)
    return heads_dim


def check_slots_in_range(op: str, slots: torch.Tensor, num_slots: int) -> None:
    """The slots' values (the eager fallback's check; the CPU op makes its own): below
    num_blocks * block_size, and no non-negative slot twice."""
    flat = slots.reshape(-1).long()
    if flat.numel() == 0:
        return
    top = int(flat.max())
    _check(IndexError, top < num_slots,
           lambda: f"{op}: slots must be < num_blocks * block_size = {num_slots} (negative slots "
           f"write nothing), got {top}")
    used = flat[flat >= 0]
    unique, counts = torch.unique(used, return_counts=True)
    twice = unique[counts > 1]
    _check(ValueError, twice.numel() == 0,
           lambda: f"{op}: slot {int(twice[0])} is given to two tokens of one call; each token "
           "needs its own slot")
