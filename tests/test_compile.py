"""torch.compile (no graph breaks, no recompiles) and torch.library.opcheck of every op."""

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext


def opcheck_samples(device):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_(grad)

    table = torch.view_as_real(rope_ext.precompute_freqs_cis(16, 12, device=device)).clone()
    table_grad = table.clone().requires_grad_()
    pos = torch.randint(0, 12, (2, 4, 1), generator=gen).to(device)
    qkv = randn(2, 4, 80)
    samples = [
        (randn(2, 4, 3, 16), table, None, 0, 1, True, False),
        (randn(2, 4, 3, 16, grad=True), table_grad, pos, 0, 1, False, False),
        (randn(2, 3, 4, 20).transpose(1, 2), table, None, 2, 1, True, True),  # non-contiguous
        (qkv[..., 16:48].view(2, 4, 2, 16), table, pos, 1, 1, False, False),  # fused qkv view
        (randn(2, 3, 4, 16, grad=True), table, pos.view(2, 1, 4), 0, 2, True, False),  # HF
        # positions and an offset, the table's gradient: row s reads offset + positions[s]
        (randn(2, 4, 3, 16, grad=True), table_grad, pos // 2, 5, 1, True, True),
    ]
    qk_samples = [
        (randn(2, 4, 4, 16), randn(2, 4, 2, 16), table, pos, 0, 1, True, False),  # GQA
        (randn(2, 4, 4, 20, grad=True), randn(2, 4, 1, 20, grad=True), table_grad, None, 3, 1,
         False, True),
        (qkv[..., :32].view(2, 4, 2, 16), qkv[..., 32:48].view(2, 4, 1, 16), table, pos, 0, 1,
         True, False),
        # packed [T, H, D] with per-token positions: seq_dim plays no part, leading dims differ
        (randn(7, 4, 16, grad=True), randn(7, 2, 16), table,
         torch.randint(0, 12, (7, 1), generator=gen).to(device), 0, 1, False, False),
    ]
    return samples, qk_samples


def test_opcheck_every_op(device):
    samples, qk_samples = opcheck_samples(device)
    for args in samples:
        torch.library.opcheck(OPS.apply_rotary.default, args)
        inplace_args = (args[0].detach().clone(), args[1].detach()) + args[2:]
        torch.library.opcheck(OPS.apply_rotary_.default, inplace_args)
    for args in qk_samples:
        torch.library.opcheck(OPS.apply_rotary_qk.default, args)
        q, k = args[0].detach().clone(), args[1].detach().clone()
        torch.library.opcheck(OPS.apply_rotary_qk_.default, (q, k, args[2].detach()) + args[3:])
    torch.library.opcheck(OPS.precompute_freqs_cis.default, (32, 10), dict(device=device))
    inv_freq = torch.rand(8, dtype=torch.float64, device=device)
    torch.library.opcheck(OPS.fill_freqs_cis_.default, (torch.empty(5, 8, 2, device=device), inv_freq, 1.5))
    torch.library.opcheck(OPS.precompute_freqs_cis.default, (32, 10, 500.0), dict(
        device=device, rope_type="yarn", factor=4.0, original_max_position_embeddings=4))


class Attention(torch.nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2, max_seq=64, inplace=False, rope=True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", rope_ext.precompute_freqs_cis(self.head_dim, max_seq))
        self.inplace, self.rope = inplace, rope

    def forward(self, x):
        b, s, _ = x.shape
        hd = self.head_dim
        qkv = self.wqkv(x)
        q = qkv[..., : self.heads * hd].view(b, s, self.heads, hd)
        k = qkv[..., self.heads * hd:(self.heads + self.kv_heads) * hd].view(b, s, self.kv_heads, hd)
        v = qkv[..., (self.heads + self.kv_heads) * hd:].view(b, s, self.kv_heads, hd)
        if self.rope:
            q, k = rope_ext.apply_rotary_qk(q, k, self.freqs_cis, inplace=self.inplace)
        else:
            q = reference.apply_rotary(q, self.freqs_cis)
            k = reference.apply_rotary(k, self.freqs_cis)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("inplace", [False, True])
def test_compiled_attention_forward_backward(device, inplace):
    torch.manual_seed(0)
    model = Attention(inplace=inplace).to(device)
    eager = Attention(rope=False).to(device)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 24, 64, device=device)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    want = eager(x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.wqkv.weight.grad, eager.wqkv.weight.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("inplace", [False, True])
def test_dynamic_sequence_length_does_not_recompile(device, inplace):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    table = rope_ext.precompute_freqs_cis(32, 128, device=device)

    def f(q, k, offset):
        q, k = q * 2, k * 2
        return rope_ext.apply_rotary_qk(q, k, table, offset=offset, inplace=inplace)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for seq, offset in [(12, 0), (24, 5), (40, 9)]:  # 16 would duck-size with R/2
        q = torch.randn(2, seq, 4, 32, device=device)
        k = torch.randn(2, seq, 2, 32, device=device)
        got = compiled(q, k, offset)
        want = rope_ext.apply_rotary_qk(q * 2, k * 2, table, offset=offset)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert counter.frame_count == 1


def test_compile_precompute_and_functional(device):
    @torch.compile(fullgraph=True)
    def f(x):
        table = rope_ext.precompute_freqs_cis(16, 8, device=x.device)
        return rope_ext.apply_rotary(x, table, interleaved=False)

    x = torch.randn(1, 8, 2, 16, device=device)
    torch.testing.assert_close(f(x), rope_ext.apply_rotary(x, rope_ext.precompute_freqs_cis(
        16, 8, device=device), interleaved=False))


def test_export_saves_and_reloads(device, tmp_path):
    """torch.export records the calls as torch.ops.rope_ext nodes, with a dynamic sequence
    length; the saved program reloads and rotates as eager does at another length."""

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.view_as_real(rope_ext.precompute_freqs_cis(32, 64)))

        def forward(self, q, k):
            return rope_ext.apply_rotary_qk(q, k, self.table, interleaved=False)

    model = Rope().to(device)
    q, k = torch.randn(2, 12, 4, 32, device=device), torch.randn(2, 12, 2, 32, device=device)
    seq = torch.export.Dim("seq", max=64)
    program = torch.export.export(model, (q, k), dynamic_shapes=({1: seq}, {1: seq}))
    assert any(str(node.target).startswith("rope_ext.") for node in program.graph.nodes)
    torch.export.save(program, tmp_path / "rope.pt2")
    loaded = torch.export.load(tmp_path / "rope.pt2").module()
    q, k = torch.randn(2, 20, 4, 32, device=device), torch.randn(2, 20, 2, 32, device=device)
    for got, want in zip(loaded(q, k), model(q, k)):
        assert torch.equal(got, want)
