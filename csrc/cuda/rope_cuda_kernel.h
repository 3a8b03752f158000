// The CUDA kernels' per-thread work and launch geometry, in a header that nvcc and the host
// compiler both build: rope_cuda.cu wraps the thread functions in __global__ kernels, and
// rope_cuda_emulate.cpp runs them on the host over every block and thread of the same launch
// plan, with every memory access checked (see tests/test_cuda_emulation.py). No torch
// tensors here: only the parameter structs of rope_math.h and c10's 16-bit float types.
//
// Design (memory-bound; the bar is the copy of the same bytes):
// - Token-major. A thread owns one 16-byte chunk ("lane") of a row and a group of heads of
//   one token: it reads the token's position and the lane's (cos, sin) once, as 16-byte
//   vectors, and applies them to every head of its group (up to kBatch rows).
// - A thread loads a batch of rows (64 bytes) before it stores any, so each thread has that
//   much in flight. The rows of one call never overlap (checked on the host): in place, each
//   element is read and written by the same thread; out of place, out is a new tensor.
// - Rows move as 16-byte loads and stores (Bits128) on the vector path; the scalar path
//   (strided or misaligned features, odd widths) moves scalar_pairs() pairs per thread.
// - Index arithmetic in index_t: int32 when every offset fits, int64 otherwise; a thread's
//   place in the block is decomposed once, a token's offsets once per token and lane.
// - Few tokens (decode): as few rows per thread as a block allows, so the launch spreads the
//   heads over as many threads as it can; many tokens: kBatch rows per thread.
// - The grid is the resident capacity (occupancy API) and threads stride over the blocks.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../rope_math.h"

namespace rope_ext {
namespace cuda_kernel {

constexpr int kThreads = 256;       // threads per block
constexpr int kBatch = 4;           // rows a thread loads before it stores any of them
constexpr int kScalarBatch = 1;     // the same on the scalar path (its loads are elements)
constexpr int kChunkBytes = 16;     // one vector load or store
constexpr int kScalarPassSpan = 8;  // pass-through elements per thread on the scalar path

struct alignas(kChunkBytes) Bits128 {
  uint32_t w[4];
};

template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// How one operand's rows map onto threads. Its leading dims are split into the head dim
// (the innermost dim whose rows share a position; absent: one head) and the token dims.
struct OperandPlan {
  int32_t ndim;  // token dims, outermost first
  int64_t sizes[kMaxDims];
  int64_t x_strides[kMaxDims];
  int64_t out_strides[kMaxDims];
  int64_t pos_strides[kMaxDims];
  int64_t tokens;  // product of sizes
  int64_t heads;   // rows of one token
  int64_t head_x_stride;
  int64_t head_out_stride;
  int32_t lanes;          // chunks of a row: rotary chunks, then pass-through chunks
  int32_t rotary_lanes;
  int32_t groups;         // threads across the heads of a token
  int32_t rows_per_thread;
  int32_t tokens_per_block;
  int64_t blocks;
};

// The kernel's one argument.
struct KernelParams {
  RotaryParams p;
  OperandPlan op[2];
  int64_t blocks;        // op[0].blocks + op[1].blocks
  int32_t lane_threads;  // threads across a row (its lanes, or fewer that loop over them)
};

struct LaunchPlan {
  KernelParams k;
  int64_t grid;
  bool vector;      // the 16-byte path
  bool wide_index;  // int64 offsets
};

// Elements of a 16-byte chunk as opmath values, and back. The float to 16-bit conversions
// are c10's, which round to nearest even on the host and the device alike.
template <typename T>
struct Packed {
  static constexpr int kCount = kChunkBytes / sizeof(T);

  ROPE_HD static opmath_t<T> get(const Bits128& b, int i) {
    if constexpr (sizeof(T) == 2) {
      const uint16_t bits = static_cast<uint16_t>(b.w[i / 2] >> (16 * (i % 2)));
      return static_cast<float>(T(bits, T::from_bits()));
    } else {
      T v;
      memcpy(&v, reinterpret_cast<const char*>(b.w) + i * sizeof(T), sizeof(T));
      return v;
    }
  }

