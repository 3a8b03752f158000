// Body of the fused RMSNorm + RoPE CPU kernel (arithmetic in ../qk_norm.h). Included after
// rope_cpu_kernel_impl.h by the same per-instruction-set .cpp files: it rotates with that
// file's vector code, in opmath, on a row held in a buffer of the thread's own.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "../qk_norm.h"

namespace rope_ext::cpu {
namespace CPU_CAPABILITY {
namespace {

// A row in opmath, padded with zeros to whole vector pairs: the vector loops run over
// whole vectors, and the padding stays zero (a scaled or rotated zero is zero). Aligned to
// 64 bytes: a 64-byte vector store split over two cache lines does not forward to the load
// that reads it back (~20x slower per row on AMD Zen 4).
template <typename opmath>
struct PaddedRow {
  static constexpr int64_t kV = Vectorized<opmath>::size();
  static constexpr int64_t kAlign = 64 / sizeof(opmath);
  std::vector<opmath> storage;
  int64_t start;
  // The elements a row of n holds: n rounded up to whole vector pairs, and one pair more.
  static int64_t padded_size(int64_t n) {
    return (n + 2 * kV - 1) / (2 * kV) * (2 * kV) + 2 * kV;
  }
  explicit PaddedRow(int64_t n) : storage(padded_size(n) + kAlign) {
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    start = static_cast<int64_t>((64 - address % 64) % 64 / sizeof(opmath));
  }
  PaddedRow(const PaddedRow&) = delete;  // a copy would lose the alignment
  PaddedRow(PaddedRow&&) noexcept = default;  // the buffer moves with its offset
  opmath* data() { return storage.data() + start; }
  const opmath* data() const { return storage.data() + start; }
  int64_t size() const { return static_cast<int64_t>(storage.size()) - kAlign; }
};

// n contiguous elements of x into f as opmath, zero-filled past n to whole vector pairs;
// with kSumSquares, returns the sum of their squares too (0 otherwise), in the same pass.
template <bool kSumSquares, typename scalar_t>
opmath_t<scalar_t> load_contiguous_row(const scalar_t* x, int64_t n, opmath_t<scalar_t>* f) {
  using opmath = opmath_t<scalar_t>;
  using V = Vectorized<opmath>;
  constexpr int64_t kV = V::size();
  V sum_a(0), sum_b(0);  // two chains of FMAs
  auto put = [&](const V& a, const V& b, int64_t j) {
    a.store(f + j);
    b.store(f + j + kV);
    if constexpr (kSumSquares) {
      sum_a = at::vec::fmadd(a, a, sum_a);
      sum_b = at::vec::fmadd(b, b, sum_b);
    }
  };
  int64_t j = 0;
  for (; j + 2 * kV <= n; j += 2 * kV) {
    const auto [a, b] = load2(x + j);
    put(a, b, j);
  }
  if (j < n) {
    const auto [a, b] = load2(x + j, n - j);
    put(a, b, j);
  }
  if constexpr (kSumSquares) {
    return at::vec::vec_reduce_all<opmath>([](V& u, V& v) { return u + v; }, sum_a + sum_b);
  }
  return opmath(0);
}

// n elements of x (feature stride xs) into f as opmath.
template <typename scalar_t>
void load_row(const scalar_t* x, int64_t xs, int64_t n, opmath_t<scalar_t>* f) {
  if (xs != 1) {
    for (int64_t j = 0; j < n; ++j) {
      f[j] = static_cast<opmath_t<scalar_t>>(x[j * xs]);
    }
    return;
  }
  load_contiguous_row<false>(x, n, f);
}

// f[0, n) to out (feature stride os), rounding once.
template <typename scalar_t>
void store_row(const opmath_t<scalar_t>* f, scalar_t* out, int64_t os, int64_t n) {
  using V = Vectorized<opmath_t<scalar_t>>;
  constexpr int64_t kV = V::size();
  if (os != 1) {
    for (int64_t j = 0; j < n; ++j) {
      out[j * os] = static_cast<scalar_t>(f[j]);
    }
    return;
  }
  int64_t j = 0;
  for (; j + 2 * kV <= n; j += 2 * kV) {
    store2(out + j, V::loadu(f + j), V::loadu(f + j + kV));
  }
  if (j < n) {
    store2(out + j, V::loadu(f + j), V::loadu(f + j + kV), n - j);
  }
}

// Vectors covering [0, n) of a padded row.
template <typename opmath>
int64_t padded_extent(int64_t n) {
  constexpr int64_t kV = Vectorized<opmath>::size();
  return (n + kV - 1) / kV * kV;
}

template <typename opmath>
opmath sum_of_products(const opmath* a, const opmath* b, int64_t n) {
  using V = Vectorized<opmath>;
  V acc(0);
  for (int64_t j = 0; j < padded_extent<opmath>(n); j += V::size()) {
    acc = at::vec::fmadd(V::loadu(a + j), V::loadu(b + j), acc);
  }
  return at::vec::vec_reduce_all<opmath>([](V& u, V& v) { return u + v; }, acc);
}

// One operand's scale weight + weight_offset in opmath, padded.
template <typename scalar_t>
PaddedRow<opmath_t<scalar_t>> scale_weights(const NormRotaryParams& p, int o) {
  using opmath = opmath_t<scalar_t>;
  const int64_t n = p.rotary.operands[o].head_dim;
  PaddedRow<opmath> w(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = j * p.weight_stride[o];
    const opmath v = p.weight_float[o] ? static_cast<opmath>(static_cast<const float*>(p.weight[o])[at])
                                       : static_cast<opmath>(static_cast<const scalar_t*>(p.weight[o])[at]);
    const opmath scaled = v + static_cast<opmath>(p.weight_offset);
    // NaN weights as the default NaN, like a Rotation's (clear_nan_payloads): store_step's
    // bfloat16 rounding relies on NaNs with clear low bits.
    w.data()[j] = std::isnan(scaled) ? std::numeric_limits<opmath>::quiet_NaN() : scaled;
  }
  return w;
}

// Calls fn(o, x offset, out offset, positions offset, span, x / out / positions strides of
// the span's rows, rows of o in [begin, end) from the span's first on) for the spans of rows
// [begin, end): runs of rows along an operand's innermost leading dim, the operands' rows in
// order.
template <typename Fn>
void for_each_span(const RotaryParams& p, int64_t begin, int64_t end, Fn&& fn) {
  int64_t first_row = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    const int64_t lo = std::max(begin, first_row);
    const int64_t hi = std::min(end, first_row + op.rows);
    first_row += op.rows;
    if (lo >= hi) {
      continue;
    }
    const int64_t inner = op.ndim - 1;
    const int64_t xs = inner >= 0 ? op.x_strides[inner] : 0;
    const int64_t os = inner >= 0 ? op.out_strides[inner] : 0;
    const int64_t ps = inner >= 0 ? op.pos_strides[inner] : 0;
    RowCursor cursor(op, lo - (first_row - op.rows));
    for (int64_t row = lo; row < hi;) {
      const int64_t span = std::min(hi - row, cursor.span());
      fn(o, cursor.x(), cursor.out(), cursor.pos(), span, xs, os, ps, hi - row);
      cursor.advance(span);
      row += span;
    }
  }
}

// Calls fn(o, x offset, out offset, rotation) for each row of [begin, end), its rotation from
// `cache`.
template <typename opmath, typename table_t, typename Fn>
void for_each_row(const RotaryParams& p, RotationCache<opmath, table_t>& cache, int64_t begin,
                  int64_t end, Fn&& fn) {
  for_each_span(p, begin, end, [&](int o, int64_t x_at, int64_t out_at, int64_t pos_at,
                                   int64_t span, int64_t xs, int64_t os, int64_t ps, int64_t) {
    for (int64_t j = 0; j < span; ++j) {
      fn(o, x_at + j * xs, out_at + j * os, cache.at(pos_at + j * ps));
    }
  });
}

// Normalising and rotating a row whose features are contiguous in x and out takes two
// passes: load, convert and sum the squares, keeping the opmath values in f; then scale,
// rotate, round and store, a step of whole vectors at a time. f, w and the rotation are
// padded with zeros, so the last step's loads run past the row's end; its stores are masked.

// The first pass; returns the row's RMS scale.
template <typename scalar_t>
opmath_t<scalar_t> load_row_scale(const scalar_t* x, opmath_t<scalar_t>* f, int64_t n,
                                  opmath_t<scalar_t> eps) {
  return rms_scale(load_contiguous_row<true>(x, n, f), n, eps);
}

// The second pass.
template <typename scalar_t, bool kInterleaved>
void scale_rotate_store(const opmath_t<scalar_t>* f, scalar_t* out, const opmath_t<scalar_t>* w,
                        opmath_t<scalar_t> scale, const Rotation<opmath_t<scalar_t>>& rotation,
                        int64_t pairs, int64_t n) {
  using V = Vectorized<opmath_t<scalar_t>>;
  constexpr int64_t kV = V::size();
  const V r(scale);
  auto scaled = [&](int64_t at) { return V::loadu(f + at) * r * V::loadu(w + at); };
  const int64_t rotary = 2 * pairs;
  if constexpr (kInterleaved) {
    for (int64_t i = 0; i < pairs; i += kV) {  // kV pairs: 2kV features
      const auto [x0, x1] = at::vec::deinterleave2(scaled(2 * i), scaled(2 * i + kV));
      V y0, y1;
      rotate_pair(x0, x1, V::loadu(rotation.cos + i), V::loadu(rotation.sin + i), y0, y1);
      const auto [lo, hi] = at::vec::interleave2(y0, y1);
      if (2 * i + 2 * kV <= rotary) {
        store2(out + 2 * i, lo, hi);
      } else {
        store2(out + 2 * i, lo, hi, rotary - 2 * i);
      }
    }
  } else {
    for (int64_t i = 0; i < pairs; i += 2 * kV) {  // 2kV pairs from each half
      V y0a, y1a, y0b, y1b;
      rotate_pair(scaled(i), scaled(pairs + i), V::loadu(rotation.cos + i),
                  V::loadu(rotation.sin + i), y0a, y1a);
      rotate_pair(scaled(i + kV), scaled(pairs + i + kV), V::loadu(rotation.cos + i + kV),
                  V::loadu(rotation.sin + i + kV), y0b, y1b);
      if (i + 2 * kV <= pairs) {
        store2(out + i, y0a, y0b);
        store2(out + pairs + i, y1a, y1b);
      } else {
        store2(out + i, y0a, y0b, pairs - i);
        store2(out + pairs + i, y1a, y1b, pairs - i);
      }
    }
  }
  for (int64_t j = rotary; j < n; j += 2 * kV) {  // the pass-through features, normalised
    if (j + 2 * kV <= n) {
      store2(out + j, scaled(j), scaled(j + kV));
    } else {
      store2(out + j, scaled(j), scaled(j + kV), n - j);
    }
  }
}

// The fast path: rows whose features are contiguous and all rotated, a whole number of the
// rotary kernel's steps long (Qwen3, Gemma 3: head_dim 128 or 256). A row stays in registers
// between the passes, in the lane order of that kernel's steps (the bfloat16 lane tricks
// included), and the weights and the rotation are held in the same order, made once.

// The opmath values of one step, as rotate_pair takes them: (x0a, x1a) turn by (c0, s0) and,
// for half-split rows, (x0b, x1b) by (c1, s1).
template <typename scalar_t>
struct StepValues {
  using V = Vectorized<opmath_t<scalar_t>>;
  V x0a, x1a, x0b, x1b;
};

template <typename scalar_t, bool kInterleaved>
StepValues<scalar_t> step_values(const StepInput<scalar_t, kInterleaved>& in) {
  if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16> && kInterleaved) {
    const auto [x0, x1] = split_bf16_lanes(in.lanes0);
    return {x0, x1, {}, {}};
  } else if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16>) {
    const auto [a_even, a_odd] = split_bf16_lanes(in.lanes0);
    const auto [b_even, b_odd] = split_bf16_lanes(in.lanes1);
    return {a_even, b_even, a_odd, b_odd};
  } else if constexpr (kInterleaved) {
    const auto [x0, x1] = at::vec::deinterleave2(in.a, in.b);
    return {x0, x1, {}, {}};
  } else {
    return {in.a, in.c, in.b, in.d};
  }
}

