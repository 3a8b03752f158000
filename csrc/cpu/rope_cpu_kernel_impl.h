// Body of the vectorised CPU rotary kernel; included by one .cpp per instruction set, which
// defines CPU_CAPABILITY (and CPU_CAPABILITY_AVX2 / _AVX512) before including it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "rope_cpu_kernel.h"

namespace rope_ext::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// float arithmetic for float/half/bfloat16 inputs, double for double.
template <typename scalar_t>
using opmath_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Loads 2 * Vectorized<opmath>::size() elements from p as two opmath vectors.
template <typename scalar_t>
std::pair<Vectorized<opmath_t<scalar_t>>, Vectorized<opmath_t<scalar_t>>> load2(
    const scalar_t* p) {
  using V = Vectorized<opmath_t<scalar_t>>;
  if constexpr (std::is_same_v<scalar_t, opmath_t<scalar_t>>) {
    return {V::loadu(p), V::loadu(p + V::size())};
  } else {
    auto [a, b] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p));
    return {a, b};
  }
}

// The first `count` (<= 2 * V::size()) values of an opmath array, as two vectors.
template <typename V, typename T>
std::pair<V, V> load_values(const T* p, int64_t count) {
  constexpr int64_t kV = V::size();
  return {V::loadu(p, std::min(count, kV)), count > kV ? V::loadu(p + kV, count - kV) : V(0)};
}

// The first `count` (< 2 * Vectorized<opmath>::size()) elements from p, zero-filled.
template <typename scalar_t>
std::pair<Vectorized<opmath_t<scalar_t>>, Vectorized<opmath_t<scalar_t>>> load2(
    const scalar_t* p, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, opmath_t<scalar_t>>) {
    return load_values<Vectorized<scalar_t>>(p, count);
  } else {
    auto [a, b] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p, count));
    return {a, b};
  }
}

// Stores the first `count` (< 2 * Vectorized<opmath>::size()) elements of (a, b) to p.
template <typename scalar_t>
void store2(scalar_t* p, const Vectorized<opmath_t<scalar_t>>& a,
            const Vectorized<opmath_t<scalar_t>>& b, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, opmath_t<scalar_t>>) {
    constexpr int64_t kV = Vectorized<scalar_t>::size();
    a.store(p, std::min(count, kV));
    if (count > kV) {
      b.store(p + kV, count - kV);
    }
  } else {
    at::vec::convert_from_float<scalar_t>(a, b).store(p, count);
  }
}

// Streaming stores: out of place, a call whose rows are too many to stay in the threads' L2
// writes its output with non-temporal stores, which go to memory without first reading each
// line in (a regular store's read for ownership), so the call moves two lines a line instead
// of three. clone, which uses regular stores, moves three. Copying 20 MiB with 2 threads of a
// Xeon (Sapphire Rapids, 2 MiB L2 a core): 2.8 ms with regular stores, 1.8 with streaming
// ones; 3 MiB: 0.38 -> 0.23 ms; 2 MiB, which fits in L2 beside its source: 0.14 -> 0.20.
// Only where Vectorized maps to SIMD registers.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kStreamingStores = true;
#else
constexpr bool kStreamingStores = false;
#endif
// The bytes a vector register holds: a streaming store's address must be a multiple of it.
constexpr int64_t kVectorBytes = sizeof(Vectorized<float>);

// Stores v at p: a streaming store when kStream (p a multiple of kVectorBytes), else a
// regular one.
template <bool kStream, typename V>
C10_ALWAYS_INLINE void store_vector(void* p, const V& v) {
  if constexpr (!kStream) {
    v.store(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<V, Vectorized<float>>) {
      _mm512_stream_ps(static_cast<float*>(p), v);
    } else if constexpr (std::is_same_v<V, Vectorized<double>>) {
      _mm512_stream_pd(static_cast<double*>(p), v);
    } else {
      _mm512_stream_si512(static_cast<__m512i*>(p), static_cast<__m512i>(v));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<V, Vectorized<float>>) {
      _mm256_stream_ps(static_cast<float*>(p), v);
    } else if constexpr (std::is_same_v<V, Vectorized<double>>) {
      _mm256_stream_pd(static_cast<double*>(p), v);
    } else {
      _mm256_stream_si256(static_cast<__m256i*>(p), static_cast<__m256i>(v));
    }
#else
    static_assert(!kStream, "streaming stores need SIMD vectors");
#endif
  }
}

// Orders a task's streaming stores before whatever follows it (they are weakly ordered).
inline void end_streaming_stores() {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  _mm_sfence();
#endif
}

// Whether a call should stream its output: out of place, its out-of-place operands moving
// (reading and writing) more bytes than streaming_threshold() (rope_cpu.cpp: the caches the
// output would stay in; ROPE_EXT_STREAMING_STORES=0 never, =1 always).
inline bool stream_output(const RotaryParams& p, int64_t element_bytes) {
  const int64_t threshold = streaming_threshold();  // checks the mode on every kernel
  if (!kStreamingStores) {
    return false;
  }
  int64_t bytes_moved = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    if (op.out != op.x) {
      bytes_moved += 2 * op.rows * op.head_dim * element_bytes;
    }
  }
  return bytes_moved > 0 && bytes_moved > threshold;
}

// Whether rows from `out` on, `os` elements apart, can take streaming stores.
template <typename scalar_t>
bool streamable(const scalar_t* out, int64_t rows, int64_t os) {
  return reinterpret_cast<std::uintptr_t>(out) % kVectorBytes == 0 &&
         (rows == 1 || (os * static_cast<int64_t>(sizeof(scalar_t))) % kVectorBytes == 0);
}

// Stores two opmath vectors to p as 2 * Vectorized<opmath>::size() elements, rounding once;
// streaming stores when kStream.
template <bool kStream = false, typename scalar_t>
void store2(scalar_t* p, const Vectorized<opmath_t<scalar_t>>& a,
            const Vectorized<opmath_t<scalar_t>>& b) {
  if constexpr (std::is_same_v<scalar_t, opmath_t<scalar_t>>) {
    store_vector<kStream>(p, a);
    store_vector<kStream>(p + Vectorized<scalar_t>::size(), b);
  } else {
    store_vector<kStream>(p, at::vec::convert_from_float<scalar_t>(a, b));
  }
}

// bfloat16 is the high half of a float, so a 32-bit lane holding two bfloat16 values splits
// into two float vectors with a shift and a mask, and joins back the same way: no permutes.
// Only where Vectorized maps to SIMD registers; the DEFAULT build's element loops are far
// faster on the plain convert-and-compute path.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kBf16LaneTricks = true;
#else
constexpr bool kBf16LaneTricks = false;
#endif
using VecI = Vectorized<int32_t>;
using VecF = Vectorized<float>;

inline std::pair<VecF, VecF> split_bf16_lanes(const VecI& lanes) {
  return {at::vec::cast<float>(lanes << VecI(16)),
          at::vec::cast<float>(lanes & VecI(static_cast<int32_t>(0xffff0000u)))};
}

// f rounded to nearest-even bfloat16, left in the high 16 bits of each lane; NaN stays NaN.
inline VecI round_to_bf16_high(const VecF& f) {
  VecI bits = VecI::blendv(at::vec::cast<int32_t>(f), VecI(0x7fc00000),
                           at::vec::cast<int32_t>(f.isnan()));
  const VecI lsb = (bits >> VecI(16)) & VecI(1);
  return (bits + VecI(0x7fff) + lsb) & VecI(static_cast<int32_t>(0xffff0000u));
}

// Lanes holding round(low) in their low half and round(high) in their high half.
#if defined(__AVX512BF16__)
// One rounding instruction for 32 values (round to nearest even; like every AVX512-BF16
// conversion it flushes results below 2^-126 to zero), then one permute to pair them up.
template <bool kCheckNan = true>  // unused: the instruction rounds NaNs right
inline VecI join_bf16_lanes(const VecF& low, const VecF& high) {
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(pairs, packed);
}
#elif defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// Any NaN among the values: one compare and a branch, instead of a NaN blend per lane.
inline bool any_nan(const VecF& low, const VecF& high) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cmp_ps_mask(low, high, _CMP_UNORD_Q) != 0;
#else
  return _mm256_movemask_ps(_mm256_cmp_ps(low, high, _CMP_UNORD_Q)) != 0;
