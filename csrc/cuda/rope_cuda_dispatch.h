// Which instantiation of the rotary thread function a call runs: element and table types,
// pairing, vector or scalar path, MRoPE or not, 32- or 64-bit offsets. Shared by the CUDA
// launcher and its host emulation, so that both pick the same kernel for the same call.
#pragma once

#include <ATen/Dispatch.h>

#include <type_traits>

#include "kv_cache_cuda_kernel.h"
#include "rope_cuda_kernel.h"

namespace rope_ext {
namespace cuda_kernel {

template <typename F>
void with_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls Run<scalar_t, table_t, kInterleaved, kVector, kMrope, index_t>::run(p, args...)
// for the kernel that serves p (x_dtype, table_dtype: the types behind its pointers).
template <template <typename, typename, bool, bool, bool, typename> class Run,
          typename... Args>
void dispatch_rotary(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
                     Args&... args) {
  const size_t elem = c10::elementSize(x_dtype);
  const bool vector = use_vector_path(p, elem, c10::elementSize(table_dtype));
  const bool wide = largest_offset(p) > INT32_MAX;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_cuda", [&] {
    using row_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_cuda_table", [&] {
      using table_t = scalar_t;
      with_bool(p.interleaved, [&](auto interleaved) {
        with_bool(vector, [&](auto vec) {
          with_bool(p.mrope_axes > 0, [&](auto mrope) {
            with_bool(wide, [&](auto wide_index) {
              using index_t = std::conditional_t<decltype(wide_index)::value, int64_t, int32_t>;
              Run<row_t, table_t, decltype(interleaved)::value, decltype(vec)::value,
                  decltype(mrope)::value, index_t>::run(p, args...);
            });
          });
        });
      });
    });
  });
}

// Calls Run<scalar_t, table_t, kInterleaved, kVector, index_t>::run(p, args...) for the
// fused KV-cache kernel that serves p (x_dtype: its rows' type; table_dtype: the table's).
template <template <typename, typename, bool, bool, typename> class Run, typename... Args>
void dispatch_kv_cache(const KvCacheParams& p, at::ScalarType x_dtype,
                       at::ScalarType table_dtype, Args&... args) {
  const KvLaunchPlan plan = plan_kv_cache(p, c10::elementSize(x_dtype),
                                          c10::elementSize(table_dtype), 1, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_cuda_kv", [&] {
    using row_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_cuda_kv_table", [&] {
      using table_t = scalar_t;
      with_bool(p.rot.interleaved, [&](auto interleaved) {
        with_bool(plan.vector, [&](auto vec) {
          with_bool(plan.wide_index, [&](auto wide_index) {
            using index_t = std::conditional_t<decltype(wide_index)::value, int64_t, int32_t>;
            Run<row_t, table_t, decltype(interleaved)::value, decltype(vec)::value,
                index_t>::run(p, args...);
          });
        });
      });
    });
  });
}

}  // namespace cuda_kernel
}  // namespace rope_ext
