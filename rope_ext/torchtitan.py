"""rope_ext in torchtitan, through torchtitan's own override mechanism.

    torchtitan_train ... --override.imports rope_ext.torchtitan.rope_ext_complex_rope
    torchtitan_train ... --override.imports rope_ext.torchtitan.rope_ext_cos_sin_rope

Each factory swaps one of torchtitan's RoPE modules (exactly `ComplexRoPE.Config` or
`CosSinRoPE.Config`) for a subclass that rotates q and k with rope_ext's native kernels, on
the CPU and on CUDA, any layout or stride, forward and backward. The subclasses keep the
stock cache (the same buffer, built by the stock code), so checkpoints and the cache contract
are unchanged: positions None, [1, S] or [B, S], plain or DTensor; q and k as DTensors under
tensor parallelism (`use_local_output=False`) and context parallelism
(rope_ext.distributed); torchtitan's asynchronous bounds check on positions. The cache is
read in place: a complex cache through its real view, a cos/sin cache through a strided view
of its cos and sin halves, with no copy. torchtitan stays an optional dependency: nothing
else in rope_ext imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, _maybe_check_max_pos

from . import api

__all__ = ["RopeExtComplexRoPE", "RopeExtCosSinRoPE", "rope_ext_complex_rope",
           "rope_ext_cos_sin_rope"]


class RopeExtComplexRoPE(ComplexRoPE):
    """ComplexRoPE (LLaMA's complex cache, interleaved pairs) applied by rope_ext."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass

    def forward(self, query, key, positions=None):
        table = torch.view_as_real(self.cache)  # [max_seq_len, D/2, 2], no copy
        return _apply(query, key, table, positions, interleaved=True)


class RopeExtCosSinRoPE(CosSinRoPE):
    """CosSinRoPE (cat(cos, sin) of cat(freqs, freqs), rotate_half) applied by rope_ext."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def forward(self, query, key, positions=None):
        cache = self.cache  # [max_seq_len, 2 D]: cos of cat(f, f), then sin of cat(f, f)
        dim = cache.shape[-1] // 2
        table = cache.as_strided((cache.shape[0], dim // 2, 2),
                                 (cache.stride(0), cache.stride(1), dim * cache.stride(1)),
                                 cache.storage_offset())
        return _apply(query, key, table, positions, interleaved=False)


def _apply(query, key, table, positions, interleaved):
    """query [B, S, H, D], key [B, S, Hk, D]; table [max_seq_len, D/2, 2] (cos, sin)."""
    kwargs = dict(interleaved=interleaved, seq_dim=1)
    if positions is not None:
        _maybe_check_max_pos(positions, max_valid_pos=table.shape[0] - 1)
        kwargs["positions"] = positions.unsqueeze(-1)  # [B or 1, S, 1]: every head of a token
    return api.apply_rotary_qk(query, key, table, **kwargs)


@override(target=ComplexRoPE.Config, exact=True,
          description="rope_ext complex rotary embedding (native CPU and CUDA kernels).")
def rope_ext_complex_rope(cfg: ComplexRoPE.Config) -> RopeExtComplexRoPE.Config:
    return derive(cfg, RopeExtComplexRoPE.Config)


@override(target=CosSinRoPE.Config, exact=True,
          description="rope_ext cos/sin rotary embedding (native CPU and CUDA kernels).")
def rope_ext_cos_sin_rope(cfg: CosSinRoPE.Config) -> RopeExtCosSinRoPE.Config:
    return derive(cfg, RopeExtCosSinRoPE.Config)
