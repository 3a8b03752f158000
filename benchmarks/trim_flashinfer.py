#!/usr/bin/env python
"""flashinfer-python's wheel cut down to what its rope ops need, for a GPU machine that
receives 64 MiB in all (benchmarks/peers.sh calls it).

The whole wheel is 62 MB, nearly all of it CUDA sources and headers of other ops. The rope
ops are flashinfer/rope.py, which JIT-compiles data/csrc/rope.cu and its binding with nvcc on
first use (flashinfer/jit/rope.py). The trimmed wheel holds:

- the Python modules that `import flashinfer.rope` executes, found by reading their import
  statements (module level, and in class bodies and if/try/with blocks there; not those in
  function bodies, which run only when called), with flashinfer/__init__.py replaced by a
  stub that imports only flashinfer.version: the package's own imports every op;
- the CUDA sources flashinfer/jit/rope.py names and the data/csrc headers they include;
- data/include (FlashInfer's headers) and the CCCL that flashinfer/jit/env.py puts ahead of
  the toolkit's on nvcc's include path (CCCL_INCLUDE_DIRS), whole.

It leaves out CUTLASS and spdlog, which rope.cu does not include (nvcc finds none of their
headers missing: `check`).

  python benchmarks/trim_flashinfer.py trim flashinfer_python-0.7.2.post1-py3-none-any.whl OUT/
  PYTHONPATH=SITE python benchmarks/trim_flashinfer.py check   # SITE: the trimmed wheel installed

`check` imports flashinfer.rope from the trimmed copy, calls the two ops the benchmark times
with the JIT switched off (each gets as far as the build), and has nvcc (where there is one)
preprocess the JIT's two compile commands for sm_90a, listing every header they include: the
JIT would find them all. It compiles nothing.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable

PACKAGE = "flashinfer"
START = "flashinfer.rope"
JIT_SPEC = "flashinfer/jit/rope.py"  # gen_rope_module: the sources the rope JIT compiles
CSRC = "flashinfer/data/csrc/"
INCLUDE = "flashinfer/data/include/"
WHOLE_TREES = (INCLUDE, "flashinfer/data/cccl/cub/", "flashinfer/data/cccl/libcudacxx/include/",
               "flashinfer/data/cccl/thrust/")
LOCAL_VERSION = "rope"  # the trimmed wheel's version: <the wheel's>+rope
STUB_INIT = '''"""flashinfer-python {version} trimmed to flashinfer.rope and what it imports,
by rope_ext's benchmarks/trim_flashinfer.py. The package's own __init__ imports every op."""

from .version import __version__ as __version__
from .version import __git_commit__ as __git_commit__

TRIMMED_FOR = "rope"
'''
# Third-party imports of the modules kept (pip installs none of them with --no-deps).
REQUIRES = ("apache-tvm-ffi<0.2,>=0.1.11", "filelock", "jinja2", "nvidia-ml-py", "packaging",
            "requests", "torch")
_INCLUDE_LINE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def module_member(members: set[str], module: str) -> str | None:
    """The wheel member that defines `module`: its package's __init__.py or its .py file."""
    path = module.replace(".", "/")
    for member in (f"{path}/__init__.py", f"{path}.py"):
        if member in members:
            return member
    return None


