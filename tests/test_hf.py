"""Scaling variants against the installed transformers, and rope_ext.hf in real (tiny,
randomly initialised) models: logits, greedy decoding with the KV cache, a training step,
torch.compile."""

import math

import pytest
import torch

import rope_ext

transformers = pytest.importorskip("transformers")
import rope_ext.hf  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 128
PHI3_SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
PHI3_LONG = [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)]

SCALING_CASES = [
    ("default", dict(rope_theta=10000.0), 2048, [None]),
    ("default", dict(rope_theta=500000.0), 2048, [None]),
    ("linear", dict(factor=2.0, rope_theta=10000.0), 2048, [None]),
    ("linear", dict(factor=8.0, rope_theta=1e6), 2048, [None]),
    ("dynamic", dict(factor=2.0, rope_theta=10000.0), 2048, [None, 1000, 4096, 10000]),
    ("yarn", dict(factor=4.0, original_max_position_embeddings=2048, rope_theta=10000.0), 8192, [None]),
    ("yarn", dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                  mscale_all_dim=0.707, beta_fast=32, beta_slow=1, rope_theta=10000.0), 163840, [None]),
    ("yarn", dict(factor=8.0, original_max_position_embeddings=1024, attention_factor=1.3,
                  beta_fast=16.0, beta_slow=2.0, truncate=False, rope_theta=1e6), 8192, [None]),
    ("longrope", dict(short_factor=PHI3_SHORT, long_factor=PHI3_LONG,
                      original_max_position_embeddings=4096, rope_theta=10000.0), 131072,
     [None, 1000, 4096, 5000]),
    ("longrope", dict(short_factor=PHI3_SHORT, long_factor=PHI3_LONG, factor=4.0,
                      attention_factor=1.1, original_max_position_embeddings=2048,
                      rope_theta=10000.0), 8192, [3000]),
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, rope_theta=500000.0), 131072, [None]),
    ("llama3", dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192, rope_theta=500000.0), 131072, [None]),
]
if "proportional" in ROPE_INIT_FUNCTIONS:
    SCALING_CASES += [
        ("proportional", dict(partial_rotary_factor=0.25, rope_theta=10000.0), 2048, [None]),
        ("proportional", dict(partial_rotary_factor=0.5, factor=2.0, rope_theta=1e6), 2048, [None]),
    ]


TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


def rope_kwargs(rope_parameters: dict) -> dict:
    """A config's rope arguments: transformers 5's rope_parameters dict, or 4.x's rope_theta
    plus a rope_scaling dict (None for the default type)."""
    if not TRANSFORMERS_4:
        return dict(rope_parameters=rope_parameters)
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    kwargs = dict(rope_theta=rope_parameters["rope_theta"],
                  rope_scaling=None if scaling["rope_type"] == "default" else scaling)
    if scaling["rope_type"] == "longrope":  # 4.x reads it from the config, as Phi-3's has it
        kwargs["original_max_position_embeddings"] = scaling.pop("original_max_position_embeddings")
    return kwargs


def llama_config(rope_parameters, max_position_embeddings, **extra):
    return LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2,
                       max_position_embeddings=max_position_embeddings,
                       **rope_kwargs(rope_parameters), **extra)


def transformers_frequencies(config, rope_type, seq_len):
    if rope_type == "default" and "default" not in ROPE_INIT_FUNCTIONS:
        # transformers 5: a static method of the rotary module, whose device argument 5.18
        # deprecated and later releases removed.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("case", SCALING_CASES, ids=lambda c: c[0] if isinstance(c, str) else None)
