// Autograd of the fused RMSNorm + RoPE ops (qk_norm_ops.h), as rope_autograd.cpp's: a C++
// autograd Function. The backward op recomputes each row's RMS scale from the saved input,
// so nothing beyond the inputs is kept. The table's gradient, when it needs one, is
// rotary_table_grad's of the normalised rows, recovered by rotating the outputs back.
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "autograd_common.h"
#include "qk_norm_ops.h"

namespace rope_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using autograd::ApplySig;
using autograd::find_op;
using autograd::Mrope;
using autograd::NormInplaceSig;
using autograd::NormSig;
using autograd::optional_tensor;
using autograd::TableGradSig;
using NormBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    c10::SymInt, int64_t, bool, double, double, Mrope, bool);
// The non-tensor arguments of a fused call, kept in the autograd context.
struct NormArgs : autograd::PlacementArgs {
  double eps;
  double weight_offset;

  NormArgs(PlacementArgs placement, double eps, double weight_offset)
      : PlacementArgs(std::move(placement)), eps(eps), weight_offset(weight_offset) {}

  void save(AutogradContext* ctx) const {
    PlacementArgs::save(ctx);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["weight_offset"] = weight_offset;
  }
  static NormArgs load(AutogradContext* ctx) {
    return {PlacementArgs::load(ctx), ctx->saved_data["eps"].toDouble(),
            ctx->saved_data["weight_offset"].toDouble()};
  }
};

NormArgs make_args(c10::SymInt offset, int64_t seq_dim, bool interleaved, double eps,
                   double weight_offset, Mrope section, bool mrope_interleaved) {
  return {{std::move(offset), seq_dim, interleaved, section, mrope_interleaved}, eps,
          weight_offset};
}

class NormRotaryQk : public torch::autograd::Function<NormRotaryQk> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& q_weight, const at::Tensor& k_weight,
                               const at::Tensor& table, std::optional<at::Tensor> positions,
                               NormArgs a) {
    static const auto op = find_op<NormSig>("rope_ext::rms_norm_rotary_qk");
    at::Tensor q_out, k_out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(q_out, k_out) = op.call(q, k, q_weight, k_weight, table, positions, a.offset,
                                       a.seq_dim, a.interleaved, a.eps, a.weight_offset,
                                       a.section(), a.mrope_interleaved);
    }
    a.save(ctx);
    const bool table_grad = table.requires_grad();
    ctx->save_for_backward({q, k, q_weight, k_weight, table, positions.value_or(at::Tensor()),
                            table_grad ? q_out : at::Tensor(), table_grad ? k_out : at::Tensor()});
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto backward_op =
        find_op<NormBackwardSig>("rope_ext::rms_norm_rotary_qk_backward");
    const auto s = ctx->get_saved_variables();
    const NormArgs a = NormArgs::load(ctx);
    const std::optional<at::Tensor> positions = optional_tensor(s[5]);
    // Undefined gradients arrive as zeros (materialised).
    auto [dq, dk, dwq, dwk] = backward_op.call(
        grads[0], grads[1], s[0], s[1], s[2], s[3], s[4], positions, a.offset, a.seq_dim,
        a.interleaved, a.eps, a.weight_offset, a.section(), a.mrope_interleaved);
    at::Tensor d_table;
    if (ctx->needs_input_grad(4)) {
      static const auto apply = find_op<ApplySig>("rope_ext::apply_rotary");
      static const auto table_grad = find_op<TableGradSig>("rope_ext::rotary_table_grad");
      for (int i = 0; i < 2; ++i) {
        // The normalised rows: the outputs rotated back.
        const at::Tensor normed = apply.call(s[6 + i], s[4], positions, a.offset, a.seq_dim,
                                             a.interleaved, true, a.section(),
                                             a.mrope_interleaved);
        const at::Tensor g = table_grad.call(grads[i], normed, s[4], positions, a.offset,
                                             a.seq_dim, a.interleaved, false, a.section(),
                                             a.mrope_interleaved);
        d_table = d_table.defined() ? d_table + g : g;
      }
    }
    return {dq, dk, dwq, dwk, d_table, at::Tensor(), at::Tensor()};
  }
};

