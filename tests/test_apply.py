"""rope_ext against the float64 eager reference, over dtypes, layouts, pairings, partial
rotary, positions, strides and in-place calls."""

import re
import zlib

import pytest
import torch

import rope_ext
from rope_ext import reference

from conftest import DTYPES, assert_matches_reference

P, B, S, H, D = 64, 2, 11, 3, 32


def make_layout(name, device, dtype, gen):
    """x, call kwargs (seq_dim / positions / offset) for one layout."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def randint(high, *shape, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=gen).to(device=device, dtype=dtype)

    if name == "llama":
        return randn(B, S, H, D), dict(seq_dim=1)
    if name == "llama_3d":
        return randn(B, S, D), dict(seq_dim=1)
    if name == "hf":
        return randn(B, H, S, D), dict(seq_dim=2)
    if name == "negative_seq_dim":
        return randn(B, H, S, D), dict(seq_dim=-2)
    if name == "sequence_first":  # [S, B, H, D], as Megatron lays out activations
        return randn(S, B, H, D), dict(seq_dim=0)
    if name == "offset":
        return randn(B, S, H, D), dict(offset=P - S)
    if name == "decode":
        return randn(5, 1, H, D), dict(positions=randint(P, 5, 1, 1))
    if name == "positions_bs1":
        return randn(B, S, H, D), dict(positions=randint(P - 3, B, S, 1), offset=3)
    if name == "hf_positions_int32":
        return randn(B, H, S, D), dict(positions=randint(P, B, 1, S, dtype=torch.int32), seq_dim=2)
    if name == "packed":
        return randn(17, H, D), dict(positions=randint(P, 17, 1), seq_dim=0)
    if name == "positions_per_head":
        return randn(B, S, H, D), dict(positions=randint(P, B, S, H))
    if name == "fused_qkv_slice":
        qkv = randn(B, S, 3 * H * D)
        return qkv[..., H * D:2 * H * D].view(B, S, H, D), dict()
    if name == "strided_features":
        return randn(B, S, D, H).transpose(-1, -2), dict()
    if name == "storage_offset":
        return randn(B + 1, S, H, D)[1:], dict()
    raise ValueError(name)


LAYOUTS = [
    "llama", "llama_3d", "hf", "negative_seq_dim", "sequence_first", "offset", "decode",
    "positions_bs1", "hf_positions_int32", "packed", "positions_per_head", "fused_qkv_slice",
    "strided_features", "storage_offset",
]


def reference_of(x, table, **kwargs):
    """The float64 oracle, with the very table entries the op reads."""
    real = torch.view_as_real(table) if table.is_complex() else table
    return reference.apply_rotary(x.double(), real.double(), **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary(device, dtype, interleaved, layout, rotary_dim, inplace):
    # zlib.crc32, not hash(): str hashes change from process to process (PYTHONHASHSEED)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout} {rotary_dim}".encode()))
    x, kwargs = make_layout(layout, device, dtype, gen)
    table = rope_ext.precompute_freqs_cis(rotary_dim, P, device=device)
    kwargs["interleaved"] = interleaved
    expected = reference_of(x, table, **kwargs)  # before any in-place write
    original = x.clone()
    out = rope_ext.apply_rotary(x, table, inplace=inplace, **kwargs)
    assert out.dtype == dtype and out.shape == x.shape
    assert_matches_reference(out, expected)
    if inplace:
        assert out is x
    else:
        assert out.data_ptr() != x.data_ptr()
        torch.testing.assert_close(x, original, atol=0, rtol=0)
    # Pass-through features are copied bit for bit.
    torch.testing.assert_close(out[..., rotary_dim:], original[..., rotary_dim:], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_apply_rotary_qk_gqa(device, dtype, interleaved, inplace, fused):
    gen = torch.Generator().manual_seed(1)
    hq, hk = 8, 2
    if fused:  # views into one qkv projection output, no copies
        qkv = torch.randn(B, S, (hq + 2 * hk) * D, generator=gen).to(device, dtype)
        q = qkv[..., : hq * D].view(B, S, hq, D)
        k = qkv[..., hq * D:(hq + hk) * D].view(B, S, hk, D)
    else:
        q = torch.randn(B, S, hq, D, generator=gen).to(device, dtype)
        k = torch.randn(B, S, hk, D, generator=gen).to(device, dtype)
    table = rope_ext.precompute_freqs_cis(D, P, device=device)
    positions = torch.randint(0, P, (B, S, 1), generator=gen).to(device)
    kwargs = dict(positions=positions, interleaved=interleaved)
    want_q, want_k = reference_of(q, table, **kwargs), reference_of(k, table, **kwargs)
    got_q, got_k = rope_ext.apply_rotary_qk(q, k, table, inplace=inplace, **kwargs)
    assert_matches_reference(got_q, want_q)
    assert_matches_reference(got_k, want_k)
    assert (got_q is q and got_k is k) == inplace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_positions_define_positions(device, dtype, inplace):
    """With positions, seq_dim plays no part: q and k need only share head_dim and each
    broadcast with positions (vLLM's packed call; ranks and leading dims may differ)."""
    gen = torch.Generator().manual_seed(3)
    tokens, table = 13, rope_ext.precompute_freqs_cis(64, P, device=device)
    pos = torch.randint(0, P, (tokens,), generator=gen).to(device)
    cases = [
        # packed [T, H, D] q and k with different head counts, default seq_dim
        (torch.randn(tokens, 8, 64, generator=gen), torch.randn(tokens, 2, 64, generator=gen),
         pos[:, None], {}),
        # different ranks, and a seq_dim that names no dim of k
        (torch.randn(2, tokens, 4, 64, generator=gen), torch.randn(tokens, 2, 64, generator=gen),
         pos[:, None], dict(seq_dim=2)),
        # [T, D] rows (2-D) where the default seq_dim=1 is the feature dim
        (torch.randn(tokens, 64, generator=gen), torch.randn(tokens, 64, generator=gen), pos, {}),
    ]
    for q, k, positions, kwargs in cases:
        q, k = q.to(device, dtype), k.to(device, dtype)
        k_alone = k.clone()
        want_q = reference_of(q, table, positions=positions)
        want_k = reference_of(k, table, positions=positions)
        got_q, got_k = rope_ext.apply_rotary_qk(q, k, table, positions=positions,
                                                inplace=inplace, **kwargs)
        assert_matches_reference(got_q, want_q)
        assert_matches_reference(got_k, want_k)
        assert (got_q is q and got_k is k) == inplace
        got_x = rope_ext.apply_rotary(k_alone, table, positions=positions, inplace=inplace,
                                      **kwargs)
        assert_matches_reference(got_x, want_k)


@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(device, head_dim, dtype):
    x = torch.randn(2, 9, 2, head_dim, device=device).to(dtype)
    table = rope_ext.precompute_freqs_cis(head_dim, 16, device=device)
    for interleaved in (True, False):
        assert_matches_reference(
            rope_ext.apply_rotary(x, table, interleaved=interleaved),
            reference_of(x, table, interleaved=interleaved),
        )


def test_float64_table_and_strided_table(device):
    x = torch.randn(2, 9, 2, 16, device=device)
    table64 = rope_ext.precompute_freqs_cis(16, 40, device=device, dtype=torch.float64)
    assert_matches_reference(rope_ext.apply_rotary(x, table64), reference_of(x, table64))
    strided = torch.view_as_real(table64)[::2]  # every other position, non-contiguous
    assert_matches_reference(rope_ext.apply_rotary(x, strided), reference_of(x, strided))


@pytest.mark.parametrize("heads", [8, 5, 1])
@pytest.mark.parametrize("seq", [520, 544])  # tiles and tokens left over; whole tiles
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rotary_dim,interleaved,with_positions,memory",
                         [(48, False, False, "bhsd"), (64, False, True, "bhsd"),
                          (64, True, False, "bhsd"), (48, True, True, "bhsd"),
                          (64, False, False, "bshd"), (48, True, True, "bshd")])
