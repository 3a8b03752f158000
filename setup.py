"""Builds rope_ext._C: the CPU kernels always, the CUDA kernels when the torch build has CUDA
and a CUDA toolkit is found (not because a GPU is present).

Environment:
  ROPE_EXT_CUDA=1|0        force / disable the CUDA kernels (default: auto)
  TORCH_CUDA_ARCH_LIST     CUDA archs, e.g. "9.0" (default: 8.0;8.6;8.9;9.0+PTX)
  ROPE_EXT_SANITIZE=1      build with AddressSanitizer and UndefinedBehaviorSanitizer
  ROPE_EXT_AVX512=0        leave the AVX-512 CPU kernels out (x86; for a build that only ever
                           runs on processors without AVX-512, e.g. a sanitized test build)
  MAX_JOBS                 parallel compile jobs (ninja)
"""

import contextlib
import importlib.util
import os
import platform
import sys
import tempfile
from pathlib import Path

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).parent
CSRC = Path("csrc")

# One kernel source per instruction set, each with its own flags; the library picks one at
# run time (csrc/cpu/rope_cpu.cpp). Mirrored in CMakeLists.txt.
X86 = platform.machine().lower() in ("x86_64", "amd64")
ISA_FLAGS = {
    str(CSRC / "cpu" / "rope_cpu_kernel_avx2.cpp"): ["-mavx2", "-mfma", "-mf16c"],
    str(CSRC / "cpu" / "rope_cpu_kernel_avx512.cpp"): [
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
    ],
    str(CSRC / "cpu" / "rope_cpu_kernel_avx512_bf16.cpp"): [
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mavx512bf16",
    ],
}
# The CUDA kernels compiled for the host, for the tests (tests/test_cuda_emulation.py): -O1,
# as their speed does not matter. At -O3 this one file took 97 of a CPU build's 333 CPU
# seconds (2 cores, Zen 3); at -O1 it takes 43, and its tests run as fast.
EMULATION = str(CSRC / "cuda" / "rope_cuda_emulate.cpp")
# The flags each of these files adds to the build's own (they come last, so they win).
FILE_FLAGS = {**ISA_FLAGS, EMULATION: ["-O1"]}
SANITIZE = os.environ.get("ROPE_EXT_SANITIZE") == "1"  # read once: the build and its folder agree
if SANITIZE:
    # A sanitized build leaves the emulation uninstrumented: it checks every access of the
    # kernels it runs itself (in bounds, 16-byte aligned, no races, each output written
    # once), and instrumented it took 136 of the build's 476 CPU seconds (37 without).
    FILE_FLAGS[EMULATION] = ["-O1", "-fno-sanitize=all"]
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"
WITH_CUDA = False  # set by extension()
BUILT_AGAINST = "_C.torch_version"  # beside the library: the torch it was compiled against


def find_cuda_home() -> str | None:
    """The first CUDA toolkit that really has nvcc and the runtime headers.

    torch derives CUDA_HOME from `which nvcc`, which is wrong where nvcc is a wrapper script
    (e.g. /usr/local/bin/nvcc gives /usr/local); /usr/local/cuda is tried after it.
    """
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                 cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
                os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def want_cuda() -> bool:
    forced = os.environ.get("ROPE_EXT_CUDA")
    if forced is not None and forced not in ("0", "1"):
        raise SystemExit(f"ROPE_EXT_CUDA must be 0 or 1, got {forced!r}")
    home = find_cuda_home() if torch.version.cuda is not None else None
    if forced == "1" and home is None:
        raise SystemExit(
            "ROPE_EXT_CUDA=1 but CUDA cannot be built: "
            f"torch.version.cuda={torch.version.cuda}, no toolkit with bin/nvcc and "
            "include/cuda_runtime.h found (set CUDA_HOME)"
        )
    if forced == "0" or home is None:
        return False
    os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = home
    return True


def want_avx512() -> bool:
    value = os.environ.get("ROPE_EXT_AVX512", "1")
    if value not in ("0", "1"):
        raise SystemExit(f"ROPE_EXT_AVX512 must be 0 or 1, got {value!r}")
    return X86 and value == "1"


def isa_kernel_sources() -> list[str]:
    """The per-instruction-set kernel sources this build compiles."""
    if not X86:
        return []
    return [src for src in ISA_FLAGS if want_avx512() or "avx512" not in src]


def sources(with_cuda: bool) -> list[str]:
    files = [str(p) for p in sorted(CSRC.glob("*.cpp"))]
    files += [str(CSRC / "cpu" / "rope_cpu.cpp"), str(CSRC / "cpu" / "rope_cpu_kernel_default.cpp")]
    files += isa_kernel_sources()
    files.append(EMULATION)  # the CUDA kernels on the host
    files.append(str(CSRC / "cuda" / ("rope_cuda.cu" if with_cuda else "no_cuda.cpp")))
    return files


def persistent_build_temp(build_temp: str) -> str:
    """Where the object files go: build/temp-<configuration>/ in the source tree instead of
    the throwaway folder of an editable install; a folder the caller named is kept.

    pip builds in a fresh temporary folder each time, so the README's second command would
    recompile everything the first had just built; with the objects kept here, ninja
    recompiles only what changed. The folder name carries everything that changes the
    objects, so two configurations never share one.
    """
    folder = Path(build_temp).resolve()
    if not (folder.name.endswith(".build-temp")  # setuptools' editable builds: tmpXXXX.build-temp
            and folder.parent == Path(tempfile.gettempdir()).resolve()):
        return build_temp
    config = "-".join([
        f"py{sys.version_info[0]}{sys.version_info[1]}",
        f"torch{torch.__version__.replace('+', '_')}",
        "cuda" if WITH_CUDA else "cpu",
        "san" if SANITIZE else "release",
    ] + ([] if want_avx512() or not X86 else ["noavx512"]))
    return str(ROOT.resolve() / "build" / f"temp-{config}")


