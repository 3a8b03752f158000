"""Timing of RoPE providers against the copy bound, shared by `python -m rope_ext` and
benchmarks/bench_rope.py.

Every provider rotates q and k of one case; its bytes are what q and k must move (read once,
written once), so GB/s compares directly with copying the same bytes, measured in the same
run: `copy_` into preallocated buffers (the bound for in-place calls) and `clone` (a fresh
allocation, the bound for out-of-place calls).

On CUDA, third-party kernels join the plain cases (third_party): FlashInfer, Liger, flash-attn's
Triton rotary and vLLM, each imported where it loads (load_peers lists the others with the
reason) and checked once against the float64 reference before it is timed (check_peer).

QK-norm cases (Case.qk_norm) time rope_ext.rms_norm_rotary_qk, per-head RMSNorm then RoPE, against
RoPE alone and the unfused compositions (F.rms_norm + rope_ext, Hugging Face's Qwen3 eager and
compiled), forward and forward+backward, and markdown_table adds the ratios the issue's targets
are stated in (QK_NORM_TARGETS). Their bytes are the same q and k read and written once; a
fwd+bwd row's GB/s counts only those forward bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from . import _native, api, reference
from .qk_norm import rms_norm_rotary_qk


# /proc/cpuinfo flag -> the widest vector ISA it names, widest first.
_ISAS = (("avx512_bf16", "AVX-512 with BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_info() -> dict[str, str | int]:
    """The first processor of /proc/cpuinfo: vendor, model name, family and model numbers
    ("unknown" where the file or the field is missing) and its widest vector ISA."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:  # a blank line ends the first processor
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())

    def number(key: str) -> int | str:
        value = fields.get(key, "")
        return int(value) if value.isdigit() else "unknown"

    return dict(vendor=fields.get("vendor_id", "unknown"),
                model_name=fields.get("model name") or platform.processor() or platform.machine(),
                family=number("cpu family"), model=number("model"),
                isa=next((name for flag, name in _ISAS if flag in flags), "no AVX2"))


def _streaming_stores() -> str:
    return os.environ.get("ROPE_EXT_STREAMING_STORES", "auto") or "auto"


def cpu_description() -> str:
    """The processor's model name and widest vector ISA, the rope_ext CPU kernel that ran (said
    to be forced when ROPE_EXT_CPU_KERNEL chose it) and ROPE_EXT_STREAMING_STORES' mode: every
    CPU table names them."""
    cpu = cpu_info()
    kernel = _native.build_info().get("cpu_kernel", "none")
    forced = " (forced by ROPE_EXT_CPU_KERNEL)" if os.environ.get("ROPE_EXT_CPU_KERNEL") else ""
    return (f"{cpu['model_name']} ({cpu['isa']}), CPU kernel {kernel}{forced}, "
            f"streaming stores {_streaming_stores()}")


# Results directories (benchmarks/results/<platform>/) of the machines this project has
# measured, by /proc/cpuinfo's (vendor, family, model); platform_name names any other by its
# numbers. The Sapphire Rapids-class Xeon's KVM guest reports model 167.
PLATFORMS = {
    ("AuthenticAMD", 25, 1): "zen3-epyc",
    ("AuthenticAMD", 25, 17): "zen4-epyc",
    ("AuthenticAMD", 26, 2): "zen5-epyc",
    ("GenuineIntel", 6, 143): "xeon-spr",
    ("GenuineIntel", 6, 167): "xeon-spr",
    ("GenuineIntel", 6, 207): "xeon-emr",
}


def platform_name(device: str) -> str:
    """The machine's directory under benchmarks/results: the GPU's name for "cuda" ("NVIDIA
    H200" -> "h200"), else PLATFORMS' name of the CPU or "<vendor>-f<family>-m<model>"."""
    if device == "cuda":
        name = torch.cuda.get_device_name().removeprefix("NVIDIA ")
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    cpu = cpu_info()
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(str(cpu["vendor"]), "cpu")
    return PLATFORMS.get((cpu["vendor"], cpu["family"], cpu["model"]),
                         f"{vendor}-f{cpu['family']}-m{cpu['model']}")


_SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
                 torch.float64: "f64"}


def variant_name(device: str, dtypes: Sequence[torch.dtype], settings: Sequence[str] = ()) -> str:
    """What sets a run apart from its suite's default run on the same machine, "-"-joined ("" for
    none): the CPU kernel ROPE_EXT_CPU_KERNEL forced ("avx2"), ROPE_EXT_STREAMING_STORES when
    not auto ("stream", "no-stream"), the dtypes when bfloat16 is not among them ("f32"), then
    the caller's `settings` (e.g. "system-heap"). Never a run number or a commit."""
    parts = []
    if device == "cpu":
        if os.environ.get("ROPE_EXT_CPU_KERNEL"):
            kernel = _native.build_info().get("cpu_kernel", "none")
            parts.append(kernel.lower().replace("_", "-"))
        streaming = _streaming_stores()
        if streaming != "auto":
            parts.append({"0": "no-stream", "1": "stream"}.get(streaming, f"stream-{streaming}"))
    if torch.bfloat16 not in dtypes:
        parts += [_SHORT_DTYPES.get(dt, str(dt).removeprefix("torch.")) for dt in dtypes]
    return "-".join(parts + list(settings))


def results_path(results_dir: Path, device: str, suite: str, variant: str) -> Path:
    """results_dir/<platform>/<suite>[-<variant>], without a suffix: where a run's .json (and
    .md, .csv, .png) go by default. Suites are named with hyphens (qk_norm -> qk-norm)."""
    stem = suite.replace("_", "-") + (f"-{variant}" if variant else "")
    return results_dir / platform_name(device) / stem


