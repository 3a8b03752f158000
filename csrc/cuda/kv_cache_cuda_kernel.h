// The fused RoPE + KV-cache write on CUDA (rotary_kv_cache_update): the per-thread work and
// the launch plan, in a header that nvcc and the host compiler both build, as
// rope_cuda_kernel.h. rope_cuda.cu wraps kv_cache_thread() in a __global__ kernel;
// rope_cuda_emulate.cpp runs it on the host over every block and thread of the same plan,
// with every memory access checked (tests/test_cuda_emulation.py).
//
// Design (memory-bound; the bar is copying q, k and v once):
// - Token-major, one pass: a thread owns one 16-byte chunk ("lane") of one row of one token,
//   a q row, a k row or a v row. It reads the token's position and the lane's (cos, sin)
//   (rows of q and k), and the token's slot (rows of k and v), then the chunk, and writes it
//   once: q's rotated into q_out, k's rotated into its cache slot, v's copied into its own.
//   k is read once and never written back.
// - 16-byte loads and stores of rows (Bits128) on the vector path; a float8 cache row is
//   written in stores of the chunk's width in bytes (8 for a 16-bit x). The scalar path
//   (misaligned rows, widths that are not whole chunks) moves a lane's elements one by one.
// - Float8: x / scale, saturated to the format's finite range, rounded to nearest even once
//   from the float32 rotated value (as the CPU kernel, csrc/cpu/rope_cpu_kernel_impl.h).
// - A negative slot writes nothing (padding); a slot at or beyond num_blocks * block_size is
//   a device-side assert, as an out-of-range position is. Two tokens with one slot race: the
//   CPU op rejects them, the CUDA op cannot without reading the slots back (documented).
// - The grid is the resident capacity and threads stride over the items.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "../kv_cache.h"
#include "rope_cuda_kernel.h"

