"""Bad input: a clear error naming the argument, the same from the native op, its fake
kernel (torch.compile) and the eager fallback; nothing written by a rejected in-place call."""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import rope_ext
from rope_ext import _checks, _native

T = torch.view_as_real(rope_ext.precompute_freqs_cis(16, 8))  # [8, 8, 2]


def x_(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# (name, op, args, kwargs, error, message)
APPLY_CASES = [
    ("integer x", "apply_rotary", (torch.ones(1, 4, 16, dtype=torch.int64), T), {}, TypeError,
     "apply_rotary: x must be a float16, bfloat16, float32 or float64 tensor, got Long"),
    ("0-dim x", "apply_rotary", (torch.tensor(1.0), T), {}, ValueError,
     "apply_rotary: x must have at least 2 dims (a sequence dim and head_dim), got 0"),
    ("1-dim x", "apply_rotary", (x_(16), T), {}, ValueError,
     "apply_rotary: x must have at least 2 dims (a sequence dim and head_dim), got 1"),
    ("too many dims", "apply_rotary", (x_(*[1] * 9, 16), T), {}, ValueError,
     "apply_rotary: x must have at most 9 dims, got 10"),
    ("table rank", "apply_rotary", (x_(1, 4, 16), T[0]), {}, ValueError,
     "apply_rotary: freqs_cis must have shape [P, R/2, 2] holding (cos, sin), got [8, 2]"),
    ("table last dim", "apply_rotary", (x_(1, 4, 16), torch.zeros(8, 8, 3)), {}, ValueError,
     "apply_rotary: freqs_cis must have shape [P, R/2, 2] holding (cos, sin), got [8, 8, 3]"),
    ("empty table pairs", "apply_rotary", (x_(1, 4, 16), torch.zeros(8, 0, 2)), {}, ValueError,
     "apply_rotary: freqs_cis must hold at least one rotary pair, got shape [8, 0, 2]"),
    ("table dtype", "apply_rotary", (x_(1, 4, 16), T.half()), {}, TypeError,
     "apply_rotary: freqs_cis must be float32 or float64 (the real view [P, R/2, 2] of the "
     "complex table) or complex64 or complex128 [P, R/2], got Half"),
    ("complex table dtype", "apply_rotary",
     (x_(1, 4, 16), torch.zeros(8, 8, dtype=torch.complex32)), {}, TypeError,
     "apply_rotary: freqs_cis must be complex64 or complex128 [P, R/2] (or its real view, "
     "float32 or float64 [P, R/2, 2]), got ComplexHalf"),
    ("complex table rank", "apply_rotary", (x_(1, 4, 16), torch.view_as_complex(T)[None]), {},
     ValueError, "apply_rotary: complex freqs_cis must have shape [P, R/2], got [1, 8, 8]"),
    ("empty complex table pairs", "apply_rotary",
     (x_(1, 4, 16), torch.zeros(8, 0, dtype=torch.complex64)), {}, ValueError,
     "apply_rotary: freqs_cis must hold at least one rotary pair, got shape [8, 0]"),
    ("rotary dim too large", "apply_rotary", (x_(1, 4, 12), T), {}, ValueError,
     "apply_rotary: rotary dim 2 * freqs_cis.shape[1] = 16 exceeds x's head_dim 12"),
    ("odd head_dim too small", "apply_rotary", (x_(1, 4, 15), T), {}, ValueError,
     "apply_rotary: rotary dim 2 * freqs_cis.shape[1] = 16 exceeds x's head_dim 15"),
    ("seq_dim last", "apply_rotary", (x_(1, 4, 16), T), dict(seq_dim=2), ValueError,
     "apply_rotary: seq_dim must name a dim of x other than the last, in [-3, -2] or [0, 1], "
     "got 2"),
    ("seq_dim -1 is the feature dim", "apply_rotary", (x_(1, 4, 16), T), dict(seq_dim=-1),
     ValueError, "apply_rotary: seq_dim must name a dim of x other than the last, in [-3, -2] "
     "or [0, 1], got -1"),
    ("seq_dim too negative", "apply_rotary", (x_(1, 4, 16), T), dict(seq_dim=-4), ValueError,
     "apply_rotary: seq_dim must name a dim of x other than the last, in [-3, -2] or [0, 1], "
     "got -4"),
    ("sequence past table", "apply_rotary", (x_(1, 6, 16), T), dict(offset=3), ValueError,
     "apply_rotary: offset + x.shape[seq_dim] = 3 + 6 exceeds the 8 rows of freqs_cis"),
    ("negative offset", "apply_rotary", (x_(1, 4, 16), T), dict(offset=-1), ValueError,
     "apply_rotary: offset must be >= 0, got -1"),
    ("float positions", "apply_rotary", (x_(1, 4, 16), T, torch.zeros(1, 4)), {}, TypeError,
     "apply_rotary: positions must be an int32 or int64 tensor, got Float"),
    ("positions not broadcastable", "apply_rotary",
     (x_(2, 4, 16), T, torch.zeros(3, 4, dtype=torch.long)), {}, ValueError,
     "apply_rotary: positions of shape [3, 4] is not broadcastable to x.shape[:-1] = [2, 4]"),
    ("positions not broadcastable in the last dim", "apply_rotary",
     (x_(2, 4, 16), T, torch.zeros(2, 3, dtype=torch.long)), {}, ValueError,
     "apply_rotary: positions of shape [2, 3] is not broadcastable to x.shape[:-1] = [2, 4]"),
    ("positions too many dims", "apply_rotary",
     (x_(2, 4, 16), T, torch.zeros(1, 2, 4, dtype=torch.long)), {}, ValueError,
     "apply_rotary: positions of shape [1, 2, 4] is not broadcastable to x.shape[:-1] = [2, 4]"),
    ("in-place expanded", "apply_rotary_", (x_(1, 1, 16).expand(1, 4, 16), T), {}, ValueError,
     "apply_rotary_: x has overlapping memory (dim 1 of size 4 has stride 0, e.g. from "
     "expand); an in-place call needs distinct elements, use the out-of-place op"),
    ("qk ndim", "apply_rotary_qk", (x_(1, 4, 2, 16), x_(1, 4, 16), T), {}, ValueError,
     "apply_rotary_qk: q and k must have the same number of dims, got 4 and 3"),
    ("qk head_dim", "apply_rotary_qk", (x_(1, 4, 2, 16), x_(1, 4, 2, 18), T), {}, ValueError,
     "apply_rotary_qk: q and k must have the same head_dim, got 16 and 18"),
    ("qk batch", "apply_rotary_qk", (x_(1, 4, 2, 16), x_(2, 4, 2, 16), T), {}, ValueError,
     "apply_rotary_qk: q and k must agree on dim 0 (batch and seq_dim; only head counts may "
     "differ), got 1 and 2"),
    ("qk sequence", "apply_rotary_qk", (x_(1, 4, 2, 16), x_(1, 5, 2, 16), T), {}, ValueError,
     "apply_rotary_qk: q and k must agree on dim 1 (batch and seq_dim; only head counts may "
     "differ), got 4 and 5"),
    ("qk tokens along seq_dim 0", "apply_rotary_qk", (x_(4, 2, 16), x_(5, 2, 16), T),
     dict(seq_dim=0), ValueError, "apply_rotary_qk: q and k must agree on dim 0 (batch and "
     "seq_dim; only head counts may differ), got 4 and 5"),
    ("qk with positions: k not broadcastable", "apply_rotary_qk",
     (x_(6, 8, 16), x_(5, 2, 16), T, torch.zeros(6, 1, dtype=torch.long)), {}, ValueError,
     "apply_rotary_qk: positions of shape [6, 1] is not broadcastable to k.shape[:-1] = [5, 2]"),
    ("qk with positions: head_dim", "apply_rotary_qk",
     (x_(6, 8, 16), x_(6, 2, 18), T, torch.zeros(6, 1, dtype=torch.long)), {}, ValueError,
     "apply_rotary_qk: q and k must have the same head_dim, got 16 and 18"),
    ("qk bad k dtype", "apply_rotary_qk", (x_(1, 4, 2, 16), torch.ones(1, 4, 2, 16, dtype=torch.int32), T), {},
     TypeError, "apply_rotary_qk: k must be a float16, bfloat16, float32 or float64 tensor, got Int"),
]


def run_op(op, args, kwargs):
    return getattr(torch.ops.rope_ext, op)(*args, **kwargs)


@pytest.mark.parametrize("case", APPLY_CASES, ids=[c[0] for c in APPLY_CASES])
def test_native_op_error(case):
    _, op, args, kwargs, error, message = case
    with pytest.raises(error, match=re.escape(message)):
        run_op(op, args, kwargs)


@pytest.mark.parametrize("case", APPLY_CASES, ids=[c[0] for c in APPLY_CASES])
def test_fake_kernel_mirrors_error(case):
    _, op, args, kwargs, error, message = case
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(error, match=re.escape(message)):
            run_op(op, fake_args, kwargs)


def public_call(op, args, kwargs):
    """The same call through the public API (complex table, keyword arguments)."""
    inplace = op.endswith("_")
    if op.startswith("apply_rotary_qk"):
        q, k, table, *rest = args
        positions = rest[0] if rest else None
        return rope_ext.apply_rotary_qk(q, k, table, positions=positions, inplace=inplace, **kwargs)
    x, table, *rest = args
    positions = rest[0] if rest else None
    return rope_ext.apply_rotary(x, table, positions=positions, inplace=inplace, **kwargs)


@pytest.mark.parametrize("case", APPLY_CASES, ids=[c[0] for c in APPLY_CASES])
def test_fallback_mirrors_error(case, monkeypatch):
    _, op, args, kwargs, error, message = case
    monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    with pytest.raises(error, match=re.escape(message)):
        public_call(op, args, kwargs)


def _positions(*rows):
    return torch.tensor(rows, dtype=torch.long)


# Calls at the very limits of what the ops take: (name, op, args, kwargs).
ACCEPTED_CASES = [
    ("one rotary pair", "apply_rotary", (x_(1, 4, 16), T[:, :1].contiguous()), {}),
    ("rotary dim is head_dim", "apply_rotary", (x_(1, 4, 16), T), {}),
    ("2 dims", "apply_rotary", (x_(4, 16), T), dict(seq_dim=0)),
    ("9 dims", "apply_rotary", (x_(*[1] * 6, 2, 4, 16), T), dict(seq_dim=7)),
    ("seq_dim -ndim", "apply_rotary", (x_(4, 2, 16), T), dict(seq_dim=-3)),
    ("sequence fills the table", "apply_rotary", (x_(1, 5, 16), T), dict(offset=3)),
    ("positions on the first and last rows", "apply_rotary",
     (x_(2, 4, 16), T, _positions([-2], [5])), dict(offset=2)),
    ("positions of fewer dims", "apply_rotary", (x_(2, 4, 16), T, _positions(3, 1, 0, 7)), {}),
    ("MRoPE on one axis", "apply_rotary", (x_(2, 4, 16), T, torch.ones(1, 2, 4, dtype=torch.long)),
     dict(mrope_section=[8])),
    ("MRoPE on four axes", "apply_rotary", (x_(2, 4, 16), T, torch.ones(4, 1, 4, dtype=torch.long)),
     dict(mrope_section=[2, 2, 0, 4])),
    ("MRoPE positions of one value per axis", "apply_rotary", (x_(2, 4, 16), T, _positions(1, 5)),
     dict(mrope_section=[4, 4])),
    ("interleaved MRoPE below R/2", "apply_rotary",
     (x_(2, 4, 16), T, torch.ones(3, 2, 4, dtype=torch.long)),
     dict(mrope_section=[2, 2, 2], mrope_interleaved=True)),
    ("interleaved MRoPE at R/2", "apply_rotary",
     (x_(2, 4, 16), T, torch.ones(3, 2, 4, dtype=torch.long)),
     dict(mrope_section=[2, 3, 3], mrope_interleaved=True)),
    ("qk head counts differ", "apply_rotary_qk", (x_(1, 4, 3, 16), x_(1, 4, 1, 16), T), {}),
    ("qk with positions: ranks differ", "apply_rotary_qk",
     (x_(6, 2, 16), x_(1, 6, 1, 16), T, _positions([1], [0], [2], [7], [3], [4])), {}),
    ("in place, size-1 dim of stride 0", "apply_rotary_", (x_(4, 16).expand(1, 4, 16), T), {}),
    ("no tokens, no positions", "apply_rotary", (x_(2, 0, 16), T, _positions()), {}),
    ("no tokens, positions per sequence", "apply_rotary",
     (x_(2, 0, 16), T, torch.zeros(2, 0, dtype=torch.long)), {}),
]


@pytest.mark.parametrize("case", ACCEPTED_CASES, ids=[c[0] for c in ACCEPTED_CASES])
def test_limits_are_accepted_on_every_path(case, monkeypatch):
    # The native op, its fake kernel and the eager fallback take the same calls: the Python
    # checks refuse nothing the C++ ones accept.
    _, op, args, kwargs = case

    def fresh():  # the same layout and values for each path (in-place calls write them)
        return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).copy_(a)
                if isinstance(a, torch.Tensor) else a for a in args]

    native_args = fresh()
    native = run_op(op, native_args, kwargs)
    native = native_args[:1] if native is None else native
    native = list(native) if isinstance(native, (list, tuple)) else [native]
    fake_args = fresh()
    with FakeTensorMode() as mode:
        fake = run_op(op, [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                           for a in fake_args], kwargs)
    if fake is not None:
        fake = list(fake) if isinstance(fake, (list, tuple)) else [fake]
        assert [f.shape for f in fake] == [n.shape for n in native]
    monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    fallback = public_call(op, fresh(), kwargs)
    fallback = list(fallback) if isinstance(fallback, (list, tuple)) else [fallback]
    for got, want in zip(fallback, native, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("positions,lo,hi", [([0, 12], 0, 12), ([-1, 3], -1, 3), ([12], 12, 12),
                                             ([-1], -1, -1)])
@pytest.mark.parametrize("native", [True, False])
def test_positions_out_of_range_leave_input_untouched(positions, lo, hi, native, monkeypatch):
    if not native:
        monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(16, 12))  # 12 rows, 8 pairs
    x = x_(len(positions), 1, 2, 16)  # one token per sequence
    before = x.clone()
    pos = torch.tensor(positions).view(-1, 1, 1)
    message = (f"apply_rotary_: offset + positions must lie in [0, 12) (the rows of freqs_cis), "
               f"got values in [{lo}, {hi}]")
    with pytest.raises(IndexError, match=re.escape(message)):
        rope_ext.apply_rotary(x, table, positions=pos, inplace=True)
    torch.testing.assert_close(x, before, atol=0, rtol=0)
    with pytest.raises(IndexError, match="offset \\+ positions must lie in"):
        rope_ext.apply_rotary(x, table, positions=pos - lo + 10, offset=2)