def git_commit() -> str:
    """`git rev-parse --short HEAD` of the tree this file sits in, or "unknown" outside one."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_metadata(device: str, suite: str, variant: str, command: str, heap: str) -> dict:
    """The fields every results JSON starts with (benchmarks/render_results.py's META_KEYS):
    the platform, suite and variant of results_path, the date, commit, torch version, the CPU
    (model name, family and model numbers, widest ISA), the rope_ext CPU kernel and whether
    ROPE_EXT_CPU_KERNEL forced it, threads, heap, streaming stores, the GPU ("none" on a CPU
    run) and the command, environment settings first."""
    cpu = cpu_info()
    return dict(platform=platform_name(device), suite=suite.replace("_", "-"), variant=variant,
                date=datetime.date.today().isoformat(), commit=git_commit(),
                torch=torch.__version__, cpu_model_name=cpu["model_name"],
                cpu_family=cpu["family"], cpu_model=cpu["model"], cpu_isa=cpu["isa"],
                cpu_kernel=_native.build_info().get("cpu_kernel", "none"),
                cpu_kernel_forced=bool(os.environ.get("ROPE_EXT_CPU_KERNEL")),
                threads=torch.get_num_threads(), heap=heap.removeprefix("heap: "),
                streaming_stores=_streaming_stores(),
                gpu=torch.cuda.get_device_name() if device == "cuda" else "none",
                command=command)


def json_output(out: Path, device: str, suite: str, dtypes: Sequence[torch.dtype], script: str,
                argv: Sequence[str], heap: str) -> tuple[Path, dict]:
    """For the scripts that write one JSON (bench_compile_inplace.py, bench_layer.py): the
    file `--out` names (a directory: results_path's .json there) and the run's metadata."""
    variant = variant_name(device, dtypes)
    path = (results_path(out, device, suite, variant).with_suffix(".json") if out.is_dir()
            else out)
    meta = run_metadata(device, suite, variant, command_line(script, argv), heap=heap)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, meta


def command_line(script: str, argv: Sequence[str]) -> str:
    """`python script argv...` as typed, preceded by the ROPE_EXT_* settings in the
    environment (they choose the kernel and its stores)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("ROPE_EXT_")]
    return " ".join([*env, "python", script, *map(shlex.quote, argv)])


def steady_heap() -> str:
    """Keeps glibc's malloc from handing memory back to the kernel (no mmap'd blocks, no trim),
    so that timed calls reuse pages that are already mapped; says what it did.

    Otherwise whether an output allocation page-faults depends on the allocator's state, not
    on the provider: a 32 MiB float32 tensor is always mmap'd afresh (8192 page faults, 20 ms
    for a clone that copies in 3 ms), and a 16 MiB one is or is not, depending on whether the
    heap top was trimmed, so the same provider timed 1.5 ms in one process and 12 ms in the
    next. Every provider, the copy bounds included, runs under the same setting.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return "heap: system allocator as is (no glibc mallopt)"
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    if mallopt(m_mmap_max, 0) != 1 or mallopt(m_trim_threshold, 2**31 - 1) != 1:
        return "heap: system allocator as is (mallopt refused)"
    return "heap: glibc malloc without mmap or trim (no page faults in timed calls)"


@dataclasses.dataclass(frozen=True)
class Case:
    """q [batch, seq, q_heads, head_dim] and k [batch, seq, k_heads, head_dim]."""

    batch: int
    seq: int
    q_heads: int
    k_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str
    rotary_dim: int | None = None  # partial rotary when < head_dim
    decode_offset: int = 0  # positions start here (KV-cache decode)
    # Each sequence at a position of its own, in [0, decode_offset] (a serving batch's decode
    # step): positions [B, S, 1], as a varlen case's.
    per_sequence: bool = False
    varlen: bool = False  # one packed batch of sequences, positions restarting per sequence
    mrope: bool = False  # Qwen2-VL's MRoPE: text, an image grid, text (see mrope_positions)
    qk_norm: bool = False  # Qwen3's per-head RMSNorm then half-split RoPE (_qk_norm_providers)
    # The fused RoPE + KV-cache write (_kv_cache_providers): "NHD" a paged cache of 16-token
    # blocks, "HND" a static [B, H_kv, max_len, D] cache. v has k's shape.
    kv_cache: str | None = None
    name: str = ""

    @property
    def bytes_moved(self) -> int:
        """q and k read and written once; with a KV cache, v too (read, then written to its
        cache): what copying the same tensors once moves."""
        heads = self.q_heads + self.k_heads * (2 if self.kv_cache else 1)
        elems = self.batch * self.seq * heads * self.head_dim
        return 2 * elems * torch.empty((), dtype=self.dtype).element_size()

    def label(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        rot = f" rot{self.rotary_dim}" if self.rotary_dim not in (None, self.head_dim) else ""
        cache = f" {self.kv_cache} cache" if self.kv_cache else ""
        return (f"{self.name + ' ' if self.name else ''}[{self.batch},{self.seq},{self.q_heads}"
                f"/{self.k_heads},{self.head_dim}]{rot}{cache} {dt} {self.device}")


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    freqs_cis: torch.Tensor  # complex [P, R/2]
    cos: torch.Tensor  # [S, R] ([B, S, R] per sequence) in q's dtype, HF's half-split form
    sin: torch.Tensor
    # Absolute rows of freqs_cis: [1, S, 1] for varlen cases, [B, S, 1] per sequence,
    # [3, 1, S, 1] for MRoPE; None where they are decode_offset, decode_offset + 1, ...
    positions: torch.Tensor | None


MROPE_SECTION = [16, 24, 24]  # Qwen2-VL / Qwen2.5-VL (time, height, width), R = 128


def mrope_positions(seq: int) -> torch.Tensor:
    """[3, seq] positions as transformers' get_rope_index lays out a text + image + text
    sequence: a quarter text (equal axes), an image grid of half the tokens (time fixed,
    height and width counting rows and columns from the text's end), then text again,
    continuing after the grid's larger side."""
    text = seq // 4
    rows = 16
    cols = (seq - 2 * text) // rows
    image = rows * cols
    t = torch.arange(text)
    h, w = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    grid = torch.stack([torch.full((image,), text), text + h.reshape(-1), text + w.reshape(-1)])
    after = text + max(rows, cols) + torch.arange(seq - text - image)
    return torch.cat([t.expand(3, -1), grid, after.expand(3, -1)], 1)


def packed_positions(total: int, gen: torch.Generator) -> torch.Tensor:
    """Positions of sequences of random lengths (64..1024) packed into `total` tokens."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(64, 1025, (), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return torch.cat([torch.arange(n) for n in lengths])


ROPE_THETA = 10000.0  # every case's table; FlashInfer's pos_ids provider turns by it too


def make_inputs(case: Case) -> Inputs:
    gen = torch.Generator().manual_seed(0)
    rot = case.rotary_dim or case.head_dim

    def randn(heads):
        shape = (case.batch, case.seq, heads, case.head_dim)
        return torch.randn(shape, generator=gen).to(device=case.device, dtype=case.dtype)

    table = api.precompute_freqs_cis(rot, case.decode_offset + case.seq, ROPE_THETA,
                                     device=case.device)
    positions = None
    if case.mrope:
        positions = mrope_positions(case.seq).to(case.device).view(3, 1, case.seq, 1)
        rows = torch.view_as_real(table[: case.seq])  # plain RoPE's rows, for the HF providers
    elif case.varlen:
        positions = packed_positions(case.seq, gen).to(case.device)
        rows = torch.view_as_real(table[positions])
        positions = positions.view(1, case.seq, 1)
    elif case.per_sequence:
        starts = torch.randint(0, case.decode_offset + 1, (case.batch, 1), generator=gen)
        positions = (starts + torch.arange(case.seq)).to(case.device)
        rows = torch.view_as_real(table[positions])  # [B, S, R/2, 2]
        positions = positions.view(case.batch, case.seq, 1)
    else:
        rows = torch.view_as_real(table[case.decode_offset:])
    cos = torch.cat([rows[..., 0], rows[..., 0]], -1).to(case.dtype)
    sin = torch.cat([rows[..., 1], rows[..., 1]], -1).to(case.dtype)
    return Inputs(randn(case.q_heads), randn(case.k_heads), table, cos, sin, positions)


def _llama_eager(q, k, freqs_cis, offset):
    return reference.llama_apply_rotary_emb(q, k, freqs_cis[offset:offset + q.shape[1]])


def _hf_eager(q, k, cos, sin):
    rot = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]  # [(B,) S, 1, R] against [B, S, H, D]

    def one(x):
        xr, rest = x[..., :rot], x[..., rot:]
        return torch.cat([xr * cos + reference.rotate_half(xr) * sin, rest], -1)

    return one(q), one(k)


_compiled: dict[str, Callable] = {}


def _compiled_fn(name: str, fn: Callable) -> Callable:
    """torch.compile of fn, specialised per shape as a user's static-shape model would be."""
    if name not in _compiled:
        # Each case's shapes compile anew; a sweep must not fall back to eager at the limit.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _compiled[name] = torch.compile(fn, dynamic=False)
    return _compiled[name]


def _qwen2_vl(case: Case):
    """transformers' Qwen2-VL text rotary path (the rotary module builds cos/sin per token from
    [3, B, S] position ids, then apply_rotary_pos_emb), or None without transformers."""
    try:
        from transformers import Qwen2VLTextConfig
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    except ImportError:
        return None
    config = Qwen2VLTextConfig(hidden_size=case.q_heads * case.head_dim,
                               num_attention_heads=case.q_heads, num_key_value_heads=case.k_heads,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": MROPE_SECTION})
    rotary = m.Qwen2VLRotaryEmbedding(config).to(case.device)
    apply = m.apply_rotary_pos_emb  # looked up now: rope_ext.hf.enable() may swap it later

    def step(q, k, position_ids):  # q, k [B, H, S, D]
        cos, sin = rotary(q, position_ids)
        return apply(q, k, cos, sin)

    return step


def _mrope_providers(case: Case, inputs: Inputs, include_compile: bool):
    q, k, table, positions = inputs.q, inputs.k, inputs.freqs_cis, inputs.positions
    buffers = (torch.empty_like(q), torch.empty_like(k))
    plain = torch.arange(case.seq, device=q.device).view(1, case.seq, 1)
    mrope = dict(positions=positions, interleaved=False, mrope_section=MROPE_SECTION)
    qh, kh = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    positions_h = positions.transpose(2, 3)  # [3, B, 1, S] against [B, H, S, D]
    out: dict[str, Callable[[], object]] = {
        "copy_ (bound, in-place)": lambda: (buffers[0].copy_(q), buffers[1].copy_(k)),
        "clone (bound, out-of-place)": lambda: (q.clone(), k.clone()),
        "rope_ext plain RoPE": lambda: api.apply_rotary_qk(q, k, table, positions=plain,
                                                           interleaved=False),
        "rope_ext MRoPE": lambda: api.apply_rotary_qk(q, k, table, **mrope),
        "rope_ext MRoPE in-place": lambda: api.apply_rotary_qk(q, k, table, inplace=True,
                                                               **mrope),
        "rope_ext MRoPE [B,H,S,D]": lambda: api.apply_rotary_qk(
            qh, kh, table, positions=positions_h, interleaved=False,
            mrope_section=MROPE_SECTION),
        "rope_ext MRoPE interleaved (Qwen3-VL)": lambda: api.apply_rotary_qk(
            q, k, table, positions=positions, interleaved=False, mrope_section=[24, 20, 20],
            mrope_interleaved=True),
    }
    step = _qwen2_vl(case)
    if step is not None:
        position_ids = positions[..., 0]  # [3, B, S]
        out["eager Qwen2-VL (HF)"] = lambda: step(qh, kh, position_ids)
        if include_compile:
            compiled = _compiled_fn("qwen2_vl", step)
            out["compiled Qwen2-VL (HF)"] = lambda: compiled(qh, kh, position_ids)
    return out


QK_NORM_EPS = 1e-6  # Qwen3's rms_norm_eps

# Provider names of the QK-norm cases, shared by _qk_norm_providers and QK_NORM_TARGETS.
ROPE_INPLACE = "rope_ext RoPE alone in-place"
ROPE = "rope_ext RoPE alone"
FUSED_INPLACE = "rope_ext fused in-place"
FUSED = "rope_ext fused"
F_RMS_ROPE = "F.rms_norm + rope_ext"
HF_QWEN3 = "eager Qwen3 RMSNorm + rotate_half (HF)"
HF_QWEN3_COMPILED = "compiled Qwen3 RMSNorm + rotate_half (HF)"
FUSED_BWD = "rope_ext fused fwd+bwd"
F_RMS_ROPE_BWD = "F.rms_norm + rope_ext fwd+bwd"
HF_QWEN3_BWD = "eager Qwen3 (HF) fwd+bwd"
HF_QWEN3_COMPILED_BWD = "compiled Qwen3 (HF) fwd+bwd"
FUSED_PACKED = "rope_ext fused in-place, packed qkv"
VLLM_FUSED = "vLLM fused_qk_norm_rope, packed qkv"

# (what, numerator, denominator, comparison, target, device[, case]): the targets, then
# (target None) ratios shown for context; device None for every device; case: only for cases
# whose name starts with it.
QK_NORM_TARGETS = [
    ("fused in-place / RoPE alone in-place", FUSED_INPLACE, ROPE_INPLACE, "<=", 1.25, "cpu"),
    ("fused in-place / RoPE alone in-place", FUSED_INPLACE, ROPE_INPLACE, "<=", 1.15, "cuda"),
    ("(F.rms_norm + rope_ext) / fused", F_RMS_ROPE, FUSED, ">=", 1.7, None),
    ("compiled HF / fused", HF_QWEN3_COMPILED, FUSED, ">=", 5.0, "cpu"),
    ("compiled HF / fused in-place", HF_QWEN3_COMPILED, FUSED_INPLACE, ">=", 1.0, "cuda"),
    ("compiled HF fwd+bwd / fused fwd+bwd", HF_QWEN3_COMPILED_BWD, FUSED_BWD, ">=", 1.0,
     "cuda"),
    ("eager (F.rms_norm + rope_ext) fwd+bwd / fused fwd+bwd", F_RMS_ROPE_BWD, FUSED_BWD, ">=",
     2.0, None),
    ("vLLM / rope_ext, both in place on packed qkv", VLLM_FUSED, FUSED_PACKED, ">=", 1.0,
     "cuda"),
    ("fused / RoPE alone (both out of place)", FUSED, ROPE, None, None, None),
    ("(F.rms_norm + rope_ext) / fused in-place", F_RMS_ROPE, FUSED_INPLACE, None, None, None),
    ("eager HF / fused", HF_QWEN3, FUSED, None, None, None),
    ("eager HF fwd+bwd / fused fwd+bwd", HF_QWEN3_BWD, FUSED_BWD, None, None, None),
]

# Provider names of the KV-cache cases (_kv_cache_providers).
COPY_QKV = "copy_ (bound, in-place)"
KV_FUSED_INPLACE = "rope_ext fused in-place"
KV_FUSED = "rope_ext fused"
KV_FUSED_FP8 = "rope_ext fused in-place, float8_e4m3fn cache"
KV_COMPOSED = "rope_ext in-place + indexed cache writes"
KV_HF = "eager rotate_half (HF) + indexed cache writes"
KV_TARGETS = [
    ("composition / fused in-place", KV_COMPOSED, KV_FUSED_INPLACE, ">=", 1.4, "cpu", "KV prefill"),
    ("fused in-place / copy_ of q, k, v", KV_FUSED_INPLACE, COPY_QKV, "<=", 1.15, "cpu",
     "KV prefill"),
    ("composition / fused in-place", KV_COMPOSED, KV_FUSED_INPLACE, ">=", 2.0, "cpu", "KV decode"),
    ("fused in-place / copy_ of q, k, v", KV_FUSED_INPLACE, COPY_QKV, "<=", 1.10, "cuda",
     "KV prefill"),
    ("float8 cache / bf16 cache, fused in-place", KV_FUSED_FP8, KV_FUSED_INPLACE, "<=", 1.0,
     "cuda", None),
    ("fused in-place / copy_ of q, k, v", KV_FUSED_INPLACE, COPY_QKV, None, None, None,
     "KV decode"),
    ("float8 cache / bf16 cache, fused in-place", KV_FUSED_FP8, KV_FUSED_INPLACE, None, None,
     "cpu", None),
    ("eager HF + writes / fused in-place", KV_HF, KV_FUSED_INPLACE, None, None, None, None),
]


def _qwen3_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward, line for line: float32 statistics, the normalised
    row rounded back to x's dtype, then times the weight (x's dtype in a bf16 model)."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def _qwen3_hf(q, k, q_weight, k_weight, cos, sin, eps):
    """Qwen3Attention's path from the projections' [B, S, H, D] views: q_norm / k_norm, then
    transpose(1, 2) to [B, H, S, D] and apply_rotary_pos_emb with cos/sin [B, S, D]."""
    qh = _qwen3_rms_norm(q, q_weight, eps).transpose(1, 2)
    kh = _qwen3_rms_norm(k, k_weight, eps).transpose(1, 2)
    return reference.hf_apply_rotary_pos_emb(qh, kh, cos, sin)


def _qk_norm_providers(case: Case, inputs: Inputs, include_compile: bool):
    """Qwen3's QK-norm + half-split RoPE. The fwd+bwd providers are always included: one of
    the issue's targets is stated for them. Each fwd+bwd call differentiates outputs . grads
    (fixed random grads) in q, k and both weights with torch.autograd.grad, so no .grad
    accumulates between calls."""
    q, k, table = inputs.q, inputs.k, inputs.freqs_cis
    eps, head_dim = QK_NORM_EPS, case.head_dim
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(device=case.device, dtype=case.dtype)

    # Weights of magnitude 1 (random signs): the in-place providers normalise the same q and k
    # call after call, and weights of other sizes compound, feature by feature, into
    # subnormals within a few hundred calls (1 + 0.1 * randn did), which time the CPU's
    # subnormal arithmetic, not the kernel. A weight's value costs nothing else.
    def signs():
        return torch.where(rand(head_dim) < 0, -1.0, 1.0).to(case.dtype)

    q_weight, k_weight = signs(), signs()
    buffers = (torch.empty_like(q), torch.empty_like(k))
    rope = dict(offset=case.decode_offset, interleaved=False)
    # Hugging Face's rotary embedding hands attention cos/sin [B, S, D] in the model's dtype.
    cos = inputs.cos[None].expand(case.batch, -1, -1).contiguous()
    sin = inputs.sin[None].expand(case.batch, -1, -1).contiguous()

    def fused(q, k, q_weight, k_weight, inplace=False):
        return rms_norm_rotary_qk(q, k, q_weight, k_weight, table, eps=eps, inplace=inplace,
                                  **rope)

    def f_rms_rope(q, k, q_weight, k_weight):
        return api.apply_rotary_qk(F.rms_norm(q, (head_dim,), q_weight, eps),
                                   F.rms_norm(k, (head_dim,), k_weight, eps), table, **rope)

    def hf(q, k, q_weight, k_weight):
        return _qwen3_hf(q, k, q_weight, k_weight, cos, sin, eps)

    out: dict[str, Callable[[], object]] = {
        "copy_ (bound, in-place)": lambda: (buffers[0].copy_(q), buffers[1].copy_(k)),
        "clone (bound, out-of-place)": lambda: (q.clone(), k.clone()),
        ROPE_INPLACE: lambda: api.apply_rotary_qk(q, k, table, inplace=True, **rope),
        ROPE: lambda: api.apply_rotary_qk(q, k, table, **rope),
        FUSED_INPLACE: lambda: fused(q, k, q_weight, k_weight, inplace=True),
        FUSED: lambda: fused(q, k, q_weight, k_weight),
        F_RMS_ROPE: lambda: f_rms_rope(q, k, q_weight, k_weight),
        HF_QWEN3: lambda: hf(q, k, q_weight, k_weight),
    }
    if include_compile:
        compiled = _compiled_fn("qwen3_qk_norm", _qwen3_hf)
        out[HF_QWEN3_COMPILED] = lambda: compiled(q, k, q_weight, k_weight, cos, sin, eps)

    leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, q_weight, k_weight))
    grads = (rand(*q.shape), rand(*k.shape))
    grads_h = tuple(g.transpose(1, 2) for g in grads)  # against HF's [B, H, S, D] outputs

    def fwd_bwd(fn, grads):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, grads)

    out[FUSED_BWD] = fwd_bwd(fused, grads)
    out[F_RMS_ROPE_BWD] = fwd_bwd(f_rms_rope, grads)
    out[HF_QWEN3_BWD] = fwd_bwd(hf, grads_h)
    if include_compile:  # Inductor compiles the backward too (AOTAutograd)
        out[HF_QWEN3_COMPILED_BWD] = fwd_bwd(
            lambda q, k, q_weight, k_weight: compiled(q, k, q_weight, k_weight, cos, sin, eps),
            grads_h)
    if case.device == "cuda" and importlib.util.find_spec("vllm") is not None:
        out.update(_vllm_qk_norm(case, q, k, table, q_weight, k_weight, eps))
    return out


