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

// Calls Run<scalar_t, kInterleaved, kVector, kBackward>::run(p, args...) for the kernel that
// serves p. The table's element type and MRoPE are runtime branches (uniform per launch): a
// template parameter each would double the kernels for little.
template <template <typename, bool, bool, bool> class Run, typename... Args>
void dispatch_norm(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                   Args&... args) {
  const bool vector = norm_vector_path(p, c10::elementSize(x_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_norm_cuda", [&] {
    with_bool(p.rotary.interleaved, [&](auto interleaved) {
      with_bool(vector, [&](auto vec) {
        with_bool(backward, [&](auto bwd) {
          Run<scalar_t, decltype(interleaved)::value, decltype(vec)::value,
              decltype(bwd)::value>::run(p, args...);
        });
      });
    });
  });
}

// Backward: a zeroed partial weight-gradient buffer [groups, head_dim] per operand (opmath),
// pointed to by plan.k.partial; keep the tensors alive until the launch completes on its
// stream (the caching allocator's stream semantics see to that when they go out of scope).
inline void make_norm_partials(NormLaunchPlan& plan, at::ScalarType x_dtype, c10::Device device,
                               at::Tensor (&partials)[2]) {
  const RotaryParams& p = plan.k.n.rotary;
  const auto opmath = x_dtype == at::kDouble ? at::kDouble : at::kFloat;
  for (int o = 0; o < p.num_operands; ++o) {
    partials[o] = at::zeros({plan.k.groups, p.operands[o].head_dim},
                            at::TensorOptions().dtype(opmath).device(device));
    plan.k.partial[o] = partials[o].data_ptr();
  }
}

// Adds the partials, summed over groups, into the op's weight gradients.
inline void add_norm_partials(const NormRotaryParams& n, const at::Tensor (&partials)[2]) {
  for (int o = 0; o < n.rotary.num_operands; ++o) {
    at::from_blob(n.weight_grad[o], {partials[o].size(1)}, partials[o].options())
        .add_(partials[o].sum(0));
  }
}

}  // namespace cuda_kernel
}  // namespace rope_ext
