// Cycles a step of the AVX512_BF16 bfloat16 kernels takes on one core, with the data in L1,
// and which execution pipes the instructions of those steps share: the evidence for what
// bounds the fused RMSNorm + RoPE op against RoPE alone (issue #12, README "What bounds the
// fused op on a Zen 4").
//
// A step is 32 interleaved bfloat16 features (16 pairs) of one row, as in
// csrc/cpu/rope_cpu_kernel_impl.h and qk_norm_cpu_kernel_impl.h: split into even and odd
// floats (vpslld, vpandd), turned with 2 multiplies and 2 FMAs, rounded back to bfloat16
// (vcvtne2ps2bf16, vpermw) and stored in place. The fused op's second pass multiplies the two
// outputs by the row's scale first (2 more multiplies; the weights are folded into the
// rotation), and its first pass loads the step again and sums its squares (vdpbf16ps).
//
// Build and run (an x86-64 host with AVX512_BF16; never -march=native):
//   g++ -O3 -std=c++20 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -o /tmp/cpu_step_cycles
//       benchmarks/cpu_step_cycles.cpp && /tmp/cpu_step_cycles      (one command line)
//
// Cycles are core cycles: the time stamp counter, scaled by a calibration loop of dependent
// integer adds (one cycle each on every x86 core). Best of 7 runs of each loop.
#include <immintrin.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace {

constexpr int kRows = 16, kDim = 128, kSteps = kDim / 32;
alignas(64) uint16_t rows[kRows * kDim];
alignas(64) float cos_[kDim / 2], sin_[kDim / 2];
alignas(64) float w0c[kDim / 2], w1s[kDim / 2], w0s[kDim / 2], w1c[kDim / 2];
alignas(64) float scales[kRows];

// Lanes holding round(low) in their low half and round(high) in their high half, as the
// kernels' join_bf16_lanes with AVX512_BF16.
inline __m512i join_cvt(__m512 low, __m512 high) {
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(pairs, packed);
}

// The same rounding with integer instructions only (the kernels' AVX512 join, its
// vpternlogd written as an and and an add, which run beside the FMAs).
inline __m512i join_integer(__m512 lowf, __m512 highf) {
  const __m512i lo = _mm512_castps_si512(lowf), hi = _mm512_castps_si512(highf);
  const __m512i h = _mm512_mask_blend_epi16(0x55555555u, hi, _mm512_srli_epi32(lo, 16));
  const __m512i l = _mm512_mask_blend_epi16(0x55555555u, _mm512_slli_epi32(hi, 16), lo);
  const __m512i bias =
      _mm512_add_epi16(_mm512_and_si512(h, _mm512_set1_epi16(1)), _mm512_set1_epi16(0x7ffe));
  return _mm512_add_epi16(h, _mm512_srli_epi16(_mm512_avg_epu16(l, bias), 15));
}

inline void split(const uint16_t* x, __m512& even, __m512& odd) {
  const __m512i lanes = _mm512_load_si512(x);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(0xffff0000u)));
}

// RoPE alone, in place.
template <bool kIntegerJoin>
__attribute__((noinline)) void rope(long iters) {
  for (long it = 0; it < iters; ++it) {
    for (int r = 0; r < kRows; ++r) {
      uint16_t* x = rows + r * kDim;
#pragma GCC unroll 4
      for (int k = 0; k < kSteps; ++k) {
        __m512 x0, x1;
        split(x + 32 * k, x0, x1);
        const __m512 c = _mm512_load_ps(cos_ + 16 * k), s = _mm512_load_ps(sin_ + 16 * k);
        const __m512 y0 = _mm512_fmsub_ps(x0, c, _mm512_mul_ps(x1, s));
        const __m512 y1 = _mm512_fmadd_ps(x0, s, _mm512_mul_ps(x1, c));
        _mm512_store_si512(x + 32 * k, kIntegerJoin ? join_integer(y0, y1) : join_cvt(y0, y1));
      }
    }
  }
}