#endif
}

// kCheckNan false: the caller's values can only hold NaNs whose low 16 bits are clear
// (kNanLowBitsClear), which the rounding increment below cannot carry out of, so the NaN
// check and its branch go.
//
// The rounding works on 16-bit words: the two values' high halves H side by side (the
// truncated bfloat16 pair) and their low halves L side by side. Round to nearest even adds
// one to H when L + 0x7fff + (H & 1) carries out of 16 bits, which is when the rounded-up
// average of L and 0x7ffe + (H & 1) has its top bit set: 9 instructions for 16 values where
// rounding each float on its own (bits + 0x7fff + lsb, shifted and blended) takes 10. H + 1
// cannot carry out of its word: H is at most 0xff7f for a non-NaN value (0xff80, -inf, once
// rounded).
template <bool kCheckNan = true>
inline VecI join_bf16_lanes(const VecF& low, const VecF& high) {
  if (kCheckNan && any_nan(low, high)) {
    return ((round_to_bf16_high(low) >> VecI(16)) & VecI(0xffff)) | round_to_bf16_high(high);
  }
  // As raw registers: without optimisation some intrinsics are macros whose casts do not
  // take ATen's vector class.
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i lo = at::vec::cast<int32_t>(low);
  const __m512i hi = at::vec::cast<int32_t>(high);
  const __m512i h = _mm512_mask_blend_epi16(0x55555555u, hi, _mm512_srli_epi32(lo, 16));
  const __m512i l = _mm512_mask_blend_epi16(0x55555555u, _mm512_slli_epi32(hi, 16), lo);
  // (H & 1) | 0x7ffe, as 0x7ffe's lowest bit is clear: one ternary-logic instruction.
  const __m512i bias = _mm512_ternarylogic_epi32(h, _mm512_set1_epi16(1),
                                                 _mm512_set1_epi16(0x7ffe), 0xea);
  return _mm512_add_epi16(h, _mm512_srli_epi16(_mm512_avg_epu16(l, bias), 15));
#else
  const __m256i lo = at::vec::cast<int32_t>(low);
  const __m256i hi = at::vec::cast<int32_t>(high);
  const __m256i h = _mm256_blend_epi16(hi, _mm256_srli_epi32(lo, 16), 0x55);
  const __m256i l = _mm256_blend_epi16(_mm256_slli_epi32(hi, 16), lo, 0x55);
  const __m256i bias = _mm256_add_epi16(_mm256_and_si256(h, _mm256_set1_epi16(1)),
                                        _mm256_set1_epi16(0x7ffe));
  return _mm256_add_epi16(h, _mm256_srli_epi16(_mm256_avg_epu16(l, bias), 15));
#endif
}
#else
// The DEFAULT build does not use the lane tricks (kBf16LaneTricks); declared for the
// discarded branches that name it.
template <bool kCheckNan = true>
inline VecI join_bf16_lanes(const VecF& low, const VecF& high) {
  return ((round_to_bf16_high(low) >> VecI(16)) & VecI(0xffff)) | round_to_bf16_high(high);
}
#endif

// The rotation of one position: cos and sin per pair (sin negated for inverse calls).
template <typename opmath>
struct Rotation {
  std::vector<opmath> storage;
  opmath* cos;
  opmath* sin;

  // `padding` zero pairs after each of cos and sin let vector loads run past the last pair.
  explicit Rotation(int64_t pairs, int64_t padding = 0) : storage(2 * (pairs + padding)) {
    cos = storage.data();
    sin = cos + pairs + padding;
  }

  template <typename table_t>
  void load(const table_t* entry, const RotaryParams& p) {
    load_pairs(entry, 0, p.rot_pairs, p);
    clear_nan_payloads(p.rot_pairs);
  }

  // Every NaN among the first `pairs` cos and sin made the default quiet NaN, whose low 16
  // bits are clear, so that the bfloat16 rounding of what it turns needs no NaN check
  // (kNanLowBitsClear). The caller's table may hold any NaN (a float64 table's, converted,
  // keeps payload bits there).
  void clear_nan_payloads(int64_t pairs) {
    if constexpr (std::is_same_v<opmath, float>) {
      using V = Vectorized<float>;
      constexpr int64_t kV = V::size();
      const V quiet(std::numeric_limits<float>::quiet_NaN());
      for (float* values : {cos, sin}) {
        int64_t i = 0;
        for (; i + kV <= pairs; i += kV) {
          const V v = V::loadu(values + i);
          V::blendv(v, quiet, v.isnan()).store(values + i);
        }
        for (; i < pairs; ++i) {
          values[i] = std::isnan(values[i]) ? std::numeric_limits<float>::quiet_NaN() : values[i];
        }
      }
    }
  }

  // Pairs [begin, end) from the table row at entry.
  template <typename table_t>
  void load_pairs(const table_t* entry, int64_t begin, int64_t end, const RotaryParams& p) {
    using V = Vectorized<opmath>;
    constexpr int64_t kV = V::size();
    const opmath sign = p.inverse ? opmath(-1) : opmath(1);
    int64_t i = begin;
    if constexpr (std::is_same_v<table_t, opmath>) {
      // The real view of a contiguous complex row: (cos, sin) side by side.
      if (p.table_pair_stride == 2 && p.table_cs_stride == 1) {
        for (; i + kV <= end; i += kV) {
          auto [c, s] = at::vec::deinterleave2(V::loadu(entry + 2 * i),
                                               V::loadu(entry + 2 * i + kV));
          c.store(cos + i);
          (s * V(sign)).store(sin + i);
        }
        if (i < end) {  // the tail, with partial loads and stores
          const int64_t n = end - i;
          auto [c, s] = at::vec::deinterleave2(
              V::loadu(entry + 2 * i, std::min<int64_t>(2 * n, kV)),
              V::loadu(entry + 2 * i + kV, std::max<int64_t>(2 * n - kV, 0)));
          c.store(cos + i, n);
          (s * V(sign)).store(sin + i, n);
          return;
        }
      }
    }
    for (; i < end; ++i) {
      cos[i] = static_cast<opmath>(entry[i * p.table_pair_stride]);
      sin[i] = sign * static_cast<opmath>(entry[i * p.table_pair_stride + p.table_cs_stride]);
    }
  }

  // MRoPE: pair i from table row rows[pair_axis(p, i)]. Contiguous sections load as
  // segments of their rows; Qwen3-VL's interleaving loads the time row, then puts the height
  // and width pairs (every third below 3 * section) over it.
  template <typename table_t>
  void load_mrope(const table_t* table, const int64_t* rows, const RotaryParams& p) {
    const int64_t step = p.table_row_stride;
    if (p.mrope_interleaved) {
      load_pairs(table + rows[0] * step, 0, p.rot_pairs, p);
      const opmath sign = p.inverse ? opmath(-1) : opmath(1);
      for (int a = 1; a < 3; ++a) {
        const table_t* entry = table + rows[a] * step;
        for (int64_t i = a; i < std::min(p.mrope_bounds[a], p.rot_pairs); i += 3) {
          cos[i] = static_cast<opmath>(entry[i * p.table_pair_stride]);
          sin[i] = sign * static_cast<opmath>(entry[i * p.table_pair_stride + p.table_cs_stride]);
        }
      }
      clear_nan_payloads(p.rot_pairs);
      return;
    }
    int64_t begin = 0;
    for (int a = 0; a < p.mrope_axes; ++a) {
      load_pairs(table + rows[a] * step, begin, p.mrope_bounds[a], p);
      begin = p.mrope_bounds[a];
    }
    clear_nan_payloads(p.rot_pairs);
  }
};

// A table row read where it lies: (cos, sin) side by side in opmath, the real view of a
// contiguous complex table. Rows whose positions all differ (Hugging Face's [B, H, S, D]
// walked in memory order) rotate straight from it instead of copying it into a Rotation.
template <typename opmath>
struct TableRow {
  const opmath* entry;
  bool inverse;  // negate sin
};