def test_hf_layout_long_sequences(device, heads, seq, inplace, dtype, rotary_dim, interleaved,
                                  with_positions, memory):
    # [B, H, S, D] with enough positions that the CPU kernel walks the tokens in tiles, each
    # head's run of a tile in turn, and the tokens left over on their own (memory "bhsd"), or
    # walks the heads of a token together, as a [B, H, S, D] view of [B, S, H, D] memory lies
    # (what transformers' attention passes): the same bits as [B, S, H, D], whose heads share a
    # span. Partial rotary, per-batch positions and one head (the batch dim then holds the
    # rows that share a position) included.
    gen = torch.Generator().manual_seed(seq + heads)

    def randn(h):
        if memory == "bshd":
            x = torch.randn(2, seq, h, 64, generator=gen).transpose(1, 2)
        else:
            x = torch.randn(2, h, seq, 64, generator=gen)
        return x.to(device=device, dtype=dtype)

    q, k = randn(heads), randn(2)
    table = rope_ext.precompute_freqs_cis(rotary_dim, seq + 10, device=device)
    where = dict(offset=7)
    bshd = dict(offset=7)
    if with_positions:
        positions = torch.randint(0, seq + 3, (2, 1, seq), generator=gen).to(device)
        where, bshd = dict(positions=positions), dict(positions=positions.transpose(1, 2))
    expected = reference_of(q, table, seq_dim=2, interleaved=interleaved, **where)
    want = [y.transpose(1, 2) for y in rope_ext.apply_rotary_qk(
        q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), table,
        interleaved=interleaved, **bshd)]
    got = rope_ext.apply_rotary_qk(q, k, table, seq_dim=2, interleaved=interleaved,
                                   inplace=inplace, **where)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert_matches_reference(got[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ops_take_the_complex_table(device, dtype):
    # The ops read a complex table through its real view themselves (strided too); results,
    # in place and out, are those of the real view, bit for bit.
    x = torch.randn(2, 9, 3, 16, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 9, 1, 16, device=device, dtype=torch.bfloat16)
    table = rope_ext.precompute_freqs_cis(16, 40, device=device, dtype=dtype)[::2]
    real = torch.view_as_real(table)
    ops = torch.ops.rope_ext
    args = (None, 3, 1, False, False)
    torch.testing.assert_close(ops.apply_rotary(x, table, *args),
                               ops.apply_rotary(x, real, *args), rtol=0, atol=0)
    for got, want in zip(ops.apply_rotary_qk(x, k, table, *args),
                         ops.apply_rotary_qk(x, k, real, *args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    y = x.clone()
    ops.apply_rotary_(y, table, *args)
    torch.testing.assert_close(y, ops.apply_rotary(x, real, *args), rtol=0, atol=0)


@pytest.mark.parametrize("op, names, defaults", [
    (op, ("seq_dim", "interleaved", "inverse", "mrope_section", "mrope_interleaved"),
     rope_ext.api.ROTARY_TAIL_DEFAULTS)
    for op in ("apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_")
] + [
    (op, ("seq_dim", "interleaved", "eps", "weight_offset", "mrope_section",
          "mrope_interleaved"), rope_ext.qk_norm.NORM_TAIL_DEFAULTS)
    for op in ("rms_norm_rotary_qk", "rms_norm_rotary_qk_")
])
def test_wrappers_leave_off_only_schema_defaults(op, names, defaults):
    # The wrappers drop trailing arguments equal to these defaults; they must be the schema's.
    arguments = getattr(torch.ops.rope_ext, op).default._schema.arguments
    tail = arguments[[a.name for a in arguments].index("offset") + 1:]
    assert tuple(a.name for a in tail) == names
    assert tuple(a.default_value for a in tail) == defaults


@pytest.mark.parametrize("eager, public", [
    (reference.apply_rotary, rope_ext.apply_rotary),
    (reference.rms_norm_rotary, rope_ext.rms_norm_rotary_qk),
], ids=["apply_rotary", "rms_norm_rotary"])
def test_eager_path_defaults_are_the_public_functions(eager, public):
    # The eager path is the fallback and the tests' oracle: a keyword left out means there
    # what it means to a user.
    import inspect

    def defaults(fn):
        return {name: p.default for name, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty}

    eager_defaults, public_defaults = defaults(eager), defaults(public)
    assert eager_defaults and eager_defaults.keys() <= public_defaults.keys()
    assert eager_defaults == {name: public_defaults[name] for name in eager_defaults}


def test_eager_calls_reach_torch_function_modes(device):
    # The wrappers call the overloads' C++ entry points in eager mode; torch function modes
    # (and subclasses) still see the op, with every argument the wrapper passed.
    from torch.overrides import TorchFunctionMode

    class RecordFunctions(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, args))
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, 5, 4, 16, device=device)
    k = torch.randn(2, 5, 2, 16, device=device)
    table = rope_ext.precompute_freqs_cis(16, 32, device=device)
    expected = rope_ext.apply_rotary_qk(q, k, table, offset=3, interleaved=False)
    with RecordFunctions() as mode:
        got = rope_ext.apply_rotary_qk(q, k, table, offset=3, interleaved=False)
        rope_ext.apply_rotary(q, table, inplace=True)
    ops = [func for func, _ in mode.calls]
    assert torch.ops.rope_ext.apply_rotary_qk.default in ops
    assert torch.ops.rope_ext.apply_rotary_.default in ops
    call_args = dict(mode.calls)[torch.ops.rope_ext.apply_rotary_qk.default]
    assert call_args[3:] == (None, 3, 1, False)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_traced_calls_reach_the_ops():
    # Under torch.compile the wrappers call the ops, never the eager entries (C functions
    # Dynamo cannot trace): one graph, the eager call's bits. Dynamo alone (backend "eager")
    # keeps this quick; test_compile.py runs Inductor.
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, generator=gen), torch.randn(2, 5, 2, 16, generator=gen)
    table = rope_ext.precompute_freqs_cis(16, 8)
    weight = torch.rand(16, generator=gen) + 0.5
    calls = {
        "apply_rotary": lambda q, k: (rope_ext.apply_rotary(q, table, offset=2),),
        "apply_rotary_qk": lambda q, k: rope_ext.apply_rotary_qk(q, k, table, interleaved=False),
        "rms_norm_rotary_qk": lambda q, k: rope_ext.rms_norm_rotary_qk(q, k, weight, weight, table,
                                                                       weight_offset=1.0),
    }
    for name, call in calls.items():
        torch._dynamo.reset()
        traced = torch.compile(call, backend="eager", fullgraph=True)
        for got, want in zip(traced(q, k), call(q, k)):
            assert torch.equal(got, want), name


@pytest.fixture
def mesh_of_one():
    """A one-process gloo group and its 1-D CPU mesh: DTensors in this process
    (test_distributed.py spawns two ranks)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no torch.distributed/gloo")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_inputs_take_the_distributed_path(mesh_of_one):
    # The wrappers know DTensor q and k and give the ops the table and positions as
    # DTensors too: DTensors back, with the plain call's values.
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, generator=gen), torch.randn(2, 5, 2, 16, generator=gen)
    table = rope_ext.precompute_freqs_cis(16, 8)
    positions = torch.randint(0, 8, (2, 5, 1), generator=gen)
    weight = torch.rand(16, generator=gen) + 0.5
    dq, dk = (distribute_tensor(t, mesh_of_one, [Shard(0)]) for t in (q, k))
    calls = {
        "apply_rotary": lambda q, k: (rope_ext.apply_rotary(q, table, positions=positions),),
        "apply_rotary_qk": lambda q, k: rope_ext.apply_rotary_qk(q, k, table, offset=1),
        "rms_norm_rotary_qk": lambda q, k: rope_ext.rms_norm_rotary_qk(
            q, k, weight, weight, table, positions=positions),
    }
    for name, call in calls.items():
        for got, want in zip(call(dq, dk), call(q, k)):
            assert isinstance(got, DTensor), name
            assert torch.equal(got.full_tensor(), want), name
    with pytest.raises(ValueError, match="apply_rotary_qk: q and k must be DTensors on one "
                       "device mesh, got .* and a plain tensor"):
        rope_ext.apply_rotary_qk(dq, k, table)


_ENTRY_OPS = ("apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_",
              "rms_norm_rotary_qk", "rms_norm_rotary_qk_")


def _entry_args(op, device, **changes):
    """All of op's arguments in schema order, for its eager entry and for torch.ops."""
    q = torch.randn(2, 5, 4, 16, device=device)
    k = torch.randn(2, 5, 2, 16, device=device)
    table = torch.view_as_real(rope_ext.precompute_freqs_cis(16, 64, device=device))
    weight = torch.rand(16, device=device) + 0.5
    positions = torch.tensor([[[3], [1], [0], [7], [2]]], device=device)
    args = dict(positions=positions, offset=4, seq_dim=1, interleaved=False)
    if op.startswith("rms_norm"):
        args.update(eps=1e-5, weight_offset=1.0)
        head = dict(q=q, k=k, q_weight=weight, k_weight=weight.clone(), freqs_cis=table)
    else:
        args.update(inverse=True)
        head = dict(q=q, k=k, freqs_cis=table) if "_qk" in op else dict(x=q, freqs_cis=table)
    args.update(mrope_section=None, mrope_interleaved=False)
    args = {**head, **args, **changes}
    names = [a.name for a in getattr(torch.ops.rope_ext, op).default._schema.arguments]
    assert list(args) == names
    return list(args.values())


@pytest.mark.parametrize("op", _ENTRY_OPS)
def test_eager_entries_run_the_op(op, device):
    # rope_ext._C's entries (what the wrappers call in eager mode) give the op's bits, write
    # only where the in-place op writes, and return what it returns.
    args = _entry_args(op, device)
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    want = getattr(torch.ops.rope_ext, op).default(*expected)
    got = rope_ext._native.EAGER_ENTRIES[op](*args)
    outputs = 2 if "_qk" in op else 1
    if op.endswith("_"):
        assert got is None and want is None
        got, want = args[:outputs], expected[:outputs]
    elif outputs == 1:
        got, want = [got], [want]
    assert isinstance(got, (tuple, list)) and len(got) == len(want) == outputs
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)



