// The bodies of the fused RoPE + KV-cache write ops (schemas in rope_ops.cpp, kernel
// parameters in kv_cache.h): validate everything, then write. A backend supplies a
// KvCacheBackend beside its Backend and NormBackend and registers these functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string_view>

#include "kv_cache.h"
#include "qk_norm_ops.h"

namespace rope_ext {

struct KvCacheBackend {
  // Runs the tokens of p; x_dtype is the element type of its sources (q, k, v).
  void (*launch)(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
                 c10::Device device);
  // Rejects positions outside the table, slots >= num_slots and a non-negative slot given
  // to two tokens, before anything is written, where the backend can read them without a
  // device synchronisation; nullptr where the kernel asserts instead.
  void (*check_tokens)(const char* op, const KvCacheParams& p, int64_t num_slots);
};

// The arguments of one call, as the ops take them.
struct KvCacheArgs {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const at::Tensor& table;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& slots;
  const std::optional<at::Tensor>& positions;
  int64_t offset;
  int64_t seq_dim;
  bool interleaved;
  std::string_view cache_layout;
  const std::optional<at::Tensor>& k_scale;
  const std::optional<at::Tensor>& v_scale;
  const std::optional<at::Tensor>& q_weight;
  const std::optional<at::Tensor>& k_weight;
  double eps;
  double weight_offset;
};

// Every check of a call that needs no tensor values (csrc/kv_cache_ops.cpp; mirrored in
// rope_ext/_checks.py). q_out is q for the in-place op, else nullptr. Returns the head dim of
// q and k.
int64_t check_kv_cache_args(const char* op, const KvCacheArgs& a, bool inplace);

// The kernel parameters of a call whose q is written to q_out (nullptr: q not rotated), k
// read from k_src (rotated unless rotate_k is false; nullptr: no k rows) and v from v_src
// (nullptr: no v rows). heads_dim: as check_kv_cache_args returned it.
KvCacheParams make_kv_cache_params(const KvCacheArgs& a, int64_t heads_dim,
                                   const at::Tensor* q_out, const at::Tensor* k_src,
                                   bool rotate_k, const at::Tensor* v_src);

// The call behind both ops, once check_kv_cache_args passed: q is rotated (and normed) into
// q_out.
void kv_cache_update(const Backend& b, const NormBackend& n, const KvCacheBackend& kv,
                     const char* op, const KvCacheArgs& a, int64_t heads_dim,
                     const at::Tensor& q_out);

template <const Backend& B, const NormBackend& N, const KvCacheBackend& KV>
at::Tensor rotary_kv_cache_update(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& freqs_cis,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
    const std::optional<at::Tensor>& positions, c10::SymInt offset, int64_t seq_dim,
    bool interleaved, c10::string_view cache_layout, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& q_weight,
    const std::optional<at::Tensor>& k_weight, double eps, double weight_offset) {
  const KvCacheArgs a{q, k, v, freqs_cis, k_cache, v_cache, slots, positions,
                      offset.expect_int(), seq_dim, interleaved,
                      std::string_view(cache_layout.data(), cache_layout.size()), k_scale,
                      v_scale, q_weight, k_weight, eps, weight_offset};
  constexpr const char* op = "rotary_kv_cache_update";
  const int64_t heads_dim = check_kv_cache_args(op, a, /*inplace=*/false);
  at::Tensor q_out = at::empty_like(q);
  kv_cache_update(B, N, KV, op, a, heads_dim, q_out);
  return q_out;
}

template <const Backend& B, const NormBackend& N, const KvCacheBackend& KV>
void rotary_kv_cache_update_(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& freqs_cis,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
    const std::optional<at::Tensor>& positions, c10::SymInt offset, int64_t seq_dim,
    bool interleaved, c10::string_view cache_layout, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& q_weight,
    const std::optional<at::Tensor>& k_weight, double eps, double weight_offset) {
  const KvCacheArgs a{q, k, v, freqs_cis, k_cache, v_cache, slots, positions,
                      offset.expect_int(), seq_dim, interleaved,
                      std::string_view(cache_layout.data(), cache_layout.size()), k_scale,
                      v_scale, q_weight, k_weight, eps, weight_offset};
  constexpr const char* op = "rotary_kv_cache_update_";
  const int64_t heads_dim = check_kv_cache_args(op, a, /*inplace=*/true);
  kv_cache_update(B, N, KV, op, a, heads_dim, q);
}

}  // namespace rope_ext
