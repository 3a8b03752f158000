"""Multi-axis RoPE (MRoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL): positions [A, *b], pair i turning
by the position of its axis. Against the float64 reference, against transformers' own rotary
modules, through autograd, opcheck and torch.compile, and the bad-input messages."""

import re

import pytest
import torch

import rope_ext
from rope_ext import _checks, reference

from conftest import DTYPES, assert_matches_reference

P = 64
QWEN2 = dict(mrope_section=[16, 24, 24])  # contiguous (time, height, width), R = 128
QWEN3 = dict(mrope_section=[24, 20, 20], mrope_interleaved=True)


def layout(name, dtype, gen):
    """q, k and kwargs (positions [3, ...], seq_dim) for one layout."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def positions(*shape, dtype=torch.int64):
        return torch.randint(0, P, (3, *shape), generator=gen).to(dtype)

    if name == "bshd":
        return randn(2, 7, 4, 128), randn(2, 7, 2, 128), dict(positions=positions(2, 7, 1))
    if name == "hf":  # [B, H, S, D], positions [3, B, 1, S] as transformers' [3, B, S]
        return (randn(2, 4, 7, 128), randn(2, 2, 7, 128),
                dict(positions=positions(2, 1, 7, dtype=torch.int32)))
    if name == "packed":
        return randn(11, 4, 128), randn(11, 2, 128), dict(positions=positions(11, 1))
    if name == "decode_offset":
        return randn(3, 1, 4, 128), randn(3, 1, 4, 128), dict(positions=positions(3, 1, 1) // 2,
                                                              offset=5)
    if name == "partial_rotary":  # R = 64 of head_dim 96; features 64.. pass through
        return randn(2, 5, 3, 96), randn(2, 5, 1, 96), dict(positions=positions(2, 5, 1))
    raise ValueError(name)


LAYOUTS = ["bshd", "hf", "packed", "decode_offset", "partial_rotary"]


def sections(name, variant):
    if name == "partial_rotary":  # 32 pairs
        return dict(mrope_section=[8, 12, 12]) if variant == "qwen2" else dict(
            mrope_section=[12, 10, 10], mrope_interleaved=True)
    return QWEN2 if variant == "qwen2" else QWEN3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_matches_reference(dtype, interleaved, variant, name):
    gen = torch.Generator().manual_seed(0)
    q, k, kwargs = layout(name, dtype, gen)
    kwargs.update(sections(name, variant), interleaved=interleaved)
    rotary = 64 if name == "partial_rotary" else 128
    table = rope_ext.precompute_freqs_cis(rotary, P + 8)
    want_q = reference.apply_rotary(q.double(), table, **kwargs)
    want_k = reference.apply_rotary(k.double(), table, **kwargs)
    got_q, got_k = rope_ext.apply_rotary_qk(q, k, table, **kwargs)
    assert_matches_reference(got_q, want_q)
    assert_matches_reference(got_k, want_k)
    # In place, and x alone, give the same bits.
    q2, k2 = q.clone(), k.clone()
    rope_ext.apply_rotary_qk(q2, k2, table, inplace=True, **kwargs)
    assert torch.equal(q2, got_q) and torch.equal(k2, got_k)
    assert torch.equal(rope_ext.apply_rotary(q, table, **kwargs), got_q)


def test_one_axis_is_plain_rope():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 64, generator=gen)
    positions = torch.randint(0, P, (2, 5, 1), generator=gen)
    table = rope_ext.precompute_freqs_cis(64, P)
    got = rope_ext.apply_rotary(x, table, positions=positions[None], mrope_section=[32])
    assert torch.equal(got, rope_ext.apply_rotary(x, table, positions=positions))


def test_equal_axes_are_plain_rope():
    """Text tokens carry the same position on every axis: MRoPE is then plain RoPE."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 3, 128, generator=gen)
    positions = torch.randint(0, P, (2, 5, 1), generator=gen)
    table = rope_ext.precompute_freqs_cis(128, P)
    plain = rope_ext.apply_rotary(x, table, positions=positions, interleaved=False)
    for kw in (QWEN2, QWEN3):
        got = rope_ext.apply_rotary(x, table, positions=positions.expand(3, 2, 5, 1),
                                    interleaved=False, **kw)
        assert torch.equal(got, plain)


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_vl"])
def test_matches_transformers_rotary(model):
    """transformers' own text rotary module (cos/sin per token from [3, B, S] position ids)
    and its apply_rotary_pos_emb, against rope_ext with the model's sections."""
    pytest.importorskip("transformers")
    if model == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m
        from transformers import Qwen2VLTextConfig as Config
        rotary_cls, kw = m.Qwen2VLRotaryEmbedding, QWEN2
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m
        from transformers import Qwen3VLTextConfig as Config
        rotary_cls, kw = m.Qwen3VLTextRotaryEmbedding, QWEN3
    config = Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": kw["mrope_section"]})
    rotary = rotary_cls(config)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 9, 128, generator=gen)  # [B, H, S, D]
    k = torch.randn(2, 1, 9, 128, generator=gen)
    position_ids = torch.randint(0, 40, (3, 2, 9), generator=gen)
    cos, sin = rotary(q, position_ids)
    want_q, want_k = m.apply_rotary_pos_emb(q, k, cos, sin)
    table = rope_ext.precompute_freqs_cis(128, 40)
    got_q, got_k = rope_ext.apply_rotary_qk(q, k, table, positions=position_ids[:, :, None],
                                            interleaved=False, **kw)
    # transformers computes angles in float32 (rope_ext in float64): float32 tolerances.
    torch.testing.assert_close(got_q, want_q, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("offset", [0, 4])
def test_gradients(kw, inplace, offset):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 2, 128, generator=gen, dtype=torch.float64, requires_grad=True)
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(128, 16, dtype=torch.float64))
    table = table.clone().requires_grad_()
    positions = torch.randint(0, 12, (3, 2, 3, 1), generator=gen)

    def f(x, table):
        x = x.clone() if inplace else x
        return rope_ext.apply_rotary(x, table, positions=positions, offset=offset,
                                     inplace=inplace, interleaved=False, **kw)

    torch.autograd.gradcheck(f, (x, table))