// The fused op's steps: the second pass (weighted rotation, times the row's scale when
// kScale), after the first (loads and vdpbf16ps, one reduction a row) when kFirstPass.
template <bool kFirstPass, bool kScale>
__attribute__((noinline)) void fused(long iters) {
  for (long it = 0; it < iters; ++it) {
    if (kFirstPass) {
      for (int r = 0; r < kRows; ++r) {
        const uint16_t* x = rows + r * kDim;
        __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int k = 0; k < kSteps; ++k) {
          const __m512i lanes = _mm512_load_si512(x + 32 * k);
          acc = _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(lanes),
                                 reinterpret_cast<const __m512bh&>(lanes));
        }
        // Kept near 1 so the rows neither grow nor shrink over the iterations.
        scales[r] = 1.0f + 1e-30f * _mm512_reduce_add_ps(acc);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      uint16_t* x = rows + r * kDim;
      const __m512 scale = _mm512_set1_ps(scales[r]);
#pragma GCC unroll 4
      for (int k = 0; k < kSteps; ++k) {
        __m512 x0, x1;
        split(x + 32 * k, x0, x1);
        __m512 y0 = _mm512_fmsub_ps(x0, _mm512_load_ps(w0c + 16 * k),
                                    _mm512_mul_ps(x1, _mm512_load_ps(w1s + 16 * k)));
        __m512 y1 = _mm512_fmadd_ps(x0, _mm512_load_ps(w0s + 16 * k),
                                    _mm512_mul_ps(x1, _mm512_load_ps(w1c + 16 * k)));
        if (kScale) {
          y0 = _mm512_mul_ps(y0, scale);
          y1 = _mm512_mul_ps(y1, scale);
        }
        _mm512_store_si512(x + 32 * k, join_cvt(y0, y1));
      }
    }
  }
}

// Pipe probes: 8 independent FMAs an iteration, alone or beside 8 instructions of one kind
// (independent of the FMAs and of each other: each writes a register of its own, zmm8 to
// zmm15), on inputs 1 and 0.5 (%0 and %1).
#define FMA8                                                                           \
  "vfmadd231ps %0, %1, %%zmm0\n\t vfmadd231ps %0, %1, %%zmm1\n\t"                      \
  "vfmadd231ps %0, %1, %%zmm2\n\t vfmadd231ps %0, %1, %%zmm3\n\t"                      \
  "vfmadd231ps %0, %1, %%zmm4\n\t vfmadd231ps %0, %1, %%zmm5\n\t"                      \
  "vfmadd231ps %0, %1, %%zmm6\n\t vfmadd231ps %0, %1, %%zmm7\n\t"
#define X8(op) op("8") op("9") op("10") op("11") op("12") op("13") op("14") op("15")
#define VMULPS(r) "vmulps %0, %1, %%zmm" r "\n\t"
#define VDPBF16PS(r) "vdpbf16ps %0, %1, %%zmm" r "\n\t"
#define VCVTNE2PS2BF16(r) "vcvtne2ps2bf16 %0, %1, %%zmm" r "\n\t"
#define VPERMW(r) "vpermw %0, %1, %%zmm" r "\n\t"
#define VADDPS(r) "vaddps %0, %1, %%zmm" r "\n\t"
#define VPSLLD(r) "vpslld $16, %0, %%zmm" r "\n\t"
#define VPANDD(r) "vpandd %0, %1, %%zmm" r "\n\t"
#define VPTERNLOGD(r) "vpternlogd $0xea, %0, %1, %%zmm" r "\n\t"
#define PROBE(body)                                                                      \
  [](long n) {                                                                           \
    const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.5f);                     \
    for (long i = 0; i < n; ++i) {                                                       \
      asm volatile(body ::"v"(a), "v"(b)                                                 \
                   : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",      \
                     "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"); \
    }                                                                                    \
  }
// The probe pair of one instruction: {name, alone, beside 8 FMAs}.
#define PROBES(NAME) {#NAME, probe(PROBE(X8(NAME))), probe(PROBE(FMA8 X8(NAME)))}

__attribute__((noinline)) void add_chain(long n) {
  uint64_t v = 0;
  for (long i = 0; i < n; ++i) {
    asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(v));
  }
}

template <typename F>
double best_ticks(F&& f) {
  double best = 1e300;
  for (int rep = 0; rep < 7; ++rep) {
    const uint64_t t0 = __rdtsc();
    f();
    const double t = static_cast<double>(__rdtsc() - t0);
    best = t < best ? t : best;
  }
  return best;
}

// "model name", and the family and model numbers ("AMD EPYC" alone does not say which Zen).
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string name = "unknown", family, model;
  for (std::string line; std::getline(in, line) && line.rfind("flags", 0) != 0;) {
    const size_t colon = line.find(':');
    const std::string value = colon == std::string::npos ? "" : line.substr(colon + 2);
    if (line.rfind("model name", 0) == 0) {
      name = value;
    } else if (line.rfind("cpu family", 0) == 0) {
      family = value;
    } else if (line.rfind("model", 0) == 0 && line.rfind("model name", 0) != 0) {
      model = value;
    }
  }
  return name + " (family " + family + ", model " + model + ")";
}

}  // namespace

