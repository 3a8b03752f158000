#!/usr/bin/env python
"""RoPE providers side by side against the copy bound, on CPU and CUDA.

Reports a Markdown table on stdout, and writes CSV, JSON and (with matplotlib) a PNG plot of
GB/s against sequence length per provider, the copy bound drawn as a line. The JSON starts with
the run's metadata (rope_ext.benchmark.run_metadata: date, commit, torch, CPU, kernel, GPU,
command); benchmarks/render_results.py renders docs/benchmarks.md's tables from it.

--out alone writes each device's and suite's results to benchmarks/results/<platform>/
<suite>[-<variant>] (rope_ext.benchmark.results_path: e.g. zen4-epyc/core-avx2.json with
ROPE_EXT_CPU_KERNEL=AVX2, h200/qk-norm.json); --out DIR does the same under DIR, and --out
PREFIX writes everything to PREFIX.json, .csv, .md and .png.

Examples:
  python benchmarks/bench_rope.py                            # core cases, every device
  python benchmarks/bench_rope.py --suite all --device cpu --out
  python benchmarks/bench_rope.py --suite prefill --device cuda --dtypes bfloat16
  ROPE_EXT_CPU_KERNEL=AVX2 python benchmarks/bench_rope.py --suite qk_norm --device cpu --out

The qk_norm suite (fused RMSNorm + RoPE, rope_ext.rms_norm_rotary_qk) always times its fwd+bwd
providers, with or without --backward, and adds a table of the issue's target ratios under each
case's timings (also in OUT.json under "targets").

On a GPU the peers join: FlashInfer, Liger, flash-attn's Triton rotary and vLLM where they load
(benchmarks/peers.sh carries them to a machine without an index; rope_ext.benchmark.load_peers).
Each peer provider runs once against the float64 reference before it is timed; the checks are
listed under each case (also in OUT.json under "checks"), and one that disagrees is not timed.
The header names each peer's version, and each peer not measured with the reason.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

from rope_ext import benchmark
from rope_ext.benchmark import Case

RESULTS = Path(__file__).resolve().parent / "results"
SUITES = ("core", "prefill", "gqa", "decode", "varlen", "partial", "head_dim", "mrope",
          "qk_norm", "kv_cache")


def cases(suite: str, device: str, dtype: torch.dtype) -> list[Case]:
    def c(b, s, hq, hk, d, **kw):
        return Case(b, s, hq, hk, d, dtype, device, **kw)

    if suite == "core":  # the shapes the issues' targets are stated for
        if device == "cuda":  # Llama-3-8B and -70B prefill; a serving batch's decode step
            return [c(4, 4096, 32, 8, 128, name="prefill GQA"),
                    c(1, 8192, 64, 8, 128, name="Llama-3-70B prefill"),
                    c(64, 1, 32, 8, 128, decode_offset=4000, per_sequence=True,
                      name="decode, per-sequence positions")]
        return [c(1, 2048, 32, 32, 128, name="LLaMA-7B"),
                c(32, 1, 32, 32, 128, decode_offset=1000, name="decode")]
    if suite == "prefill":
        return [c(1, s, 32, 32, 128, name="prefill") for s in (128, 512, 2048, 8192, 32768)]
    if suite == "gqa":
        return [c(1, s, 32, 8, 128, name="GQA") for s in (512, 4096)]
    if suite == "decode":
        return [c(b, 1, 32, 8, 128, decode_offset=1000, name="decode") for b in (1, 8, 32, 64)]
    if suite == "varlen":
        return [c(1, 8192, 32, 8, 128, varlen=True, name="packed varlen")]
    if suite == "partial":
        return [c(1, 4096, 32, 8, 128, rotary_dim=64, name="partial rotary")]
    if suite == "head_dim":
        return [c(1, 2048, 32, 8, d, name="head_dim") for d in (64, 80, 128, 256)]
    if suite == "mrope":  # Qwen2.5-VL-7B's attention, text + image positions
        return [c(1, 4096, 28, 4, 128, mrope=True, name="MRoPE")]
    if suite == "qk_norm":  # Qwen3's per-head RMSNorm + half-split RoPE, fused vs unfused
        prefill, decode = ((4, 4096), (64, 1)) if device == "cuda" else ((1, 2048), (32, 1))
        return [c(*prefill, 32, 8, 128, qk_norm=True, name="QK-norm prefill"),
                c(*decode, 32, 8, 128, decode_offset=1000, qk_norm=True, name="QK-norm decode")]
    if suite == "kv_cache":  # fused RoPE + KV-cache write: a paged and a static cache
        prefill, decode = ((4, 4096), (64, 1)) if device == "cuda" else ((1, 2048), (32, 1))
        return [c(*prefill, 32, 8, 128, kv_cache=layout, name="KV prefill")
                for layout in ("NHD", "HND")] + [
                c(*decode, 32, 8, 128, decode_offset=1000, kv_cache=layout, name="KV decode")
                for layout in ("NHD", "HND")]
    raise ValueError(suite)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        elapsed = time.monotonic() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.0f}s {label[:60]:60s}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def plot(results: list[benchmark.Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install '.[bench]')", file=sys.stderr)
        return False
    sweep = [r for r in results if r.case.name == "prefill"]
    if not sweep:
        return False
    panels = sorted({(r.case.device, str(r.case.dtype).removeprefix("torch.")) for r in sweep})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (device, dtype) in zip(axes[0], panels):
        rows = [r for r in sweep if r.case.device == device and str(r.case.dtype).endswith(dtype)]
        for provider in dict.fromkeys(r.provider for r in rows):
            pts = sorted((r.case.seq, r.gbps) for r in rows if r.provider == provider)
            bound = provider.startswith(("copy_", "clone"))
            ax.plot(*zip(*pts), linestyle="--" if bound else "-", marker="" if bound else "o",
                    color="black" if provider.startswith("copy_") else None,
                    linewidth=2 if bound or provider.startswith("rope_ext") else 1,
                    label=provider)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (q and k [1, S, 32, 128])")
        ax.set_ylabel("GB/s (q and k read + written)")
        ax.set_title(f"{device} {dtype}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write(prefix: Path, results: list[benchmark.Result], checks: list[benchmark.Check],
          header: list[str], meta: dict) -> None:
    """PREFIX.md (header and tables), .csv (one row per provider and case), .json (meta, then
    the header, the rows, any target ratios and the third-party providers' checks against
    the float64 reference) and, with a prefill sweep, .png."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".md").write_text("\n".join(header) + "\n\n"
                                         + benchmark.markdown_table(results, checks))
    rows = [dict(case=r.case.label(), provider=r.provider, ms=r.seconds * 1e3,
                 gbps=r.gbps, bytes=r.case.bytes_moved,
                 graph_us="" if r.graph_seconds is None else r.graph_seconds * 1e6, **{
                     f: str(getattr(r.case, f)) for f in ("device", "dtype", "seq", "batch")})
            for r in results]
    with prefix.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    targets = benchmark.target_ratios(results)
    extra = dict(targets=targets) if targets else {}
    if checks:
        extra["checks"] = [c.as_dict() for c in checks]
    prefix.with_suffix(".json").write_text(json.dumps(
        dict(**meta, header=header, results=rows, **extra), indent=1) + "\n")
    print(f"results: {prefix.with_suffix('.json')}", file=sys.stderr)
    if plot(results, prefix.with_suffix(".png")):
        print(f"plot: {prefix.with_suffix('.png')}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="core", choices=SUITES + ("all",),
                        help="which cases (default core; all = every suite)")
    parser.add_argument("--device", default="all", choices=("all", "cpu", "cuda"))
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="comma-separated: bfloat16,float16,float32 (default bfloat16,float32)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile providers")
    parser.add_argument("--backward", action="store_true",
                        help="add rope_ext forward+backward (the qk_norm suite always has its "
                             "fwd+bwd providers)")
    parser.add_argument("--min-run-time", type=float, default=0.5,
                        help="seconds of CPU timing per provider (default 0.5)")
    parser.add_argument("--out", type=Path, nargs="?", const=RESULTS,
                        help="write OUT.csv, OUT.json, OUT.md and OUT.png; with no value or a "
                             "directory, one set per device and suite in <platform>/<suite>"
                             "[-<variant>] under benchmarks/results or that directory")
    parser.add_argument("--system-heap", action="store_true",
                        help="leave malloc as it is: outputs may page-fault, depending on the "
                             "allocator's state (default: a steady heap, see "
                             "rope_ext.benchmark.steady_heap)")
    args = parser.parse_args()

    heap = ("heap: system allocator as is" if args.system_heap else benchmark.steady_heap())
    torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    suites = SUITES[1:] if args.suite == "all" else (args.suite,)
    todo = [(s, case) for d in devices for dt in dtypes for s in suites
            for case in cases(s, d, dt)]

    progress = Progress(len(todo))
    results: list[benchmark.Result] = []
    checks: list[benchmark.Check] = []
    by_suite: dict[tuple[str, str], list[benchmark.Result]] = {}
    for suite, case in todo:
        timed = benchmark.run_case(case, include_compile=not args.no_compile,
                                   include_backward=args.backward,
                                   min_run_time=args.min_run_time, checks=checks)
        results += timed
        by_suite.setdefault((case.device, suite), []).extend(timed)
        progress.step(case.label())

    command = benchmark.command_line("benchmarks/bench_rope.py", sys.argv[1:])
    header = [
        f"rope_ext benchmark: torch {torch.__version__}, {benchmark.cpu_description()}, "
        f"{args.threads} CPU threads, {heap}"
        + (f", GPU {torch.cuda.get_device_name()}" if "cuda" in devices else ""),
        "Command: " + command,
    ]
    if "cuda" in devices:
        header.append("Peers: " + (", ".join(f"{name} {peer.version}" for name, peer
                                             in benchmark.peers()[0].items()) or "none"))
    header.append("Not measured: " + ", ".join(
        sorted({m for d in devices for m in benchmark.missing_third_party(d)})))
    print("\n".join(header) + "\n\n" + benchmark.markdown_table(results, checks))
    settings = ["system-heap"] if args.system_heap else []
    if args.out and args.out.is_dir():
        for (device, suite), timed in by_suite.items():
            variant = benchmark.variant_name(device, dtypes, settings)
            labels = {r.case.label() for r in timed}
            write(benchmark.results_path(args.out, device, suite, variant), timed,
                  [c for c in checks if c.case.label() in labels], header,
                  benchmark.run_metadata(device, suite, variant, command, heap))
    elif args.out:
        device = "cuda" if "cuda" in devices else "cpu"
        variant = benchmark.variant_name(device, dtypes, settings)
        write(args.out, results, checks, header,
              benchmark.run_metadata(device, args.suite, variant, command, heap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
