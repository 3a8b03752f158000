"""The fused RoPE + KV-cache write against its composition, bit for bit: apply_rotary_qk (or
rms_norm_rotary_qk) then an assignment of each token's rows into its cache slot, float8
caches quantised as documented; every other slot keeps its contents. Then bad input: the same
error from the op, its fake kernel and the composed fallback, and nothing written."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rope_ext
from rope_ext import _native

FLOAT8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass(frozen=True)
class Case:
    layout: str = "bshd"          # bshd (seq_dim 1), bhsd (seq_dim 2), thd (packed, seq_dim 0)
    cache_layout: str = "NHD"
    interleaved: bool = True
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None   # None: q's dtype
    per_head_scale: bool = False
    batch: int = 2
    seq: int = 5
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    v_head_dim: int = 32
    rotary_dim: int = 32
    block_size: int = 4
    padding: bool = False         # some tokens get slot -1
    norm: bool = False
    positions: bool = False
    offset: int = 0
    inplace: bool = False
    table_dtype: torch.dtype = torch.float32
    negative_seq_dim: bool = False  # seq_dim counted from the end
    # v_cache's feature dim (of size 1) given a stride other than 1, as a size-1 dim may have
    v_cache_feature_stride: int | None = None

    @property
    def seq_dim(self):
        sd = {"bshd": 1, "bhsd": 2, "thd": 0}[self.layout]
        return sd - (3 if self.layout == "thd" else 4) if self.negative_seq_dim else sd


CASES = {
    "prefill": Case(),
    "prefill-inplace": Case(inplace=True),
    "half-split": Case(interleaved=False),
    "hnd": Case(cache_layout="HND"),
    "hf-layout": Case(layout="bhsd", cache_layout="HND", interleaved=False),
    "hf-layout-nhd": Case(layout="bhsd", inplace=True),
    "packed": Case(layout="thd", positions=True, batch=1, seq=11),
    "decode": Case(seq=1, batch=5, positions=True, offset=3),
    "decode-inplace-hnd": Case(seq=1, batch=3, positions=True, cache_layout="HND", inplace=True),
    "padding": Case(padding=True, positions=True),
    "partial-rotary": Case(rotary_dim=16, interleaved=False),
    "negative-seq-dim": Case(layout="bhsd", negative_seq_dim=True, positions=True),
    "v-of-one-feature": Case(v_head_dim=1, v_cache_feature_stride=7),
    "partial-rotary-odd-pairs": Case(head_dim=40, v_head_dim=40, rotary_dim=24),
    "v-head-dim": Case(v_head_dim=24, cache_layout="HND"),
    "mha": Case(q_heads=2, kv_heads=2),
    "long-rows": Case(head_dim=128, v_head_dim=128, rotary_dim=128, q_heads=8, kv_heads=2, seq=3),
    "float32": Case(dtype=torch.float32),
    "float16": Case(dtype=torch.float16, interleaved=False),
    "float64": Case(dtype=torch.float64, table_dtype=torch.float64),
    "norm": Case(norm=True),
    "norm-inplace-hf": Case(norm=True, inplace=True, layout="bhsd", cache_layout="HND"),
    "fp8-e4m3": Case(cache_dtype=torch.float8_e4m3fn),
    "fp8-e4m3-per-head-hnd": Case(cache_dtype=torch.float8_e4m3fn, per_head_scale=True,
                                  cache_layout="HND", interleaved=False),
    "fp8-e5m2-decode": Case(cache_dtype=torch.float8_e5m2, seq=1, positions=True, padding=True),
    "fp8-float32-rows": Case(cache_dtype=torch.float8_e4m3fn, dtype=torch.float32,
                             rotary_dim=16),
    "fp8-norm": Case(cache_dtype=torch.float8_e4m3fn, norm=True, per_head_scale=True),
}


def tokens_of(c: Case):
    return (c.batch * c.seq,) if c.layout == "thd" else (c.batch, c.seq)


def make(c: Case, seed=0):
    """Inputs of one call, the caches filled with values the call must keep where it does not
    write, and the per-token slots and positions."""
    g = torch.Generator().manual_seed(seed)
    tok = tokens_of(c)
    n_tok = c.batch * c.seq

    def rows(heads, dim):
        shape = {"bshd": (c.batch, c.seq, heads, dim), "bhsd": (c.batch, heads, c.seq, dim),
                 "thd": (n_tok, heads, dim)}[c.layout]
        return (4 * torch.randn(shape, generator=g, dtype=torch.float64)).to(c.dtype)

    q, k, v = rows(c.q_heads, c.head_dim), rows(c.kv_heads, c.head_dim), rows(c.kv_heads,
                                                                              c.v_head_dim)
    span = c.offset + c.seq + 8
    table = rope_ext.precompute_freqs_cis(c.rotary_dim, span + 1, 10000.0,
                                          dtype=c.table_dtype)
    num_blocks = (2 * n_tok + c.block_size - 1) // c.block_size + 1
    slot_ids = torch.randperm(num_blocks * c.block_size, generator=g)[:n_tok]
    if c.padding:
        slot_ids[::3] = -1
    cache_dtype = c.cache_dtype or c.dtype

    def cache(dim):
        shape = ((num_blocks, c.block_size, c.kv_heads, dim) if c.cache_layout == "NHD"
                 else (num_blocks, c.kv_heads, c.block_size, dim))
        return torch.randn(shape, generator=g).to(cache_dtype)

    k_cache, v_cache = cache(c.head_dim), cache(c.v_head_dim)
    if c.v_cache_feature_stride is not None:  # and v's own feature dim likewise
        v_cache = v_cache.as_strided(v_cache.shape, (*v_cache.stride()[:3],
                                                     c.v_cache_feature_stride))
        v = v.as_strided(v.shape, (*v.stride()[:-1], c.v_cache_feature_stride))
    heads_axis = {"bshd": 2, "bhsd": 1, "thd": 1}[c.layout]
    slots = slot_ids.view(tok).unsqueeze(heads_axis)
    positions = None
    if c.positions:
        positions = torch.randint(0, span - c.offset, tok, generator=g).unsqueeze(heads_axis)
    kw = dict(positions=positions, offset=c.offset, seq_dim=c.seq_dim,
              interleaved=c.interleaved, cache_layout=c.cache_layout, inplace=c.inplace)
    if c.cache_dtype is not None:
        n_scale = c.kv_heads if c.per_head_scale else 1
        kw["k_scale"] = torch.rand(n_scale, generator=g) * 0.02 + 0.005
        kw["v_scale"] = torch.rand(n_scale, generator=g) * 0.02 + 0.005
    if c.norm:
        kw["q_weight"] = torch.randn(c.head_dim, generator=g)
        kw["k_weight"] = torch.randn(c.head_dim, generator=g)
        kw["eps"] = 1e-5
        kw["weight_offset"] = 1.0
    return q, k, v, table, k_cache, v_cache, slots, kw


def composed(c: Case, q, k, v, table, k_cache, v_cache, slots, kw):
    """The composition, written out: rotate (and norm) q and k out of place with the public
    functions, then assign each token's rows to its slot, one token at a time."""
    kw = dict(kw)
    kw.pop("inplace")
    layout = kw.pop("cache_layout")
    k_scale, v_scale = kw.pop("k_scale", None), kw.pop("v_scale", None)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rot = dict(positions=kw["positions"], offset=kw["offset"], seq_dim=kw["seq_dim"],
               interleaved=kw["interleaved"])
    float8 = c.cache_dtype is not None
    if c.norm:
        norm = dict(eps=kw["eps"], weight_offset=kw["weight_offset"], **rot)
        q_out, k_rot = rope_ext.rms_norm_rotary_qk(q, k, kw["q_weight"], kw["k_weight"], table,
                                                   **norm)
        if float8:
            _, k_rot = rope_ext.rms_norm_rotary_qk(q, k.float(), kw["q_weight"],
                                                   kw["k_weight"].float(), table, **norm)
    else:
        q_out, k_rot = rope_ext.apply_rotary_qk(q, k, table, **rot)
        if float8:
            k_rot = rope_ext.apply_rotary(k.float(), table, **rot)
    heads_axis = {"bshd": 2, "bhsd": 1, "thd": 1}[c.layout]
    k_tok = k_rot.movedim(heads_axis, -2).reshape(-1, c.kv_heads, c.head_dim)
    v_tok = v.movedim(heads_axis, -2).reshape(-1, c.kv_heads, c.v_head_dim)
    for t, slot in enumerate(slots.reshape(-1).tolist()):
        if slot < 0:
            continue
        block, index = divmod(slot, c.block_size)
        for rows, cache, scale in ((k_tok[t], k_cache, k_scale), (v_tok[t], v_cache, v_scale)):
            if float8:
                limit = FLOAT8_MAX[cache.dtype]
                rows = (rows.float() / scale.view(-1, 1)).clamp(-limit, limit)
            target = cache[block, index] if layout == "NHD" else cache[block, :, index]
            target.copy_(rows.to(cache.dtype))
    return q_out, k_cache, v_cache


