// The fused RMSNorm + RoPE CUDA kernels' per-thread work and launch plan (arithmetic in
// ../qk_norm.h), in a header that nvcc and the host compiler both build, as
// rope_cuda_kernel.h is: rope_cuda.cu wraps NormRowThread in __global__ kernels, and
// rope_cuda_emulate.cpp runs it on the host over every block, warp and lane of the same plan.
//
// Design (memory-bound; the bar is the rotary kernels, which move a copy's bytes):
// - A row (one head of one token, D features) belongs to a group of G threads (G a power of
//   two <= 32, so a group never straddles a warp), in one pass over its memory: each thread
//   loads its part, keeps it in registers (vector path), sums its squares; the group adds the
//   partial sums with an xor butterfly; then each thread scales, rotates and stores its part.
// - A group takes an "item" per iteration: norm_rows() heads of one token (split_heads(), as
//   the rotary kernels split rows), so that a thread keeps 64 bytes of loads in flight as the
//   rotary kernels do, and the heads share the token's position and (cos, sin). An item's
//   offsets cost one division, plus one per inner token dim (32-bit where the values fit);
//   its rows are a head stride apart, with no division per row.
// - A row's work is split in two stages, load() and finish(), around the butterfly: on the
//   device the kernel calls them with __shfl_xor_sync between them; the host emulation runs
//   load() for all 32 lanes of a warp, adds the sums in the same butterfly order
//   (butterfly_add), then runs finish(). Both compute the same values, bit for bit.
// - Vector path (features contiguous, rows 16-byte aligned, the rotary half or rotary width
//   and the pass-through width whole 16-byte chunks): a thread owns up to norm_max_slots()
//   "lanes" of a row: a rotary lane is chunk c of the first half and chunk c of the second
//   (half-split pairs, so a pair never crosses threads) or one chunk of interleaved pairs; a
//   pass-through lane one chunk of [R, D), normalised but not rotated. Rows, the lane's
//   weights and its (cos, sin) move as 16-byte vectors (make_norm_vector_inputs() hands the
//   kernel a table and weights laid out for that), so the only narrower loads are the
//   position's and, with MRoPE (its own kernels), each pair's (cos, sin) from its axis' row.
// - Scalar path (strided or misaligned features, odd widths, rows of many lanes): a thread
//   takes pairs lane, lane + G, ... and pass-through features R + lane, R + lane + G, ...,
//   element by element, and reads them again in finish() (nothing held in registers).
// - Every thread of a warp takes part in every butterfly: the item loop's trip count is the
//   warp's (iterations()), and a group past the last item adds zeros and stores nothing.
// - Backward: load() reads the forward input x and the gradient gy, rotates gy back (gn),
//   and sums x^2 and g * x (g = gn * w'); finish() writes dx and adds gn * x * r into the
//   thread's own row of a partial weight-gradient buffer [groups, D] (opmath), which the
//   launcher sums over groups afterwards: no atomics, the same result on every run.
#pragma once

#include "../qk_norm.h"
#include "rope_cuda_kernel.h"