  ROPE_HD static void set(Bits128& b, int i, opmath_t<T> v) {
    if constexpr (sizeof(T) == 2) {
      const uint32_t bits = static_cast<T>(v).x;
      b.w[i / 2] = i % 2 == 0 ? bits : (b.w[i / 2] | (bits << 16));
    } else {
      const T t = static_cast<T>(v);
      memcpy(reinterpret_cast<char*>(b.w) + i * sizeof(T), &t, sizeof(T));
    }
  }
};

// Rows a thread loads before it stores any: kBatch 16-byte chunks (64 bytes in flight per
// thread) on the vector path, kScalarBatch rows on the scalar path. Half-split rows take two
// chunks each; one row at a time when the registers are short (a float64 table for a 16- or
// 32-bit x, or 64-bit offsets).
ROPE_HD constexpr int rows_per_batch(bool vector, bool interleaved, bool short_of_registers) {
  return !vector ? kScalarBatch : interleaved ? kBatch : short_of_registers ? 1 : kBatch / 2;
}

// Blocks each SM must hold at once, which bounds registers per thread (65536 per SM): the
// vector path keeps 3 (768 threads, 48 KB of loads in flight per SM, ~1.7x what covers HBM3e
// latency at full bandwidth on an H200), so at most 80 registers; the scalar path and MRoPE
// (a table row per pair) 2, so at most 128.
ROPE_HD constexpr int min_blocks_per_sm(bool vector, bool mrope) {
  return vector && !mrope ? 3 : 2;
}

// Pairs per thread on the scalar path: 4 (2 in float64, for registers).
ROPE_HD constexpr int scalar_pairs(size_t elem) {
  return elem == 8 ? 2 : 4;
}

// min() by value (std::min takes references, which device code cannot bind to constants).
template <typename T>
ROPE_HD T smaller(T a, T b) {
  return a < b ? a : b;
}

// The stored position at positions offset pos_offset.
template <typename Mem>
ROPE_HD int64_t load_position(const RotaryParams& p, int64_t pos_offset, Mem& mem) {
  return p.positions_int64 ? mem.load(static_cast<const int64_t*>(p.positions) + pos_offset)
                           : mem.load(static_cast<const int32_t*>(p.positions) + pos_offset);
}

// The rotation of one thread of a rotary launch: blocks block, block + grid, ... of the plan.
// Mem performs the memory accesses (plain loads and stores on the device; checked ones in the
// host emulation).
template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, bool kMrope,
          typename index_t, typename Mem>
ROPE_HD void rotary_thread(const KernelParams& kp, int64_t block, int32_t thread, int64_t grid,
                           Mem& mem) {
  using opmath = opmath_t<scalar_t>;
  using Io = Packed<scalar_t>;
  constexpr int V = Io::kCount;
  constexpr int kPairs = kVector ? (kInterleaved ? V / 2 : V) : scalar_pairs(sizeof(scalar_t));
  constexpr int kPassSpan = kVector ? V : kScalarPassSpan;
  constexpr int kRows = rows_per_batch(kVector, kInterleaved,
                                       sizeof(table_t) > sizeof(opmath) || sizeof(index_t) > 4);
  constexpr int kTableVecs = kPairs * 2 * sizeof(table_t) / kChunkBytes;
  // The vector path reads a lane's (cos, sin) as 16-byte vectors whenever they fill whole
  // vectors (use_vector_path() checked the table's layout); else element by element.
  constexpr bool kTableVecOk = kVector && (kPairs * 2 * sizeof(table_t)) % kChunkBytes == 0;
  // Elements of a row that one rotary lane holds: V interleaved, V per half otherwise.
  constexpr int kHalves = kInterleaved ? 1 : 2;
  constexpr int kSpan = kInterleaved ? 2 * kPairs : kPairs;

  const RotaryParams& p = kp.p;
  // Thread = (token in block * groups + group) * lane_threads + lane; the lanes are the same
  // for every operand of a launch.
  const int32_t first_lane = thread % kp.lane_threads;
  const int32_t rest_of_thread = thread / kp.lane_threads;

#pragma unroll 1
  for (index_t b = static_cast<index_t>(block); b < static_cast<index_t>(kp.blocks);
       b += static_cast<index_t>(grid)) {
    const bool second = b >= static_cast<index_t>(kp.op[0].blocks);
    const int o = second ? 1 : 0;
    const OperandPlan& pl = kp.op[o];
    const int32_t group = rest_of_thread % pl.groups;
    const int32_t token_in_block = rest_of_thread / pl.groups;
    if (token_in_block >= pl.tokens_per_block) {
      continue;
    }
    const index_t token =
        (second ? b - static_cast<index_t>(kp.op[0].blocks) : b) * pl.tokens_per_block +
        token_in_block;
    if (token >= pl.tokens) {
      continue;
    }
    const RotaryOperand& op = p.operands[o];
    // The token's offsets, from its index over the token dims.
    // The outermost dim takes what is left, without a division (often the only token dim).
    index_t rest = token, x_off = 0, out_off = 0, pos_off = 0;
#pragma unroll 1
    for (int d = pl.ndim - 1; d > 0; --d) {
      const index_t size = static_cast<index_t>(pl.sizes[d]);
      const index_t i = rest % size;
      rest /= size;
      x_off += i * static_cast<index_t>(pl.x_strides[d]);
      out_off += i * static_cast<index_t>(pl.out_strides[d]);
      pos_off += i * static_cast<index_t>(pl.pos_strides[d]);
    }
    if (pl.ndim > 0) {
      x_off += rest * static_cast<index_t>(pl.x_strides[0]);
      out_off += rest * static_cast<index_t>(pl.out_strides[0]);
      pos_off += rest * static_cast<index_t>(pl.pos_strides[0]);
    }
    const auto* x = static_cast<const scalar_t*>(op.x) + x_off +
                    group * static_cast<index_t>(pl.head_x_stride);
    auto* out = static_cast<scalar_t*>(op.out) + out_off +
                group * static_cast<index_t>(pl.head_out_stride);
    const index_t x_step = static_cast<index_t>(pl.groups * pl.head_x_stride);
    const index_t out_step = static_cast<index_t>(pl.groups * pl.head_out_stride);
    const index_t xs = static_cast<index_t>(op.x_feature_stride);
    const index_t os = static_cast<index_t>(op.out_feature_stride);
    // The thread's rows are heads group + j * groups, j < rows_per_thread, below heads.
    const int32_t rows = pl.rows_per_thread;
    const index_t heads_left = static_cast<index_t>(pl.heads) - group;
    const index_t groups = pl.groups;
    auto has_row = [&](int32_t j) { return j < rows && j * groups < heads_left; };

    // The work of one lane of every row of the thread.
    auto lane_work = [&](int32_t lane) {
      if (lane >= pl.rotary_lanes) {
        // Pass-through features, out-of-place calls only: copied as they are.
        const index_t f = static_cast<index_t>(2 * p.rot_pairs) +
                          static_cast<index_t>(lane - pl.rotary_lanes) * kPassSpan;
        // One batch per iteration: unrolling would hold two batches' registers.
#pragma unroll 1
        for (int32_t j0 = 0; j0 < rows; j0 += kRows) {
          if constexpr (kVector) {  // whole chunks: vectorisable() checked the sizes
            Bits128 v[kRows];
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
              if (has_row(j0 + j)) v[j] = mem.load128(x + (j0 + j) * x_step + f);
            }
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
              if (has_row(j0 + j)) mem.store128(out + (j0 + j) * out_step + f, v[j]);
            }
          } else {
            const int64_t count = op.head_dim - f;
            scalar_t v[kRows][kPassSpan];
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
#pragma unroll
              for (int e = 0; e < kPassSpan; ++e) {
                if (has_row(j0 + j) && e < count) {
                  v[j][e] = mem.load(x + (j0 + j) * x_step + (f + e) * xs);
                }
              }
            }
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
#pragma unroll
              for (int e = 0; e < kPassSpan; ++e) {
                if (has_row(j0 + j) && e < count) {
                  mem.store(out + (j0 + j) * out_step + (f + e) * os, v[j][e]);
                }
              }
            }
          }
        }
        return;
      }