@pytest.mark.parametrize("kw", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_opcheck(kw):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, 128, generator=gen)
    k = torch.randn(2, 3, 2, 128, generator=gen)
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(128, P))
    positions = torch.randint(0, P, (3, 2, 3, 1), generator=gen)
    args = (table, positions, 0, 1, False, False, kw["mrope_section"],
            kw.get("mrope_interleaved", False))
    ops = torch.ops.rope_ext
    torch.library.opcheck(ops.apply_rotary.default, (q, *args))
    torch.library.opcheck(ops.apply_rotary_.default, (q.clone(), *args))
    torch.library.opcheck(ops.apply_rotary_qk.default, (q, k, *args))
    torch.library.opcheck(ops.apply_rotary_qk_.default, (q.clone(), k.clone(), *args))


def test_compile_fullgraph_dynamic():
    table = rope_ext.precompute_freqs_cis(128, P)

    @torch.compile(fullgraph=True, dynamic=True)
    def step(q, k, positions):
        return rope_ext.apply_rotary_qk(q * 1, k * 1, table, positions=positions,
                                        interleaved=False, **QWEN2)

    gen = torch.Generator().manual_seed(6)
    for s in (5, 9):
        q = torch.randn(2, s, 4, 128, generator=gen)
        k = torch.randn(2, s, 2, 128, generator=gen)
        positions = torch.randint(0, P, (3, 2, s, 1), generator=gen)
        got = step(q, k, positions)
        want = rope_ext.apply_rotary_qk(q, k, table, positions=positions, interleaved=False,
                                        **QWEN2)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


BAD = [
    (dict(mrope_section=[16, 24, 23]), "mrope_section [16, 24, 23] must sum to R/2 = 64"),
    (dict(mrope_section=[16, -8, 56]), "mrope_section lengths must be >= 0, got [16, -8, 56]"),
    (dict(mrope_section=[-1, 33, 32]), "mrope_section lengths must be >= 0, got [-1, 33, 32]"),
    (dict(mrope_section=[]), "mrope_section must hold 1 to 4 section lengths, got 0"),
    (dict(mrope_section=[32, 32], mrope_interleaved=True),
     "mrope_interleaved=True needs 3 sections (time, height, width), got 2"),
    (dict(mrope_section=[24, 24, 24], mrope_interleaved=True),
     "mrope_section [24, 24, 24] sums to 72, more than the R/2 = 64 pairs"),
    (dict(mrope_section=[16, 16, 16, 8, 8]), "mrope_section must hold 1 to 4 section lengths"),
    (dict(mrope_interleaved=True), "mrope_interleaved=True needs mrope_section"),
    (dict(mrope_section=[16, 24, 24], positions=None),
     "mrope_section needs positions of shape [3, ...] (one position per axis), got none"),
    (dict(mrope_section=[16, 24, 24], positions=torch.zeros(2, 2, 5, 1, dtype=torch.long)),
     "positions must have a leading dim of len(mrope_section) = 3, got shape [2, 2, 5, 1]"),
    (dict(mrope_section=[16, 24, 24], positions=torch.tensor(0)),
     "positions must have a leading dim of len(mrope_section) = 3, got shape []"),
    (dict(mrope_section=[16, 24, 24], positions=torch.zeros(3, 2, 6, 1, dtype=torch.long)),
     "positions of shape [3, 2, 6, 1] (after its leading axis dim) is not broadcastable"),
    (dict(mrope_section=[16, 24, 24], positions=torch.zeros(3, 4, 5, 1, dtype=torch.long)),
     "positions of shape [3, 4, 5, 1] (after its leading axis dim) is not broadcastable"),
]