@pytest.mark.parametrize("case", [c for c in APPLY_CASES if c[1].startswith("apply_rotary")],
                         ids=[c[0] for c in APPLY_CASES])
def test_rejected_inplace_call_writes_nothing(case):
    _, op, args, kwargs, error, _ = case
    inplace_op = op if op.endswith("_") else op + "_"
    # Fresh copies, except of expanded views (a clone would make them valid targets).
    tensors = [a.clone() if isinstance(a, torch.Tensor) and 0 not in a.stride() else a
               for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in tensors]
    with pytest.raises(error):
        run_op(inplace_op, tensors, kwargs)
    for a, b in zip(tensors, before):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("native", [True, False])
def test_qk_inplace_overlap(native, monkeypatch):
    if not native:
        monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    q = x_(1, 4, 2, 16)
    before = q.clone()
    message = "apply_rotary_qk_: q and k overlap in memory; an in-place call needs them disjoint"
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_ext.apply_rotary_qk(q, q, T, inplace=True)
    torch.testing.assert_close(q, before, atol=0, rtol=0)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        with pytest.raises(ValueError, match=re.escape(message)):
            torch.ops.rope_ext.apply_rotary_qk_(fq, fq, mode.from_tensor(T))
    # Disjoint views of one fused buffer are fine.
    qkv = x_(1, 4, 64)
    rope_ext.apply_rotary_qk(qkv[..., :32].view(1, 4, 2, 16), qkv[..., 32:48].view(1, 4, 1, 16),
                             T, inplace=True)


