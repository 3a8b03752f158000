import pytest
import torch

import rope_ext

# Every device-parametrised test also runs on CUDA when a GPU is present (skipped otherwise).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# Output (in its dtype) against the float64 reference: the op computes in float32 (float64
# for float64) and rounds once, so the error is about one unit in the last place.
TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3),
}


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), expected.double(), **TOLERANCES[out.dtype])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _require_native():
    # The suite tests the kernels: a silently missing extension must fail, not fall back.
    assert rope_ext.native_available(), rope_ext._native.LOAD_ERROR


@pytest.fixture(autouse=True)
def _fallback_warning_unspent():
    """The eager fallback warns once per device and process: each test leaves that state as
    it found it, so no test spends a warning that a later one checks for."""
    saved = set(rope_ext._native._warned)
    yield
    rope_ext._native._warned.clear()
    rope_ext._native._warned.update(saved)


# Property-based tests: a fixed-seed profile for CI, a larger one on request
# (ROPE_EXT_HYPOTHESIS_PROFILE=thorough).
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=2000, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=50000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(__import__("os").environ.get("ROPE_EXT_HYPOTHESIS_PROFILE", "ci"))
