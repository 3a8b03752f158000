"""The CUDA kernels run on the host (csrc/cuda/rope_cuda_emulate.cpp): every block and thread of
the launch plan the CUDA launcher computes, through the same thread functions, with every
memory access checked (no read outside x / table / positions, no read of an element already
written, 16-byte accesses aligned, every element of out written exactly once). Each case must
also agree bit for bit with the CPU kernel. No GPU needed: this is how the CUDA code is tested
on CPU-only machines."""

import contextlib
import re

import pytest
import torch

import rope_ext

emulation = torch.ops.rope_ext._cuda_emulation
H200 = (132, 3)  # SMs, and blocks per SM of the vector kernels (their launch bounds)
SMALL_GPU = (1, 1)  # one resident block: every thread strides over many blocks
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
P = 64  # table rows


@contextlib.contextmanager
def emulated(gpu=H200):
    """Runs the CPU ops as emulated CUDA launches; yields the list the launch log goes to."""
    emulation(0)  # drop any earlier log
    launches = []
    emulation(*gpu)
    try:
        yield launches
    finally:
        launches.extend(emulation(0).splitlines())


def make_case(layout, dtype, head_dim, gen):
    """(q, k, kwargs) for one layout; k has fewer heads (GQA) where the layout allows."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def randint(*shape, dtype=torch.int64):
        return torch.randint(0, P, shape, generator=gen).to(dtype)

    D = head_dim
    if layout == "bshd":
        return randn(2, 7, 4, D), randn(2, 7, 2, D), dict(seq_dim=1)
    if layout == "bhsd":  # Hugging Face
        return randn(2, 4, 7, D), randn(2, 2, 7, D), dict(seq_dim=2)
    if layout == "positions_int32":
        return (randn(2, 7, 4, D), randn(2, 7, 2, D),
                dict(positions=randint(2, 7, 1, dtype=torch.int32)))
    if layout == "packed":  # varlen: [T, H, D] with a position per token
        return randn(13, 4, D), randn(13, 1, D), dict(positions=randint(13, 1), seq_dim=0)
    if layout == "decode":
        return randn(5, 1, 8, D), randn(5, 1, 2, D), dict(positions=randint(5, 1, 1))
    if layout == "offset":
        return randn(1, 3, 4, D), randn(1, 3, 4, D), dict(offset=P - 3)
    if layout == "decode_offset":  # one position for every row: batch and heads merge
        return randn(5, 1, 8, D), randn(5, 1, 2, D), dict(offset=P - 1)
    if layout == "positions_per_head":
        return randn(2, 3, 4, D), randn(2, 3, 4, D), dict(positions=randint(2, 3, 4))
    if layout == "fused_qkv":  # q and k are views into one projection output
        qkv = randn(2, 5, (4 + 2 + 2) * D)
        return (qkv[..., :4 * D].view(2, 5, 4, D), qkv[..., 4 * D:6 * D].view(2, 5, 2, D),
                dict())
    if layout == "misaligned":  # storage offset of one element: the scalar path
        base = randn(2 * 5 * 4 * D + 1)
        return base[1:].view(2, 5, 4, D), randn(2, 5, 2, D), dict()
    if layout == "strided_features":
        return (randn(2, 5, D, 4).transpose(-1, -2), randn(2, 5, D, 2).transpose(-1, -2),
                dict())
    if layout == "many_heads":  # heads beyond what one block's groups hold
        return randn(1, 3, 70, D), randn(1, 3, 6, D), dict()
    if layout == "empty":
        return randn(2, 0, 4, D), randn(2, 0, 2, D), dict()
    if layout == "bsd":  # no head dim: LLaMA's [B, S, D]
        return randn(2, 7, D), randn(2, 7, D), dict(seq_dim=1)
    if layout == "positions_offset":
        return randn(2, 5, 4, D), randn(2, 5, 2, D), dict(positions=randint(2, 5, 1) // 2,
                                                          offset=P // 2)
    if layout == "bhsd_positions":  # the head dim between the token dims
        return (randn(2, 4, 5, D), randn(2, 2, 5, D),
                dict(positions=randint(2, 1, 5, dtype=torch.int32)))
    if layout == "expanded_positions":  # as transformers and torchtitan pass them
        return (randn(2, 5, 4, D), randn(2, 5, 2, D),
                dict(positions=randint(1, 5, 1).expand(2, 5, 1)))
    if layout == "different_ranks":  # with positions, q and k need only broadcast
        return randn(2, 5, 4, D), randn(5, 2, D), dict(positions=randint(5, 1))
    raise ValueError(layout)


LAYOUTS = ["bshd", "bhsd", "positions_int32", "packed", "decode", "decode_offset", "offset",
           "positions_per_head", "fused_qkv", "misaligned", "strided_features", "many_heads",
           "empty", "bsd", "positions_offset", "bhsd_positions", "expanded_positions",
           "different_ranks"]
# (head_dim, rotary_dim): full, partial (pass-through), odd widths for the scalar path.
WIDTHS = [(128, 128), (128, 64), (80, 80), (72, 40), (6, 4)]


def copy_with_layout(t):
    """A copy of t with its strides and storage offset (clone() would make it dense)."""
    base = t.new_empty(t.untyped_storage().nbytes() // t.element_size())
    return base.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(t)


def call(op, q, k, table, kwargs, interleaved, inverse):
    """Runs op (one of the four rotary ops; in place on copies); returns the outputs."""
    if op.endswith("_"):
        q, k = copy_with_layout(q), copy_with_layout(k)
    args = (table, kwargs.get("positions"), kwargs.get("offset", 0), kwargs.get("seq_dim", 1),
            interleaved, inverse)
    ops = torch.ops.rope_ext
    if op == "qk":
        return ops.apply_rotary_qk(q, k, *args)
    if op == "qk_":
        ops.apply_rotary_qk_(q, k, *args)
        return q, k
    if op == "x":
        return (ops.apply_rotary(q, *args),)
    ops.apply_rotary_(q, *args)
    return (q,)


def check(op, q, k, table, kwargs, interleaved, inverse=False, gpu=H200):
    want = call(op, q, k, table, kwargs, interleaved, inverse)
    with emulated(gpu) as launches:
        got = call(op, q, k, table, kwargs, interleaved, inverse)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()
    return launches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("head_dim,rotary_dim", WIDTHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_cpu_kernel(dtype, interleaved, head_dim, rotary_dim, layout):
    gen = torch.Generator().manual_seed(head_dim * 7 + rotary_dim)
    q, k, kwargs = make_case(layout, dtype, head_dim, gen)
    table = rope_ext.precompute_freqs_cis(rotary_dim, P)
    # The path to take: 16-byte vectors whenever rows and widths allow them (the
    # pass-through features count only out of place).
    vector_width = 16 // q.element_size()
    # Rows start 16-byte aligned unless the layout offsets them or head_dim is odd-sized.
    aligned = layout not in ("misaligned", "strided_features") and head_dim % vector_width == 0
    rotary_ok = (rotary_dim if interleaved else rotary_dim // 2) % vector_width == 0
    for op in ("qk", "qk_", "x", "x_"):
        launches = check(op, q, k, table, kwargs, interleaved)
        assert len(launches) == (0 if layout == "empty" else 1), launches
        pass_ok = op.endswith("_") or (head_dim - rotary_dim) % vector_width == 0
        for line in launches:
            assert f"vector={int(aligned and rotary_ok and pass_ok)}" in line, (op, line)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["bshd", "misaligned"])
def test_grid_stride_and_inverse(interleaved, dtype, layout):
    """One resident block, so each thread walks many blocks; q and k in one launch; inverse,
    on the vector and the scalar path."""
    gen = torch.Generator().manual_seed(1)
    q, k, kwargs = make_case(layout, dtype, 128, gen)
    table = rope_ext.precompute_freqs_cis(128, P)
    for inverse in (False, True):
        launches = check("qk", q, k, table, kwargs, interleaved, inverse, gpu=SMALL_GPU)
        assert "grid=1 " in launches[0], launches[0]


# The residency each kind of kernel gets on an H200: 2 blocks (scalar, MRoPE), 4 (small
# vector kernels), and a small GPU.
@pytest.mark.parametrize("gpu", [(132, 2), (132, 4), (8, 3)], ids=str)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "decode", "many_heads", "misaligned"])
def test_other_occupancies(gpu, layout):
    gen = torch.Generator().manual_seed(7)
    q, k, kwargs = make_case(layout, torch.bfloat16, 128, gen)
    table = rope_ext.precompute_freqs_cis(64, P)  # partial rotary: pass-through lanes too
    for op in ("qk", "qk_"):
        check(op, q, k, table, kwargs, False, gpu=gpu)


def test_expanded_x_out_of_place():
    """A stride-0 x (expand) is fine out of place: every thread reads, none writes, x."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 5, 1, 128, generator=gen).bfloat16().expand(2, 5, 4, 128)
    k = torch.randn(2, 5, 2, 128, generator=gen).bfloat16()
    table = rope_ext.precompute_freqs_cis(128, P)
    for interleaved in (True, False):
        check("qk", x, k, table, {}, interleaved)
        check("x", x, None, table, {}, interleaved)


