"""Argument checks, word for word those of csrc/rope_checks.cpp.

The fake kernels (torch.compile) and the eager fallback both run them, so a bad call fails the
same way on every path.
"""

from __future__ import annotations

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


def check_apply_args(
    op: str,
    name: str,
    x: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor | None,
    offset,
    seq_dim: int,
) -> int:
    """Returns seq_dim normalised to [0, x.dim() - 2], or -1 when positions are given
    (they define every row's position; seq_dim then plays no part)."""
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
        broadcastable = positions.dim() <= len(lead) and all(
            positions.shape[-d] == 1 or positions.shape[-d] == lead[-d]
            for d in range(1, positions.dim() + 1)
        )
        _check(
        ValueError,
            broadcastable,
            lambda: f"{op}: positions of shape {list(positions.shape)} is not broadcastable "
            f"to {name}.shape[:-1] = {lead}",
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


def check_qk_args(op, q, k, table, positions, offset, seq_dim) -> int:
    sd = check_apply_args(op, "q", q, table, positions, offset, seq_dim)
    check_apply_args(op, "k", k, table, positions, offset, seq_dim)
    check_qk_pair(op, q, k, sd)
    return sd


def check_inplace_target(op: str, name: str, x: torch.Tensor) -> None:
    for d in range(x.dim()):
        _check(
        ValueError,
            x.stride(d) != 0 or x.shape[d] <= 1,
            lambda d=d: f"{op}: {name} has overlapping memory (dim {d} of size {x.shape[d]} has "
            "stride 0, e.g. from expand); an in-place call needs distinct elements, use the "
            "out-of-place op",
        )


def check_qk_disjoint(op: str, q: torch.Tensor, k: torch.Tensor) -> None:
    if (
        q.numel() == 0
        or k.numel() == 0
        or not torch._C._is_alias_of(q, k)
        or not _dense(q)
        or not _dense(k)
    ):
        return
    q_begin, k_begin = q.storage_offset(), k.storage_offset()
    overlap = q_begin < k_begin + k.numel() and k_begin < q_begin + q.numel()
    _check(
        ValueError,
        not overlap,
        lambda: f"{op}: q and k overlap in memory; an in-place call needs them disjoint",
    )


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
