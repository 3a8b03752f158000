"""rope_ext for Hugging Face transformers models.

    import rope_ext.hf
    rope_ext.hf.enable()       # every recognised RoPE function now rotates with rope_ext
    rope_ext.hf.disable()      # back to transformers' own functions

transformers gives every model family its own copy of its RoPE function, and those copies
come in a few dozen behaviours: half-split or interleaved pairs, full or partial rotary, cos
tables laid out as cat(freqs, freqs), repeat_interleave(freqs, 2) or freqs alone, complex
freqs_cis, one tensor or q and k, float32 compute with a cast back, DeepSeek's de-interleaving
variant. `VARIANTS` names each behaviour by a function of the installed transformers that
has it; `enable()` recognises a module's function by its code (and that of the helpers it
calls, such as rotate_half) and swaps in a rope_ext drop-in with the same signature and
semantics, q and k in one kernel launch. `table_from_config` builds a model's (scaled)
table natively from its config.

Vision-language models with multi-axis RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; MROPE_ROTARY) go
further: their text rotary module's forward is replaced too, so that it returns the model's
table and the [3, B, S] position ids (MropePositions) rather than cos/sin built per token, and
the attention's apply_rotary_pos_emb drop-in rotates q and k natively with the model's
mrope_section. Their vision towers' apply_rotary_pos_emb_vision goes through the native op.

With enable(fuse_qk_norm=True), the QK-norm families (Qwen3, Qwen3-MoE, Gemma 3; QK_NORM)
normalise and rotate q and k in one rope_ext.rms_norm_rotary_qk: while their attention's
forward runs, its q_norm and k_norm return their input, and the apply_rotary_pos_emb call that
follows applies both norms with the rotation.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import sys
import threading
from typing import NamedTuple

import torch

from . import api, qk_norm

# Families enable() always imports and checks; with all_families=True it checks every family
# transformers ships, and it always checks every modeling module already imported.
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
            "gemma2", "gemma3", "olmo2", "granite", "phi3", "starcoder2", "qwen2_vl",
            "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

_patched: dict[tuple[str, str], object] = {}  # (module, function name) -> transformers' function


@dataclasses.dataclass(frozen=True)
class Variant:
    """One behaviour of transformers' RoPE functions, and how rope_ext reproduces it.

    family, function: a function of the installed transformers that has this behaviour; every
        function with the same code (and the same helpers) is this variant.
    layout: how the function reads its rotary dim R and angles from cos/sin:
        "cat"      cos [..., R] is cat(freqs, freqs): the angles are cos[..., :R/2];
        "repeated" cos [..., R] is freqs.repeat_interleave(2): the angles are cos[..., 0::2];
        "half"     cos [..., R/2] holds the angles themselves.
    interleaved: pairs (2i, 2i+1), else (i, i + R/2). Features R.. pass through.
    inverse: the function rotates by the negative angle (a sign-flipped rotate_half).
    cast: the outputs' dtypes: "promote" torch's promotion of the input and cos (the
        arithmetic runs in that dtype), "each" each input's own, "q" q's for both.
    deinterleave: DeepSeek's apply_rotary_pos_emb_interleave: rotate interleaved pairs and
        return the rotated even features, then the odd ones.
    bare_q: with k None, return the rotated q alone rather than (q, None).
    heads_dim: for complex freqs_cis [B, S, R/2], the dim of q and k that holds the heads.
    """

    name: str
    family: str
    function: str
    layout: str = "cat"
    interleaved: bool = False
    inverse: bool = False
    cast: str = "promote"
    deinterleave: bool = False
    bare_q: bool = False
    heads_dim: int = 1


VARIANTS = (
    Variant("half-split", "llama", "apply_rotary_pos_emb"),
    Variant("half-split, partial", "gpt_neox", "apply_rotary_pos_emb"),
    Variant("half-split, partial", "phi3", "apply_rotary_pos_emb"),
    Variant("half-split, partial", "nemotron", "apply_rotary_pos_emb"),
    Variant("half-split, partial", "glmasr", "apply_rotary_pos_emb"),
    Variant("half-split, partial, optional k", "qwen4_exp", "apply_rotary_pos_emb", bare_q=True),
    Variant("half-split, cast back to each dtype", "olmo2", "apply_rotary_pos_emb", cast="each"),
    Variant("half-split, float32, cast to q's dtype", "modernbert", "apply_rotary_pos_emb",
            cast="q"),
    Variant("half-split, half-size cos", "gpt_oss", "apply_rotary_pos_emb", layout="half"),
    Variant("half-split, negated angle", "nanochat", "apply_rotary_pos_emb", inverse=True),
    Variant("half-split, one tensor", "gemma3n", "apply_rotary_pos_emb"),
    Variant("interleaved, repeated cos, float32", "cohere", "apply_rotary_pos_emb",
            layout="repeated", interleaved=True, cast="q"),
    Variant("interleaved, repeated cos", "blt", "apply_rotary_pos_emb", layout="repeated",
            interleaved=True),
    Variant("interleaved, repeated cos, partial", "glm4v", "apply_rotary_pos_emb",
            layout="repeated", interleaved=True),
    Variant("interleaved, repeated cos, float32", "ernie4_5_vl_moe", "apply_rotary_pos_emb",
            layout="repeated", interleaved=True, cast="q"),
    Variant("interleaved, cat cos", "helium", "apply_rotary_pos_emb", interleaved=True),
    Variant("interleaved, cat cos, partial", "glm", "apply_rotary_pos_emb", interleaved=True),
    Variant("interleaved, cat cos, float32", "ernie4_5", "apply_rotary_pos_emb",
            interleaved=True, cast="q"),
    Variant("interleaved, cat cos (2x2 matrices)", "pe_audio", "apply_rotary_pos_emb",
            interleaved=True),
    Variant("interleaved, half-size cos", "openai_privacy_filter", "apply_rotary_pos_emb",
            layout="half", interleaved=True),
    Variant("interleaved, one tensor, half-size sin/cos (GPT-J)", "gptj", "apply_rotary_pos_emb",
            layout="half", interleaved=True),
    Variant("DeepSeek interleave", "deepseek_v3", "apply_rotary_pos_emb_interleave",
            deinterleave=True),
    Variant("DeepSeek interleave, optional k", "mistral_large4", "apply_rotary_pos_emb_interleave",
            deinterleave=True),
    Variant("complex freqs_cis, heads at dim 1", "deepseek_v2", "apply_rotary_emb",
            layout="half", interleaved=True, cast="each"),
    Variant("complex freqs_cis, heads at dim 2", "llama4", "apply_rotary_emb", layout="half",
            interleaved=True, cast="each", heads_dim=2),
    Variant("half-split, float32, cos per patch (vision towers)", "qwen2_vl",
            "apply_rotary_pos_emb_vision", cast="each"),
)

# Multi-axis RoPE (Qwen2-VL and later): the text rotary module whose forward enable() replaces,
# and whether its sections interleave (Qwen3-VL). The replacement returns the model's table and
# an MropePositions in place of (cos, sin), so no cos/sin is built per token; the family's
# apply_rotary_pos_emb drop-in then rotates q and k with mrope_section.
MROPE_ROTARY = (
    ("qwen2_vl", "Qwen2VLRotaryEmbedding", False),
    ("qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding", False),
    ("qwen3_vl", "Qwen3VLTextRotaryEmbedding", True),
    ("qwen3_vl_moe", "Qwen3VLMoeTextRotaryEmbedding", True),
)


class QKNorm(NamedTuple):
    """A family whose attention normalises each head of q and k right before the rotation.

    attention, norm: the attention class and the RMSNorm class of its q_norm and k_norm.
    eps: the norm's attribute holding eps (both norms are built with the config's).
    weight_offset: what the norm adds to its weight (Gemma's 1 + weight).
    promotes: the norm's output dtype is the input's promoted with the weight's (Qwen3's
        weight * x.to(dtype)), else the input's (Gemma 3 casts back).
    """

    family: str
    attention: str
    norm: str
    eps: str
    weight_offset: float
    promotes: bool


# enable(fuse_qk_norm=True) fuses these where the installed attention forward calls q_norm,
# k_norm and then apply_rotary_pos_emb, as transformers 5 and 4.x do.
QK_NORM = (
    QKNorm("qwen3", "Qwen3Attention", "Qwen3RMSNorm", "variance_epsilon", 0.0, True),
    QKNorm("qwen3_moe", "Qwen3MoeAttention", "Qwen3MoeRMSNorm", "variance_epsilon", 0.0, True),
    QKNorm("gemma3", "Gemma3Attention", "Gemma3RMSNorm", "eps", 1.0, False),
)


class MropePositions(NamedTuple):
    """What an MRoPE rotary module returns in place of sin under enable(): position ids
    [3, B, S] and the sections; cos is then the model's table [P, R/2, 2]."""

    positions: torch.Tensor
    section: tuple
    interleaved: bool


