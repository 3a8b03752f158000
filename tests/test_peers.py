"""benchmarks/trim_flashinfer.py on a made-up flashinfer wheel: it keeps what importing
flashinfer.rope and building its JIT module need, drops the rest, and writes a wheel whose
copy imports."""

import base64
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trim_flashinfer.py"
spec = importlib.util.spec_from_file_location("trim_flashinfer", SCRIPT)
trim_flashinfer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trim_flashinfer)

# A wheel shaped like flashinfer-python's: an __init__ that imports every op, rope.py importing
# at module level, in a try block and a class body, and in a function (run only when called).
FAKE = {
    "flashinfer/__init__.py": "from .attention import *\nfrom . import rope\n",
    "flashinfer/version.py": "from . import _build_meta\n__version__ = _build_meta.__version__\n"
                             "__git_commit__ = 'abc'\n",
    "flashinfer/_build_meta.py": "__version__ = '9.9.post1'\n",
    "flashinfer/attention.py": "raise ImportError('the trimmed copy must not import me')\n",
    "flashinfer/rope.py": (
        "import functools\n"
        "from .utils import helper\n"
        "from .jit.rope import gen_rope_module\n"
        "try:\n    from .optional import thing\nexcept ImportError:\n    thing = None\n"
        "class Holder:\n    from . import in_class\n"
        "def later():\n    from .lazy import x\n    return x\n"),
    "flashinfer/utils.py": "helper = 1\n",
    "flashinfer/optional.py": "thing = 2\n",
    "flashinfer/in_class.py": "",
    "flashinfer/lazy.py": "x = 3\n",
    "flashinfer/jit/__init__.py": "from . import env as env\n",
    "flashinfer/jit/env.py": "from ..version import __version__\n",
    "flashinfer/jit/rope.py": ("from . import env\n"
                               "def gen_rope_module():\n"
                               "    return [env, 'rope.cu', 'rope_binding.cu']\n"),
    "flashinfer/jit/gemm.py": "",
    "flashinfer/data/csrc/rope.cu": '#include <flashinfer/pos_enc.cuh>\n#include "ffi.h"\n',
    "flashinfer/data/csrc/rope_binding.cu": '#include "ffi.h"\n',
    "flashinfer/data/csrc/ffi.h": '  #  include "nested/deeper.h"\n',
    "flashinfer/data/csrc/nested/deeper.h": "",
    "flashinfer/data/csrc/gemm.cu": '#include "gemm.h"\n',
    "flashinfer/data/csrc/gemm.h": "",
    "flashinfer/data/include/flashinfer/pos_enc.cuh": "",
    "flashinfer/data/include/flashinfer/gemm.cuh": "",
    "flashinfer/data/cccl/libcudacxx/include/cuda/std/cstdint": "",
    "flashinfer/data/cccl/cub/cub/cub.cuh": "",
    "flashinfer/data/cccl/docs/index.md": "",
    "flashinfer/data/cutlass/include/cutlass/cutlass.h": "",
    "flashinfer_python-9.9.post1.dist-info/METADATA": "Name: flashinfer-python\n"
                                                       "Version: 9.9.post1\n",
}


@pytest.fixture
def trimmed(tmp_path):
    wheel = tmp_path / "flashinfer_python-9.9.post1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in FAKE.items():
            z.writestr(name, text)
    return trim_flashinfer.trim(wheel, tmp_path / "out")


def test_keeps_what_the_rope_import_and_jit_need_and_nothing_else(trimmed):
    assert trimmed.name == "flashinfer_python-9.9.post1+rope-py3-none-any.whl"
    names = set(zipfile.ZipFile(trimmed).namelist())
    info = "flashinfer_python-9.9.post1+rope.dist-info/"
    assert names == {
        "flashinfer/__init__.py", "flashinfer/version.py", "flashinfer/_build_meta.py",
        "flashinfer/rope.py", "flashinfer/utils.py", "flashinfer/optional.py",
        "flashinfer/in_class.py", "flashinfer/jit/__init__.py", "flashinfer/jit/env.py",
        "flashinfer/jit/rope.py",
        "flashinfer/data/csrc/rope.cu", "flashinfer/data/csrc/rope_binding.cu",
        "flashinfer/data/csrc/ffi.h", "flashinfer/data/csrc/nested/deeper.h",
        "flashinfer/data/include/flashinfer/pos_enc.cuh",
        "flashinfer/data/include/flashinfer/gemm.cuh",
        "flashinfer/data/cccl/libcudacxx/include/cuda/std/cstdint",
        "flashinfer/data/cccl/cub/cub/cub.cuh",
        info + "METADATA", info + "WHEEL", info + "RECORD",
    }


def test_the_wheel_records_every_file_with_its_hash(trimmed):
    with zipfile.ZipFile(trimmed) as z:
        info = "flashinfer_python-9.9.post1+rope.dist-info/"
        assert "Version: 9.9.post1+rope" in z.read(info + "METADATA").decode()
        lines = z.read(info + "RECORD").decode().splitlines()
        recorded = {line.split(",")[0]: line for line in lines}
        assert set(recorded) == set(z.namelist())
        for name in z.namelist():
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert recorded[name] == f"{name},sha256={digest.decode()},{len(data)}"


def test_the_trimmed_copy_imports(trimmed, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(trimmed).extractall(site)
    code = ("import flashinfer, flashinfer.rope as r; "
            "print(flashinfer.TRIMMED_FOR, flashinfer.__version__, r.thing, r.Holder.in_class)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(site)}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("rope 9.9.post1 2 <module 'flashinfer.in_class'")
    # The function-level import was left out, and says so when called.
    run = subprocess.run([sys.executable, "-c", "import flashinfer.rope as r; r.later()"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site)}, timeout=60)
    assert "No module named 'flashinfer.lazy'" in run.stderr


def test_relative_imports_resolve_from_the_importing_package():
    source = "from ..a import b\nfrom . import c\nimport x.y\nfrom .d.e import f as g\n"
    assert trim_flashinfer.imports_at_load(source, "p.q.mod", is_package=False) == {
        "p.a", "p.a.b", "p.q", "p.q.c", "x.y", "p.q.d.e", "p.q.d.e.f"}
    assert trim_flashinfer.imports_at_load(source, "p.q", is_package=True) == {
        "p.a", "p.a.b", "p.q", "p.q.c", "x.y", "p.q.d.e", "p.q.d.e.f"}