namespace rope_ext {
namespace cuda_kernel {

constexpr int kNormMaxGroup = 32;  // a warp

// Vector lanes a thread holds of a row: 2, so that a warp covers rows of 64 lanes (256
// features of 32-bit x, interleaved); 1 for 16-bit x, whose 32 lanes already cover 256
// features.
ROPE_HD constexpr int norm_max_slots(size_t elem) {
  return elem == 2 ? 1 : 2;
}
// Rows (heads of one token) a group takes per iteration: on the vector path as many as make
// 64 bytes of loads per thread (4 chunks of x, and of the gradient in backward, as the rotary
// kernels keep in flight), at least one; one on the scalar path (it reads its rows again in
// finish()) and with MRoPE (a table row per pair: the registers are short).
ROPE_HD constexpr int norm_rows(size_t elem, bool interleaved, bool vector, bool backward,
                                bool mrope) {
  const int chunks = (interleaved ? 1 : 2) * norm_max_slots(elem) * (backward ? 2 : 1);
  return vector && !mrope && chunks < 4 ? 4 / chunks : 1;
}
constexpr int kNormScalarSpan = 8; // features per thread the scalar path aims for
// Blocks per SM the norm kernels are built for (launch bounds): at most 128 registers.
constexpr int kNormMinBlocks = 2;

// The kernel's one argument.
struct NormKernelParams {
  NormRotaryParams n;
  OperandPlan op[2];      // operand o's token dims and heads (split_heads(); the rest unused)
  int64_t head_blocks[2]; // groups of norm_rows() heads of one token: operand o's items are
  int64_t items[2];       //   (token, head block), tokens * head_blocks of them
  int64_t total_items;    // items[0] + items[1]
  int32_t rotary_lanes[2];  // vector path: lanes of operand o's rotary features
  int32_t lanes[2];         // and with its pass-through chunks
  int32_t group;          // G: threads per row
  int64_t groups;         // groups in the grid: a thread's items stride by this
  bool table_double;      // the table's element type: double, else float
  void* partial[2];       // backward: [groups, head_dim of operand o] opmath, zeroed
};

struct NormLaunchPlan {
  NormKernelParams k;
  int64_t grid;
  bool vector;
};

// One step of the butterfly: a lane's sum and its partner's (lane ^ offset), for offsets
// G / 2, G / 4, ..., 1. Both partners compute own + other: the same value (+ commutes).
template <typename T>
ROPE_HD T butterfly_add(T own, T partner) {
  return own + partner;
}

// a / b and a % b (a >= 0, b > 0), in 32-bit arithmetic when both fit: a 64-bit division is
// a long subroutine on the GPU.
ROPE_HD void divide(int64_t a, int64_t b, int64_t& quotient, int64_t& remainder) {
  if (((a | b) >> 31) == 0) {
    const uint32_t q = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    quotient = q;
    remainder = a - static_cast<int64_t>(q) * b;
  } else {
    quotient = a / b;
    remainder = a - quotient * b;
  }
}

// The rows, groups and lanes of one thread; see the design above.
// kMrope: the vector path's MRoPE variant (each pair's (cos, sin) from the table row of its
// axis); the scalar path reads the table pair by pair anyway and serves MRoPE at runtime.
template <typename scalar_t, bool kInterleaved, bool kVector, bool kBackward, bool kMrope>
class NormRowThread {
  static_assert(kVector || !kMrope, "the scalar path serves MRoPE at runtime");

 public:
  using opmath = opmath_t<scalar_t>;
  using Io = Packed<scalar_t>;
  static constexpr int kSums = kBackward ? 2 : 1;  // sum(x^2), and sum(g * x) in backward
  static constexpr int kRows = norm_rows(sizeof(scalar_t), kInterleaved, kVector, kBackward,
                                         kMrope);
  static constexpr int kSumCount = kRows * kSums;  // row j's sums: [j * kSums, (j + 1) * kSums)
  static constexpr int V = Io::kCount;             // elements of a chunk
  static constexpr int kChunks = kInterleaved ? 1 : 2;  // chunks of a rotary lane
  static constexpr int kSlots = norm_max_slots(sizeof(scalar_t));
  static constexpr int kPairs = kInterleaved ? V / 2 : V;  // pairs of a rotary lane
  // A rotary lane's (cos, sin) as 16-byte vectors of opmath (the launcher hands the vector
  // path an opmath table of (cos, sin) pairs, see make_norm_vector_inputs()).
  static constexpr int kTableVecs = kPairs * 2 * sizeof(opmath) / kChunkBytes;
  // A chunk's weights as 16-byte vectors: float32 weights of 16-bit x take two.
  static constexpr int kWeightVecs = sizeof(scalar_t) == 2 ? 2 : 1;
  // Forward holds the weights as opmath scale values, backward as 16-byte vectors (see
  // load_weights()).
  static constexpr bool kWeightValues = !kBackward;

  ROPE_HD NormRowThread(const NormKernelParams& kp, int64_t block, int32_t thread) {
    const int64_t global = block * kThreads + thread;
    lane_ = static_cast<int32_t>(global % kp.group);
    group_ = global / kp.group;
    // The warp's first group: every lane of the warp loops as often as it does.
    warp_first_group_ = (block * kThreads + (thread & ~(kNormMaxGroup - 1))) / kp.group;
    if constexpr (kMrope) {
      // The axes of the pairs of the thread's lanes, which are the same for all its rows.
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        pair_axes_[s] = 0;
        const int64_t pair0 = static_cast<int64_t>(lane_ + s * kp.group) * kPairs;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          pair_axes_[s] |= static_cast<uint32_t>(pair_axis(kp.n.rotary, pair0 + i)) << (2 * i);
        }
      }
    }
  }

  // Items this thread's warp loops over (the same for each of its lanes).
  ROPE_HD int64_t iterations(const NormKernelParams& kp) const {
    return warp_first_group_ < kp.total_items
               ? (kp.total_items - warp_first_group_ + kp.groups - 1) / kp.groups
               : 0;
  }