namespace rope_ext {
namespace cuda_kernel {

// The kernel's one argument.
struct KvKernelParams {
  KvCacheParams p;
  int32_t lanes;         // threads across a row: the most lanes of any row of a token
  int32_t rotary_lanes;  // lanes of the rotated features of a q or k row
  int32_t q_lanes;       // of a q row: rotary lanes, then pass-through ones (out of place)
  int32_t k_lanes;       // of a k row: rotary and pass-through, or all copied (!rotate_k)
  int32_t v_lanes;       // of a v row (copied)
  int32_t q_rows;        // rows of a token: q's, then k's, then v's (those the call has)
  int32_t k_rows;
  int32_t v_rows;
  int64_t items;         // tokens * (q_rows + k_rows + v_rows) * lanes
};

struct KvLaunchPlan {
  KvKernelParams k;
  int64_t grid;
  bool vector;      // the 16-byte path
  bool wide_index;  // int64 item indices and offsets
};

// Largest finite values of the float8 formats.
constexpr float kFloat8E4M3Max = 448.0f;
constexpr float kFloat8E5M2Max = 57344.0f;

// x / scale saturated to [-max, max] (NaN stays NaN), rounded to nearest even once.
template <typename fp8_t>
ROPE_HD uint8_t float8_bits(float x, float scale, float max) {
  const float y = x / scale;
  const float clamped = y < -max ? -max : (y > max ? max : y);  // NaN: both false
  return fp8_t(clamped).x;
}

// One lane's values, stored into dst + f: `count` elements (the lane's width on the vector
// path, where the stores are whole chunks; fewer at a row's end on the scalar path). The
// store is the cache's: the row's own type, or float8 bytes with the row's scale.
template <typename scalar_t, bool kVector, typename Mem>
ROPE_HD void store_lane(void* dst, int64_t f, const opmath_t<scalar_t>* values, int count,
                        CacheStore store, float scale, Mem& mem) {
  using Io = Packed<scalar_t>;
  constexpr int V = Io::kCount;
  if (store == CacheStore::kSame) {
    scalar_t* out = static_cast<scalar_t*>(dst) + f;
    if constexpr (kVector) {
      Bits128 b;
#pragma unroll
      for (int e = 0; e < V; ++e) Io::set(b, e, values[e]);
      mem.store128(out, b);
    } else {
#pragma unroll
      for (int e = 0; e < kScalarPassSpan; ++e) {
        if (e < count) mem.store(out + e, static_cast<scalar_t>(values[e]));
      }
    }
    return;
  }
  const bool e4m3 = store == CacheStore::kFloat8E4M3;
  const float max = e4m3 ? kFloat8E4M3Max : kFloat8E5M2Max;
  uint8_t* out = static_cast<uint8_t*>(dst) + f;
  if constexpr (kVector) {
    // V bytes: one store of the chunk's width (8, 4 or 2 bytes).
    Bits128 b{{0, 0, 0, 0}};
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x = static_cast<float>(values[e]);
      const uint32_t bits = e4m3 ? float8_bits<c10::Float8_e4m3fn>(x, scale, max)
                                 : float8_bits<c10::Float8_e5m2>(x, scale, max);
      b.w[e / 4] |= bits << (8 * (e % 4));
    }
    mem.template store_bytes<V>(out, b);
  } else {
#pragma unroll
    for (int e = 0; e < kScalarPassSpan; ++e) {
      if (e < count) {
        const float x = static_cast<float>(values[e]);
        mem.store(out + e, e4m3 ? float8_bits<c10::Float8_e4m3fn>(x, scale, max)
                                : float8_bits<c10::Float8_e5m2>(x, scale, max));
      }
    }
  }
}

// Loads `count` elements of a row from src + f as opmath values (a whole chunk on the vector
// path).
template <typename scalar_t, bool kVector, typename Mem>
ROPE_HD void load_lane(const scalar_t* src, int64_t f, opmath_t<scalar_t>* values, int count,
                       Mem& mem) {
  using Io = Packed<scalar_t>;
  if constexpr (kVector) {
    const Bits128 b = mem.load128(src + f);
#pragma unroll
    for (int e = 0; e < Io::kCount; ++e) values[e] = Io::get(b, e);
  } else {
#pragma unroll
    for (int e = 0; e < kScalarPassSpan; ++e) {
      if (e < count) values[e] = static_cast<opmath_t<scalar_t>>(mem.load(src + f + e));
    }
  }
}

// The work of one thread: items item, item + stride, ... of the plan.
template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector,
          typename index_t, typename Mem>
ROPE_HD void kv_cache_thread(const KvKernelParams& kp, int64_t item0, int64_t stride,
                             Mem& mem) {
  using opmath = opmath_t<scalar_t>;
  constexpr int V = Packed<scalar_t>::kCount;
  // Elements of a lane: a chunk on the vector path, kScalarPassSpan elements on the scalar
  // path. A rotary lane holds kPairs pairs: its elements (interleaved), or its elements in
  // each half (half-split, two chunks).
  constexpr int kSpan = kVector ? V : kScalarPassSpan;
  constexpr int kPairs = kInterleaved ? kSpan / 2 : kSpan;
  constexpr int kHalves = kInterleaved ? 1 : 2;
  constexpr bool kTableVecOk = kVector && (kPairs * 2 * sizeof(table_t)) % kChunkBytes == 0;
  const KvCacheParams& p = kp.p;
  const RotaryParams& r = p.rot;
  const int32_t rows = kp.q_rows + kp.k_rows + kp.v_rows;
  const int64_t d = p.head_dim;
  const int64_t rotated = 2 * r.rot_pairs;

#pragma unroll 1
  for (index_t item = static_cast<index_t>(item0); item < static_cast<index_t>(kp.items);
       item += static_cast<index_t>(stride)) {
    const int32_t lane = static_cast<int32_t>(item % kp.lanes);
    const index_t token_row = item / kp.lanes;
    const int32_t row = static_cast<int32_t>(token_row % rows);
    const index_t token = token_row / rows;
    // Which row: q's (kind 0), k's (1) or v's (2), and its head.
    const int kind = row < kp.q_rows ? 0 : row < kp.q_rows + kp.k_rows ? 1 : 2;
    const int64_t head = kind == 0 ? row : kind == 1 ? row - kp.q_rows
                                                     : row - kp.q_rows - kp.k_rows;
    const int32_t row_lanes = kind == 0 ? kp.q_lanes : kind == 1 ? kp.k_lanes : kp.v_lanes;
    if (lane >= row_lanes) {
      continue;
    }
    const TokenOffsets o = token_offsets<index_t>(p, token);
    // Where the row goes, and in what form.
    const scalar_t* src;
    void* dst;
    CacheStore store = CacheStore::kSame;
    float scale = 1.0f;
    int64_t width = d;  // features of the row
    bool rotates = false;
    if (kind == 0) {
      src = static_cast<const scalar_t*>(p.q) + o.q + head * p.q_head_stride;
      dst = static_cast<scalar_t*>(p.q_out) + o.q_out + head * p.q_out_head_stride;
      rotates = true;
    } else {
      const int64_t slot = p.slots_int64
                               ? mem.load(static_cast<const int64_t*>(p.slots) + o.slot)
                               : mem.load(static_cast<const int32_t*>(p.slots) + o.slot);
      if (slot < 0) {
        continue;  // padding: nothing written
      }
      mem.check_slot(slot < p.num_slots);
      const CacheTarget& c = kind == 1 ? p.k_cache : p.v_cache;
      const int64_t at = cache_row(c, slot, p.block_size) + head * c.head_stride;
      store = c.store;
      if (store == CacheStore::kSame) {
        dst = static_cast<scalar_t*>(c.data) + at;
      } else {
        dst = static_cast<uint8_t*>(c.data) + at;
        scale = mem.load(c.scale + head * c.scale_stride);
      }
      if (kind == 1) {
        src = static_cast<const scalar_t*>(p.k) + o.k + head * p.k_head_stride;
        rotates = p.rotate_k;
      } else {
        src = static_cast<const scalar_t*>(p.v) + o.v + head * p.v_head_stride;
        width = c.head_dim;
      }
    }

    opmath values[kHalves][kSpan];
    if (!rotates || lane >= kp.rotary_lanes) {
      // Copied as it is: a chunk of the pass-through features, or of a row written unrotated.
      const int64_t f = (rotates ? rotated : 0) +
                        static_cast<int64_t>(rotates ? lane - kp.rotary_lanes : lane) * kSpan;
      const int count = static_cast<int>(smaller<int64_t>(kSpan, width - f));
      load_lane<scalar_t, kVector>(src, f, values[0], count, mem);
      store_lane<scalar_t, kVector>(dst, f, values[0], count, store, scale, mem);
      continue;
    }

    // A rotary lane: pairs pair0 .. pair0 + pairs - 1.
    const int64_t pair0 = static_cast<int64_t>(lane) * kPairs;
    const int pairs = static_cast<int>(smaller<int64_t>(kPairs, r.rot_pairs - pair0));
    const int64_t position =
        r.offset + (r.positions == nullptr ? o.pos : load_position(r, o.pos, mem));
    mem.check_position(position >= 0 && position < r.table_rows);
    const auto* entry = static_cast<const table_t*>(r.table) + position * r.table_row_stride +
                        pair0 * r.table_pair_stride;
    opmath c[kPairs], s[kPairs];
    if constexpr (kTableVecOk) {
      constexpr int kPerVec = kChunkBytes / sizeof(table_t);
#pragma unroll
      for (int v = 0; v < kPairs * 2 / kPerVec; ++v) {
        const Bits128 t = mem.load128(entry + v * kPerVec);
#pragma unroll
        for (int e = 0; e < kPerVec; e += 2) {
          c[(v * kPerVec + e) / 2] = static_cast<opmath>(Packed<table_t>::get(t, e));
          s[(v * kPerVec + e) / 2] = static_cast<opmath>(Packed<table_t>::get(t, e + 1));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        if (j < pairs) {
          c[j] = static_cast<opmath>(mem.load(entry + j * r.table_pair_stride));
          s[j] = static_cast<opmath>(mem.load(entry + j * r.table_pair_stride + r.table_cs_stride));
        }
      }
    }
    // Elements of half h: features f0 + h * rot_pairs + e, e < count.
    const int64_t f0 = kInterleaved ? 2 * pair0 : pair0;
    const int count = kInterleaved ? 2 * pairs : pairs;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      load_lane<scalar_t, kVector>(src, f0 + h * r.rot_pairs, values[h], count, mem);
    }
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      if (i < pairs) {
        opmath& a = values[0][kInterleaved ? 2 * i : i];
        opmath& b = values[kHalves - 1][kInterleaved ? 2 * i + 1 : i];
        rotate_pair(a, b, c[i], s[i], a, b);
      }
    }
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      store_lane<scalar_t, kVector>(dst, f0 + h * r.rot_pairs, values[h], count, store, scale,
                                    mem);
    }
  }
}