// The weights of the step at pair i, in step_values' order.
template <typename scalar_t, bool kInterleaved>
StepValues<scalar_t> weight_step(const opmath_t<scalar_t>* w, int64_t i, int64_t pairs) {
  using V = Vectorized<opmath_t<scalar_t>>;
  constexpr int64_t kV = V::size();
  if constexpr (kInterleaved) {
    const auto [w0, w1] = at::vec::deinterleave2(V::loadu(w + 2 * i), V::loadu(w + 2 * i + kV));
    return {w0, w1, {}, {}};
  } else if constexpr (kBlocked<scalar_t, kInterleaved>) {  // [even pairs, odd pairs]
    const auto [w0_even, w0_odd] = at::vec::deinterleave2(V::loadu(w + i), V::loadu(w + i + kV));
    const auto [w1_even, w1_odd] =
        at::vec::deinterleave2(V::loadu(w + pairs + i), V::loadu(w + pairs + i + kV));
    return {w0_even, w1_even, w0_odd, w1_odd};
  } else {
    return {V::loadu(w + i), V::loadu(w + pairs + i), V::loadu(w + i + kV),
            V::loadu(w + pairs + i + kV)};
  }
}

// The values come from bfloat16 rows, a Rotation and scale_weights' weights, whose NaNs all
// have clear low bits (kNanLowBitsClear): the joins skip the NaN check. kStream: streaming
// stores (store_vector).
template <typename scalar_t, bool kInterleaved, bool kStream = false>
void store_step(const StepValues<scalar_t>& y, scalar_t* out, int64_t i, int64_t pairs) {
  if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16> && kInterleaved) {
    store_vector<kStream>(out + 2 * i, join_bf16_lanes<false>(y.x0a, y.x1a));
  } else if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16>) {
    store_vector<kStream>(out + i, join_bf16_lanes<false>(y.x0a, y.x0b));
    store_vector<kStream>(out + pairs + i, join_bf16_lanes<false>(y.x1a, y.x1b));
  } else if constexpr (kInterleaved) {
    const auto [lo, hi] = at::vec::interleave2(y.x0a, y.x1a);
    store2<kStream>(out + 2 * i, lo, hi);
  } else {
    store2<kStream>(out + i, y.x0a, y.x0b);
    store2<kStream>(out + pairs + i, y.x1a, y.x1b);
  }
}