def test_frequencies_match_transformers(case):
    rope_type, params, max_pos, seq_lens = case
    for seq_len in seq_lens:
        config = llama_config({"rope_type": rope_type, **params}, max_pos)
        want_inv, want_attention = transformers_frequencies(config, rope_type, seq_len)
        got_inv, got_attention = rope_ext.rope_frequencies(
            HEAD_DIM, rope_scaling=rope_ext.hf.rope_parameters(config), max_position_embeddings=max_pos,
            seq_len=seq_len)
        torch.testing.assert_close(got_inv, want_inv.double(), rtol=1e-6, atol=0)
        assert math.isclose(got_attention, want_attention, rel_tol=1e-6)
        table = rope_ext.hf.table_from_config(config, 64, seq_len=seq_len, dtype=torch.float64)
        torch.testing.assert_close(table.abs(), torch.full_like(table.abs(), want_attention))
        angle = torch.outer(torch.arange(64, dtype=torch.float64), got_inv)
        torch.testing.assert_close(table, torch.polar(torch.full_like(angle, got_attention), angle))


def test_sequence_length_changes_dynamic_and_longrope():
    dynamic = llama_config({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, 2048)
    short = rope_ext.rope_frequencies(HEAD_DIM, rope_scaling=rope_ext.hf.rope_parameters(dynamic),
                                      max_position_embeddings=2048, seq_len=1000)[0]
    long = rope_ext.rope_frequencies(HEAD_DIM, rope_scaling=rope_ext.hf.rope_parameters(dynamic),
                                     max_position_embeddings=2048, seq_len=8000)[0]
    assert torch.equal(short, rope_ext.rope_frequencies(HEAD_DIM, 1e4)[0]) and (long < short).any()
    params = dict(rope_type="longrope", short_factor=PHI3_SHORT, long_factor=PHI3_LONG,
                  original_max_position_embeddings=4096)
    short = rope_ext.rope_frequencies(HEAD_DIM, rope_scaling=params, seq_len=4096,
                                      max_position_embeddings=131072)[0]
    long = rope_ext.rope_frequencies(HEAD_DIM, rope_scaling=params, seq_len=4097,
                                     max_position_embeddings=131072)[0]
    assert not torch.equal(short, long)


@pytest.mark.parametrize("params,message", [
    (dict(rope_type="yarn", factor=4.0), "rope_type 'yarn' needs original_max_position_embeddings"),
    (dict(rope_type="linear"), "rope_type 'linear' needs factor"),
    (dict(rope_type="dynamic", factor=2.0), "rope_type 'dynamic' needs max_position_embeddings"),
    (dict(rope_type="longrope", original_max_position_embeddings=16, factor=2.0, short_factor=[1.0]),
     "rope_type 'longrope' needs short_factor with dim / 2 = 64 values, got 1"),
    (dict(rope_type="nope"), "rope_type must be one of default, linear, dynamic, yarn, longrope, "
     "llama3, proportional, got 'nope'"),
])
def test_bad_scaling_parameters(params, message):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(ValueError, match=message):
        rope_ext.precompute_freqs_cis(HEAD_DIM, 8, rope_scaling=params, max_position_embeddings=None)
    theta, kwargs = rope_ext.api.scaling_arguments(params, 10000.0)
    with FakeTensorMode(), pytest.raises(ValueError, match=message):
        torch.ops.rope_ext.precompute_freqs_cis(HEAD_DIM, 8, theta, **kwargs)


# ----------------------------------------------------------------------------- drop-in function

def rotary_cos_sin(config, batch, seq, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(batch, seq, 1, dtype=dtype)
    position_ids = torch.arange(seq).expand(batch, seq) + torch.tensor([[0], [7]])[:batch]
    return rotary(x, position_ids)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_pos_emb_matches_transformers(unsqueeze_dim, dtype):
    from transformers.models.llama import modeling_llama

    original = rope_ext.hf._patched.get("transformers.models.llama.modeling_llama",
                                        modeling_llama.apply_rotary_pos_emb)
    config = llama_config({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                           "original_max_position_embeddings": 64}, 256)
    cos, sin = rotary_cos_sin(config, 2, 40, dtype)
    shape_q = (2, 4, 40, HEAD_DIM) if unsqueeze_dim == 1 else (2, 40, 4, HEAD_DIM)
    shape_k = (2, 2, 40, HEAD_DIM) if unsqueeze_dim == 1 else (2, 40, 2, HEAD_DIM)
    q = torch.randn(shape_q, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_k, dtype=dtype, requires_grad=True)
    got = rope_ext.hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    # transformers' arithmetic in float64 on the same inputs: rope_ext rounds once from there,
    # transformers' own bfloat16 path rounds every product and sum.
    exact = [t.to(q.dtype).double() for t in original(
        q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=8e-3)
    for g, w in zip(got, exact):
        torch.testing.assert_close(g.double(), w, **tol)
    grads = torch.autograd.grad(sum(g.float().square().sum() for g in got), (q, k))
    want = original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want_grads = torch.autograd.grad(sum(w.float().square().sum() for w in want), (q, k))
    grad_tol = tol if dtype == torch.float32 else dict(atol=1.5e-1, rtol=5e-2)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **grad_tol)


# ----------------------------------------------------------------------------- whole models

def tiny_model(family, dtype=torch.float32):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM)}[family]
    rope = {"llama": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                      "rope_theta": 500000.0},
            "qwen2": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "rope_theta": 1e6},
            "mistral": {"rope_type": "default", "rope_theta": 1e6}}[family]
    config = config_cls(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        **rope_kwargs(rope), attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_cls(config).to(dtype).eval()


@pytest.fixture
def patched():
    yield rope_ext.hf.enable()
    rope_ext.hf.disable()


def test_enable_patches_families_and_disable_restores():
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.gemma import modeling_gemma

    modules = [modeling_llama, modeling_mistral, modeling_qwen2, modeling_qwen3, modeling_gemma]
    originals = [m.apply_rotary_pos_emb for m in modules]
    patched = rope_ext.hf.enable()
    try:
        for m in modules:
            assert m.__name__ in patched
            assert m.apply_rotary_pos_emb is rope_ext.hf.apply_rotary_pos_emb
    finally:
        rope_ext.hf.disable()
    assert [m.apply_rotary_pos_emb for m in modules] == originals
    assert not rope_ext.hf.enabled()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_logits_generation_and_gradients_match(family, patched):
    model = tiny_model(family)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got_logits = model(ids).logits
        got_tokens = model.generate(ids, max_new_tokens=20, do_sample=False, use_cache=True)
    loss = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), ids.roll(-1).flatten())
    loss.backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    rope_ext.hf.disable()
    with torch.no_grad():
        want_logits = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=20, do_sample=False, use_cache=True)
    loss = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), ids.roll(-1).flatten())
    loss.backward()
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got_grads[name], param.grad, atol=1e-5, rtol=1e-4)


def test_bfloat16_logits_within_rounding(patched):
    model = tiny_model("llama", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(ids).logits.float()
        rope_ext.hf.disable()
        want = model(ids).logits.float()
    # rope_ext rounds once from float32; transformers rounds each product and sum to bfloat16.
    torch.testing.assert_close(got, want, atol=4e-2, rtol=4e-2)


def test_compiled_model(patched):
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = torch.compile(model)(ids).logits
        rope_ext.hf.disable()
        want = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_positions_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    want = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0], dtype=torch.int32).unsqueeze(-1)
    assert torch.equal(rope_ext.positions_from_cu_seqlens(cu), want)
    assert torch.equal(rope_ext.positions_from_cu_seqlens(cu.long(), total_tokens=9), want.long())
    q = torch.randn(9, 4, 32)
    table = rope_ext.precompute_freqs_cis(32, 16)
    got = rope_ext.apply_rotary(q, table, positions=rope_ext.positions_from_cu_seqlens(cu), seq_dim=0)
    # Each sequence rotated as if alone.
    for start, end in [(0, 3), (3, 8), (8, 9)]:
        alone = rope_ext.apply_rotary(q[start:end], table, seq_dim=0)
        torch.testing.assert_close(got[start:end], alone)