// Whether the values a rotation by `Source` produces from bfloat16 rows can only hold NaNs
// whose low 16 bits are clear: those of the rows are (a bfloat16 is a float's high half),
// x86 arithmetic returns one of its NaN operands (quieted, payload kept) or the default NaN,
// and a Rotation's NaNs are the default NaN (clear_nan_payloads). A TableRow is the caller's
// table as it is.
template <typename Source>
constexpr bool kNanLowBitsClear = !std::is_same_v<Source, TableRow<float>>;

// Pairs one full-vector step of a contiguous row covers: kV interleaved pairs (2kV
// elements), or 2kV pairs from each half of a half-split row.
template <typename scalar_t, bool kInterleaved>
constexpr int64_t kStepPairs = (kInterleaved ? 1 : 2) * Vectorized<opmath_t<scalar_t>>::size();

// bfloat16 half-split rows with the lane tricks see each block of 2kV pairs as [even pairs,
// odd pairs], the order split_bf16_lanes produces.
template <typename scalar_t, bool kInterleaved>
constexpr bool kBlocked = kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16> &&
                          !kInterleaved;

// The second cos / sin vectors of a half-split step; interleaved steps have none (the tiled
// walk keeps a tile's steps in L1, at no more than the bytes they use).
template <typename V, bool kInterleaved>
struct HalfSplitRotation {
  V c1, s1;
};
template <typename V>
struct HalfSplitRotation<V, true> {};

// The cos / sin vectors of one step starting at pair i (sin already negated for inverse
// calls): one each for interleaved rows, two each for half-split rows.
template <typename scalar_t, bool kInterleaved>
struct StepRotation : HalfSplitRotation<Vectorized<opmath_t<scalar_t>>, kInterleaved> {
  using V = Vectorized<opmath_t<scalar_t>>;
  V c0, s0;

  StepRotation() = default;
  StepRotation(const Rotation<opmath_t<scalar_t>>& r, int64_t i) {
    constexpr int64_t kV = V::size();
    c0 = V::loadu(r.cos + i);
    s0 = V::loadu(r.sin + i);
    if constexpr (!kInterleaved) {
      this->c1 = V::loadu(r.cos + i + kV);
      this->s1 = V::loadu(r.sin + i + kV);
    }
    if constexpr (kBlocked<scalar_t, kInterleaved>) {
      std::tie(c0, this->c1) = at::vec::deinterleave2(c0, this->c1);
      std::tie(s0, this->s1) = at::vec::deinterleave2(s0, this->s1);
    }
  }
  StepRotation(const TableRow<opmath_t<scalar_t>>& t, int64_t i) {
    constexpr int64_t kV = V::size();
    std::tie(c0, s0) = at::vec::deinterleave2(V::loadu(t.entry + 2 * i),
                                              V::loadu(t.entry + 2 * i + kV));
    if constexpr (!kInterleaved) {
      std::tie(this->c1, this->s1) = at::vec::deinterleave2(
          V::loadu(t.entry + 2 * i + 2 * kV), V::loadu(t.entry + 2 * i + 3 * kV));
    }
    if (t.inverse) {
      s0 = s0.neg();
      if constexpr (!kInterleaved) {
        this->s1 = this->s1.neg();
      }
    }
    if constexpr (kBlocked<scalar_t, kInterleaved>) {
      std::tie(c0, this->c1) = at::vec::deinterleave2(c0, this->c1);
      std::tie(s0, this->s1) = at::vec::deinterleave2(s0, this->s1);
    }
  }
};

// Interleaved rows of float, double and half (bfloat16 has its lane tricks) turn as they lie,
// each pair (x0, x1) side by side in a vector: y = x0 (c, s) + x1 (-s, c) lane by lane, from
// two in-lane duplicating shuffles, one product and one FMA a vector. Splitting the pairs
// apart and back (deinterleave2, interleave2) took eight cross-lane permutes a step, all on
// one port of an Intel core: float32 decode rows ran at 1.5x the time of half-split ones
// (AVX2). The roundings are rotate_pair's: x0 c - (x1 s) and x0 s + (x1 c), the product
// rounded, then one FMA.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
template <typename scalar_t, bool kInterleaved>
constexpr bool kPairLanes =
    kInterleaved && !(kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16>);

#if defined(CPU_CAPABILITY_AVX512)
inline VecF dup_even(const VecF& v) { return _mm512_moveldup_ps(v); }
inline VecF dup_odd(const VecF& v) { return _mm512_movehdup_ps(v); }
inline Vectorized<double> dup_even(const Vectorized<double>& v) { return _mm512_movedup_pd(v); }
inline Vectorized<double> dup_odd(const Vectorized<double>& v) {
  return _mm512_permute_pd(v, 0xff);
}
#else
inline VecF dup_even(const VecF& v) { return _mm256_moveldup_ps(v); }
inline VecF dup_odd(const VecF& v) { return _mm256_movehdup_ps(v); }
inline Vectorized<double> dup_even(const Vectorized<double>& v) { return _mm256_movedup_pd(v); }
inline Vectorized<double> dup_odd(const Vectorized<double>& v) {
  return _mm256_permute_pd(v, 0xf);
}
#endif
#else
// The DEFAULT build's vectors are arrays: the split-and-join path.
template <typename scalar_t, bool kInterleaved>
constexpr bool kPairLanes = false;
#endif

// The rotation of one interleaved step (kV pairs, two vectors a and b) in the pair-lane
// form: (c, s) and (-s, c) for each pair, side by side.
template <typename scalar_t>
struct PairLaneRotation {
  using V = Vectorized<opmath_t<scalar_t>>;
  V cs_a, nsc_a, cs_b, nsc_b;

  PairLaneRotation() = default;
  PairLaneRotation(const Rotation<opmath_t<scalar_t>>& r, int64_t i) {
    set(V::loadu(r.cos + i), V::loadu(r.sin + i));
  }
  PairLaneRotation(const TableRow<opmath_t<scalar_t>>& t, int64_t i) {
    constexpr int64_t kV = V::size();
    const auto [c, s] = at::vec::deinterleave2(V::loadu(t.entry + 2 * i),
                                               V::loadu(t.entry + 2 * i + kV));
    set(c, t.inverse ? s.neg() : s);
  }

 private:
  void set(const V& c, const V& s) {
    std::tie(cs_a, cs_b) = at::vec::interleave2(c, s);
    std::tie(nsc_a, nsc_b) = at::vec::interleave2(s.neg(), c);
  }
};

// What one step of the rotary kernel turns by: the pair-lane form where it applies.
template <typename scalar_t, bool kInterleaved>
using RowStepRotation = std::conditional_t<kPairLanes<scalar_t, kInterleaved>,
                                           PairLaneRotation<scalar_t>,
                                           StepRotation<scalar_t, kInterleaved>>;

// The inputs of one full-vector step, loaded: rows are read before anything of them is
// written, so the overlapping last step (rotate_contiguous_span) still sees x.
template <typename scalar_t, bool kInterleaved>
struct StepInput {
  using V = Vectorized<opmath_t<scalar_t>>;
  VecI lanes0, lanes1;  // bfloat16 lane tricks
  V a, b, c, d;         // every other path, in opmath
};

template <typename scalar_t, bool kInterleaved>
C10_ALWAYS_INLINE StepInput<scalar_t, kInterleaved> load_step(const scalar_t* x, int64_t i,
                                                               int64_t pairs) {
  StepInput<scalar_t, kInterleaved> in;
  if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16> && kInterleaved) {
    // One lane holds one pair (x0 low, x1 high).
    in.lanes0 = VecI::loadu(x + 2 * i);
  } else if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16>) {
    // Lane j of each half holds pairs i + 2j (low) and i + 2j + 1 (high).
    in.lanes0 = VecI::loadu(x + i);
    in.lanes1 = VecI::loadu(x + pairs + i);
  } else if constexpr (kInterleaved) {
    // x[2i .. 2i + 2kV) holds kV pairs (x0, x1) side by side.
    std::tie(in.a, in.b) = load2(x + 2 * i);
  } else {
    // Pair i is (x[i], x[i + pairs]): 2kV pairs per step from each half.
    std::tie(in.a, in.b) = load2(x + i);
    std::tie(in.c, in.d) = load2(x + pairs + i);
  }
  return in;
}

