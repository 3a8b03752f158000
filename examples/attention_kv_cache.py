"""A LLaMA-style attention block with a KV cache: prefill a prompt, then decode token by
token, with rope_ext rotating q and k in place, on whatever device is present.

    python examples/attention_kv_cache.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import rope_ext


class Attention(torch.nn.Module):
    def __init__(self, dim=256, heads=8, kv_heads=2, max_seq=1024, theta=500000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", rope_ext.precompute_freqs_cis(self.head_dim, max_seq, theta))
        self.cache_k = self.cache_v = None

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [B, S, dim] holds the tokens at positions start .. start + S - 1."""
        b, s, _ = x.shape
        hd, h, kvh = self.head_dim, self.heads, self.kv_heads
        qkv = self.wqkv(x)
        q = qkv[..., : h * hd].view(b, s, h, hd)
        k = qkv[..., h * hd:(h + kvh) * hd].view(b, s, kvh, hd)
        v = qkv[..., (h + kvh) * hd:].view(b, s, kvh, hd)
        # Views into the fused projection, rotated in place: no copies of q or k.
        rope_ext.apply_rotary_qk(q, k, self.freqs_cis, offset=start, inplace=True)
        if start == 0:
            self.cache_k, self.cache_v = k, v
        else:
            self.cache_k = torch.cat([self.cache_k, k], 1)
            self.cache_v = torch.cat([self.cache_v, v], 1)
        keys = self.cache_k.repeat_interleave(h // kvh, 2).transpose(1, 2)
        values = self.cache_v.repeat_interleave(h // kvh, 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=start == 0)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    block = Attention().to(device).eval()
    prompt = torch.randn(2, 32, 256, device=device)
    with torch.no_grad():
        out = block(prompt, start=0)
        steps = [out[:, -1:]]
        for t in range(8):
            steps.append(block(steps[-1], start=32 + t))
        # The same sequence in one pass gives the same last outputs as prefill + decode.
        full = torch.cat([prompt] + steps[:-1], 1)
        check = Attention().to(device).eval()
        check.load_state_dict(block.state_dict())
        reference_out = check(full, start=0)[:, -8:]
    decoded = torch.cat(steps[1:], 1)
    err = (decoded - reference_out).abs().max().item()
    print(f"device {device}, native kernels: {rope_ext.native_available()}")
    print(f"prefill 32 tokens, decoded 8; max difference from one full pass: {err:.2e}")
    assert err < 1e-4


if __name__ == "__main__":
    main()
