"""Greedy decoding in the style of gpt-fast: a small Llama with a static KV cache per layer,
whose attention rotates q and k and writes k and v into the cache with one fused call
(rope_ext.rotary_kv_cache_update). The decode step is compiled: with CUDA graphs
(mode="reduce-overhead") on a GPU, plain torch.compile on a CPU. The same loop without the
fusion (rotate in place, then index_copy_ into the cache, as transformers' StaticCache does)
must produce the same tokens.

    python examples/kv_cache_decode.py [--steps 16] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import rope_ext


class Attention(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, batch, max_len, fused):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.fused = heads, kv_heads, dim // heads, fused
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        # A static cache [B, H_kv, max_len, D]: cache_layout "HND", one block per sequence.
        shape = (batch, kv_heads, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, freqs_cis, input_pos, mask):
        b, s, _ = x.shape
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(b, s, h, d), k.view(b, s, kvh, d), v.view(b, s, kvh, d)
        positions = input_pos.view(1, s, 1).expand(b, s, 1)
        if self.fused:
            max_len = self.k_cache.shape[2]
            slots = rope_ext.static_cache_slots(positions[..., 0], max_len)
            rope_ext.rotary_kv_cache_update(q, k, v, freqs_cis, self.k_cache, self.v_cache,
                                            slots, positions=positions, cache_layout="HND",
                                            inplace=True)
        else:
            rope_ext.apply_rotary_qk(q, k, freqs_cis, positions=positions, inplace=True)
            self.k_cache.index_copy_(2, input_pos, k.transpose(1, 2))
            self.v_cache.index_copy_(2, input_pos, v.transpose(1, 2))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), self.k_cache.repeat_interleave(h // kvh, 1),
            self.v_cache.repeat_interleave(h // kvh, 1), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, h * d))


class Block(torch.nn.Module):
    def __init__(self, dim, *args):
        super().__init__()
        self.attention = Attention(dim, *args)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim, bias=False), torch.nn.SiLU(),
                                       torch.nn.Linear(4 * dim, dim, bias=False))
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)

    def forward(self, x, freqs_cis, input_pos, mask):
        x = x + self.attention(self.norm1(x), freqs_cis, input_pos, mask)
        return x + self.mlp(self.norm2(x))


class Transformer(torch.nn.Module):
    def __init__(self, vocab=512, dim=256, layers=2, heads=8, kv_heads=2, batch=2, max_len=64,
                 fused=True):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            Block(dim, heads, kv_heads, batch, max_len, fused) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)
        # The table's real view [max_len, D/2, 2] (cos, sin): no complex tensor in the graph.
        table = rope_ext.precompute_freqs_cis(dim // heads, max_len, 500000.0)
        self.register_buffer("freqs_cis", torch.view_as_real(table), persistent=False)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, tokens, input_pos):
        mask = self.causal[input_pos][None, None]  # [1, 1, S, max_len]: the cache written so far
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.freqs_cis, input_pos, mask)
        return self.output(self.norm(x))


def decode_one_token(model, token, input_pos):
    logits = model(token, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True), logits[:, -1]


@torch.no_grad()
def generate(model, prompt, steps, step_fn):
    """The prompt in one forward, then `steps` tokens one at a time (greedy)."""
    s = prompt.shape[1]
    logits = model(prompt, torch.arange(s, device=prompt.device))
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens, all_logits = [token], [logits[:, -1]]
    for i in range(steps - 1):
        token, last = step_fn(model, token, torch.tensor([s + i], device=prompt.device))
        tokens.append(token.clone())
        all_logits.append(last.clone())
    return torch.cat(tokens, 1), torch.stack(all_logits, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    fused = Transformer(fused=True).to(device)
    plain = Transformer(fused=False).to(device)
    plain.load_state_dict(fused.state_dict())
    prompt = torch.randint(0, 512, (2, 8), device=device)

    def run(model, step_fn):
        for layer in model.layers:  # an empty cache for each run
            layer.attention.k_cache.zero_()
            layer.attention.v_cache.zero_()
        tokens, logits = generate(model, prompt, args.steps, step_fn)
        caches = [t.clone() for layer in model.layers
                  for t in (layer.attention.k_cache, layer.attention.v_cache)]
        return tokens, logits, caches

    # Eager, the fused and the unfused loop agree bit for bit: logits and every cache row.
    want_tokens, want_logits, want_caches = run(plain, decode_one_token)
    tokens, logits, caches = run(fused, decode_one_token)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches))

    # Compiled, the fused loop gives the same tokens; Inductor's own kernels for the rest of
    # the model (norms, activations) round differently, so logits and caches agree closely.
    mode = "reduce-overhead" if device.type == "cuda" else None
    step = torch.compile(decode_one_token, mode=mode, fullgraph=True)
    start = time.perf_counter()
    tokens, logits, caches = run(fused, step)
    seconds = time.perf_counter() - start
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches, want_caches):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    print(f"{args.steps} tokens x {prompt.shape[0]} sequences on {device.type}, the same as the "
          f"unfused loop (eager: bit for bit; compiled{', CUDA graphs' if mode else ''}: "
          f"{seconds:.1f} s with its compile): {tokens[0].tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