// Rotates the loaded step by r and stores it at pair i of out (streaming stores when kStream).
template <typename scalar_t, bool kInterleaved, bool kCheckNan = true, bool kStream = false>
C10_ALWAYS_INLINE void finish_step(const StepInput<scalar_t, kInterleaved>& in, scalar_t* out,
                                   int64_t i, int64_t pairs,
                                   const RowStepRotation<scalar_t, kInterleaved>& r) {
  using V = Vectorized<opmath_t<scalar_t>>;
  if constexpr (kPairLanes<scalar_t, kInterleaved>) {
    const V y_a = at::vec::fmadd(dup_even(in.a), r.cs_a, dup_odd(in.a) * r.nsc_a);
    const V y_b = at::vec::fmadd(dup_even(in.b), r.cs_b, dup_odd(in.b) * r.nsc_b);
    store2<kStream>(out + 2 * i, y_a, y_b);
  } else if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16> &&
                       kInterleaved) {
    auto [x0, x1] = split_bf16_lanes(in.lanes0);
    V y0, y1;
    rotate_pair(x0, x1, r.c0, r.s0, y0, y1);
    store_vector<kStream>(out + 2 * i, join_bf16_lanes<kCheckNan>(y0, y1));
  } else if constexpr (kBf16LaneTricks && std::is_same_v<scalar_t, c10::BFloat16>) {
    auto [a_even, a_odd] = split_bf16_lanes(in.lanes0);
    auto [b_even, b_odd] = split_bf16_lanes(in.lanes1);
    V y0_even, y1_even, y0_odd, y1_odd;
    rotate_pair(a_even, b_even, r.c0, r.s0, y0_even, y1_even);
    rotate_pair(a_odd, b_odd, r.c1, r.s1, y0_odd, y1_odd);
    store_vector<kStream>(out + i, join_bf16_lanes<kCheckNan>(y0_even, y0_odd));
    store_vector<kStream>(out + pairs + i, join_bf16_lanes<kCheckNan>(y1_even, y1_odd));
  } else if constexpr (kInterleaved) {
    auto [x0, x1] = at::vec::deinterleave2(in.a, in.b);
    V y0, y1;
    rotate_pair(x0, x1, r.c0, r.s0, y0, y1);
    auto [out_lo, out_hi] = at::vec::interleave2(y0, y1);
    store2<kStream>(out + 2 * i, out_lo, out_hi);
  } else {
    V y0a, y1a, y0b, y1b;
    rotate_pair(in.a, in.c, r.c0, r.s0, y0a, y1a);
    rotate_pair(in.b, in.d, r.c1, r.s1, y0b, y1b);
    store2<kStream>(out + i, y0a, y0b);
    store2<kStream>(out + pairs + i, y1a, y1b);
  }
}

// One full-vector step of a contiguous row: the kStepPairs pairs from pair i on.
template <typename scalar_t, bool kInterleaved, bool kCheckNan = true, bool kStream = false>
C10_ALWAYS_INLINE void rotate_step(const scalar_t* x, scalar_t* out, int64_t i, int64_t pairs,
                                   const RowStepRotation<scalar_t, kInterleaved>& r) {
  finish_step<scalar_t, kInterleaved, kCheckNan, kStream>(
      load_step<scalar_t, kInterleaved>(x, i, pairs), out, i, pairs, r);
}

// The rotation of the last `rest` (< kStepPairs) pairs from pair i on, in natural order,
// zero-filled: what the partial step after the full ones uses.
template <typename scalar_t, bool kInterleaved>
struct TailRotation {
  using V = Vectorized<opmath_t<scalar_t>>;
  V c0, s0, c1, s1;

  TailRotation() = default;
  TailRotation(const Rotation<opmath_t<scalar_t>>& r, int64_t i, int64_t rest) {
    if constexpr (kInterleaved) {
      c0 = V::loadu(r.cos + i, rest);
      s0 = V::loadu(r.sin + i, rest);
    } else {
      std::tie(c0, c1) = load_values<V>(r.cos + i, rest);
      std::tie(s0, s1) = load_values<V>(r.sin + i, rest);
    }
  }
  TailRotation(const TableRow<opmath_t<scalar_t>>& t, int64_t i, int64_t rest) {
    constexpr int64_t kV = V::size();
    // 2 * rest values, (cos, sin) side by side: up to 2kV for interleaved rows, 4kV else.
    const int64_t count = 2 * rest;
    auto [lo, hi] = load_values<V>(t.entry + 2 * i, std::min(count, 2 * kV));
    std::tie(c0, s0) = at::vec::deinterleave2(lo, hi);
    if (count > 2 * kV) {
      auto [lo1, hi1] = load_values<V>(t.entry + 2 * i + 2 * kV, count - 2 * kV);
      std::tie(c1, s1) = at::vec::deinterleave2(lo1, hi1);
    } else {
      c1 = V(0);
      s1 = V(0);
    }
    if (t.inverse) {
      s0 = s0.neg();
      s1 = s1.neg();
    }
  }
};

// The partial step on the last `rest` pairs of a contiguous row, from pair i on.
template <typename scalar_t, bool kInterleaved>
inline void rotate_tail(const scalar_t* x, scalar_t* out, int64_t i, int64_t rest,
                        int64_t pairs, const TailRotation<scalar_t, kInterleaved>& r) {
  using V = Vectorized<opmath_t<scalar_t>>;
  if constexpr (kInterleaved) {
    auto [lo, hi] = load2(x + 2 * i, 2 * rest);
    auto [x0, x1] = at::vec::deinterleave2(lo, hi);
    V y0, y1;
    rotate_pair(x0, x1, r.c0, r.s0, y0, y1);
    auto [out_lo, out_hi] = at::vec::interleave2(y0, y1);
    store2(out + 2 * i, out_lo, out_hi, 2 * rest);
  } else {
    auto [x0a, x0b] = load2(x + i, rest);
    auto [x1a, x1b] = load2(x + pairs + i, rest);
    V y0a, y1a, y0b, y1b;
    rotate_pair(x0a, x1a, r.c0, r.s0, y0a, y1a);
    rotate_pair(x0b, x1b, r.c1, r.s1, y0b, y1b);
    store2(out + i, y0a, y0b, rest);
    store2(out + pairs + i, y1a, y1b, rest);
  }
}

// Rotates one row whose features are contiguous in x and out by the rotation r (a Rotation
// or a TableRow).
template <typename scalar_t, bool kInterleaved, typename Source>
void rotate_contiguous_row(const scalar_t* x, scalar_t* out, const Source& r, int64_t pairs,
                           int64_t head_dim) {
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  constexpr bool kCheckNan = !kNanLowBitsClear<Source>;
  const int64_t rest = pairs % kStep;
  if (rest > 0 && pairs > kStep) {
    // The pairs left over take one more full step, overlapping the one before it: its
    // inputs are loaded before anything is stored, and the overlap is written twice with
    // the same values. Masked loads after overlapping stores would stall on forwarding.
    const int64_t last = pairs - kStep;
    const auto last_in = load_step<scalar_t, kInterleaved>(x, last, pairs);
    for (int64_t i = 0; i < last; i += kStep) {
      rotate_step<scalar_t, kInterleaved, kCheckNan>(x, out, i, pairs,
                                                     RowStepRotation<scalar_t, kInterleaved>(r, i));
    }
    finish_step<scalar_t, kInterleaved, kCheckNan>(
        last_in, out, last, pairs, RowStepRotation<scalar_t, kInterleaved>(r, last));
  } else {
    int64_t i = 0;
    for (; i + kStep <= pairs; i += kStep) {
      rotate_step<scalar_t, kInterleaved, kCheckNan>(x, out, i, pairs,
                                                     RowStepRotation<scalar_t, kInterleaved>(r, i));
    }
    if (rest > 0) {  // fewer pairs than one step: a partial step on masked vectors
      rotate_tail<scalar_t, kInterleaved>(x, out, i, rest, pairs,
                                          TailRotation<scalar_t, kInterleaved>(r, i, rest));
    }
  }
  if (out != x && head_dim > 2 * pairs) {
    std::memcpy(out + 2 * pairs, x + 2 * pairs, (head_dim - 2 * pairs) * sizeof(scalar_t));
  }
}