def _rows_table(cos, sin, unsqueeze_dim, layout):
    """The table [rows, R/2, 2] of a call's cos/sin [*lead, W], and positions (the row of each
    (batch, token)) shaped as cos.unsqueeze(unsqueeze_dim) without its last dim, so they
    broadcast against q's leading dims exactly as cos does against q."""
    if layout == "cat":
        cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    elif layout == "repeated":
        cos, sin = cos[..., 0::2], sin[..., 0::2]
    real = torch.float64 if cos.dtype == torch.float64 else torch.float32
    table = torch.stack([cos, sin], -1).to(real)
    lead = table.shape[:-2]
    positions = torch.arange(lead.numel(), device=table.device).view(lead)
    if unsqueeze_dim is not None:  # cos [*lead, W].unsqueeze(d), without its last dim
        positions = positions.unsqueeze(unsqueeze_dim if unsqueeze_dim >= 0
                                        else unsqueeze_dim + len(lead) + 2)
    return table.reshape(-1, *table.shape[-2:]), positions


def _deinterleaved(x):
    return torch.cat((x[..., 0::2], x[..., 1::2]), -1)


def _rotate(v: Variant, q, k, cos, sin, unsqueeze_dim):
    """q (and k, when given) rotated as variant v's function rotates them."""
    if isinstance(sin, MropePositions):  # cos is the table (see MROPE_ROTARY)
        # As cos [B, S, W].unsqueeze(unsqueeze_dim), after the positions' axis dim.
        lead = sin.positions.dim() - 1
        d = unsqueeze_dim if unsqueeze_dim >= 0 else unsqueeze_dim + lead + 2
        positions = sin.positions.unsqueeze(d + 1)
        kwargs = dict(positions=positions, interleaved=v.interleaved, inverse=v.inverse,
                      mrope_section=sin.section, mrope_interleaved=sin.interleaved)
        if k is None:
            q_out = api.apply_rotary(q, cos, **kwargs)
            return q_out if v.bare_q else (q_out, None)
        return api.apply_rotary_qk(q, k, cos, **kwargs)
    if v.cast == "promote":  # the arithmetic runs in the promoted dtype, as there
        dtype = torch.promote_types(q.dtype, cos.dtype)
        q = q.to(dtype)
        k = None if k is None else k.to(torch.promote_types(k.dtype, cos.dtype))
    table, positions = _rows_table(cos, sin, unsqueeze_dim, v.layout)
    kwargs = dict(positions=positions, interleaved=v.interleaved, inverse=v.inverse)
    if v.deinterleave:  # rotate the de-interleaved copy in place: half-split pairs there
        q, k = _deinterleaved(q), None if k is None else _deinterleaved(k)
        kwargs["inplace"] = True
    if k is None:
        q_out = api.apply_rotary(q, table, **kwargs)
        return q_out if v.bare_q else (q_out, None)
    q_out, k_out = api.apply_rotary_qk(q, k, table, **kwargs)
    return q_out, k_out.to(q_out.dtype) if v.cast == "q" else k_out


