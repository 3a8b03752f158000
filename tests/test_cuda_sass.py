"""What the compiler made of the CUDA kernels (sm_90), read from the built library's SASS with
cuobjdump: no GPU needed. The design relies on these properties; a change that breaks one
fails here (CI builds sm_90 and sets ROPE_EXT_EXPECT_CUDA=1, so there this cannot skip).

- No rotary kernel spills or uses local memory.
- On the vector path every global store is a 16-byte STG.E.128 (a generic-address ST counts
  as a store of its width too), and so is every load but the row's position (one int32 or
  int64 load) and, where a lane's (cos, sin) are not one 16-byte vector (MRoPE, or float64 x
  with a float32 table), the table's.
- Registers: the vector kernels are built for 3 blocks of 256 threads per SM (768 resident
  threads, 48 KB of loads in flight per SM), so at most 80 per thread; the scalar and MRoPE
  kernels for 2 (at most 128). See min_blocks_per_sm() in csrc/cuda/rope_cuda_kernel.h.
- The fused RoPE + KV-cache write kernels (kv_cache_kernel): no spills or local memory; on
  the vector path every global store is 16 bytes but a float8 cache's, which stores a
  chunk's width in bytes (8 for 16-bit x), and every load is 16 bytes but the position's, the
  slot's (int32 or int64 each), the float8 scale's and, as in the rotary kernels, a lane's
  (cos, sin) where they are not one 16-byte vector; at most 80 registers on the vector path
  and 128 on the scalar path.
- The fused RMSNorm + RoPE kernels (norm_rotary_kernel): no spills or local memory; on the
  vector path every global store is 16 bytes (rows, and the backward's weight-gradient
  partials), and so is every load (rows, weights, (cos, sin), partials) but the position's
  and, in the MRoPE kernels, each pair's (cos, sin) from its axis' table row; at most 128
  registers (kNormMinBlocks = 2 blocks of 256 threads per SM).
"""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rope_ext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sass_report  # noqa: E402

ARCH = "sm_90"
EXPECTED = os.environ.get("ROPE_EXT_EXPECT_CUDA") == "1"


# cuobjdump's output for one made-up kernel: every kind of memory access the parser tells
# apart, predicated and not, each instruction line followed by its second encoding line.
SASS = """
	code for sm_90
		Function : _Z6kernelPf
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                     /* 0x00000a00ff017b82 */
                                                                              /* 0x000fe40000000800 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;           /* 0x0000000402047981 */
        /*0020*/               @P0 LD.E.64 R8, desc[UR4][R6.64] ;             /* 0x0000000406080980 */
        /*0030*/                   LD.E R10, desc[UR4][R6.64+0x8] ;           /* 0x00000804060a7980 */
        /*0040*/                   LDG.E.STRONG.GPU R11, desc[UR4][R2.64] ;   /* 0x00000004020b7981 */
        /*0050*/                   LDS.128 R12, [R0] ;                        /* 0x00000000000c7984 */
        /*0060*/                   LDGSTS.E.128 [R0], desc[UR4][R2.64] ;      /* 0x0000000002007fae */
        /*0070*/                   STS [R0], R4 ;                             /* 0x0000000400007388 */
        /*0080*/              @!P1 ST.E.U16 desc[UR4][R6.64], R4 ;            /* 0x0000000406009986 */
        /*0090*/                   ST.E.64 desc[UR4][R6.64+0x10], R4 ;        /* 0x0000100406007985 */
        /*00a0*/                   STG.E.128 desc[UR4][R2.64], R4 ;           /* 0x0000000402007986 */
        /*00b0*/                   STL [R1], R4 ;                             /* 0x0000000401007387 */
        /*00c0*/                   LDL.LU R4, [R1] ;                          /* 0x0000000001047983 */
        /*00d0*/                   EXIT ;                                     /* 0x000000000000794d */
		..........
"""
USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function _Z6kernelPf:
  REG:40 STACK:8 SHARED:0 LOCAL:0 CONSTANT[0]:908 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_sass_parser_counts_every_access_by_width():
    """Global and generic-address loads and stores by width (generic LD / ST are what ptxas
    emits where it cannot prove a pointer global: a narrow one must fail the width gates),
    local accesses, registers and stack; shared and constant accesses are not global
    traffic. No CUDA build needed: the parser reads text."""
    (kernel,) = sass_report.parse(SASS, USAGE)
    assert kernel.name in ("kernel(float*)", "_Z6kernelPf")  # demangled where c++filt is
    assert kernel.instructions == 14
    assert kernel.loads == {128: 2, 64: 1, 32: 2}  # LDGSTS.E.128 a global load too
    assert kernel.stores == {128: 1, 64: 1, 16: 1}
    assert kernel.generic_accesses == 4
    assert kernel.local_accesses == 2
    assert (kernel.registers, kernel.stack) == (40, 8)
    assert kernel.wide_store_share == 1 / 3