// How a span's rows end after their full steps: exactly, with a partial step on masked
// vectors (fewer pairs than one step), or with one more full step overlapping the last.
enum class Tail { kNone, kMasked, kOverlap };

// The step rotations of one position for rows whose rotary part is kSteps full steps and
// the kTail ending, built once from a Rotation and applied to many rows.
// What a row turns by after its full steps, by kTail: nothing, the step overlapping the last
// full one (last), or the partial step (tail).
template <typename scalar_t, bool kInterleaved, Tail kTail>
struct SpanEnding {};
template <typename scalar_t, bool kInterleaved>
struct SpanEnding<scalar_t, kInterleaved, Tail::kOverlap> {
  RowStepRotation<scalar_t, kInterleaved> last;
};
template <typename scalar_t, bool kInterleaved>
struct SpanEnding<scalar_t, kInterleaved, Tail::kMasked> {
  TailRotation<scalar_t, kInterleaved> tail;
};

template <typename scalar_t, bool kInterleaved, int kSteps, Tail kTail>
struct SpanRotation : SpanEnding<scalar_t, kInterleaved, kTail> {
  RowStepRotation<scalar_t, kInterleaved> steps[kSteps > 0 ? kSteps : 1];

  SpanRotation() = default;
  SpanRotation(const Rotation<opmath_t<scalar_t>>& r, int64_t pairs) {
    constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
    for (int k = 0; k < kSteps; ++k) {
      steps[k] = RowStepRotation<scalar_t, kInterleaved>(r, k * kStep);
    }
    if constexpr (kTail == Tail::kOverlap) {
      this->last = RowStepRotation<scalar_t, kInterleaved>(r, pairs - kStep);
    } else if constexpr (kTail == Tail::kMasked) {
      this->tail =
          TailRotation<scalar_t, kInterleaved>(r, kSteps * kStep, pairs - kSteps * kStep);
    }
  }
};

// Rotates one contiguous row by r; `pass_through`: out is not x and features [2 * pairs,
// head_dim) are copied over. kStream: the full steps' stores stream (store_vector), so out
// is a multiple of kVectorBytes and the row ends with them.
template <typename scalar_t, bool kInterleaved, int kSteps, Tail kTail, bool kStream = false>
C10_ALWAYS_INLINE void rotate_row_by(const scalar_t* x, scalar_t* out,
                                     const SpanRotation<scalar_t, kInterleaved, kSteps, kTail>& r,
                                     int64_t pairs, int64_t head_dim, bool pass_through) {
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  constexpr bool kCheckNan = !kNanLowBitsClear<Rotation<opmath_t<scalar_t>>>;
  static_assert(!kStream || kTail == Tail::kNone);
  StepInput<scalar_t, kInterleaved> last_in;
  if constexpr (kTail == Tail::kOverlap) {  // loaded before the full steps write over it
    last_in = load_step<scalar_t, kInterleaved>(x, pairs - kStep, pairs);
  }
  for (int k = 0; k < kSteps; ++k) {
    rotate_step<scalar_t, kInterleaved, kCheckNan, kStream>(x, out, k * kStep, pairs,
                                                            r.steps[k]);
  }
  if constexpr (kTail == Tail::kOverlap) {
    finish_step<scalar_t, kInterleaved, kCheckNan>(last_in, out, pairs - kStep, pairs, r.last);
  } else if constexpr (kTail == Tail::kMasked) {
    rotate_tail<scalar_t, kInterleaved>(x, out, kSteps * kStep, pairs - kSteps * kStep, pairs,
                                        r.tail);
  }
  if (pass_through) {
    std::memcpy(out + 2 * pairs, x + 2 * pairs, (head_dim - 2 * pairs) * sizeof(scalar_t));
  }
}

// Rotates `rows` contiguous rows (x and out `xs` / `os` elements apart) that share the
// rotation r: the rotation stays in registers across the rows, which is what decode (one
// position for every head of every sequence) and the heads of a prefill token run through.
// kStream: streaming stores (rotate_row_by).
template <typename scalar_t, bool kInterleaved, int kSteps, Tail kTail, bool kStream>
void rotate_contiguous_span(const scalar_t* x, scalar_t* out, int64_t rows, int64_t xs,
                            int64_t os, const Rotation<opmath_t<scalar_t>>& r, int64_t pairs,
                            int64_t head_dim) {
  const SpanRotation<scalar_t, kInterleaved, kSteps, kTail> rotation(r, pairs);
  const bool pass_through = x != out && head_dim > 2 * pairs;
  for (int64_t row = 0; row < rows; ++row, x += xs, out += os) {
    rotate_row_by<scalar_t, kInterleaved, kSteps, kTail, kStream>(x, out, rotation, pairs,
                                                                   head_dim, pass_through);
  }
}

// Prefetches the `bytes` from p on, a cache line at a time; kWrite: for writing. kLocality is
// __builtin_prefetch's: 3 into L1 (prefetcht0), 2 into L2 (prefetcht1); without -mprfchw, which
// the build does not pass, writes get the same instructions.
template <bool kWrite, int kLocality = 3>
C10_ALWAYS_INLINE void prefetch_bytes(const void* p, int64_t bytes) {
  const auto* line = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(line + b, kWrite ? 1 : 0, kLocality);
  }
}

// One head's rows of a tile of tokens (the tiled walk of [B, H, S, D], rope_cpu.cpp): `rows`
// contiguous rows (x and out `xs` / `os` elements apart), row j turned by the rotation of
// the tile's token j. The tile's rotations are built into `cache` (RowFunctions'
// tile_bytes_per_token a token) from `rotations` when `fresh`, and reused by every other head
// of the tile. Row j first prefetches row j of the next run, `ahead_x` / `ahead_out` elements
// on, if it has one (`ahead_rows`): the runs are a few KiB each, too short for the hardware
// prefetchers to follow. kStream: streaming stores (rotate_row_by), and no prefetch of out.
//
// The next run goes into L2, not L1: the tile's rotations (16 KiB for 64 bf16 pairs a row),
// the run being turned (8 + 8 KiB out of place) and the next run (16 KiB more) do not fit a
// 32 KiB L1 together (Zen 3 and 4, and Intel's cores before Golden Cove), and the runs of
// a tile's heads lie a power of two apart, so in the same L1 sets. bf16 half-split q, k
// [1, 32, 2048, 128], AMD EPYC (Zen 4), median of 7, over five interleaved rounds of the two
// builds: out of place, 1 thread, AVX2 2.48-2.86 ms -> 2.06-2.39, AVX512_BF16 2.22-2.85 ->
// 1.59-2.04; in place, 2 threads, AVX2 1.02-1.10 -> 0.97-1.05, AVX512_BF16 0.82-0.94 -> 0.74-0.76.
// Out of place on 2 threads the change was within the machine's noise.
//
// What the tiled walk costs over the span walk of [B, S, H, D] (same rows, 1 thread, AVX2, from
// L3, perf cpu-clock): the rows' own work is the same (24.7k against 25.0k samples); the
// extra ~26% is these prefetches (18% of this function's samples) and the tiles' setup. Every
// line needs its prefetch: one every 128 bytes, leaving the rest to the adjacent-line
// prefetcher, took bf16 half-split q, k [1, 32, 2048, 128] out of place, 1 thread, from
// 2.3-2.9 ms to 4.9-5.0 ms (none at all: 5.3-6.2). An unrolled loop, no prefetch of out,
// 16-token tiles and the rotations pinned to registers (one load each, not two) measured
// within the noise.
constexpr int kTileLocality = 2;
template <typename scalar_t, bool kInterleaved, int kSteps, Tail kTail, bool kStream>
void rotate_contiguous_tile(const scalar_t* x, scalar_t* out, int64_t rows, int64_t xs,
                            int64_t os, const Rotation<opmath_t<scalar_t>>* rotations,
                            void* cache, bool fresh, int64_t ahead_x, int64_t ahead_out,
                            int64_t ahead_rows, int64_t pairs, int64_t head_dim) {
  using Cached = SpanRotation<scalar_t, kInterleaved, kSteps, kTail>;
  auto* tile = static_cast<Cached*>(cache);
  if (fresh) {
    for (int64_t j = 0; j < rows; ++j) {
      new (tile + j) Cached(rotations[j], pairs);
    }
  }
  const bool pass_through = x != out && head_dim > 2 * pairs;
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t row = 0; row < rows; ++row, x += xs, out += os) {
    if (row < ahead_rows) {
      prefetch_bytes<false, kTileLocality>(x + ahead_x, row_bytes);
      if (out != x && !kStream) {
        prefetch_bytes<true, kTileLocality>(out + ahead_out, row_bytes);
      }
    }
    rotate_row_by<scalar_t, kInterleaved, kSteps, kTail, kStream>(x, out, tile[row], pairs,
                                                                   head_dim, pass_through);
  }
}