MROPE = {"qwen2": dict(mrope_section=[16, 24, 24]),
         "qwen3": dict(mrope_section=[24, 20, 20], mrope_interleaved=True)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "packed", "misaligned"])
def test_mrope_matches_cpu_kernel(dtype, interleaved, variant, layout):
    """MRoPE: positions [3, ...], each pair's (cos, sin) from its axis' table row."""
    gen = torch.Generator().manual_seed(9)
    q, k, kwargs = make_case(layout, dtype, 128, gen)
    lead = {"bshd": (2, 7, 1), "bhsd": (2, 1, 7), "packed": (13, 1), "misaligned": (2, 5, 1)}
    kwargs = dict(positions=torch.randint(0, P, (3, *lead[layout]), generator=gen),
                  seq_dim=kwargs.get("seq_dim", 1), **MROPE[variant])
    table = rope_ext.precompute_freqs_cis(128, P)
    for op in ("qk", "qk_", "x", "x_"):
        want = call_mrope(op, q, k, table, kwargs, interleaved)
        with emulated() as launches:
            got = call_mrope(op, q, k, table, kwargs, interleaved)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (g - w).abs().max()
        assert len(launches) == 1 and "mrope=1" in launches[0], launches
        assert f"vector={int(layout != 'misaligned')}" in launches[0], launches[0]


