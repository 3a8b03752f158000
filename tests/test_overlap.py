"""In-place calls refuse x whose elements share memory and q, k that share memory, for any
strides, before writing anything; every layout they accept is rotated exactly as a copy of it
would be. Random layouts (views made with as_strided over one buffer) are judged against the
elements' offsets enumerated one by one, through the native op, the fake kernel and the
Python checks the fallback runs.
"""

import contextlib
import itertools
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import rope_ext
from rope_ext import _checks

D = 4  # head_dim: two pairs, so that small buffers hold many layouts
T = torch.view_as_real(rope_ext.precompute_freqs_cis(D, 8))
OVERLAP = re.compile(r"has overlapping memory|q and k overlap in memory")


def offsets(t: torch.Tensor) -> list[int]:
    """Every element's offset into the storage, index by index."""
    return [t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))
            for index in itertools.product(*map(range, t.shape))]


def random_view(buffer: torch.Tensor, gen: torch.Generator,
                like: torch.Tensor | None = None) -> torch.Tensor:
    """A view [rows..., D] of buffer with random sizes, strides (0 excluded) and offset; with
    `like`, as many dims and the same dim 0 (q and k agree on batch and seq_dim 0)."""
    ndim = like.dim() - 1 if like is not None else int(torch.randint(1, 4, (), generator=gen))
    sizes = [int(torch.randint(1, 4, (), generator=gen)) for _ in range(ndim)] + [D]
    if like is not None:
        sizes[0] = like.shape[0]
    strides = [int(torch.randint(1, 13, (), generator=gen)) for _ in range(ndim + 1)]
    if torch.rand((), generator=gen) < 0.5:
        strides[-1] = 1  # contiguous features, the common case
    extent = sum((n - 1) * s for n, s in zip(sizes, strides)) + 1
    offset = int(torch.randint(0, buffer.numel() - extent + 1, (), generator=gen))
    return buffer.as_strided(sizes, strides, offset)


def rotated_by_copies(views: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.ops.rope_ext.apply_rotary(v.contiguous(), T, None, 0, 0, True, False)
            for v in views]


def check_in_every_path(op: str, views: list[torch.Tensor], overlapping: bool) -> None:
    """The native op, the fake kernel and the fallback's checks agree with `overlapping`; an
    accepted call rotates like copies, a refused one leaves the buffer as it was."""
    buffer = views[0]._base
    before = buffer.clone()
    expected = rotated_by_copies(views)
    native = getattr(torch.ops.rope_ext, op)
    if overlapping:
        with pytest.raises(ValueError, match=OVERLAP):
            native(*views, T, None, 0, 0, True, False)
        torch.testing.assert_close(buffer, before, rtol=0, atol=0)
    else:
        native(*views, T, None, 0, 0, True, False)
        for got, want in zip(views, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(v) for v in views]
        if overlapping:
            with pytest.raises(ValueError, match=OVERLAP):
                native(*fake, mode.from_tensor(T), None, 0, 0, True, False)
        else:
            native(*fake, mode.from_tensor(T), None, 0, 0, True, False)
    names = ("q", "k") if len(views) == 2 else ("x",)
    with pytest.raises(ValueError, match=OVERLAP) if overlapping else contextlib.nullcontext():
        for name, v in zip(names, views):
            _checks.check_inplace_target(op, name, v)
        if len(views) == 2:
            _checks.check_qk_disjoint(op, *views)