// The rotation of one pair vector with the weights folded in, so that a row needs no
// separate scaling: y0 = r (x0 (w0 c) - x1 (w1 s)), y1 = r (x0 (w0 s) + x1 (w1 c)).
template <typename V>
struct WeightedRotation {
  V w0c, w1s, w0s, w1c;
  WeightedRotation() = default;
  WeightedRotation(const V& w0, const V& w1, const V& c, const V& s)
      : w0c(w0 * c), w1s(w1 * s), w0s(w0 * s), w1c(w1 * c) {}
  void apply(V& x0, V& x1, const V& r) const {
    const V y0 = at::vec::fmsub(x0, w0c, x1 * w1s);
    const V y1 = at::vec::fmadd(x0, w0s, x1 * w1c);
    x0 = y0 * r;
    x1 = y1 * r;
  }
};

// Rows on the fast path are normalised a block at a time, in two passes over the block. The
// first loads each row, sums its squares and reduces the sum, then computes the block's
// scales a vector at a time (one division, square root and division per vector of rows, not
// per row); the second loads each row again, from L1, rotates it with the weights and its
// scale folded in, and stores it. Done a row at a time, the rotation waited on the row's own
// chain of reduction, division, square root and division (some 80 cycles), and the
// out-of-order window could not hide it: 12-14 ns a row on a Zen 5 core where RoPE alone
// takes 5. That chain is still the cost of a block: with it left out, the fused kernel ran
// within 5% of RoPE alone. So in place, a block takes all the rows of one token it can, q's
// and k's heads together (norm_rotate_tokens), not one operand's span at a time: three
// chains a token of bf16 q, k [1, 2048, 32 / 8, 128] became one, and the fused kernel went
// from 1.31x RoPE alone's time to 1.22x (2 threads of a Zen 5). Out of place, spans of up to
// kNormBlock rows. A row's sum and scale do not depend on the block it is in (the reductions
// below keep one order, rms_scale's operations are IEEE), so every layout gets the same bits.
constexpr int kNormBlock = 64;
// Rows the second pass prefetches ahead on a span's walk, and tokens on the token walk, for
// the first pass of a later block. Measured on a Zen 5 core (bf16 q, k [1, 2048, 32 / 8,
// 128] in place, 2 threads, fused time / RoPE alone's, median of 11 interleaved rounds),
// tokens ahead: 1.28x for 1, 1.22x for 2, 1.31x for 3 and 4.
constexpr int64_t kNormPrefetchRows = 64;
constexpr int64_t kNormPrefetchTokens = 2;

// The squares of one row summed into one vector, in the step order of step_values, before
// the reduction across its lanes.
template <typename scalar_t, bool kInterleaved, int kSteps>
C10_ALWAYS_INLINE Vectorized<opmath_t<scalar_t>> row_squares(const scalar_t* x, int64_t pairs) {
  using opmath = opmath_t<scalar_t>;
  using V = Vectorized<opmath>;
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  V sum_a(0), sum_b(0);
  for (int k = 0; k < kSteps; ++k) {
    // Squared straight from the loaded step, never through a StepValues (GCC kept those on
    // the stack: eight dead 64-byte stores a row).
    const auto in = load_step<scalar_t, kInterleaved>(x, k * kStep, pairs);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      // Squared and summed in pairs by one instruction, unsplit: 2 a step, where the split
      // and the products took 8. vdpbf16ps flushes subnormal products and sums to zero, so
      // only a row whose mean square is below 2^-126 (1.2e-38, far under any model's eps)
      // can get another scale than the split path's.
      const auto lanes0 = reinterpret_cast<const __m512bh&>(static_cast<const __m512i&>(in.lanes0));
      sum_a = _mm512_dpbf16_ps(sum_a, lanes0, lanes0);
      if constexpr (!kInterleaved) {
        const auto lanes1 = reinterpret_cast<const __m512bh&>(static_cast<const __m512i&>(in.lanes1));
        sum_b = _mm512_dpbf16_ps(sum_b, lanes1, lanes1);
      }
      continue;
    }
#endif
    if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16>) {
      const auto [x0a, x0b] = split_bf16_lanes(in.lanes0);  // (x0a, x1a) if interleaved
      sum_a = at::vec::fmadd(x0a, x0a, sum_a);
      if constexpr (kInterleaved) {
        sum_b = at::vec::fmadd(x0b, x0b, sum_b);
      } else {
        const auto [x1a, x1b] = split_bf16_lanes(in.lanes1);
        sum_b = at::vec::fmadd(x1a, x1a, sum_b);
        sum_a = at::vec::fmadd(x0b, x0b, sum_a);
        sum_b = at::vec::fmadd(x1b, x1b, sum_b);
      }
    } else {
      const StepValues<scalar_t> v = step_values<scalar_t, kInterleaved>(in);
      sum_a = at::vec::fmadd(v.x0a, v.x0a, sum_a);
      sum_b = at::vec::fmadd(v.x1a, v.x1a, sum_b);
      if constexpr (!kInterleaved) {
        sum_a = at::vec::fmadd(v.x0b, v.x0b, sum_a);
        sum_b = at::vec::fmadd(v.x1b, v.x1b, sum_b);
      }
    }
  }
  return sum_a + sum_b;
}