@contextlib.contextmanager
def file_flags_in_ninja_file(flagged: list[str]):
    """Yields whether the per-file flags (FILE_FLAGS) can go into torch's one ninja file.

    torch compiles every source of a call with the same flags, so each instruction-set file
    used to take a ninja run of its own, one file at a time: a third of a build's time on
    two cores. Inside this context, torch's (private) ninja writer is wrapped so that the
    build statement of each such file gets its flags as a ninja build-scoped variable
    (`post_cflags = $post_cflags -mavx2 ...`), and the caller compiles everything in one call.
    Yields False when torch has no such writer: the caller then gives each file a run of its
    own. A build statement missing from what the writer wrote stops the build, naming it.
    """
    writer = getattr(cpp_extension, "_write_ninja_file", None)
    if not flagged or writer is None:
        yield not flagged
        return

    def write_with_file_flags(path, *args, **kwargs):
        writer(path, *args, **kwargs)
        text = Path(path).read_text()
        for src in flagged:
            escaped = os.path.abspath(src).replace(" ", "$ ")  # as torch escapes paths
            line = next((ln for ln in text.splitlines()
                         if ln.startswith("build ") and ln.endswith(f": compile {escaped}")), None)
            if line is None:
                raise RuntimeError(f"setup.py: no build statement for {src} in {path}; "
                                   "torch's ninja file has changed, see file_flags_in_ninja_file")
            flags = " ".join(FILE_FLAGS[src])
            text = text.replace(line + "\n", f"{line}\n  post_cflags = $post_cflags {flags}\n", 1)
        Path(path).write_text(text)

    cpp_extension._write_ninja_file = write_with_file_flags
    try:
        yield True
    finally:
        cpp_extension._write_ninja_file = writer


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, compiling the files of FILE_FLAGS with their own flags,
    with its objects kept between builds (persistent_build_temp)."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = persistent_build_temp(self.build_temp)

    def build_extension(self, ext):
        compile_all = self.compiler.compile

        def compile_grouped(srcs, *args, extra_postargs=None, **kwargs):
            flagged = [s for s in srcs if s in FILE_FLAGS]
            if self.use_ninja:  # torch writes the call's ninja file: the flags can go into it
                with file_flags_in_ninja_file(flagged) as patched:
                    if patched:  # one ninja run: every file shares the MAX_JOBS workers
                        return compile_all(srcs, *args, extra_postargs=extra_postargs, **kwargs)
            # No ninja, or no ninja writer that file_flags_in_ninja_file knows: one compile
            # call per file of FILE_FLAGS, with its flags.
            objects = []
            plain = [s for s in srcs if s not in FILE_FLAGS]
            if plain:
                objects += compile_all(plain, *args, extra_postargs=extra_postargs, **kwargs)
            for src in flagged:
                post = dict(extra_postargs)
                post["cxx"] = post["cxx"] + FILE_FLAGS[src]
                objects += compile_all([src], *args, extra_postargs=post, **kwargs)
            return objects

        self.compiler.compile = compile_grouped
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_all
        # The library only loads into the torch it was compiled against; rope_ext/_native.py
        # compares this record with the running torch and says how to rebuild on a mismatch
        # (an isolated `pip install .` may compile against a newer torch than the user has).
        folders = [Path(self.get_ext_fullpath(ext.name)).parent]
        if self.inplace or getattr(self, "editable_mode", False):  # the library is copied here
            package = ".".join(ext.name.split(".")[:-1])
            folders.append(Path(self.get_finalized_command("build_py").get_package_dir(package)))
        for folder in folders:
            (folder / BUILT_AGAINST).write_text(torch.__version__ + "\n")


def load_toolchain():
    """rope_ext/_toolchain.py, loaded by path: the package itself needs the built library."""
    spec = importlib.util.spec_from_file_location("rope_ext_toolchain",
                                                  ROOT / "rope_ext" / "_toolchain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extension():
    global WITH_CUDA
    # Before anything reads CC / CXX: a compiler that links libstdc++ statically makes a
    # library that crashes in torch's process; _toolchain.choose_compiler picks another.
    load_toolchain().choose_compiler(log=lambda line: print(line, file=sys.stderr))
    WITH_CUDA = with_cuda = want_cuda()
    # -g0: Python's own CFLAGS carry -g, and debug info for the kernels' template instances
    # made the objects 26x larger and the CPU kernels' compile 1.6x slower (AVX2 kernel:
    # 2m45 against 1m43, 48 MB against 1.9 MB).
    cxx = ["-O3", "-g0", "-fopenmp", "-fvisibility=hidden"]
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    link = ["-fopenmp"]
    macros = []
    if X86:
        macros.append(("ROPE_EXT_HAVE_AVX2", None))
    if want_avx512():
        macros.append(("ROPE_EXT_HAVE_AVX512", None))
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        macros.append(("ROPE_EXT_WITH_CUDA", None))
    if SANITIZE:
        san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
               "-fno-sanitize-recover=all"]
        # -g1: line tables, all the reports' stack traces need; full -g made the build a
        # quarter slower (ASan and UBSan instrument every template instance the kernels make).
        # -fno-wrapv: Python's own flags (sysconfig CFLAGS) carry -fwrapv, which makes signed
        # overflow defined, and GCC's UBSan then never checks it; index arithmetic that
        # overflows is what a sanitized run is for.
        cxx = [f for f in cxx if f not in ("-O3", "-g0")] + ["-O1", "-g1", "-fno-wrapv"] + san
        link += san
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    return kind(
        "rope_ext._C",
        sources(with_cuda),
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
