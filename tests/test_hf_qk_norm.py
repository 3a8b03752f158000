"""rope_ext.hf.enable(fuse_qk_norm=True) on the QK-norm families, Qwen3, Qwen3-MoE and Gemma 3
(tiny configs, random weights, norm weights included): the stock model's logits, greedy
generations and gradients, with q_norm/k_norm and the rotation run as one
rms_norm_rotary_qk; disable() restores every function and forward."""

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
import rope_ext  # noqa: E402
import rope_ext.hf  # noqa: E402

pytestmark = pytest.mark.integration

FAMILIES = ["qwen3", "qwen3_moe", "gemma3"]
LAYERS = 2


def classes(family):
    """The family's modeling module, attention class and q_norm/k_norm class."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    spec = next(s for s in rope_ext.hf.QK_NORM if s.family == family)
    return module, getattr(module, spec.attention), getattr(module, spec.norm)


def tiny_model(family, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
             "gemma3": dict(sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"])}.get(family, {})
    config = AutoConfig.for_model(
        "gemma3_text" if family == "gemma3" else family, vocab_size=96, hidden_size=64,
        intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norm weights away from their init (ones; Gemma's zeros)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn_like(param) * 0.5 + (0.0 if family == "gemma3" else 1.0))
    return model.to(dtype).eval()


IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def patched():
    yield
    rope_ext.hf.disable()


@pytest.fixture
def fused_calls(monkeypatch, patched):
    """The q_weight of each call rope_ext.hf makes to the fused op."""
    calls = []
    fused = rope_ext.qk_norm.rms_norm_rotary_qk
    monkeypatch.setattr(rope_ext.qk_norm, "rms_norm_rotary_qk",
                        lambda *args, **kwargs: calls.append(args[2]) or fused(*args, **kwargs))
    return calls


def run(model):
    with torch.no_grad():
        return model(IDS).logits, model.generate(IDS, max_new_tokens=20, do_sample=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_generation_match_float32(family, fused_calls):
    model = tiny_model(family)
    want_logits, want_tokens = run(model)
    rope_ext.hf.enable(fuse_qk_norm=True)
    got_logits, got_tokens = run(model)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    # One fused call per layer and step: the prompt, then 19 decoding steps with the cache.
    assert len(fused_calls) == 2 * LAYERS + 19 * LAYERS


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_generation_match_bfloat16(family, fused_calls):
    model = tiny_model(family, torch.bfloat16)
    want_logits, want_tokens = run(model)
    with torch.no_grad():
        want_steps = model(want_tokens).logits.float()
    rope_ext.hf.enable(fuse_qk_norm=True)
    got_logits, got_tokens = run(model)
    # transformers rounds the norm to bfloat16 (Qwen3 before and after the weight), then rotates
    # in bfloat16 from bfloat16 cos/sin; the fused op works in float32 and rounds once.
    torch.testing.assert_close(got_logits.float(), want_logits.float(), atol=2e-2, rtol=2e-2)
    # Those roundings differ, so a greedy token may flip where two logits lie closer than
    # they do (qwen3, transformers 5.25: the first prompt's 15th new token, its two best
    # logits 0.002 apart). So: the stock model's tokens, fed to both, give logits within the
    # tolerance at every step, and the fused model's generation agrees with the stock one up
    # to a step where the stock token is within twice that tolerance of the fused model's
    # best, and from there on may not.
    with torch.no_grad():
        got_steps = model(want_tokens).logits.float()
    torch.testing.assert_close(got_steps, want_steps, atol=2e-2, rtol=2e-2)
    assert got_tokens.shape == want_tokens.shape
    for b in range(IDS.shape[0]):
        for t in range(IDS.shape[1], want_tokens.shape[1]):
            if got_tokens[b, t] != want_tokens[b, t]:
                step = got_steps[b, t - 1]
                margin = step.max() - step[want_tokens[b, t]]
                assert margin <= 2 * (2e-2 + 2e-2 * step.abs().max()), (b, t, margin)
                break


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_op_replaces_the_norms(family, fused_calls, monkeypatch):
    """Each attention's q_norm and k_norm hand their weights to the fused op and never run
    their own forward; the other norms of the class still do."""
    module, _, norm_cls = classes(family)
    ran = []
    stock = norm_cls.forward
    monkeypatch.setattr(norm_cls, "forward", lambda self, x: ran.append(self) or stock(self, x))
    model = tiny_model(family)
    attentions = [layer.self_attn for layer in model.model.layers]
    rope_ext.hf.enable(fuse_qk_norm=True)
    with torch.no_grad():
        model(IDS)
    assert [id(w) for w in fused_calls] == [id(a.q_norm.weight) for a in attentions]
    assert not {id(m) for m in ran} & {id(n) for a in attentions for n in (a.q_norm, a.k_norm)}
    assert ran  # the decoder layers' own norms
    # Called outside an attention, the norms and the rotation are transformers' own.
    x = torch.randn(2, 4, 24, 16)
    torch.testing.assert_close(attentions[0].q_norm(x), stock(attentions[0].q_norm, x))
    angles = torch.rand(1, 24, 8) * 20
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k = module.apply_rotary_pos_emb(x, x[:, :2], cos, sin)
    assert len(fused_calls) == LAYERS
    rope_ext.hf.disable()
    want_q, want_k = module.apply_rotary_pos_emb(x, x[:, :2], cos, sin)
    torch.testing.assert_close((q, k), (want_q, want_k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_norm_with_a_forward_hook_runs_its_own_forward(family, fused_calls):
    """A forward hook must see k_norm's output: that attention falls back to both norms'
    own forwards and the plain rotation; the other layers stay fused."""
    model = tiny_model(family)
    want = run(model)[0]
    seen = []
    hook = model.model.layers[0].self_attn.k_norm.register_forward_hook(
        lambda module, args, out: seen.append(out))
    rope_ext.hf.enable(fuse_qk_norm=True)
    with torch.no_grad():
        got = model(IDS).logits
    hook.remove()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(fused_calls) == LAYERS - 1 and len(seen) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_with_different_eps_run_their_own_forwards(family, fused_calls):
    """The fused op takes one eps: an attention whose q_norm and k_norm differ in it falls
    back to the norms' own forwards and the plain rotation."""
    model = tiny_model(family)
    spec = next(s for s in rope_ext.hf.QK_NORM if s.family == family)
    setattr(model.model.layers[0].self_attn.k_norm, spec.eps, 1e-2)
    want = run(model)[0]
    rope_ext.hf.enable(fuse_qk_norm=True)
    with torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(fused_calls) == LAYERS - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_disable_restores_and_plain_enable_leaves_the_norms(family, fused_calls):
    module, attention, norm = classes(family)
    stock = (module.apply_rotary_pos_emb, attention.forward, norm.forward)

    def current():
        return module.apply_rotary_pos_emb, attention.forward, norm.forward

    rope_ext.hf.enable()
    assert current() == (rope_ext.hf.apply_rotary_pos_emb, *stock[1:])
    rope_ext.hf.enable(fuse_qk_norm=True)  # on top of a plain enable()
    fused = current()
    assert all(f is not s for f, s in zip(fused, stock))
    assert fused[0].rope_ext_variant == "half-split"
    assert fused[0].__wrapped__ is rope_ext.hf.apply_rotary_pos_emb
    rope_ext.hf.enable()  # leaves them fused
    assert current() == fused
    rope_ext.hf.disable()
    assert all(c is s for c, s in zip(current(), stock))
    assert not rope_ext.hf.enabled()
    rope_ext.hf.enable(fuse_qk_norm=True)  # and again from scratch
    assert current()[1:] != stock[1:]
    rope_ext.hf.disable()
    assert all(c is s for c, s in zip(current(), stock))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match(family, checkpointing, fused_calls):
    model = tiny_model(family).train()  # (no dropout in these configs)
    if checkpointing:  # the backward pass runs the attention forward again
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()

    def grads():
        model.zero_grad()
        logits = model(IDS).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), IDS.roll(-1).flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = grads()
    rope_ext.hf.enable(fuse_qk_norm=True)
    got = grads()
    assert len(fused_calls) == LAYERS * (2 if checkpointing else 1)
    for name, grad in want.items():
        tol = dict(atol=1e-6, rtol=1e-5) if "q_norm" in name or "k_norm" in name else dict(
            atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got[name], grad, **tol, msg=lambda m: f"{name}: {m}")
    assert any(got[f"model.layers.{i}.self_attn.k_norm.weight"].abs().max() > 1e-3
               for i in range(LAYERS))


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_model(family, fullgraph, patched):
    model = tiny_model(family)
    with torch.no_grad():
        want = model(IDS).logits
        rope_ext.hf.enable(fuse_qk_norm=True)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=fullgraph)
        compiled(IDS)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = compiled(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ops = [e.name for e in prof.events()]
    assert ops.count("rope_ext::rms_norm_rotary_qk") == LAYERS


def test_threads_keep_their_own_state(fused_calls):
    """Models of two families run concurrently, each in its own threads."""
    models = {f: tiny_model(f) for f in ("qwen3", "gemma3")}
    with torch.no_grad():
        want = {f: m(IDS).logits for f, m in models.items()}
    rope_ext.hf.enable(fuse_qk_norm=True)
    results, barrier = {}, threading.Barrier(4)

    def worker(i, family):
        barrier.wait()
        with torch.no_grad():
            results[i] = [models[family](IDS).logits for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(i, f))
               for i, f in enumerate(["qwen3", "gemma3"] * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, family in enumerate(["qwen3", "gemma3"] * 2):
        for got in results[i]:
            torch.testing.assert_close(got, want[family], atol=1e-5, rtol=1e-5)
    assert len(fused_calls) == 4 * 3 * LAYERS