// The lane sums of row vectors (row g's vector at acc + g * V::size(), its sum to sums[g]),
// each made with the additions of at::vec::vec_reduce_all, in its order, so with its bits:
// that reduction adds lane i to lane i ^ (half the width), then i ^ (a quarter), ... down to
// i ^ 1. With AVX512 and AVX2 floats, kGroup rows are reduced together, a transpose as they
// go: each pair of shuffles and its add takes one step of that order for two vectors at once,
// 45 operations for 16 rows where one row at a time took 8 each, all of them on one chain.
// reduce() takes a whole number of groups.
template <typename opmath>
void reduce_each_row(const opmath* acc, int rows, opmath* sums) {
  using V = Vectorized<opmath>;
  for (int g = 0; g < rows; ++g) {
    sums[g] = at::vec::vec_reduce_all<opmath>([](V& a, V& b) { return a + b; },
                                              V::loadu(acc + g * V::size()));
  }
}

template <typename opmath>
struct BlockReduction {
  static constexpr int kGroup = 1;
  static void reduce(const opmath* acc, int rows, opmath* sums) {
    reduce_each_row(acc, rows, sums);
  }
};
#if defined(CPU_CAPABILITY_AVX512)
template <>
struct BlockReduction<float> {
  static constexpr int kGroup = 16;
  static void reduce(const float* acc, int rows, float* sums) {
    for (int group = 0; group < rows; group += kGroup) {
      const float* a16 = acc + 16 * group;
      __m512 l1[8], l2[4], l3[2];
      for (int p = 0; p < 8; ++p) {  // i ^ 8: [A_i + A_i^8 | B_i + B_i^8], 8 lanes each
        const __m512 a = _mm512_load_ps(a16 + 32 * p), b = _mm512_load_ps(a16 + 32 * p + 16);
        l1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
      }
      for (int q = 0; q < 4; ++q) {  // i ^ 4: rows 4q .. 4q + 3 in 128-bit blocks 0 .. 3
        const __m512 x = l1[2 * q], y = l1[2 * q + 1];
        l2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
      }
      for (int r = 0; r < 2; ++r) {  // i ^ 2: block j holds rows 8r + j (lanes 0, 1), 8r + 4 + j
        const __m512 x = l2[2 * r], y = l2[2 * r + 1];
        l3[r] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xee));
      }
      // i ^ 1: block j holds rows j, 4 + j, 8 + j, 12 + j; row g goes back to lane g.
      const __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88),
                                       _mm512_shuffle_ps(l3[0], l3[1], 0xdd));
      const __m512i order =
          _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      _mm512_store_ps(sums + group, _mm512_permutexvar_ps(order, sum));
    }
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
template <>
struct BlockReduction<float> {
  static constexpr int kGroup = 8;
  static void reduce(const float* acc, int rows, float* sums) {
    for (int group = 0; group < rows; group += kGroup) {
      const float* a8 = acc + 8 * group;
      __m256 l1[4], l2[2];
      for (int p = 0; p < 4; ++p) {  // i ^ 4: [A_i + A_i^4 | B_i + B_i^4]
        const __m256 a = _mm256_load_ps(a8 + 16 * p), b = _mm256_load_ps(a8 + 16 * p + 8);
        l1[p] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                              _mm256_permute2f128_ps(a, b, 0x31));
      }
      for (int q = 0; q < 2; ++q) {  // i ^ 2: [rows 4q, 4q + 2 | 4q + 1, 4q + 3], 2 lanes each
        const __m256 x = l1[2 * q], y = l1[2 * q + 1];
        l2[q] = _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xee));
      }
      // i ^ 1: [rows 0, 2, 4, 6 | 1, 3, 5, 7]; row g goes back to lane g.
      const __m256 sum = _mm256_add_ps(_mm256_shuffle_ps(l2[0], l2[1], 0x88),
                                       _mm256_shuffle_ps(l2[0], l2[1], 0xdd));
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_store_ps(sums + group, _mm256_permutevar8x32_ps(sum, order));
    }
  }
};
#endif

// Rows of one operand in a block: `rows` rows, x and out `xs` / `os` elements apart, each
// prefetching the row `ahead_x` / `ahead_out` elements on in its second pass (0: none).
template <typename scalar_t>
struct NormSegment {
  const scalar_t* x;
  scalar_t* out;
  int64_t xs, os;
  int rows, operand;
  int64_t ahead_x, ahead_out;
};

