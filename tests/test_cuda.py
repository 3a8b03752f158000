"""CUDA-only behaviour: agreement with the CPU kernels (and, for the fused norm, with the host
emulation), vector and scalar paths, CUDA graphs,
reduce-overhead compile, device-side position asserts."""

import os
import subprocess
import sys

import pytest
import torch

import rope_ext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]  # -k bfloat16 selects


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (128, 64), (80, 80), (72, 40), (6, 4)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_cuda_agrees_with_cpu(dtype, interleaved, head_dim, rotary_dim, misaligned):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3 * 17 * 5 * head_dim + 1, generator=gen).to(dtype)
    # A storage offset of one element defeats 16-byte alignment: the scalar path.
    x = base[1:] if misaligned else base[:-1]
    x = x.view(3, 17, 5, head_dim)
    table = rope_ext.precompute_freqs_cis(rotary_dim, 40)
    positions = torch.randint(0, 40, (3, 17, 1), generator=gen)
    kwargs = dict(positions=positions, interleaved=interleaved)
    want = rope_ext.apply_rotary(x, table, **kwargs)
    got = rope_ext.apply_rotary(x.cuda(), table.cuda(), **{**kwargs, "positions": positions.cuda()})
    # Bit for bit: both kernels run rotate_pair (rope_math.h) with its roundings spelt out, on
    # the same table, and round to the output type the same way (the host emulation of the
    # CUDA kernels, tests/test_cuda_emulation.py, shows the same without a GPU).
    assert torch.equal(got.cpu(), want), (got.cpu().double() - want.double()).abs().max()


def test_cuda_table_matches_cpu():
    for dtype in (torch.float32, torch.float64):
        got = rope_ext.precompute_freqs_cis(128, 70000, device="cuda", dtype=dtype).cpu()
        want = rope_ext.precompute_freqs_cis(128, 70000, dtype=dtype)
        torch.testing.assert_close(got, want, atol=1.2e-7 if dtype == torch.float32 else 1e-12, rtol=0)


