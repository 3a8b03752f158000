// The CUDA kernels emulated on the host, for tests (rope_cuda_emulate.cpp). While
// torch.ops.rope_ext._cuda_emulation(sm_count > 0, ...) is in force, the CPU backend hands its
// launches here.
#pragma once

#include <ATen/core/Tensor.h>

#include "../kv_cache.h"
#include "../qk_norm.h"

namespace rope_ext {
namespace cuda_emulation {

bool active();
void launch(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
void fill_freqs_cis(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude);
void launch_norm(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                 at::ScalarType table_dtype);
void launch_kv_cache(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);

}  // namespace cuda_emulation
}  // namespace rope_ext