      const index_t pair0 = static_cast<index_t>(lane) * kPairs;
      const int32_t pairs =
          kVector ? kPairs : static_cast<int32_t>(smaller<int64_t>(kPairs, p.rot_pairs - pair0));
      const auto* table = static_cast<const table_t*>(p.table);
      opmath c[kPairs], s[kPairs];
      if constexpr (kMrope) {
        // Each pair from the table row of its axis' position: element loads.
        int64_t rows[kMaxMropeAxes];
#pragma unroll
        for (int a = 0; a < kMaxMropeAxes; ++a) {
          rows[a] = 0;
          if (a < p.mrope_axes) {
            rows[a] = p.offset + load_position(p, pos_off + a * p.mrope_axis_stride, mem);
            mem.check_position(rows[a] >= 0 && rows[a] < p.table_rows);
          }
        }
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          if (j < pairs) {
            const int axis = pair_axis(p, pair0 + j);
            // Constant indices only, so rows stays in registers.
            const int64_t row = axis == 0 ? rows[0] : axis == 1 ? rows[1]
                                : axis == 2 ? rows[2] : rows[3];
            const table_t* e =
                table + row * p.table_row_stride + (pair0 + j) * p.table_pair_stride;
            c[j] = static_cast<opmath>(mem.load(e));
            s[j] = static_cast<opmath>(mem.load(e + p.table_cs_stride));
          }
        }
      } else {
        const int64_t position =
            p.offset + (p.positions == nullptr ? pos_off : load_position(p, pos_off, mem));
        mem.check_position(position >= 0 && position < p.table_rows);
        const table_t* entry =
            table + position * p.table_row_stride + pair0 * p.table_pair_stride;
        if constexpr (kTableVecOk) {
          constexpr int kPerVec = kChunkBytes / sizeof(table_t);
#pragma unroll
          for (int v = 0; v < kTableVecs; ++v) {
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
              const table_t* e = entry + j * p.table_pair_stride;
              c[j] = static_cast<opmath>(mem.load(e));
              s[j] = static_cast<opmath>(mem.load(e + p.table_cs_stride));
            }
          }
        }
      }
      if (p.inverse) {
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          if (j < pairs) s[j] = -s[j];
        }
      }

      // Feature of element e of half h of this lane's span.
      const index_t half_step = static_cast<index_t>(p.rot_pairs);
      const index_t f0 = kInterleaved ? 2 * pair0 : pair0;
      // One batch per iteration: unrolling would hold two batches' registers.