// Normalises and rotates a block: the rows of `count` segments, kNormBlock at most, all
// turned by `rotation`, each segment's with its operand's weights (in step order); streaming
// stores when kStream.
template <typename scalar_t, bool kInterleaved, int kSteps, bool kStream = false>
void norm_rotate_block_fast(const NormSegment<scalar_t>* segments, int count,
                            const StepValues<scalar_t>* const (&weights)[2],
                            const Rotation<opmath_t<scalar_t>>& rotation, int64_t pairs,
                            opmath_t<scalar_t> eps) {
  using opmath = opmath_t<scalar_t>;
  using V = Vectorized<opmath>;
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  using Reduction = BlockReduction<opmath>;
  static_assert(kNormBlock % Reduction::kGroup == 0);
  // Raw storage, not V acc[kNormBlock]: GCC zero-filled that array on every block.
  alignas(64) opmath acc[kNormBlock * V::size()];
  int rows = 0;
  for (int s = 0; s < count; ++s) {
    const NormSegment<scalar_t>& seg = segments[s];
    for (int j = 0; j < seg.rows; ++j, ++rows) {
      row_squares<scalar_t, kInterleaved, kSteps>(seg.x + j * seg.xs, pairs)
          .store(acc + rows * V::size());
    }
  }
  alignas(64) opmath scale[kNormBlock];
  // A block of one or two rows (tokens with positions of their own come one row at a time)
  // reduces them one by one, in the same order; others in whole groups.
  const bool together = rows > 2;
  const int reduced = together ? (rows + Reduction::kGroup - 1) / Reduction::kGroup * Reduction::kGroup : rows;
  if (together) {
    // The rows past `rows` are copies of the last, reduced and never used. (Zeros, a memset,
    // made GCC save and restore every vector register around the call.)
    for (int g = rows; g < reduced; ++g) {
      V::loadu(acc + (rows - 1) * V::size()).store(acc + g * V::size());
    }
    Reduction::reduce(acc, reduced, scale);
  } else {
    reduce_each_row(acc, rows, scale);
  }
  // rms_scale, a vector of rows at a time: the same IEEE operations, so the same bits.
  const V n(static_cast<opmath>(2 * pairs));
  for (int g = 0; g < reduced; g += V::size()) {  // no lane past `reduced` read or stored
    const int lanes = std::min<int>(V::size(), reduced - g);
    (V(1) / (V::loadu(scale + g, lanes) / n + V(eps)).sqrt()).store(scale + g, lanes);
  }
  constexpr int64_t kRowBytes = 2 * kSteps * kStep * static_cast<int64_t>(sizeof(scalar_t));
  const opmath* r_row = scale;
  for (int s = 0; s < count; ++s) {
    const NormSegment<scalar_t>& seg = segments[s];
    WeightedRotation<V> turn[2][kSteps];  // (x0a, x1a) and (x0b, x1b) of each step
    for (int k = 0; k < kSteps; ++k) {
      const StepRotation<scalar_t, kInterleaved> step(rotation, k * kStep);
      const StepValues<scalar_t>& w = weights[seg.operand][k];
      turn[0][k] = WeightedRotation<V>(w.x0a, w.x1a, step.c0, step.s0);
      if constexpr (!kInterleaved) {
        turn[1][k] = WeightedRotation<V>(w.x0b, w.x1b, step.c1, step.s1);
      }
    }
    const scalar_t* x = seg.x;
    scalar_t* out = seg.out;
    for (int g = 0; g < seg.rows; ++g, x += seg.xs, out += seg.os) {
      if (seg.ahead_x != 0) {  // unrolled: kRowBytes is a constant
        prefetch_bytes<false>(x + seg.ahead_x, kRowBytes);
      }
      if (seg.ahead_out != 0) {
        prefetch_bytes<true>(out + seg.ahead_out, kRowBytes);
      }
      const V r(*r_row++);
      for (int k = 0; k < kSteps; ++k) {
        StepValues<scalar_t> v = step_values<scalar_t, kInterleaved>(
            load_step<scalar_t, kInterleaved>(x, k * kStep, pairs));
        turn[0][k].apply(v.x0a, v.x1a, r);
        if constexpr (!kInterleaved) {
          turn[1][k].apply(v.x0b, v.x1b, r);
        }
        store_step<scalar_t, kInterleaved, kStream>(v, out, k * kStep, pairs);
      }
    }
  }
}

// Normalises and rotates `rows` rows of operand o that share the rotation, a block at a time.
// Rows back to back in memory ([B, S, H, D], and transformers' [B, H, S, D] views of it) are
// prefetched kNormPrefetchRows ahead, into the next spans: the first pass then reads them
// from L1, where it had nothing to overlap their wait on L2 or L3. Only rows of the task's
// own, the first `task_rows` from x on: a prefetch into the next task's rows pulled lines that
// another core was writing, and that core then took them back, every call. bf16 q, k
// [32, 1, 32 / 8, 128] at one position in place (two tasks of 640 rows), 2 threads of a Zen 4,
// AVX512_BF16: the thread whose rows the other prefetched ran 2.7x as long as the other
// (perf), and a call took 22-37 us, against 13-19 without those prefetches (1 thread: 17-20).
// kStream: streaming stores (stream_output), and no prefetch of out.
template <typename scalar_t, bool kInterleaved, int kSteps, bool kStream>
void norm_rotate_span_fast(const scalar_t* x, scalar_t* out, int64_t rows, int64_t task_rows,
                           int64_t xs, int64_t os, int o,
                           const StepValues<scalar_t>* const (&weights)[2],
                           const Rotation<opmath_t<scalar_t>>& rotation, int64_t pairs,
                           opmath_t<scalar_t> eps) {
  constexpr int64_t kRowElems = 2 * kSteps * kStepPairs<scalar_t, kInterleaved>;
  const int64_t ahead_x = xs == kRowElems ? kNormPrefetchRows * xs : 0;
  const int64_t ahead_out = out != x && os == kRowElems && !kStream ? kNormPrefetchRows * os : 0;
  for (int64_t row = 0; row < rows; row += kNormBlock) {
    const int block = static_cast<int>(std::min<int64_t>(kNormBlock, rows - row));
    // The block's rows whose prefetch stays in the task, then the rest, without.
    const int prefetching = static_cast<int>(
        std::clamp<int64_t>(task_rows - kNormPrefetchRows - row, 0, block));
    NormSegment<scalar_t> segments[2];
    int count = 0;
    if (prefetching > 0) {
      segments[count++] = {x + row * xs, out + row * os, xs, os, prefetching, o, ahead_x,
                           ahead_out};
    }
    if (prefetching < block) {
      segments[count++] = {x + (row + prefetching) * xs, out + (row + prefetching) * os, xs, os,
                           block - prefetching, o, 0, 0};
    }
    norm_rotate_block_fast<scalar_t, kInterleaved, kSteps, kStream>(segments, count, weights,
                                                                    rotation, pairs, eps);
  }
}

// The tokens [begin, end) of two operands that pair up token by token (paired_tokens): each
// token's q and k rows are normalised and rotated in the same blocks, with the one rotation
// of its position. `cursors` are at the first token's rows.
template <typename scalar_t, bool kInterleaved, int kSteps>
void norm_rotate_tokens_fast(const RotaryParams& p, RowCursor (&cursors)[2], int64_t tokens,
                             const StepValues<scalar_t>* const (&weights)[2],
                             const std::function<const Rotation<opmath_t<scalar_t>>&(int64_t)>&
                                 rotation_at,
                             opmath_t<scalar_t> eps) {
  NormSegment<scalar_t> segments[2];  // a block holds one run of q's rows and one of k's
  int64_t ahead_x[2];  // elements
  for (int o = 0; o < 2; ++o) {
    const RotaryOperand& op = p.operands[o];
    // The same row kNormPrefetchTokens tokens on, along the innermost token dim of more than
    // one (a decode step's [B, 1, H, D]: the batch).
    int d = op.ndim - 2;
    while (d >= 0 && op.sizes[d] == 1) {
      --d;
    }
    ahead_x[o] = d >= 0 ? kNormPrefetchTokens * op.x_strides[d] : 0;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const Rotation<opmath_t<scalar_t>>& rotation = rotation_at(cursors[0].pos());
    int count = 0, rows = 0;
    for (int o = 0; o < 2; ++o) {
      const RotaryOperand& op = p.operands[o];
      const int64_t heads = op.sizes[op.ndim - 1];
      const int64_t xs = op.x_strides[op.ndim - 1], os = op.out_strides[op.ndim - 1];
      const auto* x = static_cast<const scalar_t*>(op.x) + cursors[o].x();
      auto* out = static_cast<scalar_t*>(op.out) + cursors[o].out();
      for (int64_t j = 0; j < heads;) {
        const int take = static_cast<int>(std::min<int64_t>(heads - j, kNormBlock - rows));
        segments[count++] = {x + j * xs, out + j * os, xs, os, take, o,
                             t + kNormPrefetchTokens < tokens ? ahead_x[o] : 0, 0};
        rows += take;
        j += take;
        if (rows == kNormBlock) {
          norm_rotate_block_fast<scalar_t, kInterleaved, kSteps>(segments, count, weights,
                                                                 rotation, p.rot_pairs, eps);
          count = rows = 0;
        }
      }
      cursors[o].advance(heads);
    }
    if (rows > 0) {
      norm_rotate_block_fast<scalar_t, kInterleaved, kSteps>(segments, count, weights, rotation,
                                                             p.rot_pairs, eps);
    }
  }
}

