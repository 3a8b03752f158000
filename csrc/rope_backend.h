// The op bodies every backend shares: validate, allocate, fill the parameter struct, launch.
// A backend (cpu/rope_cpu.cpp, cuda/rope_cuda.cu) supplies a Backend with its launcher and
// registers these functions with TORCH_LIBRARY_IMPL.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <tuple>

#include "rope_checks.h"

namespace rope_ext {

struct Backend {
  // Runs the rotation described by p; x_dtype / table_dtype are the element types behind
  // the operand and table pointers, device the tensors' device.
  void (*launch)(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
                 c10::Device device);
  // Rejects positions outside [0, rows) before anything is written, where the backend can
  // read them without a device synchronisation; nullptr where the kernel asserts instead.
  void (*check_positions)(const char* op, const at::Tensor& positions, int64_t offset,
                          int64_t rows);
  // Fills out [end, R/2, 2] with magnitude * (cos, sin) of position * inv_freq[i].
  void (*fill_freqs_cis)(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude);
};

namespace detail {

inline void check_positions(const Backend& b, const char* op,
                            const std::optional<at::Tensor>& positions, int64_t offset,
                            const at::Tensor& table) {
  if (positions.has_value() && positions->numel() > 0 && b.check_positions != nullptr) {
    b.check_positions(op, *positions, offset, table.size(0));
  }
}

inline void rotate(const Backend& b, const char* op, const at::Tensor& x, const at::Tensor& out,
                   const at::Tensor& table, const std::optional<at::Tensor>& positions,
                   int64_t offset, int64_t seq_dim, bool interleaved, bool inverse,
                   at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  RotaryParams p = make_params(table, positions, offset, interleaved, inverse, mrope_section,
                               mrope_interleaved);
  add_operand(op, p, x, out, positions, seq_dim);
  if (p.num_operands > 0) {
    b.launch(p, x.scalar_type(), c10::toRealValueType(table.scalar_type()), x.device());
  }
}

inline void rotate_qk(const Backend& b, const char* op, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& q_out, const at::Tensor& k_out,
                      const at::Tensor& table, const std::optional<at::Tensor>& positions,
                      int64_t offset, int64_t seq_dim, bool interleaved, bool inverse,
                      at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  RotaryParams p = make_params(table, positions, offset, interleaved, inverse, mrope_section,
                               mrope_interleaved);
  if (q.scalar_type() == k.scalar_type()) {
    add_operand(op, p, q, q_out, positions, seq_dim);
    add_operand(op, p, k, k_out, positions, seq_dim);
    if (p.num_operands > 0) {
      b.launch(p, q.scalar_type(), c10::toRealValueType(table.scalar_type()), q.device());
    }
    return;
  }
  // One kernel handles one element type; q and k of different dtypes take two launches.
  rotate(b, op, q, q_out, table, positions, offset, seq_dim, interleaved, inverse, mrope_section,
         mrope_interleaved);
  rotate(b, op, k, k_out, table, positions, offset, seq_dim, interleaved, inverse, mrope_section,
         mrope_interleaved);
}

inline int64_t check_qk_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& table,
                             const std::optional<at::Tensor>& positions, int64_t offset,
                             int64_t seq_dim, at::OptionalIntArrayRef mrope_section,
                             bool mrope_interleaved) {
  const int64_t sd = check_apply_args(op, "q", q, table, positions, offset, seq_dim,
                                      mrope_section, mrope_interleaved);
  check_apply_args(op, "k", k, table, positions, offset, seq_dim, mrope_section,
                   mrope_interleaved);
  check_qk_pair(op, q, k, sd);
  return sd;
}

}  // namespace detail

template <const Backend& B>
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& freqs_cis,
                        const std::optional<at::Tensor>& positions, c10::SymInt offset,
                        int64_t seq_dim, bool interleaved, bool inverse,
                        at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  constexpr const char* op = "apply_rotary";
  const int64_t off = offset.expect_int();
  const int64_t sd = check_apply_args(op, "x", x, freqs_cis, positions, off, seq_dim,
                                      mrope_section, mrope_interleaved);
  detail::check_positions(B, op, positions, off, freqs_cis);
  at::Tensor out = at::empty_like(x);
  detail::rotate(B, op, x, out, freqs_cis, positions, off, sd, interleaved, inverse,
                 mrope_section, mrope_interleaved);
  return out;
}

template <const Backend& B>
void apply_rotary_(const at::Tensor& x, const at::Tensor& freqs_cis,
                   const std::optional<at::Tensor>& positions, c10::SymInt offset,
                   int64_t seq_dim, bool interleaved, bool inverse,
                   at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  constexpr const char* op = "apply_rotary_";
  const int64_t off = offset.expect_int();
  const int64_t sd = check_apply_args(op, "x", x, freqs_cis, positions, off, seq_dim,
                                      mrope_section, mrope_interleaved);
  check_inplace_target(op, "x", x);
  detail::check_positions(B, op, positions, off, freqs_cis);
  detail::rotate(B, op, x, x, freqs_cis, positions, off, sd, interleaved, inverse,
                 mrope_section, mrope_interleaved);
}

template <const Backend& B>
std::tuple<at::Tensor, at::Tensor> apply_rotary_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs_cis,
    const std::optional<at::Tensor>& positions, c10::SymInt offset, int64_t seq_dim,
    bool interleaved, bool inverse, at::OptionalIntArrayRef mrope_section,
    bool mrope_interleaved) {
  constexpr const char* op = "apply_rotary_qk";
  const int64_t off = offset.expect_int();
  const int64_t sd = detail::check_qk_args(op, q, k, freqs_cis, positions, off, seq_dim,
                                              mrope_section, mrope_interleaved);
  detail::check_positions(B, op, positions, off, freqs_cis);
  at::Tensor q_out = at::empty_like(q);
  at::Tensor k_out = at::empty_like(k);
  detail::rotate_qk(B, op, q, k, q_out, k_out, freqs_cis, positions, off, sd, interleaved,
                    inverse, mrope_section, mrope_interleaved);
  return {q_out, k_out};
}

template <const Backend& B>
void apply_rotary_qk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs_cis,
                      const std::optional<at::Tensor>& positions, c10::SymInt offset,
                      int64_t seq_dim, bool interleaved, bool inverse,
                      at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  constexpr const char* op = "apply_rotary_qk_";
  const int64_t off = offset.expect_int();
  const int64_t sd = detail::check_qk_args(op, q, k, freqs_cis, positions, off, seq_dim,
                                              mrope_section, mrope_interleaved);
  check_inplace_target(op, "q", q);
  check_inplace_target(op, "k", k);
  check_qk_disjoint(op, q, k);
  detail::check_positions(B, op, positions, off, freqs_cis);
  detail::rotate_qk(B, op, q, k, q, k, freqs_cis, positions, off, sd, interleaved, inverse,
                    mrope_section, mrope_interleaved);
}

template <const Backend& B>
void fill_freqs_cis_(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude) {
  check_freqs_table("fill_freqs_cis_", out, inv_freq);
  if (out.numel() > 0) {
    B.fill_freqs_cis(out, inv_freq.contiguous(), magnitude);
  }
}

}  // namespace rope_ext
