"""What the build holds: CI sets ROPE_EXT_EXPECT_CUDA=1 where it compiled the CUDA sources,
so a CUDA build that silently dropped its kernels fails here, GPU or not."""

import os

import pytest
import torch

import rope_ext

OPS = ["fill_freqs_cis_", "apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_"]


def registered_keys(op):
    dump = torch._C._dispatch_dump(f"rope_ext::{op}")
    return {line.split(":")[0] for line in dump.splitlines() if "registered at" in line}


@pytest.mark.parametrize("op", OPS)
def test_cpu_kernels_registered(op):
    assert "CPU" in registered_keys(op)


@pytest.mark.skipif(os.environ.get("ROPE_EXT_EXPECT_CUDA") != "1", reason="CUDA build not expected")
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_registered(op):
    assert "CUDA" in registered_keys(op)
    info = rope_ext.build_info()
    assert info["cuda"] == "yes" and info["cuda_archs"].startswith("sm_")


def test_build_info_names_the_cpu_kernel():
    assert rope_ext.build_info()["cpu_kernel"] in {"DEFAULT", "AVX2", "AVX512", "AVX512_BF16"}