  // Stage 1 of iteration `it`: loads this thread's part of its item's rows, returns their
  // partial sums (zeros for rows past the last).
  template <typename Mem>
  ROPE_HD void load(const NormKernelParams& kp, int64_t it, Mem& mem,
                    opmath (&sums)[kSumCount]) {
    for (int k = 0; k < kSumCount; ++k) sums[k] = opmath(0);
    if (!start_item(kp, group_ + it * kp.groups, mem)) return;
    if constexpr (kVector) {
      const OperandPlan& pl = kp.op[o_];
      const scalar_t* x = row_x(kp);
      // Chunk by chunk, its feature computed once for all rows.
      for_each_chunk(kp, [&](int s, int32_t lane, int c) {
        const int64_t feature = chunk_feature(kp, lane, c);
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          if (j >= rows_) continue;
          const int64_t f = j * pl.head_x_stride + feature;
          x_[j][s][c] = mem.load128(x + f);
          if constexpr (kBackward) gy_[j][s][c] = mem.load128(row_gy(kp) + f);
        }
      });
      load_rotations(kp, mem);
      // The weights depend on the operand and the lane only: read once per operand.
      if (o_ != weights_of_) {
        load_weights(kp, mem);
        weights_of_ = o_;
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (j >= rows_) continue;
        opmath* row_sums = sums + j * kSums;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const int32_t lane = lane_ + s * kp.group;
          if (lane >= kp.lanes[o_]) continue;
          if constexpr (kBackward) {
            for_lane(kp, j, s, lane, mem, [&](int, int, opmath xv, opmath gn, opmath w) {
              row_sums[0] = fmadd(xv, xv, row_sums[0]);
              row_sums[1] = fmadd(gn * w, xv, row_sums[1]);
            });
          } else {
            const int chunks = lane < kp.rotary_lanes[o_] ? kChunks : 1;
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
              if (c >= chunks) continue;
#pragma unroll
              for (int e = 0; e < V; ++e) {
                const opmath xv = Io::get(x_[j][s][c], e);
                row_sums[0] = fmadd(xv, xv, row_sums[0]);
              }
            }
          }
        }
      }
    } else {
      const scalar_t* x = row_x(kp);
      const int64_t xs = kp.n.rotary.operands[o_].x_feature_stride;
      scalar_for_each(kp, mem, [&](int64_t f0, int64_t f1, int64_t pair) {
        const opmath x0 = static_cast<opmath>(mem.load(x + f0 * xs));
        const opmath x1 = pair >= 0 ? static_cast<opmath>(mem.load(x + f1 * xs)) : opmath(0);
        sums[0] = fmadd(x0, x0, sums[0]);
        if (pair >= 0) sums[0] = fmadd(x1, x1, sums[0]);
        if constexpr (kBackward) {
          const scalar_t* gy = row_gy(kp);
          opmath g0 = static_cast<opmath>(mem.load(gy + f0 * xs));
          opmath g1 = pair >= 0 ? static_cast<opmath>(mem.load(gy + f1 * xs)) : opmath(0);
          if (pair >= 0) {
            opmath c, s;
            rotation(kp, pair, mem, c, s);
            rotate_pair(g0, g1, c, s, g0, g1);
          }
          sums[1] = fmadd(g0 * weight(kp, f0, mem), x0, sums[1]);
          if (pair >= 0) sums[1] = fmadd(g1 * weight(kp, f1, mem), x1, sums[1]);
        }
      });
    }
  }

  // Stage 2: with the rows' sums (the group's totals), scales, rotates and stores this
  // thread's part (backward: writes dx and adds to the weight-gradient partials).
  template <typename Mem>
  ROPE_HD void finish(const NormKernelParams& kp, const opmath (&totals)[kSumCount], Mem& mem) {
    if (rows_ == 0) return;
    const RotaryOperand& op = kp.n.rotary.operands[o_];
    const int64_t n = op.head_dim;
    auto* out = static_cast<scalar_t*>(op.out) + out_off_;
    opmath* partial = kBackward ? static_cast<opmath*>(kp.partial[o_]) + group_ * n : nullptr;
    if constexpr (kVector) {
      const int64_t out_step = kp.op[o_].head_out_stride;
      opmath r[kRows], coefficient[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        r[j] = rms_scale(totals[j * kSums], n, static_cast<opmath>(kp.n.eps));
        coefficient[j] = opmath(0);
        if constexpr (kBackward) {
          coefficient[j] = rms_grad_coefficient(r[j], totals[j * kSums + 1], n);
        }
      }
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int32_t lane = lane_ + s * kp.group;
        if (lane >= kp.lanes[o_]) continue;
        const int chunks = lane < kp.rotary_lanes[o_] ? kChunks : 1;
        // The lane's chunks' features, once for all rows (recomputed per row, they cost a
        // constant-bank load and 64-bit arithmetic per store).
        int64_t feature[kChunks];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) feature[c] = chunk_feature(kp, lane, c);
        // Backward: the thread's partial-row vectors for the lane's chunks, to which each
        // row adds gn * x * r, row by row.
        constexpr int kPer = kChunkBytes / sizeof(opmath);
        Bits128 acc[kBackward ? kChunks : 1][V / kPer];
        // fn(acc vector, its place in the partial row) for each of the lane's chunks.
        auto each_partial = [&](auto&& fn) {
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            if (c >= chunks) continue;
#pragma unroll
            for (int q = 0; q < V / kPer; ++q) {
              fn(acc[c][q], partial + feature[c] + q * kPer);
            }
          }
        };
        if constexpr (kBackward) {
          each_partial([&](Bits128& a, opmath* at) { a = mem.load128(at); });
        }
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          if (j >= rows_) continue;
          Bits128 y[kChunks];
          for_lane(kp, j, s, lane, mem, [&](int c, int e, opmath xv, opmath v, opmath w) {
            if constexpr (kBackward) {  // v: gn
              Io::set(y[c], e, fmsub(v * w, r[j], xv * coefficient[j]));
              Bits128& a = acc[c][e / kPer];
              Packed<opmath>::set(a, e % kPer, fmadd(v * xv, r[j], Packed<opmath>::get(a, e % kPer)));
            } else {  // v: the rotated, scaled x
              Io::set(y[c], e, v);
              (void)xv, (void)w;
            }
          }, r[j]);
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            if (c >= chunks) continue;
            mem.store128(out + j * out_step + feature[c], y[c]);
          }
        }
        if constexpr (kBackward) {
          each_partial([&](Bits128& a, opmath* at) { mem.store128(at, a); });
        }
      }
    } else {
      const opmath r = rms_scale(totals[0], n, static_cast<opmath>(kp.n.eps));
      opmath coefficient = opmath(0);
      if constexpr (kBackward) coefficient = rms_grad_coefficient(r, totals[1], n);
      const scalar_t* x = row_x(kp);
      const int64_t xs = op.x_feature_stride, os = op.out_feature_stride;
      scalar_for_each(kp, mem, [&](int64_t f0, int64_t f1, int64_t pair) {
        opmath v[2], xv[2];
        const int count = pair >= 0 ? 2 : 1;
        v[1] = xv[1] = opmath(0);
        for (int h = 0; h < count; ++h) {
          xv[h] = static_cast<opmath>(mem.load(x + (h ? f1 : f0) * xs));
        }
        opmath c = opmath(1), s = opmath(0);
        if (pair >= 0) rotation(kp, pair, mem, c, s);
        const opmath w0 = weight(kp, f0, mem);
        const opmath w1 = pair >= 0 ? weight(kp, f1, mem) : opmath(0);
        if constexpr (kBackward) {
          const scalar_t* gy = row_gy(kp);
          for (int h = 0; h < count; ++h) {
            v[h] = static_cast<opmath>(mem.load(gy + (h ? f1 : f0) * xs));
          }
          if (pair >= 0) rotate_pair(v[0], v[1], c, s, v[0], v[1]);  // gn
          const opmath w[2] = {w0, w1};
          for (int h = 0; h < count; ++h) {
            const int64_t f = h ? f1 : f0;
            mem.store(out + f * os, static_cast<scalar_t>(fmsub(v[h] * w[h], r,
                                                                 xv[h] * coefficient)));
            mem.store(partial + f, fmadd(v[h] * xv[h], r, mem.load(partial + f)));
          }
        } else {
          v[0] = xv[0] * r * w0;
          v[1] = xv[1] * r * w1;
          if (pair >= 0) rotate_pair(v[0], v[1], c, s, v[0], v[1]);
          for (int h = 0; h < count; ++h) {
            mem.store(out + (h ? f1 : f0) * os, static_cast<scalar_t>(v[h]));
          }
        }
      });
    }
  }

 private:
  // Takes item `item`: its operand, its first row's offsets, its rows and its position (not
  // MRoPE). Returns whether it has rows. One division for the item and one per inner token
  // dim, none per row: the rows are heads of one token, a head stride apart.
  template <typename Mem>
  ROPE_HD bool start_item(const NormKernelParams& kp, int64_t item, Mem& mem) {
    rows_ = 0;
    if (item >= kp.total_items) return false;
    o_ = item >= kp.items[0] ? 1 : 0;
    const OperandPlan& pl = kp.op[o_];
    int64_t token, head_block;
    divide(item - (o_ ? kp.items[0] : 0), kp.head_blocks[o_], token, head_block);
    // The token's offsets from its index over the token dims; the outermost takes what is
    // left, without a division.
    int64_t rest = token, x_off = 0, out_off = 0, pos_off = 0;
#pragma unroll 1
    for (int d = pl.ndim - 1; d > 0; --d) {
      int64_t i;
      divide(rest, pl.sizes[d], rest, i);
      x_off += i * pl.x_strides[d];
      out_off += i * pl.out_strides[d];
      pos_off += i * pl.pos_strides[d];
    }
    if (pl.ndim > 0) {
      x_off += rest * pl.x_strides[0];
      out_off += rest * pl.out_strides[0];
      pos_off += rest * pl.pos_strides[0];
    }
    const int64_t head = head_block * kRows;
    rows_ = static_cast<int32_t>(smaller<int64_t>(kRows, pl.heads - head));
    x_off_ = x_off + head * pl.head_x_stride;
    out_off_ = out_off + head * pl.head_out_stride;
    pos_off_ = pos_off;
    const RotaryParams& p = kp.n.rotary;
    if (!kMrope && p.mrope_axes == 0) {
      position_ = p.offset + (p.positions == nullptr ? pos_off : load_position(p, pos_off, mem));
      mem.check_position(position_ >= 0 && position_ < p.table_rows);
    }
    return true;
  }

  ROPE_HD const scalar_t* row_x(const NormKernelParams& kp) const {
    // Backward reads the forward's input as x (the operand's x is the gradient).
    const void* base = kBackward ? kp.n.input[o_] : kp.n.rotary.operands[o_].x;
    return static_cast<const scalar_t*>(base) + x_off_;
  }
  ROPE_HD const scalar_t* row_gy(const NormKernelParams& kp) const {
    return static_cast<const scalar_t*>(kp.n.rotary.operands[o_].x) + x_off_;
  }

  // Feature of chunk c of vector lane `lane`: rotary lanes first, then pass-through ones.
  ROPE_HD int64_t chunk_feature(const NormKernelParams& kp, int32_t lane, int c) const {
    const int64_t pairs = kp.n.rotary.rot_pairs;
    if (lane < kp.rotary_lanes[o_]) {
      return static_cast<int64_t>(lane) * V + c * (kInterleaved ? 0 : pairs);
    }
    return 2 * pairs + static_cast<int64_t>(lane - kp.rotary_lanes[o_]) * V;
  }

  // Vector path: the (cos, sin) of each slot's rotary lane for the item's position, as
  // 16-byte vectors (make_norm_vector_inputs() laid the table out so). MRoPE: the table rows
  // of the item's axis positions; lane_rotation() reads each pair's (cos, sin) from the row of
  // its axis when it needs them (held in registers, a lane's 2 * kPairs values each from its
  // own address spill the backward kernels).
  template <typename Mem>
  ROPE_HD void load_rotations(const NormKernelParams& kp, Mem& mem) {
    const RotaryParams& p = kp.n.rotary;
    const auto* table = static_cast<const opmath*>(p.table);
    if constexpr (kMrope) {
#pragma unroll
      for (int a = 0; a < kMaxMropeAxes; ++a) {
        axis_rows_[a] = table;
        if (a < p.mrope_axes) {
          const int64_t row =
              p.offset + load_position(p, pos_off_ + a * p.mrope_axis_stride, mem);
          mem.check_position(row >= 0 && row < p.table_rows);
          axis_rows_[a] = table + row * p.table_row_stride;
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int32_t lane = lane_ + s * kp.group;
        if (lane >= kp.rotary_lanes[o_]) continue;
        const opmath* entry =
            table + position_ * p.table_row_stride + 2 * static_cast<int64_t>(lane) * kPairs;
#pragma unroll
        for (int v = 0; v < kTableVecs; ++v) {
          cs_[s][v] = mem.load128(entry + v * (kChunkBytes / sizeof(opmath)));
        }
      }
    }
  }

  // Vector path: the weights of each slot's lane, read as 16-byte vectors once per operand.
  // Forward holds them as scale values (weight + weight_offset, in opmath), so that a row's
  // elements take a ready value: the weight's dtype, its conversion and the offset cost
  // instructions per element and row otherwise, and the forward kernel is short of issue
  // slots, not of bytes in flight (on the H200, 128 bytes per thread ran no faster than 64).
  // Backward keeps the vectors (its registers are short: values spilled in float32).
  template <typename Mem>
  ROPE_HD void load_weights(const NormKernelParams& kp, Mem& mem) {
    const bool wide = sizeof(scalar_t) == 2 && kp.n.weight_float[o_];
    const opmath offset = static_cast<opmath>(kp.n.weight_offset);
    for_each_chunk(kp, [&](int s, int32_t lane, int c) {
      const int64_t f = chunk_feature(kp, lane, c);
      Bits128 b[kWeightVecs];
      if (wide) {
        const float* w = static_cast<const float*>(kp.n.weight[o_]) + f;
#pragma unroll
        for (int v = 0; v < kWeightVecs; ++v) {
          b[v] = mem.load128(w + v * (kChunkBytes / sizeof(float)));
        }
      } else {
        b[0] = mem.load128(static_cast<const scalar_t*>(kp.n.weight[o_]) + f);
      }
      if constexpr (kWeightValues) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          w_[s][c][e] = (wide ? static_cast<opmath>(Packed<float>::get(b[e / 4], e % 4))
                              : Io::get(b[0], e)) + offset;
        }
      } else {
#pragma unroll
        for (int v = 0; v < kWeightVecs; ++v) w_raw_[s][c][v] = b[v];
      }
    });
  }

  // Vector path: calls fn(s, lane, c) for each 16-byte chunk c this thread holds of slot s's
  // lane in its operand: every chunk of a rotated lane, the first of a pass-through one.
  template <typename Fn>
  ROPE_HD void for_each_chunk(const NormKernelParams& kp, Fn&& fn) const {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int32_t lane = lane_ + s * kp.group;
      if (lane >= kp.lanes[o_]) continue;
      const int chunks = lane < kp.rotary_lanes[o_] ? kChunks : 1;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c >= chunks) continue;
        fn(s, lane, c);
      }
    }
  }

  // Vector path: the (cos, sin) of pair i of slot s's lane `lane` (negated sine for the
  // inverse rotation), and the scale weight + weight_offset of element e of its chunk c.
  template <typename Mem>
  ROPE_HD void lane_rotation(const NormKernelParams& kp, int s, int32_t lane, int i, Mem& mem,
                             opmath& c, opmath& sn) const {
    if constexpr (kMrope) {
      const int64_t pair = static_cast<int64_t>(lane) * kPairs + i;
      const int axis = (pair_axes_[s] >> (2 * i)) & 3;
      // Constant indices only, so axis_rows_ stays in registers.
      const opmath* entry = (axis == 0 ? axis_rows_[0] : axis == 1 ? axis_rows_[1]
                             : axis == 2 ? axis_rows_[2] : axis_rows_[3]) + 2 * pair;
      c = mem.load(entry);
      sn = mem.load(entry + 1);
    } else {
      constexpr int kPer = kChunkBytes / sizeof(opmath);
      c = Packed<opmath>::get(cs_[s][2 * i / kPer], 2 * i % kPer);
      sn = Packed<opmath>::get(cs_[s][2 * i / kPer], 2 * i % kPer + 1);
    }
    // Backward rotates back (norm_launch sets rotary.inverse exactly when it launches the
    // backward): a compile-time negation, which folds into the rotation's multiplies, where a
    // runtime flag cost a select per pair and row.
    if constexpr (kBackward) sn = -sn;
  }
  ROPE_HD opmath lane_weight(const NormKernelParams& kp, int s, int c, int e) const {
    if constexpr (kWeightValues) {
      return w_[s][c][e];
    } else {
      opmath w;
      if (sizeof(scalar_t) == 2 && kp.n.weight_float[o_]) {
        w = Packed<float>::get(w_raw_[s][c][e / 4], e % 4);
      } else {
        w = Io::get(w_raw_[s][c][0], e);
      }
      return w + static_cast<opmath>(kp.n.weight_offset);
    }
  }

  // Scalar path: (cos, sin) of pair `pair` of the row, negated sine for the inverse
  // rotation; as the rotary kernels read them (MRoPE: the position of the pair's axis).
  template <typename Mem>
  ROPE_HD void rotation(const NormKernelParams& kp, int64_t pair, Mem& mem, opmath& c,
                        opmath& s) const {
    const RotaryParams& p = kp.n.rotary;
    int64_t position = position_;
    if (p.mrope_axes > 0) {
      position = p.offset +
                 load_position(p, pos_off_ + pair_axis(p, pair) * p.mrope_axis_stride, mem);
      mem.check_position(position >= 0 && position < p.table_rows);
    }
    const int64_t at = position * p.table_row_stride + pair * p.table_pair_stride;
    if (kp.table_double) {
      const double* e = static_cast<const double*>(p.table) + at;
      c = static_cast<opmath>(mem.load(e));
      s = static_cast<opmath>(mem.load(e + p.table_cs_stride));
    } else {
      const float* e = static_cast<const float*>(p.table) + at;
      c = static_cast<opmath>(mem.load(e));
      s = static_cast<opmath>(mem.load(e + p.table_cs_stride));
    }
    if constexpr (kBackward) s = -s;  // as lane_rotation()
  }

  // Scalar path: the scale weight + weight_offset of feature f.
  template <typename Mem>
  ROPE_HD opmath weight(const NormKernelParams& kp, int64_t f, Mem& mem) const {
    const int64_t at = f * kp.n.weight_stride[o_];
    const opmath w = kp.n.weight_float[o_]
                         ? static_cast<opmath>(mem.load(static_cast<const float*>(kp.n.weight[o_]) + at))
                         : static_cast<opmath>(mem.load(static_cast<const scalar_t*>(kp.n.weight[o_]) + at));
    return w + static_cast<opmath>(kp.n.weight_offset);
  }

  // Vector path: calls fn(chunk, element, x, v, w') for each element of vector lane `lane`
  // (slot s) of row j, held in x_ (and gy_): v is gn (backward) or the scaled and rotated x
  // (forward, with r given); w' the scale weight. Rotary lanes go pair by pair.
  template <typename Mem, typename Fn>
  ROPE_HD void for_lane(const NormKernelParams& kp, int j, int s, int32_t lane, Mem& mem,
                        Fn&& fn, opmath r = opmath(1)) const {
    if (lane >= kp.rotary_lanes[o_]) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const opmath xv = Io::get(x_[j][s][0], e);
        const opmath w = lane_weight(kp, s, 0, e);
        opmath v;
        if constexpr (kBackward) {
          v = Io::get(gy_[j][s][0], e);
        } else {
          v = xv * r * w;
        }
        fn(0, e, xv, v, w);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      // Interleaved: elements (2i, 2i + 1) of the chunk; else element i of each half.
      const int c1 = kInterleaved ? 0 : 1;
      const int e0 = kInterleaved ? 2 * i : i, e1 = kInterleaved ? 2 * i + 1 : i;
      opmath c, sn;
      lane_rotation(kp, s, lane, i, mem, c, sn);
      const opmath x0 = Io::get(x_[j][s][0], e0), x1 = Io::get(x_[j][s][c1], e1);
      const opmath w0 = lane_weight(kp, s, 0, e0), w1 = lane_weight(kp, s, c1, e1);
      opmath v0, v1;
      if constexpr (kBackward) {
        rotate_pair(Io::get(gy_[j][s][0], e0), Io::get(gy_[j][s][c1], e1), c, sn, v0, v1);
      } else {
        rotate_pair(x0 * r * w0, x1 * r * w1, c, sn, v0, v1);
      }
      fn(0, e0, x0, v0, w0);
      fn(c1, e1, x1, v1, w1);
    }
  }

  // Scalar path: calls fn(f0, f1, pair) for this thread's pairs (f0, f1 its features), then
  // fn(f, -, -1) for its pass-through features.
  template <typename Mem, typename Fn>
  ROPE_HD void scalar_for_each(const NormKernelParams& kp, Mem&, Fn&& fn) const {
    const RotaryParams& p = kp.n.rotary;
    const int64_t pairs = p.rot_pairs;
#pragma unroll 1
    for (int64_t j = lane_; j < pairs; j += kp.group) {
      fn(kInterleaved ? 2 * j : j, kInterleaved ? 2 * j + 1 : j + pairs, j);
    }
#pragma unroll 1
    for (int64_t f = 2 * pairs + lane_; f < p.operands[o_].head_dim; f += kp.group) {
      fn(f, int64_t(-1), int64_t(-1));
    }
  }

  int32_t lane_ = 0;           // place in the group
  int64_t group_ = 0;          // the group's index in the grid (its partial row)
  int64_t warp_first_group_ = 0;
  int32_t rows_ = 0;           // rows of the current item (0: none)
  int o_ = 0;                  // its operand
  int weights_of_ = -1;        // vector path: the operand whose weights w_ holds
  int64_t x_off_ = 0, out_off_ = 0, pos_off_ = 0;  // of its first row
  int64_t position_ = 0;       // its position (not MRoPE)
  // Vector path: the rows' chunks, and the lanes' (cos, sin) and weights.
  Bits128 x_[kVector ? kRows : 1][kVector ? kSlots : 1][kChunks];
  Bits128 gy_[kVector && kBackward ? kRows : 1][kVector ? kSlots : 1][kChunks];
  Bits128 cs_[kVector && !kMrope ? kSlots : 1][kVector && !kMrope ? kTableVecs : 1];
  const opmath* axis_rows_[kMrope ? kMaxMropeAxes : 1];  // MRoPE: the axes' table rows
  uint32_t pair_axes_[kMrope ? kSlots : 1];  // MRoPE: pair i of slot s's lane: bits 2i, 2i + 1
  // The lanes' weights: forward, as scale values (weight + weight_offset); backward, as read.
  opmath w_[kVector && kWeightValues ? kSlots : 1][kChunks][kVector && kWeightValues ? V : 1];
  Bits128 w_raw_[kVector && !kWeightValues ? kSlots : 1][kChunks][kWeightVecs];
};