def _vllm_qk_norm(case: Case, q, k, table, q_weight, k_weight, eps):
    """vLLM's fused_qk_norm_rope normalises and rotates (GPT-NeoX pairs) the q and k heads of a
    packed qkv [T, (Hq + 2 Hk) D] in place, with a cache [P, D] of cos then sin and int64
    positions [T]. rope_ext's fused op runs beside it on q and k views of the same layout.
    The cache and weight dtypes vLLM accepts have changed between releases: each form is
    tried once, and the provider is left out (with the reason printed) if none runs."""
    from vllm import _custom_ops as vllm_ops

    tokens, hq, hk, d = case.batch * case.seq, case.q_heads, case.k_heads, case.head_dim
    qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), k.reshape(tokens, -1)], -1)
    q_view = qkv[:, : hq * d].view(tokens, hq, d)
    k_view = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    rows = torch.view_as_real(table)
    cache = torch.cat([rows[..., 0], rows[..., 1]], -1)  # [P, D]
    positions = (case.decode_offset + torch.arange(case.seq, device=q.device)).repeat(case.batch)

    def vllm_call(cache, q_w, k_w):
        return lambda: vllm_ops.fused_qk_norm_rope(qkv, hq, hk, hk, d, eps, q_w, k_w, cache,
                                                   True, positions)

    found: dict[str, Callable[[], object]] = {}
    errors = []
    for dtype in (torch.float32, q.dtype):
        call = vllm_call(cache.to(dtype), q_weight.to(q.dtype), k_weight.to(q.dtype))
        try:
            call()
        except Exception as error:  # an unsupported form: try the next one
            errors.append(f"{dtype}: {error}".splitlines()[0])
            continue
        found[VLLM_FUSED] = call
        break
    else:
        print(f"vLLM fused_qk_norm_rope left out: {'; '.join(errors)}")
        return found
    token_positions = positions.view(tokens, 1)
    found[FUSED_PACKED] = lambda: rms_norm_rotary_qk(
        q_view, k_view, q_weight, k_weight, table, eps=eps, inplace=True, interleaved=False,
        positions=token_positions)
    return found


