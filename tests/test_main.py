"""The main job, python -m rope_ext, as a user runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_main_job_reports_build_self_check_and_benchmark():
    run = subprocess.run([sys.executable, "-m", "rope_ext", "--seq", "64", "--no-compile"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "native CPU kernel : " in out
    assert "self-check cpu    : ok (native)" in out
    for provider in ("copy_ (bound, in-place)", "rope_ext in-place", "rope_ext",
                     "eager complex (LLaMA)"):
        assert f"| {provider} |" in out
    assert "GB/s" in out
    # Measured as benchmarks/bench_rope.py measures, and said so.
    assert "benchmark         : " in out and "heap: " in out


def test_kv_cache_example_runs():
    example = Path(__file__).parents[1] / "examples" / "attention_kv_cache.py"
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "max difference from one full pass" in run.stdout


def test_fused_kv_cache_decode_example_runs():
    """The gpt-fast-style loop: fused and unfused agree, eager and compiled (CPU here)."""
    example = Path(__file__).parents[1] / "examples" / "kv_cache_decode.py"
    run = subprocess.run([sys.executable, str(example), "--steps", "6", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the same as the unfused loop (eager: bit for bit; compiled" in run.stdout


def test_main_job_is_quiet_and_says_what_matters_once():
    import os

    # Inductor's "No CUDA runtime is found" log (on every machine without a GPU) and its
    # complex-operator warning stay out of the report.
    code = ("from rope_ext.__main__ import quiet_third_party; quiet_third_party();"
            "import warnings, torch.utils.cpp_extension;"
            "warnings.warn('Torchinductor does not support code generation for complex "
            "operators. Performance may be worse than eager.')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    # The eager fallback is said once, as a note, not again as a warning.
    run = subprocess.run([sys.executable, "-m", "rope_ext", "--no-bench"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "ROPE_EXT_DISABLE_NATIVE": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("eager path") == 1 and "RuntimeWarning" not in run.stderr
    assert "note              : ROPE_EXT_DISABLE_NATIVE=1: every call takes the eager path" in run.stdout
