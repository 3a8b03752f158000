// Autograd of the rotary ops, in place and out of place, as ATen's derivatives are: a C++
// autograd Function per op, which costs a fraction of a microsecond a call where the Python
// layer of torch.library.register_autograd cost ~7 us (most of a decode step's budget). The
// table's gradient is the rotary_table_grad op (rope_ext/_autograd.py).
//
// The gradient of x is the inverse rotation of the incoming gradient. The table's gradient
// needs the input; an in-place call overwrote it, so it is recovered by rotating the output
// back, and nothing beyond the output is saved.
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "autograd_common.h"
#include "rope_backend.h"

namespace rope_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using autograd::ApplyInplaceSig;
using autograd::ApplyQkInplaceSig;
using autograd::ApplyQkSig;
using autograd::ApplySig;
using autograd::find_op;
using autograd::Mrope;
using autograd::optional_tensor;
using autograd::TableGradSig;

// The non-tensor arguments every rotary op shares, kept in the autograd context.
struct RotaryArgs : autograd::PlacementArgs {
  bool inverse;

  RotaryArgs(c10::SymInt offset, int64_t seq_dim, bool interleaved, bool inverse,
             Mrope section, bool mrope_interleaved)
      : PlacementArgs(std::move(offset), seq_dim, interleaved, section, mrope_interleaved),
        inverse(inverse) {}
  RotaryArgs(PlacementArgs placement, bool inverse)
      : PlacementArgs(std::move(placement)), inverse(inverse) {}

  void save(AutogradContext* ctx) const {
    PlacementArgs::save(ctx);
    ctx->saved_data["inverse"] = inverse;
  }
  static RotaryArgs load(AutogradContext* ctx) {
    return {PlacementArgs::load(ctx), ctx->saved_data["inverse"].toBool()};
  }
};

// The gradient of x: the inverse rotation of grad (undefined where grad is).
at::Tensor x_grad(const at::Tensor& grad, const at::Tensor& table, const at::Tensor& positions,
                  const RotaryArgs& a) {
  static const auto apply = find_op<ApplySig>("rope_ext::apply_rotary");
  if (!grad.defined()) {
    return {};
  }
  return apply.call(grad, table, optional_tensor(positions), a.offset, a.seq_dim, a.interleaved,
                    !a.inverse, a.section(), a.mrope_interleaved);
}

// The table's gradient from one rotated tensor whose input was x.
at::Tensor table_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& table,
                      const at::Tensor& positions, const RotaryArgs& a) {
  static const auto table_grad_op = find_op<TableGradSig>("rope_ext::rotary_table_grad");
  if (!grad.defined()) {
    return {};
  }
  return table_grad_op.call(grad, x, table, optional_tensor(positions), a.offset, a.seq_dim,
                            a.interleaved, a.inverse, a.section(), a.mrope_interleaved);
}

at::Tensor sum_defined(const at::Tensor& a, const at::Tensor& b) {
  return !a.defined() ? b : !b.defined() ? a : a + b;
}