def call_mrope(op, q, k, table, kwargs, interleaved):
    inplace = op.endswith("_")
    q = copy_with_layout(q) if inplace else q
    if op.startswith("qk"):
        k = copy_with_layout(k) if inplace else k
        return rope_ext.apply_rotary_qk(q, k, table, inplace=inplace, interleaved=interleaved,
                                        **kwargs)
    return (rope_ext.apply_rotary(q, table, inplace=inplace, interleaved=interleaved,
                                  **kwargs),)


def table_form(kind):
    """A rotary-64 table of P positions in one of the forms a caller may pass."""
    full = rope_ext.precompute_freqs_cis(64, 2 * P)  # complex64 [2P, 32]
    make = {
        "float64": lambda: torch.view_as_real(full).double(),
        "complex64": lambda: full,
        "rows_sliced": lambda: torch.view_as_real(full)[P:],  # whole rows off
        "pairs_strided": lambda: torch.view_as_real(rope_ext.precompute_freqs_cis(128, P))[:, ::2],
        "misaligned": lambda: torch.view_as_real(full).flatten()[2:2 + P * 64].view(P, 32, 2),
    }
    return make[kind]()


@pytest.mark.parametrize("table_kind", ["float64", "complex64", "rows_sliced", "pairs_strided"])
def test_table_forms(table_kind):
    """Tables the vector kernels read as 16-byte vectors, and ones they must not."""
    gen = torch.Generator().manual_seed(2)
    q, k, kwargs = make_case("bshd", torch.bfloat16, 64, gen)
    table = table_form(table_kind)
    for interleaved in (True, False):
        launches = check("qk", q, k, table, kwargs, interleaved)
        assert ("vector=0" if table_kind == "pairs_strided" else "vector=1") in launches[0]


