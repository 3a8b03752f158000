"""rope_ext: Rotary Position Embedding kernels for PyTorch (CPU and CUDA custom ops).

    import rope_ext
    freqs_cis = rope_ext.precompute_freqs_cis(128, 4096)          # complex [4096, 64]
    xq, xk = rope_ext.apply_rotary_emb(xq, xk, freqs_cis)        # LLaMA drop-in
    q, k = rope_ext.apply_rotary_qk(q, k, freqs_cis, positions=pos, inplace=True)

The ops are torch.ops.rope_ext.* (schemas in csrc/rope_ops.cpp).
"""

from . import _native

if _native.LOADED:
    from . import _autograd, _meta  # noqa: F401  (autograd formulas and fake kernels)

    if "torch.distributed.tensor" in __import__("sys").modules:
        from . import distributed  # noqa: F401  (DTensor sharding rules)

from .api import (
    apply_rotary,
    apply_rotary_emb,
    apply_rotary_qk,
    mrope_positions,
    native_available,
    positions_from_cu_seqlens,
    precompute_freqs_cis,
    rope_frequencies,
)

from .qk_norm import rms_norm_rotary_qk
from .kv_cache import rotary_kv_cache_update, static_cache_slots

build_info = _native.build_info

__all__ = [
    "apply_rotary",
    "apply_rotary_emb",
    "apply_rotary_qk",
    "build_info",
    "mrope_positions",
    "native_available",
    "positions_from_cu_seqlens",
    "precompute_freqs_cis",
    "rms_norm_rotary_qk",
    "rope_frequencies",
    "rotary_kv_cache_update",
    "static_cache_slots",
]
__version__ = "0.1.0"
