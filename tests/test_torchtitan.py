"""rope_ext.torchtitan against torchtitan's own RoPE modules: the Llama 3 debug model with the
override applied through torchtitan's override mechanism, and each module on its own
(positions None, [1, S], [B, S]; scalings; gradients; DTensor q and k on 2 processes).

torchtitan is optional: CI installs it (0.3) for these tests; without it they are skipped."""

import copy

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE  # noqa: E402

import rope_ext.torchtitan as tt  # noqa: E402

from test_distributed import run  # noqa: E402

OVERRIDES = {ComplexRoPE: "rope_ext.torchtitan.rope_ext_complex_rope",
             CosSinRoPE: "rope_ext.torchtitan.rope_ext_cos_sin_rope"}
REPLACEMENT = {ComplexRoPE: tt.RopeExtComplexRoPE, CosSinRoPE: tt.RopeExtCosSinRoPE}
CONFIGS = [
    (ComplexRoPE, dict(dim=64, max_seq_len=256, theta=500000.0, scaling="llama",
                       original_max_position_embeddings=32)),
    (ComplexRoPE, dict(dim=64, max_seq_len=256, scaling="yarn", rope_factor=4.0,
                       original_seq_len=64)),
    (CosSinRoPE, dict(dim=64, max_seq_len=256, theta=1e6)),
    (CosSinRoPE, dict(dim=64, max_seq_len=256, scaling="yarn", rope_factor=4.0,
                      original_seq_len=64, truncate=False)),
]


def modules(cls, kwargs):
    """The stock module and the rope_ext one, built by the override factory from the same
    config (the whole-model test below goes through apply_overrides)."""
    stock = cls.Config(**kwargs).build()
    factory = {ComplexRoPE: tt.rope_ext_complex_rope, CosSinRoPE: tt.rope_ext_cos_sin_rope}[cls]
    ours = factory(cls.Config(**kwargs)).build()
    assert type(ours) is REPLACEMENT[cls]
    assert torch.equal(ours.cache, stock.cache)  # the stock cache, so checkpoints carry over
    return stock, ours


def qk_positions(kind, dtype, gen, batch=2, seq=24):
    q = torch.randn(batch, seq, 4, 64, generator=gen).to(dtype)
    k = torch.randn(batch, seq, 2, 64, generator=gen).to(dtype)
    positions = {"none": None,
                 "shared": torch.randint(0, 256, (1, seq), generator=gen),
                 "per_batch": torch.randint(0, 256, (batch, seq), generator=gen)}[kind]
    return q, k, positions


@pytest.mark.parametrize("positions_kind", ["none", "shared", "per_batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CONFIGS, ids=lambda c: f"{c[0].__name__}-{c[1].get('scaling', 'none')}")
def test_module_matches_stock(case, dtype, positions_kind):
    stock, ours = modules(*case)
    gen = torch.Generator().manual_seed(0)
    q, k, positions = qk_positions(positions_kind, dtype, gen)
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    got = ours(*leaves, positions)
    want = stock(q.requires_grad_(), k.requires_grad_(), positions)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=8e-3)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **tol)
    grads = torch.autograd.grad(sum(g.float().square().sum() for g in got), leaves)
    want_grads = torch.autograd.grad(sum(w.float().square().sum() for w in want), (q, k))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **(tol if dtype == torch.float32 else
                                            dict(atol=1e-1, rtol=5e-2)))


def test_positions_past_the_cache_are_refused():
    stock, ours = modules(*CONFIGS[2])
    q, k, _ = qk_positions("none", torch.float32, torch.Generator().manual_seed(0))
    positions = torch.full((1, q.shape[1]), 256)
    with pytest.raises(RuntimeError):  # torchtitan's own asynchronous bounds check
        ours(q, k, positions)