// apply_rotary: saves the table, positions and, when the table needs a gradient, x.
class Rotary : public torch::autograd::Function<Rotary> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& table, std::optional<at::Tensor> positions,
                               RotaryArgs a) {
    static const auto op = find_op<ApplySig>("rope_ext::apply_rotary");
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = op.call(x, table, positions, a.offset, a.seq_dim, a.interleaved, a.inverse,
                    a.section(), a.mrope_interleaved);
    }
    a.save(ctx);
    ctx->save_for_backward({table, positions.value_or(at::Tensor()),
                            table.requires_grad() ? x : at::Tensor()});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const RotaryArgs a = RotaryArgs::load(ctx);
    return {ctx->needs_input_grad(0) ? x_grad(grads[0], saved[0], saved[1], a) : at::Tensor(),
            ctx->needs_input_grad(1) ? table_grad(grads[0], saved[2], saved[0], saved[1], a)
                                     : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// apply_rotary_qk: as Rotary, for q and k in one launch.
class RotaryQk : public torch::autograd::Function<RotaryQk> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& table, std::optional<at::Tensor> positions,
                               RotaryArgs a) {
    static const auto op = find_op<ApplyQkSig>("rope_ext::apply_rotary_qk");
    at::Tensor q_out, k_out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(q_out, k_out) =
          op.call(q, k, table, positions, a.offset, a.seq_dim, a.interleaved, a.inverse,
                  a.section(), a.mrope_interleaved);
    }
    a.save(ctx);
    const bool keep_inputs = table.requires_grad();
    ctx->save_for_backward({table, positions.value_or(at::Tensor()),
                            keep_inputs ? q : at::Tensor(), keep_inputs ? k : at::Tensor()});
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const RotaryArgs a = RotaryArgs::load(ctx);
    at::Tensor grad_table;
    if (ctx->needs_input_grad(2)) {
      grad_table = sum_defined(table_grad(grads[0], saved[2], saved[0], saved[1], a),
                               table_grad(grads[1], saved[3], saved[0], saved[1], a));
    }
    return {ctx->needs_input_grad(0) ? x_grad(grads[0], saved[0], saved[1], a) : at::Tensor(),
            ctx->needs_input_grad(1) ? x_grad(grads[1], saved[0], saved[1], a) : at::Tensor(),
            grad_table, at::Tensor(), at::Tensor()};
  }
};

// Gradients of x and of the table for one tensor rotated in place into `out`.
std::pair<at::Tensor, at::Tensor> rotary_grads(const at::Tensor& grad, const at::Tensor& out,
                                               const at::Tensor& table,
                                               const at::Tensor& positions,
                                               const RotaryArgs& a, bool needs_table_grad) {
  at::Tensor grad_table;
  if (needs_table_grad && grad.defined()) {
    const at::Tensor x = x_grad(out, table, positions, a);  // out rotated back: the input
    grad_table = table_grad(grad, x, table, positions, a);
  }
  return {x_grad(grad, table, positions, a), grad_table};
}

