"""Fused per-head RMSNorm + RoPE (rope_ext.rms_norm_rotary_qk): against the float64
reference, in place, every layout, MRoPE, gradients (gradcheck and the eager composition),
opcheck, torch.compile and bad input."""

import contextlib
import re

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import rope_ext
from conftest import DTYPES, assert_matches_reference
from rope_ext import _native, reference

OPS = torch.ops.rope_ext


def table(rotary_dim, rows=64, device="cpu"):
    return rope_ext.precompute_freqs_cis(rotary_dim, rows, device=device)


def weights(head_dim, dtype, gen):
    return (torch.randn(head_dim, generator=gen) * 0.5 + 1).to(dtype)


def expected(x, w, freqs_cis, **kwargs):
    """The float64 reference, before any in-place call."""
    return reference.rms_norm_rotary(x.double(), w.double(), freqs_cis.to(torch.complex128),
                                     **kwargs)


# (name, q, k, call kwargs) with q, k made by a function of (dtype, gen): the layouts of
# apply_rotary_qk.
def _layouts():
    def bshd(dtype, gen):
        return (torch.randn(2, 8, 4, 64, generator=gen).to(dtype),
                torch.randn(2, 8, 2, 64, generator=gen).to(dtype), {})

    def bhsd(dtype, gen):  # Hugging Face: q_norm's output transposed, a view
        q = torch.randn(2, 8, 4, 64, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(2, 8, 2, 64, generator=gen).to(dtype).transpose(1, 2)
        return q, k, dict(seq_dim=2)

    def positions(dtype, gen):
        q, k, _ = bshd(dtype, gen)
        return q, k, dict(positions=torch.randint(0, 60, (2, 8, 1), generator=gen), offset=3)

    def packed(dtype, gen):  # [T, H, D] with per-token positions
        pos = torch.randint(0, 64, (12, 1), generator=gen)
        return (torch.randn(12, 4, 64, generator=gen).to(dtype),
                torch.randn(12, 2, 64, generator=gen).to(dtype), dict(positions=pos, seq_dim=0))

    def fused_qkv(dtype, gen):  # q and k as views of one projection
        qkv = torch.randn(2, 8, 8, 64, generator=gen).to(dtype)
        return qkv[:, :, :4], qkv[:, :, 4:6], {}

    def strided_features(dtype, gen):
        q = torch.randn(2, 8, 4, 128, generator=gen).to(dtype)[..., ::2]
        k = torch.randn(2, 8, 2, 128, generator=gen).to(dtype)[..., ::2]
        return q, k, {}

    def decode(dtype, gen):
        return (torch.randn(16, 1, 4, 64, generator=gen).to(dtype),
                torch.randn(16, 1, 2, 64, generator=gen).to(dtype), dict(offset=40))

    return [("bshd", bshd), ("bhsd", bhsd), ("positions", positions), ("packed", packed),
            ("fused_qkv", fused_qkv), ("strided_features", strided_features),
            ("decode", decode)]


LAYOUTS = _layouts()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_matches_reference(device, dtype, interleaved, layout):
    gen = torch.Generator().manual_seed(0)
    q, k, kwargs = layout[1](dtype, gen)
    if q._base is not None and q._base is k._base:  # views of one tensor: keep them so
        base = q._base.to(device)
        q, k = base.as_strided(q.shape, q.stride(), q.storage_offset()), \
            base.as_strided(k.shape, k.stride(), k.storage_offset())
    q, k = q.to(device), k.to(device)
    kwargs = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}
    wq, wk = weights(64, torch.float32, gen).to(device), weights(64, dtype, gen).to(device)
    freqs = table(64, device=device)
    q_ref = expected(q, wq, freqs, interleaved=interleaved, **kwargs)
    k_ref = expected(k, wk, freqs, interleaved=interleaved, **kwargs)
    q_out, k_out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, interleaved=interleaved,
                                               **kwargs)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert_matches_reference(q_out, q_ref)
    assert_matches_reference(k_out, k_ref)
    # In place: the same bits, in the same memory.
    q_in, k_in = q.clone(), k.clone()
    if layout[0] == "fused_qkv":
        qkv = q._base.clone() if q._base is not None else None
        q_in, k_in = qkv[:, :, :4], qkv[:, :, 4:6]
    returned = rope_ext.rms_norm_rotary_qk(q_in, k_in, wq, wk, freqs, interleaved=interleaved,
                                           inplace=True, **kwargs)
    assert returned[0] is q_in and returned[1] is k_in
    torch.testing.assert_close(q_in, q_out, atol=0, rtol=0)
    torch.testing.assert_close(k_in, k_out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 64), (80, 80), (72, 40), (6, 4),
                                                 (256, 256)])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_head_dims_partial_rotary_and_offset(device, dtype, head_dim, rotary_dim, weight_offset):
    """The norm covers the whole head_dim; the pass-through features are normalised too."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 5, 3, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(1, 5, 1, head_dim, generator=gen).to(dtype).to(device)
    wq, wk = (weights(head_dim, dtype, gen).to(device) for _ in range(2))
    freqs = table(rotary_dim, device=device)
    for interleaved in (True, False):
        kwargs = dict(interleaved=interleaved, weight_offset=weight_offset, eps=1e-5)
        q_out, k_out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, **kwargs)
        assert_matches_reference(q_out, expected(q, wq, freqs, **kwargs))
        assert_matches_reference(k_out, expected(k, wk, freqs, **kwargs))


def test_matches_rms_norm_then_rope(device):
    """float32: F.rms_norm then the rotation, to float32 rounding."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 16, 8, 128, generator=gen).to(device)
    k = torch.randn(2, 16, 2, 128, generator=gen).to(device)
    wq, wk = (weights(128, torch.float32, gen).to(device) for _ in range(2))
    freqs = table(128, device=device)
    q_out, k_out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, interleaved=False)
    q_two, k_two = rope_ext.apply_rotary_qk(F.rms_norm(q, (128,), wq, 1e-6),
                                            F.rms_norm(k, (128,), wk, 1e-6), freqs,
                                            interleaved=False)
    torch.testing.assert_close(q_out, q_two, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(k_out, k_two, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_blocks_of_rows(device, dtype, interleaved, head_dim):
    """A token's heads are normalised in blocks of rows (on the CPU up to 64, q's and k's
    heads of a token together), their sums reduced together: every head count around a
    block's size matches the reference, and gives the bits of the same rows taken one at a
    time (a contiguous [B, H, S, D], whose rows along the sequence each have a position of
    their own); a NaN or inf row spoils only itself."""
    gen = torch.Generator().manual_seed(11)
    freqs = table(head_dim, device=device)
    for heads, kv_heads in [(1, 1), (2, 1), (3, 2), (15, 5), (16, 8), (17, 3), (37, 1),
                            (32, 8), (56, 8), (63, 2), (64, 1), (70, 3), (5, 100)]:
        q = (torch.randn(2, 5, heads, head_dim, generator=gen) * 3).to(dtype).to(device)
        k = torch.randn(2, 5, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        if heads > 2:  # a row of NaN and a row of inf in one token's block
            q[0, 1, 1] = float("nan")
            q[1, 3, heads - 1] = float("inf")
        wq, wk = weights(head_dim, dtype, gen).to(device), weights(head_dim, dtype, gen).to(device)
        kwargs = dict(interleaved=interleaved, offset=2)
        q_out, k_out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, **kwargs)
        finite = torch.ones(2, 5, heads, dtype=torch.bool, device=device)
        if heads > 2:
            finite[0, 1, 1] = finite[1, 3, heads - 1] = False
            assert q_out[~finite].isnan().all()
        assert_matches_reference(q_out[finite], expected(q, wq, freqs, **kwargs)[finite])
        assert_matches_reference(k_out, expected(k, wk, freqs, **kwargs))
        q_rows, k_rows = rope_ext.rms_norm_rotary_qk(
            q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), wq, wk, freqs,
            seq_dim=2, **kwargs)
        assert torch.equal(q_rows.transpose(1, 2)[finite], q_out[finite]), (heads, kv_heads)
        assert torch.equal(k_rows.transpose(1, 2), k_out), (heads, kv_heads)
        # In place, a token's q and k rows share blocks (the CPU's token walk): the same bits.
        q_in, k_in = q.clone(), k.clone()
        rope_ext.rms_norm_rotary_qk(q_in, k_in, wq, wk, freqs, inplace=True, **kwargs)
        assert torch.equal(q_in[finite], q_out[finite]), (heads, kv_heads)
        assert torch.equal(k_in, k_out), (heads, kv_heads)
    # A decode step at one position, [B, 1, H, D] (batch and heads one dim of rows to the
    # CPU kernel, which splits them among its threads: 2,560 rows are more than a forward
    # task's 1,024 of 128 or 2,048 of 64), in place: the same bits again.
    q = torch.randn(64, 1, 32, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(64, 1, 8, head_dim, generator=gen).to(dtype).to(device)
    kwargs = dict(interleaved=interleaved, offset=50)
    q_out, k_out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, **kwargs)
    assert_matches_reference(q_out, expected(q, wq, freqs, **kwargs))
    assert_matches_reference(k_out, expected(k, wk, freqs, **kwargs))
    rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, inplace=True, **kwargs)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)