// ---- Host side: the launch plan, shared by the CUDA launcher and the emulation ----

// Lanes of a row of `width` features whose first `rotated` are rotated (0: copied whole).
inline int32_t row_lanes(int64_t rotated, int64_t width, bool interleaved, int64_t span) {
  const int64_t pairs_per_lane = interleaved ? span / 2 : span;
  const int64_t rot = (rotated / 2 + pairs_per_lane - 1) / pairs_per_lane;
  return static_cast<int32_t>(rot + (width - rotated + span - 1) / span);
}

// Whether every row, cache row and width allows aligned 16-byte chunks (and float8 stores of
// a chunk's width).
inline bool kv_vectorisable(const KvCacheParams& p, size_t elem) {
  const int64_t n = kChunkBytes / static_cast<int64_t>(elem);
  const RotaryParams& r = p.rot;
  auto aligned = [&](const void* ptr, int64_t bytes) {
    return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
  };
  bool ok = (r.interleaved ? 2 * r.rot_pairs : r.rot_pairs) % n == 0 &&
            (p.head_dim - 2 * r.rot_pairs) % n == 0 && p.v_cache.head_dim % n == 0 &&
            aligned(p.q, kChunkBytes) && aligned(p.q_out, kChunkBytes) &&
            aligned(p.k, kChunkBytes) && aligned(p.v, kChunkBytes) &&
            p.q_head_stride % n == 0 && p.q_out_head_stride % n == 0 &&
            p.k_head_stride % n == 0 && p.v_head_stride % n == 0;
  for (int64_t d = 0; ok && d < p.ndim; ++d) {
    ok = p.q_strides[d] % n == 0 && p.q_out_strides[d] % n == 0 && p.k_strides[d] % n == 0 &&
         p.v_strides[d] % n == 0;
  }
  for (const CacheTarget* c : {&p.k_cache, &p.v_cache}) {
    const int64_t bytes = c->store == CacheStore::kSame ? kChunkBytes : n;  // a chunk's store
    ok = ok && aligned(c->data, bytes) && c->block_stride % n == 0 && c->slot_stride % n == 0 &&
         c->head_stride % n == 0;
  }
  return ok;
}

