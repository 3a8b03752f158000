// The fused RoPE + KV-cache write: argument checks, kernel parameters and the call itself
// (csrc/kv_cache_ops.h). Every message names the argument, what was expected and what came;
// rope_ext/_checks.py mirrors them word for word for the fake kernels.
#include "kv_cache_ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "rope_checks.h"

namespace rope_ext {
namespace {

bool is_float8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// The dims of x but `skip`, as a list (for messages and comparisons).
std::vector<int64_t> sizes_without(const at::Tensor& x, int64_t skip) {
  std::vector<int64_t> out;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d != skip) {
      out.push_back(x.size(d));
    }
  }
  return out;
}

// Whether a tensor of `sizes` broadcasts to k's leading dims `lead` with size 1 (or no dim)
// at heads_dim: one value per token.
bool per_token(at::IntArrayRef sizes, at::IntArrayRef lead, int64_t heads_dim) {
  if (sizes.size() > lead.size()) {
    return false;
  }
  for (size_t i = 1; i <= sizes.size(); ++i) {
    const int64_t d = static_cast<int64_t>(lead.size() - i);
    const int64_t s = sizes[sizes.size() - i];
    if (!(s == 1 || (s == lead[d] && d != heads_dim))) {
      return false;
    }
  }
  return true;
}

void check_cache(const char* op, const char* name, const at::Tensor& cache, bool hnd,
                 const at::Tensor& q, const at::Tensor& x, const char* x_name, int64_t heads,
                 const std::optional<at::Tensor>& scale, const char* scale_name) {
  TORCH_CHECK_VALUE(cache.dim() == 4, op, ": ", name, " must have 4 dims, [num_blocks, ",
                    hnd ? "H_kv, block_size" : "block_size, H_kv", ", head_dim] for cache_layout=\"",
                    hnd ? "HND" : "NHD", "\", got shape ", cache.sizes());
  TORCH_CHECK_VALUE(cache.device() == q.device(), op, ": ", name, " is on ", cache.device(),
                    " but q is on ", q.device());
  const at::ScalarType t = cache.scalar_type();
  TORCH_CHECK_TYPE(t == q.scalar_type() || is_float8(t), op, ": ", name,
                   " must have q's dtype (", q.scalar_type(),
                   ") or be float8_e4m3fn or float8_e5m2, got ", t);
  const int64_t cache_heads = cache.size(hnd ? 1 : 2);
  TORCH_CHECK_VALUE(cache_heads == heads, op, ": ", name, " holds ", cache_heads, " heads (dim ",
                    hnd ? 1 : 2, ") but ", x_name, " has ", heads);
  TORCH_CHECK_VALUE(cache.size(3) == x.size(-1), op, ": ", name, "'s head_dim ", cache.size(3),
                    " differs from ", x_name, "'s ", x.size(-1));
  TORCH_CHECK_VALUE(cache.stride(3) == 1 || cache.size(3) <= 1, op, ": ", name,
                    " must have contiguous features (stride 1 along head_dim), got strides ",
                    cache.strides());
  if (!is_float8(t)) {
    TORCH_CHECK_VALUE(!scale.has_value(), op, ": ", scale_name, " is only for float8 caches; ",
                      name, " is ", t);
    return;
  }
  TORCH_CHECK_VALUE(scale.has_value(), op, ": a float8 ", name, " needs ", scale_name,
                    " (float32, 1 value or one per head)");
  const at::Tensor& s = *scale;
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": ", scale_name,
                   " must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() <= 1 && (s.numel() == 1 || s.numel() == heads), op, ": ",
                    scale_name, " must hold 1 value or one per head (", heads, "), got shape ",
                    s.sizes());
  TORCH_CHECK_VALUE(s.device() == q.device(), op, ": ", scale_name, " is on ", s.device(),
                    " but q is on ", q.device());
}

