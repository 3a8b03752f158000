"""What the build holds: the kernels the dispatcher has are the ones build_info() reports, so
a CUDA build that silently dropped a kernel fails here, GPU or not; CI also sets
ROPE_EXT_EXPECT_CUDA=1 where it compiled the CUDA sources, so a build without them fails."""

import os

import pytest
import torch

import rope_ext

OPS = ["fill_freqs_cis_", "apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_",
       "rms_norm_rotary_qk", "rms_norm_rotary_qk_", "rms_norm_rotary_qk_backward"]


def registered_keys(op):
    dump = torch._C._dispatch_dump(f"rope_ext::{op}")
    return {line.split(":")[0] for line in dump.splitlines() if "registered at" in line}


# The fused RoPE + KV-cache write: CPU and CUDA kernels; elsewhere the Python function
# composes it.
KV_OPS = ["rotary_kv_cache_update", "rotary_kv_cache_update_"]


@pytest.mark.parametrize("op", OPS + KV_OPS)
def test_cpu_kernels_registered(op):
    assert "CPU" in registered_keys(op)


@pytest.mark.parametrize("op", OPS + KV_OPS)
def test_cuda_kernels_registered_as_build_info_says(op):
    info = rope_ext.build_info()
    if os.environ.get("ROPE_EXT_EXPECT_CUDA") == "1":
        assert info["cuda"] == "yes", info
    assert info["cuda"] in ("yes", "no"), info
    assert ("CUDA" in registered_keys(op)) == (info["cuda"] == "yes"), (op, info)
    if info["cuda"] == "yes":
        assert info["cuda_archs"].startswith("sm_"), info
    else:
        assert info["cuda_archs"] == "", info


def test_build_info_names_the_cpu_kernel():
    assert rope_ext.build_info()["cpu_kernel"] in {"DEFAULT", "AVX2", "AVX512", "AVX512_BF16"}


def test_library_uses_the_shared_libstdcxx():
    """torch runs on the system's libstdc++.so.6; a library with its own static copy crashed at
    its first `ostream << bool` (build_info, TORCH_CHECK messages) on a GPU image whose g++
    wrapper linked libstdc++ statically. setup.py now refuses such a compiler."""
    from rope_ext import _toolchain

    assert rope_ext._native.LOADED
    assert _toolchain.bundled_libstdcxx(rope_ext._C.__file__) == []


@pytest.fixture
def static_libstdcxx_gxx(tmp_path):
    """A g++ that links libstdc++ statically into shared libraries, as the GPU image's
    /opt/gcc/bin/g++ wrapper does."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ on PATH")
    wrapper = tmp_path / "static-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    from rope_ext import _toolchain

    if _toolchain.links_own_libstdcxx([str(wrapper)]) is None:
        pytest.skip("this g++ has no static libstdc++ to link (libstdc++.a)")
    return str(wrapper)


def test_setup_replaces_a_compiler_that_links_its_own_libstdcxx(static_libstdcxx_gxx):
    from rope_ext import _toolchain

    assert _toolchain.links_own_libstdcxx([static_libstdcxx_gxx]) is True
    assert _toolchain.links_own_libstdcxx(["g++"]) is False
    env = {"CXX": static_libstdcxx_gxx, "CC": "/nowhere/gcc", "PATH": os.environ["PATH"]}
    lines = []
    _toolchain.choose_compiler(env, log=lines.append)
    assert env["CXX"] == env["CUDAHOSTCXX"] != static_libstdcxx_gxx
    assert _toolchain.links_own_libstdcxx([env["CXX"]]) is False
    assert env.get("CC") != "/nowhere/gcc"
    assert "links libstdc++ statically" in lines[0] and env["CXX"] in lines[0]
    # A good compiler is left as it is, CC included.
    env = {"CXX": "g++", "CC": "gcc", "PATH": os.environ["PATH"]}
    _toolchain.choose_compiler(env, log=lines.append)
    assert env == {"CXX": "g++", "CC": "gcc", "PATH": os.environ["PATH"]} and len(lines) == 1


def test_setup_stops_when_no_compiler_links_the_shared_libstdcxx(static_libstdcxx_gxx):
    from rope_ext import _toolchain

    env = {"CXX": static_libstdcxx_gxx, "PATH": os.environ["PATH"]}
    with pytest.raises(SystemExit, match="links libstdc\\+\\+ statically.*Set CXX"):
        _toolchain.choose_compiler(env, candidates=(static_libstdcxx_gxx, "/nowhere/g++"))
    assert env["CXX"] == static_libstdcxx_gxx