def _kv_cache_providers(case: Case, inputs: Inputs) -> dict[str, Callable[[], object]]:
    """The fused RoPE + KV-cache write of one attention layer's step (tokens at positions
    decode_offset.., half-split pairs as Llama 3 in transformers), against copying q, k and v
    once, and against rotating in place then writing k and v into the cache by indexing: a
    paged cache's rows by block and index, a static cache's with index_copy_ along its sequence
    dim, as transformers' StaticCache does."""
    from .kv_cache import rotary_kv_cache_update, static_cache_slots

    q, k, table = inputs.q, inputs.k, inputs.freqs_cis
    v = torch.randn_like(k)
    b, s, hk, d = k.shape
    positions = (case.decode_offset + torch.arange(s, device=q.device)).expand(b, s)
    if case.kv_cache == "HND":
        max_len = case.decode_offset + s
        caches = [torch.zeros(b, hk, max_len, d, dtype=q.dtype, device=q.device)
                  for _ in range(2)]
        slots = static_cache_slots(positions, max_len)
    else:  # paged, 16-token blocks handed out in a shuffled order, as a serving engine does
        block = 16
        per_seq = (case.decode_offset + s + block - 1) // block
        caches = [torch.zeros(b * per_seq, block, hk, d, dtype=q.dtype, device=q.device)
                  for _ in range(2)]
        order = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(0))
        table_of = order.view(b, per_seq).to(q.device)
        slots = (table_of.gather(1, positions // block) * block + positions % block)
        slots = slots.unsqueeze(-1)
    fp8 = [torch.zeros_like(c, dtype=torch.float8_e4m3fn) for c in caches]
    scale = torch.full((1,), 0.05, device=q.device)
    kw = dict(positions=positions.unsqueeze(-1), interleaved=False, cache_layout=case.kv_cache)
    flat_slots = slots.reshape(-1)
    blocks, index = flat_slots // caches[0].shape[1], flat_slots % caches[0].shape[1]
    rows_at = positions[0] if case.kv_cache == "HND" else None

    def write(cache, rows):
        if case.kv_cache == "HND":  # StaticCache.update: index_copy_ along the sequence
            cache.index_copy_(2, rows_at, rows.transpose(1, 2))
        else:
            cache[blocks, index] = rows.reshape(-1, hk, d)

    def composed():
        api.apply_rotary_qk(q, k, table, inplace=True, positions=kw["positions"],
                            interleaved=False)
        write(caches[0], k)
        write(caches[1], v)

    def hf():
        _, k_rotated = _hf_eager(q, k, inputs.cos, inputs.sin)
        write(caches[0], k_rotated)
        write(caches[1], v)

    buffers = [torch.empty_like(t) for t in (q, k, v)]
    return {
        COPY_QKV: lambda: [o.copy_(i) for o, i in zip(buffers, (q, k, v))],
        "clone (bound, out-of-place)": lambda: (q.clone(), k.clone(), v.clone()),
        KV_FUSED_INPLACE: lambda: rotary_kv_cache_update(q, k, v, table, *caches, slots,
                                                         inplace=True, **kw),
        KV_FUSED: lambda: rotary_kv_cache_update(q, k, v, table, *caches, slots, **kw),
        KV_FUSED_FP8: lambda: rotary_kv_cache_update(q, k, v, table, *fp8, slots, k_scale=scale,
                                                     v_scale=scale, inplace=True, **kw),
        KV_COMPOSED: composed,
        KV_HF: hf,
    }


def providers(case: Case, inputs: Inputs, include_compile: bool = True,
              include_backward: bool = False) -> dict[str, Callable[[], object]]:
    """name -> zero-argument callable, for one case: the bounds, rope_ext, eager and compiled
    paths (third-party kernels: third_party)."""
    if case.mrope:
        return _mrope_providers(case, inputs, include_compile)
    if case.qk_norm:
        return _qk_norm_providers(case, inputs, include_compile)
    if case.kv_cache:
        return _kv_cache_providers(case, inputs)
    q, k, table = inputs.q, inputs.k, inputs.freqs_cis
    where = _where(case, inputs)
    buffers = (torch.empty_like(q), torch.empty_like(k))
    out: dict[str, Callable[[], object]] = {
        "copy_ (bound, in-place)": lambda: (buffers[0].copy_(q), buffers[1].copy_(k)),
        "clone (bound, out-of-place)": lambda: (q.clone(), k.clone()),
        "rope_ext in-place": lambda: api.apply_rotary_qk(q, k, table, inplace=True, **where),
        "rope_ext": lambda: api.apply_rotary_qk(q, k, table, **where),
        "rope_ext q, k as two calls": lambda: (api.apply_rotary(q, table, **where),
                                               api.apply_rotary(k, table, **where)),
        "rope_ext half-split": lambda: api.apply_rotary_qk(q, k, table, interleaved=False,
                                                           **where),
        "rope_ext half-split in-place": lambda: api.apply_rotary_qk(
            q, k, table, interleaved=False, inplace=True, **where),
    }
    if not case.varlen:  # Hugging Face's layout: positions along the innermost leading dim
        qh, kh = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        where_h = dict(where)
        if case.per_sequence:
            where_h["positions"] = inputs.positions.transpose(1, 2)  # [B, 1, S]
        out["rope_ext half-split [B,H,S,D]"] = lambda: api.apply_rotary_qk(
            qh, kh, table, seq_dim=2, interleaved=False, **where_h)
    full = case.rotary_dim in (None, case.head_dim)
    if full and inputs.positions is None:
        out["eager complex (LLaMA)"] = lambda: _llama_eager(q, k, table, case.decode_offset)
    elif full:  # the same complex product, with a row gather for the given positions
        out["eager complex (LLaMA)"] = lambda: (reference.apply_rotary(q, table, **where),
                                                reference.apply_rotary(k, table, **where))
    out["eager rotate_half (HF)"] = lambda: _hf_eager(q, k, inputs.cos, inputs.sin)
    if include_compile:
        if full and inputs.positions is None:
            llama = _compiled_fn("llama", _llama_eager)
            out["compiled complex (LLaMA)"] = lambda: llama(q, k, table, case.decode_offset)
        hf = _compiled_fn("hf", _hf_eager)
        out["compiled rotate_half (HF)"] = lambda: hf(q, k, inputs.cos, inputs.sin)
    if include_backward:  # as the peers' fwd+bwd providers: torch.autograd.grad, q and k
        grads = backward_grads(q, k)
        for name, interleaved in (("rope_ext fwd+bwd", True), ("rope_ext half-split fwd+bwd",
                                                                 False)):
            step = _fwd_bwd(functools.partial(api.apply_rotary_qk, freqs_cis=table,
                                              interleaved=interleaved, **where))
            out[name] = functools.partial(step, q, k, grads)
        hf_paths = [("eager rotate_half (HF) fwd+bwd", _hf_eager)]
        if include_compile:  # the compiled function above; Inductor compiles its backward too
            hf_paths.append(("compiled rotate_half (HF) fwd+bwd", hf))
        for name, fn in hf_paths:
            step = _fwd_bwd(functools.partial(fn, cos=inputs.cos, sin=inputs.sin))
            out[name] = functools.partial(step, q, k, grads)
    return out


def backward_grads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output gradients every fwd+bwd provider of a case is given (seeded: the same for
    rope_ext, the eager and compiled paths and the peers)."""
    gen = torch.Generator().manual_seed(2)
    return tuple(torch.randn(x.shape, generator=gen).to(x) for x in (q, k))


# Third-party peers. Each library is imported once per process, when a GPU case first asks for
# it, from what is installed or, for flash-attn, from the rotary.py that benchmarks/peers.sh
# fetched; one that cannot load is listed with the reason (load_peers). Every peer provider
# runs once against the float64 reference before it is timed (check_peer): one whose output
# disagrees is reported as wrong and not timed. The peers are given half-split pairs, every
# one's default (and Liger's only form): compare them with the rope_ext half-split rows.


def peers_dir() -> Path:
    """Where benchmarks/peers.sh put the peers: ROPE_EXT_PEERS, else .peers in the checkout
    this module belongs to."""
    return Path(os.environ.get("ROPE_EXT_PEERS") or Path(__file__).resolve().parents[1] / ".peers")


@dataclasses.dataclass(frozen=True)
class Peer:
    """A loaded library: its version (and where it came from) and what its providers call."""

    version: str
    api: object


@dataclasses.dataclass(frozen=True)
class PeerCall:
    """A peer's provider as a function of the case's tensors: fn(q, k) rotates q and k
    [B, S, H, D] (in place where the peer does) and returns them rotated; with `grads`, the
    gradients of the outputs, fn(q, k, grads) runs forward and backward and also returns q's
    and k's gradients. `interleaved`: the pairing it was given."""

    fn: Callable[..., tuple[torch.Tensor, ...]]
    interleaved: bool = False
    grads: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind(self, q: torch.Tensor, k: torch.Tensor) -> Callable[[], object]:
        """The zero-argument callable that is timed."""
        return functools.partial(self.fn, q, k, *(() if self.grads is None else (self.grads,)))


def _fwd_bwd(forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]):
    """(q, k, grads) -> forward's outputs and torch.autograd.grad of them in q and k: a
    training step's RoPE, forward and backward (no .grad accumulates between calls)."""
    def step(q, k, grads):
        leaves = (q.detach().requires_grad_(), k.detach().requires_grad_())
        outputs = forward(*leaves)
        return (*outputs, *torch.autograd.grad(outputs, leaves, grads))

    return step


def _where(case: Case, inputs: Inputs) -> dict:
    """rope_ext's offset and positions arguments for a plain case's rows."""
    if inputs.positions is not None:  # absolute rows
        return dict(offset=0, positions=inputs.positions)
    return dict(offset=case.decode_offset, positions=None)


def _token_positions(case: Case, inputs: Inputs) -> torch.Tensor:
    """int64 [B, S]: each token's position, the rows of inputs.freqs_cis it turns by."""
    if inputs.positions is not None:  # a packed batch [1, S, 1], or per sequence [B, S, 1]
        return inputs.positions.view(case.batch, case.seq)
    start = torch.arange(case.seq, device=inputs.q.device) + case.decode_offset
    return start.expand(case.batch, case.seq)


def _load_flashinfer() -> Peer:
    import flashinfer
    import flashinfer.rope

    trimmed = ", rope only" if getattr(flashinfer, "TRIMMED_FOR", None) == "rope" else ""
    return Peer(f"{flashinfer.__version__}{trimmed}", flashinfer.rope)


def _flashinfer_providers(peer: Peer, case: Case, inputs: Inputs, grads):
    """FlashInfer rotates tokens [T, heads, head_dim] in place, with int64 positions [T]:
    from a float32 cache [P, R] of cos then sin (rope_ext's table), or from positions alone,
    computing each angle itself (theta ROPE_THETA, as rope_ext's table). No backward."""
    names = ("FlashInfer cos_sin_cache in-place", "FlashInfer pos_ids in-place")
    if case.dtype not in (torch.float16, torch.bfloat16):
        return dict.fromkeys(names, "FlashInfer's rope kernels take float16 and bfloat16 only")
    rope, table = peer.api, inputs.freqs_cis
    cache = torch.cat([table.real, table.imag], -1).contiguous()
    positions = _token_positions(case, inputs).reshape(-1).contiguous()
    tokens, rotary_dim = positions.numel(), 2 * table.shape[1]

    def cos_sin_cache(q, k):
        rope.apply_rope_with_cos_sin_cache_inplace(positions, q.view(tokens, -1),
                                                   k.view(tokens, -1), case.head_dim, cache,
                                                   is_neox=True)
        return q, k

    def pos_ids(q, k):
        rope.apply_rope_pos_ids_inplace(q.view(tokens, -1, case.head_dim),
                                        k.view(tokens, -1, case.head_dim), positions,
                                        rotary_dim=rotary_dim, interleave=False,
                                        rope_theta=ROPE_THETA)
        return q, k

    return dict(zip(names, (PeerCall(cos_sin_cache), PeerCall(pos_ids))))


def _load_liger() -> Peer:
    from liger_kernel.ops.rope import LigerRopeFunction

    return Peer(importlib.metadata.version("liger_kernel"), LigerRopeFunction)


def _liger_providers(peer: Peer, case: Case, inputs: Inputs, grads):
    """Liger's LigerRopeFunction takes q and k as Hugging Face's attention has them, [B, H, S, D]
    views of [B, S, H, D], and cos and sin [1, S, R] in q's dtype as Hugging Face's rotary
    embedding hands them over; it computes in cos's dtype and rotates in place, backward too."""
    cos, sin = inputs.cos, inputs.sin
    if cos.dim() == 2:  # one [S, R] for the batch; per sequence, [B, S, R] already
        cos, sin = cos[None], sin[None]

    def forward(q, k):
        q_out, k_out = peer.api.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    found = {"Liger in-place": PeerCall(forward)}
    if grads is not None:
        found["Liger fwd+bwd"] = PeerCall(_fwd_bwd(forward), grads=grads)
    return found


def _load_flash_attn() -> Peer:
    """flash-attn's Triton rotary module: the installed package's, else the rotary.py that
    benchmarks/peers.sh took from its sdist, loaded from its file (it imports only torch and
    triton; the package would import its compiled CUDA extension first)."""
    if importlib.util.find_spec("flash_attn") is not None:
        import flash_attn
        from flash_attn.ops.triton import rotary

        return Peer(flash_attn.__version__, rotary)
    folder = peers_dir() / "flash-attn"
    path = folder / "rotary.py"
    if not path.exists():
        raise FileNotFoundError(f"flash_attn is not installed and {path} is missing "
                                "(benchmarks/peers.sh fetches it)")
    spec = importlib.util.spec_from_file_location("rope_ext_peer_flash_attn_rotary", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton finds a kernel's module by name
    spec.loader.exec_module(module)
    version = (folder / "VERSION").read_text().strip() if (folder / "VERSION").exists() else "?"
    return Peer(f"{version}, {path}", module)


class _FlashAttnRotary(torch.autograd.Function):
    """flash_attn.layers.rotary.ApplyRotaryEmb, out of place: forward apply_rotary, backward
    apply_rotary(conjugate=True) of the gradient. `rotate(x, conjugate)` is apply_rotary
    with the case's table and positions."""

    @staticmethod
    def forward(ctx, x, rotate):
        ctx.rotate = rotate
        return rotate(x, conjugate=False)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rotate(grad, conjugate=True), None


def _flash_attn_providers(peer: Peer, case: Case, inputs: Inputs, grads):
    """flash-attn's apply_rotary rotates one tensor [B, S, H, D] (or packed tokens [T, H, D]
    with cu_seqlens) per call, with cos and sin [P, R/2] in q's dtype, as its RotaryEmbedding
    caches them, and a position offset per call or per sequence."""
    table = inputs.freqs_cis
    cos, sin = table.real.to(case.dtype).contiguous(), table.imag.to(case.dtype).contiguous()
    where: dict = dict(seqlen_offsets=case.decode_offset)
    if case.per_sequence:  # sequence b at rows seqlen_offsets[b], seqlen_offsets[b] + 1, ...
        starts = _token_positions(case, inputs)[:, 0]
        where = dict(seqlen_offsets=starts.to(torch.int32).contiguous())
    if case.varlen:  # positions restart at 0 where each packed sequence starts
        flat = _token_positions(case, inputs).reshape(-1)
        starts = torch.nonzero(flat == 0).flatten()
        bounds = torch.cat([starts, starts.new_tensor([flat.numel()])])
        where = dict(cu_seqlens=bounds.to(torch.int32),
                     max_seqlen=int((bounds[1:] - bounds[:-1]).max()))

    def rotate(x, inplace=False, conjugate=False):
        packed = case.varlen
        out = peer.api.apply_rotary(x[0] if packed else x, cos, sin, interleaved=False,
                                    inplace=inplace, conjugate=conjugate, **where)
        return out[None] if packed else out

    def forward_inplace(q, k):
        return rotate(q, inplace=True), rotate(k, inplace=True)

    found = {"flash-attn in-place": PeerCall(forward_inplace)}
    if grads is not None:
        found["flash-attn fwd+bwd"] = PeerCall(
            _fwd_bwd(lambda q, k: (_FlashAttnRotary.apply(q, rotate),
                                   _FlashAttnRotary.apply(k, rotate))), grads=grads)
    return found


def _load_vllm() -> Peer:
    from vllm import _custom_ops

    return Peer(importlib.metadata.version("vllm"), _custom_ops)


def _vllm_providers(peer: Peer, case: Case, inputs: Inputs, grads):
    """vLLM's rotary_embedding: tokens [T, heads * head_dim] in place, int64 positions [T] and
    a cache [P, R] of cos then sin in q's dtype, as its RotaryEmbedding casts it."""
    table = inputs.freqs_cis
    cache = torch.cat([table.real, table.imag], -1).to(case.dtype)
    positions = _token_positions(case, inputs).reshape(-1).contiguous()

    def rotary_embedding(q, k):
        peer.api.rotary_embedding(positions, q.view(positions.numel(), -1),
                                  k.view(positions.numel(), -1), case.head_dim, cache, True)
        return q, k

    return {"vLLM in-place": PeerCall(rotary_embedding)}


@dataclasses.dataclass(frozen=True)
class PeerLibrary:
    load: Callable[[], Peer]  # raises where the library cannot load
    # (peer, case, inputs, grads or None) -> provider name -> PeerCall, or why it does not run
    providers: Callable[..., dict[str, PeerCall | str]]


# Each library's provider names start with its name here (run_case's `only` relies on it).
PEERS = {
    "FlashInfer": PeerLibrary(_load_flashinfer, _flashinfer_providers),
    "Liger": PeerLibrary(_load_liger, _liger_providers),
    "flash-attn": PeerLibrary(_load_flash_attn, _flash_attn_providers),
    "vLLM": PeerLibrary(_load_vllm, _vllm_providers),
}
# Peers with no provider here, and why.
NOT_MEASURED = {
    "TransformerEngine": "not carried to the GPU machine: its wheels exceed the 64 MiB it "
                         "receives (benchmarks/peers.sh says by how much)",
}


def load_peers(libraries: dict[str, PeerLibrary] = PEERS) -> tuple[dict[str, Peer],
                                                                     dict[str, str]]:
    """Imports each library: those that loaded, and name -> why not for the others (the
    exception's type and first line), NOT_MEASURED's included."""
    loaded: dict[str, Peer] = {}
    missing: dict[str, str] = {}
    for name, library in libraries.items():
        try:
            loaded[name] = library.load()
        except Exception as error:  # noqa: BLE001 (whatever stops the import is the reason)
            missing[name] = f"{type(error).__name__}: {error}".splitlines()[0]
    return loaded, {**missing, **NOT_MEASURED}


@functools.cache
def peers() -> tuple[dict[str, Peer], dict[str, str]]:
    """load_peers(), once per process."""
    return load_peers()


def peer_report() -> list[str]:
    """A line per peer: its version and origin, or why it is not measured."""
    loaded, missing = peers()
    return ([f"{name} {peer.version}" for name, peer in loaded.items()]
            + [f"{name}: not measured: {reason}" for name, reason in missing.items()])


def missing_third_party(device: str) -> list[str]:
    """The peers a run on `device` does not measure, each with the reason."""
    if device != "cuda":
        return [f"{name} (CUDA only)" for name in [*PEERS, *NOT_MEASURED]]
    return [f"{name} ({reason})" for name, reason in peers()[1].items()]


def third_party(case: Case, inputs: Inputs, include_backward: bool = False,
                loaded: dict[str, Peer] | None = None) -> dict[str, PeerCall | str]:
    """The loaded peers' providers for one plain case on CUDA, each a PeerCall or the reason
    it does not run on this case; their fwd+bwd providers with include_backward."""
    if case.device != "cuda" or case.mrope or case.qk_norm or case.kv_cache:
        return {}
    loaded = peers()[0] if loaded is None else loaded
    grads = backward_grads(inputs.q, inputs.k) if include_backward else None
    found: dict[str, PeerCall | str] = {}
    for name, peer in loaded.items():
        found.update(PEERS[name].providers(peer, case, inputs, grads))
    return found


def peer_tolerance(dtype: torch.dtype) -> float:
    """The largest error (relative to the output's scale) a correct peer may make: 4 units of
    q's dtype (bf16: 0.031), for a peer that rounds its table and arithmetic to q's dtype as
    Liger does, but no less than 2^-10: FlashInfer's pos_ids kernels compute their angles in
    float32 with fast sin and cos, about 1e-3 off at position 8192. A mistaken convention
    (pairing, sign, table, positions) is off by about the output's scale itself."""
    return max(4 * torch.finfo(dtype).eps, 2.0 ** -10)


@dataclasses.dataclass(frozen=True)
class Check:
    """A peer provider's one run against the float64 reference, before it is timed."""

    case: Case
    provider: str
    error: float | None  # max |out - ref| / max |ref| over its outputs; None if it did not run
    failure: str = ""  # why it did not run, or what it raised

    @property
    def tolerance(self) -> float:
        return peer_tolerance(self.case.dtype)

    @property
    def ok(self) -> bool:
        return not self.failure and self.error is not None and self.error <= self.tolerance

    def as_dict(self) -> dict:
        return dict(case=self.case.label(), provider=self.provider, error=self.error,
                    tolerance=self.tolerance, ok=self.ok, failure=self.failure)


def check_peer(case: Case, inputs: Inputs, provider: str, call: PeerCall | str) -> Check:
    """Runs the provider once on copies of the case's q and k (and gradients) and compares
    what it returns with rope_ext.reference in float64, on the very table entries rope_ext
    reads: rotated q and k, and for fwd+bwd also their gradients, the gradients rotated back."""
    if isinstance(call, str):
        return Check(case, provider, None, call)
    where = dict(**_where(case, inputs), interleaved=call.interleaved)
    args = [inputs.q.clone(), inputs.k.clone()]
    want = [reference.apply_rotary(x.double(), inputs.freqs_cis, **where) for x in args]
    if call.grads is not None:
        args.append(tuple(g.clone() for g in call.grads))
        want += [reference.apply_rotary(g.double(), inputs.freqs_cis, inverse=True, **where)
                 for g in call.grads]
    try:
        got = call.fn(*args)
        if case.device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (a peer that raises is reported, not timed)
        return Check(case, provider, None, f"{type(error).__name__}: {error}".splitlines()[0])
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return Check(case, provider, None, "returned outputs of other shapes than q and k")
    # torch's max, not Python's: a NaN anywhere makes the error NaN, which no tolerance passes.
    error = torch.stack([(g.double() - w).abs().max() / w.abs().max()
                         for g, w in zip(got, want)]).max().item()
    return Check(case, provider, error)


def check_table(checks: list[dict]) -> list[str]:
    """Markdown lines: each peer provider's check (Check.as_dict rows of one case)."""
    if not checks:
        return []
    lines = ["| checked against float64 (max error / max of output) | error | tolerance | |",
             "|---|---:|---:|---|"]
    for c in checks:
        error = "-" if c["error"] is None else f"{c['error']:.2g}"
        verdict = (f"not timed: {c['failure']}" if c["failure"]
                   else "ok" if c["ok"] else "**wrong**: not timed")
        lines.append(f"| {c['provider']} | {error} | {c['tolerance']:.2g} | {verdict} |")
    return lines + [""]


def time_fn(fn: Callable[[], object], device: str, min_run_time: float = 0.5) -> float:
    """Median seconds per call: torch.utils.benchmark on CPU, CUDA events on GPU."""
    if device == "cuda":
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
        for s, e in zip(start, end):
            s.record()
            for _ in range(10):
                fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 10 for s, e in zip(start, end)) / 1e3
    from torch.utils import benchmark

    fn()
    # Timer runs single-threaded unless told otherwise; measure with torch's thread count.
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


@dataclasses.dataclass
class Result:
    case: Case
    provider: str
    seconds: float  # the median round
    rounds: tuple[float, ...] = ()  # seconds per call in each round, in order
    graph_seconds: float | None = None  # CUDA: a call's time in a replayed CUDA graph

    @property
    def gbps(self) -> float:
        return self.case.bytes_moved / self.seconds / 1e9


def run_case(case: Case, include_compile: bool = True, include_backward: bool = False,
             min_run_time: float = 0.5, only: list[str] | None = None,
             rounds: int = 5, checks: list[Check] | None = None) -> list[Result]:
    """Times every provider in `rounds` interleaved rounds and keeps each one's median round.

    Interleaving puts the bound and the kernels under the same machine conditions; the median
    round discards bursts of interference from other tenants, and lucky rounds too (a large
    allocation that happens to reuse pages the allocator kept).

    Third-party providers are first run once against the float64 reference (check_peer): each
    Check goes to `checks`, and only those that pass are timed.
    """
    inputs = make_inputs(case)

    def wanted(name: str) -> bool:
        return not only or name in only or name.startswith(("copy_", "clone"))

    chosen = {name: fn for name, fn in providers(case, inputs, include_compile,
                                                 include_backward).items() if wanted(name)}
    peer_named = not only or any(name.startswith(tuple(PEERS)) for name in only)
    for name, call in (third_party(case, inputs, include_backward) if peer_named else {}).items():
        if wanted(name):
            check = check_peer(case, inputs, name, call)
            if checks is not None:
                checks.append(check)
            if check.ok:
                chosen[name] = call.bind(inputs.q, inputs.k)
    times: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(rounds):
        for name, fn in chosen.items():
            times[name].append(time_fn(fn, case.device, min_run_time / rounds))
    graphed = {name: graph_time(fn) for name, fn in chosen.items()
               if case.device == "cuda" and graphable(name)}
    return [Result(case, name, statistics.median(t), tuple(t), graphed.get(name))
            for name, t in times.items()]


def graphable(provider: str) -> bool:
    """Providers timed in a CUDA graph too: eager calls, forward and backward (autograd's
    backward captures as torch.cuda.make_graphed_callables captures it); not compiled
    functions, which keep their own machinery (and graphs, in reduce-overhead mode). A
    provider whose capture fails anyway gets no graph time."""
    return not provider.startswith("compiled")


def graph_time(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float | None:
    """Seconds per call of fn in a replayed CUDA graph of `calls` calls (median of `replays`
    replays): the GPU's time without the host's launch cost, which bounds an eager call at a
    few tens of microseconds whatever the kernel (a decode step's copy_ took 21 us on an H200,
    launch-bound). None where fn cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        for s, e in zip(start, end):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) / calls / 1e3
    except Exception:  # noqa: BLE001 (a provider that cannot be captured gets no graph time)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None


def paired_ratio(num: Result, den: Result) -> float:
    """num's time / den's: the median of the two's ratios round by round, when both were timed
    in the same interleaved rounds, else the ratio of their medians. A round's two timings are
    made within a second of each other, so a slow spell of the machine (other tenants, its
    clock) that lasts a round or two moves both, where the ratio of medians can set one
    provider's fast rounds against the other's slow ones: on a host whose copy_ time swung
    2.7x in a session, one run's fused / RoPE alone said 1.45 and A/B runs right after it
    1.07-1.18."""
    if num.rounds and len(num.rounds) == len(den.rounds):
        return statistics.median(a / b for a, b in zip(num.rounds, den.rounds))
    return num.seconds / den.seconds


def target_ratios(results: list[Result]) -> list[dict]:
    """QK_NORM_TARGETS's and KV_TARGETS's ratios (time / time, paired_ratio) for each case that timed both
    providers."""
    rows = []
    for label in dict.fromkeys(r.case.label() for r in results):
        by = {r.provider: r for r in results if r.case.label() == label}
        device = next(r.case.device for r in results if r.case.label() == label)
        for what, num, den, cmp, target, only_on, *case in QK_NORM_TARGETS + KV_TARGETS:
            if num not in by or den not in by or only_on not in (None, device) or (
                    case and case[0] is not None and not label.startswith(case[0])):
                continue

            def judged(name: str, ratio: float) -> dict:
                met = None if target is None else (ratio <= target if cmp == "<=" else
                                                   ratio >= target)
                return dict(case=label, ratio=name, value=ratio,
                            target=None if target is None else f"{cmp} {target:g}", met=met)

            rows.append(judged(what, paired_ratio(by[num], by[den])))
            graphs = by[num].graph_seconds, by[den].graph_seconds
            if None not in graphs:  # the GPU's own times, without the host's launch cost
                rows.append(judged(what + " (CUDA graph)", graphs[0] / graphs[1]))
    return rows


def markdown_table(results: list[Result], checks: Sequence[Check] = ()) -> str:
    """One row per provider: ms, GB/s, ratio to the bound it competes with, speedups; for
    QK-norm cases, a table of the issue's target ratios under it; for cases with third-party
    providers, their checks against the float64 reference (check_table)."""
    targets = target_ratios(results)
    lines = []
    for label in dict.fromkeys(r.case.label() for r in results):
        rows = [r for r in results if r.case.label() == label]
        by = {r.provider: r for r in rows}
        copy = by.get("copy_ (bound, in-place)")
        clone = by.get("clone (bound, out-of-place)")
        graphed = any(r.graph_seconds is not None for r in rows)
        lines += [f"**{label}**", "",
                  "| provider | ms | GB/s | time / copy_ | time / clone |"
                  + (" GPU us, CUDA graph | graph time / copy_'s |" if graphed else ""),
                  "|---|---:|---:|---:|---:|" + ("---:|---:|" if graphed else "")]
        for r in rows:
            line = (f"| {r.provider} | {r.seconds * 1e3:.3f} | {r.gbps:.1f} | "
                    f"{paired_ratio(r, copy):.2f} | {paired_ratio(r, clone):.2f} |")
            if graphed:
                g, bound = r.graph_seconds, copy.graph_seconds if copy else None
                line += (f" {g * 1e6:.1f} |" if g is not None else " - |")
                line += (f" {g / bound:.2f} |" if g is not None and bound else " - |")
            lines.append(line)
        lines.append("")
        mine = [t for t in targets if t["case"] == label]
        if mine:
            lines += ["| ratio (time / time) | value | target | met |", "|---|---:|---:|---|"]
            for t in mine:
                met = {None: "", True: "yes", False: "**no**"}[t["met"]]
                lines.append(f"| {t['ratio']} | {t['value']:.2f} | {t['target'] or '-'} | "
                             f"{met} |")
            lines += ["", "fwd+bwd rows: forward and backward (q, k and both weights); their "
                      "GB/s counts only the forward's bytes.", ""]
        lines += check_table([c.as_dict() for c in checks if c.case.label() == label])
    return "\n".join(lines)