def no_native(monkeypatch):
    """The eager fallback for this test; its one-time warning stays unspent for the tests
    that expect it."""
    monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    monkeypatch.setattr(_native, "_warned", set())


def same_bits(a, b, what):
    """a and b hold the same bits (float8: the same bytes)."""
    if a.dtype in FLOAT8_MAX:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    differ = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
    assert not differ.any(), (
        f"{what}: {int(differ.sum())} of {a.numel()} elements differ, first at "
        f"{differ.nonzero()[0].tolist()}: {a[differ][0].item()} vs {b[differ][0].item()}")


@pytest.mark.parametrize("path", ["native", "fallback"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_composition_bit_for_bit(name, path, monkeypatch):
    c = CASES[name]
    q, k, v, table, k_cache, v_cache, slots, kw = make(c)
    if path == "fallback":  # the composition of the fallback's own rotations
        no_native(monkeypatch)
    want_q, want_k_cache, want_v_cache = composed(c, q, k, v, table, k_cache, v_cache, slots, kw)
    k_before, v_before, q_before = k.clone(), v.clone(), q.clone()
    out = rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots, **kw)
    same_bits(out, want_q, "q")
    assert (out is q) == c.inplace
    if not c.inplace:
        assert torch.equal(q, q_before)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # read only
    same_bits(k_cache, want_k_cache, "k_cache")  # every slot: those written and those kept
    same_bits(v_cache, want_v_cache, "v_cache")


def test_each_thread_count_and_kernel_agree():
    """The tokens split over threads as the kernel likes: one thread gives the same bits."""
    c = replace(CASES["long-rows"], seq=40)
    q, k, v, table, k_cache, v_cache, slots, kw = make(c, seed=1)
    results = []
    threads = torch.get_num_threads()
    for n in (1, threads):
        torch.set_num_threads(n)
        try:
            kc, vc = k_cache.clone(), v_cache.clone()
            results.append((rope_ext.rotary_kv_cache_update(q, k, v, table, kc, vc, slots, **kw),
                            kc, vc))
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_static_cache_slots_write_the_static_cache():
    """A static [B, H_kv, max_len, D] cache is HND with one block per sequence."""
    b, s, max_len = 2, 3, 8
    positions = torch.tensor([[2, 3, 4], [5, 6, 7]])
    slots = rope_ext.static_cache_slots(positions, max_len)
    assert slots.tolist() == [[[2], [3], [4]], [[13], [14], [15]]]
    assert rope_ext.static_cache_slots(positions, max_len, seq_dim=2).shape == (b, 1, s)
    table = rope_ext.precompute_freqs_cis(16, max_len)
    q, k, v = (torch.randn(b, s, h, 16) for h in (4, 2, 2))
    k_cache, v_cache = torch.zeros(b, 2, max_len, 16), torch.zeros(b, 2, max_len, 16)
    rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots,
                                    positions=positions.unsqueeze(-1), cache_layout="HND")
    _, k_rot = rope_ext.apply_rotary_qk(q, k, table, positions=positions.unsqueeze(-1))
    assert torch.equal(k_cache[:, :, 2:5][0], k_rot[0].transpose(0, 1))
    assert torch.equal(k_cache[1, :, 5:8], k_rot[1].transpose(0, 1))
    assert torch.equal(v_cache[1, :, 5:8], v[1].transpose(0, 1))
    assert not k_cache[0, :, :2].any() and not k_cache[1, :, :5].any()
    with pytest.raises(ValueError, match=re.escape("static_cache_slots: positions must be [B, S]")):
        rope_ext.static_cache_slots(positions[0], max_len)


