"""Fake kernels for torch.compile / FakeTensor: the C++ checks, then outputs shaped and
strided as the real kernels make them (empty_like, as the C++ ops allocate)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import _checks


def _real_frequencies(dim, theta, scaling):
    """The real rope_frequencies op (host arithmetic, no tensor inputs): its checks and values
    are the fake kernels' too, word for word."""
    with unset_fake_temporarily():
        return torch.ops.rope_ext.rope_frequencies.default(dim, theta, **scaling)


@torch.library.register_fake("rope_ext::precompute_freqs_cis")
def _(dim, end, theta=10000.0, *, dtype=None, device=None, **scaling):
    dtype = torch.float32 if dtype is None else dtype
    _checks.check_precompute_args(dim, end, theta, dtype)
    _real_frequencies(dim, theta, scaling)
    return torch.empty(end, dim // 2, 2, dtype=dtype, device=device or "cpu")


@torch.library.register_fake("rope_ext::rope_frequencies")
def _(dim, theta=10000.0, **scaling):
    inv_freq, attention_factor = _real_frequencies(dim, theta, scaling)
    return torch.empty_like(inv_freq), attention_factor


@torch.library.register_fake("rope_ext::fill_freqs_cis_")
def _(out, inv_freq, magnitude):
    _checks.check_freqs_table(out, inv_freq)


@torch.library.register_fake("rope_ext::apply_rotary")
def _(x, freqs_cis, positions=None, offset=0, seq_dim=1, interleaved=True, inverse=False,
      mrope_section=None, mrope_interleaved=False):
    _checks.check_apply_args("apply_rotary", "x", x, freqs_cis, positions, offset, seq_dim,
                             mrope_section, mrope_interleaved)
    return torch.empty_like(x)


@torch.library.register_fake("rope_ext::apply_rotary_")
def _(x, freqs_cis, positions=None, offset=0, seq_dim=1, interleaved=True, inverse=False,
      mrope_section=None, mrope_interleaved=False):
    op = "apply_rotary_"
    _checks.check_apply_args(op, "x", x, freqs_cis, positions, offset, seq_dim, mrope_section,
                             mrope_interleaved)
    _checks.check_inplace_target(op, "x", x)


@torch.library.register_fake("rope_ext::apply_rotary_qk")
def _(q, k, freqs_cis, positions=None, offset=0, seq_dim=1, interleaved=True, inverse=False,
      mrope_section=None, mrope_interleaved=False):
    _checks.check_qk_args("apply_rotary_qk", q, k, freqs_cis, positions, offset, seq_dim,
                          mrope_section, mrope_interleaved)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("rope_ext::apply_rotary_qk_")
def _(q, k, freqs_cis, positions=None, offset=0, seq_dim=1, interleaved=True, inverse=False,
      mrope_section=None, mrope_interleaved=False):
    op = "apply_rotary_qk_"
    _checks.check_qk_args(op, q, k, freqs_cis, positions, offset, seq_dim, mrope_section,
                          mrope_interleaved)
    _checks.check_inplace_target(op, "q", q)
    _checks.check_inplace_target(op, "k", k)
    _checks.check_qk_disjoint(op, q, k)


# check_inplace returns nothing: without this, a traced graph would drop it as dead code, and
# the overlap a trace cannot decide from symbolic strides would go unchecked at run time.
torch.fx.node.has_side_effect(torch.ops.rope_ext.check_inplace.default)


@torch.library.register_fake("rope_ext::check_inplace")
def _(op, targets):
    if len(targets) == 1:
        _checks.check_inplace_target(op, "x", targets[0])
        return
    q, k = targets
    _checks.check_inplace_target(op, "q", q)
    _checks.check_inplace_target(op, "k", k)
    _checks.check_qk_disjoint(op, q, k)


@torch.library.register_fake("rope_ext::rms_norm_rotary_qk")
def _(q, k, q_weight, k_weight, freqs_cis, positions=None, offset=0, seq_dim=1,
      interleaved=True, eps=1e-6, weight_offset=0.0, mrope_section=None,
      mrope_interleaved=False):
    _checks.check_norm_args("rms_norm_rotary_qk", q, k, q_weight, k_weight, freqs_cis,
                            positions, offset, seq_dim, eps, mrope_section, mrope_interleaved)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("rope_ext::rms_norm_rotary_qk_")
def _(q, k, q_weight, k_weight, freqs_cis, positions=None, offset=0, seq_dim=1,
      interleaved=True, eps=1e-6, weight_offset=0.0, mrope_section=None,
      mrope_interleaved=False):
    op = "rms_norm_rotary_qk_"
    _checks.check_norm_args(op, q, k, q_weight, k_weight, freqs_cis, positions, offset, seq_dim,
                            eps, mrope_section, mrope_interleaved)
    _checks.check_inplace_target(op, "q", q)
    _checks.check_inplace_target(op, "k", k)
    _checks.check_qk_disjoint(op, q, k)


@torch.library.register_fake("rope_ext::rms_norm_rotary_qk_backward")
def _(grad_q, grad_k, q, k, q_weight, k_weight, freqs_cis, positions=None, offset=0,
      seq_dim=1, interleaved=True, eps=1e-6, weight_offset=0.0, mrope_section=None,
      mrope_interleaved=False):
    op = "rms_norm_rotary_qk_backward"
    _checks.check_norm_args(op, q, k, q_weight, k_weight, freqs_cis, positions, offset, seq_dim,
                            eps, mrope_section, mrope_interleaved)
    _checks.check_norm_grads(op, grad_q, grad_k, q, k)

    def input_grad(grad, x):  # laid out as the kernel lays it (qk_norm_ops.h, same_layout)
        return torch.empty_like(x if grad.stride() == x.stride() else x.contiguous())

    return (input_grad(grad_q, q), input_grad(grad_k, k), torch.empty_like(q_weight),
            torch.empty_like(k_weight))


def _kv_cache_fake(op, inplace, q, k, v, freqs_cis, k_cache, v_cache, slots, positions, offset,
                   seq_dim, interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight,
                   eps, weight_offset):
    _checks.check_kv_cache_args(op, q, k, v, freqs_cis, k_cache, v_cache, slots, positions,
                                offset, seq_dim, cache_layout, k_scale, v_scale, q_weight,
                                k_weight, eps, inplace)


@torch.library.register_fake("rope_ext::rotary_kv_cache_update")
def _(q, k, v, freqs_cis, k_cache, v_cache, slots, positions=None, offset=0, seq_dim=1,
      interleaved=True, cache_layout="NHD", k_scale=None, v_scale=None, q_weight=None,
      k_weight=None, eps=1e-6, weight_offset=0.0):
    _kv_cache_fake("rotary_kv_cache_update", False, q, k, v, freqs_cis, k_cache, v_cache, slots,
                   positions, offset, seq_dim, interleaved, cache_layout, k_scale, v_scale,
                   q_weight, k_weight, eps, weight_offset)
    return torch.empty_like(q)


@torch.library.register_fake("rope_ext::rotary_kv_cache_update_")
def _(q, k, v, freqs_cis, k_cache, v_cache, slots, positions=None, offset=0, seq_dim=1,
      interleaved=True, cache_layout="NHD", k_scale=None, v_scale=None, q_weight=None,
      k_weight=None, eps=1e-6, weight_offset=0.0):
    _kv_cache_fake("rotary_kv_cache_update_", True, q, k, v, freqs_cis, k_cache, v_cache, slots,
                   positions, offset, seq_dim, interleaved, cache_layout, k_scale, v_scale,
                   q_weight, k_weight, eps, weight_offset)