template <typename scalar_t, bool kInterleaved>
using SpanFn = void (*)(const scalar_t*, scalar_t*, int64_t, int64_t, int64_t,
                        const Rotation<opmath_t<scalar_t>>&, int64_t, int64_t);
template <typename scalar_t, bool kInterleaved>
using TileFn = void (*)(const scalar_t*, scalar_t*, int64_t, int64_t, int64_t,
                        const Rotation<opmath_t<scalar_t>>*, void*, bool, int64_t, int64_t,
                        int64_t, int64_t, int64_t);

// The span and tile functions for a rotary dim of `pairs` pairs, and the bytes a tile cache
// takes per token: 1..8 full steps, a partial step alone, or 1..4 full steps and an
// overlapping one (head dims such as 80 or 96); nullptrs for the rest. The streaming-store
// span and tile functions (stream_output) only for rows of 1, 2, 4 or 8 whole steps.
template <typename scalar_t, bool kInterleaved>
struct RowFunctions {
  SpanFn<scalar_t, kInterleaved> span = nullptr;
  TileFn<scalar_t, kInterleaved> tile = nullptr;
  int64_t tile_bytes_per_token = 0;
  SpanFn<scalar_t, kInterleaved> span_stream = nullptr;
  TileFn<scalar_t, kInterleaved> tile_stream = nullptr;
};

template <typename scalar_t, bool kInterleaved, int kSteps, Tail kTail>
RowFunctions<scalar_t, kInterleaved> row_functions_of() {
  RowFunctions<scalar_t, kInterleaved> f{
      rotate_contiguous_span<scalar_t, kInterleaved, kSteps, kTail, false>,
      rotate_contiguous_tile<scalar_t, kInterleaved, kSteps, kTail, false>,
      static_cast<int64_t>(sizeof(SpanRotation<scalar_t, kInterleaved, kSteps, kTail>))};
  // Streaming forms for the step counts of head dims 64, 128 and 256 only: every form is
  // compiled for each dtype and instruction set, and the rest keep the regular stores.
  if constexpr (kStreamingStores && kTail == Tail::kNone &&
                (kSteps == 1 || kSteps == 2 || kSteps == 4 || kSteps == 8)) {
    f.span_stream = rotate_contiguous_span<scalar_t, kInterleaved, kSteps, kTail, true>;
    f.tile_stream = rotate_contiguous_tile<scalar_t, kInterleaved, kSteps, kTail, true>;
  }
  return f;
}

template <typename scalar_t, bool kInterleaved>
RowFunctions<scalar_t, kInterleaved> row_functions(int64_t pairs) {
  constexpr int64_t kStep = kStepPairs<scalar_t, kInterleaved>;
  constexpr Tail kOverlap = Tail::kOverlap;
  constexpr Tail kNone = Tail::kNone;
  if (pairs % kStep != 0) {
    switch (pairs / kStep) {
      case 0: return row_functions_of<scalar_t, kInterleaved, 0, Tail::kMasked>();
      case 1: return row_functions_of<scalar_t, kInterleaved, 1, kOverlap>();
      case 2: return row_functions_of<scalar_t, kInterleaved, 2, kOverlap>();
      case 3: return row_functions_of<scalar_t, kInterleaved, 3, kOverlap>();
      case 4: return row_functions_of<scalar_t, kInterleaved, 4, kOverlap>();
      default: return {};
    }
  }
  switch (pairs / kStep) {
    case 1: return row_functions_of<scalar_t, kInterleaved, 1, kNone>();
    case 2: return row_functions_of<scalar_t, kInterleaved, 2, kNone>();
    case 3: return row_functions_of<scalar_t, kInterleaved, 3, kNone>();
    case 4: return row_functions_of<scalar_t, kInterleaved, 4, kNone>();
    case 5: return row_functions_of<scalar_t, kInterleaved, 5, kNone>();
    case 6: return row_functions_of<scalar_t, kInterleaved, 6, kNone>();
    case 8: return row_functions_of<scalar_t, kInterleaved, 8, kNone>();
    default: return {};
  }
}

// Rotates one row whose features are strided (e.g. a transposed view): gathered into
// `buffer` (head_dim elements), rotated there by the contiguous-row code, scattered back,
// so that every layout gets bit-identical results.
template <typename scalar_t, bool kInterleaved>
void rotate_strided_row(const scalar_t* x, scalar_t* out, int64_t xs, int64_t os,
                        const Rotation<opmath_t<scalar_t>>& r, int64_t pairs, int64_t head_dim,
                        scalar_t* buffer) {
  // In place, the pass-through features stay where they are.
  const int64_t width = out == x ? 2 * pairs : head_dim;
  for (int64_t f = 0; f < width; ++f) {
    buffer[f] = x[f * xs];
  }
  rotate_contiguous_row<scalar_t, kInterleaved>(buffer, buffer, r, pairs, 2 * pairs);
  for (int64_t f = 0; f < width; ++f) {
    out[f * os] = buffer[f];
  }
}

// Walks the rows [begin, end) of one operand in spans along its innermost leading dim,
// keeping the multi-index and the three offsets up to date with additions only.
class RowCursor {
 public:
  RowCursor(const RotaryOperand& op, int64_t row) : op_(op) {
    for (int64_t d = op.ndim - 1; d >= 0; --d) {
      idx_[d] = row % op.sizes[d];
      row /= op.sizes[d];
      x_ += idx_[d] * op.x_strides[d];
      out_ += idx_[d] * op.out_strides[d];
      pos_ += idx_[d] * op.pos_strides[d];
    }
  }
  int64_t x() const { return x_; }
  int64_t out() const { return out_; }
  int64_t pos() const { return pos_; }
  // Rows left before the innermost dim wraps (1 for an operand with no leading dims).
  int64_t span() const {
    return op_.ndim == 0 ? 1 : op_.sizes[op_.ndim - 1] - idx_[op_.ndim - 1];
  }
  // Moves n <= span() rows on.
  void advance(int64_t n) {
    int64_t d = op_.ndim - 1;
    if (d < 0) {
      return;
    }
    x_ += n * op_.x_strides[d];
    out_ += n * op_.out_strides[d];
    pos_ += n * op_.pos_strides[d];
    idx_[d] += n;
    while (idx_[d] == op_.sizes[d]) {
      x_ -= op_.sizes[d] * op_.x_strides[d];
      out_ -= op_.sizes[d] * op_.out_strides[d];
      pos_ -= op_.sizes[d] * op_.pos_strides[d];
      idx_[d] = 0;
      if (--d < 0) {
        return;
      }
      x_ += op_.x_strides[d];
      out_ += op_.out_strides[d];
      pos_ += op_.pos_strides[d];
      ++idx_[d];
    }
  }

 private:
  const RotaryOperand& op_;
  int64_t idx_[kMaxDims] = {};
  int64_t x_ = 0, out_ = 0, pos_ = 0;
};

// The rotation of the last position seen: rows sharing a position (the heads of one token)
// read and convert the table row once, not once per head.
template <typename opmath, typename table_t>
class RotationCache {
 public:
  explicit RotationCache(const RotaryParams& p, int64_t padding = 0)
      : p_(p), table_(static_cast<const table_t*>(p.table)), rotation_(p.rot_pairs, padding) {}