def test_paged_cache_views_of_one_buffer():
    """vLLM keeps k and v as two halves of one buffer: disjoint views are accepted."""
    c = CASES["prefill"]
    q, k, v, table, k_cache, _, slots, kw = make(c)
    kv = torch.zeros(2, *k_cache.shape, dtype=k_cache.dtype)
    rope_ext.rotary_kv_cache_update(q, k, v, table, kv[0], kv[1], slots, **kw)
    _, want_k, want_v = composed(c, q, k, v, table, torch.zeros_like(kv[0]),
                                 torch.zeros_like(kv[1]), slots, kw)
    assert torch.equal(kv[0], want_k) and torch.equal(kv[1], want_v)


def test_compiles_without_graph_break_and_matches_eager():
    c = CASES["decode-inplace-hnd"]
    q, k, v, table, k_cache, v_cache, slots, kw = make(c)
    want = composed(c, q, k, v, table, k_cache, v_cache, slots, kw)

    def step(q, k, v, k_cache, v_cache, slots, positions):
        rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots,
                                        **{**kw, "positions": positions})
        return q * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    out = compiled(q, k, v, k_cache, v_cache, slots, kw["positions"])
    assert torch.equal(out, want[0] * 2)
    assert torch.equal(k_cache, want[1]) and torch.equal(v_cache, want[2])