def test_zero_rows_and_empty(device):
    """An all-zero row stays zero (its scale is 1 / sqrt(eps)); an empty q is no work."""
    q = torch.zeros(1, 3, 2, 16, device=device)
    k = torch.randn(1, 3, 1, 16, device=device)
    w = torch.ones(16, device=device)
    q_out, _ = rope_ext.rms_norm_rotary_qk(q, k, w, w, table(16, device=device))
    assert torch.equal(q_out, q)
    empty = torch.empty(1, 0, 2, 16, device=device)
    q_out, k_out = rope_ext.rms_norm_rotary_qk(empty, empty[:, :, :1], w, w,
                                               table(16, device=device))
    assert q_out.shape == empty.shape and k_out.shape == (1, 0, 1, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mrope(device, dtype, interleaved):
    """Qwen3-VL normalises q and k per head before its MRoPE."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 10, 64, generator=gen).to(dtype).to(device)  # [B, H, S, D]
    k = torch.randn(1, 1, 10, 64, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 30, (3, 1, 1, 10), generator=gen).to(device)
    wq, wk = (weights(64, torch.float32, gen).to(device) for _ in range(2))
    freqs = table(64, device=device)
    for section, mi in (([8, 12, 12], False), ([12, 10, 10], True)):
        kwargs = dict(positions=positions, interleaved=interleaved, mrope_section=section,
                      mrope_interleaved=mi)
        q_out, k_out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, **kwargs)
        assert_matches_reference(q_out, expected(q, wq, freqs, **kwargs))
        assert_matches_reference(k_out, expected(k, wk, freqs, **kwargs))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("offset", [0, 3])
def test_gradcheck(device, interleaved, weight_offset, offset):
    gen = torch.Generator().manual_seed(4)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device).requires_grad_()

    q, k = leaf(2, 5, 3, 16), leaf(2, 5, 1, 16)
    wq, wk = leaf(16), leaf(16)
    freqs = torch.view_as_real(rope_ext.precompute_freqs_cis(12, 11, dtype=torch.float64,
                                                              device=device)).clone()
    freqs.requires_grad_()
    pos = torch.randint(0, 8, (2, 5, 1), generator=gen).to(device)

    def fn(q, k, wq, wk, freqs):
        return rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, positions=pos, offset=offset,
                                           interleaved=interleaved, weight_offset=weight_offset)

    assert torch.autograd.gradcheck(fn, (q, k, wq, wk, freqs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[4]],
                         ids=["bshd", "bhsd", "fused_qkv"])
@pytest.mark.parametrize("inplace", [False, True])
def test_gradients_match_eager_composition(device, dtype, layout, inplace):
    """Gradients of q, k and both weights against autograd of F.rms_norm + the rotation
    (float32 statistics), with a loss that weighs every output."""
    gen = torch.Generator().manual_seed(5)
    q0, k0, kwargs = layout[1](dtype, gen)
    base = q0._base if layout[0] == "fused_qkv" else None
    w0 = [weights(64, torch.float32, gen) for _ in range(2)]
    freqs = table(64, device=device)
    grads = None

    def run(fused):
        nonlocal grads
        src = (base if base is not None else torch.cat([q0.flatten(), k0.flatten()])).to(device)
        leaf = src.clone().requires_grad_()
        ws = [w.to(device).clone().requires_grad_() for w in w0]
        if base is not None:
            x = leaf * 1
            q, k = x[:, :, :4], x[:, :, 4:6]
        else:
            q = leaf[:q0.numel()].view(q0.shape)
            k = leaf[q0.numel():].view(k0.shape)
            if "seq_dim" in kwargs:  # the transposed layout, as a view
                q = leaf[:q0.numel()].view(q0.transpose(1, 2).shape).transpose(1, 2)
                k = leaf[q0.numel():].view(k0.transpose(1, 2).shape).transpose(1, 2)
            q, k = q * 1, k * 1
        if fused:
            qo, ko = rope_ext.rms_norm_rotary_qk(q, k, ws[0], ws[1], freqs, interleaved=False,
                                                 inplace=inplace, **kwargs)
        else:
            qn = F.rms_norm(q.float(), (64,), ws[0], 1e-6)
            kn = F.rms_norm(k.float(), (64,), ws[1], 1e-6)
            qo, ko = rope_ext.apply_rotary_qk(qn, kn, freqs, interleaved=False, **kwargs)
            qo, ko = qo.to(dtype), ko.to(dtype)
        if grads is None:
            grads = [torch.randn(o.shape, generator=gen).to(dtype).to(device) for o in (qo, ko)]
        ((qo.float() * grads[0].float()).sum() + (ko.float() * grads[1].float()).sum()).backward()
        return leaf.grad, ws[0].grad, ws[1].grad

    fused, eager = run(True), run(False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused[0].float(), eager[0].float(), **tol)
    # The weights' gradients sum over 64-256 rows in float32 on both sides.
    torch.testing.assert_close(fused[1], eager[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused[2], eager[2], atol=1e-4, rtol=1e-4)


def test_weight_gradient_dtype_follows_weight(device):
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16, device=device, requires_grad=True)
    k = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16, device=device, requires_grad=True)
    wq = torch.ones(16, dtype=torch.bfloat16, device=device, requires_grad=True)
    wk = torch.ones(16, device=device, requires_grad=True)
    qo, ko = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, table(16, device=device))
    (qo.float().sum() + ko.float().sum()).backward()
    assert wq.grad.dtype == torch.bfloat16 and wk.grad.dtype == torch.float32
    assert q.grad.dtype == torch.bfloat16


def opcheck_samples(device):
    gen = torch.Generator().manual_seed(6)

    def randn(*shape, dtype=torch.float32, grad=False):
        return torch.randn(*shape, generator=gen).to(dtype).to(device).requires_grad_(grad)

    freqs = torch.view_as_real(table(16, 12, device=device)).clone()
    pos = torch.randint(0, 10, (2, 4, 1), generator=gen).to(device)
    return [
        (randn(2, 4, 3, 16, grad=True), randn(2, 4, 1, 16, grad=True), randn(16, grad=True),
         randn(16, grad=True), freqs, None, 0, 1, True, 1e-6, 0.0),
        (randn(2, 4, 3, 16, dtype=torch.bfloat16), randn(2, 4, 1, 16, dtype=torch.bfloat16),
         randn(16), randn(16, dtype=torch.bfloat16), freqs, pos, 2, 1, False, 1e-5, 1.0),
        (randn(2, 4, 3, 16).transpose(1, 2), randn(2, 4, 1, 16).transpose(1, 2), randn(16),
         randn(16), freqs.clone().requires_grad_(), None, 0, 2, False, 1e-6, 0.0),
    ]


def test_opcheck(device):
    for args in opcheck_samples(device):
        torch.library.opcheck(OPS.rms_norm_rotary_qk.default, args)
        q, k = args[0].detach().clone(), args[1].detach().clone()
        inplace_args = (q, k) + tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                      for a in args[2:])
        torch.library.opcheck(OPS.rms_norm_rotary_qk_.default, inplace_args)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        grads = (torch.randn_like(detached[0]), torch.randn_like(detached[1]))
        torch.library.opcheck(OPS.rms_norm_rotary_qk_backward.default, grads + detached)


@pytest.mark.parametrize("inplace", [False, True])
def test_compile_fullgraph_dynamic(device, inplace):
    """One graph, no recompiles over sequence lengths, results equal to eager."""
    counter = torch._dynamo.testing.CompileCounter()
    wq = torch.randn(64, device=device)
    wk = torch.randn(64, device=device)
    freqs = table(64, 128, device=device)

    def fn(q, k):
        q = q * 2
        k = k * 2
        return rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, interleaved=False,
                                           inplace=inplace, weight_offset=1.0)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for seq in (5, 9, 17):
        q = torch.randn(2, seq, 4, 64, device=device)
        k = torch.randn(2, seq, 2, 64, device=device)
        for got, want in zip(compiled(q, k), fn(q, k)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert counter.frame_count == 1


def test_compile_inductor_backward(device):
    """Inductor, forward and backward, against eager."""
    wq = torch.randn(32, device=device, requires_grad=True)
    wk = torch.randn(32, device=device, requires_grad=True)
    freqs = table(32, 64, device=device)

    def fn(q, k):
        qo, ko = rope_ext.rms_norm_rotary_qk(q * 1, k * 1, wq, wk, freqs)
        return (qo * qo).sum() + ko.sum()

    q = torch.randn(2, 7, 4, 32, device=device, requires_grad=True)
    k = torch.randn(2, 7, 2, 32, device=device, requires_grad=True)
    fn(q, k).backward()
    eager = [t.grad.clone() for t in (q, k, wq, wk)]
    for t in (q, k, wq, wk):
        t.grad = None
    torch.compile(fn, fullgraph=True)(q, k).backward()
    for t, want in zip((q, k, wq, wk), eager):
        torch.testing.assert_close(t.grad, want, atol=1e-5, rtol=1e-5)


def test_fallback_matches_native():
    """The eager fallback (no native kernel for the device) computes the same function."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 6, 4, 32, generator=gen).bfloat16()
    k = torch.randn(2, 6, 2, 32, generator=gen).bfloat16()
    w = weights(32, torch.float32, gen)
    freqs = table(32)
    native = rope_ext.rms_norm_rotary_qk(q, k, w, w, freqs, interleaved=False)
    try:
        saved, _native.NATIVE_DEVICES = _native.NATIVE_DEVICES, frozenset()
        with pytest.warns(RuntimeWarning, match="no native kernel"):
            eager = rope_ext.rms_norm_rotary_qk(q, k, w, w, freqs, interleaved=False)
    finally:
        _native.NATIVE_DEVICES = saved
    for a, b in zip(native, eager):
        torch.testing.assert_close(a.float(), b.float(), atol=1.6e-2, rtol=8e-3)


# Bad input: (name, op, args, kwargs, error, message), args as the op takes them.
def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


_T = torch.view_as_real(table(16, 8))
_W = torch.ones(16)
NORM = "rms_norm_rotary_qk"
ERROR_CASES = [
    ("weight length", NORM, (_x(1, 4, 2, 16), _x(1, 4, 1, 16), torch.ones(8), _W, _T), {},
     ValueError, "rms_norm_rotary_qk: q_weight must have shape [16] (the head_dim of q), got [8]"),
    ("weight rank", NORM, (_x(1, 4, 2, 16), _x(1, 4, 1, 16), _W, torch.ones(1, 16), _T), {},
     ValueError,
     "rms_norm_rotary_qk: k_weight must have shape [16] (the head_dim of k), got [1, 16]"),
    ("weight dtype", NORM,
     (_x(1, 4, 2, 16, dtype=torch.bfloat16), _x(1, 4, 1, 16, dtype=torch.bfloat16),
      torch.ones(16, dtype=torch.float16), _W, _T), {}, TypeError,
     "rms_norm_rotary_qk: q_weight must be float32 or q's dtype BFloat16, got Half"),
    ("weight float64 for float32 x", NORM,
     (_x(1, 4, 2, 16), _x(1, 4, 1, 16), _W, torch.ones(16, dtype=torch.float64), _T), {},
     TypeError, "rms_norm_rotary_qk: k_weight must be float32 or k's dtype Float, got Double"),
    ("eps zero", NORM, (_x(1, 4, 2, 16), _x(1, 4, 1, 16), _W, _W, _T), dict(eps=0.0),
     ValueError, "rms_norm_rotary_qk: eps must be a positive finite number, got 0"),
    ("eps negative", NORM, (_x(1, 4, 2, 16), _x(1, 4, 1, 16), _W, _W, _T), dict(eps=-1e-6),
     ValueError, "rms_norm_rotary_qk: eps must be a positive finite number, got -1e-06"),
    ("eps nan", NORM, (_x(1, 4, 2, 16), _x(1, 4, 1, 16), _W, _W, _T), dict(eps=float("nan")),
     ValueError, "rms_norm_rotary_qk: eps must be a positive finite number, got nan"),
    ("head_dim mismatch", NORM, (_x(1, 4, 2, 16), _x(1, 4, 1, 32), _W, _W, _T), {},
     ValueError, "rms_norm_rotary_qk: q and k must have the same head_dim, got 16 and 32"),
    ("rotary dim too large", NORM, (_x(1, 4, 2, 8), _x(1, 4, 1, 8), _W[:8], _W[:8], _T), {},
     ValueError, "rms_norm_rotary_qk: rotary dim 2 * freqs_cis.shape[1] = 16 exceeds q's "
     "head_dim 8"),
    ("sequence past table", NORM, (_x(1, 6, 2, 16), _x(1, 6, 1, 16), _W, _W, _T),
     dict(offset=3), ValueError,
     "rms_norm_rotary_qk: offset + q.shape[seq_dim] = 3 + 6 exceeds the 8 rows of freqs_cis"),
    ("integer q", NORM, (torch.ones(1, 4, 2, 16, dtype=torch.int64), _x(1, 4, 1, 16), _W, _W,
                         _T), {}, TypeError,
     "rms_norm_rotary_qk: q must be a float16, bfloat16, float32 or float64 tensor, got Long"),
]


def _run(op, args, kwargs):
    return getattr(OPS, op)(*args, **kwargs)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_native_error(case, inplace):
    _, op, args, kwargs, error, message = case
    op = op + "_" if inplace else op
    message = message.replace(case[1] + ":", op + ":")
    tensors = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in tensors]
    with pytest.raises(error, match=re.escape(message)):
        _run(op, tensors, kwargs)
    for a, b in zip(tensors, before):  # a rejected call writes nothing
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_fake_kernel_mirrors_error(case):
    _, op, args, kwargs, error, message = case
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(error, match=re.escape(message)):
            _run(op, fake, kwargs)


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_fallback_mirrors_error(case, monkeypatch):
    _, _, (q, k, wq, wk, freqs), kwargs, error, message = case
    monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    with pytest.raises(error, match=re.escape(message)):
        rope_ext.rms_norm_rotary_qk(q, k, wq, wk, freqs, **kwargs)


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_backward_op_mirrors_error(case):
    _, _, args, kwargs, error, message = case
    message = message.replace("rms_norm_rotary_qk:", "rms_norm_rotary_qk_backward:")
    grads = (torch.zeros(args[0].shape, dtype=args[0].dtype),
             torch.zeros(args[1].shape, dtype=args[1].dtype))
    with pytest.raises(error, match=re.escape(message)):
        OPS.rms_norm_rotary_qk_backward(*grads, *args, **kwargs)