  // The rotation of the row whose positions offset is pos_offset, loaded unless it is.
  const Rotation<opmath>& at(int64_t pos_offset) {
    if (p_.mrope_axes == 0) {
      const int64_t position = row_position(p_, pos_offset);
      if (position != cached_position_) {
        rotation_.load(table_ + position * p_.table_row_stride, p_);
        cached_position_ = position;
      }
      return rotation_;
    }
    int64_t rows[kMaxMropeAxes];
    bool same = cached_position_ == 0;
    for (int a = 0; a < p_.mrope_axes; ++a) {
      rows[a] = axis_position(p_, pos_offset, a);
      same = same && rows[a] == cached_axes_[a];
    }
    if (!same) {
      load_axes(rotation_, rows);
      std::copy(rows, rows + p_.mrope_axes, cached_axes_);
      cached_position_ = 0;  // cached_axes_ holds a rotation
    }
    return rotation_;
  }

  // Loads the rotation of the row whose positions offset is pos_offset into r.
  void load(Rotation<opmath>& r, int64_t pos_offset) const {
    if (p_.mrope_axes == 0) {
      r.load(table_ + row_position(p_, pos_offset) * p_.table_row_stride, p_);
      return;
    }
    int64_t rows[kMaxMropeAxes];
    for (int a = 0; a < p_.mrope_axes; ++a) {
      rows[a] = axis_position(p_, pos_offset, a);
    }
    load_axes(r, rows);
  }

 private:
  const RotaryParams& p_;
  const table_t* table_;
  Rotation<opmath> rotation_;
  int64_t cached_position_ = -1;
  int64_t cached_axes_[kMaxMropeAxes];  // MRoPE: the positions of the rotation loaded

  // MRoPE: the rotation of table rows `rows`, one per axis, into r.
  void load_axes(Rotation<opmath>& r, const int64_t* rows) const {
    bool one_row = true;  // text tokens: every axis at one position, plain RoPE
    for (int a = 1; a < p_.mrope_axes; ++a) {
      one_row = one_row && rows[a] == rows[0];
    }
    if (one_row) {
      r.load(table_ + rows[0] * p_.table_row_stride, p_);
    } else {
      r.load_mrope(table_, rows, p_);
    }
  }
};

// `stream`: contiguous rows whose output allows it take streaming stores (stream_output).
template <typename scalar_t, typename table_t, bool kInterleaved>
void rotate_rows(const RotaryParams& p, int64_t begin, int64_t end, bool stream) {
  using opmath = opmath_t<scalar_t>;
  const int64_t pairs = p.rot_pairs;
  RotationCache<opmath, table_t> cache(p);
  const Rotation<opmath>* rotation = nullptr;  // the current row's
  const auto functions = row_functions<scalar_t, kInterleaved>(pairs);
  std::vector<scalar_t> buffer;  // one strided row, gathered
  // The tiled walk (rope_cpu.cpp): the rotations of the current tile's tokens, and what the
  // tile function built from them, for the first span of rows that needs them.
  std::vector<Rotation<opmath>> tile_rotations;
  std::unique_ptr<std::byte[], void (*)(std::byte*)> tile_cache(nullptr, [](std::byte* b) {
    ::operator delete[](b, std::align_val_t(64));
  });
  int64_t tile_pos = -1, tile_span = 0;  // the tile cached: positions offset and row count
  // Rows whose positions all differ read a contiguous opmath table in place (not MRoPE, whose
  // rows mix table rows).
  const opmath* direct_table = nullptr;
  if constexpr (std::is_same_v<table_t, opmath>) {
    if (p.table_pair_stride == 2 && p.table_cs_stride == 1 && p.mrope_axes == 0) {
      direct_table = static_cast<const table_t*>(p.table);
    }
  }
  auto use_position = [&](int64_t pos_offset) { rotation = &cache.at(pos_offset); };

  int64_t first_row = 0;  // global index of the operand's first row
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    const int64_t lo = std::max(begin, first_row);
    const int64_t hi = std::min(end, first_row + op.rows);
    first_row += op.rows;
    if (lo >= hi) {
      continue;
    }
    const auto* x = static_cast<const scalar_t*>(op.x);
    auto* out = static_cast<scalar_t*>(op.out);
    const bool contiguous = op.x_feature_stride == 1 && op.out_feature_stride == 1;
    if (!contiguous && static_cast<int64_t>(buffer.size()) < op.head_dim) {
      buffer.resize(op.head_dim);
    }
    const int64_t inner = op.ndim - 1;
    const int64_t xs = inner >= 0 ? op.x_strides[inner] : 0;
    const int64_t os = inner >= 0 ? op.out_strides[inner] : 0;
    const int64_t ps = inner >= 0 ? op.pos_strides[inner] : 0;
    // Rows along the innermost dim share a position when its positions stride is 0.
    const bool shared = ps == 0;
    RowCursor cursor(op, lo - (first_row - op.rows));
    for (int64_t row = lo; row < hi;) {
      const int64_t span = std::min(hi - row, cursor.span());
      const scalar_t* xr = x + cursor.x();
      scalar_t* outr = out + cursor.out();
      if (contiguous && shared && functions.span != nullptr) {
        use_position(cursor.pos());
        const bool streams = stream && functions.span_stream != nullptr &&
                             streamable(outr, span, os);
        (streams ? functions.span_stream : functions.span)(xr, outr, span, xs, os, *rotation,
                                                           pairs, op.head_dim);
      } else if (contiguous && !shared && functions.tile != nullptr && span <= kTileTokens &&
                 inner >= 1 && op.pos_strides[inner - 1] == 0 && op.sizes[inner - 1] > 1) {
        // A head's rows of a tile of tokens, the next dim walking the heads.
        const bool fresh = cursor.pos() != tile_pos || span != tile_span;
        if (fresh) {
          if (tile_cache == nullptr) {
            tile_rotations.reserve(kTileTokens);
            for (int64_t j = 0; j < kTileTokens; ++j) {
              tile_rotations.emplace_back(pairs);
            }
            tile_cache.reset(static_cast<std::byte*>(::operator new[](
                kTileTokens * functions.tile_bytes_per_token, std::align_val_t(64))));
          }
          for (int64_t j = 0; j < span; ++j) {
            cache.load(tile_rotations[j], cursor.pos() + j * ps);
          }
          tile_pos = cursor.pos();
          tile_span = span;
        }
        // The next span of the task's rows (the next head's run, or the next tile's first),
        // for the tile function to prefetch.
        RowCursor next = cursor;
        next.advance(span);
        const int64_t next_rows = std::min(hi - row - span, next.span());
        const bool streams = stream && functions.tile_stream != nullptr &&
                             streamable(outr, span, os);
        (streams ? functions.tile_stream : functions.tile)(
            xr, outr, span, xs, os, tile_rotations.data(), tile_cache.get(), fresh,
            next.x() - cursor.x(), next.out() - cursor.out(), std::max<int64_t>(next_rows, 0),
            pairs, op.head_dim);
      } else {
        for (int64_t j = 0; j < span; ++j, xr += xs, outr += os) {
          if (contiguous && !shared && direct_table != nullptr) {
            const int64_t position = row_position(p, cursor.pos() + j * ps);
            rotate_contiguous_row<scalar_t, kInterleaved>(
                xr, outr, TableRow<opmath>{direct_table + position * p.table_row_stride,
                                           p.inverse},
                pairs, op.head_dim);
            continue;
          }
          if (j == 0 || !shared) {
            use_position(cursor.pos() + j * ps);
          }
          if (contiguous) {
            rotate_contiguous_row<scalar_t, kInterleaved>(xr, outr, *rotation, pairs,
                                                          op.head_dim);
          } else {
            rotate_strided_row<scalar_t, kInterleaved>(xr, outr, op.x_feature_stride,
                                                       op.out_feature_stride, *rotation, pairs,
                                                       op.head_dim, buffer.data());
          }
        }
      }
      cursor.advance(span);
      row += span;
    }
  }
}


// The fused RoPE + KV-cache write (kv_cache_kernel below).

