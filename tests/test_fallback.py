"""The eager fallback: same API and results where no native kernel serves the device."""

import subprocess
import sys
import warnings

import pytest
import torch

import rope_ext
from rope_ext import _native, reference

from conftest import assert_matches_reference


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(_native, "NATIVE_DEVICES", frozenset())
    monkeypatch.setattr(_native, "_warned", set())


def test_fallback_matches_native_and_warns_once(no_native):
    x = torch.randn(2, 10, 4, 32)
    positions = torch.randint(0, 16, (2, 10, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = rope_ext.precompute_freqs_cis(32, 16)  # the fallback's table
        got = rope_ext.apply_rotary(x, table, positions=positions, interleaved=False)
        got_q, got_k = rope_ext.apply_rotary_qk(x, x[:, :, :2], table, offset=3)
        packed = rope_ext.apply_rotary_qk(x[0], x[1, :, :2], table, positions=positions[0])
        written = x.clone()
        returned = rope_ext.apply_rotary(written, table, inplace=True, inverse=True)
    messages = [str(w.message) for w in caught if "rope_ext" in str(w.message)]
    assert len(messages) == 1 and "eager complex-multiply path" in messages[0]
    torch.testing.assert_close(table, _call_native(rope_ext.precompute_freqs_cis, 32, 16))
    want = _call_native(rope_ext.apply_rotary, x, table, positions=positions, interleaved=False)
    assert_matches_reference(got, want.double())
    want_q, want_k = _call_native(rope_ext.apply_rotary_qk, x, x[:, :, :2], table, offset=3)
    assert_matches_reference(got_q, want_q.double())
    assert_matches_reference(got_k, want_k.double())
    want_packed = _call_native(rope_ext.apply_rotary_qk, x[0], x[1, :, :2], table,
                               positions=positions[0])
    for g, w in zip(packed, want_packed):
        assert_matches_reference(g, w.double())
    assert returned is written
    assert_matches_reference(written, _call_native(rope_ext.apply_rotary, x, table,
                                                   inverse=True).double())


def _call_native(fn, *args, **kwargs):
    saved = _native.NATIVE_DEVICES
    _native.NATIVE_DEVICES = _native._native_devices()
    try:
        return fn(*args, **kwargs)
    finally:
        _native.NATIVE_DEVICES = saved


def test_fallback_autograd(no_native):
    x = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="eager complex-multiply path"):
        table = rope_ext.precompute_freqs_cis(8, 6, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, t: rope_ext.apply_rotary(x, t), (x, table))


def test_fallback_tables(no_native, monkeypatch):
    """Where the device has no native kernel the compiled CPU kernel still makes the table,
    scaled ones included; without the library the eager path makes the default table and
    says that scaled ones need the library."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    with pytest.warns(RuntimeWarning, match="eager complex-multiply path"):
        got = rope_ext.precompute_freqs_cis(32, 40, rope_scaling=yarn)
    assert torch.equal(got, _call_native(rope_ext.precompute_freqs_cis, 32, 40,
                                         rope_scaling=yarn))
    monkeypatch.setattr(_native, "LOADED", False)
    torch.testing.assert_close(rope_ext.precompute_freqs_cis(32, 40, dtype=torch.float64),
                               reference.precompute_freqs_cis(32, 40, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="precompute_freqs_cis: rope_type 'yarn' needs the "
                       "compiled extension, which did not load"):
        rope_ext.precompute_freqs_cis(32, 40, rope_scaling=yarn)


# Each in-place entry on q and k: (q, k, table, norm weight) -> what it returns.
INPLACE_ENTRIES = {
    "apply_rotary": lambda q, k, t, w, **kw: (rope_ext.apply_rotary(q, t, inplace=True, **kw),
                                              rope_ext.apply_rotary(k, t, inplace=True, **kw)),
    "apply_rotary_qk": lambda q, k, t, w, **kw: rope_ext.apply_rotary_qk(q, k, t, inplace=True,
                                                                         **kw),
    "rms_norm_rotary_qk": lambda q, k, t, w, **kw: rope_ext.rms_norm_rotary_qk(
        q, k, w, w, t, inplace=True, **kw),
}


def inplace_expected(entry, x, table, weight, **kwargs):
    """The float64 reference of one tensor of an in-place entry (computed before the call)."""
    real = torch.view_as_real(table).double()
    if entry == "rms_norm_rotary_qk":
        return reference.rms_norm_rotary(x.double(), weight.double(), real, **kwargs)
    return reference.apply_rotary(x.double(), real, **kwargs)


@pytest.mark.parametrize("entry", list(INPLACE_ENTRIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_fallback_inplace_writes_its_inputs(no_native, entry, dtype, interleaved):
    """In place, the eager path rotates q and k where they lie, views of one qkv projection,
    returns them and leaves v alone."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 6, 4 + 2 + 2, 32, generator=gen).to(dtype)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    positions = torch.randint(0, 12, (2, 6, 1), generator=gen)
    weight = torch.rand(32, generator=gen) + 0.5
    kwargs = dict(positions=positions, offset=3, interleaved=interleaved)
    with pytest.warns(RuntimeWarning, match="eager complex-multiply path"):
        table = rope_ext.precompute_freqs_cis(32, 16)
        want = [inplace_expected(entry, t, table, weight, **kwargs) for t in (q, k)]
        v_before = v.clone()
        got = INPLACE_ENTRIES[entry](q, k, table, weight, **kwargs)
    assert got[0] is q and got[1] is k
    assert_matches_reference(q, want[0])
    assert_matches_reference(k, want[1])
    assert torch.equal(v, v_before)


def test_disable_native_env_inplace_entries_write_their_inputs():
    """ROPE_EXT_DISABLE_NATIVE=1, as a user sets it: every in-place entry writes its inputs."""
    import os

    code = """
import warnings, torch, rope_ext
from rope_ext import reference
warnings.simplefilter("ignore")
assert not rope_ext.native_available()
table = rope_ext.precompute_freqs_cis(16, 8)
real = torch.view_as_real(table).double()
w = torch.rand(16) + 0.5
def check(call, norm):
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    before = [q.clone(), k.clone()]
    got = call(q, k)
    for g, t, x in zip(got, (q, k), before):
        want = (reference.rms_norm_rotary(x.double(), w.double(), real, offset=2) if norm
                else reference.apply_rotary(x.double(), real, offset=2))
        assert g is t
        torch.testing.assert_close(t.double(), want, atol=2e-6, rtol=2e-6)
check(lambda q, k: [rope_ext.apply_rotary(q, table, offset=2, inplace=True)], False)
check(lambda q, k: rope_ext.apply_rotary_qk(q, k, table, offset=2, inplace=True), False)
check(lambda q, k: rope_ext.rms_norm_rotary_qk(q, k, w, w, table, offset=2, inplace=True), True)
print("in-place ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "ROPE_EXT_DISABLE_NATIVE": "1"})
    assert run.returncode == 0 and run.stdout == "in-place ok\n", run.stdout + run.stderr


def test_main_self_check_of_the_fallback(no_native):
    from rope_ext.__main__ import self_check

    with pytest.warns(RuntimeWarning, match="eager complex-multiply path"):
        assert self_check("cpu") == []


def test_main_self_check_sees_inplace_calls_that_write_nothing(no_native, monkeypatch):
    """A fallback whose in-place calls return the right values but leave their inputs as they
    were fails the main job's self-check."""
    from rope_ext.__main__ import self_check

    def returning_only(fn):
        def call(x, *args, inplace=False, **kwargs):
            return fn(x, *args, **kwargs)
        return call

    monkeypatch.setattr(reference, "apply_rotary", returning_only(reference.apply_rotary))
    monkeypatch.setattr(reference, "rms_norm_rotary", returning_only(reference.rms_norm_rotary))
    with pytest.warns(RuntimeWarning, match="eager complex-multiply path"):
        failures = self_check("cpu")
    # 4 dtypes x 2 pairings x 2 op families, each: inputs not returned, q and k not written
    assert len(failures) == 4 * 2 * 2 * 3, failures
    assert all(" in place " in f for f in failures), failures


def test_meta_tensors_use_fake_kernels():
    x = torch.empty(2, 16, 4, 64, device="meta", dtype=torch.bfloat16)
    table = rope_ext.precompute_freqs_cis(64, 32, device="meta")
    assert table.shape == (32, 32) and table.device.type == "meta"
    out = rope_ext.apply_rotary(x, table)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "meta"


def test_disable_native_env_and_main_report():
    code = ("import warnings, torch, rope_ext; warnings.simplefilter('error');"
            "print(rope_ext.native_available());"
            "rope_ext.apply_rotary(torch.randn(1, 2, 8), rope_ext.precompute_freqs_cis(8, 2))")
    env = {"ROPE_EXT_DISABLE_NATIVE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, **env})
    assert run.stdout.startswith("False")
    assert "RuntimeWarning: rope_ext: no native kernel for cpu tensors" in run.stderr


def _import_copy(tmp_path, keep_library: bool, record: str | None, source_tree: bool):
    """Imports a copy of the package, as installed or as a source checkout; returns what
    `import rope_ext` then says: (native_available, LOAD_ERROR, warnings)."""
    import os
    import shutil

    package = tmp_path / "rope_ext"
    shutil.copytree(os.path.dirname(rope_ext.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__", "_C.torch_version",
                                                  *([] if keep_library else ["_C*.so"])))
    if record is not None:
        (package / "_C.torch_version").write_text(record + "\n")
    if source_tree:
        (tmp_path / "setup.py").write_text("")
    code = ("import sys, warnings; warnings.simplefilter('always');"
            # past an editable install's finder, which would import the checkout instead
            "sys.meta_path[:] = [f for f in sys.meta_path"
            " if not str(getattr(f, '__module__', '')).startswith('__editable__')];"
            "import rope_ext, rope_ext._native as n;"
            "print(rope_ext.native_available()); print(n.LOAD_ERROR)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    loaded, error = run.stdout.splitlines()[:2]
    return loaded == "True", error, run.stderr


def test_library_built_against_another_torch(tmp_path):
    """An isolated `pip install .` may compile against a newer torch than the user runs."""
    # It still loads (same ABI here): a warning names both versions and the fix.
    loaded, _, stderr = _import_copy(tmp_path / "a", True, "2.99.0", source_tree=False)
    assert loaded
    assert (f"rope_ext: compiled against torch 2.99.0 but running on torch {torch.__version__}; "
            "if anything misbehaves, rebuild with `pip install \"setuptools>=77\" ninja && "
            "pip install --no-build-isolation --force-reinstall --no-deps .`") in stderr
    # It does not load: the fallback's reason says why and what to run.
    loaded, error, _ = _import_copy(tmp_path / "b", False, "2.99.0", source_tree=False)
    assert not loaded
    assert error == (f"rope_ext was compiled against torch 2.99.0 but torch {torch.__version__} "
                     "is installed; rebuild it against this torch from the source tree with "
                     "`pip install \"setuptools>=77\" ninja && pip install --no-build-isolation "
                     "--force-reinstall --no-deps .` (`pip "
                     "install .` alone builds in an isolated environment that may get another "
                     "torch)")
    # The record matching the running torch: no warning.
    loaded, _, stderr = _import_copy(tmp_path / "c", True, torch.__version__, source_tree=False)
    assert loaded and "compiled against" not in stderr


def test_source_tree_without_library(tmp_path):
    loaded, error, _ = _import_copy(tmp_path, False, None, source_tree=True)
    assert not loaded
    assert error == (f"rope_ext is imported from its source tree ({tmp_path}), which holds no "
                     "compiled extension: run Python from another directory to use the "
                     "installed rope_ext, or build here with `pip install "
                     "--no-build-isolation -e .`")
