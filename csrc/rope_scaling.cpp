#include "rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "rope_math.h"

namespace rope_ext {
namespace {

[[noreturn]] void fail(const char* op, const std::string& message) {
  throw std::invalid_argument(std::string(op) + ": " + message);
}

template <typename T>
T need(const char* op, const std::optional<T>& value, const RopeScaling& s, const char* name) {
  if (!value.has_value()) {
    fail(op, "rope_type '" + s.rope_type + "' needs " + name);
  }
  return *value;
}

std::vector<double> default_frequencies(int64_t dim, double theta) {
  std::vector<double> inv(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    inv[i] = inverse_frequency(i, dim, theta);
  }
  return inv;
}

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The pretraining length and the extension factor of yarn and longrope; without a factor,
// the ratio of the model's length to the pretraining one.
std::pair<double, double> extension(const char* op, const RopeScaling& s) {
  const double original = static_cast<double>(
      need(op, s.original_max_position_embeddings, s, "original_max_position_embeddings"));
  const double factor = s.factor.has_value()
      ? *s.factor
      : static_cast<double>(need(op, s.max_position_embeddings, s,
                                 "factor or max_position_embeddings")) / original;
  return {original, factor};
}

Frequencies yarn(const char* op, int64_t dim, double theta, const RopeScaling& s) {
  const auto [original, factor] = extension(op, s);
  double attention = 0.0;
  if (s.attention_factor.has_value()) {
    attention = *s.attention_factor;
  } else if (s.mscale.value_or(0.0) != 0.0 && s.mscale_all_dim.value_or(0.0) != 0.0) {
    attention = yarn_mscale(factor, *s.mscale) / yarn_mscale(factor, *s.mscale_all_dim);
  } else {
    attention = yarn_mscale(factor, 1.0);
  }
  // transformers reads these with `or`: an unset or zero value takes the default.
  const double beta_fast = s.beta_fast.value_or(0.0) != 0.0 ? *s.beta_fast : 32.0;
  const double beta_slow = s.beta_slow.value_or(0.0) != 0.0 ? *s.beta_slow : 1.0;
  const auto correction_dim = [&](double rotations) {
    return (dim * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) {
    high += 0.001;  // as transformers: avoid a zero-width ramp
  }
  Frequencies f{std::vector<double>(dim / 2), attention};
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double extrapolation = inverse_frequency(i, dim, theta);
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // share of the unscaled (extrapolated) frequency
    f.inv_freq[i] = extrapolation / factor * (1.0 - keep) + extrapolation * keep;
  }
  return f;
}

Frequencies longrope(const char* op, int64_t dim, double theta, const RopeScaling& s) {
  const auto [original, factor] = extension(op, s);
  double attention = 1.0;
  if (s.attention_factor.has_value()) {
    attention = *s.attention_factor;
  } else if (factor > 1.0) {
    attention = std::sqrt(1.0 + std::log(factor) / std::log(original));
  }
  const bool long_context = s.seq_len.has_value() && static_cast<double>(*s.seq_len) > original;
  const std::vector<double>& ext = long_context ? s.long_factor : s.short_factor;
  if (static_cast<int64_t>(ext.size()) != dim / 2) {
    std::ostringstream m;
    m << "rope_type 'longrope' needs " << (long_context ? "long_factor" : "short_factor")
      << " with dim / 2 = " << dim / 2 << " values, got " << ext.size();
    fail(op, m.str());
  }
  Frequencies f{std::vector<double>(dim / 2), attention};
  for (int64_t i = 0; i < dim / 2; ++i) {
    f.inv_freq[i] = inverse_frequency(i, dim, theta) / ext[i];
  }
  return f;
}

Frequencies llama3(const char* op, int64_t dim, double theta, const RopeScaling& s) {
  const double factor = need(op, s.factor, s, "factor");
  const double original = static_cast<double>(
      need(op, s.original_max_position_embeddings, s, "original_max_position_embeddings"));
  const double low_wavelen = original / s.low_freq_factor;
  const double high_wavelen = original / s.high_freq_factor;
  Frequencies f{default_frequencies(dim, theta), 1.0};
  for (double& inv : f.inv_freq) {
    const double wavelen = 2 * M_PI / inv;
    if (wavelen > low_wavelen) {
      inv /= factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (original / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      inv = (1 - smooth) * inv / factor + smooth * inv;
    }
  }
  return f;
}

}  // namespace

Frequencies rope_frequencies(const char* op, int64_t dim, double theta, const RopeScaling& s) {
  const std::string& type = s.rope_type;
  if (type == "default") {
    return {default_frequencies(dim, theta), 1.0};
  }
  if (type == "linear") {
    Frequencies f{default_frequencies(dim, theta), 1.0};
    const double factor = need(op, s.factor, s, "factor");
    for (double& inv : f.inv_freq) {
      inv /= factor;
    }
    return f;
  }
  if (type == "dynamic") {
    const double factor = need(op, s.factor, s, "factor");
    const double max_pos = static_cast<double>(
        need(op, s.max_position_embeddings, s, "max_position_embeddings"));
    const double seq = std::max(static_cast<double>(s.seq_len.value_or(0)), max_pos);
    const double base = theta * std::pow(factor * seq / max_pos - (factor - 1),
                                         static_cast<double>(dim) / (dim - 2));
    return {default_frequencies(dim, base), 1.0};
  }
  if (type == "yarn") {
    return yarn(op, dim, theta, s);
  }
  if (type == "longrope") {
    return longrope(op, dim, theta, s);
  }
  if (type == "llama3") {
    return llama3(op, dim, theta, s);
  }
  if (type == "proportional") {
    // dim is the head dim; the first partial_rotary_factor of it rotates, the rest gets a
    // zero frequency (cos 1, sin 0), all with exponents over the whole head dim.
    const int64_t rotated = static_cast<int64_t>(s.partial_rotary_factor * dim) / 2;
    Frequencies f{std::vector<double>(dim / 2, 0.0), 1.0};
    const double factor = s.factor.value_or(1.0);
    for (int64_t i = 0; i < std::min(rotated, dim / 2); ++i) {
      f.inv_freq[i] = inverse_frequency(i, dim, theta) / factor;
    }
    return f;
  }
  fail(op, "rope_type must be one of default, linear, dynamic, yarn, longrope, llama3, "
           "proportional, got '" + type + "'");
}

}  // namespace rope_ext
