// The bodies of the fused RMSNorm + RoPE ops (schemas in rope_ops.cpp, arithmetic in
// qk_norm.h), shared by every backend as rope_backend.h's are: validate, allocate, fill the
// parameter struct, launch. A backend supplies a NormBackend and registers these functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <tuple>

#include "qk_norm.h"
#include "rope_backend.h"

namespace rope_ext {

struct NormBackend {
  // Runs the forward (backward = false) or backward pass described by p; x_dtype / table_dtype
  // are the element types behind the operand and table pointers.
  void (*launch)(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                 at::ScalarType table_dtype, c10::Device device);
};

namespace detail {

inline int64_t check_norm_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& q_weight, const at::Tensor& k_weight,
                               const at::Tensor& table,
                               const std::optional<at::Tensor>& positions, int64_t offset,
                               int64_t seq_dim, double eps, at::OptionalIntArrayRef mrope_section,
                               bool mrope_interleaved) {
  const int64_t sd = check_qk_args(op, q, k, table, positions, offset, seq_dim, mrope_section,
                                   mrope_interleaved);
  check_norm_weight(op, "q_weight", q_weight, "q", q);
  check_norm_weight(op, "k_weight", k_weight, "k", k);
  check_norm_eps(op, eps);
  return sd;
}

// One operand of a fused call: its rows (x, written to out), norm weight and, in backward,
// the forward's input (laid out as x) and the weight gradient.
struct NormOperand {
  const at::Tensor& x;
  const at::Tensor& out;
  const at::Tensor& weight;
  const at::Tensor* input;        // backward only
  const at::Tensor* weight_grad;  // backward only
};

// Launches the rows of `operands` (one or two, of one dtype) in one kernel.
inline void norm_launch(const NormBackend& n, const char* op,
                        std::initializer_list<NormOperand> operands, const at::Tensor& table,
                        const std::optional<at::Tensor>& positions, int64_t offset,
                        int64_t seq_dim, bool interleaved, double eps, double weight_offset,
                        at::OptionalIntArrayRef mrope_section, bool mrope_interleaved,
                        bool backward) {
  NormRotaryParams p{};
  // Backward rotates the incoming gradient back: the inverse rotation.
  p.rotary = make_params(table, positions, offset, interleaved, /*inverse=*/backward,
                         mrope_section, mrope_interleaved);
  p.eps = eps;
  p.weight_offset = weight_offset;
  for (const NormOperand& o : operands) {
    const int before = p.rotary.num_operands;
    add_operand(op, p.rotary, o.x, o.out, positions, seq_dim);
    if (p.rotary.num_operands == before) {
      if (backward) {
        o.weight_grad->zero_();  // no rows: the backend never sees this operand
      }
      continue;
    }
    p.weight[before] = o.weight.data_ptr();
    p.weight_stride[before] = o.weight.stride(0);
    p.weight_float[before] = o.weight.scalar_type() == at::kFloat;
    if (backward) {
      p.input[before] = o.input->data_ptr();
      p.weight_grad[before] = o.weight_grad->data_ptr();
    }
  }
  if (p.rotary.num_operands > 0) {
    n.launch(p, backward, operands.begin()->x.scalar_type(),
             c10::toRealValueType(table.scalar_type()), operands.begin()->x.device());
  }
}

// q and k in one launch when they share a dtype, else one each.
inline void norm_launch_qk(const NormBackend& n, const char* op,
                           const NormOperand& q, const NormOperand& k, const at::Tensor& table,
                           const std::optional<at::Tensor>& positions, int64_t offset,
                           int64_t seq_dim, bool interleaved, double eps, double weight_offset,
                           at::OptionalIntArrayRef mrope_section, bool mrope_interleaved,
                           bool backward) {
  if (q.x.scalar_type() == k.x.scalar_type()) {
    norm_launch(n, op, {q, k}, table, positions, offset, seq_dim, interleaved, eps,
                weight_offset, mrope_section, mrope_interleaved, backward);
    return;
  }
  for (const NormOperand* o : {&q, &k}) {
    norm_launch(n, op, {*o}, table, positions, offset, seq_dim, interleaved, eps,
                weight_offset, mrope_section, mrope_interleaved, backward);
  }
}

}  // namespace detail