def test_wrappers_fall_back_to_torch_ops_where_entries_decline(monkeypatch, device):
    # With every entry declining (a library built before the entries existed gets such
    # stand-ins), the wrappers call the ops through torch.ops and give the same bits.
    q = torch.randn(2, 5, 4, 16, device=device)
    k = torch.randn(2, 5, 2, 16, device=device)
    weight = torch.rand(16, device=device) + 0.5
    table = rope_ext.precompute_freqs_cis(16, 32, device=device)

    def calls():
        qi, ki = q.clone(), k.clone()
        rope_ext.rms_norm_rotary_qk(qi, ki, weight, weight, table, offset=2, inplace=True)
        return [*rope_ext.apply_rotary_qk(q, k, table, offset=3, interleaved=False),
                rope_ext.apply_rotary(q, table, positions=torch.arange(5, device=device)[:, None]),
                *rope_ext.rms_norm_rotary_qk(q, k, weight, weight, table, eps=1e-5), qi, ki]

    want = calls()
    for name in rope_ext._native.EAGER_ENTRIES:
        monkeypatch.setitem(rope_ext._native.EAGER_ENTRIES, name, rope_ext._native._declines)
    got = calls()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("op", ["apply_rotary_", "apply_rotary_qk", "rms_norm_rotary_qk_"])