def test_compiled_inplace_q_of_a_qkv_projection_dynamic():
    """q, k and v views of one packed projection; q at offset 0 and written in place, k and v
    at offsets that are symbols under dynamic=True. Two batch sizes, one graph."""
    table = rope_ext.precompute_freqs_cis(32, 64)

    def step(qkv, k_cache, v_cache, slots, positions):
        b, s = qkv.shape[:2]
        q = qkv[..., :128].view(b, s, 4, 32)
        k = qkv[..., 128:192].view(b, s, 2, 32)
        v = qkv[..., 192:].view(b, s, 2, 32)
        rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots,
                                        positions=positions, inplace=True)
        return qkv * 1

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for b in (3, 5):
        qkv = torch.randn(b, 1, 256)
        caches = [torch.randn(6, 4, 2, 32) for _ in range(2)]
        slots = (torch.arange(b) * 3).view(b, 1, 1)
        positions = (torch.arange(b) + 2).view(b, 1, 1)
        want_caches = [c.clone() for c in caches]
        want = step(qkv.clone(), *want_caches, slots, positions)
        got = compiled(qkv, *caches, slots, positions)
        assert torch.equal(got, want) and torch.equal(qkv, want)
        assert all(torch.equal(c, w) for c, w in zip(caches, want_caches))


def test_compiled_cache_at_a_symbolic_offset_is_refused():
    """Caches sliced from one buffer at offsets that are symbols: Inductor would write them at
    the buffer's start, so the trace stops with a message saying what to do."""
    table = rope_ext.precompute_freqs_cis(32, 64)

    def step(q, k, v, kv, slots):
        return rope_ext.rotary_kv_cache_update(q, k, v, table, kv[1, 0], kv[1, 1], slots)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    q, k, v = torch.randn(2, 1, 4, 32), torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    kv = torch.zeros(2, 2, 6, 4, 2, 32)
    with pytest.raises(Exception, match=re.escape(
            "rotary_kv_cache_update: k_cache is a view at a storage offset that depends on "
            "dynamic shapes")):
        compiled(q, k, v, kv, torch.tensor([[[1]], [[7]]]))
    assert not kv.any()


def test_inference_only():
    c = CASES["prefill"]
    q, k, v, table, k_cache, v_cache, slots, kw = make(c)
    with pytest.raises(RuntimeError, match=re.escape(
            "rotary_kv_cache_update: an inference op, it has no gradient; call it under "
            "torch.no_grad()")):
        rope_ext.rotary_kv_cache_update(q.requires_grad_(), k, v, table, k_cache, v_cache,
                                        slots, **kw)
    with torch.no_grad():
        rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots, **kw)


def test_opcheck():
    # Not a float8 cache: opcheck's schema test multiplies the arguments, which float8 lacks.
    for name in ("prefill", "padding", "hf-layout", "norm"):
        c = replace(CASES[name], inplace=False)
        q, k, v, table, k_cache, v_cache, slots, kw = make(c)
        kw.pop("inplace")
        for op in ("rotary_kv_cache_update", "rotary_kv_cache_update_"):
            torch.library.opcheck(getattr(torch.ops.rope_ext, op).default,
                                  (q.clone(), k, v, table, k_cache, v_cache, slots), kw)


