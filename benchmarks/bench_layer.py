"""Does rope_ext make a compiled transformer layer slower? One Hugging Face decoder layer under
torch.compile, with transformers' own RoPE and with rope_ext.hf.enable().

A custom op is opaque to Inductor: around it Inductor cannot fuse the RoPE arithmetic into the
projections' epilogues or the norm before it, and it may copy a view the op mutates. The
kernel alone can be faster while the layer is not. So this times the whole layer, forward and
forward + backward:

- Llama (LlamaDecoderLayer): transformers' rotate_half compiled, against rope_ext's drop-in;
- Qwen3 (Qwen3DecoderLayer): the same, and rope_ext with fuse_qk_norm=True (q_norm, k_norm
  and RoPE in one rms_norm_rotary_qk).

    python benchmarks/bench_layer.py [--device cuda] [--seq 4096] [--out [FILE.json]]

The default on CUDA is Llama-3-8B's layer (hidden 4096, 32 query and 8 key-value heads of
128, MLP 14336) at batch 1 and --seq 4096, bf16, sdpa attention. On CPU it is float32 and the
same heads with hidden 1024 and MLP 2048 at seq 512: a layer whose GEMMs dwarf RoPE would
hide any cost around it. Before it is timed, each rope_ext layer's output (and, with
backward, its input and weight gradients) is compared with transformers' compiled layer: a
difference beyond bf16 rounding is reported and the layer is not timed.

Each provider is compiled once (torch._dynamo.reset() between them, since enable() changes
the functions a trace sees), then timed in interleaved rounds (rope_ext.benchmark.time_fn;
CUDA events on GPU). Ratios are time / transformers' compiled layer, round by round
(rope_ext.benchmark.paired_ratio): above 1 means rope_ext made the compiled layer slower.
--out alone writes benchmarks/results/<platform>/layer[-<variant>].json
(rope_ext.benchmark.results_path), the run's metadata first.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import statistics
import sys
import types
from pathlib import Path
from typing import Callable

import torch

import rope_ext.hf
from rope_ext import benchmark

RESULTS = Path(__file__).resolve().parent / "results"
# name -> (transformers modeling module, config class, layer class, rotary class, QK-norm)
MODELS = {
    "Llama": ("llama", "LlamaConfig", "LlamaDecoderLayer", "LlamaRotaryEmbedding", False),
    "Qwen3": ("qwen3", "Qwen3Config", "Qwen3DecoderLayer", "Qwen3RotaryEmbedding", True),
}
HF = "compiled, transformers' RoPE"
OURS = "compiled, rope_ext.hf.enable()"
FUSED = "compiled, rope_ext.hf.enable(fuse_qk_norm=True)"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int

    def label(self) -> str:
        return (f"[{self.batch}, {self.seq}] hidden {self.hidden}, heads {self.heads}/"
                f"{self.kv_heads} x {self.head_dim}, MLP {self.mlp}")


def default_shape(device: str, seq: int | None) -> Shape:
    if device == "cuda":
        return Shape(1, seq or 4096, 4096, 32, 8, 128, 14336)
    return Shape(1, seq or 512, 1024, 32, 8, 128, 2048)


def build(model: str, shape: Shape, device: str, dtype: torch.dtype):
    """The layer (seeded weights, so every provider gets the same), its input and cos/sin."""
    import importlib

    family, config_name, layer_name, rotary_name, _ = MODELS[model]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(importlib.import_module("transformers"), config_name)(
        hidden_size=shape.hidden, intermediate_size=shape.mlp,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=max(shape.seq, 4096),
        num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = getattr(modeling, layer_name)(config, layer_idx=0).to(device, dtype)
    for p in layer.parameters():  # norms' weights away from 1, so a skipped norm shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype)
    positions = torch.arange(shape.seq, device=device)[None].expand(shape.batch, -1)
    cos, sin = getattr(modeling, rotary_name)(config).to(device)(x, positions)
    return layer, x, (cos, sin)


def layer_call(layer, x, cos_sin):
    out = layer(hidden_states=x, attention_mask=None, position_embeddings=cos_sin)
    return out[0] if isinstance(out, tuple) else out


_COMPILED = itertools.count()


def compiled_provider(layer, x, cos_sin, backward: bool):
    """A compiled call of the layer, and what one call produces (its output, and with
    backward the gradients of x and of every weight). Each provider compiles its own copy of
    layer_call (a code object of its own), so its graphs stay cached beside the others'."""
    code = layer_call.__code__.replace(co_name=f"layer_call_{next(_COMPILED)}")
    fn = torch.compile(types.FunctionType(code, layer_call.__globals__))
    # The same output gradient for every provider, so that their gradients compare.
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x)
    inp = x.detach().clone().requires_grad_(backward)

    def call():
        if not backward:
            with torch.no_grad():
                return (fn(layer, inp, cos_sin),)
        layer.zero_grad(set_to_none=True)
        inp.grad = None
        fn(layer, inp, cos_sin).backward(grad)
        return (inp.grad, *(p.grad for p in layer.parameters()))

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = [t.detach().clone() for t in call()]
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs:
        raise RuntimeError("torch.compile reused another provider's graph")
    return call, out