template <typename scalar_t>
using RotationAt = std::function<const Rotation<opmath_t<scalar_t>>&(int64_t)>;

// The fast path's functions for rows of `pairs` pairs, all rotated, in 1, 2, 4 or 8 whole
// steps; nullptrs for other rows. span_stream: span's streaming-store form (stream_output).
template <typename scalar_t>
using FastSpanFn = void (*)(const scalar_t*, scalar_t*, int64_t, int64_t, int64_t, int64_t, int,
                            const StepValues<scalar_t>* const (&)[2],
                            const Rotation<opmath_t<scalar_t>>&, int64_t, opmath_t<scalar_t>);
template <typename scalar_t>
struct FastFunctions {
  FastSpanFn<scalar_t> span = nullptr;
  void (*tokens)(const RotaryParams&, RowCursor (&)[2], int64_t,
                 const StepValues<scalar_t>* const (&)[2], const RotationAt<scalar_t>&,
                 opmath_t<scalar_t>) = nullptr;
  FastSpanFn<scalar_t> span_stream = nullptr;
};

template <typename scalar_t, bool kInterleaved, int kSteps>
FastFunctions<scalar_t> fast_functions_of() {
  FastFunctions<scalar_t> f{norm_rotate_span_fast<scalar_t, kInterleaved, kSteps, false>,
                            norm_rotate_tokens_fast<scalar_t, kInterleaved, kSteps>};
  if constexpr (kStreamingStores && kSteps > 0) {
    f.span_stream = norm_rotate_span_fast<scalar_t, kInterleaved, kSteps, true>;
  }
  return f;
}

template <typename scalar_t, bool kInterleaved>
FastFunctions<scalar_t> fast_functions(int64_t pairs, int64_t head_dim) {
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  if (head_dim != 2 * pairs || pairs % kStep != 0) {
    return {};
  }
  switch (pairs / kStep) {
    case 1: return fast_functions_of<scalar_t, kInterleaved, 1>();
    case 2: return fast_functions_of<scalar_t, kInterleaved, 2>();
    case 4: return fast_functions_of<scalar_t, kInterleaved, 4>();
    case 8: return fast_functions_of<scalar_t, kInterleaved, 8>();
    default: return {};
  }
}

// Each operand's weights in the fast path's step order (fast_functions: 8 steps at most), on
// the stack. As vectors, with norm_rotate_rows' row buffer made up front, a task's heap
// allocations took a fifth of a small call's time (malloc_consolidate among them): bf16 q, k
// [1, 1, 1, 128] in place through the bare op, 2 threads of a Zen 4, AVX512_BF16, 3.7-4.8 us a
// call; 3.0-3.2 us without them (RoPE alone: 2.3-2.6).
template <typename scalar_t>
struct FastStepWeights {
  static constexpr int64_t kMaxSteps = 8;
  StepValues<scalar_t> steps[2][kMaxSteps];
};

template <typename scalar_t, bool kInterleaved>
void fast_step_weights(const RotaryParams& p, const PaddedRow<opmath_t<scalar_t>> (&weights)[2],
                       FastStepWeights<scalar_t>& out) {
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  TORCH_INTERNAL_ASSERT(p.rot_pairs <= FastStepWeights<scalar_t>::kMaxSteps * kStep);
  for (int o = 0; o < p.num_operands; ++o) {
    for (int64_t i = 0; i < p.rot_pairs; i += kStep) {
      out.steps[o][i / kStep] =
          weight_step<scalar_t, kInterleaved>(weights[o].data(), i, p.rot_pairs);
    }
  }
}

// The tokens of q and k when their rows pair up token by token, for norm_rotate_tokens; 0
// when they do not. They do when both are normalised in place and take the fast path with
// contiguous features, a token's heads are the innermost leading dim and share its position,
// and the dims above it (the tokens') have the same sizes and positions strides in both:
// [B, S, H, D] with any head counts (GQA), packed [T, H, D], one position per token or per
// batch row. Out of place, the token walk's four streams (q and k, read and written) ran
// 5-25% slower than the span walk's two (bf16 q, k [1, 2048, 32 / 8, 128], 2 threads).
template <typename scalar_t, bool kInterleaved>
int64_t paired_tokens(const RotaryParams& p) {
  if (p.num_operands != 2) {
    return 0;
  }
  const RotaryOperand& q = p.operands[0];
  const RotaryOperand& k = p.operands[1];
  if (q.rows == 0 || k.rows == 0 ||
      fast_functions<scalar_t, kInterleaved>(p.rot_pairs, q.head_dim).tokens == nullptr ||
      q.head_dim != k.head_dim || q.ndim != k.ndim || q.ndim < 1) {
    return 0;
  }
  int64_t tokens = 1;
  for (const RotaryOperand* op : {&q, &k}) {
    if (op->out != op->x || op->x_feature_stride != 1 || op->out_feature_stride != 1 ||
        op->pos_strides[op->ndim - 1] != 0) {
      return 0;
    }
  }
  for (int d = 0; d + 1 < q.ndim; ++d) {
    if (q.sizes[d] != k.sizes[d] || q.pos_strides[d] != k.pos_strides[d]) {
      return 0;
    }
    tokens *= q.sizes[d];
  }
  return tokens;
}