#pragma unroll 1
      for (int32_t j0 = 0; j0 < rows; j0 += kRows) {
        if constexpr (kVector) {
          Bits128 v[kRows][kHalves];
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              if (has_row(j0 + j)) {
                v[j][h] = mem.load128(x + (j0 + j) * x_step + f0 + h * half_step);
              }
            }
          }
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
            if (!has_row(j0 + j)) continue;
            Bits128 r[kHalves];
#pragma unroll
            for (int i = 0; i < kPairs; ++i) {
              // Interleaved: elements (2i, 2i+1) of the chunk; else element i of each half.
              const int h1 = kInterleaved ? 0 : 1;
              const int e0 = kInterleaved ? 2 * i : i, e1 = kInterleaved ? 2 * i + 1 : i;
              opmath y0, y1;
              rotate_pair(Io::get(v[j][0], e0), Io::get(v[j][h1], e1), c[i], s[i], y0, y1);
              Io::set(r[0], e0, y0);
              Io::set(r[h1], e1, y1);
            }
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              mem.store128(out + (j0 + j) * out_step + f0 + h * half_step, r[h]);
            }
          }
        } else {
          // Elements e of half h: feature f0 + h * half_step + e, present when e < width.
          const int32_t width = kInterleaved ? 2 * pairs : pairs;
          opmath v[kRows][kHalves][kSpan];
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
#pragma unroll
              for (int e = 0; e < kSpan; ++e) {
                if (has_row(j0 + j) && e < width) {
                  v[j][h][e] = static_cast<opmath>(
                      mem.load(x + (j0 + j) * x_step + (f0 + h * half_step + e) * xs));
                }
              }
            }
          }
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
#pragma unroll
            for (int i = 0; i < kPairs; ++i) {
              if (has_row(j0 + j) && i < pairs) {
                opmath& a = v[j][0][kInterleaved ? 2 * i : i];
                opmath& b = v[j][kHalves - 1][kInterleaved ? 2 * i + 1 : i];
                rotate_pair(a, b, c[i], s[i], a, b);
              }
            }
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
#pragma unroll
              for (int e = 0; e < kSpan; ++e) {
                if (has_row(j0 + j) && e < width) {
                  mem.store(out + (j0 + j) * out_step + (f0 + h * half_step + e) * os,
                            static_cast<scalar_t>(v[j][h][e]));
                }
              }
            }
          }
        }
      }
    };
    if constexpr (kVector) {
      if (first_lane < pl.lanes) {  // use_vector_path(): a row's lanes fit in a block
        lane_work(first_lane);
      }
    } else {
#pragma unroll 1
      for (int32_t lane = first_lane; lane < pl.lanes; lane += kp.lane_threads) {
        lane_work(lane);
      }
    }
  }
}