def test_internal_overlap_matches_enumeration():
    gen = torch.Generator().manual_seed(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        buffer = torch.randn(160)
        x = random_view(buffer, gen)
        where = offsets(x)
        overlapping = len(set(where)) < len(where)
        seen[overlapping] += 1
        check_in_every_path("apply_rotary_", [x], overlapping)
    assert min(seen.values()) > 50, seen  # both answers drawn often


def test_qk_overlap_matches_enumeration():
    gen = torch.Generator().manual_seed(1)
    seen = {True: 0, False: 0}
    for _ in range(400):
        buffer = torch.randn(160)
        q = random_view(buffer, gen)
        k = random_view(buffer, gen, like=q)
        q_at, k_at = offsets(q), offsets(k)
        if len(set(q_at)) < len(q_at) or len(set(k_at)) < len(k_at):
            continue  # internal overlap: the test above
        overlapping = bool(set(q_at) & set(k_at))
        seen[overlapping] += 1
        check_in_every_path("apply_rotary_qk_", [q, k], overlapping)
    assert min(seen.values()) > 30, seen


def test_qk_sharing_strides_matches_enumeration():
    # q and k as views of one projection lay them out: the same strides, k at an offset of its
    # own and with its own head count.
    gen = torch.Generator().manual_seed(2)
    seen = {True: 0, False: 0}
    for _ in range(400):
        buffer = torch.randn(160)
        q = random_view(buffer, gen)
        sizes = list(q.shape)
        if len(sizes) > 2:
            sizes[-2] = int(torch.randint(1, 4, (), generator=gen))
        extent = sum((n - 1) * s for n, s in zip(sizes, q.stride())) + 1
        offset = int(torch.randint(0, buffer.numel() - extent + 1, (), generator=gen))
        k = buffer.as_strided(sizes, q.stride(), offset)
        q_at, k_at = offsets(q), offsets(k)
        if len(set(q_at)) < len(q_at) or len(set(k_at)) < len(k_at):
            continue  # internal overlap: test_internal_overlap_matches_enumeration
        overlapping = bool(set(q_at) & set(k_at))
        seen[overlapping] += 1
        check_in_every_path("apply_rotary_qk_", [q, k], overlapping)
    assert min(seen.values()) > 30, seen


def test_dims_of_size_one_may_have_stride_zero():
    # A dim of size 1 may have any stride, 0 included (as_strided, broadcast views): one
    # element, no overlap, accepted on every path (a dim of size 2 or more with stride 0 is
    # refused: test_errors).
    buffer = torch.randn(24)
    x = buffer.as_strided([1, 3, 2, D], [0, 8, 4, 1], 0)
    check_in_every_path("apply_rotary_", [x], False)
    q = buffer.as_strided([1, 2, 1, D], [0, 4, 0, 1], 0)
    k = buffer.as_strided([1, 2, 1, D], [0, 4, 0, 1], 16)
    check_in_every_path("apply_rotary_qk_", [q, k], False)


def test_dense_q_and_k_with_symbolic_layouts_are_judged_by_their_ranges():
    """Under dynamic shapes (every size symbolic, so offsets and strides too) the exact search
    cannot run; q and k that are both dense are then judged by the element ranges they span,
    while tracing. Slices of dim 0 of one [3, S, H, D] buffer: half shared, adjacent."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.randn(3, 6, 3, D), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] * 4))
    table = mode.from_tensor(T, static_shapes=True)
    op = "apply_rotary_qk_"
    with mode:
        for q_rows, k_rows, overlapping in [((0, 2), (1, 3), True), ((1, 3), (0, 2), True),
                                            ((0, 1), (1, 2), False), ((1, 2), (0, 1), False)]:
            q, k = x[slice(*q_rows)], x[slice(*k_rows)]
            assert not _checks._concrete(q, k)
            for check in (lambda: _checks.check_qk_disjoint(op, q, k),
                          lambda: torch.ops.rope_ext.apply_rotary_qk_(q, k, table, None, 0, 1,
                                                                      True, False)):
                with pytest.raises(ValueError, match=OVERLAP) if overlapping else \
                        contextlib.nullcontext():
                    check()
        # Rows 0 and 2 are not dense: their range holds row 1, yet they share nothing with it;
        # such layouts are left to the op's exact check at run time.
        _checks.check_qk_disjoint(op, x[1:2], x[0:3:2])


def test_dense_test_of_older_torch_matches_enumeration(monkeypatch):
    """Before torch 2.10 (no is_non_overlapping_and_dense_or_false) _checks judges density
    itself: loaded so here, it calls dense exactly the layouts whose elements fill one block
    of memory once, in some order."""
    import importlib.util

    import torch._prims_common as prims

    monkeypatch.delattr(prims, "is_non_overlapping_and_dense_or_false", raising=False)
    spec = importlib.util.spec_from_file_location("_checks_before_2_10", _checks.__file__)
    older = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(older)
    gen = torch.Generator().manual_seed(3)
    seen = {True: 0, False: 0}
    for i in range(600):
        if i % 2:
            x = random_view(torch.randn(160), gen)
        else:  # a permuted block, its size-1 dims given any stride
            sizes = [int(torch.randint(1, 4, (), generator=gen)) for _ in range(3)] + [D]
            block = torch.randn(sizes).permute(*torch.randperm(4, generator=gen).tolist())
            strides = [s if n > 1 else int(torch.randint(1, 13, (), generator=gen))
                       for n, s in zip(block.shape, block.stride())]
            x = block.as_strided(block.shape, strides)
        where = sorted(offsets(x))
        dense = where == list(range(where[0], where[0] + len(where)))
        seen[dense] += 1
        assert older._dense(x) == dense, (list(x.shape), list(x.stride()))
    assert min(seen.values()) > 100, seen


def test_layout_holds_the_dims_that_move():
    # As csrc/rope_checks.cpp's Layout: the dims of size > 1 and nonzero stride, largest
    # stride first, in bytes; spans[d] is how far dims d.. reach, one element included.
    x = torch.empty(64, dtype=torch.float16).as_strided([3, 1, 2, 4, 5], [2, 7, 16, 0, 1])
    layout = _checks._Layout(x)
    assert (layout.n, layout.strides, layout.sizes) == (3, [32, 4, 2], [2, 3, 5])
    assert layout.spans == [2 + 4 * 2 + 2 * 4 + 1 * 32, 2 + 4 * 2 + 2 * 4, 2 + 4 * 2, 2]


def test_single_elements_side_by_side_are_disjoint():
    # Layouts with no dim that moves (a lone v element and its cache slot, say): adjacent
    # elements share no byte, the same element does.
    buffer = torch.randn(4)
    for a, b in [(buffer[:1], buffer[1:2]), (buffer[1:2], buffer[:1]), (buffer[3:], buffer[:1])]:
        _checks.check_disjoint("op", "a", a, "b", b, "needs", "fix")
    with pytest.raises(ValueError, match="op: a and b overlap in memory; needs them disjoint"):
        _checks.check_disjoint("op", "a", buffer[1:2], "b", buffer[1:2].view(1, 1), "needs",
                               "fix")


def test_each_search_step_costs_one_unit_of_the_budget(monkeypatch):
    # Disjoint ranges are proven in one step, so a budget of one suffices and none does not.
    q, k = torch.randn(2, 8).unbind()
    monkeypatch.setattr(_checks, "_OVERLAP_BUDGET", 1)
    _checks.check_qk_disjoint("apply_rotary_qk_", q, k)
    monkeypatch.setattr(_checks, "_OVERLAP_BUDGET", 0)
    with pytest.raises(ValueError, match="cannot prove that q and k are disjoint"):
        _checks.check_qk_disjoint("apply_rotary_qk_", q, k)


def test_python_checks_stop_where_the_cpp_ones_do():
    # The fake kernels and the fallback answer as the op would: the same search budget and
    # the same limits, read from the C++ sources.
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    assert f"kOverlapBudget = {_checks._OVERLAP_BUDGET};" in (csrc / "rope_checks.cpp").read_text()
    rope_math = (csrc / "rope_math.h").read_text()
    assert f"kMaxDims = {_checks.MAX_DIMS - 1};" in rope_math
    assert f"kMaxMropeAxes = {_checks.MAX_MROPE_AXES};" in rope_math


def test_fused_qkv_views_and_transposes_are_disjoint():
    # The layouts real models pass: q, k, v views of one projection, HF's transposed views.
    qkv = torch.randn(2, 16, (8 + 2 + 2) * D)
    q = qkv[..., : 8 * D].view(2, 16, 8, D)
    k = qkv[..., 8 * D: 10 * D].view(2, 16, 2, D)
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(D, 16))
    expected = [torch.ops.rope_ext.apply_rotary(v.contiguous(), table, None, 0, 1, True, False)
                for v in (q, k)]
    torch.ops.rope_ext.apply_rotary_qk_(q, k, table, None, 0, 1, True, False)
    for got, want in zip((q, k), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, D] views
    torch.ops.rope_ext.apply_rotary_qk_(qt, kt, table, None, 0, 2, True, False)


def test_unprovable_layouts_are_refused_with_their_strides(monkeypatch):
    # An overlap question that outruns its step budget is refused, naming the layout, never
    # rotated on a guess (the Python twin of the C++ check, its budget cut to nothing).
    monkeypatch.setattr(_checks, "_OVERLAP_BUDGET", 0)
    x = torch.randn(64).as_strided([3, 2, D], [2, 3, 8])  # distinct, its strides interleaved
    assert len(set(offsets(x))) == x.numel()
    message = "apply_rotary_: cannot prove that the elements of x are distinct (sizes [3, 2, 4]"
    with pytest.raises(ValueError, match=re.escape(message)):
        _checks.check_inplace_target("apply_rotary_", "x", x)
    monkeypatch.setattr(_checks, "_OVERLAP_BUDGET", 100000)
    _checks.check_inplace_target("apply_rotary_", "x", x)


def _children_by_brute_force(a, da, b, db, delta):
    """The sub-questions _may_overlap must ask, in order, for one question past its range
    test: every index of the dim it splits (the larger stride's, or both dims' relative index
    where the strides are equal) whose remaining blocks still meet, found by trying each index
    rather than by the division arithmetic the search uses."""
    def meet(da2, db2, delta2):
        return delta2 < a.spans[da2] and -delta2 < b.spans[db2]

    sa = a.strides[da] if da < a.n else -1
    sb = b.strides[db] if db < b.n else -1
    if sa == sb:
        steps = [(da + 1, db + 1, delta + t * sa) for t in range(-(a.sizes[da] - 1), b.sizes[db])]
    elif sa > sb:
        steps = [(da + 1, db, delta - i * sa) for i in range(a.sizes[da])]
    else:
        steps = [(da, db + 1, delta + j * sb) for j in range(b.sizes[db])]
    return [s for s in steps if meet(*s)]


@pytest.fixture
def traced_search(monkeypatch):
    """_may_overlap and _internal_overlap wrapped (their recursion goes through the module's
    names): each question's sub-questions are recorded and checked against the brute-force
    list. Yields the number of _may_overlap calls so far, in a one-element list."""
    search, internal = _checks._may_overlap, _checks._internal_overlap
    open_calls, calls = [], [0]

    def checked(asked, expected, found):
        # Asked in order until one finds an overlap: all of them where none does.
        got = [(da, db, delta) for da, db, delta, _ in asked]
        if found and asked and asked[-1][3]:
            assert got == expected[:len(got)], (got, expected)
        else:
            assert got == expected, (got, expected)

    def may_overlap(a, da, b, db, delta, budget):
        calls[0] += 1
        if open_calls:
            open_calls[-1].append([da, db, delta, None])
        open_calls.append([])
        found = search(a, da, b, db, delta, budget)
        asked = open_calls.pop()
        if open_calls:
            open_calls[-1][-1][3] = found
        if budget[0] >= 0:
            first = not (delta < a.spans[da] and -delta < b.spans[db]) \
                or (da == a.n and db == b.n)
            checked(asked, [] if first else _children_by_brute_force(a, da, b, db, delta), found)
        return found

    def internal_overlap(a, d, budget):
        open_calls.append([])
        found = internal(a, d, budget)
        asked = open_calls.pop()
        if budget[0] >= 0 and d < a.n:  # shifts of dims d+1.. against themselves, by t rows
            expected = [(d + 1, d + 1, t * a.strides[d]) for t in range(1, a.sizes[d])
                        if t * a.strides[d] < a.spans[d + 1]]
            if not (found and not asked):  # (an overlap found inside dims d+1.. already)
                checked(asked, expected, found)
        return found

    monkeypatch.setattr(_checks, "_may_overlap", may_overlap)
    monkeypatch.setattr(_checks, "_internal_overlap", internal_overlap)
    yield calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8], ids=["4-byte", "1-byte"])
def test_overlap_search_asks_exactly_the_questions_where_blocks_meet(traced_search, dtype):
    # The enumeration tests above check the answers; this checks the search's bounds: a bound
    # one too wide asks a question whose blocks cannot meet (a wasted step, or a false overlap
    # at an index past a dim's end), one too narrow skips one that can. The search works in
    # bytes: 1-byte elements (FP8 caches) reach the remainders that 4-byte ones never do.
    gen = torch.Generator().manual_seed(4)
    for i in range(900):
        buffer = torch.zeros(160, dtype=dtype)
        q = random_view(buffer, gen)
        if i % 3 == 0:
            _checks._internal_overlap(_checks._Layout(q), 0, [_checks._OVERLAP_BUDGET])
            continue
        if i % 3 == 1:
            k = random_view(buffer, gen, like=q)
        else:  # q's strides, as views of one projection have (see above)
            extent = sum((n - 1) * s for n, s in zip(q.shape, q.stride())) + 1
            offset = int(torch.randint(0, buffer.numel() - extent + 1, (), generator=gen))
            k = buffer.as_strided(q.shape, q.stride(), offset)
        delta = (k.storage_offset() - q.storage_offset()) * q.element_size()
        _checks._may_overlap(_checks._Layout(q), 0, _checks._Layout(k), 0, delta,
                             [_checks._OVERLAP_BUDGET])
    assert traced_search[0] > 1500  # hundreds of sub-questions besides the 900 first ones


def test_overlap_search_stops_when_its_budget_is_spent(traced_search, monkeypatch):
    # One step past the budget answers "cannot prove" and every open question stops there.
    x = torch.randn(128).as_strided([4, 3, D], [9, 10, 12])  # distinct, strides interleaved
    _checks.check_inplace_target("apply_rotary_", "x", x)
    needed = traced_search[0]
    assert needed == 14
    monkeypatch.setattr(_checks, "_OVERLAP_BUDGET", needed)  # spent to the last step: enough
    _checks.check_inplace_target("apply_rotary_", "x", x)
    for budget in range(needed):
        monkeypatch.setattr(_checks, "_OVERLAP_BUDGET", budget)
        traced_search[0] = 0
        with pytest.raises(ValueError, match="cannot prove that the elements of x are distinct"):
            _checks.check_inplace_target("apply_rotary_", "x", x)
        assert traced_search[0] == budget + 1


def test_empty_views_share_no_memory():
    # An empty q or k holds no element, so it overlaps nothing, even as a view of the other.
    buffer = torch.randn(40)
    q = buffer.as_strided([2, 3, D], [12, 4, 1], 0)
    check_in_every_path("apply_rotary_qk_", [q, q[:, :0]], False)
    check_in_every_path("apply_rotary_qk_", [q[:, :0], q], False)
    # ...and an empty x never overlaps itself, whatever the strides of its other dims.
    check_in_every_path("apply_rotary_", [buffer.as_strided([0, 3, D], [1, 1, 1])], False)
