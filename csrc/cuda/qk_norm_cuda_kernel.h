// The fused RMSNorm + RoPE CUDA kernels' per-thread work and launch plan (arithmetic in
// ../qk_norm.h), in a header that nvcc and the host compiler both build, as
// rope_cuda_kernel.h is: rope_cuda.cu wraps NormRowThread in __global__ kernels, and
// rope_cuda_emulate.cpp runs it on the host over every block, warp and lane of the same plan.
//
// Design:
// - A row (one head of one token, D features) belongs to a group of G threads (G a power of
//   two <= 32, so a group never straddles a warp), in one pass over its memory: each thread
//   loads its part, keeps it in registers (vector path), sums its squares; the group adds the
//   partial sums with an xor butterfly; then each thread scales, rotates and stores its part.
// - A row's work is split in two stages, load() and finish(), around the butterfly: on the
//   device the kernel calls them with __shfl_xor_sync between them; the host emulation runs
//   load() for all 32 lanes of a warp, adds the sums in the same butterfly order
//   (butterfly_add), then runs finish(). Both compute the same values, bit for bit.
// - Vector path (features contiguous, rows 16-byte aligned, the rotary half or rotary width
//   and the pass-through width whole 16-byte chunks): a thread owns up to norm_max_slots()
//   "lanes" of a row: a rotary lane is chunk c of the first half and chunk c of the second
//   (half-split pairs, so a pair never crosses threads) or one chunk of interleaved pairs; a
//   pass-through lane one chunk of [R, D), normalised but not rotated. 16-byte loads and stores.
// - Scalar path (strided or misaligned features, odd widths, rows of many lanes): a thread
//   takes pairs lane, lane + G, ... and pass-through features R + lane, R + lane + G, ...,
//   element by element, and reads them again in finish() (nothing held in registers).
// - Every thread of a warp takes part in every butterfly: the row loop's trip count is the
//   warp's (iterations()), and a group past the last row adds zeros and stores nothing.
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
// features (and whose backward would spill with 2).
ROPE_HD constexpr int norm_max_slots(size_t elem) {
  return elem == 2 ? 1 : 2;
}
constexpr int kNormScalarSpan = 8; // features per thread the scalar path aims for
// Blocks per SM the norm kernels are built for (launch bounds): at most 128 registers.
constexpr int kNormMinBlocks = 2;

// The kernel's one argument.
struct NormKernelParams {
  NormRotaryParams n;
  int64_t rows[2];        // rows of operand o
  int64_t total_rows;     // rows[0] + rows[1]
  int32_t rotary_lanes[2];  // vector path: lanes of operand o's rotary features
  int32_t lanes[2];         // and with its pass-through chunks
  int32_t group;          // G: threads per row
  int64_t groups;         // groups in the grid: a thread's rows stride by this
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

// The rows, groups and lanes of one thread; see the design above.
template <typename scalar_t, bool kInterleaved, bool kVector, bool kBackward>
class NormRowThread {
 public:
  using opmath = opmath_t<scalar_t>;
  using Io = Packed<scalar_t>;
  static constexpr int kSums = kBackward ? 2 : 1;  // sum(x^2), and sum(g * x) in backward
  static constexpr int V = Io::kCount;             // elements of a chunk
  static constexpr int kChunks = kInterleaved ? 1 : 2;  // chunks of a rotary lane
  static constexpr int kSlots = norm_max_slots(sizeof(scalar_t));

  ROPE_HD NormRowThread(const NormKernelParams& kp, int64_t block, int32_t thread) {
    const int64_t global = block * kThreads + thread;
    lane_ = static_cast<int32_t>(global % kp.group);
    group_ = global / kp.group;
    // The warp's first group: every lane of the warp loops as often as it does.
    warp_first_group_ = (block * kThreads + (thread & ~(kNormMaxGroup - 1))) / kp.group;
  }

  // Rows this thread's warp loops over (the same for each of its lanes).
  ROPE_HD int64_t iterations(const NormKernelParams& kp) const {
    return warp_first_group_ < kp.total_rows
               ? (kp.total_rows - warp_first_group_ + kp.groups - 1) / kp.groups
               : 0;
  }