@functools.cache
def _kernels():
    """Every kernel of the build's SASS, parsed once (a second or more per cuobjdump call)."""
    info = rope_ext.build_info()
    if info["cuda"] != "yes" or ARCH not in info["cuda_archs"].split():
        if EXPECTED:
            pytest.fail(f"ROPE_EXT_EXPECT_CUDA=1 but the build has no {ARCH} code: {info}")
        pytest.skip(f"no {ARCH} CUDA kernels in this build ({info['cuda_archs']})")
    tool = sass_report.cuobjdump()
    lib = sass_report.library()

    def dump(*args):
        return subprocess.run([tool, *args, "-arch", ARCH, lib], capture_output=True, text=True,
                              check=True).stdout

    return sass_report.parse(dump("-sass"), dump("-res-usage"))


@pytest.fixture(scope="module")
def rotary_kernels():
    kernels = [k for k in _kernels() if k.name.startswith("void rotary_kernel<")]
    # 4 element types x 2 table types x 2 pairings x vector/scalar x MRoPE or not x 32/64-bit
    assert len(kernels) == 128, [k.name for k in kernels]
    return kernels


SIZES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8}


def template_args(kernel):
    """rotary_kernel<scalar_t, table_t, kInterleaved, kVector, kMrope, index_t> -> its
    arguments."""
    return re.search(r"rotary_kernel<(.*)>\(", kernel.name).group(1).split(", ")


def is_vector(kernel):
    return template_args(kernel)[3] == "true"


def is_mrope(kernel):
    return template_args(kernel)[4] == "true"


def narrow_loads_allowed(kernel):
    """The position (an int32 or an int64 load; MRoPE: one per axis, up to 4), and the (cos,
    sin) of a lane when they are not one 16-byte vector: MRoPE (each pair from its axis' table
    row) and float64 x with a float32 table, interleaved (one pair per lane)."""
    scalar, table, interleaved = template_args(kernel)[:3]
    pairs = 16 // SIZES[scalar] // (2 if interleaved == "true" else 1)
    if is_mrope(kernel):
        return 2 * 4 + 2 * pairs
    table_bytes = pairs * 2 * SIZES[table]
    return 2 + (2 * pairs if table_bytes % 16 else 0)


def test_no_spills_and_no_local_memory(rotary_kernels):
    bad = [(k.name, k.stack, k.local_accesses) for k in rotary_kernels
           if k.stack or k.local_accesses]
    assert not bad, bad


def test_vector_path_moves_16_bytes_per_access(rotary_kernels):
    for k in filter(is_vector, rotary_kernels):
        assert set(k.stores) == {128}, (k.name, k.stores)
        narrow_loads = sum(n for width, n in k.loads.items() if width != 128)
        assert narrow_loads <= narrow_loads_allowed(k), (k.name, k.loads)


def test_register_budget(rotary_kernels):
    for k in rotary_kernels:
        budget = 80 if is_vector(k) and not is_mrope(k) else 128
        assert 0 < k.registers <= budget, (k.name, k.registers)


# ---- The fused RMSNorm + RoPE kernels (csrc/cuda/qk_norm_cuda_kernel.h) ----

@pytest.fixture(scope="module")
def norm_kernels():
    kernels = [k for k in _kernels() if k.name.startswith("void norm_rotary_kernel<")]
    # 4 element types x 2 pairings x forward/backward x (scalar, vector, vector MRoPE)
    assert len(kernels) == 48, [k.name for k in kernels]
    return kernels


def norm_template_args(kernel):
    """norm_rotary_kernel<scalar_t, kInterleaved, kVector, kBackward, kMrope> -> its
    arguments."""
    return re.search(r"norm_rotary_kernel<(.*)>\(", kernel.name).group(1).split(", ")


