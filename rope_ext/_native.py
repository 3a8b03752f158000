"""Loads the compiled library and says which devices have native kernels."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_HERE = Path(__file__).parent
# Rebuilds against the installed torch, from the source tree.
REBUILD = ('pip install "setuptools>=77" ninja && '
           "pip install --no-build-isolation --force-reinstall --no-deps .")


def built_against() -> str | None:
    """The torch version the library was compiled against (setup.py records it), if known."""
    try:
        return (_HERE / "_C.torch_version").read_text().strip()
    except OSError:
        return None


def _load_error(error: ImportError) -> str:
    """Why the library did not load, in words that say what to do."""
    built = built_against()
    if built is not None and built != torch.__version__:
        return (f"rope_ext was compiled against torch {built} but torch {torch.__version__} "
                f"is installed; rebuild it against this torch from the source tree with "
                f"`{REBUILD}` (`pip install .` alone builds in an isolated environment that "
                f"may get another torch)")
    if not any(_HERE.glob("_C*.so")) and (_HERE.parent / "setup.py").is_file():
        return (f"rope_ext is imported from its source tree ({_HERE.parent}), which holds no "
                "compiled extension: run Python from another directory to use the installed "
                "rope_ext, or build here with `pip install --no-build-isolation -e .`")
    return f"{type(error).__name__}: {error}"


try:
    from . import _C  # registers torch.ops.rope_ext; EAGER_ENTRIES holds its functions

    LOADED = True
    LOAD_ERROR: str | None = None
except ImportError as error:  # not built, built for another torch, or the source tree
    LOADED = False
    LOAD_ERROR = _load_error(error)

if LOADED and (_built := built_against()) not in (None, torch.__version__):
    warnings.warn(
        f"rope_ext: compiled against torch {_built} but running on torch "
        f"{torch.__version__}; if anything misbehaves, rebuild with `{REBUILD}`",
        RuntimeWarning, stacklevel=2)


def _native_devices() -> frozenset[str]:
    if not LOADED or os.environ.get("ROPE_EXT_DISABLE_NATIVE") == "1":
        return frozenset()
    keys = {"cpu": "CPU", "cuda": "CUDA"}
    found = {
        device
        for device, key in keys.items()
        if torch._C._dispatch_has_kernel_for_dispatch_key("rope_ext::apply_rotary", key)
    }
    # Fake and meta tensors (torch.compile tracing) run the fake kernels.
    return frozenset(found | {"meta"}) if found else frozenset()


# Device types the native ops serve; fixed at import so torch.compile sees a constant.
NATIVE_DEVICES = _native_devices()
_warned: set[str] = set()


_EAGER_ENTRIES: dict[str, Callable[..., object]] = {}


def op(name: str) -> Callable[..., object]:
    """torch.ops.rope_ext.<name>.default to call. In eager mode its C++ entry point, the
    overload's bound `_op`: the same dispatcher call, torch function handling included,
    without OpOverload.__call__'s Python frame (~0.4 us of a decode step's ~20). Under
    torch.compile the overload itself, which Dynamo traces."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.rope_ext, name).default
    entry = _EAGER_ENTRIES.get(name)
    if entry is None:
        overload = getattr(torch.ops.rope_ext, name).default
        entry = _EAGER_ENTRIES[name] = getattr(overload, "_op", overload)
    return entry


# rope_ext._C's entry for each op that has one (csrc/rope_python.cpp), for the wrappers in
# eager mode (under torch.compile they call the op itself, which Dynamo traces). An entry
# takes all of the op's arguments in schema order and runs the same dispatcher call as
# torch.ops without torch's generic argument matching and boxing (~1.6 us of a one-row
# call's ~2.5). It returns NotImplemented, running nothing, where that path is needed (a
# tensor subclass or TorchFunctionMode, a SymInt offset): call op(name) then. A library
# built before the entries existed gets stand-ins that always decline.
def _declines(*args: object) -> object:
    return NotImplemented


EAGER_ENTRIES: dict[str, Callable[..., object]] = {
    name: getattr(_C, name, _declines)
    for name in ("apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_",
                 "rms_norm_rotary_qk", "rms_norm_rotary_qk_", "rotary_kv_cache_update",
                 "rotary_kv_cache_update_")
} if LOADED else {}


def supports(device: torch.device) -> bool:
    return device.type in NATIVE_DEVICES


def serves(t: torch.Tensor) -> bool:
    """supports(t.device), without building the device object for CPU tensors (a decode
    step's budget is a few microseconds)."""
    return "cpu" in NATIVE_DEVICES if t.is_cpu else t.device.type in NATIVE_DEVICES


def warn_fallback(device: torch.device) -> None:
    if device.type in _warned:
        return
    _warned.add(device.type)
    reason = LOAD_ERROR or f"this build has no {device.type} kernel"
    warnings.warn(
        f"rope_ext: no native kernel for {device.type} tensors ({reason}); "
        "using the eager complex-multiply path",
        RuntimeWarning,
        stacklevel=3,
    )


def build_info() -> dict[str, str]:
    """What this build holds: CPU kernel variant, CUDA archs; empty when not loaded."""
    if not LOADED:
        return {}
    lines = torch.ops.rope_ext.build_info.default().strip().splitlines()
    return dict(line.split("=", 1) for line in lines)
