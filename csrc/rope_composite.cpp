// Ops built from other ops, the same on every device.
#include <ATen/ops/empty.h>
#include <ATen/Version.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <sstream>
#include <string>

#include "rope_build.h"

namespace rope_ext {
namespace {

at::Tensor precompute_freqs_cis(int64_t dim, int64_t end, double theta,
                                std::optional<at::ScalarType> dtype,
                                std::optional<at::Device> device) {
  constexpr const char* op = "precompute_freqs_cis";
  const at::ScalarType t = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble, op,
                   ": dtype must be float32 or float64, got ", t);
  TORCH_CHECK_VALUE(dim >= 2, op, ": dim must be >= 2, got ", dim);
  TORCH_CHECK_VALUE(end >= 0, op, ": end must be >= 0, got ", end);
  TORCH_CHECK_VALUE(theta > 0, op, ": theta must be > 0, got ", theta);
  at::Tensor out = at::empty({end, dim / 2, 2},
                             at::TensorOptions().dtype(t).device(device.value_or(at::kCPU)));
  static const auto fill = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("rope_ext::fill_freqs_cis_", "")
                               .typed<void(const at::Tensor&, int64_t, double)>();
  fill.call(out, dim, theta);
  return out;
}

std::string build_info() {
  std::ostringstream s;
  s << "cpu_kernel=" << cpu_kernel_name() << "\n";
  s << "torch_cpu_capability=" << at::get_cpu_capability() << "\n";
  s << "cuda=" << (cuda_archs().empty() ? "no" : "yes") << "\n";
  s << "cuda_archs=" << cuda_archs() << "\n";
  return s.str();
}

}  // namespace

TORCH_LIBRARY_IMPL(rope_ext, CompositeExplicitAutograd, m) {
  m.impl("precompute_freqs_cis", &precompute_freqs_cis);
  m.impl("build_info", &build_info);
}

}  // namespace rope_ext
