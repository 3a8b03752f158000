"""Concurrency, determinism and 64-bit indexing."""

import threading

import pytest
import torch

import rope_ext
from rope_ext import reference

from conftest import DTYPES, assert_matches_reference


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 300, 8, 128, generator=gen).to(dtype)
    k = torch.randn(2, 300, 2, 128, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (2, 300, 1), generator=gen)
    return q, k, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_bitwise_identical_across_thread_counts_and_runs(dtype, interleaved):
    q, k, positions = inputs(dtype)
    table = rope_ext.precompute_freqs_cis(128, 512)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 1):
            torch.set_num_threads(threads)
            results.append(rope_ext.apply_rotary_qk(q, k, table, positions=positions,
                                                    interleaved=interleaved))
    finally:
        torch.set_num_threads(saved)
    for got_q, got_k in results[1:]:
        assert torch.equal(got_q, results[0][0]) and torch.equal(got_k, results[0][1])


@pytest.mark.parametrize("inplace", [False, True])
def test_eight_python_threads_at_once(inplace):
    table = rope_ext.precompute_freqs_cis(128, 512)
    work = [inputs(torch.bfloat16 if i % 2 else torch.float32, seed=i) for i in range(8)]
    expected = [rope_ext.apply_rotary_qk(q, k, table, positions=p) for q, k, p in work]
    results = [None] * 8
    barrier = threading.Barrier(8)

    def run(i):
        q, k, p = work[i]
        if inplace:
            q, k = q.clone(), k.clone()
        barrier.wait()
        for _ in range(20):
            out = rope_ext.apply_rotary_qk(q.clone() if inplace else q, k.clone() if inplace else k,
                                           table, positions=p, inplace=inplace)
        results[i] = out

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (got_q, got_k), (want_q, want_k) in zip(results, expected):
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    """bfloat16 x of 2,148,532,224 elements (4.3 GB): rows past element 2**31 are right."""
    seq, heads, head_dim = 16392, 1024, 128
    x = torch.zeros(1, seq, heads, head_dim, dtype=torch.bfloat16)
    assert x.numel() > 2**31
    table = rope_ext.precompute_freqs_cis(head_dim, seq)
    real = torch.view_as_real(table).double()
    gen = torch.Generator().manual_seed(0)
    first_past = 2**31 // (heads * head_dim)  # the token holding element 2**31
    samples = [(0, 0), (1, 7), (first_past - 1, heads - 1), (first_past, 0),
               (first_past, heads // 2), (seq - 1, heads - 1), (seq - 2, 3)]
    originals = {}
    for s, h in samples:
        x[0, s, h] = torch.randn(head_dim, generator=gen).to(torch.bfloat16)
        originals[s, h] = x[0, s, h].clone()
    rope_ext.apply_rotary(x, table, inplace=True)
    for (s, h), row in originals.items():
        want = reference.apply_rotary(row.double().view(1, 1, head_dim), real[s:s + 1])
        assert_matches_reference(x[0, s, h].view(1, 1, head_dim), want)
    # A row never set was rotated as zeros and stays zero.
    assert torch.count_nonzero(x[0, seq // 2, 5]) == 0
