// The arithmetic of rotary position embedding, shared by the CPU and CUDA kernels.
//
// No torch includes: this header is plain C++ (and CUDA when compiled by nvcc), so the
// CPU tests exercise the very functions the GPU kernels call.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ROPE_HD __host__ __device__ __forceinline__
#else
#define ROPE_HD inline
#endif

namespace rope_ext {

// Leading (non-feature) dimensions a kernel handles after the host merged the mergeable ones.
constexpr int kMaxDims = 8;

// Position axes of multi-axis RoPE (MRoPE): Qwen2-VL's (time, height, width) take 3.
constexpr int kMaxMropeAxes = 4;

// One tensor to rotate. Sizes and strides are in elements.
struct RotaryOperand {
  const void* x;  // [*sizes, head_dim]
  void* out;      // [*sizes, head_dim]; equal to x for in-place calls
  int64_t ndim;   // number of leading dims in sizes
  int64_t sizes[kMaxDims];
  int64_t x_strides[kMaxDims];
  int64_t out_strides[kMaxDims];
  // Position of a row = offset + positions[sum(index[d] * pos_strides[d])] with a positions
  // tensor (broadcast dims have stride 0), or offset + sum(index[d] * pos_strides[d]) without
  // one (stride 1 on seq_dim, 0 elsewhere): one code path for every layout.
  int64_t pos_strides[kMaxDims];
  int64_t x_feature_stride;
  int64_t out_feature_stride;
  int64_t head_dim;  // D; features [2 * rot_pairs, D) pass through unchanged
  int64_t rows;      // product of sizes
};

// Everything a rotary kernel needs, filled on the host.
struct RotaryParams {
  RotaryOperand operands[2];  // q and k, or x alone
  int num_operands;
  const void* table;  // [table_rows, rot_pairs, 2] holding (cos, sin), float or double
  int64_t table_rows;
  int64_t rot_pairs;  // R / 2
  int64_t table_row_stride;
  int64_t table_pair_stride;
  int64_t table_cs_stride;
  const void* positions;  // int32 or int64 (positions_int64), or nullptr
  bool positions_int64;
  int64_t offset;
  bool interleaved;  // pairs (2i, 2i+1); else (i, i + R/2)
  bool inverse;      // rotate by the negative angle
  // MRoPE: with mrope_axes = A > 0, positions carry a leading dim of A position axes (stride
  // mrope_axis_stride) and pair i turns by the position of axis pair_axis(p, i).
  // mrope_bounds: the cumulative section ends (contiguous sections), or 3 * section[a]
  // (mrope_interleaved: Qwen3-VL's layout, A = 3).
  int mrope_axes;
  bool mrope_interleaved;
  int64_t mrope_axis_stride;
  int64_t mrope_bounds[kMaxMropeAxes];
};

// a * b + c and a * b - c, each rounded once. Named as at::vec names its own, so that for
// the CPU kernel's at::vec::Vectorized arguments, argument-dependent lookup picks those.
ROPE_HD float fmadd(float a, float b, float c) { return fmaf(a, b, c); }
ROPE_HD double fmadd(double a, double b, double c) { return fma(a, b, c); }
ROPE_HD float fmsub(float a, float b, float c) { return fmaf(a, b, -c); }
ROPE_HD double fmsub(double a, double b, double c) { return fma(a, b, -c); }

// Rotates the pair (x0, x1) by the angle whose cosine and sine are c and s; y0 / y1 may be
// x0 / x1 themselves. Templated so that the CPU vector path (at::vec::Vectorized) and the
// CUDA kernels run the same expression, with its roundings spelt out: one product rounded,
// then one fused multiply-add. Left to the compiler, the contraction into FMAs differs
// between inlining sites, and so would the last bit between layouts.
template <typename T>
ROPE_HD void rotate_pair(const T& x0, const T& x1, const T& c, const T& s, T& y0, T& y1) {
  const T r0 = fmsub(x0, c, x1 * s);
  const T r1 = fmadd(x0, s, x1 * c);
  y0 = r0;
  y1 = r1;
}

// Element offsets of one row of an operand, from its multi-index.
struct RowOffsets {
  int64_t x;
  int64_t out;
  int64_t pos;
};

// Offsets of row `row` (linear over the leading dims, last dim fastest).
ROPE_HD RowOffsets row_offsets(const RotaryOperand& op, int64_t row) {
  RowOffsets o{0, 0, 0};
  for (int64_t d = op.ndim - 1; d >= 0; --d) {
    const int64_t idx = row % op.sizes[d];
    row /= op.sizes[d];
    o.x += idx * op.x_strides[d];
    o.out += idx * op.out_strides[d];
    o.pos += idx * op.pos_strides[d];
  }
  return o;
}

// Position of a row whose positions offset is pos_offset.
ROPE_HD int64_t row_position(const RotaryParams& p, int64_t pos_offset) {
  if (p.positions == nullptr) {
    return p.offset + pos_offset;
  }
  const int64_t stored = p.positions_int64
      ? static_cast<const int64_t*>(p.positions)[pos_offset]
      : static_cast<const int32_t*>(p.positions)[pos_offset];
  return p.offset + stored;
}

// The position axis pair i turns by (MRoPE; 0 without it). Contiguous sections: the section
// holding i. Interleaved (Qwen3-VL): height when i % 3 == 1 and i < 3 * section[1], width
// when i % 3 == 2 and i < 3 * section[2], time otherwise.
ROPE_HD int pair_axis(const RotaryParams& p, int64_t i) {
  if (p.mrope_interleaved) {
    const int64_t r = i % 3;
    return r != 0 && i < p.mrope_bounds[r] ? static_cast<int>(r) : 0;
  }
  int a = 0;
  while (a + 1 < p.mrope_axes && i >= p.mrope_bounds[a]) {
    ++a;
  }
  return a;
}

// Position of axis `axis` of a row whose positions offset is pos_offset (MRoPE).
ROPE_HD int64_t axis_position(const RotaryParams& p, int64_t pos_offset, int axis) {
  return row_position(p, pos_offset + axis * p.mrope_axis_stride);
}

// Inverse frequency of pair i for a rotary dim `dim`: theta^(-2i/dim), in double so that the
// angle position * inv_freq is exact to ~1e-16 relative before it is rounded once.
ROPE_HD double inverse_frequency(int64_t i, int64_t dim, double theta) {
  return pow(theta, -static_cast<double>(2 * i) / static_cast<double>(dim));
}

// magnitude * (cos, sin) of position * inv_freq, computed in double.
ROPE_HD void table_entry(int64_t position, double inv_freq, double magnitude, double& c,
                         double& s) {
  const double angle = static_cast<double>(position) * inv_freq;
  c = magnitude * cos(angle);
  s = magnitude * sin(angle);
}

}  // namespace rope_ext
