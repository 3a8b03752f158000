// Inverse frequencies and attention factor of the RoPE scaling variants that Hugging Face
// transformers configs name (rope_parameters / rope_scaling), computed in float64 on the host.
// Plain C++: the precompute ops of every backend call it, then fill the table on their device.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rope_ext {

struct RopeScaling {
  std::string rope_type = "default";  // default linear dynamic yarn longrope llama3 proportional
  std::optional<double> factor;
  std::optional<int64_t> original_max_position_embeddings;
  std::optional<int64_t> max_position_embeddings;  // the model's (dynamic, longrope, yarn)
  std::optional<int64_t> seq_len;                  // current length (dynamic, longrope)
  double low_freq_factor = 1.0;                    // llama3
  double high_freq_factor = 4.0;                   // llama3
  std::optional<double> beta_fast;                 // yarn
  std::optional<double> beta_slow;                 // yarn
  std::optional<double> mscale;                    // yarn
  std::optional<double> mscale_all_dim;            // yarn
  std::optional<double> attention_factor;          // yarn, longrope
  bool truncate = true;                            // yarn
  std::vector<double> long_factor;                 // longrope
  std::vector<double> short_factor;                // longrope
  double partial_rotary_factor = 1.0;              // proportional
};

struct Frequencies {
  std::vector<double> inv_freq;  // dim / 2 values
  double attention_factor;       // scales cos and sin (the table entries' magnitude)
};

// Throws std::invalid_argument naming the missing or bad parameter.
Frequencies rope_frequencies(const char* op, int64_t dim, double theta, const RopeScaling& s);

}  // namespace rope_ext