// One thread of the table fill: entries i, i + stride, ... of the [end, pairs] table.
template <typename table_t, typename Mem>
ROPE_HD void fill_freqs_cis_thread(table_t* out, const double* inv_freq, double magnitude,
                                   int64_t end, int64_t pairs, int64_t row_stride,
                                   int64_t pair_stride, int64_t cs_stride, int64_t first,
                                   int64_t stride, Mem& mem) {
  for (int64_t i = first; i < end * pairs; i += stride) {
    const int64_t t = i / pairs, pair = i % pairs;
    double c, s;
    table_entry(t, mem.load(inv_freq + pair), magnitude, c, s);
    table_t* at = out + t * row_stride + pair * pair_stride;
    mem.store(at, static_cast<table_t>(c));
    mem.store(at + cs_stride, static_cast<table_t>(s));
  }
}

// ---- Host side: the launch plans, shared by the CUDA launcher and the emulation ----

// Blocks of kThreads for the table fill of `items` entries.
inline int64_t fill_grid(int64_t items, int64_t sm_count) {
  return std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, sm_count * 8));
}

// Whether every row start and the feature layout allow aligned 16-byte chunks of n elements.
inline bool vectorisable(const RotaryParams& p, int64_t n, size_t elem) {
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    const int64_t pass = op.out != op.x ? op.head_dim - 2 * p.rot_pairs : 0;
    bool ok = op.x_feature_stride == 1 && op.out_feature_stride == 1 &&
              (p.interleaved ? (2 * p.rot_pairs) % n == 0 : p.rot_pairs % n == 0) &&
              pass % n == 0 && reinterpret_cast<uintptr_t>(op.x) % (n * elem) == 0 &&
              reinterpret_cast<uintptr_t>(op.out) % (n * elem) == 0;
    for (int64_t d = 0; ok && d < op.ndim; ++d) {
      ok = op.x_strides[d] % n == 0 && op.out_strides[d] % n == 0;
    }
    if (!ok) {
      return false;
    }
  }
  return true;
}