// ---- Host side: the launch plan, shared by the CUDA launcher and the emulation ----

inline int32_t next_power_of_two(int64_t v) {
  int32_t g = 1;
  while (g < v) g *= 2;
  return g;
}

// Whether every operand's rows move as aligned 16-byte chunks (see the design above).
inline bool norm_vector_path(const NormRotaryParams& n, size_t elem) {
  const RotaryParams& p = n.rotary;
  const int64_t v = kChunkBytes / static_cast<int64_t>(elem);
  const int64_t rotary = 2 * p.rot_pairs;
  auto aligned = [&](const void* ptr) {
    return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % kChunkBytes == 0;
  };
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    const int64_t lanes = (p.interleaved ? rotary : p.rot_pairs) / v + (op.head_dim - rotary) / v;
    bool ok = op.x_feature_stride == 1 && op.out_feature_stride == 1 &&
              (p.interleaved ? rotary : p.rot_pairs) % v == 0 && (op.head_dim - rotary) % v == 0 &&
              lanes <= kNormMaxGroup * norm_max_slots(elem) && aligned(op.x) && aligned(op.out) &&
              aligned(n.input[o]);
    for (int64_t d = 0; ok && d < op.ndim; ++d) {
      ok = op.x_strides[d] % v == 0 && op.out_strides[d] % v == 0;
    }
    if (!ok) return false;
  }
  return true;
}

