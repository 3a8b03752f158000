"""Scaling variants against the installed transformers, and rope_ext.hf in real (tiny,
randomly initialised) models: logits, greedy decoding with the KV cache, a training step,
torch.compile."""

import math
import sys

import pytest
import torch

import rope_ext

transformers = pytest.importorskip("transformers")
import rope_ext.hf  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.integration

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


# ----------------------------------------------------------------------------- every variant

def variant_function(v):
    """(module, transformers' function) of variant v in the installed transformers, or None
    where this transformers lacks the family or the function (older releases lack the newest
    families; some drop a family)."""
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{v.family}.modeling_{v.family}")
    except ImportError:
        return None
    original = rope_ext.hf._original(module.__name__, v.function,
                                     getattr(module, v.function, None))
    return None if original is None else (module, original)


def variants_present():
    """The variants whose function the installed transformers has."""
    return [v for v in rope_ext.hf.VARIANTS if variant_function(v) is not None]


def variant_inputs(v, fn, dtype, cos_dtype, unsqueeze_dim, gen):
    """Positional arguments for transformers' function fn of variant v."""
    import inspect

    params = tuple(inspect.signature(fn).parameters)
    B, S, H, D = 2, 7, 3, 16
    R = D // 2 if "partial" in v.name else D
    angles = torch.rand(B, S, R // 2, generator=gen, dtype=torch.float64) * 40
    cos, sin = angles.cos() * 1.25, angles.sin() * 1.25  # an attention factor, as yarn's
    if v.layout == "cat":
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    elif v.layout == "repeated":
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    cos, sin = cos.to(cos_dtype), sin.to(cos_dtype)

    def x(heads, heads_dim=unsqueeze_dim, width=D):
        shape = [B, S, width]
        shape.insert(heads_dim, heads)
        return torch.randn(shape, generator=gen).to(dtype)

    if params == ("tensor", "sin", "cos"):
        return (x(H, 2, R), sin, cos)
    if params == ("q", "k", "cos", "sin"):  # vision towers: [N, H, D] and cos [N, D]
        def patches(heads):
            return torch.randn(B * S, heads, D, generator=gen).to(dtype)
        return (patches(H), patches(1), cos.flatten(0, 1), sin.flatten(0, 1))
    if params == ("xq", "xk", "freqs_cis"):
        return (x(H, v.heads_dim), x(1, v.heads_dim), torch.polar(torch.ones_like(angles), angles).to(
            torch.complex64 if cos_dtype != torch.float64 else torch.complex128))
    if params[0] == "x":
        return (x(H), cos, sin, *([None] if "position_ids" in params else []), unsqueeze_dim)
    if "position_ids" in params:
        return (x(H), x(1), cos, sin, None, unsqueeze_dim)
    return (x(H), x(1), cos, sin, unsqueeze_dim)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype,cos_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("v", rope_ext.hf.VARIANTS, ids=lambda v: f"{v.family}.{v.function}")
def test_every_variant_matches_its_function(v, dtype, cos_dtype, unsqueeze_dim):
    """Each drop-in against transformers' own function of that variant: values against the
    function run in float64, output dtypes as the function gives them, gradients. A variant
    whose function this transformers lacks is skipped, by name."""
    found = variant_function(v)  # imports the variant's module, so enable() checks it
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {v.family}.{v.function} "
                    f"(variant {v.name!r})")
    module, original = found
    rope_ext.hf.enable()
    try:
        dropin = getattr(module, v.function)
        # (in transformers 4.x some of these families share an earlier variant's code)
        assert getattr(dropin, "rope_ext_variant", None) == v.name or (
            TRANSFORMERS_4 and hasattr(dropin, "rope_ext_variant")), (v, dropin)
        gen = torch.Generator().manual_seed(0)
        args = variant_inputs(v, original, dtype, cos_dtype, unsqueeze_dim, gen)
        # q and k get gradients (4-D; vision towers' 3-D, first); cos and sin come from
        # buffers in every model.
        vision = v.function.endswith("_vision")
        args = [a.requires_grad_() if isinstance(a, torch.Tensor) and (
            a.dim() == 4 or (vision and i < 2)) else a for i, a in enumerate(args)]
        got = dropin(*args)
        want = original(*args)
        exact = original(*[a.detach().to(torch.complex128 if a.is_complex() else torch.float64)
                           if isinstance(a, torch.Tensor) else a for a in args])
        got, want, exact = [t if isinstance(t, tuple) else (t,) for t in (got, want, exact)]
        tol = (dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else
               dict(atol=4e-2, rtol=2e-2))
        for g, w, e in zip(got, want, exact):
            assert g.dtype == w.dtype, (v.name, g.dtype, w.dtype)
            torch.testing.assert_close(g.double(), e.to(w.dtype).double(), **tol,
                                       msg=lambda m: f"{v.name} ({v.family}): {m}")
        if "optional k" in v.name:  # q alone: (q, None) or q itself, as the function
            alone = [args[0].detach(), None, *args[2:]]
            got_q, want_q = dropin(*alone), original(*alone)
            assert type(got_q) is type(want_q) and (
                isinstance(want_q, torch.Tensor) or want_q[1] is None)
            got_q = got_q if isinstance(got_q, torch.Tensor) else got_q[0]
            want_q = want_q if isinstance(want_q, torch.Tensor) else want_q[0]
            torch.testing.assert_close(got_q.double(), want_q.double(), **tol)
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = torch.autograd.grad(sum(g.float().square().sum() for g in got), inputs)
        want_grads = torch.autograd.grad(sum(w.float().square().sum() for w in want), inputs)
        grad_tol = tol if dtype == torch.float32 else dict(atol=2e-1, rtol=5e-2)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, **grad_tol, msg=lambda m: f"{v.name} grad: {m}")
    finally:
        rope_ext.hf.disable()