// The tokens [begin, end) of paired q and k (paired_tokens).
template <typename scalar_t, typename table_t, bool kInterleaved>
void norm_rotate_tokens(const NormRotaryParams& np,
                        const PaddedRow<opmath_t<scalar_t>> (&weights)[2], int64_t begin,
                        int64_t end) {
  using opmath = opmath_t<scalar_t>;
  const RotaryParams& p = np.rotary;
  RotationCache<opmath, table_t> cache(p, 2 * Vectorized<opmath>::size());
  FastStepWeights<scalar_t> steps;
  fast_step_weights<scalar_t, kInterleaved>(p, weights, steps);
  const StepValues<scalar_t>* const step_weights[2] = {steps.steps[0], steps.steps[1]};
  RowCursor cursors[2] = {
      RowCursor(p.operands[0], begin * p.operands[0].sizes[p.operands[0].ndim - 1]),
      RowCursor(p.operands[1], begin * p.operands[1].sizes[p.operands[1].ndim - 1])};
  const RotationAt<scalar_t> rotation_at = [&](int64_t pos) -> const Rotation<opmath>& {
    return cache.at(pos);
  };
  fast_functions<scalar_t, kInterleaved>(p.rot_pairs, p.operands[0].head_dim)
      .tokens(p, cursors, end - begin, step_weights, rotation_at, static_cast<opmath>(np.eps));
}

// Rows normalised a group at a time, first passes first: each row's scale is a long chain of
// dependent operations (sum, reduction, sqrt, division), which the other rows' loads overlap.
constexpr int64_t kNormGroup = 4;

// `stream`: contiguous rows whose output allows it take streaming stores (stream_output).
template <typename scalar_t, typename table_t, bool kInterleaved>
void norm_rotate_rows(const NormRotaryParams& np,
                      const PaddedRow<opmath_t<scalar_t>> (&weights)[2], int64_t begin,
                      int64_t end, bool stream) {
  using opmath = opmath_t<scalar_t>;
  const RotaryParams& p = np.rotary;
  RotationCache<opmath, table_t> cache(p, 2 * Vectorized<opmath>::size());
  const int64_t width = std::max(p.operands[0].head_dim, p.operands[p.num_operands - 1].head_dim);
  const int64_t row_stride = PaddedRow<opmath>::padded_size(width);
  std::optional<PaddedRow<opmath>> rows_buffer;  // made by the first row off the fast path
  std::vector<scalar_t> gathered;  // rows with strided features, made contiguous
  const opmath eps = static_cast<opmath>(np.eps);
  const auto fast = fast_functions<scalar_t, kInterleaved>(p.rot_pairs, width);
  FastStepWeights<scalar_t> steps;
  if (fast.span != nullptr) {
    fast_step_weights<scalar_t, kInterleaved>(p, weights, steps);
  }
  const StepValues<scalar_t>* const fast_weights[2] = {steps.steps[0], steps.steps[1]};
  for_each_span(p, begin, end, [&](int o, int64_t x_at, int64_t out_at, int64_t pos_at,
                                   int64_t span, int64_t xs, int64_t os, int64_t ps,
                                   int64_t task_rows) {
    const RotaryOperand& op = p.operands[o];
    const int64_t n = op.head_dim;
    const opmath* w = weights[o].data();
    const auto* x = static_cast<const scalar_t*>(op.x) + x_at;
    auto* out = static_cast<scalar_t*>(op.out) + out_at;
    const bool contiguous = op.x_feature_stride == 1 && op.out_feature_stride == 1;
    if (fast.span != nullptr && n == width) {
      if (contiguous && ps == 0) {
        const bool streams =
            stream && fast.span_stream != nullptr && streamable(out, span, os);
        (streams ? fast.span_stream : fast.span)(x, out, span, task_rows, xs, os, o,
                                                 fast_weights, cache.at(pos_at), p.rot_pairs,
                                                 eps);
        return;
      }
      // Strided rows are gathered and take the same path, so every layout gets the same bits.
      for (int64_t j = 0; j < span; ++j) {
        const Rotation<opmath>& rotation = cache.at(pos_at + j * ps);
        if (contiguous) {
          fast.span(x + j * xs, out + j * os, 1, task_rows - j, xs, os, o, fast_weights, rotation,
                    p.rot_pairs, eps);
          continue;
        }
        gathered.resize(n);
        for (int64_t f = 0; f < n; ++f) {
          gathered[f] = x[j * xs + f * op.x_feature_stride];
        }
        fast.span(gathered.data(), gathered.data(), 1, 1, 0, 0, o, fast_weights, rotation,
                  p.rot_pairs, eps);
        for (int64_t f = 0; f < n; ++f) {
          out[j * os + f * op.out_feature_stride] = gathered[f];
        }
      }
      return;
    }
    // Groups of rows that share a position (one rotation); single rows otherwise.
    if (!rows_buffer) {
      rows_buffer.emplace(kNormGroup * row_stride);
    }
    for (int64_t j0 = 0, group = 1; j0 < span; j0 += group) {
      group = ps == 0 && contiguous ? std::min(kNormGroup, span - j0) : 1;
      const Rotation<opmath>& rotation = cache.at(pos_at + j0 * ps);
      opmath scale[kNormGroup];
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* xr = x + (j0 + g) * xs;
        if (!contiguous) {
          gathered.resize(n);
          for (int64_t f = 0; f < n; ++f) {
            gathered[f] = xr[f * op.x_feature_stride];
          }
          xr = gathered.data();
        }
        scale[g] = load_row_scale(xr, rows_buffer->data() + g * row_stride, n, eps);
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* outr = out + (j0 + g) * os;
        scale_rotate_store<scalar_t, kInterleaved>(rows_buffer->data() + g * row_stride,
                                                   contiguous ? outr : gathered.data(), w,
                                                   scale[g], rotation, p.rot_pairs, n);
        if (!contiguous) {
          for (int64_t f = 0; f < n; ++f) {
            outr[f * op.out_feature_stride] = gathered[f];
          }
        }
      }
    }
  });
}