// Whether the call takes the 16-byte path: rows vectorisable, and the table readable as the
// vector kernel reads it (16-byte vectors of (cos, sin) pairs, when a lane's pairs fill them;
// MRoPE reads the table element by element).
inline bool use_vector_path(const RotaryParams& p, size_t elem, size_t table_elem) {
  const int64_t n = kChunkBytes / static_cast<int64_t>(elem);
  const int64_t lane_bytes = (p.interleaved ? n / 2 : n) * 2 * static_cast<int64_t>(table_elem);
  const bool table_ok = p.mrope_axes > 0 || lane_bytes % kChunkBytes != 0 ||
                        (p.table_pair_stride == 2 && p.table_cs_stride == 1 &&
                         reinterpret_cast<uintptr_t>(p.table) % kChunkBytes == 0 &&
                         p.table_row_stride * static_cast<int64_t>(table_elem) % kChunkBytes == 0);
  // A row's lanes must fit in one block: rotary lanes, then pass-through lanes (out of place).
  const int64_t lanes_needed =
      (p.interleaved ? 2 * p.rot_pairs : p.rot_pairs) / n +
      (p.num_operands > 0 && p.operands[0].out != p.operands[0].x
           ? (p.operands[0].head_dim - 2 * p.rot_pairs) / n
           : 0);
  return table_ok && lanes_needed <= kThreads && vectorisable(p, n, elem);
}

// The largest element offset a launch computes from one base pointer, over every operand,
// the positions and the table (indices stay below it).
inline int64_t largest_offset(const RotaryParams& p) {
  int64_t largest = p.table_rows * p.table_row_stride + p.rot_pairs * p.table_pair_stride +
                    p.table_cs_stride;
  int64_t rows = 0;  // the block loop's b + grid stays below twice the blocks, at most rows
  for (int o = 0; o < p.num_operands; ++o) {
    rows += p.operands[o].rows;
  }
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    int64_t x = (op.head_dim - 1) * op.x_feature_stride;
    int64_t out = (op.head_dim - 1) * op.out_feature_stride;
    int64_t pos = 0;
    for (int64_t d = 0; d < op.ndim; ++d) {
      x += (op.sizes[d] - 1) * op.x_strides[d];
      out += (op.sizes[d] - 1) * op.out_strides[d];
      pos += (op.sizes[d] - 1) * op.pos_strides[d];
    }
    pos += (p.mrope_axes > 0 ? p.mrope_axes - 1 : 0) * p.mrope_axis_stride;
    largest = std::max({largest, x, out, pos, 2 * rows + kThreads});
  }
  return largest;
}

// Splits an operand's leading dims into its head dim (the innermost whose rows share a
// position; absent: one head) and its token dims: fills pl's dims, tokens and heads.
inline void split_heads(const RotaryOperand& op, OperandPlan& pl) {
  int64_t head = -1;
  for (int64_t d = op.ndim - 1; d >= 0 && head < 0; --d) {
    if (op.pos_strides[d] == 0) head = d;
  }
  pl.heads = head >= 0 ? op.sizes[head] : 1;
  pl.head_x_stride = head >= 0 ? op.x_strides[head] : 0;
  pl.head_out_stride = head >= 0 ? op.out_strides[head] : 0;
  pl.ndim = 0;
  for (int64_t d = 0; d < op.ndim; ++d) {
    if (d == head) continue;
    pl.sizes[pl.ndim] = op.sizes[d];
    pl.x_strides[pl.ndim] = op.x_strides[d];
    pl.out_strides[pl.ndim] = op.out_strides[d];
    pl.pos_strides[pl.ndim] = op.pos_strides[d];
    ++pl.ndim;
  }
  pl.tokens = pl.heads > 0 ? op.rows / pl.heads : 0;
}

// Splits pl's head dim, where it has more than most_heads heads, into an inner head dim of h
// heads (the largest divisor of heads up to most_heads) and an outer token dim of heads / h
// "tokens" of the same position (positions stride 0). split_heads() left a place for it.
inline void split_head_dim(OperandPlan& pl, int64_t most_heads) {
  if (pl.heads <= most_heads) return;
  int64_t h = most_heads;
  while (pl.heads % h != 0) --h;
  pl.sizes[pl.ndim] = pl.heads / h;
  pl.x_strides[pl.ndim] = h * pl.head_x_stride;
  pl.out_strides[pl.ndim] = h * pl.head_out_stride;
  pl.pos_strides[pl.ndim] = 0;
  ++pl.ndim;
  pl.tokens *= pl.heads / h;
  pl.heads = h;
}