# Bad input. (name, change to the prefill call, error, message); the change takes the call's
# arguments as a dict and returns it altered.
def _with(**new):
    return lambda a: {**a, **new}


def _cache_view(a, name, fn):
    return {**a, name: fn(a[name])}


OP = "rotary_kv_cache_update"
BAD = [
    ("2-dim q", lambda a: {**a, "q": a["q"][0, 0]}, ValueError,
     f"{OP}: q must have 3 or 4 dims ([T, H, D], [B, S, H, D] or [B, H, S, D]), got 2"),
    ("seq_dim last", _with(seq_dim=3), ValueError,
     f"{OP}: seq_dim must name a dim of q other than the last, in [-4, -2] or [0, 2], got 3"),
    ("v dtype", lambda a: {**a, "v": a["v"].float()}, TypeError,
     f"{OP}: q, k and v must have one dtype, got BFloat16, BFloat16 and Float"),
    ("q and k tokens differ", lambda a: {**a, "q": a["q"][:1]}, ValueError,
     f"{OP}: q and k must agree on dim 0 (batch and seq_dim; only head counts may differ), got 1 "
     "and 2"),
    ("v tokens differ", lambda a: {**a, "v": a["v"][:, :3]}, ValueError,
     f"{OP}: v must match k on every dim but head_dim, got shapes [2, 3, 2, 32] and "
     "[2, 5, 2, 32]"),
    ("strided features", lambda a: {**a, "v": a["v"].transpose(2, 3).contiguous().transpose(2, 3)},
     ValueError, f"{OP}: v must have contiguous features (stride 1 along head_dim), got strides "
     "[320, 64, 1, 2]"),
    ("cache layout", _with(cache_layout="NDH"), ValueError,
     f'{OP}: cache_layout must be "NHD" or "HND", got "NDH"'),
    ("cache rank", lambda a: _cache_view(a, "k_cache", lambda t: t[0]), ValueError,
     f'{OP}: k_cache must have 4 dims, [num_blocks, block_size, H_kv, head_dim] for '
     'cache_layout="NHD", got shape [4, 2, 32]'),
    ("cache dtype", lambda a: _cache_view(a, "v_cache", lambda t: t.half()), TypeError,
     f"{OP}: v_cache must have q's dtype (BFloat16) or be float8_e4m3fn or float8_e5m2, got "
     "Half"),
    ("cache heads", lambda a: _cache_view(a, "k_cache", lambda t: t[:, :, :1]), ValueError,
     f"{OP}: k_cache holds 1 heads (dim 2) but k has 2"),
    ("cache head_dim", lambda a: _cache_view(a, "v_cache", lambda t: t[..., :16]), ValueError,
     f"{OP}: v_cache's head_dim 16 differs from v's 32"),
    ("cache blocks differ", lambda a: _cache_view(a, "v_cache", lambda t: t[:2]), ValueError,
     f"{OP}: k_cache and v_cache must have the same num_blocks and block_size, got shapes "
     "[6, 4, 2, 32] and [2, 4, 2, 32]"),
    ("float8 without scale", lambda a: _cache_view(a, "k_cache", lambda t: t.to(
        torch.float8_e4m3fn)), ValueError,
     f"{OP}: a float8 k_cache needs k_scale (float32, 1 value or one per head)"),
    ("scale on a bf16 cache", _with(v_scale=torch.ones(1)), ValueError,
     f"{OP}: v_scale is only for float8 caches; v_cache is BFloat16"),
    ("scale size", lambda a: {**_cache_view(a, "k_cache", lambda t: t.to(torch.float8_e5m2)),
                              "k_scale": torch.ones(3)}, ValueError,
     f"{OP}: k_scale must hold 1 value or one per head (2), got shape [3]"),
    ("scale dtype", lambda a: {**_cache_view(a, "k_cache", lambda t: t.to(torch.float8_e5m2)),
                               "k_scale": torch.ones(1, dtype=torch.float64)}, TypeError,
     f"{OP}: k_scale must be float32, got Double"),
    ("slots dtype", lambda a: {**a, "slots": a["slots"].float()}, TypeError,
     f"{OP}: slots must be an int32 or int64 tensor, got Float"),
    ("slots per head", lambda a: {**a, "slots": a["slots"].expand(2, 5, 2).contiguous()},
     ValueError, f"{OP}: slots of shape [2, 5, 2] must broadcast to k.shape[:-1] = [2, 5, 2] "
     "with size 1 along the heads (dim 2): one slot per token"),
    ("positions per head", lambda a: {**a, "q": a["q"][:, :, :2],
                                      "positions": torch.zeros(2, 5, 2, dtype=torch.long)},
     ValueError,
     f"{OP}: positions of shape [2, 5, 2] must broadcast to k.shape[:-1] = [2, 5, 2] with size "
     "1 along the heads (dim 2): one position per token"),
    ("one weight", _with(q_weight=torch.ones(32)), ValueError,
     f"{OP}: q_weight and k_weight go together (the fused QK-norm), got only q_weight"),
    ("caches overlap", lambda a: {**a, "v_cache": a["k_cache"]}, ValueError,
     f"{OP}: k_cache and v_cache overlap in memory; the call needs them disjoint"),
    ("k is its cache", lambda a: {**a, "k": a["k_cache"].view(-1, 2, 32)[:10].view(2, 5, 2, 32)},
     ValueError,
     f"{OP}: k and k_cache overlap in memory; the call needs them disjoint"),
    ("v rank", lambda a: {**a, "v": a["v"][0]}, ValueError,
     f"{OP}: q, k and v must have the same number of dims, got 4, 4 and 3"),
    ("q and k tokens differ, one position for all", lambda a: {
        **a, "q": a["q"][:, :3], "positions": torch.zeros(1, 1, 1, dtype=torch.long)}, ValueError,
     f"{OP}: q and k must agree on every dim but the heads (dim 2), got shapes [2, 3, 4, 32] and "
     "[2, 5, 2, 32]"),
    ("v heads differ", lambda a: {**a, "v": a["v"][:, :, :1]}, ValueError,
     f"{OP}: v must match k on every dim but head_dim, got shapes [2, 5, 1, 32] and "
     "[2, 5, 2, 32]"),
    ("v features of stride 2, head_dim 2", lambda a: {**a, "v": torch.zeros(2, 5, 2, 4).to(
        a["v"].dtype)[..., ::2]}, ValueError,
     f"{OP}: v must have contiguous features (stride 1 along head_dim), got strides "
     "[40, 8, 4, 2]"),
    ("v_cache features of stride 2, head_dim 2", lambda a: {
        **a, "v": torch.zeros(2, 5, 2, 2).to(a["v"].dtype),
        "v_cache": torch.zeros(6, 4, 2, 4).to(a["v"].dtype)[..., ::2]}, ValueError,
     f"{OP}: v_cache must have contiguous features (stride 1 along head_dim), got strides "
     "[32, 8, 4, 2]"),
    ("cache block sizes differ", lambda a: _cache_view(a, "v_cache", lambda t: t[:, :2]),
     ValueError, f"{OP}: k_cache and v_cache must have the same num_blocks and block_size, got "
     "shapes [6, 4, 2, 32] and [6, 2, 2, 32]"),
    ("HND cache block sizes differ", lambda a: {
        **a, "cache_layout": "HND", "k_cache": a["k_cache"].transpose(1, 2).contiguous(),
        "v_cache": a["v_cache"].transpose(1, 2).contiguous()[:, :, :2]}, ValueError,
     f"{OP}: k_cache and v_cache must have the same num_blocks and block_size, got "
     "shapes [6, 2, 4, 32] and [6, 2, 2, 32]"),
    ("q_weight shape", _with(q_weight=torch.ones(16), k_weight=torch.ones(32)), ValueError,
     f"{OP}: q_weight must have shape [32] (the head_dim of q), got [16]"),
    ("k_weight shape", _with(q_weight=torch.ones(32), k_weight=torch.ones(2, 32)), ValueError,
     f"{OP}: k_weight must have shape [32] (the head_dim of k), got [2, 32]"),
    ("eps", _with(q_weight=torch.ones(32), k_weight=torch.ones(32), eps=-1.0), ValueError,
     f"{OP}: eps must be a positive finite number, got -1"),
    ("expanded k_cache", lambda a: _cache_view(a, "k_cache", lambda t: t[:1].expand(6, 4, 2, 32)),
     ValueError, f"{OP}: k_cache has overlapping memory (dim 0 of size 6 has stride 0, e.g. "
     "from expand); the cache write needs distinct elements, pass caches whose elements are "
     "distinct"),
    ("v is its cache", lambda a: {**a, "v": a["v_cache"].view(-1, 2, 32)[:10].view(2, 5, 2, 32)},
     ValueError, f"{OP}: v and v_cache overlap in memory; the call needs them disjoint"),
    ("strided cache features", lambda a: _cache_view(
        a, "k_cache", lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
     f"{OP}: k_cache must have contiguous features (stride 1 along head_dim), got strides "
     "[256, 64, 1, 2]"),
    ("scale of 2 dims", lambda a: {**_cache_view(a, "k_cache", lambda t: t.to(torch.float8_e5m2)),
                                   "k_scale": torch.ones(1, 1)}, ValueError,
     f"{OP}: k_scale must hold 1 value or one per head (2), got shape [1, 1]"),
    ("slots of more dims", lambda a: {**a, "slots": a["slots"][None]}, ValueError,
     f"{OP}: slots of shape [1, 2, 5, 1] must broadcast to k.shape[:-1] = [2, 5, 2] with size 1 "
     "along the heads (dim 2): one slot per token"),
    ("slots of other sequences", lambda a: {**a, "slots": torch.zeros(3, 5, 1, dtype=torch.long)},
     ValueError, f"{OP}: slots of shape [3, 5, 1] must broadcast to k.shape[:-1] = [2, 5, 2] "
     "with size 1 along the heads (dim 2): one slot per token"),
    ("expanded cache", lambda a: _cache_view(a, "v_cache", lambda t: t[:1].expand(6, 4, 2, 32)),
     ValueError, f"{OP}: v_cache has overlapping memory (dim 0 of size 6 has stride 0, e.g. "
     "from expand); the cache write needs distinct elements, pass caches whose elements are "
     "distinct"),
]

# Errors only the values decide: the CPU op and the fallback (the fake kernel cannot see them).
BAD_VALUES = [
    ("slot past the cache", lambda a: {**a, "slots": a["slots"].clone().fill_(-1).index_fill_(
        0, torch.tensor([1]), 24)}, IndexError,
     f"{OP}: slots must be < num_blocks * block_size = 24 (negative slots write nothing), got 24"),
    ("slot twice", lambda a: {**a, "slots": torch.arange(10).view(2, 5, 1) % 7}, ValueError,
     f"{OP}: slot 0 is given to two tokens of one call; each token needs its own slot"),
    ("position past the table", _with(positions=torch.full((2, 5, 1), 14)), IndexError,
     f"{OP}: offset + positions must lie in [0, 14) (the rows of freqs_cis), got values in "
     "[14, 14]"),
]


def bad_call(change):
    c = CASES["prefill"]
    q, k, v, table, k_cache, v_cache, slots, kw = make(c)
    kw.pop("inplace")
    args = dict(q=q, k=k, v=v, freqs_cis=table, k_cache=k_cache, v_cache=v_cache, slots=slots,
                **kw)
    return change(args)


def op_args(a):
    head = [a.pop(n) for n in ("q", "k", "v", "freqs_cis", "k_cache", "v_cache", "slots")]
    return head, a


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", BAD + BAD_VALUES, ids=[c[0] for c in BAD + BAD_VALUES])
def test_native_op_error_writes_nothing(case, inplace):
    _, change, error, message = case
    a = bad_call(change)
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    head, kw = op_args(dict(a))
    op = OP + "_" if inplace else OP
    with pytest.raises(error, match=re.escape(message.replace(OP, op))):
        getattr(torch.ops.rope_ext, op)(*head, **kw)
    for n, t in before.items():
        assert torch.equal(a[n].view(torch.uint8) if a[n].dtype in FLOAT8_MAX else a[n],
                           t.view(torch.uint8) if t.dtype in FLOAT8_MAX else t), n


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_fake_kernel_mirrors_error(case):
    _, change, error, message = case
    head, kw = op_args(bad_call(change))
    with FakeTensorMode() as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        with pytest.raises(error, match=re.escape(message)):
            torch.ops.rope_ext.rotary_kv_cache_update([fake(t) for t in head][0],
                                                      *[fake(t) for t in head][1:],
                                                      **{n: fake(t) for n, t in kw.items()})


@pytest.mark.parametrize("case", BAD + BAD_VALUES, ids=[c[0] for c in BAD + BAD_VALUES])
def test_fallback_mirrors_error(case, monkeypatch):
    _, change, error, message = case
    no_native(monkeypatch)
    a = bad_call(change)
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    head, kw = op_args(dict(a))
    with pytest.raises(error, match=re.escape(message)):
        rope_ext.rotary_kv_cache_update(*head, **kw)
    for n, t in before.items():
        assert torch.equal(a[n].view(torch.uint8) if a[n].dtype in FLOAT8_MAX else a[n],
                           t.view(torch.uint8) if t.dtype in FLOAT8_MAX else t), n


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "k_scale", "v_scale", "v", "slots"])
def test_a_tensor_on_another_device_is_refused(name, monkeypatch):
    # Meta stands for another device (this machine may have one only): the op, and the
    # fallback's own checks, name the tensor and both devices.
    a = bad_call(lambda a: a)
    if name.endswith("scale"):
        cache = name.replace("scale", "cache")
        a[cache] = a[cache].to(torch.float8_e4m3fn)
        a[name] = torch.ones(1)
    a[name] = a[name].to("meta")
    message = f"{OP}: {name} is on meta but q is on cpu"
    head, kw = op_args(dict(a))
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.rope_ext.rotary_kv_cache_update(*head, **kw)
    no_native(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_ext.rotary_kv_cache_update(*head, **kw)


INPLACE_BAD = [  # what only an in-place call refuses
    ("q expanded", lambda a: {**a, "q": a["q"][:, :1].expand(2, 5, 4, 32)},
     "rotary_kv_cache_update_: q has overlapping memory (dim 1 of size 5 has stride 0, e.g. from "
     "expand); an in-place call needs distinct elements, use the out-of-place op"),
    ("q overlaps k", lambda a: {**a, "q": torch.cat([a["k"], a["k"]], 2)[:, :, :4].clone(),
                                "k": None},
     "rotary_kv_cache_update_: q and k overlap in memory; the call needs them disjoint"),
    ("q overlaps v", lambda a: {**a, "q": torch.cat([a["v"], a["v"]], 2)[:, :, :4].clone(),
                                "v": None},
     "rotary_kv_cache_update_: q and v overlap in memory; the call needs them disjoint"),
]


@pytest.mark.parametrize("case", INPLACE_BAD, ids=[c[0] for c in INPLACE_BAD])
@pytest.mark.parametrize("path", ["native", "fake", "fallback"])
def test_inplace_call_refuses_q_that_shares_memory(case, path, monkeypatch):
    _, change, message = case
    a = change(bad_call(lambda a: a))
    if a["k"] is None:  # k: the first two heads of q
        a["k"] = a["q"][:, :, :2]
    if a["v"] is None:
        a["v"] = a["q"][:, :, :2]
    head, kw = op_args(dict(a))
    before = [t.clone() for t in head]
    if path == "fake":
        with FakeTensorMode() as mode, pytest.raises(ValueError, match=re.escape(message)):
            torch.ops.rope_ext.rotary_kv_cache_update_(*[mode.from_tensor(t) for t in head], **kw)
        return
    if path == "fallback":
        no_native(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_ext.rotary_kv_cache_update(*head, inplace=True, **kw)
    for t, b in zip(head, before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_one_token_s_slot_past_the_cache_and_no_tokens(path, monkeypatch):
    # A single slot is range-checked like many, and a call with no tokens writes nothing.
    if path == "fallback":
        no_native(monkeypatch)
    q, k, v, table, k_cache, v_cache, slots, kw = make(replace(CASES["decode"], batch=1))
    kw.pop("inplace")
    message = f"{OP}: slots must be < num_blocks * block_size = {k_cache.shape[0] * 4}"
    with pytest.raises(IndexError, match=re.escape(message)):
        rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache,
                                        torch.full_like(slots, k_cache.shape[0] * 4), **kw)
    before = k_cache.clone(), v_cache.clone()
    empty = [t[:0] for t in (q, k, v)]
    out = rope_ext.rotary_kv_cache_update(*empty, table, k_cache, v_cache, slots[:0],
                                          **{**kw, "positions": kw["positions"][:0]})
    assert out.shape == empty[0].shape
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
