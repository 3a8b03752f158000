"""What the DTensor layer costs, and rope_ext's torchtitan override against torchtitan's own
RoPE modules, on the CPU (medians of torch.utils.benchmark runs):

    python benchmarks/bench_distributed.py           # torchtitan rows need torchtitan installed

1. apply_rotary_qk on DTensor q, k (a one-process gloo mesh, heads sharded: the local call is
   the whole call) against the same call on the local tensors: the DTensor layer's own
   dispatch cost, bf16, at the decode shape and a prefill shape.
2. torchtitan's ComplexRoPE and CosSinRoPE against rope_ext.torchtitan's, bf16 q and k
   [1, 2048, 32, 128], forward and forward + backward.
"""

from __future__ import annotations

import os
import platform
import socket

import torch
import torch.distributed as dist
import torch.utils.benchmark as tb

import rope_ext


def median_us(fn, min_run_time=1.0) -> float:
    return tb.Timer("fn()", globals=dict(fn=fn)).blocked_autorange(
        min_run_time=min_run_time).median * 1e6


def dtensor_overhead() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    table = rope_ext.precompute_freqs_cis(128, 4096)
    print("| shape (q; k the same) | call | local call (us) | DTensor call (us) | DTensor layer (us) |")
    print("|---|---|---:|---:|---:|")
    for shape in ((32, 1, 32, 128), (1, 2048, 32, 128)):
        q = torch.randn(shape, dtype=torch.bfloat16)
        k = torch.randn(shape, dtype=torch.bfloat16)
        dq, dk = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k))
        for inplace in (True, False):
            local = median_us(lambda: rope_ext.apply_rotary_qk(q, k, table, inplace=inplace))
            distributed = median_us(
                lambda: rope_ext.apply_rotary_qk(dq, dk, table, inplace=inplace))
            print(f"| {list(shape)} | {'in place' if inplace else 'out of place'} | "
                  f"{local:.1f} | {distributed:.1f} | {distributed - local:.1f} |")
    dist.destroy_process_group()


def torchtitan_modules() -> None:
    try:
        from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

        import rope_ext.torchtitan as tt
    except ImportError as error:
        print(f"(torchtitan rows skipped: {error})")
        return
    q = torch.randn(1, 2048, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 2048, 32, 128, dtype=torch.bfloat16)
    positions = torch.arange(2048)[None]
    print("| module | stock fwd (ms) | rope_ext fwd (ms) | stock fwd+bwd (ms) | rope_ext fwd+bwd (ms) |")
    print("|---|---:|---:|---:|---:|")
    for cls, factory in ((ComplexRoPE, tt.rope_ext_complex_rope),
                         (CosSinRoPE, tt.rope_ext_cos_sin_rope)):
        config = dict(dim=128, max_seq_len=8192, theta=500000.0)
        stock, ours = cls.Config(**config).build(), factory(cls.Config(**config)).build()
        row = []
        for module in (stock, ours):
            with torch.no_grad():
                row.append(median_us(lambda: module(q, k, positions)) / 1e3)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()

        def step(module):
            out_q, out_k = module(qg, kg, positions)
            torch.autograd.backward((out_q, out_k), (out_q, out_k))
        row += [median_us(lambda: step(stock)) / 1e3, median_us(lambda: step(ours)) / 1e3]
        print(f"| {cls.__name__} | " + " | ".join(f"{t:.2f}" for t in row) + " |")


if __name__ == "__main__":
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, rope_ext CPU kernel "
          f"{rope_ext.build_info().get('cpu_kernel')}")
    dtensor_overhead()
    torchtitan_modules()
