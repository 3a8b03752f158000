// Fused per-head RMSNorm + RoPE (the q_norm / k_norm of Qwen3, Gemma 3 and other QK-norm
// models): the parameters and the per-row arithmetic, shared by the CPU and CUDA kernels.
//
// Each row x (one head of one token, head_dim D) becomes
//   y = rotate(x * r * (w + weight_offset)),  r = 1 / sqrt(sum(x^2) / D + eps),
// with the statistics and the products in float32 (float64 for float64 rows), rounded once.
// Backward, with gn = rotate^-1(gy) and g = gn * (w + weight_offset):
//   dx = r * g - x * (r^3 * sum(g * x) / D),   dw = sum over rows of gn * x * r.
#pragma once

#include "rope_math.h"

namespace rope_ext {

struct NormRotaryParams {
  // The rows and their rotation: operand o reads x and writes out. In backward, x is the
  // incoming gradient, out the input's gradient, and rotary.inverse is flipped.
  RotaryParams rotary;
  const void* weight[2];  // [head_dim], stride weight_stride
  int64_t weight_stride[2];
  bool weight_float[2];   // float32; else the operand's dtype
  double eps;
  double weight_offset;   // the scale is weight + weight_offset (Gemma's (1 + w): 1)
  // Backward: the forward's input rows, at operand o's x strides (the op lays them out so),
  // and the weight gradients [head_dim], contiguous, of the weight's dtype: the backend
  // writes every element, the sum over rows in opmath rounded once to the weight's dtype
  // (the CPU kernel through store_weight_grad(), CUDA by copy_ from its float32 partials).
  const void* input[2];
  void* weight_grad[2];
};

// Element j of operand o's weight gradient: v (the opmath sum) rounded once to the weight's
// dtype, float32 or the rows' scalar_t, as torch's .to() rounds it.
template <typename scalar_t, typename opmath>
ROPE_HD void store_weight_grad(const NormRotaryParams& p, int o, int64_t j, opmath v) {
  if (p.weight_float[o]) {
    static_cast<float*>(p.weight_grad[o])[j] = static_cast<float>(v);
  } else {
    static_cast<scalar_t*>(p.weight_grad[o])[j] = static_cast<scalar_t>(v);
  }
}

ROPE_HD float rope_sqrt(float v) { return sqrtf(v); }
ROPE_HD double rope_sqrt(double v) { return sqrt(v); }

// The RMS scale 1 / sqrt(sum_sq / n + eps) of a row, in T; correctly rounded sqrt and division
// (not an approximate rsqrt), so the CPU and the GPU compute the same value from the same sum.
template <typename T>
ROPE_HD T rms_scale(T sum_sq, int64_t n, T eps) {
  return T(1) / rope_sqrt(sum_sq / static_cast<T>(n) + eps);
}

// The correction term of the input gradient: r^3 * sum(g * x) / n.
template <typename T>
ROPE_HD T rms_grad_coefficient(T r, T dot, int64_t n) {
  return r * r * r * dot / static_cast<T>(n);
}

}  // namespace rope_ext
