"""Stock transformers RoPE functions against their rope_ext drop-ins (rope_ext.hf), bf16 q, k
[1, 32, 2048, 128] on the CPU, median of torch.utils.benchmark runs:

    python benchmarks/bench_hf_variants.py
"""
import importlib, torch, torch.utils.benchmark as tb, warnings
warnings.filterwarnings("ignore")
import rope_ext.hf as h
torch.manual_seed(0)
B, H, S, D = 1, 32, 2048, 128
for family, fn in [("llama", "apply_rotary_pos_emb"), ("cohere", "apply_rotary_pos_emb"),
                   ("deepseek_v3", "apply_rotary_pos_emb_interleave"), ("olmo2", "apply_rotary_pos_emb")]:
    m = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    stock = getattr(m, fn)
    h.enable(); dropin = getattr(m, fn); h.disable()
    q = torch.randn(B, H, S, D, dtype=torch.bfloat16); k = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    ang = torch.rand(B, S, D // 2) * 100
    v = next(v for v in h.VARIANTS if v.family == family)
    c, s = ang.cos(), ang.sin()
    if v.layout == "repeated": c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    else: c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
    cos_dtype = torch.float32 if family == "olmo2" else torch.bfloat16
    c, s = c.to(cos_dtype), s.to(cos_dtype)
    t = {}
    for name, f in [("stock", stock), ("rope_ext", dropin)]:
        t[name] = tb.Timer("f(q, k, c, s)", globals=dict(f=f, q=q, k=k, c=c, s=s)).blocked_autorange(min_run_time=1.0).median * 1e3
    print(f"| {family} `{fn}` ({v.name}) | {t['stock']:.2f} | {t['rope_ext']:.2f} | {t['stock']/t['rope_ext']:.1f}x |")