// Whether the call takes the 16-byte path: rows vectorisable, and the table readable as the
// vector kernel reads it (16-byte vectors of (cos, sin) pairs where a lane's pairs fill them).
inline bool kv_use_vector_path(const KvCacheParams& p, size_t elem, size_t table_elem) {
  const RotaryParams& r = p.rot;
  const int64_t n = kChunkBytes / static_cast<int64_t>(elem);
  const int64_t lane_bytes = (r.interleaved ? n / 2 : n) * 2 * static_cast<int64_t>(table_elem);
  const bool table_ok = lane_bytes % kChunkBytes != 0 ||
                        (r.table_pair_stride == 2 && r.table_cs_stride == 1 &&
                         reinterpret_cast<uintptr_t>(r.table) % kChunkBytes == 0 &&
                         r.table_row_stride * static_cast<int64_t>(table_elem) % kChunkBytes == 0);
  return table_ok && kv_vectorisable(p, elem);
}

// The largest element offset the launch computes from one base pointer (indices stay below
// it): rows, cache rows, positions, slots, the table and the item count.
inline int64_t kv_largest_offset(const KvCacheParams& p, int64_t items) {
  const RotaryParams& r = p.rot;
  int64_t largest = r.table_rows * r.table_row_stride + r.rot_pairs * r.table_pair_stride +
                    r.table_cs_stride;
  int64_t q = p.q_heads * std::max(p.q_head_stride, p.q_out_head_stride) + p.head_dim;
  int64_t kv = p.kv_heads * std::max(p.k_head_stride, p.v_head_stride) +
               std::max(p.head_dim, p.v_cache.head_dim);
  int64_t pos = 0, slot = 0;
  for (int64_t d = 0; d < p.ndim; ++d) {
    q += (p.sizes[d] - 1) * std::max(p.q_strides[d], p.q_out_strides[d]);
    kv += (p.sizes[d] - 1) * std::max(p.k_strides[d], p.v_strides[d]);
    pos += (p.sizes[d] - 1) * p.pos_strides[d];
    slot += (p.sizes[d] - 1) * p.slot_strides[d];
  }
  for (const CacheTarget* c : {&p.k_cache, &p.v_cache}) {
    const int64_t blocks = (p.num_slots + p.block_size - 1) / std::max<int64_t>(1, p.block_size);
    largest = std::max(largest, blocks * c->block_stride + p.block_size * c->slot_stride +
                                    p.kv_heads * c->head_stride + c->head_dim);
  }
  return std::max({largest, q, kv, pos, slot, 2 * items + kThreads});
}