def imports_at_load(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an import of `module` imports in turn: its import statements at module
    level, in class bodies and in if/try/with blocks there, not those in function bodies.
    `from x import y` counts x and x.y (y may be a submodule); relative imports are resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def absolute(name: str | None, level: int) -> str:
        if not level:
            return name or ""
        parts = package.split(".")
        base = parts[: len(parts) - level + 1]
        return ".".join(base + ([name] if name else []))

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = absolute(node.module, node.level)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            blocks = [getattr(node, field, []) for field in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            blocks += [case.body for case in getattr(node, "cases", [])]
            for block in blocks:
                visit([child for child in block if isinstance(child, ast.stmt)])

    visit(ast.parse(source).body)
    return found


def import_closure(members: set[str], read: Callable[[str], str], start: list[str]) -> set[str]:
    """The package's modules that importing each of `start` executes, parent packages
    included, except the top-level package itself (the trimmed wheel replaces its __init__)."""
    closure: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        member = module_member(members, module)
        if module in closure or module == PACKAGE or member is None:
            continue
        closure.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += [name for name in imports_at_load(read(member), module,
                                                  member.endswith("__init__.py"))
                 if name.split(".")[0] == PACKAGE]
    return closure


def jit_sources(spec_source: str) -> list[str]:
    """The .cu file names the JIT spec module names (string constants)."""
    return [node.value for node in ast.walk(ast.parse(spec_source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.endswith(".cu")]


def csrc_closure(members: set[str], read: Callable[[str], str], sources: list[str]) -> set[str]:
    """The sources and every data/csrc file they include, directly or through other files,
    resolving an include against data/csrc, then data/include (nvcc's -isystem order)."""
    todo = [CSRC + s for s in sources]
    seen: set[str] = set()
    while todo:
        member = todo.pop()
        if member in seen:
            continue
        seen.add(member)
        for name in _INCLUDE_LINE.findall(read(member)):
            for root in (CSRC, INCLUDE, str(PurePosixPath(member).parent) + "/"):
                candidate = str(PurePosixPath(root) / name)
                if candidate in members:
                    todo.append(candidate)
                    break
    return {m for m in seen if m.startswith(CSRC)}


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(wheel: Path, out_dir: Path) -> Path:
    """Writes the trimmed wheel into out_dir and returns its path."""
    with zipfile.ZipFile(wheel) as z:
        members = set(z.namelist())

        def read(member: str) -> str:
            return z.read(member).decode("utf-8", errors="replace")

        metadata = next(m for m in members if m.endswith(".dist-info/METADATA"))
        version = re.search(r"^Version: (\S+)$", read(metadata), re.M).group(1)
        stub = STUB_INIT.format(version=version)
        modules = import_closure(members, read, [START, *imports_at_load(stub, PACKAGE, True)])
        keep = {module_member(members, m) for m in modules}
        keep |= csrc_closure(members, read, jit_sources(read(JIT_SPEC)))
        keep |= {m for m in members if m.startswith(WHOLE_TREES) and not m.endswith("/")}
        files = {m: z.read(m) for m in sorted(keep)}

    new_version = f"{version}+{LOCAL_VERSION}"
    files[f"{PACKAGE}/__init__.py"] = stub.encode()
    info = f"flashinfer_python-{new_version}.dist-info"
    files[f"{info}/METADATA"] = "\n".join([
        "Metadata-Version: 2.1", "Name: flashinfer-python", f"Version: {new_version}",
        f"Summary: flashinfer-python {version} trimmed to its rope ops (rope_ext "
        "benchmarks/trim_flashinfer.py)", "License: Apache-2.0",
        *(f"Requires-Dist: {r}" for r in REQUIRES), ""]).encode()
    files[f"{info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: rope_ext trim_flashinfer.py\n"
                              "Root-Is-Purelib: true\nTag: py3-none-any\n").encode()
    record = [record_line(name, data) for name, data in files.items()]
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,", ""]).encode()

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"flashinfer_python-{new_version}-py3-none-any.whl"
    partial = out.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, data in files.items():
            z.writestr(name, data)
    partial.replace(out)
    return out


def check(arch: str = "9.0a") -> int:
    """Imports flashinfer.rope from the trimmed copy on sys.path, calls the two ops the
    benchmark times on CPU tensors with the JIT switched off (each must get as far as the
    build) and, where nvcc is found, preprocesses the rope JIT's compile commands for `arch`
    (nvcc -M): a header the trimmed copy lacks fails it. Prints what it found; returns a
    process exit status."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch)  # no GPU needed to plan the build
    import flashinfer
    import flashinfer.rope  # noqa: F401 (the import under test)
    from flashinfer.jit.rope import gen_rope_module

    if getattr(flashinfer, "TRIMMED_FOR", None) != "rope":
        print(f"flashinfer at {flashinfer.__file__} is not the trimmed copy")
        return 1
    print(f"flashinfer {flashinfer.__version__}: flashinfer.rope imports from "
          f"{Path(flashinfer.__file__).parent}")
    root = Path(flashinfer.__file__).parent
    status = 0
    # The benchmark's two calls, on CPU tensors with the JIT switched off: each must get as far
    # as building the module (the modules they import when called are there too).
    import torch

    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    q, k = torch.zeros(2, 2, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    positions = torch.arange(2)
    calls = {"apply_rope_with_cos_sin_cache_inplace": lambda: flashinfer.rope.
             apply_rope_with_cos_sin_cache_inplace(positions, q.view(2, -1), k.view(2, -1), 64,
                                                   torch.zeros(4, 64)),
             "apply_rope_pos_ids_inplace": lambda: flashinfer.rope.apply_rope_pos_ids_inplace(
                 q, k, positions)}
    for name, call in calls.items():
        try:
            call()
        except Exception as error:  # noqa: BLE001 (the build's refusal is the expected end)
            reached = "JIT compilation is disabled" in str(error)
            print(f"{name}: {'reaches the JIT build' if reached else f'FAILED: {error!r}'}")
            if not reached:
                status = 1
        else:
            print(f"{name}: FAILED: ran without its kernels")
            status = 1
    for command in gen_rope_module().get_compile_commands():
        args = shlex.split(command["command"])  # nvcc -c SOURCE FLAGS... -o OBJECT
        nvcc, source, flags = args[0], args[2], args[3:args.index("-o")]
        if not Path(nvcc).exists():
            print(f"no nvcc at {nvcc}: the JIT's headers are not checked")
            return status
        run = subprocess.run([nvcc, "-M", source, *flags], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"nvcc -M {Path(source).name}: FAILED\n{run.stderr[-3000:]}")
            status = 1
            continue
        # "rope.o : SOURCE HEADER HEADER ...", lines continued with backslashes
        files = run.stdout.replace("\\\n", " ").split()[2:]
        mine = [f for f in files if Path(f).resolve().is_relative_to(root)]
        print(f"nvcc -M {Path(source).name}: includes {len(files) - 1} files, "
              f"{len(mine) - 1} of them from the trimmed copy; none missing")
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    trim_cmd = sub.add_parser("trim", help="write the trimmed wheel")
    trim_cmd.add_argument("wheel", type=Path)
    trim_cmd.add_argument("out_dir", type=Path)
    sub.add_parser("check", help="import the trimmed copy on sys.path and scan its JIT's headers")
    args = parser.parse_args()
    if args.command == "trim":
        print(trim(args.wheel, args.out_dir))
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