class RotaryInplace : public torch::autograd::Function<RotaryInplace> {
 public:
  static variable_list forward(AutogradContext* ctx, at::Tensor x, at::Tensor table,
                               std::optional<at::Tensor> positions, RotaryArgs a) {
    static const auto op = find_op<ApplyInplaceSig>("rope_ext::apply_rotary_");
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.call(x, table, positions, a.offset, a.seq_dim, a.interleaved, a.inverse, a.section(),
              a.mrope_interleaved);
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

}  // namespace

at::Tensor apply_rotary_functional(const at::Tensor& x, const at::Tensor& table,
                                   const std::optional<at::Tensor>& positions,
                                   c10::SymInt offset, int64_t seq_dim, bool interleaved,
                                   bool inverse, Mrope mrope_section, bool mrope_interleaved) {
  static const auto op = find_op<ApplySig>("rope_ext::apply_rotary");
  if (any_requires_grad({x, table})) {
    return Rotary::apply(x, table, positions,
                         RotaryArgs{std::move(offset), seq_dim, interleaved, inverse,
                                    mrope_section, mrope_interleaved})[0];
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, table, positions, offset, seq_dim, interleaved, inverse, mrope_section,
                 mrope_interleaved);
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_qk_functional(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
    const std::optional<at::Tensor>& positions, c10::SymInt offset, int64_t seq_dim,
    bool interleaved, bool inverse, Mrope mrope_section, bool mrope_interleaved) {
  static const auto op = find_op<ApplyQkSig>("rope_ext::apply_rotary_qk");
  if (any_requires_grad({q, k, table})) {
    auto out = RotaryQk::apply(q, k, table, positions,
                               RotaryArgs{std::move(offset), seq_dim, interleaved, inverse,
                                          mrope_section, mrope_interleaved});
    return {out[0], out[1]};
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k, table, positions, offset, seq_dim, interleaved, inverse, mrope_section,
                 mrope_interleaved);
}

namespace {

// What the in-place op reads when its call is traced as the functional op and copy_ (see
// autograd::at_symbolic_offset): x itself, or a copy where the functional op's autograd keeps
// x (for the table's gradient), which copy_ then overwrites.
at::Tensor functional_input(const at::Tensor& x, const at::Tensor& table) {
  return table.requires_grad() && at::GradMode::is_enabled() ? x.clone() : x;
}

void apply_rotary_autograd(const at::Tensor& x, const at::Tensor& table,
                           const std::optional<at::Tensor>& positions, c10::SymInt offset,
                           int64_t seq_dim, bool interleaved, bool inverse, Mrope mrope_section,
                           bool mrope_interleaved) {
  if (autograd::at_symbolic_offset(x)) {
    autograd::check_inplace_targets("apply_rotary_", {x});
    x.copy_(apply_rotary_functional(functional_input(x, table), table, positions, offset,
                                    seq_dim, interleaved, inverse, mrope_section,
                                    mrope_interleaved));
    return;
  }
  const RotaryArgs a{std::move(offset), seq_dim,       interleaved,
                     inverse,           mrope_section, mrope_interleaved};
  if (any_requires_grad({x, table})) {
    RotaryInplace::apply(x, table, positions, a);
    return;
  }
  static const auto op = find_op<ApplyInplaceSig>("rope_ext::apply_rotary_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(x, table, positions, a.offset, seq_dim, interleaved, inverse, mrope_section,
            mrope_interleaved);
  }
  torch::autograd::increment_version(x);
}

void apply_rotary_qk_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& table,
                              const std::optional<at::Tensor>& positions, c10::SymInt offset,
                              int64_t seq_dim, bool interleaved, bool inverse,
                              Mrope mrope_section, bool mrope_interleaved) {
  constexpr const char* name = "apply_rotary_qk_";
  const bool grads = any_requires_grad({q, k, table});
  // With gradients, the in-place call is one Function per tensor (below), which checks q and
  // k apart; a layout the C++ checks of the pair cannot read goes the functional way too.
  if (autograd::at_symbolic_offset(q) || autograd::at_symbolic_offset(k) ||
      (grads && (autograd::symbolic_layout(q) || autograd::symbolic_layout(k)))) {
    autograd::check_inplace_targets(name, {q, k});
    auto [q_out, k_out] = apply_rotary_qk_functional(
        functional_input(q, table), functional_input(k, table), table, positions, offset,
        seq_dim, interleaved, inverse, mrope_section, mrope_interleaved);
    q.copy_(q_out);
    k.copy_(k_out);
    return;
  }
  const RotaryArgs a{std::move(offset), seq_dim,       interleaved,
                     inverse,           mrope_section, mrope_interleaved};
  if (grads) {
    // The pair's checks, under the in-place op's name, before either tensor is written.
    detail::check_qk_args(name, q, k, table, positions, a.offset.guard_int(__FILE__, __LINE__),
                          seq_dim, mrope_section, mrope_interleaved);
    autograd::check_inplace_targets(name, {q, k});
    // The autograd engine lets a Function that modifies a view in place (q and k are often
    // views of one qkv projection) return only that one tensor: one Function each.
    RotaryInplace::apply(q, table, positions, a);
    RotaryInplace::apply(k, table, positions, a);
    return;
  }
  static const auto op = find_op<ApplyQkInplaceSig>("rope_ext::apply_rotary_qk_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, table, positions, a.offset, seq_dim, interleaved, inverse, mrope_section,
            mrope_interleaved);
  }
  torch::autograd::increment_version(q);
  torch::autograd::increment_version(k);
}

// The fused RoPE + KV-cache write (kv_cache_ops.h) is an inference op: no gradient. Its
// autograd kernels refuse inputs that need one, refuse caches Inductor would write at the
// wrong place, and write an in-place q at a symbolic storage offset through copy_, as the
// in-place rotations above do.
using autograd::KvCacheInplaceSig;
using autograd::KvCacheSig;
using autograd::KvOptional;