// The plan of a launch on a GPU with sm_count SMs holding blocks_per_sm blocks each.
inline KvLaunchPlan plan_kv_cache(const KvCacheParams& p, size_t elem,
                                  size_t table_elem, int64_t sm_count, int64_t blocks_per_sm) {
  KvLaunchPlan plan{};
  KvKernelParams& k = plan.k;
  k.p = p;
  plan.vector = kv_use_vector_path(p, elem, table_elem);
  const int64_t span = plan.vector ? kChunkBytes / static_cast<int64_t>(elem) : kScalarPassSpan;
  const RotaryParams& r = p.rot;
  const int64_t rotated = 2 * r.rot_pairs;
  k.rotary_lanes = row_lanes(rotated, rotated, r.interleaved, span);
  const bool q_in_place = p.q_out == p.q;
  k.q_lanes = q_in_place ? k.rotary_lanes : row_lanes(rotated, p.head_dim, r.interleaved, span);
  k.k_lanes = row_lanes(p.rotate_k ? rotated : 0, p.head_dim, r.interleaved, span);
  k.v_lanes = row_lanes(0, p.v_cache.head_dim, r.interleaved, span);
  k.q_rows = p.q != nullptr ? static_cast<int32_t>(p.q_heads) : 0;
  k.k_rows = p.k != nullptr ? static_cast<int32_t>(p.kv_heads) : 0;
  k.v_rows = p.v != nullptr ? static_cast<int32_t>(p.kv_heads) : 0;
  k.lanes = std::max({k.q_rows > 0 ? k.q_lanes : 0, k.k_rows > 0 ? k.k_lanes : 0,
                      k.v_rows > 0 ? k.v_lanes : 0, 1});
  k.items = p.tokens * (k.q_rows + k.k_rows + k.v_rows) * k.lanes;
  plan.wide_index = kv_largest_offset(p, k.items) > INT32_MAX;
  const int64_t blocks = (k.items + kThreads - 1) / kThreads;
  plan.grid = std::max<int64_t>(1, std::min(blocks, sm_count * blocks_per_sm));
  return plan;
}

}  // namespace cuda_kernel
}  // namespace rope_ext