def test_wide_rows_take_the_scalar_path():
    """Rows of more 16-byte lanes than a block has threads: the scalar path, lanes looped."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 2, 4096, generator=gen)
    k = torch.randn(2, 3, 1, 4096, generator=gen)
    table = rope_ext.precompute_freqs_cis(4096, P)
    for interleaved in (True, False):
        launches = check("qk", q, k, table, {}, interleaved)
        assert "vector=0" in launches[0] and "lane_threads=256" in launches[0], launches[0]


def test_decode_spreads_heads_over_threads():
    """Too few rows to fill the GPU (decode): fewer rows per thread, down to one, while the
    threads fit in the resident ones, so the launch has as many threads as one wave holds. A
    token's heads beyond one block's groups (256 threads / 16 lanes) are split into tokens of
    16 heads at the same position."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(64, 1, 32, 128, generator=gen).bfloat16()
    k = torch.randn(64, 1, 8, 128, generator=gen).bfloat16()
    table = rope_ext.precompute_freqs_cis(128, P)
    launches = check("qk_", q, k, table, dict(positions=torch.full((64, 1, 1), 7)), True)
    assert re.search(r"op0=\(heads=16 tokens=128 .* rows_per_thread=1 .* "
                     r"op1=\(heads=8 tokens=64 .* rows_per_thread=1", launches[0]), launches[0]
    # Decode at an offset, no positions: every row has one position, so batch and heads merge
    # into one head dim (64 * 32 rows of q). Its heads are split into tokens of 16 (one block's
    # groups), a row per thread: 160 blocks, where one token of 2048 heads was one block.
    launches = check("qk_", q, k, table, dict(offset=P - 1), True)
    assert re.search(r"blocks=160 .* op0=\(heads=16 tokens=128 .* rows_per_thread=1 .* "
                     r"op1=\(heads=16 tokens=32 .* rows_per_thread=1", launches[0]), launches[0]
    # 128 tokens: a row per thread would take 131072 threads, over the H200's 101376
    # resident, so two heads per thread and no split (one wave).
    q = torch.randn(1, 128, 32, 128, generator=gen).bfloat16()
    launches = check("qk_", q, q.clone(), rope_ext.precompute_freqs_cis(128, 128), {}, True)
    assert re.search(r"op0=\(heads=32 tokens=128 .* rows_per_thread=2", launches[0]), launches[0]
    # Prefill: enough rows for every resident thread, so four heads per thread.
    q = torch.randn(1, 2048, 32, 128, generator=gen).bfloat16()
    k = torch.randn(1, 2048, 8, 128, generator=gen).bfloat16()
    launches = check("qk_", q, k, rope_ext.precompute_freqs_cis(128, 2048), {}, True)
    assert re.search(r"op0=\(heads=32 tokens=2048 .* rows_per_thread=4", launches[0]), launches[0]


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("path", ["vector", "scalar"])
def test_offsets_beyond_32_bits(interleaved, path):
    """Views whose elements lie more than 2**31 elements into their storage: 64-bit offsets,
    for x alone and q and k in one launch, with pass-through features out of place. The
    storage is allocated but only the views' pages are touched."""
    big = torch.empty(2**31 + 8192, dtype=torch.bfloat16)
    shift = 1 if path == "scalar" else 0  # one element off 16-byte alignment
    x = big.as_strided((2, 1, 2, 128), (2**31 + 1024, 128, 256, 1), shift)
    k = big.as_strided((2, 1, 1, 128), (2**31 + 1024, 128, 128, 1), 4096 + shift)
    gen = torch.Generator().manual_seed(5)
    x.copy_(torch.randn(2, 1, 2, 128, generator=gen))
    k.copy_(torch.randn(2, 1, 1, 128, generator=gen))
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(96, P))  # partial rotary
    args = (table, None, 3, 1, interleaved, False)
    ops = torch.ops.rope_ext
    want_x = ops.apply_rotary(x.contiguous(), *args)
    want_k = ops.apply_rotary(k.contiguous(), *args)
    with emulated() as launches:
        got_x, got_k = ops.apply_rotary_qk(x, k, *args)
        ops.apply_rotary_(x, *args)
        ops.apply_rotary_qk_(x[:, :, :1], k, *args)
    assert torch.equal(got_x, want_x) and torch.equal(got_k, want_k)
    # x was rotated alone, then its first head again, with k (once), in one launch.
    again = ops.apply_rotary(want_x[:, :, :1].contiguous(), *args)
    assert torch.equal(x[:, :, 1:], want_x[:, :, 1:]) and torch.equal(x[:, :, :1], again)
    assert torch.equal(k, want_k)
    assert len(launches) == 3, launches
    for line in launches:
        assert "index=64 " in line and f"vector={int(path == 'vector')}" in line, line


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_table_fill_matches_cpu(dtype):
    want = rope_ext.precompute_freqs_cis(96, 300, dtype=dtype)
    with emulated() as launches:
        got = rope_ext.precompute_freqs_cis(96, 300, dtype=dtype)
    assert torch.equal(got, want)
    assert launches and launches[0].startswith("fill_freqs_cis"), launches


def test_emulation_rejects_bad_settings():
    with pytest.raises(ValueError, match="sm_count must be >= 0 and blocks_per_sm >= 1"):
        emulation(4, 0)


# ---- Fused RMSNorm + RoPE (rms_norm_rotary_qk): csrc/cuda/qk_norm_cuda_kernel.h ----

NORM_LAYOUTS = ["bshd", "bhsd", "positions_int32", "packed", "decode", "offset", "fused_qkv",
                "misaligned", "strided_features", "many_heads", "empty", "bsd"]
NORM_WIDTHS = [(128, 128), (128, 64), (256, 256), (80, 80), (72, 40), (6, 4)]
EPS = 1e-5


def norm_weights(head_dim, dtype, gen):
    """(float32 weights for q, weights of k's dtype): both weight element types."""
    return ((torch.randn(head_dim, generator=gen) * 0.5 + 1),
            (torch.randn(head_dim, generator=gen) * 0.5 + 1).to(dtype))


def norm_forward(q, k, wq, wk, table, kwargs, interleaved, inplace, weight_offset=0.0):
    if inplace:
        q, k = copy_with_layout(q), copy_with_layout(k)
    return rope_ext.rms_norm_rotary_qk(q, k, wq, wk, table, interleaved=interleaved,
                                       inplace=inplace, eps=EPS, weight_offset=weight_offset,
                                       **kwargs)