# One tiny model (random weights, built here) per variant that has a causal LM; the others
# (vision towers, encoders, q-only helpers) are covered function by function above.
MODEL_CASES = {
    "half-split, partial": ("gpt_neox", dict(partial_rotary_factor=0.5)),
    "half-split, cast back to each dtype": ("olmo2", {}),
    "half-split, float32, cast to q's dtype": ("modernbert-decoder", {}),
    "half-split, half-size cos": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2)),
    "half-split, negated angle": ("nanochat", {}),
    "half-split, one tensor": ("gemma4_text", dict(
        layer_types=["sliding_attention", "full_attention"], global_head_dim=16)),
    "interleaved, repeated cos, float32": ("cohere", {}),
    "interleaved, cat cos": ("helium", {}),
    "interleaved, cat cos, partial": ("glm", dict(partial_rotary_factor=0.5)),
    "interleaved, cat cos, float32": ("ernie4_5", {}),
    "interleaved, one tensor, half-size sin/cos (GPT-J)": ("gptj", dict(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256)),
    "DeepSeek interleave": ("deepseek_v3", dict(
        rope_interleave=True, num_key_value_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, moe_intermediate_size=32, n_group=1, topk_group=1)),
    "complex freqs_cis, heads at dim 1": ("deepseek_v2", dict(
        num_key_value_heads=4, head_dim=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        moe_intermediate_size=32, n_group=1, topk_group=1)),
    "complex freqs_cis, heads at dim 2": ("llama4_text", dict(
        num_local_experts=2, interleave_moe_layer_step=1, intermediate_size_mlp=96)),
}


@pytest.mark.parametrize("variant", sorted(MODEL_CASES))
def test_variant_model_logits_and_generation(variant):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, extra = MODEL_CASES[variant]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = AutoConfig.for_model(model_type, **{
        **dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, pad_token_id=0), **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_logits = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=20, do_sample=False)
        patched = rope_ext.hf.enable()
        try:
            module = sys.modules[type(model).__module__]
            assert module.__name__ in patched
            swapped = {getattr(getattr(module, name), "rope_ext_variant", None)
                       for name in dir(module)}
            # transformers 4.x gives some of these families another variant than 5.x does
            assert variant in swapped or (TRANSFORMERS_4 and swapped - {None})
            got_logits = model(ids).logits
            got_tokens = model.generate(ids, max_new_tokens=20, do_sample=False)
        finally:
            rope_ext.hf.disable()
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)


def test_coverage_of_all_families():
    """enable(all_families=True) swaps every function coverage() assigns a variant, and every
    variant of VARIANTS whose function the installed transformers has is found there."""
    import importlib

    report = rope_ext.hf.coverage()
    patched = rope_ext.hf.enable(all_families=True)
    try:
        for module_name, functions in report.items():
            module = importlib.import_module(module_name)
            for name, variant in functions.items():
                swapped = getattr(getattr(module, name), "rope_ext_variant", None)
                assert swapped == variant, (module_name, name, swapped, variant)
            assert (module_name in patched) == any(functions.values())
    finally:
        rope_ext.hf.disable()
    found = {v for functions in report.values() for v in functions.values() if v}
    if not TRANSFORMERS_4:  # every variant whose function this transformers has
        assert found == {v.name for v in variants_present()}
    # Most modeling modules with a rotary function get a drop-in: 93 of 101 in transformers
    # 4.57.1, 172 of 184 in 5.18, 201 of 214 in 5.25 (the rest rotate in other ways: 2-D
    # vision positions, ESM, CLVP).
    assert len(patched) >= 80 and len(patched) >= 0.9 * len(report), (len(patched), len(report))
