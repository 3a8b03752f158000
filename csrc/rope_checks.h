// Argument checks and parameter filling shared by every backend.
//
// Each message names the argument, what was expected and what arrived; rope_ext/_meta.py
// mirrors every check, word for word, in the fake kernels used by torch.compile.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "rope_math.h"

namespace rope_ext {

// Checks x against the table and the position arguments of one apply call and returns
// seq_dim normalised to [0, x.dim() - 2], or -1 when positions are given (seq_dim unused).
// With mrope_section, positions must be [A, *b] (see rope_ops.cpp).
int64_t check_apply_args(
    const char* op,
    const char* name,
    const at::Tensor& x,
    const at::Tensor& table,
    const std::optional<at::Tensor>& positions,
    int64_t offset,
    int64_t seq_dim,
    at::OptionalIntArrayRef mrope_section,
    bool mrope_interleaved);

// q and k of a fused call must agree on head_dim and, without positions (seq_dim >= 0, as
// check_apply_args returns it), on their rank, batch and sequence dims.
void check_qk_pair(const char* op, const at::Tensor& q, const at::Tensor& k, int64_t seq_dim);

// An in-place call needs every element of x to be distinct memory. `needs` and `fix` word the
// message for other writes (the KV-cache op's caches).
void check_inplace_target(const char* op, const char* name, const at::Tensor& x,
                          const char* needs = "an in-place call needs",
                          const char* fix = "use the out-of-place op");

// a and b share no memory: "<op>: <a> and <b> overlap in memory; <needs> them disjoint".
void check_disjoint(const char* op, const char* a_name, const at::Tensor& a, const char* b_name,
                    const at::Tensor& b, const char* needs, const char* fix);

// In-place q and k must not write to the same elements.
void check_qk_disjoint(const char* op, const at::Tensor& q, const at::Tensor& k);

// Both of the above for the targets of an in-place call: x, or q and k.
void check_inplace_call(const char* op, c10::ArrayRef<at::Tensor> targets);

// The norm weight of a fused RMSNorm + RoPE call (csrc/qk_norm.h): [head_dim] of x, float32 or
// x's dtype, on x's device.
void check_norm_weight(const char* op, const char* name, const at::Tensor& weight,
                       const char* x_name, const at::Tensor& x);

// The norm's eps: a positive finite number.
void check_norm_eps(const char* op, double eps);

// Checks the output table and the inverse frequencies of fill_freqs_cis_.
void check_freqs_table(const char* op, const at::Tensor& out, const at::Tensor& inv_freq);

// Table, positions and flags of a call; operands are added with add_operand.
RotaryParams make_params(
    const at::Tensor& table,
    const std::optional<at::Tensor>& positions,
    int64_t offset,
    bool interleaved,
    bool inverse,
    at::OptionalIntArrayRef mrope_section,
    bool mrope_interleaved);

// Appends x (written to out) to p, merging leading dims where every stride allows it.
// Does nothing for an empty x.
void add_operand(
    const char* op,
    RotaryParams& p,
    const at::Tensor& x,
    const at::Tensor& out,
    const std::optional<at::Tensor>& positions,
    int64_t seq_dim);

}  // namespace rope_ext
