// Autograd for the in-place ops. (The functional ops get theirs from
// torch.library.register_autograd in rope_ext/_autograd.py; that API refuses mutating ops,
// so these live here, as ATen's in-place derivatives do.)
//
// The gradient of x is the inverse rotation of the incoming gradient. The table's gradient
// needs the input, which the in-place call overwrote: it is recovered by rotating the output
// back, so nothing beyond the output is saved.
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>

namespace rope_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ApplySig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::SymInt, int64_t, bool, bool);
using ApplyInplaceSig = void(const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool, bool);
using ApplyQkInplaceSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool,
                               bool);
using TableGradSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool,
                                bool);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The non-tensor arguments every rotary op shares, kept in the autograd context.
struct RotaryArgs {
  c10::SymInt offset;
  int64_t seq_dim;
  bool interleaved;
  bool inverse;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["seq_dim"] = seq_dim;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["inverse"] = inverse;
  }
  static RotaryArgs load(AutogradContext* ctx) {
    return {ctx->saved_data["offset"].toSymInt(), ctx->saved_data["seq_dim"].toInt(),
            ctx->saved_data["interleaved"].toBool(), ctx->saved_data["inverse"].toBool()};
  }
};

// Gradients of x (inverse rotation of grad) and of the table, for one rotated tensor whose
// output is `out`.
std::pair<at::Tensor, at::Tensor> rotary_grads(const at::Tensor& grad, const at::Tensor& out,
                                               const at::Tensor& table,
                                               const at::Tensor& positions,
                                               const RotaryArgs& a, bool table_grad) {
  static const auto apply = find_op<ApplySig>("rope_ext::apply_rotary");
  static const auto table_grad_op = find_op<TableGradSig>("rope_ext::rotary_table_grad");
  const auto pos = optional_tensor(positions);
  at::Tensor grad_x;
  if (grad.defined()) {
    grad_x = apply.call(grad, table, pos, a.offset, a.seq_dim, a.interleaved, !a.inverse);
  }
  at::Tensor grad_table;
  if (table_grad && grad.defined()) {
    const at::Tensor x = apply.call(out, table, pos, a.offset, a.seq_dim, a.interleaved,
                                    !a.inverse);
    grad_table = table_grad_op.call(grad, x, table, pos, a.offset, a.seq_dim, a.interleaved,
                                    a.inverse);
  }
  return {grad_x, grad_table};
}

class RotaryInplace : public torch::autograd::Function<RotaryInplace> {
 public:
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor table,
                               std::optional<at::Tensor> positions, RotaryArgs a) {
    static const auto op = find_op<ApplyInplaceSig>("rope_ext::apply_rotary_");
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.call(x, table, positions, a.offset, a.seq_dim, a.interleaved, a.inverse);
    }
    ctx->mark_dirty({x});  // apply() bumps the version of dirty tensors
    a.save(ctx);
    ctx->save_for_backward({table, positions.value_or(at::Tensor()),
                            table.requires_grad() ? x : at::Tensor()});
    return {x};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto [grad_x, grad_table] = rotary_grads(
        grads[0], saved[2], saved[0], saved[1], RotaryArgs::load(ctx), ctx->needs_input_grad(1));
    return {grad_x, grad_table, at::Tensor(), at::Tensor()};
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

void apply_rotary_autograd(const at::Tensor& x, const at::Tensor& table,
                           const std::optional<at::Tensor>& positions, c10::SymInt offset,
                           int64_t seq_dim, bool interleaved, bool inverse) {
  const RotaryArgs a{std::move(offset), seq_dim, interleaved, inverse};
  if (any_requires_grad({x, table})) {
    RotaryInplace::apply(x, table, positions, a);
    return;
  }
  static const auto op = find_op<ApplyInplaceSig>("rope_ext::apply_rotary_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(x, table, positions, a.offset, seq_dim, interleaved, inverse);
  }
  torch::autograd::increment_version(x);
}

void apply_rotary_qk_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                              const std::optional<at::Tensor>& positions, c10::SymInt offset,
                              int64_t seq_dim, bool interleaved, bool inverse) {
  const RotaryArgs a{std::move(offset), seq_dim, interleaved, inverse};
  if (any_requires_grad({q, k, table})) {
    // The autograd engine lets a Function that modifies a view in place (q and k are often
    // views of one qkv projection) return only that one tensor: one Function each.
    RotaryInplace::apply(q, table, positions, a);
    RotaryInplace::apply(k, table, positions, a);
    return;
  }
  static const auto op = find_op<ApplyQkInplaceSig>("rope_ext::apply_rotary_qk_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, table, positions, a.offset, seq_dim, interleaved, inverse);
  }
  torch::autograd::increment_version(q);
  torch::autograd::increment_version(k);
}

}  // namespace

TORCH_LIBRARY_IMPL(rope_ext, Autograd, m) {
  m.impl("apply_rotary_", &apply_rotary_autograd);
  m.impl("apply_rotary_qk_", &apply_rotary_qk_autograd);
}

}  // namespace rope_ext