// Every tensor the call writes (the caches, and q in place) shares no memory with another
// tensor of the call.
void check_kv_disjoint(const char* op, const KvCacheArgs& a, bool inplace) {
  constexpr const char* needs = "the call needs";
  constexpr const char* fix = "pass tensors that do not share memory";
  check_disjoint(op, "k_cache", a.k_cache, "v_cache", a.v_cache, needs, fix);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &a.q},
                                {"k", &a.k}, {"v", &a.v}}) {
    check_disjoint(op, name, *t, "k_cache", a.k_cache, needs, fix);
    check_disjoint(op, name, *t, "v_cache", a.v_cache, needs, fix);
  }
  if (inplace) {
    check_disjoint(op, "q", a.q, "k", a.k, needs, fix);
    check_disjoint(op, "q", a.q, "v", a.v, needs, fix);
  }
}

// Strides of a per-token tensor t (right-aligned against k's leading dims) along token dim
// d of k, 0 where t broadcasts.
int64_t token_stride(const at::Tensor& t, int64_t lead, int64_t d) {
  const int64_t td = d - (lead - t.dim());
  return td >= 0 && t.size(td) != 1 ? t.stride(td) : 0;
}

CacheTarget cache_target(const at::Tensor& cache, bool hnd,
                         const std::optional<at::Tensor>& scale) {
  CacheTarget c{};
  c.data = cache.data_ptr();
  c.block_stride = cache.stride(0);
  c.slot_stride = cache.stride(hnd ? 2 : 1);
  c.head_stride = cache.stride(hnd ? 1 : 2);
  c.head_dim = cache.size(3);
  c.store = cache.scalar_type() == at::kFloat8_e4m3fn ? CacheStore::kFloat8E4M3
            : cache.scalar_type() == at::kFloat8_e5m2 ? CacheStore::kFloat8E5M2
                                                      : CacheStore::kSame;
  if (c.store != CacheStore::kSame) {
    c.scale = scale->data_ptr<float>();
    c.scale_stride = scale->numel() == 1 ? 0 : scale->stride(-1);
  }
  return c;
}

}  // namespace