// Everything that may use AVX-512 instructions runs in here, after main's check.
__attribute__((noinline)) int run() {
  for (int i = 0; i < kRows * kDim; ++i) {
    rows[i] = static_cast<uint16_t>(0x3f80 + i % 7);  // 1.0 .. 1.05
  }
  for (int i = 0; i < kDim / 2; ++i) {  // a rotation by ~0.45 rad, weights of 1
    cos_[i] = w0c[i] = w1c[i] = 0.9f;
    sin_[i] = w1s[i] = w0s[i] = 0.43589f;
  }
  for (float& s : scales) {
    s = 1.0f;
  }
  const long calib = 50'000'000;
  const double cycles_per_tick = 4.0 * calib / best_ticks([&] { add_chain(calib); });
  std::printf("CPU: %s; %.3f core cycles per TSC tick\n\n", cpu_model().c_str(), cycles_per_tick);

  const long iters = 20'000;
  const double steps = static_cast<double>(iters) * kRows * kSteps;
  auto cycles = [&](auto&& f) { return best_ticks(f) * cycles_per_tick / steps; };
  const double rope_cvt = cycles([&] { rope<false>(iters); });
  std::printf("| loop, bf16 [%d rows x %d] in place in L1 | cycles a step | / RoPE alone |\n",
              kRows, kDim);
  std::printf("|---|---:|---:|\n");
  auto row = [&](const char* name, double c) {
    std::printf("| %s | %.2f | %.2f |\n", name, c, c / rope_cvt);
  };
  row("RoPE alone (4 mul/FMA, vcvtne2ps2bf16 + vpermw)", rope_cvt);
  row("RoPE alone, rounded with integer instructions", cycles([&] { rope<true>(iters); }));
  row("fused, second pass without the scale", cycles([&] { fused<false, false>(iters); }));
  row("fused, second pass (+2 vmulps by the scale)", cycles([&] { fused<false, true>(iters); }));
  row("fused, both passes (+ load, vdpbf16ps, a reduction a row)",
      cycles([&] { fused<true, true>(iters); }));

  const long n = 2'000'000;
  auto probe = [&](auto f) { return best_ticks([&] { f(n); }) * cycles_per_tick / n; };
  const double fma = probe(PROBE(FMA8));
  std::printf("\n| 8 of an instruction an iteration (zmm) | alone | beside 8 FMAs "
              "(8 FMAs alone: %.2f) |\n",
              fma);
  std::printf("|---|---:|---:|\n");
  struct Probe {
    const char* name;
    double alone, beside;
  };
  const Probe probes[] = {
      {"VFMADD231PS", fma, 0}, PROBES(VMULPS), PROBES(VDPBF16PS), PROBES(VCVTNE2PS2BF16),
      PROBES(VPERMW), PROBES(VADDPS), PROBES(VPSLLD), PROBES(VPANDD), PROBES(VPTERNLOGD),
  };

  for (const Probe& p : probes) {
    if (p.beside == 0) {
      std::printf("| %s | %.2f | |\n", p.name, p.alone);
    } else {
      std::printf("| %s | %.2f | %.2f |\n", p.name, p.alone, p.beside);
    }
  }
  return 0;
}

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::puts("this CPU has no AVX512_BF16; nothing to measure");
    return 0;
  }
  return run();
}
