"""The eager fallback: same API and results where no native kernel serves the device."""

import subprocess
import sys
import warnings

import pytest
import torch

import rope_ext
from rope_ext import _native

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
        rope_ext.apply_rotary(x.clone(), table, inplace=True, inverse=True)
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