int64_t check_kv_cache_args(const char* op, const KvCacheArgs& a, bool inplace) {
  const at::Tensor& q = a.q;
  const at::Tensor& k = a.k;
  const at::Tensor& v = a.v;
  TORCH_CHECK_VALUE(q.dim() == 3 || q.dim() == 4, op,
                    ": q must have 3 or 4 dims ([T, H, D], [B, S, H, D] or [B, H, S, D]), got ",
                    q.dim());
  const int64_t ndim = q.dim();
  const int64_t sd = a.seq_dim < 0 ? a.seq_dim + ndim : a.seq_dim;
  TORCH_CHECK_VALUE(sd >= 0 && sd <= ndim - 2, op, ": seq_dim must name a dim of q other than "
                    "the last, in [", -ndim, ", -2] or [0, ", ndim - 2, "], got ", a.seq_dim);
  // The heads are the dim before head_dim, or the one before that when it is the sequence.
  const int64_t heads_dim = sd == ndim - 2 ? ndim - 3 : ndim - 2;
  detail::check_qk_args(op, q, k, a.table, a.positions, a.offset, a.seq_dim, std::nullopt,
                        false);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                   ": q, k and v must have one dtype, got ", q.scalar_type(), ", ",
                   k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK_VALUE(k.dim() == ndim && v.dim() == ndim, op,
                    ": q, k and v must have the same number of dims, got ", ndim, ", ", k.dim(),
                    " and ", v.dim());
  TORCH_CHECK_VALUE(sizes_without(q, heads_dim) == sizes_without(k, heads_dim), op, ": q and k must agree on every dim but the heads (dim ", heads_dim,
                    "), got shapes ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK_VALUE(v.sizes().slice(0, ndim - 1) == k.sizes().slice(0, ndim - 1), op,
                    ": v must match k on every dim but head_dim, got shapes ", v.sizes(),
                    " and ", k.sizes());
  TORCH_CHECK_VALUE(v.device() == q.device(), op, ": v is on ", v.device(), " but q is on ",
                    q.device());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k},
                                {"v", &v}}) {
    TORCH_CHECK_VALUE(t->stride(-1) == 1 || t->size(-1) <= 1, op, ": ", name,
                      " must have contiguous features (stride 1 along head_dim), got strides ",
                      t->strides());
  }
  TORCH_CHECK_VALUE(a.cache_layout == "NHD" || a.cache_layout == "HND", op,
                    ": cache_layout must be \"NHD\" or \"HND\", got \"",
                    std::string(a.cache_layout), "\"");
  const bool hnd = a.cache_layout == "HND";
  const int64_t heads = k.size(heads_dim);
  check_cache(op, "k_cache", a.k_cache, hnd, q, k, "k", heads, a.k_scale, "k_scale");
  check_cache(op, "v_cache", a.v_cache, hnd, q, v, "v", heads, a.v_scale, "v_scale");
  TORCH_CHECK_VALUE(a.v_cache.size(0) == a.k_cache.size(0) &&
                        a.v_cache.size(hnd ? 2 : 1) == a.k_cache.size(hnd ? 2 : 1),
                    op, ": k_cache and v_cache must have the same num_blocks and block_size, got "
                    "shapes ", a.k_cache.sizes(), " and ", a.v_cache.sizes());
  const auto lead = k.sizes().slice(0, ndim - 1);
  const at::Tensor& slots = a.slots;
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kInt || slots.scalar_type() == at::kLong, op,
                   ": slots must be an int32 or int64 tensor, got ", slots.scalar_type());
  TORCH_CHECK_VALUE(slots.device() == q.device(), op, ": slots is on ", slots.device(),
                    " but q is on ", q.device());
  TORCH_CHECK_VALUE(per_token(slots.sizes(), lead, heads_dim), op, ": slots of shape ",
                    slots.sizes(), " must broadcast to k.shape[:-1] = ", lead,
                    " with size 1 along the heads (dim ", heads_dim, "): one slot per token");
  if (a.positions.has_value()) {
    TORCH_CHECK_VALUE(per_token(a.positions->sizes(), lead, heads_dim), op,
                      ": positions of shape ", a.positions->sizes(),
                      " must broadcast to k.shape[:-1] = ", lead,
                      " with size 1 along the heads (dim ", heads_dim,
                      "): one position per token");
  }
  TORCH_CHECK_VALUE(a.q_weight.has_value() == a.k_weight.has_value(), op,
                    ": q_weight and k_weight go together (the fused QK-norm), got only ",
                    a.q_weight.has_value() ? "q_weight" : "k_weight");
  if (a.q_weight.has_value()) {
    check_norm_weight(op, "q_weight", *a.q_weight, "q", q);
    check_norm_weight(op, "k_weight", *a.k_weight, "k", k);
    check_norm_eps(op, a.eps);
  }
  constexpr const char* cache_needs = "the cache write needs";
  constexpr const char* cache_fix = "pass caches whose elements are distinct";
  check_inplace_target(op, "k_cache", a.k_cache, cache_needs, cache_fix);
  check_inplace_target(op, "v_cache", a.v_cache, cache_needs, cache_fix);
  if (inplace) {
    check_inplace_target(op, "q", q);
  }
  check_kv_disjoint(op, a, inplace);
  return heads_dim;
}