def norm_backward(gq, gk, q, k, wq, wk, table, kwargs, interleaved, weight_offset=0.0):
    return torch.ops.rope_ext.rms_norm_rotary_qk_backward(
        gq, gk, q, k, wq, wk, table, kwargs.get("positions"), kwargs.get("offset", 0),
        kwargs.get("seq_dim", 1), interleaved, EPS, weight_offset, kwargs.get("mrope_section"),
        kwargs.get("mrope_interleaved", False))


def reference_forward_backward(x, w, gy, table, kwargs, interleaved, weight_offset=0.0):
    """The float64 reference's output and, by autograd, its gradients of x and w."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    if not table.is_complex():
        table = torch.view_as_complex(table.double().contiguous())
    y = rope_ext.reference.rms_norm_rotary(xd, wd, table.to(torch.complex128), eps=EPS,
                                           weight_offset=weight_offset,
                                           interleaved=interleaved, **kwargs)
    y.backward(gy.double())
    return y.detach(), xd.grad, wd.grad


def assert_close_ulps(got, want, ulps=2):
    """Within a few units in the last place of the dtype, relative to the largest value
    (the sums run in another order; dx = r * g - x * c cancels)."""
    eps = torch.finfo(got.dtype).eps
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=ulps * eps * scale, rtol=ulps * eps)


def assert_weight_grad(got, want, rows):
    """A weight gradient sums over `rows` rows: rounding grows with them."""
    eps = torch.finfo(got.dtype).eps
    tol = max(8 * eps, 4 * torch.finfo(torch.float32).eps * rows)
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def check_norm(q, k, table, kwargs, interleaved, gen, gpu=H200, weight_offset=0.0,
               weights=None):
    """Forward (out of place and in place) and backward under emulation, against the CPU
    kernel (a few ulps) and the float64 reference (TOLERANCES); returns the launch log."""
    from conftest import assert_matches_reference

    D = q.shape[-1]
    wq, wk = weights if weights is not None else norm_weights(D, q.dtype, gen)
    gq = torch.randn(q.shape, generator=gen).to(q.dtype)
    gk = torch.randn(k.shape, generator=gen).to(k.dtype)
    args = (wq, wk, table, kwargs, interleaved)
    want = norm_forward(q, k, *args, inplace=False, weight_offset=weight_offset)
    want_grads = norm_backward(gq, gk, q, k, *args, weight_offset=weight_offset)
    with emulated(gpu) as launches:
        got = norm_forward(q, k, *args, inplace=False, weight_offset=weight_offset)
        got_inplace = norm_forward(q, k, *args, inplace=True, weight_offset=weight_offset)
        grads = norm_backward(gq, gk, q, k, *args, weight_offset=weight_offset)
    for g, g_in, w in zip(got, got_inplace, want):
        assert torch.equal(g, g_in)  # in place: the same kernel, the same bits
        assert_close_ulps(g, w)
    for g, w in zip(grads[:2], want_grads[:2]):
        assert_close_ulps(g, w, ulps=8)
    for x, w, gy, y, dx, dw in zip((q, k), (wq, wk), (gq, gk), got, grads[:2], grads[2:]):
        if x.numel() == 0:
            continue
        ref_y, ref_dx, ref_dw = reference_forward_backward(x, w, gy, table, kwargs, interleaved,
                                                           weight_offset)
        assert_matches_reference(y, ref_y)
        assert_matches_reference(dx, ref_dx)
        assert_weight_grad(dw, ref_dw, x.numel() // D)
    for g, w in zip(grads[2:], want_grads[2:]):
        assert_weight_grad(g, w, q.numel() // D)
    return launches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("head_dim,rotary_dim", NORM_WIDTHS)
@pytest.mark.parametrize("layout", NORM_LAYOUTS)
def test_norm_matches_reference_and_cpu_kernel(dtype, interleaved, head_dim, rotary_dim,
                                               layout):
    gen = torch.Generator().manual_seed(head_dim * 7 + rotary_dim)
    q, k, kwargs = make_case(layout, dtype, head_dim, gen)
    table = rope_ext.precompute_freqs_cis(rotary_dim, P)
    launches = check_norm(q, k, table, kwargs, interleaved, gen)
    # forward twice and backward, one launch each (q and k share a dtype)
    assert len(launches) == (0 if layout == "empty" else 3), launches
    v = 16 // q.element_size()
    rotary_lanes, rotary_ok = divmod(rotary_dim if interleaved else rotary_dim // 2, v)
    pass_lanes, pass_ok = divmod(head_dim - rotary_dim, v)
    widths_ok = (head_dim % v == 0 and rotary_ok == 0 and pass_ok == 0
                 and rotary_lanes + pass_lanes <= 64)
    for line in launches:
        # Backward makes strided rows contiguous (with their gradient's layout).
        aligned = layout != "misaligned" and (layout != "strided_features" or "backward=1" in line)
        assert line.startswith(f"norm vector={int(aligned and widths_ok)}"), line


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("layout", ["bshd", "misaligned", "many_heads"])
def test_norm_grid_stride(dtype, interleaved, layout):
    """One resident block: each warp walks many rows, q and k in one launch."""
    gen = torch.Generator().manual_seed(11)
    q, k, kwargs = make_case(layout, dtype, 128, gen)
    launches = check_norm(q, k, rope_ext.precompute_freqs_cis(64, P), kwargs, interleaved, gen,
                          gpu=SMALL_GPU)
    assert all("grid=1 " in line for line in launches), launches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "packed", "misaligned"])
def test_norm_mrope(dtype, interleaved, variant, layout):
    gen = torch.Generator().manual_seed(12)
    q, k, kwargs = make_case(layout, dtype, 128, gen)
    lead = {"bshd": (2, 7, 1), "bhsd": (2, 1, 7), "packed": (13, 1), "misaligned": (2, 5, 1)}
    kwargs = dict(positions=torch.randint(0, P, (3, *lead[layout]), generator=gen),
                  seq_dim=kwargs.get("seq_dim", 1), **MROPE[variant])
    launches = check_norm(q, k, rope_ext.precompute_freqs_cis(128, P), kwargs, interleaved, gen)
    assert len(launches) == 3 and all("mrope=1" in line for line in launches), launches


def test_norm_weight_forms_and_offset():
    """Strided weights, Gemma's weight_offset = 1, a float64 table, q and k of different
    dtypes (one launch each)."""
    gen = torch.Generator().manual_seed(13)
    q, k, kwargs = make_case("bshd", torch.bfloat16, 128, gen)
    wq = torch.randn(256, generator=gen)[::2]
    wk = torch.randn(256, generator=gen).bfloat16()[1::2]
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(96, P)).double()
    for interleaved in (True, False):
        check_norm(q, k, table, kwargs, interleaved, gen, weight_offset=1.0, weights=(wq, wk))
    launches = check_norm(q, k.float(), table, kwargs, True, gen, weights=(wq, wq))
    assert len(launches) == 6, launches


def test_norm_empty_operand():
    """k without rows (no heads): only q's rows in the launch."""
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(2, 5, 4, 64, generator=gen).bfloat16()
    k = torch.randn(2, 5, 0, 64, generator=gen).bfloat16()
    launches = check_norm(q, k, rope_ext.precompute_freqs_cis(64, P), {}, False, gen)
    assert len(launches) == 3 and all(" op1=" not in line for line in launches), launches