def test_weight_device_mismatch_meta():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=re.escape(
            "rms_norm_rotary_qk: q_weight is on meta but q is on cpu")):
        OPS.rms_norm_rotary_qk(q, q[:, :, :1], torch.ones(16, device="meta"), _W, _T)


@pytest.mark.parametrize("fake", [False, True], ids=["native", "fake"])
def test_grads_checked(fake):
    q, k = _x(1, 4, 2, 16), _x(1, 4, 1, 16)
    cases = [
        ((k, k), ValueError, "rms_norm_rotary_qk_backward: grad_q and grad_k must have the "
         "shapes of q and k, [1, 4, 2, 16] and [1, 4, 1, 16], got [1, 4, 1, 16] and [1, 4, 1, 16]"),
        ((q, k.double()), TypeError, "rms_norm_rotary_qk_backward: grad_q and grad_k must have "
         "the dtypes of q and k, Float and Float, got Float and Double"),
    ]
    for grads, error, message in cases:
        args = (*grads, q, k, _W, _W, _T)
        with FakeTensorMode() if fake else contextlib.nullcontext() as mode:
            if fake:
                args = [mode.from_tensor(a) for a in args]
            with pytest.raises(error, match=re.escape(message)):
                OPS.rms_norm_rotary_qk_backward(*args)