@pytest.mark.parametrize("change", ["subclass", "bool offset", "tuple mrope_section",
                                    "int interleaved", "numpy scalar"])
def test_eager_entries_decline_what_torch_ops_must_handle(op, change, device):
    # Where torch's own path has work to do (a subclass's __torch_function__) or an argument
    # is not of the plain form, an entry runs nothing and returns NotImplemented; the wrapper
    # then calls the op through torch.ops.
    import numpy as np

    args = _entry_args(op, device)
    names = [a.name for a in getattr(torch.ops.rope_ext, op).default._schema.arguments]
    if change == "subclass":
        args[0] = args[0].as_subclass(_Subclass)
    elif change == "bool offset":
        args[names.index("offset")] = True
    elif change == "tuple mrope_section":
        args[names.index("mrope_section")] = (2, 3, 3)
    elif change == "int interleaved":
        args[names.index("interleaved")] = 0
    elif "eps" in names:
        args[names.index("eps")] = np.float64(1e-5)
    else:
        args[names.index("seq_dim")] = np.int64(1)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert rope_ext._native.EAGER_ENTRIES[op](*args) is NotImplemented
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eager_entries_raise_what_torch_ops_raises(device):
    # Same exception type and message, and the in-place op leaves q and k as they were.
    args = _entry_args("apply_rotary_qk_", device)
    args[1] = args[1][..., :8]  # k's head_dim differs from q's
    before = [a.clone() for a in args[:2]]
    with pytest.raises(Exception) as via_ops:
        torch.ops.rope_ext.apply_rotary_qk_.default(*args)
    with pytest.raises(Exception) as via_entry:
        rope_ext._native.EAGER_ENTRIES["apply_rotary_qk_"](*args)
    assert type(via_entry.value) is type(via_ops.value)
    assert str(via_entry.value) == str(via_ops.value)
    for a, b in zip(args[:2], before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(TypeError, match="takes 10 arguments, got 2"):
        rope_ext._native.EAGER_ENTRIES["apply_rotary_qk_"](*args[:2])


def test_eager_entries_reach_dispatch_modes_and_the_profiler(device):
    # The entries call the dispatcher, so a TorchDispatchMode and the profiler see the op.
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordDispatches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, 5, 4, 16, device=device)
    table = rope_ext.precompute_freqs_cis(16, 32, device=device)
    with RecordDispatches() as mode:
        rope_ext.apply_rotary_qk(q, q.clone(), table, inplace=True)
    assert torch.ops.rope_ext.apply_rotary_qk_.default in mode.funcs
    with torch.profiler.profile() as prof:
        rope_ext.apply_rotary(q, table)
    assert "rope_ext::apply_rotary" in {e.name for e in prof.events()}