def norm_narrow_loads_allowed(kernel):
    """Loads narrower than 16 bytes a vector-path norm kernel may make: the item's position
    (one int32 or one int64 load). MRoPE kernels instead load a position per axis (up to 4,
    int32 or int64) and each pair's cosine and sine from the table row of its axis, element by
    element: 2 per pair of each of a thread's lanes (norm_max_slots(): 1 for 16-bit x, else
    2), in finish() and, in backward, in load() too. The rows, the weights, the table of the
    other kernels and the weight-gradient partials must all be 16-byte loads."""
    scalar, interleaved, _, backward, mrope = norm_template_args(kernel)
    pairs = 16 // SIZES[scalar] // (2 if interleaved == "true" else 1)
    slots = 1 if SIZES[scalar] == 2 else 2
    if mrope == "true":
        return 2 * 4 + 2 * pairs * slots * (2 if backward == "true" else 1)
    return 2


def test_norm_no_spills_and_no_local_memory(norm_kernels):
    bad = [(k.name, k.stack, k.local_accesses) for k in norm_kernels
           if k.stack or k.local_accesses]
    assert not bad, bad


def test_norm_vector_path_moves_16_bytes_per_access(norm_kernels):
    """Rows (and, in backward, the weight-gradient partials) stored as 16-byte vectors; rows,
    weights and (cos, sin) loaded as 16-byte vectors (at most the position's loads narrower;
    MRoPE: see norm_narrow_loads_allowed)."""
    vector = [k for k in norm_kernels if norm_template_args(k)[2] == "true"]
    assert len(vector) == 32
    for k in vector:
        assert set(k.stores) == {128}, (k.name, k.stores)
        narrow_loads = sum(n for width, n in k.loads.items() if width != 128)
        assert narrow_loads <= norm_narrow_loads_allowed(k), (k.name, k.loads)
        assert k.loads.get(128, 0) > 0, (k.name, k.loads)


def test_norm_register_budget(norm_kernels):
    """Built for 2 blocks of 256 threads per SM (kNormMinBlocks): at most 128 registers."""
    for k in norm_kernels:
        assert 0 < k.registers <= 128, (k.name, k.registers)


# ---- The fused RoPE + KV-cache write (csrc/cuda/kv_cache_cuda_kernel.h) ----

@pytest.fixture(scope="module")
def kv_kernels():
    kernels = [k for k in _kernels() if k.name.startswith("void kv_cache_kernel<")]
    # 4 element types x 2 table types x 2 pairings x vector/scalar x 32/64-bit
    assert len(kernels) == 64, [k.name for k in kernels]
    return kernels


def kv_template_args(kernel):
    """kv_cache_kernel<scalar_t, table_t, kInterleaved, kVector, index_t> -> its arguments."""
    return re.search(r"kv_cache_kernel<(.*)>\(", kernel.name).group(1).split(", ")


def test_kv_no_spills_and_no_local_memory(kv_kernels):
    bad = [(k.name, k.stack, k.local_accesses) for k in kv_kernels
           if k.stack or k.local_accesses]
    assert not bad, bad


def test_kv_vector_path_moves_16_bytes_per_access(kv_kernels):
    """Rows and (cos, sin) as 16-byte vectors; a float8 cache row's chunk in one store of its
    width in bytes (16 // sizeof(x): 8 bytes for bfloat16 and half, 4 for float32, 2 for
    float64); narrower loads only for the position and the slot (an int32 or an int64 load
    each), the float8 scale, and a lane's (cos, sin) where they are not one 16-byte vector
    (float64 x with a float32 table, interleaved: one pair per lane)."""
    vector = [k for k in kv_kernels if kv_template_args(k)[3] == "true"]
    assert len(vector) == 32
    for k in vector:
        scalar, table, interleaved = kv_template_args(k)[:3]
        float8_store = 8 * (16 // SIZES[scalar])
        assert set(k.stores) == {128, float8_store}, (k.name, k.stores)
        pairs = 16 // SIZES[scalar] // (2 if interleaved == "true" else 1)
        table_loads = 2 * pairs if pairs * 2 * SIZES[table] % 16 else 0
        narrow_loads = sum(n for width, n in k.loads.items() if width != 128)
        assert narrow_loads <= 2 + 2 + 1 + table_loads, (k.name, k.loads)
        assert k.loads.get(128, 0) > 0, (k.name, k.loads)


def test_kv_register_budget(kv_kernels):
    """Built for 3 blocks of 256 threads per SM on the vector path (at most 80 registers) and
    2 on the scalar path (at most 128): min_blocks_per_sm() in rope_cuda_kernel.h."""
    for k in kv_kernels:
        budget = 80 if kv_template_args(k)[3] == "true" else 128
        assert 0 < k.registers <= budget, (k.name, k.registers)