@pytest.mark.parametrize("table_kind", ["float64", "complex64", "rows_sliced", "pairs_strided",
                                        "misaligned"])
def test_norm_table_forms(table_kind):
    """The vector kernels read an opmath table with 16-byte aligned rows; other tables reach
    them as a converted copy with the same values (make_norm_vector_inputs)."""
    gen = torch.Generator().manual_seed(16)
    q, k, kwargs = make_case("bshd", torch.bfloat16, 64, gen)
    table = table_form(table_kind)
    for interleaved in (True, False):
        launches = check_norm(q, k, table, kwargs, interleaved, gen)
        assert all(line.startswith("norm vector=1") for line in launches), launches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_heads_per_item(dtype):
    """A group takes several heads of one token per iteration on the vector path (64 bytes of
    loads per thread: x, and the gradient in backward), one on the scalar path; head counts
    that are no multiple of it leave a short last item."""
    gen = torch.Generator().manual_seed(17)
    q, k, kwargs = make_case("many_heads", dtype, 128, gen)  # 70 and 6 heads
    chunks = {2: 1, 4: 2, 8: 2}[q.element_size()]  # 16-byte chunks a thread holds of a lane
    for interleaved in (True, False):
        launches = check_norm(q, k, rope_ext.precompute_freqs_cis(128, P), kwargs, interleaved,
                              gen)
        for line in launches:
            held = chunks * (1 if interleaved else 2) * (2 if "backward=1" in line else 1)
            assert f" rows_per_item={max(1, 4 // held)} " in line, line


