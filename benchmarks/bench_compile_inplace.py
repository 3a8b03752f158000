"""What in-place RoPE on views of one qkv buffer costs under torch.compile.

A view whose storage offset is a symbol (a dynamic-shape trace) loses that offset when
Inductor lets a custom op mutate it (pytorch/pytorch#198068); rope_ext then traces the
in-place call as the functional op, a check of the targets and copy_ into the views
(csrc/autograd_common.h). Which views sit at symbolic offsets depends on the layout and on
which dims are dynamic: this times apply_rotary_qk(inplace=True) on three common layouts,
compiled with static shapes, automatic dynamic shapes and dynamic=True, against eager and
copying the same bytes in the same run.

    python benchmarks/bench_compile_inplace.py [--device cuda] [--out [FILE.json]]

Every row moves q and k once each way (the bytes of an in-place call); GB/s and the ratio to
`copy_` of those bytes are per call. --out alone writes benchmarks/results/<platform>/
compile-inplace[-<variant>].json (rope_ext.benchmark.results_path), the run's metadata
(rope_ext.benchmark.run_metadata) first.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import torch

import rope_ext
from rope_ext import benchmark

RESULTS = Path(__file__).resolve().parent / "results"
B, S, HQ, HKV, D = 1, 2048, 32, 8, 128  # Llama-3-8B's heads, one 2048-token prefill


def packed(proj):  # [B, S, (HQ + 2 HKV) * D], split at the model's constant sizes
    b, s, _ = proj.shape
    return (proj[..., :HQ * D].view(b, s, HQ, D),
            proj[..., HQ * D:(HQ + HKV) * D].view(b, s, HKV, D))


# name: (q and k as views of the buffer, the buffer, its sequence dim)
LAYOUTS = {
    "packed [B, S, (Hq + 2 Hkv) * D]": (packed, (B, S, (HQ + 2 * HKV) * D), 1),
    "qkv [B, S, 3, H, D][:, :, i]": (lambda x: (x[:, :, 0], x[:, :, 1]), (B, S, 3, HKV, D), 1),
    "qkv [3, B, S, H, D][i]": (lambda x: (x[0], x[1]), (3, B, S, HKV, D), 2),
}
# How Dynamo is asked for shapes. Automatic dynamic: called at two other lengths first, so
# that the sequence dim alone has become a symbol, as in a serving loop.
MODES = ("static", "automatic dynamic", "dynamic=True")


def compiled(fn, mode: str, buffer: torch.Tensor, seq_dim: int):
    torch._dynamo.reset()
    c = torch.compile(fn, fullgraph=True, dynamic={"static": False, "dynamic=True": True}.get(mode))
    if mode == "automatic dynamic":
        for length in (100, 200):
            c(buffer.narrow(seq_dim, 0, length).clone())
    return c


def run(device: str, dtype: torch.dtype, min_run_time: float) -> list[dict]:
    table = rope_ext.precompute_freqs_cis(D, 4096, device=device)
    rows = []
    for layout, (split, shape, seq_dim) in LAYOUTS.items():
        buffer = torch.randn(shape, device=device, dtype=dtype)
        q, k = split(buffer)
        q_src, k_src = q.clone(), k.clone()

        def rotate(x):
            rope_ext.apply_rotary_qk(*split(x), table, interleaved=False, inplace=True)

        providers = {"copy_ (the bound)": lambda: (q.copy_(q_src), k.copy_(k_src)),
                     "eager": lambda: rotate(buffer)}
        for mode in MODES:
            providers[f"compiled, {mode}"] = functools.partial(
                compiled(rotate, mode, buffer, seq_dim), buffer)
        bytes_moved = 2 * (q.numel() + k.numel()) * q.element_size()
        seconds = {p: benchmark.time_fn(fn, device, min_run_time) for p, fn in providers.items()}
        for provider, t in seconds.items():
            rows.append(dict(layout=layout, dtype=str(dtype).removeprefix("torch."),
                             provider=provider, us=t * 1e6, gbps=bytes_moved / t / 1e9,
                             ratio_to_copy=t / seconds["copy_ (the bound)"],
                             ratio_to_eager=t / seconds["eager"]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--min-run-time", type=float, default=0.5)
    parser.add_argument("--out", type=Path, nargs="?", const=RESULTS,
                        help="write the rows and the machine to this JSON (no value: "
                             "benchmarks/results/<platform>/compile-inplace[-<variant>].json)")
    args = parser.parse_args()
    rows = run(args.device, getattr(torch, args.dtype), args.min_run_time)
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else benchmark.cpu_description())
    print(f"{machine}; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print(f"q [{B}, {S}, {HQ}, {D}] and k [{B}, {S}, {HKV}, {D}], {args.dtype}, in place\n")
    print("| layout | provider | us | GB/s | / copy_ | / eager |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['provider']} | {r['us']:.1f} | {r['gbps']:.1f} | "
              f"{r['ratio_to_copy']:.2f} | {r['ratio_to_eager']:.2f} |")
    if args.out:
        out, meta = benchmark.json_output(
            args.out, args.device, "compile-inplace", [getattr(torch, args.dtype)],
            "benchmarks/bench_compile_inplace.py", sys.argv[1:], heap="system allocator as is")
        out.write_text(json.dumps(dict(
            **meta, machine=machine, device=args.device, python=platform.python_version(),
            rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
