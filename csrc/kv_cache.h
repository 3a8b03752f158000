// The fused RoPE + KV-cache write (rotary_kv_cache_update, csrc/rope_ops.cpp): what a kernel
// needs to rotate q, rotate k into its cache slot and copy v into its own, token by token.
//
// No torch includes, as rope_math.h: the CPU kernels and the tests read the same struct and
// the same slot arithmetic.
#pragma once

#include <cstdint>

#include "rope_math.h"

namespace rope_ext {

// How a cache stores what the call writes: the tensors' own element type, or float8 with a
// scale (stored value: saturate(x / scale) rounded to nearest even, x the float32 value).
enum class CacheStore : int { kSame = 0, kFloat8E4M3 = 1, kFloat8E5M2 = 2 };

// One cache, [num_blocks, block_size, H_kv, D] ("NHD") or [num_blocks, H_kv, block_size, D]
// ("HND"), by its strides in elements.
struct CacheTarget {
  void* data;
  int64_t block_stride;  // between blocks
  int64_t slot_stride;   // between the slots of one block
  int64_t head_stride;   // between heads
  int64_t head_dim;      // features a row writes (stride 1)
  CacheStore store;
  const float* scale;    // float8: 1 value, or one per head (scale_stride 1); else nullptr
  int64_t scale_stride;
};

// Every token of a call, by the multi-index of its leading dims other than the head dim
// (e.g. (b, s) of [B, S, H, D]); offsets and strides in elements. A token's heads share its
// position and its slot.
struct KvCacheParams {
  // The table, positions and flags (RotaryParams' own fields; its operands are unused). A
  // token's positions offset is sum(index[d] * pos_strides[d]).
  RotaryParams rot;
  int64_t ndim;  // token dims
  int64_t sizes[kMaxDims];
  int64_t tokens;  // product of sizes
  int64_t pos_strides[kMaxDims];
  int64_t slot_strides[kMaxDims];
  const void* slots;  // int32 or int64 (slots_int64); a negative slot writes nothing
  bool slots_int64;
  int64_t block_size;
  int64_t num_slots;  // num_blocks * block_size of the caches

  // Sources: q (rotated into q_out, which may be q), k (rotated into k's cache unless
  // rotate_k is false: then k already holds the rows to store), v (copied into v's cache).
  // A null source is skipped. Each has H rows per token, head_stride apart.
  const void* q;
  void* q_out;
  int64_t q_heads, q_head_stride, q_out_head_stride;
  int64_t q_strides[kMaxDims], q_out_strides[kMaxDims];
  const void* k;
  bool rotate_k;
  int64_t k_strides[kMaxDims];
  int64_t k_head_stride;
  const void* v;
  int64_t v_strides[kMaxDims];
  int64_t v_head_stride;
  int64_t kv_heads;
  int64_t head_dim;  // q and k rows
  CacheTarget k_cache, v_cache;
};

// Offsets of token `token` (linear over the token dims, last fastest): q, q_out, k, v,
// positions and slots, each by its strides. index_t: the type of the division (the CUDA
// kernel divides in 32 bits where every offset fits).
struct TokenOffsets {
  int64_t q, q_out, k, v, pos, slot;
};

template <typename index_t = int64_t>
ROPE_HD TokenOffsets token_offsets(const KvCacheParams& p, index_t token) {
  TokenOffsets o{0, 0, 0, 0, 0, 0};
  for (int64_t d = p.ndim - 1; d >= 0; --d) {
    const index_t idx = token % static_cast<index_t>(p.sizes[d]);
    token /= static_cast<index_t>(p.sizes[d]);
    o.q += idx * p.q_strides[d];
    o.q_out += idx * p.q_out_strides[d];
    o.k += idx * p.k_strides[d];
    o.v += idx * p.v_strides[d];
    o.pos += idx * p.pos_strides[d];
    o.slot += idx * p.slot_strides[d];
  }
  return o;
}

// The slot of a token whose slots offset is slot_offset.
ROPE_HD int64_t token_slot(const KvCacheParams& p, int64_t slot_offset) {
  return p.slots_int64 ? static_cast<const int64_t*>(p.slots)[slot_offset]
                       : static_cast<const int32_t*>(p.slots)[slot_offset];
}

// Element offset of head 0 of slot `slot` (>= 0) in cache c: block slot / block_size, slot
// slot % block_size in it.
ROPE_HD int64_t cache_row(const CacheTarget& c, int64_t slot, int64_t block_size) {
  return (slot / block_size) * c.block_stride + (slot % block_size) * c.slot_stride;
}

}  // namespace rope_ext
