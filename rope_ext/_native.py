"""Loads the compiled library and says which devices have native kernels."""

from __future__ import annotations

import os
import warnings

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.rope_ext)

    LOADED = True
    LOAD_ERROR: str | None = None
except ImportError as error:  # the extension was not built, or was built for another torch
    LOADED = False
    LOAD_ERROR = f"{type(error).__name__}: {error}"


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
