"""In-place calls under torch.compile with dynamic shapes, on views of one projection.

Inductor drops the storage offset of a view that a custom op mutates when that offset is a
symbol (pytorch/pytorch#198068): q [B, S, 3, H, D][:, :, 0] and k [..., 1] were both written
at offset 0, with no error. The ops' autograd kernels trace such calls as the functional op
and copy_ (csrc/autograd_common.h). Here every in-place entry, through the wrappers and
through torch.ops, rotates q and k taken three ways (views of a [B, S, 3, H, D] qkv, views of
a packed [B, S, (Hq + 2 Hkv) * D] projection, plain tensors), compiled with dynamic=True and
with automatic dynamic shapes (recompiled at the second length), with and without gradients.
Values and gradients must equal eager's bit for bit, the untouched v included.
"""

import pytest
import torch

import rope_ext

OPS = torch.ops.rope_ext
HQ, HKV, D = 4, 2, 32
LENGTHS = (10, 14, 22)  # none duck-sizes with another dim


def qkv_views(qkv):  # [B, S, 3, HKV, D]: q and k of equal head counts
    return qkv[:, :, 0], qkv[:, :, 1]


def packed_views(proj):  # [B, S, (HQ + 2 HKV) * D]
    b, s, _ = proj.shape
    q = proj[..., :HQ * D].view(b, s, HQ, D)
    k = proj[..., HQ * D:(HQ + HKV) * D].view(b, s, HKV, D)
    return q, k


def weights(device, grad):
    gen = torch.Generator().manual_seed(1)
    return [(torch.rand(D, generator=gen) + 0.5).to(device).requires_grad_(grad)
            for _ in range(2)]


# Each entry rotates q and k in place: (q, k, complex table, norm weights) -> None.
ENTRIES = {
    "apply_rotary": lambda q, k, t, w: (rope_ext.apply_rotary(q, t, inplace=True),
                                        rope_ext.apply_rotary(k, t, inplace=True)),
    "apply_rotary_qk": lambda q, k, t, w: rope_ext.apply_rotary_qk(
        q, k, t, interleaved=False, inplace=True),
    "rms_norm_rotary_qk": lambda q, k, t, w: rope_ext.rms_norm_rotary_qk(
        q, k, *w, t, inplace=True),
    # Under torch.compile the wrappers call these same overloads; one direct call stands for
    # the torch.ops users (the suite runs in several CI stages, and each entry compiles 6 times).
    "ops.apply_rotary_qk_": lambda q, k, t, w: OPS.apply_rotary_qk_(
        q, k, torch.view_as_real(t), None, 0, 1, False),
}


def rotate_all_three(entry, qkv, proj, q, k, table, w):
    """entry on q and k as views of qkv, as views of proj, and as plain tensors; returns the
    three buffers whole (made here, so that the inputs stay as they were)."""
    qkv, proj, q, k = qkv * 1, proj * 1, q * 1, k * 1
    for views in (qkv_views(qkv), packed_views(proj), (q, k)):
        entry(*views, table, w)
    return qkv, proj, q, k


def inputs(device, seq, grad):
    gen = torch.Generator().manual_seed(seq)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_(grad)

    return (randn(2, seq, 3, HKV, D), randn(2, seq, (HQ + 2 * HKV) * D), randn(2, seq, HQ, D),
            randn(2, seq, HKV, D))


def results(fn, device, seq, grad, w):
    """fn's outputs and, with grad, the gradients of a fixed random projection of them with
    respect to every input and weight."""
    xs = inputs(device, seq, grad)
    table = rope_ext.precompute_freqs_cis(D, 64, device=device)
    outs = fn(*xs, table, w)
    if not grad:
        return list(outs)
    gen = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(device)).sum() for o in outs)
    leaves = list(xs) + [x for x in w if x.requires_grad]
    return list(outs) + list(torch.autograd.grad(loss, leaves))


