#!/usr/bin/env python
"""What the compiled CUDA kernels are made of, read from their SASS without a GPU.

For every kernel in the built extension (nvcc's cubin inside rope_ext/_C*.so): registers per
thread, local memory and spills (STL/LDL), loads and stores of global memory by width (128-bit
`LDG.E.128` / `STG.E.128` against narrower ones; generic-address `LD` / `ST`, which ptxas
emits where it cannot prove a pointer global, count with them) and the instruction count.
The tools are
cuobjdump and c++filt; torch's triton wheel ships cuobjdump, so a CUDA build of torch is
enough.

Examples:
  python benchmarks/sass_report.py                  # every kernel, Markdown on stdout
  python benchmarks/sass_report.py --filter rotary  # kernels whose name contains "rotary"
  python benchmarks/sass_report.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


@dataclasses.dataclass
class Kernel:
    name: str  # demangled, without the namespace
    registers: int = 0
    stack: int = 0  # bytes of stack frame (local memory)
    local_accesses: int = 0  # STL / LDL instructions: spills and local arrays
    generic_accesses: int = 0  # LD / ST instructions (also counted in loads and stores)
    instructions: int = 0
    loads: dict = dataclasses.field(default_factory=dict)  # width in bits -> count: LDG, LD
    stores: dict = dataclasses.field(default_factory=dict)  # STG, ST

    @property
    def wide_store_share(self) -> float | None:
        total = sum(self.stores.values())
        return self.stores.get(128, 0) / total if total else None


def cuobjdump() -> str:
    """cuobjdump from the CUDA toolkit, else the one triton ships beside torch."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", "/usr/local/cuda"),):
        candidate = Path(root) / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    import triton  # torch's CUDA wheels depend on it

    candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if candidate.exists():
        return str(candidate)
    raise SystemExit("cuobjdump not found: install a CUDA toolkit or torch's triton")


def library() -> str:
    import rope_ext

    found = glob.glob(str(Path(rope_ext.__file__).parent / "_C*.so"))
    if not found:
        raise SystemExit("rope_ext has no compiled library here: build it first")
    return found[0]


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [re.sub(r"rope_ext::cuda::\(anonymous namespace\)::", "", n) for n in out]


# An instruction line, `/*0010*/  @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;`: its opcode with
# its modifiers, after the predicate if any.
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:\{\s*)?(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]*)")
# Memory accesses by opcode: global (LDGSTS: an asynchronous copy from global to shared
# memory), generic-address, local. LDS / STS (shared) and LDC (constant) are not counted.
_LOADS, _STORES = {"LDG", "LDGSTS", "LD"}, {"STG", "ST"}
_LOCAL, _GENERIC = {"LDL", "STL"}, {"LD", "ST"}


def _width(suffix: str) -> int:
    for part in suffix.split("."):
        if part in ("128", "64"):
            return int(part)
        if part in ("U16", "S16"):
            return 16
        if part in ("U8", "S8"):
            return 8
    return 32


def parse(sass: str, usage: str) -> list[Kernel]:
    kernels: dict[str, Kernel] = {}
    current = None
    for line in sass.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            current = kernels.setdefault(header.group(1), Kernel(header.group(1)))
            continue
        instruction = _INSTRUCTION.match(line) if current is not None else None
        if instruction is None:
            continue
        current.instructions += 1
        op, _, suffix = instruction.group(1).partition(".")
        if op in _LOCAL:
            current.local_accesses += 1
        elif op in _LOADS or op in _STORES:
            table = current.loads if op in _LOADS else current.stores
            width = _width(suffix)
            table[width] = table.get(width, 0) + 1
            current.generic_accesses += op in _GENERIC
    for name, regs, stack in re.findall(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+)", usage):
        if name in kernels:
            kernels[name].registers, kernels[name].stack = int(regs), int(stack)
    found = list(kernels.values())
    for k, pretty in zip(found, demangle([k.name for k in found])):
        k.name = pretty
    return found


def report(kernels: list[Kernel]) -> str:
    def widths(counts: dict) -> str:
        return " ".join(f"{w}b:{n}" for w, n in sorted(counts.items(), reverse=True)) or "-"

    rows = ["| kernel | registers | stack / local accesses | instructions | global loads | "
            "global stores | of which generic | 128-bit share of stores |",
            "|---|---:|---:|---:|---|---|---:|---:|"]
    for k in kernels:
        share = k.wide_store_share
        rows.append(f"| `{k.name}` | {k.registers} | {k.stack} / {k.local_accesses} | "
                    f"{k.instructions} | {widths(k.loads)} | {widths(k.stores)} | "
                    f"{k.generic_accesses} | {'-' if share is None else f'{share:.2f}'} |")
    stores = {}
    for k in kernels:
        for w, n in k.stores.items():
            stores[w] = stores.get(w, 0) + n
    total = sum(stores.values())
    if total:
        rows.append(f"\nAll kernels: {stores.get(128, 0)} of {total} global stores are 128-bit "
                    f"({stores.get(128, 0) / total:.2f}); {sum(k.local_accesses for k in kernels)}"
                    f" local-memory accesses; registers {min(k.registers for k in kernels)}-"
                    f"{max(k.registers for k in kernels)}.")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="the extension (default: rope_ext's _C*.so)")
    parser.add_argument("--filter", default="", help="only kernels whose name contains this")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    lib = args.library or library()
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", lib], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", lib], capture_output=True, text=True,
                           check=True).stdout
    kernels = [k for k in parse(sass, usage) if args.filter in k.name]
    if not kernels:
        print(f"no CUDA kernels in {lib} (a CPU-only build?)", file=sys.stderr)
        return 1
    arch = sorted(set(re.findall(r"(sm_\d+)", subprocess.run(
        [tool, "-lelf", lib], capture_output=True, text=True).stdout))) or ["?"]
    print(f"SASS of {Path(lib).name} ({', '.join(arch)}), {len(kernels)} kernels\n")
    print(report(kernels))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(k) for k in kernels], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