// x / scale, saturated to the float8 format's finite range (NaN stays NaN), rounded to
// nearest even once: the stored value of a float8 cache.
template <typename fp8_t>
inline fp8_t quantize(float x, float scale) {
  const float kMax = static_cast<float>(std::numeric_limits<fp8_t>::max());
  const float y = x / scale;
  return fp8_t(std::isnan(y) ? y : std::min(std::max(y, -kMax), kMax));
}

// Stores n float values of one head row into cache c at `dst` (c.store is a float8 format),
// with the head's scale.
inline void store_float8_row(const float* values, const CacheTarget& c, int64_t dst,
                             int64_t head, int64_t n) {
  const float scale = c.scale[head * c.scale_stride];
  if (c.store == CacheStore::kFloat8E4M3) {
    auto* out = static_cast<c10::Float8_e4m3fn*>(c.data) + dst;
    for (int64_t f = 0; f < n; ++f) {
      out[f] = quantize<c10::Float8_e4m3fn>(values[f], scale);
    }
  } else {
    auto* out = static_cast<c10::Float8_e5m2*>(c.data) + dst;
    for (int64_t f = 0; f < n; ++f) {
      out[f] = quantize<c10::Float8_e5m2>(values[f], scale);
    }
  }
}

// Rotates `rows` rows of one token (x and out xs / os elements apart) by r.
template <typename scalar_t, bool kInterleaved>
void rotate_token_rows(const RowFunctions<scalar_t, kInterleaved>& functions,
                       const scalar_t* x, scalar_t* out, int64_t rows, int64_t xs, int64_t os,
                       const Rotation<opmath_t<scalar_t>>& r, int64_t pairs,
                       int64_t head_dim) {
  if (functions.span != nullptr) {
    functions.span(x, out, rows, xs, os, r, pairs, head_dim);
    return;
  }
  for (int64_t row = 0; row < rows; ++row, x += xs, out += os) {
    rotate_contiguous_row<scalar_t, kInterleaved>(x, out, r, pairs, head_dim);
  }
}

// The tokens [begin, end) of a fused call: q's rows rotated, k's rotated into the k cache
// (float8 caches: rotated in float, the row converted first, so one rounding), v's copied.
template <typename scalar_t, typename table_t, bool kInterleaved>
void kv_cache_tokens(const KvCacheParams& p, int64_t begin, int64_t end) {
  using opmath = opmath_t<scalar_t>;
  const int64_t pairs = p.rot.rot_pairs;
  const int64_t d = p.head_dim;
  RotationCache<opmath, table_t> rotations(p.rot);
  const auto functions = row_functions<scalar_t, kInterleaved>(pairs);
  const auto float_functions = row_functions<float, kInterleaved>(pairs);
  std::vector<float> row(std::max(d, p.v_cache.head_dim));  // a float8 row, in float
  const auto* q = static_cast<const scalar_t*>(p.q);
  auto* q_out = static_cast<scalar_t*>(p.q_out);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  for (int64_t t = begin; t < end; ++t) {
    const TokenOffsets o = token_offsets(p, t);
    const bool rotates = q != nullptr || (k != nullptr && p.rotate_k);
    const Rotation<opmath>* r = rotates ? &rotations.at(o.pos) : nullptr;
    if (q != nullptr) {
      rotate_token_rows<scalar_t, kInterleaved>(functions, q + o.q, q_out + o.q_out, p.q_heads,
                                                p.q_head_stride, p.q_out_head_stride, *r,
                                                pairs, d);
    }
    const int64_t slot = token_slot(p, o.slot);
    if (slot < 0) {
      continue;  // padding: nothing is written
    }
    if (k != nullptr) {
      const CacheTarget& c = p.k_cache;
      const int64_t dst = cache_row(c, slot, p.block_size);
      const scalar_t* src = k + o.k;
      if (c.store == CacheStore::kSame) {
        auto* out = static_cast<scalar_t*>(c.data) + dst;
        if (p.rotate_k) {
          rotate_token_rows<scalar_t, kInterleaved>(functions, src, out, p.kv_heads,
                                                    p.k_head_stride, c.head_stride, *r, pairs,
                                                    d);
        } else {
          for (int64_t h = 0; h < p.kv_heads; ++h) {
            std::memcpy(out + h * c.head_stride, src + h * p.k_head_stride,
                        d * sizeof(scalar_t));
          }
        }
      } else {
        for (int64_t h = 0; h < p.kv_heads; ++h) {
          const scalar_t* x = src + h * p.k_head_stride;
          for (int64_t f = 0; f < d; ++f) {
            row[f] = static_cast<float>(x[f]);
          }
          if (p.rotate_k) {
            if constexpr (std::is_same_v<opmath, float>) {
              rotate_token_rows<float, kInterleaved>(float_functions, row.data(), row.data(), 1,
                                                     0, 0, *r, pairs, d);
            } else {  // float64 rows: rotated in double, then converted (checked on the host)
              std::vector<double> wide(x, x + d);
              rotate_contiguous_row<double, kInterleaved>(wide.data(), wide.data(), *r, pairs,
                                                          d);
              std::copy(wide.begin(), wide.end(), row.begin());
            }
          }
          store_float8_row(row.data(), c, dst + h * c.head_stride, h, d);
        }
      }
    }
    if (v != nullptr) {
      const CacheTarget& c = p.v_cache;
      const int64_t dst = cache_row(c, slot, p.block_size);
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const scalar_t* x = v + o.v + h * p.v_head_stride;
        if (c.store == CacheStore::kSame) {
          std::memcpy(static_cast<scalar_t*>(c.data) + dst + h * c.head_stride, x,
                      c.head_dim * sizeof(scalar_t));
        } else {
          for (int64_t f = 0; f < c.head_dim; ++f) {
            row[f] = static_cast<float>(x[f]);
          }
          store_float8_row(row.data(), c, dst + h * c.head_stride, h, c.head_dim);
        }
      }
    }
  }
}

}  // namespace

void rotary_kernel(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype) {
  int64_t rows = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    rows += p.operands[o].rows;
  }
  // Enough rows per task that a task moves at least ~64 KiB.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, p.operands[0].head_dim));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_cpu", [&] {
    using row_t = scalar_t;
    const bool stream = stream_output(p, sizeof(row_t));
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_cpu_table", [&] {
      using table_t = scalar_t;
      // A task takes the same share of every operand (q's rows [begin, end) * q.rows / rows
      // and k's likewise), not q's rows on one thread and k's on another: out of place, the
      // allocator may hand q's output the block k's had last call, which the other core
      // then holds in its cache. Float32 q, k [32, 1, 32, 128] out of place, 2 threads, ran
      // in 1.03x to 2.0x `clone`'s time from one process to the next, split by operand.
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        int64_t first = 0;
        for (int o = 0; o < p.num_operands; ++o) {
          const int64_t n = p.operands[o].rows;
          const auto share = [&](int64_t at) {
            return first + static_cast<int64_t>(static_cast<__int128>(at) * n / rows);
          };
          const int64_t lo = share(begin), hi = share(end);
          if (lo < hi) {
            if (p.interleaved) {
              rotate_rows<row_t, table_t, true>(p, lo, hi, stream);
            } else {
              rotate_rows<row_t, table_t, false>(p, lo, hi, stream);
            }
          }
          first += n;
        }
        if (stream) {
          end_streaming_stores();
        }
      });
    });
  });
}


void kv_cache_kernel(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype) {
  const int64_t heads = (p.q != nullptr ? p.q_heads : 0) + 2 * p.kv_heads;
  // Enough tokens per task that a task moves at least ~64 KiB.
  const int64_t grain =
      std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * std::max<int64_t>(1, p.head_dim)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_kv_cache", [&] {
    using row_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_kv_cache_table", [&] {
      using table_t = scalar_t;
      at::parallel_for(0, p.tokens, grain, [&](int64_t begin, int64_t end) {
        if (p.rot.interleaved) {
          kv_cache_tokens<row_t, table_t, true>(p, begin, end);
        } else {
          kv_cache_tokens<row_t, table_t, false>(p, begin, end);
        }
      });
    });
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace rope_ext::cpu
