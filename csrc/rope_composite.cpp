// Ops built from other ops, the same on every device.
#include <ATen/ops/empty.h>
#include <ATen/Version.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>

#include "rope_build.h"
#include "rope_checks.h"
#include "rope_scaling.h"

namespace rope_ext {
namespace {

using OptionalArray = std::optional<c10::ArrayRef<double>>;

RopeScaling scaling_of(std::string_view rope_type, std::optional<double> factor,
                       std::optional<int64_t> original_max_position_embeddings,
                       std::optional<int64_t> max_position_embeddings,
                       std::optional<int64_t> seq_len, double low_freq_factor,
                       double high_freq_factor, std::optional<double> beta_fast,
                       std::optional<double> beta_slow, std::optional<double> mscale,
                       std::optional<double> mscale_all_dim,
                       std::optional<double> attention_factor, bool truncate,
                       OptionalArray long_factor, OptionalArray short_factor,
                       double partial_rotary_factor) {
  RopeScaling s;
  s.rope_type = std::string(rope_type);
  s.factor = factor;
  s.original_max_position_embeddings = original_max_position_embeddings;
  s.max_position_embeddings = max_position_embeddings;
  s.seq_len = seq_len;
  s.low_freq_factor = low_freq_factor;
  s.high_freq_factor = high_freq_factor;
  s.beta_fast = beta_fast;
  s.beta_slow = beta_slow;
  s.mscale = mscale;
  s.mscale_all_dim = mscale_all_dim;
  s.attention_factor = attention_factor;
  s.truncate = truncate;
  if (long_factor.has_value()) {
    s.long_factor.assign(long_factor->begin(), long_factor->end());
  }
  if (short_factor.has_value()) {
    s.short_factor.assign(short_factor->begin(), short_factor->end());
  }
  s.partial_rotary_factor = partial_rotary_factor;
  return s;
}

Frequencies frequencies(const char* op, int64_t dim, double theta, const RopeScaling& s) {
  TORCH_CHECK_VALUE(dim >= 2, op, ": dim must be >= 2, got ", dim);
  TORCH_CHECK_VALUE(theta > 0, op, ": theta must be > 0, got ", theta);
  try {
    return rope_frequencies(op, dim, theta, s);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

#define ROPE_EXT_SCALING_PARAMS                                                               \
  std::string_view rope_type, std::optional<double> factor,                                   \
      std::optional<int64_t> original_max_position_embeddings,                                \
      std::optional<int64_t> max_position_embeddings, std::optional<int64_t> seq_len,         \
      double low_freq_factor, double high_freq_factor, std::optional<double> beta_fast,       \
      std::optional<double> beta_slow, std::optional<double> mscale,                          \
      std::optional<double> mscale_all_dim, std::optional<double> attention_factor,           \
      bool truncate, OptionalArray long_factor, OptionalArray short_factor,                   \
      double partial_rotary_factor
#define ROPE_EXT_SCALING_VALUES                                                               \
  rope_type, factor, original_max_position_embeddings, max_position_embeddings, seq_len,      \
      low_freq_factor, high_freq_factor, beta_fast, beta_slow, mscale, mscale_all_dim,        \
      attention_factor, truncate, long_factor, short_factor, partial_rotary_factor

// The inverse frequencies as a float64 CPU tensor.
at::Tensor inv_freq_tensor(const Frequencies& f) {
  at::Tensor inv = at::empty({static_cast<int64_t>(f.inv_freq.size())}, at::kDouble);
  std::copy(f.inv_freq.begin(), f.inv_freq.end(), inv.data_ptr<double>());
  return inv;
}

std::tuple<at::Tensor, double> rope_frequencies_op(int64_t dim, double theta,
                                                   ROPE_EXT_SCALING_PARAMS) {
  const Frequencies f = frequencies("rope_frequencies", dim, theta,
                                    scaling_of(ROPE_EXT_SCALING_VALUES));
  return {inv_freq_tensor(f), f.attention_factor};
}

at::Tensor precompute_freqs_cis(int64_t dim, int64_t end, double theta,
                                std::optional<at::ScalarType> dtype,
                                std::optional<at::Device> device, ROPE_EXT_SCALING_PARAMS) {
  constexpr const char* op = "precompute_freqs_cis";
  const at::ScalarType t = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble, op,
                   ": dtype must be float32 or float64, got ", t);
  TORCH_CHECK_VALUE(dim >= 2, op, ": dim must be >= 2, got ", dim);
  TORCH_CHECK_VALUE(end >= 0, op, ": end must be >= 0, got ", end);
  const Frequencies f = frequencies(op, dim, theta, scaling_of(ROPE_EXT_SCALING_VALUES));
  const auto options = at::TensorOptions().device(device.value_or(at::kCPU));
  at::Tensor out = at::empty({end, dim / 2, 2}, options.dtype(t));
  static const auto fill = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("rope_ext::fill_freqs_cis_", "")
                               .typed<void(const at::Tensor&, const at::Tensor&, double)>();
  fill.call(out, inv_freq_tensor(f).to(options.device()), f.attention_factor);
  return out;
}

std::string build_info() {
  std::ostringstream s;
  s << "cpu_kernel=" << cpu_kernel_name() << "\n";
  s << "cpu_streaming_threshold=" << cpu_streaming_threshold() << "\n";
  s << "torch_cpu_capability=" << at::get_cpu_capability() << "\n";
  s << "cuda=" << (cuda_archs().empty() ? "no" : "yes") << "\n";
  s << "cuda_archs=" << cuda_archs() << "\n";
  return s.str();
}

void check_inplace(std::string_view op, at::TensorList targets) {
  check_inplace_call(std::string(op).c_str(), targets);
}

}  // namespace

TORCH_LIBRARY_IMPL(rope_ext, CompositeExplicitAutograd, m) {
  m.impl("precompute_freqs_cis", &precompute_freqs_cis);
  m.impl("rope_frequencies", &rope_frequencies_op);
  m.impl("build_info", &build_info);
  m.impl("check_inplace", &check_inplace);
}

}  // namespace rope_ext
