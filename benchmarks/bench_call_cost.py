#!/usr/bin/env python
"""The fixed cost of a rope_ext call, part by part, on CPU.

At a one-row q, k (where the kernel's own work is nothing) and at the decode shape, each
path a user can take: the Python API in place and out of place, the eager entries it calls
(csrc/rope_python.cpp), the bare torch.ops calls (what a compiled graph runs), and the
pieces a call is made of, beside copying the same tensors (`copy_` and `clone`, each twice,
one per tensor). Best of 5 repeats, in us.

Examples:
  python benchmarks/bench_call_cost.py
  ROPE_EXT_CPU_KERNEL=AVX2 python benchmarks/bench_call_cost.py --threads 2
"""

from __future__ import annotations

import argparse
import timeit

import torch

import rope_ext
from rope_ext import benchmark


def best_us(fn, number: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    table = rope_ext.precompute_freqs_cis(128, 4096)
    real = torch.view_as_real(table)
    ops = torch.ops.rope_ext
    entries = rope_ext._C
    print(f"rope_ext call cost: torch {torch.__version__}, {benchmark.cpu_description()}, "
          f"{args.threads} CPU threads, {args.dtype}\n")
    print("| path | q, k [1,1,1,128] (us) | q, k [32,1,32,128] (us) |\n|---|---:|---:|")
    shapes = [(1, 1, 1, 128), (32, 1, 32, 128)]
    inputs = [(torch.randn(s, dtype=dtype), torch.randn(s, dtype=dtype)) for s in shapes]
    buffers = [(q.clone(), k.clone()) for q, k in inputs]
    rows = {
        "copy_ x2 (the in-place bound)": lambda q, k, b: (b[0].copy_(q), b[1].copy_(k)),
        "clone x2 (the out-of-place bound)": lambda q, k, b: (q.clone(), k.clone()),
        "torch.empty_like x2 (output allocation)": lambda q, k, b: (torch.empty_like(q),
                                                                    torch.empty_like(k)),
        "torch.view_as_real(table)": lambda q, k, b: torch.view_as_real(table),
        "rope_ext.apply_rotary_qk(..., inplace=True)": lambda q, k, b: rope_ext.apply_rotary_qk(
            q, k, table, offset=1000, inplace=True),
        "rope_ext.apply_rotary_qk(...)": lambda q, k, b: rope_ext.apply_rotary_qk(
            q, k, table, offset=1000),
        "rope_ext._C.apply_rotary_qk_ (the wrapper's eager entry)":
            lambda q, k, b: entries.apply_rotary_qk_(q, k, real, None, 1000, 1, True, False,
                                                     None, False),
        "rope_ext._C.apply_rotary_qk": lambda q, k, b: entries.apply_rotary_qk(
            q, k, real, None, 1000, 1, True, False, None, False),
        "torch.ops.rope_ext.apply_rotary_qk_": lambda q, k, b: ops.apply_rotary_qk_(
            q, k, real, None, 1000, 1, True, False),
        "torch.ops.rope_ext.apply_rotary_qk": lambda q, k, b: ops.apply_rotary_qk(
            q, k, real, None, 1000, 1, True, False),
    }
    for name, fn in rows.items():
        cells = [best_us(lambda: fn(q, k, b), 20000 if q.numel() < 1024 else 2000)
                 for (q, k), b in zip(inputs, buffers)]
        print(f"| {name} | {cells[0]:.2f} | {cells[1]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