def agree(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest error relative to each tensor's scale: bf16 rounding of a layer's outputs and
    gradients stays under a few percent; a wrong rotation or norm is off by order 1."""
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               .item() for g, w in zip(got, want))


TOLERANCE = 0.05  # bf16: two compiled graphs fuse and round differently


def run(device: str, dtype: torch.dtype, shape: Shape, models: list[str], backward: list[bool],
        min_run_time: float, rounds: int = 5,
        done: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """The rows of every model and pass; done(rows so far) after each (model, pass), so that a
    run cut short by a time limit keeps what it finished (forward passes first)."""
    rows = []
    torch._dynamo.reset()
    for bwd in backward:
        for model in models:
            layer, x, cos_sin = build(model, shape, device, dtype)
            providers = [(HF, None), (OURS, False)] + ([(FUSED, True)] if MODELS[model][4]
                                                       else [])
            calls: dict[str, tuple[Callable[[], object], bool | None]] = {}  # call, fuse
            errors: dict[str, float | None] = {}
            want = None
            for name, fuse in providers:
                rope_ext.hf.disable()
                if fuse is not None:
                    rope_ext.hf.enable(fuse_qk_norm=fuse)
                try:
                    call, out = compiled_provider(layer, x, cos_sin, bwd)
                finally:
                    rope_ext.hf.disable()
                if want is None:
                    want, errors[name] = out, None
                else:
                    errors[name] = agree(out, want)
                    if not errors[name] <= TOLERANCE:  # NaN included
                        print(f"{model} {name}: differs from transformers' layer by "
                              f"{errors[name]:.3g}, not timed", file=sys.stderr)
                        continue
                calls[name] = call, fuse
            # Interleaved rounds, each provider with the functions it was compiled with in
            # place; a recompile there would time the compiler, so it is an error.
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, (call, fuse) in calls.items():
                    if fuse is not None:
                        rope_ext.hf.enable(fuse_qk_norm=fuse)
                    try:
                        with torch.compiler.set_stance("fail_on_recompile"):
                            times[name].append(
                                benchmark.time_fn(call, device, min_run_time / rounds))
                    finally:
                        rope_ext.hf.disable()
            base = times.get(HF)
            for name, t in times.items():
                ratio = (statistics.median(a / b for a, b in zip(t, base)) if base else None)
                rows.append(dict(model=model, pass_="fwd+bwd" if bwd else "fwd", provider=name,
                                 ms=statistics.median(t) * 1e3, rounds_ms=[s * 1e3 for s in t],
                                 ratio_to_hf=ratio, max_error=errors[name]))
            rows += [dict(model=model, pass_="fwd+bwd" if bwd else "fwd", provider=name,
                          ms=None, rounds_ms=[], ratio_to_hf=None, max_error=errors[name])
                     for name in errors if name not in times]
            done(rows)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="default bfloat16 on CUDA, float32 on CPU (where "
                        "bfloat16 matmul gradients take a slow path without AVX-512-BF16: "
                        "2.3 s against float32's 0.05 s for a [1, 32] layer on Zen 3)")
    parser.add_argument("--seq", type=int, help="sequence length (default 4096 on CUDA, 512 "
                                                 "on CPU)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--min-run-time", type=float, default=2.0)
    parser.add_argument("--out", type=Path, nargs="?", const=RESULTS,
                        help="write the rows and the machine to this JSON (no value: "
                             "benchmarks/results/<platform>/layer[-<variant>].json)")
    args = parser.parse_args()
    import transformers

    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    shape = default_shape(args.device, args.seq)
    backward = [False] if args.no_backward else [False, True]
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else benchmark.cpu_description())
    print(f"{machine}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print(f"one decoder layer, {shape.label()}, {args.dtype}, sdpa\n")
    print("| model | pass | provider | ms | time / transformers' | max error |\n"
          "|---|---|---|---:|---:|---:|", flush=True)
    printed = 0
    if args.out:  # the file and its header once; each done() rewrites it with the rows so far
        out, meta = benchmark.json_output(
            args.out, args.device, "layer", [dtype], "benchmarks/bench_layer.py", sys.argv[1:],
            heap="system allocator as is")
        meta.update(machine=machine, device=args.device, python=platform.python_version(),
                    transformers=transformers.__version__, shape=shape.label(), dtype=args.dtype)

    def done(rows: list[dict]) -> None:
        nonlocal printed
        for r in rows[printed:]:
            ms = "not timed" if r["ms"] is None else f"{r['ms']:.2f}"
            ratio = "-" if r["ratio_to_hf"] is None else f"{r['ratio_to_hf']:.3f}"
            err = "-" if r["max_error"] is None else f"{r['max_error']:.2g}"
            print(f"| {r['model']} | {r['pass_']} | {r['provider']} | {ms} | {ratio} | {err} |",
                  flush=True)
        printed = len(rows)
        if args.out:
            out.write_text(json.dumps(dict(**meta, layers=rows), indent=1) + "\n")

    rows = run(args.device, dtype, shape, args.models, backward, args.min_run_time, done=done)
    return 0 if all(r["ms"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
