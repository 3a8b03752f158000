"""rope_ext for Hugging Face transformers models.

    import rope_ext.hf
    rope_ext.hf.enable()       # every supported model family now rotates with rope_ext
    rope_ext.hf.disable()      # back to transformers' own function

`apply_rotary_pos_emb` is a drop-in for transformers' function of that name: half-split
pairs, `cos`/`sin` as the model's rotary module returns them, q and k in one kernel launch.
`table_from_config` builds a model's (scaled) table natively from its config.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil

import torch

from . import api

# Families checked to share transformers' apply_rotary_pos_emb; enable() also patches every
# other imported (or, with all_families=True, importable) module whose function is that one.
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
            "gemma2", "gemma3", "olmo2", "granite", "phi3", "starcoder2")

_patched: dict[str, object] = {}  # module name -> transformers' original function


def _rotate_with_cos_sin(q, k, cos, sin, unsqueeze_dim):
    half = cos.shape[-1] // 2
    # The rotary module's cos/sin are cat(freqs, freqs) (times the attention factor): their
    # first halves are the table rows of this call, one per (batch, token).
    table = torch.stack([cos[..., :half], sin[..., :half]], -1).float()
    if table.dim() == 3:
        table = table.unsqueeze(0)
    rows, seq = table.shape[0], table.shape[1]
    table = table.reshape(rows * seq, half, 2)
    positions = torch.arange(rows * seq, device=q.device).view(rows, seq)
    if unsqueeze_dim == 1:
        positions, seq_dim = positions.view(rows, 1, seq), 2
    elif unsqueeze_dim == 2:
        positions, seq_dim = positions.view(rows, seq, 1), 1
    else:
        raise ValueError(f"apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    return api.apply_rotary_qk(q, k, table, positions=positions, seq_dim=seq_dim,
                               interleaved=False)


def _apply_rotary_pos_emb_v5(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb, backed by rope_ext's native kernels.

    q, k: [B, H, S, D] (unsqueeze_dim=1) or [B, S, H, D] (unsqueeze_dim=2); cos, sin:
    [B, S, R] or [S, R] with R <= D (features R.. pass through).
    """
    return _rotate_with_cos_sin(q, k, cos, sin, unsqueeze_dim)


def _apply_rotary_pos_emb_v4(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers 4.x's apply_rotary_pos_emb (position_ids unused, as there)."""
    return _rotate_with_cos_sin(q, k, cos, sin, unsqueeze_dim)


def _transformers_major() -> int:
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 5


# The installed transformers' signature.
apply_rotary_pos_emb = (_apply_rotary_pos_emb_v5 if _transformers_major() >= 5
                        else _apply_rotary_pos_emb_v4)
apply_rotary_pos_emb.__name__ = "apply_rotary_pos_emb"


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


def _is_shared_function(fn, reference) -> bool:
    """Whether fn is transformers' shared apply_rotary_pos_emb (same code, any docstring)."""
    code, ref = getattr(fn, "__code__", None), reference.__code__
    return code is not None and code.co_code == ref.co_code and code.co_names == ref.co_names


def _modeling_modules(all_families: bool) -> list[str]:
    import sys

    import transformers.models

    names = {f"transformers.models.{f}.modeling_{f}" for f in FAMILIES}
    names |= {n for n in sys.modules if n.startswith("transformers.models.") and ".modeling_" in n}
    if all_families:
        for info in pkgutil.iter_modules(transformers.models.__path__):
            names.add(f"transformers.models.{info.name}.modeling_{info.name}")
    return sorted(names)


def enable(all_families: bool = False) -> list[str]:
    """Routes transformers' apply_rotary_pos_emb through rope_ext; returns the modules patched.

    Patches the FAMILIES and every already-imported modeling module whose function is the
    shared one (all_families=True imports and checks every family first). transformers 5 marks
    the function for its kernels hub, which only loads hub repositories, so the module
    attribute the attention layers call is swapped instead.
    """
    from transformers.models.llama import modeling_llama

    reference = _patched.get("transformers.models.llama.modeling_llama",
                             modeling_llama.apply_rotary_pos_emb)
    for name in _modeling_modules(all_families):
        if name in _patched:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a family whose optional dependencies are missing
            continue
        original = getattr(module, "apply_rotary_pos_emb", None)
        if original is not None and _is_shared_function(original, reference):
            _patched[name] = original
            module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return sorted(_patched)


def disable() -> None:
    """Restores transformers' own apply_rotary_pos_emb everywhere enable() swapped it."""
    for name, original in _patched.items():
        importlib.import_module(name).apply_rotary_pos_emb = original
    _patched.clear()


def enabled() -> bool:
    return bool(_patched)


__all__ = ["apply_rotary_pos_emb", "disable", "enable", "enabled", "rope_parameters",
           "table_from_config"]