NAMES = ["qkv view", "packed view", "plain q", "plain k"]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic_dynamic"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_entries_match_eager_bit_for_bit(device, entry, dynamic, grad):
    torch._dynamo.reset()
    w = weights(device, grad and "norm" in entry)

    def fn(qkv, proj, q, k, table, w):
        return rotate_all_three(ENTRIES[entry], qkv, proj, q, k, table, w)

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for seq in LENGTHS:
        got = results(compiled, device, seq, grad, w)
        want = results(fn, device, seq, grad, w)
        names = NAMES + [f"grad of {n}" for n in NAMES] + ["grad of q_weight", "grad of k_weight"]
        for name, g, e in zip(names, got, want):
            assert torch.equal(g, e), (
                f"{entry}, seq {seq}: {name} differs from eager by "
                f"{(g - e).abs().max().item():.3g}")


def test_inplace_under_inference_mode(device):
    """Inference tensors skip autograd's dispatch keys in eager; the trace still takes the
    copy_ path (the case a serving loop compiles)."""
    torch._dynamo.reset()

    def fn(qkv, table):
        qkv = qkv * 1
        rope_ext.apply_rotary_qk(*qkv_views(qkv), table, inplace=True)
        return qkv

    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    table = rope_ext.precompute_freqs_cis(D, 64, device=device)
    with torch.inference_mode():
        for seq in LENGTHS:
            qkv = torch.randn(2, seq, 3, HKV, D, device=device)
            assert torch.equal(compiled(qkv, table), fn(qkv, table))


def overlap_refused(entry, device, split):
    """entry on q, k = split(x) for a [3, S, HKV + 1, D] x, compiled with dynamic=True, must raise
    an overlap error and leave x as it was."""
    torch._dynamo.reset()
    w = weights(device, False)

    def fn(x, table):
        ENTRIES[entry](*split(x), table, w)

    table = rope_ext.precompute_freqs_cis(D, 64, device=device)
    x = torch.randn(3, 12, HKV + 1, D, device=device)
    before = x.clone()
    with pytest.raises(Exception, match="overlap in memory"):
        torch.compile(fn, dynamic=True, fullgraph=True)(x, table)
    assert torch.equal(x, before)


@pytest.mark.parametrize("entry", ["apply_rotary_qk", "rms_norm_rotary_qk"])
def test_traced_inplace_refuses_overlap(device, entry):
    """The copy_ path keeps the in-place op's checks: q = x[0:2] and k = x[1:3], both dense
    and k at a symbolic offset, overlap in a way the trace decides."""
    overlap_refused(entry, device, lambda x: (x[0:2], x[1:3]))


@pytest.mark.skipif(not hasattr(torch._library.utils, "is_impure"),
                    reason="this torch's Inductor drops ops without outputs, side-effecting or "
                    "not: an overlap the trace cannot decide goes unchecked at run time")
@pytest.mark.parametrize("entry", ["apply_rotary_qk", "rms_norm_rotary_qk"])
def test_traced_inplace_refuses_overlap_at_run_time(device, entry):
    """Heads [0, HKV) and [1, HKV + 1) of x overlap in a way symbolic strides cannot decide:
    the check_inplace op stays in the compiled graph and refuses the call at run time, before
    anything is written."""
    overlap_refused(entry, device, lambda x: (x[:, :, :HKV], x[:, :, 1:]))


@pytest.mark.parametrize("entry", ["apply_rotary_qk", "rms_norm_rotary_qk"])
def test_eager_inplace_with_grad_checks_the_pair(device, entry):
    """With gradients, apply_rotary_qk_ rotates q and k one Function each: the pair's checks
    (overlap, agreeing dims) still run first, under the in-place op's name, and a refused
    call writes nothing."""
    w = weights(device, False)
    table = rope_ext.precompute_freqs_cis(D, 64, device=device)
    base = torch.randn(2, 12, HKV + 2, D, device=device, requires_grad=True)
    x = base * 1
    before = x.detach().clone()
    with pytest.raises(ValueError, match=f"{entry}_: q and k overlap in memory"):
        ENTRIES[entry](x[:, :, :HKV], x[:, :, 1:HKV + 1], table, w)
    with pytest.raises(ValueError, match=f"{entry}_: q and k must agree on dim 1"):
        ENTRIES[entry](x[:, :6, :HKV], x[:, :, HKV:], table, w)
    assert torch.equal(x.detach(), before)
