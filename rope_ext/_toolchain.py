"""The C++ compiler the build links with must use the shared libstdc++: this module tells
whether a shared library carries its own copy (read from its ELF symbol tables, no binutils
needed) and picks a compiler that does not make one. setup.py loads this file by path before
anything is built, so it imports nothing from rope_ext or torch.

Why it matters: torch loads the system's libstdc++.so.6, and an extension linked with a static
libstdc++ (some toolchains' g++ wrappers do that, e.g. the GPU image where rope_ext first ran:
CXX=/opt/gcc/bin/g++) holds a second copy whose iostreams and locale were never initialised in
that process. Every `std::ostringstream << bool` inside it then crashes: the extension's
build_info, each TORCH_CHECK message that formats a bool, the CUDA host emulation.
"""

from __future__ import annotations

import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

# Symbols only libstdc++'s own compiled objects define (std::ios_base::Init, std::locale,
# basic_ostream<char>'s number formatting): a library that defines one has linked libstdc++
# into itself. Header-only templates (std::string, std::vector) never define these.
LIBSTDCXX_PREFIXES = (b"_ZNSt8ios_base4Init", b"_ZNSt6locale", b"_ZNSo9_M_insert")

_SHT_SYMTAB, _SHT_DYNSYM = 2, 11


def defined_symbols(path: str | Path) -> set[bytes]:
    """Names of the symbols that the ELF64 file at path defines (its .symtab and .dynsym)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not an ELF64 file")
    order = "<" if data[5] == 1 else ">"
    shoff, = struct.unpack_from(order + "Q", data, 0x28)
    shentsize, shnum = struct.unpack_from(order + "HH", data, 0x3A)
    sections = [struct.unpack_from(order + "IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    names: set[bytes] = set()
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind not in (_SHT_SYMTAB, _SHT_DYNSYM) or entsize == 0:
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize):
            st_name, _st_info, _st_other, st_shndx = struct.unpack_from(order + "IBBH", data, at)
            if st_shndx != 0 and st_name != 0:  # 0: undefined (imported)
                end = data.index(b"\0", strtab + st_name)
                names.add(data[strtab + st_name:end])
    return names


def bundled_libstdcxx(path: str | Path) -> list[str]:
    """The libstdc++ symbols that the library at path defines itself (empty when it uses the
    shared libstdc++.so.6, as it must inside a torch process)."""
    return sorted(n.decode() for n in defined_symbols(path) if n.startswith(LIBSTDCXX_PREFIXES))


_PROBE = ("#include <sstream>\n#include <string>\n"
          "std::string rope_ext_probe(bool b) { std::ostringstream s; s << b; return s.str(); }\n")


def links_own_libstdcxx(cxx: list[str]) -> bool | None:
    """Whether the compiler command cxx links a copy of libstdc++ into the shared libraries it
    makes; None when it cannot make one at all."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp, "probe.cpp"), Path(tmp, "probe.so")
        src.write_text(_PROBE)
        try:
            done = subprocess.run([*cxx, "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)],
                                  capture_output=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0 or not lib.is_file():
            return None
        return bool(bundled_libstdcxx(lib))


def _c_compiler_beside(cxx: str) -> str | None:
    """The C compiler of the same toolchain as the C++ compiler at path cxx (g++ -> gcc,
    c++ -> cc, clang++ -> clang)."""
    folder, name = os.path.split(cxx)
    for cpp, c in (("g++", "gcc"), ("c++", "cc"), ("clang++", "clang")):
        if name.endswith(cpp):
            candidate = os.path.join(folder, name[: -len(cpp)] + c)
            if os.access(candidate, os.X_OK):
                return candidate
    return None


CANDIDATES = ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++")


def choose_compiler(environ: dict[str, str] | None = None, log=None,
                    candidates: tuple[str, ...] = CANDIDATES) -> None:
    """Makes the build link against the shared libstdc++ (see the module's docstring).

    Where $CXX (or the default c++) links its own libstdc++ into shared libraries, the first
    of the candidates (g++ and c++ on PATH, /usr/bin/g++, /usr/bin/c++) that does not is put
    in CXX, CUDAHOSTCXX and (for the link and nvcc's -ccbin) CC, and a line says so; where
    none qualifies the build stops with what to set. Linux only; elsewhere nothing is
    checked."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return
    configured = env.get("CXX") or "c++"
    command = shlex.split(configured)
    if links_own_libstdcxx(command) is not True:
        return
    seen = {os.path.realpath(shutil.which(command[0]) or command[0])}
    for name in candidates:
        path = shutil.which(name, path=env.get("PATH"))
        if path is None or os.path.realpath(path) in seen:
            continue
        seen.add(os.path.realpath(path))
        if links_own_libstdcxx([path]) is False:
            env["CXX"] = env["CUDAHOSTCXX"] = path
            cc = _c_compiler_beside(path)
            if cc is not None:
                env["CC"] = cc
            elif "CC" in env:
                del env["CC"]
            (log or print)(f"rope_ext: {configured} links libstdc++ statically into shared "
                           f"libraries, which crashes inside torch's process (a second, "
                           f"uninitialised libstdc++); building with {path} instead")
            return
    raise SystemExit(
        f"rope_ext: the C++ compiler {configured} links libstdc++ statically into shared "
        "libraries; the extension would crash inside torch's process (its own uninitialised "
        "copy of libstdc++'s iostreams). Set CXX (and CC) to a compiler that links "
        "libstdc++.so.6, as torch itself does.")
