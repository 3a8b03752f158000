// Every op of rope_ext, in one place. Backends only add implementations
// (TORCH_LIBRARY_IMPL in cpu/, cuda/, rope_composite.cpp, rope_autograd.cpp).
//
// The table argument `freqs_cis` of the ops is the real view [P, R/2, 2] (cos, sin) of the
// complex LLaMA table, float32 or float64; the Python wrappers accept the complex form too.
#include <torch/library.h>

TORCH_LIBRARY(rope_ext, m) {
  // The scaling variants of Hugging Face transformers configs (rope_parameters / rope_scaling);
  // rope_type "default" is plain RoPE. See csrc/rope_scaling.h.
#define ROPE_EXT_SCALING_ARGS                                                                  \
  "str rope_type=\"default\", float? factor=None, int? original_max_position_embeddings=None, " \
  "int? max_position_embeddings=None, int? seq_len=None, float low_freq_factor=1.0, "          \
  "float high_freq_factor=4.0, float? beta_fast=None, float? beta_slow=None, "                 \
  "float? mscale=None, float? mscale_all_dim=None, float? attention_factor=None, "             \
  "bool truncate=True, float[]? long_factor=None, float[]? short_factor=None, "                \
  "float partial_rotary_factor=1.0"
  // The LLaMA table polar(attention_factor, outer(arange(end), inv_freq)) as its real view
  // [end, dim // 2, 2], angles in float64 rounded once. dtype float32 (default) or float64.
  m.def("precompute_freqs_cis(int dim, int end, float theta=10000.0, *, ScalarType? dtype=None, "
        "Device? device=None, " ROPE_EXT_SCALING_ARGS ") -> Tensor");
  // The float64 inverse frequencies [dim // 2] (CPU) and attention factor behind that table.
  m.def("rope_frequencies(int dim, float theta=10000.0, *, " ROPE_EXT_SCALING_ARGS
        ") -> (Tensor, float)");
  // Fills out [end, R/2, 2] with magnitude * (cos, sin)(t * inv_freq[i]); inv_freq is float64
  // [R/2] on out's device. The backend kernel behind precompute_freqs_cis.
  m.def("fill_freqs_cis_(Tensor(a!) out, Tensor inv_freq, float magnitude) -> ()");

  // Rotates x [..., head_dim] by freqs_cis; a row's position is offset + positions[...] with
  // positions (int32/int64, broadcastable to x.shape[:-1]), else offset + its index along
  // seq_dim. Features [R, head_dim) pass through. MRoPE (Qwen2-VL and later): with
  // mrope_section of A ints, positions is [A, *b] (*b broadcastable to x.shape[:-1]) and pair
  // i turns by offset + positions[axis(i), ...]: axis(i) the section holding i (the sections
  // sum to R/2), or with mrope_interleaved Qwen3-VL's interleaving (A = 3).
  m.def(
      "apply_rotary(Tensor x, Tensor freqs_cis, Tensor? positions=None, SymInt offset=0, "
      "int seq_dim=1, bool interleaved=True, bool inverse=False, int[]? mrope_section=None, "
      "bool mrope_interleaved=False) -> Tensor");
  m.def(
      "apply_rotary_(Tensor(a!) x, Tensor freqs_cis, Tensor? positions=None, SymInt offset=0, "
      "int seq_dim=1, bool interleaved=True, bool inverse=False, int[]? mrope_section=None, "
      "bool mrope_interleaved=False) -> ()");
  // q and k (head counts may differ) in one kernel launch.
  m.def(
      "apply_rotary_qk(Tensor q, Tensor k, Tensor freqs_cis, Tensor? positions=None, "
      "SymInt offset=0, int seq_dim=1, bool interleaved=True, bool inverse=False, "
      "int[]? mrope_section=None, bool mrope_interleaved=False) -> (Tensor, Tensor)");
  m.def(
      "apply_rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor freqs_cis, Tensor? positions=None, "
      "SymInt offset=0, int seq_dim=1, bool interleaved=True, bool inverse=False, "
      "int[]? mrope_section=None, bool mrope_interleaved=False) -> ()");

  // Fused per-head RMSNorm + RoPE of QK-norm models (Qwen3, Gemma 3; csrc/qk_norm.h): each row
  // of q and k becomes rotate(x / sqrt(mean(x^2) + eps) * (weight + weight_offset)), the norm
  // over the whole head_dim, in float32 (float64 for float64 rows), rounded once. q_weight and
  // k_weight are [head_dim], float32 or their tensor's dtype. The rotation's arguments are
  // apply_rotary_qk's.
#define ROPE_EXT_NORM_ARGS                                                                    \
  "Tensor q_weight, Tensor k_weight, Tensor freqs_cis, Tensor? positions=None, "             \
  "SymInt offset=0, int seq_dim=1, bool interleaved=True, float eps=1e-06, "                 \
  "float weight_offset=0.0, int[]? mrope_section=None, bool mrope_interleaved=False"
  m.def("rms_norm_rotary_qk(Tensor q, Tensor k, " ROPE_EXT_NORM_ARGS ") -> (Tensor, Tensor)");
  m.def("rms_norm_rotary_qk_(Tensor(a!) q, Tensor(b!) k, " ROPE_EXT_NORM_ARGS ") -> ()");
  // Gradients of q, k, q_weight and k_weight, given those of rms_norm_rotary_qk's outputs.
  m.def("rms_norm_rotary_qk_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, "
        ROPE_EXT_NORM_ARGS ") -> (Tensor, Tensor, Tensor, Tensor)");
#undef ROPE_EXT_NORM_ARGS

  // Fused RoPE + KV-cache write (csrc/kv_cache.h): q rotated (and normed with q_weight), each
  // token's k row normed (k_weight), rotated and written to its slot of k_cache, its v row
  // written unrotated to v_cache; k and v are read only. q, k, v: [B, S, H, D] (seq_dim 1),
  // [B, H, S, D] (seq_dim 2) or [T, H, D] (seq_dim 0), one dtype, H_q and H_kv heads, v's
  // head_dim may differ. Caches [num_blocks, block_size, H_kv, D] ("NHD") or [num_blocks,
  // H_kv, block_size, D] ("HND"), q's dtype or float8 (e4m3fn, e5m2) with float32 k_scale /
  // v_scale of 1 or H_kv values (stored: saturate(x / scale), rounded once). slots and
  // positions: one per token, broadcastable to k.shape[:-1] with size 1 along the heads; slot
  // = block * block_size + index in block, negative: not written.
#define ROPE_EXT_KV_ARGS                                                                      \
  "Tensor k, Tensor v, Tensor freqs_cis, Tensor(b!) k_cache, Tensor(c!) v_cache, "           \
  "Tensor slots, Tensor? positions=None, SymInt offset=0, int seq_dim=1, "                   \
  "bool interleaved=True, str cache_layout=\"NHD\", Tensor? k_scale=None, "                  \
  "Tensor? v_scale=None, Tensor? q_weight=None, Tensor? k_weight=None, float eps=1e-06, "    \
  "float weight_offset=0.0"
  m.def("rotary_kv_cache_update(Tensor q, " ROPE_EXT_KV_ARGS ") -> Tensor");
  m.def("rotary_kv_cache_update_(Tensor(a!) q, " ROPE_EXT_KV_ARGS ") -> ()");
#undef ROPE_EXT_KV_ARGS

  // The checks of an in-place call's targets (x, or q and k), under op's name: each distinct
  // memory, q and k disjoint. The ops' autograd kernels call it where they write through
  // copy_ instead of the in-place op (csrc/autograd_common.h).
  m.def("check_inplace(str op, Tensor[] targets) -> ()");

  // Gradient of sum(grad * apply_rotary(x, freqs_cis, ...)) with respect to freqs_cis, shaped
  // like freqs_cis. Composed of stock torch ops (rope_ext/_autograd.py).
  m.def(
      "rotary_table_grad(Tensor grad, Tensor x, Tensor freqs_cis, Tensor? positions, "
      "SymInt offset, int seq_dim, bool interleaved, bool inverse, int[]? mrope_section, "
      "bool mrope_interleaved) -> Tensor");

  // Tests: sm_count > 0 makes the CPU ops run the CUDA kernels emulated on the host, with
  // every memory access checked, on a GPU of sm_count SMs holding blocks_per_sm blocks each
  // (csrc/cuda/rope_cuda_emulate.cpp); 0 turns it off. Returns the launches made since the
  // last call, one line each.
  m.def("_cuda_emulation(int sm_count, int blocks_per_sm=3) -> str");

  // Which kernels this build holds, as "key=value" lines (python -m rope_ext prints them).
  m.def("build_info() -> str");
}
