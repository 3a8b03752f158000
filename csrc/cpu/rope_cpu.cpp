// CPU implementations of the rope_ext ops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/aminmax.h>
#include <torch/library.h>

#include <string>

#include "../rope_backend.h"
#include "../rope_build.h"
#include "rope_cpu_kernel.h"

namespace rope_ext {
namespace cpu {
namespace {

struct KernelChoice {
  RotaryKernel kernel;
  const char* name;
};

// The widest kernel this build holds that both this processor and torch's own choice allow
// (torch honours ATEN_CPU_CAPABILITY=default|avx2|avx512, and so does rope_ext).
KernelChoice choose_kernel() {
#if defined(ROPE_EXT_HAVE_AVX512)
  const std::string torch_choice = at::get_cpu_capability();
  if (torch_choice == "AVX512" && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return {AVX512::rotary_kernel, "AVX512"};
  }
#endif
#if defined(ROPE_EXT_HAVE_AVX2)
  const std::string choice = at::get_cpu_capability();
  if ((choice == "AVX2" || choice == "AVX512") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return {AVX2::rotary_kernel, "AVX2"};
  }
#endif
  return {DEFAULT::rotary_kernel, "DEFAULT"};
}

const KernelChoice& kernel_choice() {
  static const KernelChoice choice = choose_kernel();
  return choice;
}

void launch(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
            c10::Device) {
  kernel_choice().kernel(p, x_dtype, table_dtype);
}

void check_positions(const char* op, const at::Tensor& positions, int64_t offset,
                     int64_t rows) {
  const auto [lo, hi] = at::aminmax(positions);
  const int64_t first = lo.item<int64_t>() + offset;
  const int64_t last = hi.item<int64_t>() + offset;
  TORCH_CHECK_INDEX(
      first >= 0 && last < rows, op, ": offset + positions must lie in [0, ", rows,
      ") (the rows of freqs_cis), got values in [", first, ", ", last, "]");
}

void fill_freqs_cis(const at::Tensor& out, int64_t dim, double theta) {
  const int64_t end = out.size(0);
  const int64_t pairs = out.size(1);
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "rope_ext_fill_freqs_cis", [&] {
    auto* data = out.data_ptr<scalar_t>();
    const int64_t row_stride = out.stride(0), pair_stride = out.stride(1),
                  cs_stride = out.stride(2);
    std::vector<double> inv_freq(pairs);
    for (int64_t i = 0; i < pairs; ++i) {
      inv_freq[i] = inverse_frequency(i, dim, theta);
    }
    at::parallel_for(0, end, std::max<int64_t>(1, 4096 / pairs), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        for (int64_t i = 0; i < pairs; ++i) {
          double c, s;
          table_entry(t, inv_freq[i], c, s);
          scalar_t* entry = data + t * row_stride + i * pair_stride;
          entry[0] = static_cast<scalar_t>(c);
          entry[cs_stride] = static_cast<scalar_t>(s);
        }
      }
    });
  });
}

constexpr Backend kCpu{&launch, &check_positions, &fill_freqs_cis};

}  // namespace
}  // namespace cpu

const char* cpu_kernel_name() {
  return cpu::kernel_choice().name;
}

TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  m.impl("fill_freqs_cis_", &fill_freqs_cis_<cpu::kCpu>);
  m.impl("apply_rotary", &apply_rotary<cpu::kCpu>);
  m.impl("apply_rotary_", &apply_rotary_<cpu::kCpu>);
  m.impl("apply_rotary_qk", &apply_rotary_qk<cpu::kCpu>);
  m.impl("apply_rotary_qk_", &apply_rotary_qk_<cpu::kCpu>);
}

}  // namespace rope_ext