void check_kv_cache_call(const char* op, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& table, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, KvOptional q_weight, KvOptional k_weight) {
  const bool grads = at::GradMode::is_enabled() &&
                     (any_requires_grad({q, k, v, table}) ||
                      (q_weight.has_value() && q_weight->requires_grad()) ||
                      (k_weight.has_value() && k_weight->requires_grad()));
  TORCH_CHECK(!grads, op, ": an inference op, it has no gradient; call it under "
              "torch.no_grad() or torch.inference_mode(), or on tensors that do not require "
              "grad");
  for (const auto& [name, cache] : {std::pair<const char*, const at::Tensor*>{"k_cache", &k_cache},
                                    {"v_cache", &v_cache}}) {
    TORCH_CHECK_VALUE(
        !autograd::at_symbolic_offset(*cache), op, ": ", name, " is a view at a storage offset "
        "that depends on dynamic shapes (a slice of a larger buffer, under torch.compile with "
        "dynamic shapes), which Inductor would write at the start of the buffer "
        "(pytorch/pytorch#198068): give each layer a cache tensor of its own, or keep the "
        "buffer's sizes static (torch._dynamo.mark_static)");
  }
}

at::Tensor kv_cache_functional(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& table, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& slots,
                               KvOptional positions, c10::SymInt offset, int64_t seq_dim,
                               bool interleaved, c10::string_view cache_layout,
                               KvOptional k_scale, KvOptional v_scale, KvOptional q_weight,
                               KvOptional k_weight, double eps, double weight_offset) {
  check_kv_cache_call("rotary_kv_cache_update", q, k, v, table, k_cache, v_cache, q_weight,
                      k_weight);
  static const auto op = find_op<KvCacheSig>("rope_ext::rotary_kv_cache_update");
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = op.call(q, k, v, table, k_cache, v_cache, slots, positions, std::move(offset),
                  seq_dim, interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
                  weight_offset);
  }
  torch::autograd::increment_version(k_cache);
  torch::autograd::increment_version(v_cache);
  return out;
}

void kv_cache_inplace(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& table, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& slots, KvOptional positions,
                      c10::SymInt offset, int64_t seq_dim, bool interleaved,
                      c10::string_view cache_layout, KvOptional k_scale, KvOptional v_scale,
                      KvOptional q_weight, KvOptional k_weight, double eps,
                      double weight_offset) {
  constexpr const char* name = "rotary_kv_cache_update_";
  check_kv_cache_call(name, q, k, v, table, k_cache, v_cache, q_weight, k_weight);
  if (autograd::at_symbolic_offset(q)) {
    autograd::check_inplace_targets(name, {q});
    q.copy_(kv_cache_functional(q, k, v, table, k_cache, v_cache, slots, positions,
                                std::move(offset), seq_dim, interleaved, cache_layout, k_scale,
                                v_scale, q_weight, k_weight, eps, weight_offset));
    return;
  }
  static const auto op = find_op<KvCacheInplaceSig>("rope_ext::rotary_kv_cache_update_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(q, k, v, table, k_cache, v_cache, slots, positions, std::move(offset), seq_dim,
            interleaved, cache_layout, k_scale, v_scale, q_weight, k_weight, eps,
            weight_offset);
  }
  torch::autograd::increment_version(q);
  torch::autograd::increment_version(k_cache);
  torch::autograd::increment_version(v_cache);
}

}  // namespace

TORCH_LIBRARY_IMPL(rope_ext, Autograd, m) {
  m.impl("apply_rotary", &apply_rotary_functional);
  m.impl("apply_rotary_qk", &apply_rotary_qk_functional);
  m.impl("apply_rotary_", &apply_rotary_autograd);
  m.impl("apply_rotary_qk_", &apply_rotary_qk_autograd);
  m.impl("rotary_kv_cache_update", &kv_cache_functional);
  m.impl("rotary_kv_cache_update_", &kv_cache_inplace);
}

}  // namespace rope_ext