// The plan of a rotary launch on a GPU with sm_count SMs, each holding blocks_per_sm blocks of
// the kernel at once (the occupancy API's answer).
inline LaunchPlan plan_rotary(const RotaryParams& p, size_t elem, size_t table_elem,
                              int64_t sm_count, int64_t blocks_per_sm) {
  LaunchPlan plan{};
  KernelParams& kp = plan.k;
  kp.p = p;
  const int64_t v = kChunkBytes / static_cast<int64_t>(elem);
  plan.vector = use_vector_path(p, elem, table_elem);
  const int64_t pairs_per_lane = plan.vector ? (p.interleaved ? v / 2 : v) : scalar_pairs(elem);
  const int64_t pass_span = plan.vector ? v : kScalarPassSpan;
  plan.wide_index = largest_offset(p) > INT32_MAX;

  // Rows per thread: as many as kBatch while the launch still fills the GPU's resident
  // threads (more loads in flight per thread, and the table read by fewer threads); fewer,
  // down to what the block size allows, for small calls such as decode.
  auto threads_for = [&](int64_t rows_per_thread) {
    int64_t threads = 0;
    for (int o = 0; o < p.num_operands; ++o) {
      const OperandPlan& pl = kp.op[o];
      const int64_t groups = (pl.heads + rows_per_thread - 1) / rows_per_thread;
      threads += pl.tokens * groups * kp.lane_threads;
    }
    return threads;
  };
  int64_t fewest_rows = 1;  // the fewest rows per thread a block of kThreads allows
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    OperandPlan& pl = kp.op[o];
    split_heads(op, pl);
    pl.rotary_lanes = static_cast<int32_t>((p.rot_pairs + pairs_per_lane - 1) / pairs_per_lane);
    const int64_t pass = op.out != op.x ? op.head_dim - 2 * p.rot_pairs : 0;
    pl.lanes = pl.rotary_lanes + static_cast<int32_t>((pass + pass_span - 1) / pass_span);
    kp.lane_threads = std::min<int32_t>(pl.lanes, kThreads);
    const int64_t max_groups = std::max<int64_t>(1, kThreads / kp.lane_threads);
    fewest_rows = std::max(fewest_rows, (pl.heads + max_groups - 1) / max_groups);
  }
  const int64_t resident = sm_count * blocks_per_sm * kThreads;
  int64_t rows_per_thread = fewest_rows;
  // Too few rows to fill the GPU at that many per thread (decode without positions: every
  // row has the one position, so batch and heads merge into one head dim of B * H rows):
  // fewer rows per thread, the head dim split into blocks' worth of heads, as long as the
  // threads still fit in the resident ones. One wave and a partial second ran slower on the
  // H200 than one wave of two rows per thread (q, k [1,128,32,128]: 4.3 against 3.0 us).
  while (rows_per_thread > 1 && threads_for(rows_per_thread / 2) <= resident) {
    rows_per_thread /= 2;
  }
  if (rows_per_thread < fewest_rows) {
    for (int o = 0; o < p.num_operands; ++o) {
      split_head_dim(kp.op[o], std::max<int64_t>(1, kThreads / kp.lane_threads) * rows_per_thread);
    }
  }
  while (rows_per_thread < kBatch && threads_for(2 * rows_per_thread) >= resident) {
    rows_per_thread *= 2;
  }
  kp.blocks = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    OperandPlan& pl = kp.op[o];
    const int64_t rows = std::min(rows_per_thread, pl.heads);
    pl.groups = static_cast<int32_t>((pl.heads + rows - 1) / rows);
    pl.rows_per_thread = static_cast<int32_t>((pl.heads + pl.groups - 1) / pl.groups);
    pl.tokens_per_block = std::max<int32_t>(1, kThreads / (kp.lane_threads * pl.groups));
    pl.blocks = (pl.tokens + pl.tokens_per_block - 1) / pl.tokens_per_block;
    kp.blocks += pl.blocks;
  }
  plan.grid = std::max<int64_t>(1, std::min(kp.blocks, sm_count * blocks_per_sm));
  return plan;
}

}  // namespace cuda_kernel
}  // namespace rope_ext