@pytest.mark.parametrize("bad,message", BAD)
def test_bad_input(bad, message):
    x = torch.randn(2, 5, 3, 128)
    table = rope_ext.precompute_freqs_cis(128, 2 * P)  # rows != pairs: each check reads its own
    kwargs = dict(positions=torch.zeros(3, 2, 5, 1, dtype=torch.long))
    kwargs.update(bad)
    before = x.clone()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        rope_ext.apply_rotary(x, table, inplace=True, **kwargs)
    assert torch.equal(x, before)
    # The fake kernels and the eager fallback run the same checks, word for word.
    with pytest.raises(ValueError) as fake:
        _checks.check_apply_args("apply_rotary_", "x", x, torch.view_as_real(table),
                                 kwargs["positions"], 0, 1, kwargs.get("mrope_section"),
                                 kwargs.get("mrope_interleaved", False))
    with pytest.raises(ValueError) as native:
        rope_ext.apply_rotary(x, table, inplace=True, **kwargs)
    assert str(fake.value) == str(native.value).split("\n")[0]


def test_pair_axes():
    assert reference.mrope_pair_axes(8, [2, 3, 3]) == [0, 0, 1, 1, 1, 2, 2, 2]
    # Qwen3-VL: height on i % 3 == 1 below 3 * 2, width on i % 3 == 2 below 3 * 1.
    assert reference.mrope_pair_axes(9, [4, 2, 1], True) == [0, 1, 2, 0, 1, 0, 0, 0, 0]


def test_mrope_positions_lay_out_text_images_and_videos():
    """Text counts up on all three axes; a vision block's patches (merged 2 x 2 to a token)
    take (start + frame * interval, start + row, start + column), and the text after it
    continues from start + max(rows, columns). Written out by hand (test_hf_mrope.py checks
    the same against transformers' get_rope_index)."""
    # text 2, an image of 1 x 4 x 4 patches (2 x 2 tokens), text 1, a video of 2 frames of
    # 2 x 4 patches (1 x 2 tokens each, 3 time units apart), text 1; then a text-only sequence
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0], [0] * 12])
    positions, deltas = rope_ext.mrope_positions(
        types, torch.tensor([[1, 4, 4]]), torch.tensor([[2, 2, 4]]), video_time_interval=3.0)
    want = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5, 5, 8, 8, 7],    # time
                         [0, 1, 2, 2, 3, 3, 4, 5, 5, 5, 5, 7],    # height
                         [0, 1, 2, 3, 2, 3, 4, 5, 6, 5, 6, 7]])   # width
    assert torch.equal(positions, torch.stack([want, torch.arange(12).expand(3, 12)], 1))
    assert deltas.tolist() == [8 + 1 - 12, 0]
    one, delta = rope_ext.mrope_positions(types[0], torch.tensor([[1, 4, 4]]),
                                          torch.tensor([[2, 2, 4]]), video_time_interval=3.0)
    assert torch.equal(one, want) and delta.tolist() == [-3]
    with pytest.raises(ValueError, match=re.escape(
            "mrope_positions: a vision block of 3 tokens at token 1 does not match its grid "
            "[1, 4, 4] (4 tokens after the spatial merge)")):
        rope_ext.mrope_positions(torch.tensor([0, 1, 1, 1]), torch.tensor([[1, 4, 4]]))
    # No tokens: no positions, and a delta of 0 per sequence.
    empty, deltas = rope_ext.mrope_positions(torch.zeros(2, 0, dtype=torch.long))
    assert empty.shape == (3, 2, 0) and empty.dtype == torch.long and deltas.tolist() == [0, 0]


@pytest.mark.parametrize("kw", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layouts_agree_bitwise(kw, dtype):
    """[B, H, S, D] (the CPU gathers a table per token first) and [B, S, H, D] (the kernel
    mixes each token's rows itself) give the same bits, as does the packed [T, H, D] form."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 9, 4, 128, generator=gen).to(dtype)
    k = torch.randn(2, 9, 2, 128, generator=gen).to(dtype)
    positions = torch.randint(0, P, (3, 2, 9), generator=gen)
    table = rope_ext.precompute_freqs_cis(128, P)
    bshd = rope_ext.apply_rotary_qk(q, k, table, positions=positions[..., None],
                                    interleaved=False, **kw)
    bhsd = rope_ext.apply_rotary_qk(q.transpose(1, 2), k.transpose(1, 2), table,
                                    positions=positions[:, :, None], interleaved=False, **kw)
    packed = rope_ext.apply_rotary_qk(q.flatten(0, 1), k.flatten(0, 1), table,
                                      positions=positions.flatten(1, 2)[..., None],
                                      interleaved=False, **kw)
    for a, b, c in zip(bshd, bhsd, packed):
        assert torch.equal(a, b.transpose(1, 2)) and torch.equal(a.flatten(0, 1), c)