// The plan of a norm launch on a GPU with sm_count SMs, each holding blocks_per_sm blocks.
inline NormLaunchPlan plan_norm(const NormRotaryParams& n, size_t elem, bool table_double,
                                bool backward, int64_t sm_count, int64_t blocks_per_sm) {
  NormLaunchPlan plan{};
  NormKernelParams& k = plan.k;
  const RotaryParams& p = n.rotary;
  k.n = n;
  k.table_double = table_double;
  plan.vector = norm_vector_path(n, elem);
  const int64_t v = kChunkBytes / static_cast<int64_t>(elem);
  const int64_t rows_per_item =
      norm_rows(elem, p.interleaved, plan.vector, backward, p.mrope_axes > 0);
  int64_t widest = 1;  // lanes (vector) or features (scalar) of the widest operand
  k.total_items = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    OperandPlan& pl = k.op[o];
    split_heads(op, pl);
    k.head_blocks[o] = (pl.heads + rows_per_item - 1) / rows_per_item;
    k.items[o] = pl.tokens * k.head_blocks[o];
    k.total_items += k.items[o];
    if (plan.vector) {
      k.rotary_lanes[o] = static_cast<int32_t>((p.interleaved ? 2 * p.rot_pairs : p.rot_pairs) / v);
      k.lanes[o] = k.rotary_lanes[o] + static_cast<int32_t>((op.head_dim - 2 * p.rot_pairs) / v);
      widest = std::max<int64_t>(widest, k.lanes[o]);
    } else {
      widest = std::max<int64_t>(widest, (op.head_dim + kNormScalarSpan - 1) / kNormScalarSpan);
    }
  }
  // Vector: a lane per thread where a warp holds them (else norm_max_slots()); scalar: about
  // kNormScalarSpan features per thread.
  k.group = std::min<int32_t>(kNormMaxGroup, next_power_of_two(widest));
  const int64_t blocks = (k.total_items * k.group + kThreads - 1) / kThreads;
  plan.grid = std::max<int64_t>(1, std::min(blocks, sm_count * blocks_per_sm));
  k.groups = plan.grid * kThreads / k.group;
  return plan;
}

}  // namespace cuda_kernel
}  // namespace rope_ext