def test_inverse_undoes_rotation(device):
    x = torch.randn(3, 20, 4, 64, device=device)
    table = rope_ext.precompute_freqs_cis(64, 20, device=device)
    for interleaved in (True, False):
        y = rope_ext.apply_rotary(x, table, interleaved=interleaved)
        back = rope_ext.apply_rotary(y, table, interleaved=interleaved, inverse=True)
        torch.testing.assert_close(back, x, atol=2e-6, rtol=2e-6)


def test_llama_drop_in(device):
    """Same results as the seed's LLaMA code, with its own table, for 4-D and 3-D x."""
    table = reference.llama_precompute_freqs_cis(64, 128).to(device)
    for shape in [(2, 128, 4, 64), (2, 128, 64)]:
        xq = torch.randn(*shape, device=device)
        xk = torch.randn(*shape, device=device)
        want = reference.llama_apply_rotary_emb(xq, xk, table)
        got = rope_ext.apply_rotary_emb(xq, xk, table)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)
    # freqs_cis may hold more rows than the sequence (LLaMA keeps max_seq_len * 2).
    xq = torch.randn(1, 16, 2, 64, device=device)
    got = rope_ext.apply_rotary_emb(xq, xq, table)[0]
    torch.testing.assert_close(got, reference.llama_apply_rotary_emb(xq, xq, table[:16])[0],
                               atol=2e-6, rtol=2e-6)