# ---- The fused RoPE + KV-cache write (rotary_kv_cache_update): csrc/cuda/kv_cache_cuda_kernel.h

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_case(layout, dtype, head_dim, gen, v_dim=None):
    """(q, k, v, slots, kwargs): k and v with fewer heads (GQA); some tokens' slots negative
    (padding), the rest distinct slots of a 6-block cache of 4 slots each."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    D, Dv = head_dim, v_dim or head_dim
    shapes = {"bshd": ((2, 5, 4), (2, 5, 2), 1, (2, 5, 1)),
              "bhsd": ((2, 4, 5), (2, 2, 5), 2, (2, 1, 5)),
              "packed": ((9, 4), (9, 1), 0, (9, 1)),
              "decode": ((5, 1, 8), (5, 1, 2), 1, (5, 1, 1))}
    q_lead, kv_lead, seq_dim, slot_shape = shapes[layout]
    q, k, v = randn(*q_lead, D), randn(*kv_lead, D), randn(*kv_lead, Dv)
    tokens = int(torch.tensor(slot_shape).prod())
    slots = torch.randperm(24, generator=gen)[:tokens]
    slots[1::4] = -1
    kwargs = dict(seq_dim=seq_dim)
    if layout in ("packed", "decode"):
        kwargs["positions"] = torch.randint(0, P, slot_shape, generator=gen)
    return q, k, v, slots.view(slot_shape), kwargs


def kv_caches(cache_dtype, kv_heads, head_dim, v_dim, cache_layout, gen):
    def cache(d):
        shape = (6, 4, kv_heads, d) if cache_layout == "NHD" else (6, kv_heads, 4, d)
        return torch.randn(*shape, generator=gen).to(cache_dtype)
    return cache(head_dim), cache(v_dim)


def check_kv(q, k, v, table, k_cache, v_cache, slots, kwargs, gpu=H200, inplace=False):
    """The emulated CUDA launches against the CPU kernel, bit for bit: q's result and both
    whole caches (so every slot the call must not write kept its contents)."""
    # Each run writes into the caches given (their strides and alignment are the case: a
    # clone would be contiguous), from the same contents.
    k_before, v_before = k_cache.clone(), v_cache.clone()

    def run():
        k_cache.copy_(k_before)
        v_cache.copy_(v_before)
        q_ = q.clone() if inplace else q
        out = rope_ext.rotary_kv_cache_update(q_, k, v, table, k_cache, v_cache, slots,
                                              inplace=inplace, **kwargs)
        assert (out is q_) == inplace and (inplace or torch.equal(q_, q))
        return out, k_cache.clone(), v_cache.clone()

    want = run()
    with emulated(gpu) as launches:
        got = run()
    for g, w in zip(got, want):
        g, w = (g.view(torch.uint8), w.view(torch.uint8)) if g.dtype in FLOAT8 else (g, w)
        assert torch.equal(g, w), (g.float() - w.float()).abs().max()
    return launches


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16),
                                               (torch.float32, torch.float32),
                                               (torch.float64, torch.float64),
                                               (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.float8_e5m2),
                                               (torch.float32, torch.float8_e4m3fn)], ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("head_dim,rotary_dim,v_dim", [(128, 128, 128), (64, 32, 96),
                                                       (12, 8, 6)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "packed", "decode"])
def test_kv_cache_matches_cpu_kernel(dtype, cache_dtype, interleaved, head_dim, rotary_dim,
                                     v_dim, layout):
    """Every layout, both cache layouts, in place and not, float8 caches with a per-tensor k
    scale and per-head v scales, partial rotary (pass-through features) and v of its own
    width; the vector path wherever the widths are whole 16-byte chunks."""
    gen = torch.Generator().manual_seed(head_dim + v_dim + len(layout))
    q, k, v, slots, kwargs = kv_case(layout, dtype, head_dim, gen, v_dim)
    kv_heads = k.shape[-2] if layout != "bhsd" else k.shape[1]
    table = rope_ext.precompute_freqs_cis(rotary_dim, P)
    n = 16 // q.element_size()
    widths = [rotary_dim if interleaved else rotary_dim // 2, head_dim - rotary_dim, v_dim]
    vector = all(w % n == 0 for w in widths)
    for cache_layout, inplace in [("NHD", False), ("HND", True)]:
        kc, vc = kv_caches(cache_dtype, kv_heads, head_dim, v_dim, cache_layout, gen)
        kw = dict(kwargs, interleaved=interleaved, cache_layout=cache_layout)
        if cache_dtype in FLOAT8:
            kw.update(k_scale=torch.tensor([0.75]), v_scale=torch.rand(kv_heads, generator=gen) + 0.5)
        launches = check_kv(q, k, v, table, kc, vc, slots, kw, inplace=inplace)
        assert len(launches) == 1 and launches[0].startswith("kv_cache "), launches
        assert f" vector={int(vector)} " in launches[0], launches[0]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_kv_cache_with_qk_norm(cache_dtype, interleaved):
    """With the QK-norm: the norm kernel into q's result and a k buffer (float32 for a float8
    cache), then the cache write of k (copied, not rotated again) and of v."""
    gen = torch.Generator().manual_seed(21)
    q, k, v, slots, kwargs = kv_case("bshd", torch.bfloat16, 128, gen)
    kc, vc = kv_caches(cache_dtype, 2, 128, 128, "NHD", gen)
    kw = dict(kwargs, interleaved=interleaved, q_weight=torch.rand(128, generator=gen).bfloat16(),
              k_weight=torch.rand(128, generator=gen).bfloat16())
    if cache_dtype in FLOAT8:
        kw.update(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0]))
    launches = check_kv(q, k, v, rope_ext.precompute_freqs_cis(128, P), kc, vc, slots, kw)
    kv = [line for line in launches if line.startswith("kv_cache ")]
    assert len(launches) == 4 and len(kv) == 2, launches
    assert " rows=(0 2 0) " in kv[0] and " rows=(0 0 2) " in kv[1], kv


@pytest.mark.parametrize("layout", ["misaligned", "odd_cache_strides"])
def test_kv_cache_scalar_path(layout):
    """Rows that cannot move as aligned 16-byte chunks take the scalar path: q one element off
    alignment, or a cache whose heads are an odd number of elements apart."""
    gen = torch.Generator().manual_seed(22)
    q, k, v, slots, kwargs = kv_case("bshd", torch.bfloat16, 64, gen)
    kc, vc = kv_caches(torch.bfloat16, 2, 64, 64, "NHD", gen)
    if layout == "misaligned":
        q = torch.randn(q.numel() + 1, generator=gen).bfloat16()[1:].view(q.shape)
    else:
        kc = torch.randn(6, 4, 2, 65, generator=gen).bfloat16()[..., :64]
    for interleaved in (True, False):
        launches = check_kv(q, k, v, rope_ext.precompute_freqs_cis(48, P), kc, vc, slots,
                            dict(kwargs, interleaved=interleaved))
        assert " vector=0 " in launches[0], launches


def test_kv_cache_grid_stride_and_static_cache():
    """One resident block, so each thread walks many items; a static [B, H_kv, max_len, D]
    cache (HND, a block per sequence) written at each sequence's own positions."""
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(3, 4, 8, 64, generator=gen).bfloat16()
    k, v = (torch.randn(3, 4, 2, 64, generator=gen).bfloat16() for _ in range(2))
    positions = torch.tensor([[5], [0], [9]]) + torch.arange(4)
    cache = torch.randn(3, 2, 16, 64, generator=gen).bfloat16()
    slots = rope_ext.static_cache_slots(positions, 16)
    launches = check_kv(q, k, v, rope_ext.precompute_freqs_cis(64, P), cache, cache.clone(),
                        slots, dict(positions=positions[..., None], cache_layout="HND"),
                        gpu=SMALL_GPU)
    assert " grid=1 " in launches[0], launches