template <const Backend& B, const NormBackend& N>
std::tuple<at::Tensor, at::Tensor> rms_norm_rotary_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
    const at::Tensor& k_weight, const at::Tensor& freqs_cis,
    const std::optional<at::Tensor>& positions, c10::SymInt offset, int64_t seq_dim,
    bool interleaved, double eps, double weight_offset, at::OptionalIntArrayRef mrope_section,
    bool mrope_interleaved) {
  constexpr const char* op = "rms_norm_rotary_qk";
  const int64_t off = offset.expect_int();
  const int64_t sd = detail::check_norm_args(op, q, k, q_weight, k_weight, freqs_cis, positions,
                                             off, seq_dim, eps, mrope_section, mrope_interleaved);
  detail::check_positions(B, op, positions, off, freqs_cis);
  at::Tensor q_out = at::empty_like(q);
  at::Tensor k_out = at::empty_like(k);
  detail::norm_launch_qk(N, op, {q, q_out, q_weight, nullptr, nullptr},
                         {k, k_out, k_weight, nullptr, nullptr}, freqs_cis, positions, off, sd,
                         interleaved, eps, weight_offset, mrope_section, mrope_interleaved,
                         /*backward=*/false);
  return {q_out, k_out};
}

template <const Backend& B, const NormBackend& N>
void rms_norm_rotary_qk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                         const at::Tensor& k_weight, const at::Tensor& freqs_cis,
                         const std::optional<at::Tensor>& positions, c10::SymInt offset,
                         int64_t seq_dim, bool interleaved, double eps, double weight_offset,
                         at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  constexpr const char* op = "rms_norm_rotary_qk_";
  const int64_t off = offset.expect_int();
  const int64_t sd = detail::check_norm_args(op, q, k, q_weight, k_weight, freqs_cis, positions,
                                             off, seq_dim, eps, mrope_section, mrope_interleaved);
  check_inplace_target(op, "q", q);
  check_inplace_target(op, "k", k);
  check_qk_disjoint(op, q, k);
  detail::check_positions(B, op, positions, off, freqs_cis);
  detail::norm_launch_qk(N, op, {q, q, q_weight, nullptr, nullptr},
                         {k, k, k_weight, nullptr, nullptr}, freqs_cis, positions, off, sd,
                         interleaved, eps, weight_offset, mrope_section, mrope_interleaved,
                         /*backward=*/false);
}

// The gradient and the input of one operand with the same strides, as the backward kernel
// reads them: as they are when they agree, else both made contiguous.
inline std::pair<at::Tensor, at::Tensor> same_layout(const at::Tensor& grad,
                                                     const at::Tensor& x) {
  if (grad.strides() == x.strides()) {
    return {grad, x};
  }
  return {grad.contiguous(), x.contiguous()};
}

template <const Backend& B, const NormBackend& N>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rms_norm_rotary_qk_backward(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
    const at::Tensor& freqs_cis, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, int64_t seq_dim, bool interleaved, double eps, double weight_offset,
    at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  constexpr const char* op = "rms_norm_rotary_qk_backward";
  const int64_t off = offset.expect_int();
  const int64_t sd = detail::check_norm_args(op, q, k, q_weight, k_weight, freqs_cis, positions,
                                             off, seq_dim, eps, mrope_section, mrope_interleaved);
  TORCH_CHECK_VALUE(grad_q.sizes() == q.sizes() && grad_k.sizes() == k.sizes(), op,
                    ": grad_q and grad_k must have the shapes of q and k, ", q.sizes(), " and ",
                    k.sizes(), ", got ", grad_q.sizes(), " and ", grad_k.sizes());
  TORCH_CHECK_TYPE(grad_q.scalar_type() == q.scalar_type() &&
                       grad_k.scalar_type() == k.scalar_type(),
                   op, ": grad_q and grad_k must have the dtypes of q and k, ", q.scalar_type(),
                   " and ", k.scalar_type(), ", got ", grad_q.scalar_type(), " and ",
                   grad_k.scalar_type());
  detail::check_positions(B, op, positions, off, freqs_cis);
  const auto [gq, xq] = same_layout(grad_q, q);
  const auto [gk, xk] = same_layout(grad_k, k);
  at::Tensor dq = at::empty_like(xq);
  at::Tensor dk = at::empty_like(xk);
  // Summed in float32 (float64 for float64 rows) and rounded once to the weight's dtype by
  // the backend, which writes every element (no fill, no conversion afterwards: each would
  // be a kernel launch, and a decode-sized backward is all launches).
  at::Tensor dwq = at::empty({q_weight.size(0)}, q_weight.options());
  at::Tensor dwk = at::empty({k_weight.size(0)}, k_weight.options());
  detail::norm_launch_qk(N, op, {gq, dq, q_weight, &xq, &dwq}, {gk, dk, k_weight, &xk, &dwk},
                         freqs_cis, positions, off, sd, interleaved, eps, weight_offset,
                         mrope_section, mrope_interleaved, /*backward=*/true);
  return {dq, dk, dwq, dwk};
}

}  // namespace rope_ext