def test_hf_rotate_half_equivalence(device):
    table = rope_ext.precompute_freqs_cis(64, 40, device=device)
    angles = torch.view_as_real(table)
    cos = torch.cat([angles[..., 0], angles[..., 0]], -1)  # [P, D]
    sin = torch.cat([angles[..., 1], angles[..., 1]], -1)
    q = torch.randn(2, 4, 32, 64, device=device)
    k = torch.randn(2, 2, 32, 64, device=device)
    want = reference.hf_apply_rotary_pos_emb(q, k, cos[None, :32], sin[None, :32])
    got = rope_ext.apply_rotary_qk(q, k, table, seq_dim=2, interleaved=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)
    # position_ids [B, S] of their own per sequence: cos and sin [B, S, D]
    position_ids = torch.arange(32, device=device) + torch.tensor([[0], [7]], device=device)
    want = reference.hf_apply_rotary_pos_emb(q, k, cos[position_ids], sin[position_ids])
    got = rope_ext.apply_rotary_qk(q, k, table, positions=position_ids[:, None],
                                   interleaved=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)


def test_positions_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    want = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0], dtype=torch.int32).unsqueeze(-1)
    assert torch.equal(rope_ext.positions_from_cu_seqlens(cu), want)
    assert torch.equal(rope_ext.positions_from_cu_seqlens(cu.long(), total_tokens=9), want.long())
    q = torch.randn(9, 4, 32)
    table = rope_ext.precompute_freqs_cis(32, 16)
    got = rope_ext.apply_rotary(q, table, positions=rope_ext.positions_from_cu_seqlens(cu),
                                seq_dim=0)
    # Each sequence rotated as if alone.
    for start, end in [(0, 3), (3, 8), (8, 9)]:
        alone = rope_ext.apply_rotary(q[start:end], table, seq_dim=0)
        torch.testing.assert_close(got[start:end], alone)
    assert rope_ext.positions_from_cu_seqlens(torch.tensor([0])).shape == (0, 1)  # no sequence
    for bad in (torch.tensor([], dtype=torch.long), cu.view(1, 5)):
        with pytest.raises(ValueError, match=re.escape(
                "positions_from_cu_seqlens: cu_seqlens must be 1-D with at least one entry, "
                f"got shape {list(bad.shape)}")):
            rope_ext.positions_from_cu_seqlens(bad)