def test_cuda_graph_capture_and_replay():
    table = rope_ext.precompute_freqs_cis(128, 256, device="cuda")
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.zeros(4, 1, 1, dtype=torch.int64, device="cuda")
    static_q, static_k = q.clone(), k.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        rope_ext.apply_rotary_qk(static_q, static_k, table, positions=positions, inplace=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_k = rope_ext.apply_rotary_qk(static_q, static_k, table, positions=positions)
    for step in [3, 17, 200]:
        positions.fill_(step)
        static_q.copy_(q)
        static_k.copy_(k)
        graph.replay()
        want_q, want_k = rope_ext.apply_rotary_qk(q, k, table, offset=step)
        torch.testing.assert_close(out_q, want_q, atol=0, rtol=0)
        torch.testing.assert_close(out_k, want_k, atol=0, rtol=0)


def test_compile_reduce_overhead():
    table = rope_ext.precompute_freqs_cis(64, 128, device="cuda")

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q, k, positions):
        return rope_ext.apply_rotary_qk(q * 1, k * 1, table, positions=positions)

    for i in range(4):
        q = torch.randn(8, 1, 4, 64, device="cuda")
        k = torch.randn(8, 1, 2, 64, device="cuda")
        positions = torch.full((8, 1, 1), 10 + i, device="cuda")
        got = step(q, k, positions)
        want = rope_ext.apply_rotary_qk(q, k, table, offset=10 + i)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_out_of_range_position_is_a_device_assert():
    code = ("import torch, rope_ext\n"
            "t = rope_ext.precompute_freqs_cis(16, 8, device='cuda')\n"
            "x = torch.randn(1, 2, 16, device='cuda')\n"
            "rope_ext.apply_rotary(x, t, positions=torch.tensor([1, 8], device='cuda'))\n"
            "torch.cuda.synchronize()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
    assert run.returncode != 0
    assert "offset + positions must lie in" in run.stderr or "device-side assert" in run.stderr


def test_other_stream_and_device_guard():
    table = rope_ext.precompute_freqs_cis(32, 16, device="cuda")
    x = torch.randn(2, 16, 2, 32, device="cuda")
    want = rope_ext.apply_rotary(x, table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = rope_ext.apply_rotary(x, table)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim",
                         [(128, 128), (128, 64), (256, 256), (80, 80), (72, 40), (6, 4)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_norm_cuda_agrees_with_emulation(dtype, interleaved, head_dim, rotary_dim, misaligned):
    """Fused RMSNorm + RoPE, forward and backward: the GPU computes bit for bit what the host
    emulation of the same kernels computes (same thread functions, same butterfly order;
    tests/test_cuda_emulation.py). The weight gradients are float32 sums over partial rows
    whose number follows the GPU's occupancy (the emulation assumes 2 blocks per SM; the
    scalar kernels fit more), added in another order: they agree to float32 rounding, and
    once rounded to a 16-bit weight dtype to one unit in its last place."""
    gen = torch.Generator().manual_seed(1)
    D = head_dim
    base = torch.randn(2 * 9 * 6 * D + 1, generator=gen).to(dtype)
    k = torch.randn(2, 9, 2, D, generator=gen).to(dtype)
    wq = torch.randn(D, generator=gen) * 0.5 + 1
    wk = (torch.randn(D, generator=gen) * 0.5 + 1).to(dtype)
    gq = torch.randn(2, 9, 6, D, generator=gen).to(dtype)
    gk = torch.randn(2, 9, 2, D, generator=gen).to(dtype)
    table = rope_ext.precompute_freqs_cis(rotary_dim, 40)
    positions = torch.randint(0, 40, (2, 9, 1), generator=gen)
    ops = torch.ops.rope_ext

    def run(base, k, wq, wk, gq, gk, table, positions):
        # A storage offset of one element defeats 16-byte alignment: the scalar path.
        q = (base[1:] if misaligned else base[:-1]).view(2, 9, 6, D)
        args = (table, positions, 0, 1, interleaved, 1e-5, 0.0, None, False)
        return (*ops.rms_norm_rotary_qk(q, k, wq, wk, *args),
                *ops.rms_norm_rotary_qk_backward(gq, gk, q, k, wq, wk, *args))

    ops._cuda_emulation(132, 2)
    try:
        want = run(base, k, wq, wk, gq, gk, table, positions)
    finally:
        ops._cuda_emulation(0)
    got = [t.cpu() for t in run(*(t.cuda() for t in (base, k, wq, wk, gq, gk, table,
                                                      positions)))]
    names = ("q_out", "k_out", "dq", "dk", "dwq", "dwk")
    for name, g, w in zip(names[:4], got[:4], want[:4]):
        diff = (g.double() - w.double()).abs()
        assert torch.equal(g, w), f"{name}: {(diff > 0).sum()} differ, by up to {diff.max()}"
    for name, g, w in zip(names[4:], got[4:], want[4:]):
        assert g.dtype == w.dtype == (wq.dtype if name == "dwq" else wk.dtype), (name, g.dtype)
        # A 16-bit gradient's rounding can flip by one unit: at most eps relative.
        rtol = 1e-4 if g.dtype in (torch.float32, torch.float64) else torch.finfo(g.dtype).eps
        torch.testing.assert_close(g, w, atol=1e-4, rtol=rtol, msg=lambda m: f"{name}: {m}")


def test_norm_cuda_graph_capture():
    """The norm kernels launch on the current stream: they can be captured and replayed."""
    table = rope_ext.precompute_freqs_cis(128, 64, device="cuda")
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    wq = torch.randn(128, device="cuda")
    wk = torch.randn(128, device="cuda")
    want = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rope_ext.rms_norm_rotary_qk(q, k, wq, wk, table)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_ext.rms_norm_rotary_qk(q, k, wq, wk, table)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


# ---- The fused RoPE + KV-cache write ----

@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=str)
@pytest.mark.parametrize("cache_layout", ["NHD", "HND"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("misaligned", [False, True])
def test_kv_cache_cuda_agrees_with_cpu(cache_dtype, cache_layout, interleaved, misaligned):
    """q's result and both whole caches bit for bit against the CPU kernel (as the host
    emulation shows without a GPU): padding slots, GQA, partial rotary, float8 scales."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(3 * 7 * 8 * 128 + 1, generator=gen).bfloat16()
    q = (base[1:] if misaligned else base[:-1]).view(3, 7, 8, 128)
    k, v = (torch.randn(3, 7, 2, 128, generator=gen).bfloat16() for _ in range(2))
    shape = (8, 4, 2, 128) if cache_layout == "NHD" else (8, 2, 4, 128)
    k_cache, v_cache = (torch.randn(*shape, generator=gen).to(cache_dtype) for _ in range(2))
    slots = torch.randperm(32, generator=gen)[:21].view(3, 7, 1)
    slots[:, ::3] = -1
    positions = torch.randint(0, 40, (3, 7, 1), generator=gen)
    table = rope_ext.precompute_freqs_cis(96, 40)
    kw = dict(positions=positions, interleaved=interleaved, cache_layout=cache_layout)
    if cache_dtype != torch.bfloat16:
        kw.update(k_scale=torch.tensor([0.5]), v_scale=torch.rand(2, generator=gen) + 0.5)
    cuda = {name: t.cuda() for name, t in dict(q=q, k=k, v=v, kc=k_cache.clone(),
                                                   vc=v_cache.clone(), slots=slots).items()}
    want = rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots, **kw)
    got = rope_ext.rotary_kv_cache_update(
        cuda["q"], cuda["k"], cuda["v"], table.cuda(), cuda["kc"], cuda["vc"], cuda["slots"],
        **{name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in kw.items()})
    assert torch.equal(got.cpu(), want)
    for g, w in ((cuda["kc"], k_cache), (cuda["vc"], v_cache)):
        assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))


def test_kv_cache_cuda_graph_capture():
    """A decode step captured once and replayed at new positions and slots (both on the
    device): the same caches as eager calls."""
    table = rope_ext.precompute_freqs_cis(128, 64, device="cuda")
    q = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache = torch.zeros(4, 2, 64, 128, device="cuda", dtype=torch.bfloat16)  # static, HND
    k_cache, v_cache = cache.clone(), cache.clone()
    positions = torch.zeros(4, 1, dtype=torch.int64, device="cuda")
    slots = rope_ext.static_cache_slots(positions, 64)

    def step():
        slots.copy_(rope_ext.static_cache_slots(positions, 64))
        return rope_ext.rotary_kv_cache_update(q, k, v, table, k_cache, v_cache, slots,
                                               positions=positions[..., None],
                                               cache_layout="HND")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    want_k, want_v = cache.clone(), cache.clone()
    want_k.copy_(k_cache)
    want_v.copy_(v_cache)
    for position in (3, 17, 40):
        positions.fill_(position)
        graph.replay()
        want_q = rope_ext.rotary_kv_cache_update(
            q, k, v, table, want_k, want_v, rope_ext.static_cache_slots(positions, 64),
            positions=positions[..., None], cache_layout="HND")
        assert torch.equal(out, want_q)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_kv_cache_slot_past_the_cache_is_a_device_assert():
    code = ("import torch, rope_ext\n"
            "t = rope_ext.precompute_freqs_cis(16, 8, device='cuda')\n"
            "q = torch.randn(2, 1, 16, device='cuda')\n"
            "c = torch.zeros(2, 2, 1, 16, device='cuda')\n"
            "rope_ext.rotary_kv_cache_update(q, q, q, t, c, c.clone(),\n"
            "    torch.tensor([[1], [4]], device='cuda'), positions=torch.tensor([[0], [1]],\n"
            "    device='cuda'), seq_dim=0)\n"
            "torch.cuda.synchronize()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
    assert run.returncode != 0
    assert "slots must be < num_blocks" in run.stderr or "device-side assert" in run.stderr
