// Which instantiation of the norm thread function a call runs, and the weight-gradient
// partials of a backward launch. Shared by the CUDA launcher and its host emulation, so that
// both pick the same kernel and sum the same partials for the same call.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include "qk_norm_cuda_kernel.h"
#include "rope_cuda_dispatch.h"

namespace rope_ext {
namespace cuda_kernel {

// Calls Run<scalar_t, kInterleaved, kVector, kBackward, kMrope>::run(p, args...) for the
// kernel that serves p. The table's element type is a runtime branch of the scalar path
// (uniform per launch), and so is MRoPE there: a template parameter each would double the
// kernels for little. The vector path reads an opmath table (make_norm_vector_inputs()) and
// has its own MRoPE kernels, whose per-pair table reads would cost the others registers.
template <template <typename, bool, bool, bool, bool> class Run, typename... Args>
void dispatch_norm(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                   Args&... args) {
  const bool vector = norm_vector_path(p, c10::elementSize(x_dtype));
  const bool vector_mrope = vector && p.rotary.mrope_axes > 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_norm_cuda", [&] {
    with_bool(p.rotary.interleaved, [&](auto interleaved) {
      with_bool(backward, [&](auto bwd) {
        if (vector) {
          with_bool(vector_mrope, [&](auto mrope) {
            Run<scalar_t, decltype(interleaved)::value, true, decltype(bwd)::value,
                decltype(mrope)::value>::run(p, args...);
          });
        } else {
          Run<scalar_t, decltype(interleaved)::value, false, decltype(bwd)::value, false>::run(
              p, args...);
        }
      });
    });
  });
}

// Vector path: hands the kernel a table of opmath (cos, sin) pairs with 16-byte aligned rows
// ([rows, pairs, 2], pair stride 2) and weights it can read as 16-byte vectors (contiguous,
// aligned, and float32 or x's dtype, double for float64 x), so that it reads a lane's (cos,
// sin) and weights as whole vectors. Where the caller's are not so, a converted copy (the same
// values: every conversion is exact or the one the kernel would make) in `copies`, which the
// caller keeps until the launch completes on its stream. Typical calls (a float32 table from
// precompute_freqs_cis, contiguous weights) copy nothing.
inline void make_norm_vector_inputs(NormLaunchPlan& plan, at::ScalarType x_dtype,
                                    at::ScalarType table_dtype, c10::Device device,
                                    at::Tensor (&copies)[3]) {
  NormRotaryParams& n = plan.k.n;
  RotaryParams& p = n.rotary;
  const auto opmath = x_dtype == at::kDouble ? at::kDouble : at::kFloat;
  const auto options = at::TensorOptions().device(device);
  auto aligned = [](const void* ptr) {
    return reinterpret_cast<uintptr_t>(ptr) % kChunkBytes == 0;
  };
  const int64_t opmath_size = c10::elementSize(opmath);
  if (table_dtype != opmath || p.table_pair_stride != 2 || p.table_cs_stride != 1 ||
      !aligned(p.table) || p.table_row_stride * opmath_size % kChunkBytes != 0) {
    const at::Tensor table = at::from_blob(
        const_cast<void*>(p.table), {p.table_rows, p.rot_pairs, 2},
        {p.table_row_stride, p.table_pair_stride, p.table_cs_stride}, options.dtype(table_dtype));
    copies[2] = table.to(opmath, /*non_blocking=*/false, /*copy=*/true,
                         at::MemoryFormat::Contiguous);
    p.table = copies[2].data_ptr();
    p.table_row_stride = 2 * p.rot_pairs;
    p.table_pair_stride = 2;
    p.table_cs_stride = 1;
    plan.k.table_double = opmath == at::kDouble;
  }
  for (int o = 0; o < p.num_operands; ++o) {
    const auto dtype = n.weight_float[o] ? at::kFloat : x_dtype;
    // Double x reads double weights: a chunk's two float32 weights are not 16 bytes.
    const auto wanted = x_dtype == at::kDouble ? at::kDouble : dtype;
    if (dtype == wanted && n.weight_stride[o] == 1 && aligned(n.weight[o])) continue;
    const at::Tensor weight = at::from_blob(const_cast<void*>(n.weight[o]),
                                            {p.operands[o].head_dim}, {n.weight_stride[o]},
                                            options.dtype(dtype));
    copies[o] = weight.to(wanted, /*non_blocking=*/false, /*copy=*/true,
                          at::MemoryFormat::Contiguous);
    n.weight[o] = copies[o].data_ptr();
    n.weight_stride[o] = 1;
    n.weight_float[o] = wanted == at::kFloat;
  }
}

// Backward: one zeroed partial weight-gradient buffer [operands, groups, head_dim] (opmath;
// q and k share head_dim), operand o's rows pointed to by plan.k.partial[o]. Keep it alive
// until the launch completes on its stream (the caching allocator's stream semantics see to
// that when it goes out of scope). One buffer: one fill, and one reduction below.
inline at::Tensor make_norm_partials(NormLaunchPlan& plan, at::ScalarType x_dtype,
                                     c10::Device device) {
  const RotaryParams& p = plan.k.n.rotary;
  const auto opmath = x_dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor partials = at::zeros({p.num_operands, plan.k.groups, p.operands[0].head_dim},
                                  at::TensorOptions().dtype(opmath).device(device));
  for (int o = 0; o < p.num_operands; ++o) {
    plan.k.partial[o] = partials[o].data_ptr();
  }
  return partials;
}

// Writes the op's weight gradients (NormRotaryParams::weight_grad): the partials summed over
// groups, in opmath, each copied (rounded once) into its weight's dtype.
inline void write_norm_weight_grads(const NormRotaryParams& n, at::ScalarType x_dtype,
                                    const at::Tensor& partials) {
  const at::Tensor sums = partials.sum(1);
  for (int o = 0; o < n.rotary.num_operands; ++o) {
    const auto dtype = n.weight_float[o] ? at::kFloat : x_dtype;
    at::from_blob(n.weight_grad[o], {sums.size(1)}, sums.options().dtype(dtype))
        .copy_(sums[o]);
  }
}

}  // namespace cuda_kernel
}  // namespace rope_ext
