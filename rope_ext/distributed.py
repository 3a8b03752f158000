"""rope_ext on DTensors (tensor, context and data parallel training).

Sharding rules for every rotary op let DTensor q and k run the native kernel on their local
shards with no communication (the fused RMSNorm + RoPE ops too, but never on Partial inputs,
the norm not being linear; their weights replicated, the weights' gradients Partial over
sharded rows):

- Shard on any leading dim of x other than the sequence dim (batch, heads), and Replicate:
  the outputs are placed as the inputs. With positions, the sequence dim may be sharded too,
  positions sharded alike (a shard's rows then carry their global positions).
- Partial(sum) inputs stay Partial: the rotation is linear.
- The table is replicated; DTensor gathers a sharded one.
- A sequence-sharded x without positions, or an x sharded on head_dim, matches no rule, so
  DTensor gathers it first (the out-of-place ops) or refuses (the in-place ops): no shard is
  ever rotated as if it started at position 0.

The Python API (rope_ext.apply_rotary, apply_rotary_qk, apply_rotary_emb) goes further: it
turns a sequence-sharded x without positions into positions sharded like x (each rank's from
its shard's global offset, uneven shards included), wraps a plain-tensor table as Replicate
and plain-tensor positions as this rank's own, placed like x (torchtitan passes them so),
and rejects a
head_dim-sharded x or mismatched meshes with an error naming the placements.

The rules are registered when rope_ext is imported after torch.distributed.tensor, and the
first time the API sees a DTensor; `import rope_ext.distributed` registers them for raw
torch.ops.rope_ext calls on DTensors (importing DTensor costs ~0.4 s, which a plain
`import rope_ext` does not pay).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

OPS = torch.ops.rope_ext


def _positions_placement(x_ndim: int, positions_shape, d: int, skip: int = 0):
    """The placement positions need when x is sharded on its dim d: sharded on the dim that
    lines up with d (from the right, as they broadcast), replicated where they broadcast
    along it. skip: leading dims that do not broadcast (MRoPE's axis dim: 1)."""
    pd = d - (x_ndim - 1 - (len(positions_shape) - skip))
    return Shard(pd + skip) if pd >= 0 and positions_shape[pd + skip] != 1 else Replicate()


def _strategies(xs, positions, seq_dim, skip=0):
    """(output placements, input placements of the tensors xs, table, positions) for one mesh
    dim: all replicated, all partial, or every x sharded on a leading dim its rows share."""
    ndim = len(xs[0].shape)
    pos_replicated = None if positions is None else Replicate()
    out = [([Replicate()] * len(xs), [Replicate()] * len(xs) + [Replicate(), pos_replicated]),
           ([Partial()] * len(xs), [Partial()] * len(xs) + [Replicate(), pos_replicated])]
    sd = seq_dim + ndim if seq_dim < 0 else seq_dim
    for d in range(ndim - 1):
        if positions is None and d == sd:  # the rows' positions would be shard-local
            continue
        dims = [d - (ndim - len(x.shape)) for x in xs]  # the same dim of each, from the right
        if not all(0 <= e < len(x.shape) - 1 for e, x in zip(dims, xs)):
            continue
        placements = [Shard(e) for e in dims]
        pos = None if positions is None else _positions_placement(ndim, positions.shape, d,
                                                                  skip)
        out.append((placements, placements + [Replicate(), pos]))
    return out


def _outputs(strategies, inplace):
    # The in-place ops return nothing; the six non-tensor arguments take no placement.
    return [([] if inplace else outputs, inputs + [None] * 6) for outputs, inputs in strategies]


def _rule(inplace: bool):
    def rule(x, freqs_cis, positions=None, offset=0, seq_dim=1, interleaved=True,
             inverse=False, mrope_section=None, mrope_interleaved=False):
        skip = 0 if mrope_section is None else 1
        return _outputs(_strategies([x], positions, seq_dim, skip), inplace)
    return rule


def _qk_rule(inplace: bool):
    def rule(q, k, freqs_cis, positions=None, offset=0, seq_dim=1, interleaved=True,
             inverse=False, mrope_section=None, mrope_interleaved=False):
        skip = 0 if mrope_section is None else 1
        return _outputs(_strategies([q, k], positions, seq_dim, skip), inplace)
    return rule


def _propagates_ops_returning_nothing() -> bool:
    """Whether this torch's DTensor can run ops that return nothing, as the in-place rotary
    ops do (torch 2.9 indexes the first return type of every op)."""
    from torch.distributed.tensor._op_schema import OpSchema

    try:
        OpSchema(OPS.apply_rotary_.default, (), {}).return_type_tensor()
    except IndexError:
        return False
    return True


INPLACE_SUPPORTED = _propagates_ops_returning_nothing()

def _norm_strategies(q, k, positions, seq_dim, mrope_section):
    """The fused RMSNorm + RoPE ops': the rotary ops' strategies but Partial (the norm is not
    linear), with the weights replicated (inputs q, k, q_weight, k_weight, table, positions)."""
    skip = 0 if mrope_section is None else 1
    return [(outputs, inputs[:2] + [Replicate(), Replicate()] + inputs[2:])
            for outputs, inputs in _strategies([q, k], positions, seq_dim, skip)
            if not isinstance(outputs[0], Partial)]


def _norm_rule(inplace: bool):
    def rule(q, k, q_weight, k_weight, freqs_cis, positions=None, offset=0, seq_dim=1,
             interleaved=True, eps=1e-6, weight_offset=0.0, mrope_section=None,
             mrope_interleaved=False):
        # The seven non-tensor arguments take no placement.
        return [([] if inplace else outputs, inputs + [None] * 7)
                for outputs, inputs in _norm_strategies(q, k, positions, seq_dim, mrope_section)]
    return rule


def _norm_backward_rule(grad_q, grad_k, q, k, q_weight, k_weight, freqs_cis, positions=None,
                        offset=0, seq_dim=1, interleaved=True, eps=1e-6, weight_offset=0.0,
                        mrope_section=None, mrope_interleaved=False):
    """The gradients placed as q and k; the weights' gradients sum each rank's rows: Partial
    where the rows are sharded, Replicate where every rank holds them all."""
    out = []
    for outputs, inputs in _norm_strategies(q, k, positions, seq_dim, mrope_section):
        weight_grad = Replicate() if isinstance(outputs[0], Replicate) else Partial()
        out.append((outputs + [weight_grad, weight_grad], inputs[:2] + inputs + [None] * 7))
    return out


register_sharding(OPS.apply_rotary.default)(_rule(inplace=False))
register_sharding(OPS.apply_rotary_.default)(_rule(inplace=True))
register_sharding(OPS.apply_rotary_qk.default)(_qk_rule(inplace=False))
register_sharding(OPS.apply_rotary_qk_.default)(_qk_rule(inplace=True))
register_sharding(OPS.rms_norm_rotary_qk.default)(_norm_rule(inplace=False))
register_sharding(OPS.rms_norm_rotary_qk_.default)(_norm_rule(inplace=True))
register_sharding(OPS.rms_norm_rotary_qk_backward.default)(_norm_backward_rule)


# ----------------------------------------------------------------------------- the Python API

def _wrap(t: torch.Tensor, mesh, placements) -> DTensor:
    """A plain global tensor as a DTensor with these placements, each rank keeping its own
    slice: no communication (every rank holds the whole tensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t
    sizes, starts = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    for dim, (size, start) in enumerate(zip(sizes, starts)):
        if size != t.shape[dim]:
            local = local.narrow(dim, start, size)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def _follow(x: DTensor, positions_shape, skip: int = 0) -> list:
    """Placements for positions (broadcasting to x.shape[:-1]) that match x's."""
    return [_positions_placement(x.dim(), positions_shape, p.dim, skip) if isinstance(p, Shard)
            else Replicate() for p in x.placements]


def prepare(op: str, xs: list[DTensor], table, positions, offset, seq_dim,
            mrope_section=None):
    """The table and positions for a call on DTensors xs, as the sharding rules take them."""
    if op.endswith("_") and not INPLACE_SUPPORTED:
        raise NotImplementedError(
            f"{op}: in-place calls on DTensors need a newer torch (this torch "
            f"{torch.__version__}'s DTensor cannot run ops that return nothing); use "
            "inplace=False")
    mesh = xs[0].device_mesh
    ndim = xs[0].dim()
    for name, x in zip(("q", "k") if len(xs) == 2 else ("x",), xs):
        if not isinstance(x, DTensor) or x.device_mesh != mesh:
            raise ValueError(f"{op}: q and k must be DTensors on one device mesh, got "
                             f"{getattr(xs[0], 'device_mesh', None)} and "
                             f"{getattr(x, 'device_mesh', 'a plain tensor')}")
        for p in x.placements:
            if isinstance(p, Shard) and p.dim % x.dim() == x.dim() - 1:
                raise ValueError(f"{op}: {name} is sharded on its last dim (head_dim) by "
                                 f"{x.placements}; rotary pairs need whole rows: redistribute "
                                 "it over a leading dim first")
    if not isinstance(table, DTensor):
        table = DTensor.from_local(table, mesh, [Replicate()] * mesh.ndim, run_check=False)
    elif table.device_mesh != mesh:
        raise ValueError(f"{op}: freqs_cis is on device mesh {table.device_mesh} but the "
                         f"inputs on {mesh}")
    sd = seq_dim + ndim if seq_dim < 0 else seq_dim
    skip = 0 if mrope_section is None else 1  # MRoPE positions: [A, *b]
    if positions is None and any(isinstance(p, Shard) and p.dim % ndim == sd
                                 for x in xs for p in x.placements):
        # Context parallel: each rank's rows get their global positions.
        seq = xs[0].shape[sd]
        positions = torch.arange(seq, device=xs[0].to_local().device).view(
            seq, *[1] * (ndim - 2 - sd))
        positions = _wrap(positions, mesh, _follow(xs[0], positions.shape))
    elif positions is not None and not isinstance(positions, DTensor):
        # This rank's positions, placed like x (torchtitan's _maybe_wrap_positions). Their
        # global size along a sharded dim is x's: from_local alone would assume even shards.
        from torch.distributed.tensor._utils import compute_global_tensor_info

        placements = _follow(xs[0], positions.shape, skip)
        shape = list(positions.shape)
        for px, pp in zip(xs[0].placements, placements):
            if isinstance(pp, Shard):
                shape[pp.dim] = xs[0].shape[px.dim]
        _, stride = compute_global_tensor_info(positions, mesh, placements)
        positions = DTensor.from_local(positions, mesh, placements, run_check=False,
                                       shape=torch.Size(shape), stride=tuple(stride))
    elif positions is not None:
        if positions.device_mesh != mesh:
            raise ValueError(f"{op}: positions are on device mesh {positions.device_mesh} "
                             f"but the inputs on {mesh}")
        want = _follow(xs[0], positions.shape, skip)
        if list(positions.placements) != want:
            raise ValueError(f"{op}: positions are placed {tuple(positions.placements)} but "
                             f"{'q' if len(xs) == 2 else 'x'} {tuple(xs[0].placements)} needs "
                             f"them {tuple(want)}")
    return table, positions


def replicate(t: torch.Tensor, mesh) -> DTensor:
    """t as a DTensor on mesh: a plain tensor (every rank's whole copy) replicated."""
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def table_grad(local_fn, grad, x, freqs_cis, positions, offset, seq_dim, interleaved, inverse,
               mrope_section, mrope_interleaved):
    """rotary_table_grad on DTensors: each rank sums the contributions of its own rows, and
    the table's gradient is their sum over the ranks that hold different rows or parts of a
    partial x (Partial), replicated where every rank holds the same rows."""
    mesh = x.device_mesh
    grad_placements, out = [], []
    for px, pg in zip(x.placements, grad.placements):
        if isinstance(px, Shard):
            grad_placements.append(px)
            out.append(Partial())
        elif isinstance(px, Partial):  # sum_r g * x_r: g whole on every rank
            grad_placements.append(Replicate())
            out.append(Partial())
        else:
            grad_placements.append(pg if isinstance(pg, Partial) else Replicate())
            out.append(Partial() if isinstance(pg, Partial) else Replicate())
    grad = grad.redistribute(mesh, grad_placements)
    table = freqs_cis.full_tensor() if isinstance(freqs_cis, DTensor) else freqs_cis
    local = local_fn(grad.to_local(), x.to_local(), table,
                     None if positions is None else positions.to_local(), offset, seq_dim,
                     interleaved, inverse, mrope_section, mrope_interleaved)
    result = DTensor.from_local(local, mesh, out, run_check=False)
    if isinstance(freqs_cis, DTensor):  # the gradient placed as its table
        return result.redistribute(mesh, freqs_cis.placements)
    return result