def test_relative_position_property(device):
    """<rope(q)_m, rope(k)_n> depends only on m - n."""
    table = rope_ext.precompute_freqs_cis(64, 64, device=device, dtype=torch.float64)
    q = torch.randn(64, device=device, dtype=torch.float64)
    k = torch.randn(64, device=device, dtype=torch.float64)
    xs = torch.stack([q, k]).expand(64, 2, 64).transpose(0, 1).contiguous()  # [2, S, D]
    rq, rk = rope_ext.apply_rotary(xs, table, seq_dim=1).unbind(0)
    for m, n in [(10, 3), (40, 33), (63, 56)]:
        torch.testing.assert_close(rq[m] @ rk[n], rq[m - n] @ rk[0])


def test_empty_inputs_are_a_no_op(device):
    table = rope_ext.precompute_freqs_cis(16, 8, device=device)
    x = torch.empty(0, 4, 2, 16, device=device)
    out = rope_ext.apply_rotary(x, table)
    assert out.shape == x.shape and out is not x
    assert rope_ext.apply_rotary(x, table, inplace=True) is x
    q = torch.randn(2, 4, 2, 16, device=device)
    k = torch.empty(2, 4, 0, 16, device=device)
    got_q, got_k = rope_ext.apply_rotary_qk(q, k, table)
    assert_matches_reference(got_q, reference_of(q, table))
    assert got_k.shape == k.shape


def test_output_strides_match_fake(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = torch.view_as_real(rope_ext.precompute_freqs_cis(32, 16, device=device))
    for x in [torch.randn(2, 16, 3, 32, device=device),
              torch.randn(2, 3, 16, 32, device=device).transpose(1, 2),
              torch.randn(2, 16, 96, device=device)[..., 32:64].unflatten(-1, (1, 32))]:
        real = torch.ops.rope_ext.apply_rotary(x, table)
        with FakeTensorMode() as mode:
            fake = torch.ops.rope_ext.apply_rotary(mode.from_tensor(x), mode.from_tensor(table))
        assert fake.stride() == real.stride() and fake.shape == real.shape
