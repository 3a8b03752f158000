// What the autograd Functions of the rotary ops (rope_autograd.cpp) and of the fused
// RMSNorm + RoPE ops (qk_norm_autograd.cpp) share: typed handles of the ops they call (the
// Python entries of rope_python.cpp use them too), and the placement arguments (which angle
// each row turns by) kept in the autograd context.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <initializer_list>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "rope_checks.h"

namespace rope_ext::autograd {

using torch::autograd::AutogradContext;
using Mrope = at::OptionalIntArrayRef;  // mrope_section

// The ops' C++ signatures, for their typed handles.
using ApplySig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::SymInt, int64_t, bool, bool, Mrope, bool);
using ApplyInplaceSig = void(const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool, bool,
                             Mrope, bool);
using ApplyQkSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&,
                                                       const std::optional<at::Tensor>&,
                                                       c10::SymInt, int64_t, bool, bool, Mrope,
                                                       bool);
using ApplyQkInplaceSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool,
                               bool, Mrope, bool);
using NormSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool, double,
    double, Mrope, bool);
using NormInplaceSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool,
                            double, double, Mrope, bool);
// The fused RoPE + KV-cache write (kv_cache_ops.h), out of place and in place.
using KvOptional = const std::optional<at::Tensor>&;
using KvCacheSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, KvOptional, c10::SymInt, int64_t, bool,
                              c10::string_view, KvOptional, KvOptional, KvOptional, KvOptional,
                              double, double);
using KvCacheInplaceSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, KvOptional, c10::SymInt, int64_t, bool,
                               c10::string_view, KvOptional, KvOptional, KvOptional, KvOptional,
                               double, double);
using TableGradSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, c10::SymInt, int64_t, bool,
                                bool, Mrope, bool);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Whether t's sizes, strides or storage offset are symbols: a fake tensor of a dynamic-shape
// trace (torch.compile, torch.export). The C++ checks cannot read such a layout (numel()
// throws); the fake kernels (rope_ext/_meta.py) check it as far as its symbols allow.
inline bool symbolic_layout(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// Whether an in-place call must write t through copy_ rather than hand it to a mutating op:
// t is a view at a symbolic storage offset, which only a dynamic-shape trace makes. Inductor
// drops that offset when a custom op mutates the view (pytorch/pytorch#198068, in every torch
// release up to 2.15), so the writes would land at the start of the base buffer, with no
// error. It places copy_ into the view right.
inline bool at_symbolic_offset(const at::Tensor& t) {
  return !t.sym_storage_offset().maybe_as_int().has_value();
}

// The checks an in-place call makes of its targets (x, or q and k), under op's name: each
// distinct memory, q and k disjoint. For the autograd kernels' paths that write through
// copy_ or one Function per tensor, where the in-place op's own checks do not run; symbolic
// layouts go to the check_inplace op, whose fake kernel checks what their symbols allow.
inline void check_inplace_targets(const char* op, std::initializer_list<at::Tensor> targets) {
  bool symbolic = false;
  for (const at::Tensor& t : targets) {
    symbolic = symbolic || symbolic_layout(t);
  }
  if (symbolic) {
    static const auto check =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rope_ext::check_inplace", "")
            .typed<void(std::string_view, at::TensorList)>();
    check.call(op, std::vector<at::Tensor>(targets));
    return;
  }
  check_inplace_call(op, targets);
}

inline std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// offset, seq_dim, interleaved, mrope_section and mrope_interleaved: the arguments every
// rotary op takes, saved in and loaded from an autograd context.
struct PlacementArgs {
  c10::SymInt offset;
  int64_t seq_dim;
  bool interleaved;
  std::optional<std::vector<int64_t>> mrope_section;
  bool mrope_interleaved;

  PlacementArgs(c10::SymInt offset, int64_t seq_dim, bool interleaved, Mrope section,
                bool mrope_interleaved)
      : offset(std::move(offset)),
        seq_dim(seq_dim),
        interleaved(interleaved),
        mrope_section(section.has_value() ? std::optional<std::vector<int64_t>>(section->vec())
                                          : std::nullopt),
        mrope_interleaved(mrope_interleaved) {}

  Mrope section() const {
    return mrope_section.has_value() ? Mrope(*mrope_section) : Mrope();
  }
  void save(AutogradContext* ctx) const {
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["seq_dim"] = seq_dim;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["mrope_section"] =
        mrope_section.has_value() ? c10::IValue(*mrope_section) : c10::IValue();
    ctx->saved_data["mrope_interleaved"] = mrope_interleaved;
  }
  static PlacementArgs load(AutogradContext* ctx) {
    const c10::IValue& section = ctx->saved_data["mrope_section"];
    const std::vector<int64_t> sections = section.isNone() ? std::vector<int64_t>()
                                                           : section.toIntVector();
    return {ctx->saved_data["offset"].toSymInt(), ctx->saved_data["seq_dim"].toInt(),
            ctx->saved_data["interleaved"].toBool(),
            section.isNone() ? Mrope() : Mrope(sections),
            ctx->saved_data["mrope_interleaved"].toBool()};
  }
};

}  // namespace rope_ext::autograd