@pytest.mark.parametrize("native", [True, False])
def test_inplace_overlap_rejected_before_writing(native, monkeypatch):
    if not native:
        monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    qkv = _x(1, 4, 3, 16)
    before = qkv.clone()
    with pytest.raises(ValueError, match="rms_norm_rotary_qk_: q and k overlap in memory"):
        rope_ext.rms_norm_rotary_qk(qkv[:, :, :2], qkv[:, :, 1:], _W, _W, _T, inplace=True)
    assert torch.equal(qkv, before)
    # q, then k, whose heads share memory (expanded from one head)
    for q, k, name in [(qkv[:, :, :1].expand(1, 4, 2, 16), qkv[:, :, 2:], "q"),
                       (qkv[:, :, :2], qkv[:, :, 2:].expand(1, 4, 2, 16), "k")]:
        with pytest.raises(ValueError, match=f"rms_norm_rotary_qk_: {name} has overlapping "
                           "memory"):
            rope_ext.rms_norm_rotary_qk(q, k, _W, _W, _T, inplace=True)
        assert torch.equal(qkv, before)
    with torch.enable_grad():  # the autograd path checks first too
        w = _W.clone().requires_grad_()
        with pytest.raises(ValueError, match="rms_norm_rotary_qk_: q and k overlap in memory"):
            rope_ext.rms_norm_rotary_qk(qkv[:, :, :2], qkv[:, :, 1:], w, _W, _T, inplace=True)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("native", [True, False])
def test_positions_out_of_range_write_nothing(native, monkeypatch):
    if not native:
        monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    q, k = _x(1, 4, 2, 16), _x(1, 4, 1, 16)
    before = q.clone()
    with pytest.raises(IndexError, match=re.escape(
            "rms_norm_rotary_qk_: offset + positions must lie in [0, 8) (the rows of "
            "freqs_cis), got values in [0, 8]")):
        rope_ext.rms_norm_rotary_qk(q, k, _W, _W, _T, positions=torch.tensor([0, 8, 1, 2]).view(1, 4, 1),
                                    inplace=True)
    assert torch.equal(q, before)