def test_device_mismatch_meta():
    message = "apply_rotary: freqs_cis is on cpu but x is on meta"
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.rope_ext.apply_rotary(torch.empty(1, 4, 16, device="meta"), T)
    message = "apply_rotary: positions is on meta but x is on cpu"
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.rope_ext.apply_rotary(x_(1, 4, 16), T, torch.zeros(4, dtype=torch.long, device="meta"))


def test_fill_freqs_cis_checks():
    inv = torch.ones(4, dtype=torch.float64)
    cases = [
        ((torch.empty(3, 5, 2), inv), ValueError,
         "fill_freqs_cis_: out must have shape [end, inv_freq.shape[0], 2] = [end, 4, 2], "
         "got [3, 5, 2]"),
        ((torch.empty(3, 4, 2, dtype=torch.half), inv), TypeError,
         "fill_freqs_cis_: out must be float32 or float64, got Half"),
        ((torch.empty(3, 4, 2), inv.float()), TypeError,
         "fill_freqs_cis_: inv_freq must be float64, got Float"),
        ((torch.empty(3, 4, 2), inv.view(2, 2)), ValueError,
         "fill_freqs_cis_: inv_freq must be 1-D, got shape [2, 2]"),
        ((torch.empty(4, 3, 2), inv), ValueError,  # as many rows as inv_freq, not as many pairs
         "fill_freqs_cis_: out must have shape [end, inv_freq.shape[0], 2] = [end, 4, 2], "
         "got [4, 3, 2]"),
        ((torch.empty(3, 4, 2), inv.to("meta")), ValueError,
         "fill_freqs_cis_: inv_freq is on meta but out is on cpu"),
    ]
    for (out, inv_freq), error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            torch.ops.rope_ext.fill_freqs_cis_(out, inv_freq, 1.0)
        with FakeTensorMode() as mode, pytest.raises(error, match=re.escape(message)):
            torch.ops.rope_ext.fill_freqs_cis_(mode.from_tensor(out), mode.from_tensor(inv_freq), 1.0)


def test_checks_on_symbolic_sizes_raise_while_tracing():
    # Under dynamic shapes a check's condition is symbolic: torch._check_with decides it from
    # the sizes' hints (head_dim 12 < rotary dim 16 here) and raises the same error while the
    # fake kernel traces, rather than leaving it to the op at run time.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(x_(2, 4, 12), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] * 3))
    table = mode.from_tensor(T, static_shapes=True)
    message = "apply_rotary: rotary dim 2 * freqs_cis.shape[1] = 16 exceeds x's head_dim "
    with mode:
        assert not isinstance(x.shape[-1], int)
        with pytest.raises(ValueError, match=re.escape(message)):
            _checks.check_apply_args("apply_rotary", "x", x, table, None, 0, 1, None, False)
        with pytest.raises(ValueError, match=re.escape(message)):
            torch.ops.rope_ext.apply_rotary(x, table, None, 0, 1, True, False)