KvCacheParams make_kv_cache_params(const KvCacheArgs& a, int64_t heads_dim,
                                   const at::Tensor* q_out, const at::Tensor* k_src,
                                   bool rotate_k, const at::Tensor* v_src) {
  KvCacheParams p{};
  p.rot = make_params(a.table, a.positions, a.offset, a.interleaved, /*inverse=*/false,
                      std::nullopt, false);
  const at::Tensor& k = a.k;
  const int64_t lead = k.dim() - 1;
  const int64_t sd = a.seq_dim < 0 ? a.seq_dim + k.dim() : a.seq_dim;
  p.ndim = 0;
  p.tokens = 1;
  for (int64_t d = 0; d < lead; ++d) {
    if (d == heads_dim) {
      continue;
    }
    const int64_t i = p.ndim++;
    p.sizes[i] = k.size(d);
    p.tokens *= k.size(d);
    p.q_strides[i] = a.q.stride(d);
    p.q_out_strides[i] = q_out != nullptr ? q_out->stride(d) : 0;
    p.k_strides[i] = k_src != nullptr ? k_src->stride(d) : 0;
    p.v_strides[i] = v_src != nullptr ? v_src->stride(d) : 0;
    p.pos_strides[i] = a.positions.has_value() ? token_stride(*a.positions, lead, d)
                                               : (d == sd ? 1 : 0);
    p.slot_strides[i] = token_stride(a.slots, lead, d);
  }
  p.slots = a.slots.data_ptr();
  p.slots_int64 = a.slots.scalar_type() == at::kLong;
  const bool hnd = a.cache_layout == "HND";
  p.block_size = a.k_cache.size(hnd ? 2 : 1);
  p.num_slots = a.k_cache.size(0) * p.block_size;
  p.q = q_out != nullptr ? a.q.data_ptr() : nullptr;
  p.q_out = q_out != nullptr ? q_out->data_ptr() : nullptr;
  p.q_heads = a.q.size(heads_dim);
  p.q_head_stride = a.q.stride(heads_dim);
  p.q_out_head_stride = q_out != nullptr ? q_out->stride(heads_dim) : 0;
  p.k = k_src != nullptr ? k_src->data_ptr() : nullptr;
  p.rotate_k = rotate_k;
  p.k_head_stride = k_src != nullptr ? k_src->stride(heads_dim) : 0;
  p.v = v_src != nullptr ? v_src->data_ptr() : nullptr;
  p.v_head_stride = v_src != nullptr ? v_src->stride(heads_dim) : 0;
  p.kv_heads = k.size(heads_dim);
  p.head_dim = k.size(-1);
  p.k_cache = cache_target(a.k_cache, hnd, a.k_scale);
  p.v_cache = cache_target(a.v_cache, hnd, a.v_scale);
  return p;
}

void kv_cache_update(const Backend& b, const NormBackend& n, const KvCacheBackend& kv,
                     const char* op, const KvCacheArgs& a, int64_t heads_dim,
                     const at::Tensor& q_out) {
  if (a.q.numel() == 0) {
    return;
  }
  const bool hnd = a.cache_layout == "HND";
  const KvCacheParams p = make_kv_cache_params(a, heads_dim, &q_out, &a.k, true, &a.v);
  if (kv.check_tokens != nullptr) {
    kv.check_tokens(op, p, a.k_cache.size(0) * a.k_cache.size(hnd ? 2 : 1));
  } else {
    detail::check_positions(b, op, a.positions, a.offset, a.table);
  }
  const at::ScalarType table_dtype = c10::toRealValueType(a.table.scalar_type());
  const at::ScalarType x_dtype = a.q.scalar_type();
  if (!a.q_weight.has_value()) {  // one pass: q rotated, k rotated into its cache, v copied
    kv.launch(p, x_dtype, table_dtype, a.q.device());
    return;
  }
  // With the QK-norm, q and k go through the fused norm kernel first, k into a buffer
  // (float32 for a float8 k cache, so that its values are rounded once), which the cache
  // write then copies: two passes over k.
  const bool k_float8 = is_float8(a.k_cache.scalar_type());
  const int64_t sd = a.positions.has_value() ? -1 : (a.seq_dim < 0 ? a.seq_dim + a.q.dim()
                                                                    : a.seq_dim);
  detail::norm_launch(n, op, {{a.q, q_out, *a.q_weight, nullptr, nullptr}}, a.table,
                      a.positions, a.offset, sd, a.interleaved, a.eps, a.weight_offset,
                      std::nullopt, false, /*backward=*/false);
  const at::Tensor k_in = k_float8 ? a.k.to(at::kFloat) : a.k;
  const at::Tensor k_weight = k_float8 ? a.k_weight->to(at::kFloat) : *a.k_weight;
  const at::Tensor k_normed = at::empty_like(k_in);
  detail::norm_launch(n, op, {{k_in, k_normed, k_weight, nullptr, nullptr}}, a.table,
                      a.positions, a.offset, sd, a.interleaved, a.eps, a.weight_offset,
                      std::nullopt, false, /*backward=*/false);
  const KvCacheParams kp = make_kv_cache_params(a, heads_dim, nullptr, &k_normed, false, nullptr);
  kv.launch(kp, k_normed.scalar_type(), table_dtype, a.q.device());
  const KvCacheParams vp = make_kv_cache_params(a, heads_dim, nullptr, nullptr, false, &a.v);
  kv.launch(vp, x_dtype, table_dtype, a.q.device());
}

}  // namespace rope_ext
