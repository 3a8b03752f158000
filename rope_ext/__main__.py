"""python -m rope_ext: what this build holds, a self-check against the float64 reference on
every available device, and a short benchmark for a LLaMA-7B-like shape."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import torch

from . import _native, api, benchmark, qk_norm, reference


def self_check(device: str) -> list[str]:
    """Compares each op family (rotation, fused RMSNorm + rotation, table) with the float64
    reference, out of place and in place (the values written into the inputs, which an
    in-place call must also return); returns failures."""
    failures = []
    gen = torch.Generator().manual_seed(0)
    table = api.precompute_freqs_cis(64, 128, device=device)
    real = torch.view_as_real(table).double()
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3,
                 torch.float64: 1e-12}

    def compare(what, got, want, tol):
        for g, w in zip(got, want):
            err = (g.double() - w).abs().max().item()
            if err > tol * (1 + w.abs().max().item()):
                failures.append(f"{what} error {err:.3g}")

    def in_place(what, call, q, k, want, tol):
        """call(q', k') on copies of q and k: it must write them and return them."""
        targets = (q.clone(), k.clone())
        returned = call(*targets)
        if returned[0] is not targets[0] or returned[1] is not targets[1]:
            failures.append(f"{what} did not return its inputs")
        compare(what, targets, want, tol)

    for dtype, tol in tolerance.items():
        for interleaved in (True, False):
            q = torch.randn(2, 64, 8, 64, generator=gen).to(device, dtype)
            k = torch.randn(2, 64, 2, 64, generator=gen).to(device, dtype)
            positions = torch.randint(0, 128, (2, 64, 1), generator=gen).to(device)
            kwargs = dict(positions=positions, interleaved=interleaved)
            where = f"{device} {dtype} interleaved={interleaved}:"
            want = [reference.apply_rotary(t.double(), real, **kwargs) for t in (q, k)]
            compare(where, api.apply_rotary_qk(q, k, table, **kwargs), want, tol)
            in_place(f"{where} in place", lambda q, k: api.apply_rotary_qk(
                q, k, table, inplace=True, **kwargs), q, k, want, tol)
            weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(device)
            want = [reference.rms_norm_rotary(t.double(), weight.double(), real, **kwargs)
                    for t in (q, k)]
            compare(f"{where} rms_norm_rotary_qk",
                    qk_norm.rms_norm_rotary_qk(q, k, weight, weight, table, **kwargs), want, tol)
            in_place(f"{where} rms_norm_rotary_qk in place",
                     lambda q, k: qk_norm.rms_norm_rotary_qk(q, k, weight, weight, table,
                                                             inplace=True, **kwargs),
                     q, k, want, tol)
    exact = reference.precompute_freqs_cis(64, 128, device=device)
    if (table - exact).abs().max().item() > 1.2e-7:
        failures.append(f"{device} precompute_freqs_cis differs from the float64 table")
    return failures


def quiet_third_party() -> None:
    """Keeps messages that say nothing about the user's setup out of the report: Inductor
    imports torch.utils.cpp_extension, which logs "No CUDA runtime is found" on every
    machine without a GPU, and warns that it runs complex operators eagerly (the LLaMA
    reference is complex)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    warnings.filterwarnings(
        "ignore", message="Torchinductor does not support code generation for complex operators")


def setup_notes(info: dict[str, str]) -> list[str]:
    """What the user may want to act on, each said once: no GPU, the eager fallback, a CPU
    kernel narrower than the processor could run."""
    notes = []
    if not torch.cuda.is_available():
        notes.append("no GPU visible: only the CPU kernels run here"
                     + (" (the CUDA kernels are built)" if info.get("cuda") == "yes" else ""))
    if not _native.LOADED:
        notes.append(f"the compiled extension did not load, every call takes the eager path: "
                     f"{_native.LOAD_ERROR}")
    elif not api.native_available():
        notes.append("ROPE_EXT_DISABLE_NATIVE=1: every call takes the eager path")
    if info.get("cpu_kernel") == "DEFAULT":
        notes.append("this processor has no AVX2 (or ROPE_EXT_CPU_KERNEL=DEFAULT): the CPU "
                     "kernel is the slow baseline build")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_ext", description=__doc__)
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave torch.compile out of the benchmark (it compiles for ~1 min on CPU)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    args = parser.parse_args(argv)
    quiet_third_party()

    print(f"rope_ext {__import__('rope_ext').__version__}  torch {torch.__version__}"
          f"  (CUDA {torch.version.cuda or 'none'})")
    info = _native.build_info()
    if info:
        print(f"native CPU kernel : {info['cpu_kernel']} (torch picks {info['torch_cpu_capability']})")
        print(f"native CUDA kernel: {'yes, ' + info['cuda_archs'] if info['cuda'] == 'yes' else 'not built'}")
    else:
        print("native kernels    : not loaded")

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"GPU               : {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    for note in setup_notes(info):
        print(f"note              : {note}")
    # The notes said it: the eager path's own warning would say it again.
    warnings.filterwarnings("ignore", message="rope_ext: no native kernel", category=RuntimeWarning)
    ok = True
    for device in devices:
        path = "native" if _native.supports(torch.device(device)) else "eager fallback"
        failures = self_check(device)
        ok &= not failures
        print(f"self-check {device:4s}   : {'ok' if not failures else 'FAILED'} ({path})")
        for failure in failures:
            print(f"  {failure}")

    if not args.no_bench:
        # As benchmarks/bench_rope.py measures: outputs reuse mapped pages, so that a fresh
        # 67 MB output's page faults (20 ms on a 3 ms clone) do not decide the figures.
        heap = benchmark.steady_heap()
        print(f"benchmark         : {benchmark.cpu_description()}, "
              f"{torch.get_num_threads()} CPU threads, {heap}")
        for device in devices:
            for dtype in (torch.bfloat16, torch.float32):
                case = benchmark.Case(1, args.seq, 32, 32, 128, dtype, device, name="LLaMA-7B")
                only = ["rope_ext in-place", "rope_ext", "eager complex (LLaMA)",
                        "compiled complex (LLaMA)"]
                results = benchmark.run_case(case, include_compile=not args.no_compile,
                                             min_run_time=0.3, only=only)
                print()
                print(benchmark.markdown_table(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