def _plain(fn):
    """The Python function behind fn. With the `kernels` package installed, transformers 5.x
    (5.25 on) makes each hub-kernel function, apply_rotary_pos_emb among them, an nn.Module
    instance whose forward calls the function it was made from (the closure's `func`)."""
    forward = getattr(type(fn), "forward", None)
    if isinstance(fn, torch.nn.Module) and getattr(forward, "__closure__", None):
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__))
        inner = cells["func"].cell_contents if "func" in cells else None
        if inspect.isfunction(inner):
            return inner
    return fn


def _dropin(v: Variant, reference):
    """A function with reference's parameters that rotates as v, through rope_ext."""
    reference = _plain(reference)
    params = tuple(inspect.signature(reference).parameters)
    if params == ("q", "k", "cos", "sin", "unsqueeze_dim"):
        def fn(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
            return _rotate(v, q, k, cos, sin, unsqueeze_dim)
    elif params == ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"):
        def fn(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            return _rotate(v, q, k, cos, sin, unsqueeze_dim)
    elif params == ("x", "cos", "sin", "unsqueeze_dim"):
        def fn(x, cos, sin, unsqueeze_dim=1):
            return _rotate(v, x, None, cos, sin, unsqueeze_dim)[0]
    elif params == ("x", "cos", "sin", "position_ids", "unsqueeze_dim"):  # 4.x's Gemma 3n
        def fn(x, cos, sin, position_ids=None, unsqueeze_dim=1):
            return _rotate(v, x, None, cos, sin, unsqueeze_dim)[0]
    elif params == ("q", "k", "cos", "sin"):  # vision towers: [N, H, D], cos [N, D]
        def fn(q, k, cos, sin):
            return _rotate(v, q, k, cos, sin, -2)
    elif params == ("tensor", "sin", "cos"):  # GPT-J: [B, S, H, R], sin/cos [B, S, R/2]
        def fn(tensor, sin, cos):
            return _rotate(v, tensor, None, cos, sin, 2)[0]
    elif params == ("xq", "xk", "freqs_cis"):
        def fn(xq, xk, freqs_cis):
            table = torch.view_as_real(freqs_cis)
            return _rotate(v, xq, xk, table[..., 0], table[..., 1], v.heads_dim)
    else:
        return None
    fn.__name__ = fn.__qualname__ = reference.__name__
    fn.__signature__ = inspect.signature(reference)
    fn.__doc__ = (f"transformers' {v.family} {reference.__name__} ({v.name}), rotating with "
                  "rope_ext's native kernels.")
    fn.rope_ext_variant = v.name
    return fn


def _fingerprint(fn, namespace: dict, depth: int = 0):
    """What a function does, by its code: bytecode, names and constants (docstrings aside),
    parameters, and the same for the module functions it calls (rotate_half differs between
    half-split and interleaved families whose apply functions are byte-identical)."""
    code = getattr(_plain(fn), "__code__", None)
    if code is None:
        return None
    helpers = tuple(
        _fingerprint(namespace[name], namespace, depth + 1)
        if depth < 2 and inspect.isfunction(_plain(namespace.get(name))) else name
        for name in code.co_names)
    consts = tuple(c for c in code.co_consts if not isinstance(c, str))
    return (code.co_code, code.co_names, repr(consts),
            code.co_varnames[: code.co_argcount + code.co_kwonlyargcount], helpers)


_known: dict | None = None  # fingerprint -> (Variant, drop-in), for the installed transformers


def _known_variants() -> dict:
    global _known
    if _known is None:
        _known = {}
        for v in VARIANTS:
            try:
                module = importlib.import_module(
                    f"transformers.models.{v.family}.modeling_{v.family}")
            except Exception:  # noqa: BLE001 - a family this transformers lacks
                continue
            reference = _original(module.__name__, v.function, getattr(module, v.function, None))
            fn = _dropin(v, reference) if reference is not None else None
            if fn is not None:
                _known.setdefault(_fingerprint(reference, vars(module)), (v, fn))
    return _known


def _original(module_name: str, name: str, current):
    return _patched.get((module_name, name), current)


def rope_parameters(config) -> dict:
    """The config's rope dict, transformers 5 (rope_parameters) or 4.x (rope_scaling)."""
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if "original_max_position_embeddings" not in params and hasattr(
            config, "original_max_position_embeddings"):  # Phi-3's longrope keeps it here
        params["original_max_position_embeddings"] = config.original_max_position_embeddings
    return params


def table_from_config(config, end: int | None = None, *, seq_len: int | None = None,
                      device=None, dtype=torch.float32) -> torch.Tensor:
    """The model's complex table [end, R/2], scaling and attention factor included."""
    params = rope_parameters(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    dim = head_dim if rope_type == "proportional" else int(head_dim * partial)
    return api.precompute_freqs_cis(
        dim, end or config.max_position_embeddings, rope_scaling=params,
        max_position_embeddings=config.max_position_embeddings, seq_len=seq_len,
        device=device, dtype=dtype)


def _modeling_modules(all_families: bool) -> list[str]:
    import transformers.models

    names = {f"transformers.models.{f}.modeling_{f}" for f in FAMILIES}
    names |= {n for n in sys.modules if n.startswith("transformers.models.") and ".modeling_" in n}
    if all_families:
        for info in pkgutil.iter_modules(transformers.models.__path__):
            names.add(f"transformers.models.{info.name}.modeling_{info.name}")
    return sorted(names)


def _rope_functions(module) -> dict[str, tuple[object, tuple | None]]:
    """The module's own public top-level functions whose name says rotary or rope, as
    transformers wrote them (whether or not enable() swapped them), each with its (variant,
    drop-in), or None where rope_ext has none. Private helpers such as gpt-oss's
    _apply_rotary_emb are reached through the public ones."""
    known = _known_variants()
    out = {}
    for name, current in list(vars(module).items()):
        fn = _original(module.__name__, name, current)
        plain = _plain(fn)
        if (("rotary" in name or "rope" in name) and not name.startswith("_")
                and inspect.isfunction(plain) and plain.__module__ == module.__name__):
            out[name] = (fn, known.get(_fingerprint(fn, vars(module))))
    return out


# MRoPE rotary, QK-norm attention and norm class -> transformers' forward
_patched_forwards: dict[type, object] = {}


def _mrope_table(module, device) -> torch.Tensor:
    """The model's real table [P, R/2, 2] on device, built once per module and device."""
    tables = module.__dict__.setdefault("_rope_ext_tables", {})
    if device not in tables:
        table = table_from_config(module.config, device=device)
        tables[device] = torch.view_as_real(table)
    return tables[device]


def _mrope_forward(original, interleaved: bool):
    """A forward for an MRoPE text rotary module: (table, MropePositions) instead of cos and
    sin; transformers' own forward where the rope type scales frequencies dynamically."""
    def forward(self, x, position_ids):
        if self.rope_type != "default":
            return original(self, x, position_ids)
        position_ids = position_ids.expand(3, -1, -1)
        return _mrope_table(self, x.device), MropePositions(
            position_ids, tuple(self.mrope_section), interleaved)

    forward.__doc__ = original.__doc__
    forward.rope_ext_original = original
    return forward


def _enable_mrope(module) -> None:
    """Swaps the family's MRoPE text rotary forward, once its apply_rotary_pos_emb is patched
    (the drop-in that understands what the new forward returns)."""
    family = module.__name__.rsplit(".", 2)[-2]
    for fam, cls_name, interleaved in MROPE_ROTARY:
        cls = getattr(module, cls_name, None)
        # transformers 5's structure: the module builds cos/sin (recomposition_frequencies) and
        # the attention calls apply_rotary_pos_emb; 4.x's attention called
        # apply_multimodal_rotary_pos_emb with the sections instead.
        if (fam == family and cls is not None and cls not in _patched_forwards
                and hasattr(cls, "recomposition_frequencies")
                and not hasattr(module, "apply_multimodal_rotary_pos_emb")
                and (module.__name__, "apply_rotary_pos_emb") in _patched):
            _patched_forwards[cls] = cls.forward
            cls.forward = _mrope_forward(cls.forward, interleaved)


class _Deferred(NamedTuple):
    """The norms of the QK-norm attention whose forward runs in this thread, from its start to
    its first rotation; the first n of them (q_norm first, the attention's order) returned
    their input."""

    spec: QKNorm
    stock: object  # the norm class's own forward
    norms: tuple  # (q_norm, k_norm)
    n: int = 0


class _Deferral(threading.local):
    def __init__(self):  # run in each thread: torch.compile's guards need an instance attribute
        self.state: _Deferred | None = None


_deferral = _Deferral()  # per thread: concurrent models, autograd's recomputation threads


def _attention_forward(original, spec: QKNorm, stock):
    """transformers' attention forward, run with its q_norm and k_norm deferred to the
    rotation; nested calls keep their own state."""
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        outer = _deferral.state
        _deferral.state = _Deferred(spec, stock, (self.q_norm, self.k_norm))
        try:
            return original(self, *args, **kwargs)
        finally:
            _deferral.state = outer

    return forward


def _norm_forward(stock):
    """A QK-norm class forward that returns its input when it is the next norm to defer;
    transformers' own elsewhere (the class's other norms, a norm with forward hooks, which
    would see the input)."""
    @functools.wraps(stock)
    def forward(self, x):
        state = _deferral.state
        if (state is not None and state.n < 2 and self is state.norms[state.n]
                and not self._forward_hooks):
            _deferral.state = _Deferred(*state[:3], state.n + 1)
            return x
        return stock(self, x)

    return forward


def _fused_dropin(v: Variant, plain):
    """apply_rotary_pos_emb of a QK-norm family: the attention's call after both its norms
    were deferred runs rms_norm_rotary_qk; any other call runs the deferred norms, if any,
    with their own forward, then plain (the family's drop-in)."""
    def fn(q, k, cos, sin, *args, **kwargs):
        state = _deferral.state
        if state is None or state.n == 0:
            return plain(q, k, cos, sin, *args, **kwargs)
        _deferral.state = None  # norms called after this rotation are not deferred
        q_norm, k_norm = state.norms
        eps = getattr(q_norm, state.spec.eps)
        # (the attention passes four arguments; the fused op takes one eps for both norms)
        if state.n < 2 or args or kwargs or getattr(k_norm, state.spec.eps) != eps:
            q = state.stock(q_norm, q)
            k = state.stock(k_norm, k) if state.n == 2 else k
            return plain(q, k, cos, sin, *args, **kwargs)
        # The dtype transformers' norm, then rotation, would give: promote as those do.
        dtype = torch.promote_types(q.dtype, cos.dtype)
        if state.spec.promotes:
            dtype = torch.promote_types(dtype, q_norm.weight.dtype)
        weights = [w if w.dtype == dtype else w.float() for w in (q_norm.weight, k_norm.weight)]
        table, positions = _rows_table(cos, sin, 1, v.layout)
        return qk_norm.rms_norm_rotary_qk(
            q.to(dtype), k.to(dtype), *weights, table, eps=eps,
            weight_offset=state.spec.weight_offset, positions=positions,
            interleaved=v.interleaved)

    functools.update_wrapper(fn, plain)
    return fn


def _enable_qk_norm(module) -> None:
    """Swaps the family's QK_NORM attention and norm forwards, and its apply_rotary_pos_emb
    drop-in for the fused one, where its attention forward calls q_norm, k_norm and
    apply_rotary_pos_emb and that function is a variant the fused op rotates as (no inverse,
    no de-interleaving)."""
    family = module.__name__.rsplit(".", 2)[-2]
    for spec in (q for q in QK_NORM if q.family == family):
        attention, norm = getattr(module, spec.attention, None), getattr(module, spec.norm, None)
        entry = _rope_functions(module).get("apply_rotary_pos_emb", (None, None))[1]
        if (attention is None or norm is None or entry is None or attention in _patched_forwards
                or entry[0].inverse or entry[0].deinterleave
                or not {"q_norm", "k_norm", "apply_rotary_pos_emb"}
                <= set(inspect.unwrap(attention.forward).__code__.co_names)):
            continue
        stock = _patched_forwards.setdefault(norm, norm.forward)
        norm.forward = _norm_forward(stock)
        _patched_forwards[attention] = attention.forward
        attention.forward = _attention_forward(attention.forward, spec, stock)
        module.apply_rotary_pos_emb = _fused_dropin(*entry)


def enable(all_families: bool = False, fuse_qk_norm: bool = False) -> list[str]:
    """Routes transformers' RoPE functions through rope_ext; returns the modules patched.

    Checks the FAMILIES and every already-imported modeling module (all_families=True imports
    and checks every family first) and swaps each function of a known variant for its
    drop-in. transformers 5 marks some of these functions for its kernels hub, which only
    loads hub repositories, so the module attribute the attention layers call is swapped.
    fuse_qk_norm: also fuse the QK_NORM families' q_norm and k_norm with their rotation
    (rope_ext.rms_norm_rotary_qk); a later enable() without it leaves them fused.
    """
    for name in _modeling_modules(all_families):
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a family whose optional dependencies are missing
            continue
        for fn_name, (fn, entry) in _rope_functions(module).items():
            if entry is not None and (name, fn_name) not in _patched:
                _patched[(name, fn_name)] = fn
                setattr(module, fn_name, entry[1])
        _enable_mrope(module)
        if fuse_qk_norm:
            _enable_qk_norm(module)
    return sorted({module for module, _ in _patched})


def disable() -> None:
    """Restores transformers' own functions and forwards everywhere enable() swapped them."""
    for (name, fn_name), original in _patched.items():
        setattr(importlib.import_module(name), fn_name, original)
    _patched.clear()
    for cls, forward in _patched_forwards.items():
        cls.forward = forward
    _patched_forwards.clear()


def enabled() -> bool:
    return bool(_patched)


def coverage() -> dict:
    """What enable(all_families=True) covers in the installed transformers: for every
    modeling module that defines a RoPE function (a top-level function named *rotary* or
    *rope*), each function's variant name, or None where rope_ext has no drop-in."""
    import transformers.models

    report = {}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            module = importlib.import_module(
                f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 - missing optional dependencies, or no modeling file
            continue
        functions = {n: entry and entry[0].name
                     for n, (_, entry) in _rope_functions(module).items()}
        if functions:
            report[module.__name__] = functions
    return report


def _llama_reference():
    from transformers.models.llama import modeling_llama

    return (_original(modeling_llama.__name__, "apply_rotary_pos_emb",
                      modeling_llama.apply_rotary_pos_emb), vars(modeling_llama))


def __getattr__(name):
    # apply_rotary_pos_emb: the Llama drop-in, for calling directly, with the installed
    # transformers' signature ((q, k, cos, sin, unsqueeze_dim=1); 4.x adds position_ids).
    # Built on first use, which imports transformers.
    if name == "apply_rotary_pos_emb":
        return _known_variants()[_fingerprint(*_llama_reference())][1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MROPE_ROTARY", "MropePositions", "QKNorm", "QK_NORM", "VARIANTS", "Variant",
           "apply_rotary_pos_emb", "coverage", "disable", "enable", "enabled", "rope_parameters",
           "table_from_config"]