@pytest.mark.parametrize("path", ["vector", "scalar"])
def test_kv_cache_offsets_beyond_32_bits(path):
    """A cache whose second block lies more than 2**31 elements into its storage: 64-bit
    offsets. The storage is allocated but only the view's pages are touched."""
    gen = torch.Generator().manual_seed(24)
    big = torch.empty(2**31 + 8192, dtype=torch.bfloat16)
    shift = 1 if path == "scalar" else 0
    kc = big.as_strided((2, 4, 2, 64), (2**31, 128, 64, 1), shift)
    kc.copy_(torch.randn(2, 4, 2, 64, generator=gen))
    vc = torch.randn(2, 4, 2, 64, generator=gen).bfloat16()
    q, k, v, _, kwargs = kv_case("bshd", torch.bfloat16, 64, gen)
    slots = torch.tensor([0, 7, -1, 4, 2, 5, 1, 3, 6, -1]).view(2, 5, 1)
    launches = check_kv(q, k, v, rope_ext.precompute_freqs_cis(64, P), kc, vc, slots, kwargs)
    assert " index=64 " in launches[0] and f" vector={int(path == 'vector')} " in launches[0]


def test_kv_cache_device_checks():
    """As on a GPU, the kernel checks what the CPU op checks before writing: a slot beyond the
    cache and a position beyond the table stop the launch (device-side asserts there), and two
    tokens given one slot write it twice, the race the CUDA op documents."""
    gen = torch.Generator().manual_seed(25)
    q, k, v, slots, kwargs = kv_case("packed", torch.bfloat16, 64, gen)
    kc, vc = kv_caches(torch.bfloat16, 1, 64, 64, "NHD", gen)
    table = rope_ext.precompute_freqs_cis(64, P)
    shared = slots.clone()
    shared[2] = shared[0]  # two tokens, one slot
    bad = [(slots.masked_fill(slots == slots.max(), 24), kwargs,
            "read a slot at or beyond num_blocks \\* block_size"),
           (slots, dict(kwargs, positions=kwargs["positions"] + P),
            "read a position outside \\[0, rows of freqs_cis\\)"),
           (shared, kwargs, "was written 2 times, expected 1")]
    for bad_slots, kw, message in bad:
        with emulated(), pytest.raises(RuntimeError, match=message):
            rope_ext.rotary_kv_cache_update(q, k, v, table, kc.clone(), vc.clone(), bad_slots,
                                            **kw)