def test_llama3_debugmodel_logits():
    stock, _ = llama3_debugmodel(None)
    ours, lines = llama3_debugmodel(OVERRIDES[ComplexRoPE])
    assert len(lines) == 6 and all("RopeExtComplexRoPE" in line for line in lines)
    ours.load_state_dict(stock.state_dict())
    assert all(type(layer.attention.rope) is tt.RopeExtComplexRoPE for layer in ours.layers.values())
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    for positions in (torch.arange(64).expand(2, 64), None):
        masks = stock.get_attention_masks(torch.arange(64).expand(2, 64))
        with torch.no_grad():
            want = stock(tokens, positions, masks)
            got = ours(tokens, positions, masks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def llama3_debugmodel(override: str | None, sequence_parallel: bool = False):
    """torchtitan's Llama 3 debug model as its trainer configures it (sharding declarations,
    then the override), built on the CPU with seed 0."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = copy.deepcopy(model_registry("debugmodel", attn_backend="flex").model)
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    lines = apply_overrides(OverrideConfig(imports=[override]), config) if override else []
    torch.manual_seed(0)
    return config.build(), lines


def scenario_llama3_tensor_parallel(mesh):
    """The debug model with the override under torchtitan's tensor parallelism (TP=2; q and k
    reach the RoPE module as DTensors sharded on heads), with and without sequence
    parallelism, against the stock model in one process."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (torchtitan's size-1 dims)
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims

    parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" on a machine without a GPU
    stock, _ = llama3_debugmodel(None)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(64).expand(2, 64)
    masks = stock.get_attention_masks(positions)
    with torch.no_grad():
        want = stock(tokens, positions, masks)
    seen = []
    for sequence_parallel in (False, True):
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=mesh.size(), pp=1, ep=1,
                            world_size=mesh.size(), spmd_backend="partial_dtensor")
        dims.build_mesh()
        ours, _ = llama3_debugmodel(OVERRIDES[ComplexRoPE], sequence_parallel)
        ours.load_state_dict(stock.state_dict())
        ours.parallelize(dims)
        rope = ours.layers["0"].attention.rope
        rope.register_forward_pre_hook(lambda _, args: seen.append(type(args[0]).__name__))
        with torch.no_grad():
            got = ours(tokens, positions, masks)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert seen == ["DTensor", "DTensor"]


def test_llama3_debugmodel_tensor_parallel():
    run("scenario_llama3_tensor_parallel", module=__name__, timeout=240.0)


def scenario_torchtitan_dtensor(mesh):
    """The override modules on DTensor q, k (tensor parallel: heads sharded, as with
    use_local_output=False; context parallel: sequence sharded, positions sharded alike),
    against the stock modules on the full tensors; gradients included."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for cls, kwargs in CONFIGS:
        stock, ours = modules(cls, kwargs)
        gen = torch.Generator().manual_seed(0)
        q, k, positions = qk_positions("per_batch", torch.float32, gen, seq=8)
        want = stock(q, k, positions)
        # This rank's rows of the positions, as torchtitan's context parallel hands them over.
        local = positions.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]
        for placements, pos in (([Shard(2)], positions), ([Shard(1)], None), ([Shard(0)], None),
                                ([Shard(1)], distribute_tensor(positions, mesh, [Shard(1)])),
                                ([Shard(1)], local)):
            leaves = [distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k)]
            got = ours(*leaves, pos)
            for g, w in zip(got, want if pos is not None else stock(q, k, None)):
                assert list(g.placements) == placements
                torch.testing.assert_close(g.full_tensor(), w, atol=2e-6, rtol=2e-6)
            sum(g.square().sum() for g in got).backward()
            ref = [t.clone().requires_grad_() for t in (q, k)]
            sum(w.square().sum() for w in stock(*ref, None if pos is None else positions)
                ).backward()
            for leaf, r in zip(leaves, ref):
                torch.testing.assert_close(leaf.grad.full_tensor(), r.grad, atol=2e-5, rtol=2e-5)


def test_override_modules_on_dtensors():
    run("scenario_torchtitan_dtensor", module=__name__)