  // Stage 1 of row iteration `it`: loads this thread's part of its row, returns its partial
  // sums (zeros for a group past the last row).
  template <typename Mem>
  ROPE_HD void load(const NormKernelParams& kp, int64_t it, Mem& mem, opmath (&sums)[kSums]) {
    for (int k = 0; k < kSums; ++k) sums[k] = opmath(0);
    const int64_t row = group_ + it * kp.groups;
    active_ = row < kp.total_rows;
    if (!active_) return;
    o_ = row >= kp.rows[0] ? 1 : 0;
    const RotaryParams& p = kp.n.rotary;
    const RotaryOperand& op = p.operands[o_];
    const RowOffsets off = row_offsets(op, row - (o_ ? kp.rows[0] : 0));
    x_off_ = off.x;
    out_off_ = off.out;
    pos_off_ = off.pos;
    if (p.mrope_axes == 0) {
      position_ = p.offset + (p.positions == nullptr ? off.pos : load_position(p, off.pos, mem));
      mem.check_position(position_ >= 0 && position_ < p.table_rows);
    }
    const scalar_t* x = row_x(kp);
    if constexpr (kVector) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int32_t lane = lane_ + s * kp.group;
        if (lane >= kp.lanes[o_]) continue;
        const int chunks = lane < kp.rotary_lanes[o_] ? kChunks : 1;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          if (c >= chunks) continue;
          const int64_t f = chunk_feature(kp, lane, c);
          x_[s][c] = mem.load128(x + f);
          if constexpr (kBackward) gy_[s][c] = mem.load128(row_gy(kp) + f);
        }
        if constexpr (kBackward) {
          for_lane(kp, lane, s, mem, [&](int c, int e, int64_t, opmath xv, opmath gn, opmath w) {
            (void)c, (void)e;
            sums[0] = fmadd(xv, xv, sums[0]);
            sums[1] = fmadd(gn * w, xv, sums[1]);
          });
        } else {
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            if (c >= chunks) continue;
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const opmath xv = Io::get(x_[s][c], e);
              sums[0] = fmadd(xv, xv, sums[0]);
            }
          }
        }
      }
    } else {
      const RotaryOperand& o = op;
      const int64_t xs = o.x_feature_stride;
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

  // Stage 2: with the row's sums (the group's totals), scales, rotates and stores this
  // thread's part (backward: writes dx and adds to the weight-gradient partials).
  template <typename Mem>
  ROPE_HD void finish(const NormKernelParams& kp, const opmath (&totals)[kSums], Mem& mem) {
    if (!active_) return;
    const RotaryOperand& op = kp.n.rotary.operands[o_];
    const int64_t n = op.head_dim;
    const opmath r = rms_scale(totals[0], n, static_cast<opmath>(kp.n.eps));
    opmath coefficient = opmath(0);
    if constexpr (kBackward) coefficient = rms_grad_coefficient(r, totals[1], n);
    auto* out = static_cast<scalar_t*>(op.out) + out_off_;
    opmath* partial = kBackward ? static_cast<opmath*>(kp.partial[o_]) + group_ * n : nullptr;
    if constexpr (kVector) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int32_t lane = lane_ + s * kp.group;
        if (lane >= kp.lanes[o_]) continue;
        Bits128 y[kChunks];
        opmath dw[kChunks][V];
        for_lane(kp, lane, s, mem, [&](int c, int e, int64_t, opmath xv, opmath v, opmath w) {
          if constexpr (kBackward) {  // v: gn
            Io::set(y[c], e, fmsub(v * w, r, xv * coefficient));
            dw[c][e] = v * xv;
          } else {  // v: the rotated, scaled x
            Io::set(y[c], e, v);
            (void)xv, (void)w;
          }
        }, r);
        const int chunks = lane < kp.rotary_lanes[o_] ? kChunks : 1;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          if (c >= chunks) continue;
          const int64_t f = chunk_feature(kp, lane, c);
          mem.store128(out + f, y[c]);
          if constexpr (kBackward) {
            // V opmath values of the thread's partial row: whole 16-byte vectors.
            constexpr int kPer = kChunkBytes / sizeof(opmath);
#pragma unroll
            for (int q = 0; q < V / kPer; ++q) {
              Bits128 acc = mem.load128(partial + f + q * kPer);
#pragma unroll
              for (int e = 0; e < kPer; ++e) {
                Packed<opmath>::set(acc, e, fmadd(dw[c][q * kPer + e], r,
                                                  Packed<opmath>::get(acc, e)));
              }
              mem.store128(partial + f + q * kPer, acc);
            }
          }
        }
      }
    } else {
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

  // (cos, sin) of pair `pair` of the row, negated sine for the inverse rotation; as the
  // rotary kernels read them (MRoPE: the position of the pair's axis).
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
    if (p.inverse) s = -s;
  }

  // The scale weight + weight_offset of feature f.
  template <typename Mem>
  ROPE_HD opmath weight(const NormKernelParams& kp, int64_t f, Mem& mem) const {
    const int64_t at = f * kp.n.weight_stride[o_];
    const opmath w = kp.n.weight_float[o_]
                         ? static_cast<opmath>(mem.load(static_cast<const float*>(kp.n.weight[o_]) + at))
                         : static_cast<opmath>(mem.load(static_cast<const scalar_t*>(kp.n.weight[o_]) + at));
    return w + static_cast<opmath>(kp.n.weight_offset);
  }

  // Calls fn(chunk, element, feature, x, v, w') for each element of vector lane `lane` (slot
  // s) held in x_ (and gy_): v is gn (backward) or the scaled and rotated x (forward, with
  // r given); w' the scale weight.
  template <typename Mem, typename Fn>
  ROPE_HD void for_lane(const NormKernelParams& kp, int32_t lane, int s, Mem& mem, Fn&& fn,
                        opmath r = opmath(1)) const {
    const bool rotary = lane < kp.rotary_lanes[o_];
    if (!rotary) {
      const int64_t f = chunk_feature(kp, lane, 0);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const opmath xv = Io::get(x_[s][0], e);
        const opmath w = weight(kp, f + e, mem);
        opmath v;
        if constexpr (kBackward) {
          v = Io::get(gy_[s][0], e);
        } else {
          v = xv * r * w;
        }
        fn(0, e, f + e, xv, v, w);
      }
      return;
    }
    constexpr int kPairs = kInterleaved ? V / 2 : V;
    const int64_t pair0 = static_cast<int64_t>(lane) * kPairs;
    const int64_t half = kp.n.rotary.rot_pairs;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      // Interleaved: elements (2i, 2i + 1) of the chunk; else element i of each half.
      const int c1 = kInterleaved ? 0 : 1;
      const int e0 = kInterleaved ? 2 * i : i, e1 = kInterleaved ? 2 * i + 1 : i;
      const int64_t f0 = kInterleaved ? 2 * (pair0 + i) : pair0 + i;
      const int64_t f1 = kInterleaved ? f0 + 1 : f0 + half;
      opmath c, sn;
      rotation(kp, pair0 + i, mem, c, sn);
      const opmath x0 = Io::get(x_[s][0], e0), x1 = Io::get(x_[s][c1], e1);
      const opmath w0 = weight(kp, f0, mem), w1 = weight(kp, f1, mem);
      opmath v0, v1;
      if constexpr (kBackward) {
        rotate_pair(Io::get(gy_[s][0], e0), Io::get(gy_[s][c1], e1), c, sn, v0, v1);
      } else {
        rotate_pair(x0 * r * w0, x1 * r * w1, c, sn, v0, v1);
      }
      fn(0, e0, f0, x0, v0, w0);
      fn(c1, e1, f1, x1, v1, w1);
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
  bool active_ = false;        // the current row exists
  int o_ = 0;                  // its operand
  int64_t x_off_ = 0, out_off_ = 0, pos_off_ = 0;
  int64_t position_ = 0;       // its position (not MRoPE)
  Bits128 x_[kVector ? kSlots : 1][kChunks];   // vector path: the row's chunks
  Bits128 gy_[kVector && kBackward ? kSlots : 1][kChunks];
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
                                int64_t sm_count, int64_t blocks_per_sm) {
  NormLaunchPlan plan{};
  NormKernelParams& k = plan.k;
  const RotaryParams& p = n.rotary;
  k.n = n;
  k.table_double = table_double;
  plan.vector = norm_vector_path(n, elem);
  const int64_t v = kChunkBytes / static_cast<int64_t>(elem);
  int64_t widest = 1;  // lanes (vector) or features (scalar) of the widest operand
  k.total_rows = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    k.rows[o] = op.rows;
    k.total_rows += op.rows;
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
  const int64_t blocks = (k.total_rows * k.group + kThreads - 1) / kThreads;
  plan.grid = std::max<int64_t>(1, std::min(blocks, sm_count * blocks_per_sm));
  k.groups = plan.grid * kThreads / k.group;
  return plan;
}

}  // namespace cuda_kernel
}  // namespace rope_ext