// Backward of rows [begin, end), adding each operand's weight gradient into dw[o].
template <typename scalar_t, typename table_t, bool kInterleaved>
void norm_rotate_rows_backward(const NormRotaryParams& np,
                               const PaddedRow<opmath_t<scalar_t>> (&weights)[2],
                               opmath_t<scalar_t>* const (&dw)[2], int64_t begin, int64_t end) {
  using opmath = opmath_t<scalar_t>;
  using V = Vectorized<opmath>;
  const RotaryParams& p = np.rotary;  // inverse: rotates the gradient back
  RotationCache<opmath, table_t> cache(p);
  const int64_t width = std::max(p.operands[0].head_dim, p.operands[p.num_operands - 1].head_dim);
  PaddedRow<opmath> x_row(width), g_row(width);
  opmath* x = x_row.data();
  opmath* g = g_row.data();
  const opmath eps = static_cast<opmath>(np.eps);
  for_each_row(p, cache, begin, end, [&](int o, int64_t x_at, int64_t out_at,
                                         const Rotation<opmath>& rotation) {
    const RotaryOperand& op = p.operands[o];
    const int64_t n = op.head_dim;
    load_row(static_cast<const scalar_t*>(np.input[o]) + x_at, op.x_feature_stride, n, x);
    const opmath r = rms_scale(sum_of_products(x, x, n), n, eps);
    load_row(static_cast<const scalar_t*>(op.x) + x_at, op.x_feature_stride, n, g);
    rotate_contiguous_row<opmath, kInterleaved>(g, g, rotation, p.rot_pairs, n);  // gn
    const opmath* w = weights[o].data();
    V dot(0);
    for (int64_t j = 0; j < padded_extent<opmath>(n); j += V::size()) {
      const V gn = V::loadu(g + j);
      const V xv = V::loadu(x + j);
      at::vec::fmadd(gn * xv, V(r), V::loadu(dw[o] + j)).store(dw[o] + j);
      const V gw = gn * V::loadu(w + j);
      gw.store(g + j);
      dot = at::vec::fmadd(gw, xv, dot);
    }
    const V coefficient(rms_grad_coefficient(
        r, at::vec::vec_reduce_all<opmath>([](V& u, V& v) { return u + v; }, dot), n));
    for (int64_t j = 0; j < padded_extent<opmath>(n); j += V::size()) {
      at::vec::fmsub(V::loadu(g + j), V(r), V::loadu(x + j) * coefficient).store(g + j);
    }
    store_row(g, static_cast<scalar_t*>(op.out) + out_at, op.out_feature_stride, n);
  });
}

}  // namespace

void norm_rotary_kernel(const NormRotaryParams& np, bool backward, at::ScalarType x_dtype,
                        at::ScalarType table_dtype) {
  const RotaryParams& p = np.rotary;
  int64_t rows = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    rows += p.operands[o].rows;
  }
  const int64_t head_dim = std::max<int64_t>(1, p.operands[0].head_dim);
  const int64_t grain = std::max<int64_t>(1, 16384 / head_dim);
  // The forward's tasks take 8 times the rotary kernel's rows: a second thread cost more than
  // it saved below ~2,000 rows. bf16 q, k [B, 1, 32 / 8, 128] in place, 2 threads of a Xeon
  // (Sapphire Rapids), AVX512_BF16, tasks of 128 -> 1,024 rows: B = 16 23.7 -> 16.8 us, B = 32
  // 31.6 -> 28.2, B = 48 to 96 and a [1, 2048] prefill the same within 3%. With 320 rows each,
  // the two tasks of B = 16 took 8 and 12 us where one thread did all 640 rows in ~10.
  const int64_t forward_grain = std::max<int64_t>(1, 131072 / head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_norm_cpu", [&] {
    using row_t = scalar_t;
    using opmath = opmath_t<row_t>;
    const PaddedRow<opmath> weights[2] = {
        scale_weights<row_t>(np, 0),
        p.num_operands > 1 ? scale_weights<row_t>(np, 1) : PaddedRow<opmath>(0)};
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_norm_cpu_table", [&] {
      using table_t = scalar_t;
      if (!backward) {
        const int64_t tokens = p.interleaved ? paired_tokens<row_t, true>(p)
                                             : paired_tokens<row_t, false>(p);
        // The token walk shares tokens out among the threads, so it needs two a thread. A
        // decode step's [B, 1, H, D] at one position reaches the kernel as a single token (its
        // batch and heads coalesce into one dim of B * H rows), which the token walk ran on
        // one thread: bf16 q, k [512, 1, 32 / 8, 128] in place took 420 us with 1 thread and
        // with 2. The span walk splits rows, and one position makes a span of them all.
        if (tokens > 0 && tokens >= 2 * at::get_num_threads()) {
          const int64_t per_token = (p.operands[0].rows + p.operands[1].rows) / tokens;
          at::parallel_for(0, tokens, std::max<int64_t>(1, forward_grain / per_token),
                           [&](int64_t begin, int64_t end) {
            if (p.interleaved) {
              norm_rotate_tokens<row_t, table_t, true>(np, weights, begin, end);
            } else {
              norm_rotate_tokens<row_t, table_t, false>(np, weights, begin, end);
            }
          });
          return;
        }
        // Each task takes the same share of every operand's rows: q's and k's cost per row
        // differ (k has fewer heads a token), and a split of the rows in order gave one
        // thread all of k.
        const bool stream = stream_output(p, sizeof(row_t));
        at::parallel_for(0, rows, forward_grain, [&](int64_t begin, int64_t end) {
          int64_t first = 0;
          for (int o = 0; o < p.num_operands; ++o) {
            const int64_t n = p.operands[o].rows;
            const int64_t lo = first + n * begin / rows, hi = first + n * end / rows;
            if (lo < hi) {
              if (p.interleaved) {
                norm_rotate_rows<row_t, table_t, true>(np, weights, lo, hi, stream);
              } else {
                norm_rotate_rows<row_t, table_t, false>(np, weights, lo, hi, stream);
              }
            }
            first += n;
          }
          if (stream) {
            end_streaming_stores();
          }
        });
        return;
      }
      // The weight gradients: one accumulator per chunk of rows, the chunks fixed by the
      // thread count and summed in order, so a run repeats its result bit for bit.
      const int64_t chunks =
          std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (rows + grain - 1) / grain));
      std::vector<PaddedRow<opmath>> partial;  // [chunk][operand]
      partial.reserve(2 * chunks);
      for (int64_t c = 0; c < 2 * chunks; ++c) {
        partial.emplace_back(p.operands[0].head_dim);
      }
      at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t c = lo; c < hi; ++c) {
          opmath* const dw[2] = {partial[2 * c].data(), partial[2 * c + 1].data()};
          const int64_t begin = rows * c / chunks, end = rows * (c + 1) / chunks;
          if (p.interleaved) {
            norm_rotate_rows_backward<row_t, table_t, true>(np, weights, dw, begin, end);
          } else {
            norm_rotate_rows_backward<row_t, table_t, false>(np, weights, dw, begin, end);
          }
        }
      });
      for (int o = 0; o < p.num_operands; ++o) {
        for (int64_t j = 0; j < p.operands[o].head_dim; ++j) {
          opmath sum = 0;
          for (int64_t c = 0; c < chunks; ++c) {
            sum += partial[2 * c + o].data()[j];
          }
          store_weight_grad<row_t, opmath>(np, o, j, sum);
        }
      }
    });
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace rope_ext::cpu
