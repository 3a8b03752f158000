"""The main job, python -m rope_ext, as a user runs it."""

import subprocess
import sys
from pathlib import Path


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


def test_kv_cache_example_runs():
    example = Path(__file__).parents[1] / "examples" / "attention_kv_cache.py"
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "max difference from one full pass" in run.stdout