bool any_requires_grad(std::initializer_list<at::Tensor> tensors) {
  if (!at::GradMode::is_enabled()) {
    return false;
  }
  for (const auto& t : tensors) {
    if (t.requires_grad()) {
      return true;
    }
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor> norm_rotary_qk_functional(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
    const at::Tensor& k_weight, const at::Tensor& table,
    const std::optional<at::Tensor>& positions, c10::SymInt offset, int64_t seq_dim,
    bool interleaved, double eps, double weight_offset, Mrope mrope_section,
    bool mrope_interleaved) {
  if (any_requires_grad({q, k, q_weight, k_weight, table})) {
    auto out = NormRotaryQk::apply(q, k, q_weight, k_weight, table, positions,
                                   make_args(std::move(offset), seq_dim, interleaved, eps,
                                             weight_offset, mrope_section, mrope_interleaved));
    return {out[0], out[1]};
  }
  static const auto op = find_op<NormSig>("rope_ext::rms_norm_rotary_qk");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k, q_weight, k_weight, table, positions, offset, seq_dim, interleaved, eps,
                 weight_offset, mrope_section, mrope_interleaved);
}

// In place with gradients: the functional op, then copied into q and k, so that autograd
// keeps the inputs the backward needs (the in-place kernel would overwrite them) and q and
// k may be views of one projection. Without gradients too where q or k is a view at a
// symbolic storage offset (autograd::at_symbolic_offset).
void norm_rotary_qk_inplace(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                            const at::Tensor& k_weight, const at::Tensor& table,
                            const std::optional<at::Tensor>& positions, c10::SymInt offset,
                            int64_t seq_dim, bool interleaved, double eps, double weight_offset,
                            Mrope mrope_section, bool mrope_interleaved) {
  constexpr const char* name = "rms_norm_rotary_qk_";
  const bool grads = any_requires_grad({q, k, q_weight, k_weight, table});
  if (grads || autograd::at_symbolic_offset(q) || autograd::at_symbolic_offset(k)) {
    // The in-place op's checks, under its name, before anything is written. Symbolic
    // layouts (a dynamic-shape trace) leave the arguments to the functional op's checks.
    if (!autograd::symbolic_layout(q) && !autograd::symbolic_layout(k)) {
      detail::check_norm_args(name, q, k, q_weight, k_weight, table, positions,
                              offset.guard_int(__FILE__, __LINE__), seq_dim, eps, mrope_section,
                              mrope_interleaved);
    }
    autograd::check_inplace_targets(name, {q, k});
    // On copies with gradients: the backward reads the inputs, which the copies back
    // overwrite.
    auto [q_out, k_out] = norm_rotary_qk_functional(
        grads ? q.clone() : q, grads ? k.clone() : k, q_weight, k_weight, table, positions,
        offset, seq_dim, interleaved, eps, weight_offset, mrope_section, mrope_interleaved);
    q.copy_(q_out);
    k.copy_(k_out);
    return;
  }
  static const auto op = find_op<NormInplaceSig>("rope_ext::rms_norm_rotary_qk_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, q_weight, k_weight, table, positions, offset, seq_dim, interleaved, eps,
            weight_offset, mrope_section, mrope_interleaved);
  }
  torch::autograd::increment_version(q);
  torch::autograd::increment_version(k);
}

}  // namespace

TORCH_LIBRARY_IMPL(rope_ext, Autograd, m) {
  m.impl("rms_norm_rotary_qk", &norm_rotary_qk_functional);
  m.impl("rms_norm_rotary_qk_", &norm_rotary_qk_inplace);
}

}  // namespace rope_ext
