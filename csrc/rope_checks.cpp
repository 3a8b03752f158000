#include "rope_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

namespace rope_ext {
namespace {

bool is_supported_x_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

void check_table(const char* op, const at::Tensor& table) {
  if (table.is_complex()) {
    TORCH_CHECK_TYPE(
        table.scalar_type() == at::kComplexFloat || table.scalar_type() == at::kComplexDouble,
        op, ": freqs_cis must be complex64 or complex128 [P, R/2] (or its real view, float32 "
        "or float64 [P, R/2, 2]), got ", table.scalar_type());
    TORCH_CHECK_VALUE(table.dim() == 2, op, ": complex freqs_cis must have shape [P, R/2], got ",
                      table.sizes());
  } else {
    TORCH_CHECK_TYPE(
        table.scalar_type() == at::kFloat || table.scalar_type() == at::kDouble,
        op, ": freqs_cis must be float32 or float64 (the real view [P, R/2, 2] of the complex "
        "table) or complex64 or complex128 [P, R/2], got ", table.scalar_type());
    TORCH_CHECK_VALUE(
        table.dim() == 3 && table.size(2) == 2,
        op, ": freqs_cis must have shape [P, R/2, 2] holding (cos, sin), got ", table.sizes());
  }
  TORCH_CHECK_VALUE(
      table.size(1) > 0, op, ": freqs_cis must hold at least one rotary pair, got shape ",
      table.sizes());
}

// The MRoPE arguments: sections, and positions with a leading dim of one position per axis.
void check_mrope(const char* op, const at::Tensor& table,
                 const std::optional<at::Tensor>& positions,
                 at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  if (!mrope_section.has_value()) {
    TORCH_CHECK_VALUE(!mrope_interleaved, op,
                      ": mrope_interleaved=True needs mrope_section (3 section lengths)");
    return;
  }
  const auto section = *mrope_section;
  const int64_t axes = static_cast<int64_t>(section.size());
  TORCH_CHECK_VALUE(axes >= 1 && axes <= kMaxMropeAxes, op, ": mrope_section must hold 1 to ",
                    kMaxMropeAxes, " section lengths, got ", axes);
  int64_t total = 0;
  for (const int64_t n : section) {
    TORCH_CHECK_VALUE(n >= 0, op, ": mrope_section lengths must be >= 0, got ", section);
    total += n;
  }
  const int64_t pairs = table.size(1);
  if (mrope_interleaved) {
    TORCH_CHECK_VALUE(axes == 3, op,
                      ": mrope_interleaved=True needs 3 sections (time, height, width), got ",
                      axes);
    TORCH_CHECK_VALUE(total <= pairs, op, ": mrope_section ", section, " sums to ", total,
                      ", more than the R/2 = ", pairs, " pairs of freqs_cis");
  } else {
    TORCH_CHECK_VALUE(total == pairs, op, ": mrope_section ", section, " must sum to R/2 = ",
                      pairs, " (freqs_cis.shape[1]), got ", total);
  }
  TORCH_CHECK_VALUE(positions.has_value(), op, ": mrope_section needs positions of shape [",
                    axes, ", ...] (one position per axis), got none");
  TORCH_CHECK_VALUE(positions->dim() >= 1 && positions->size(0) == axes, op,
                    ": positions must have a leading dim of len(mrope_section) = ", axes,
                    ", got shape ", positions->sizes());
}

}  // namespace

int64_t check_apply_args(
    const char* op,
    const char* name,
    const at::Tensor& x,
    const at::Tensor& table,
    const std::optional<at::Tensor>& positions,
    int64_t offset,
    int64_t seq_dim,
    at::OptionalIntArrayRef mrope_section,
    bool mrope_interleaved) {
  TORCH_CHECK_TYPE(
      is_supported_x_dtype(x.scalar_type()),
      op, ": ", name, " must be a float16, bfloat16, float32 or float64 tensor, got ",
      x.scalar_type());
  TORCH_CHECK_VALUE(
      x.dim() >= 2, op, ": ", name,
      " must have at least 2 dims (a sequence dim and head_dim), got ", x.dim());
  TORCH_CHECK_VALUE(x.dim() <= kMaxDims + 1, op, ": ", name, " must have at most ",
                    kMaxDims + 1, " dims, got ", x.dim());
  check_table(op, table);
  TORCH_CHECK_VALUE(
      table.device() == x.device(), op, ": freqs_cis is on ", table.device(), " but ", name,
      " is on ", x.device());
  const int64_t ndim = x.dim();
  // Positions define every row's position; seq_dim then plays no part.
  const int64_t sd = positions.has_value() ? -1 : seq_dim < 0 ? seq_dim + ndim : seq_dim;
  TORCH_CHECK_VALUE(
      positions.has_value() || (sd >= 0 && sd <= ndim - 2), op, ": seq_dim must name a dim of ",
      name, " other than the last, in [", -ndim, ", -2] or [0, ", ndim - 2, "], got ", seq_dim);
  const int64_t rotary_dim = 2 * table.size(1);
  TORCH_CHECK_VALUE(
      rotary_dim <= x.size(-1), op, ": rotary dim 2 * freqs_cis.shape[1] = ", rotary_dim,
      " exceeds ", name, "'s head_dim ", x.size(-1));
  TORCH_CHECK_VALUE(offset >= 0, op, ": offset must be >= 0, got ", offset);
  check_mrope(op, table, positions, mrope_section, mrope_interleaved);
  if (positions.has_value()) {
    const at::Tensor& pos = *positions;
    TORCH_CHECK_TYPE(
        pos.scalar_type() == at::kInt || pos.scalar_type() == at::kLong,
        op, ": positions must be an int32 or int64 tensor, got ", pos.scalar_type());
    TORCH_CHECK_VALUE(
        pos.device() == x.device(), op, ": positions is on ", pos.device(), " but ", name,
        " is on ", x.device());
    const auto lead = x.sizes().slice(0, ndim - 1);
    // With MRoPE the leading dim holds the axes; the rest broadcasts.
    const auto rows = pos.sizes().slice(mrope_section.has_value() ? 1 : 0);
    bool broadcastable = rows.size() <= lead.size();
    for (size_t d = 1; broadcastable && d <= rows.size(); ++d) {
      const int64_t ps = rows[rows.size() - d];
      broadcastable = ps == 1 || ps == lead[lead.size() - d];
    }
    TORCH_CHECK_VALUE(
        broadcastable, op, ": positions of shape ", pos.sizes(),
        mrope_section.has_value() ? " (after its leading axis dim)" : "",
        " is not broadcastable to ", name, ".shape[:-1] = ", lead);
  } else {
    TORCH_CHECK_VALUE(
        offset + x.size(sd) <= table.size(0), op, ": offset + ", name,
        ".shape[seq_dim] = ", offset, " + ", x.size(sd), " exceeds the ", table.size(0),
        " rows of freqs_cis");
  }
  return sd;
}

void check_qk_pair(const char* op, const at::Tensor& q, const at::Tensor& k, int64_t seq_dim) {
  TORCH_CHECK_VALUE(
      q.size(-1) == k.size(-1), op, ": q and k must have the same head_dim, got ", q.size(-1),
      " and ", k.size(-1));
  if (seq_dim < 0) {
    return;  // positions given: each of q and k only has to broadcast with them
  }
  TORCH_CHECK_VALUE(
      q.dim() == k.dim(), op, ": q and k must have the same number of dims, got ", q.dim(),
      " and ", k.dim());
  for (const int64_t d : {int64_t{0}, seq_dim}) {
    TORCH_CHECK_VALUE(
        q.size(d) == k.size(d), op, ": q and k must agree on dim ", d,
        " (batch and seq_dim; only head counts may differ), got ", q.size(d), " and ",
        k.size(d));
  }
}

namespace {

// Where a strided tensor's elements lie, in bytes from its first element: its dims of size > 1,
// largest stride first, and the width of one element.
struct Layout {
  int n = 0;
  int64_t sizes[kMaxDims + 1] = {};
  int64_t strides[kMaxDims + 1] = {};
  int64_t width = 0;
  int64_t spans[kMaxDims + 2] = {};  // spans[d]: bytes covered by one block of dims d..n-1

  explicit Layout(const at::Tensor& t) : width(t.element_size()) {
    for (int64_t d = 0; d < t.dim(); ++d) {
      // A stride-0 dim repeats the same elements: for where they lie, it is a dim of size 1
      // (check_inplace_target refuses it on its own).
      if (t.size(d) > 1 && t.stride(d) != 0) {
        sizes[n] = t.size(d);
        strides[n] = t.stride(d) * width;
        ++n;
      }
    }
    for (int i = 1; i < n; ++i) {  // insertion sort, largest stride first
      for (int j = i; j > 0 && strides[j] > strides[j - 1]; --j) {
        std::swap(strides[j], strides[j - 1]);
        std::swap(sizes[j], sizes[j - 1]);
      }
    }
    spans[n] = width;
    for (int d = n - 1; d >= 0; --d) {
      spans[d] = spans[d + 1] + (sizes[d] - 1) * strides[d];
    }
  }
};

int64_t floor_div(int64_t a, int64_t b) {
  return a / b - (a % b != 0 && (a < 0) != (b < 0));
}

// Whether an element of a (dims da..) and one of b (dims db..), b's first element `delta`
// bytes after a's, share a byte. Each call costs one unit of `budget`; an exhausted budget
// answers true (not proven disjoint). Dims with equal strides are taken together: the pair of
// blocks (i, j) only matters through j - i, so the blocks of a whole prefill are one question.
bool may_overlap(const Layout& a, int da, const Layout& b, int db, int64_t delta,
                 int64_t& budget) {
  if (--budget < 0) {
    return true;
  }
  if (delta >= a.spans[da] || -delta >= b.spans[db]) {
    return false;  // their extents do not meet
  }
  if (da == a.n && db == b.n) {
    return true;
  }
  const int64_t sa = da < a.n ? a.strides[da] : -1;
  const int64_t sb = db < b.n ? b.strides[db] : -1;
  if (sa == sb && sa > 0) {
    // Block i of a against block j of b: b's block starts delta + (j - i) * s after a's.
    const int64_t lo = std::max(-(a.sizes[da] - 1), floor_div(-b.spans[db + 1] - delta, sa) + 1);
    const int64_t hi = std::min(b.sizes[db] - 1, floor_div(a.spans[da + 1] - delta - 1, sa));
    for (int64_t t = lo; t <= hi; ++t) {
      if (may_overlap(a, da + 1, b, db + 1, delta + t * sa, budget)) {
        return true;
      }
    }
    return false;
  }
  if (sa > sb) {  // split a's outermost dim; its block i lies i * sa after a's first element
    const int64_t lo = std::max<int64_t>(0, floor_div(delta - a.spans[da + 1], sa) + 1);
    const int64_t hi = std::min(a.sizes[da] - 1, floor_div(delta + b.spans[db] - 1, sa));
    for (int64_t i = lo; i <= hi; ++i) {
      if (may_overlap(a, da + 1, b, db, delta - i * sa, budget)) {
        return true;
      }
    }
    return false;
  }
  const int64_t lo = std::max<int64_t>(0, floor_div(-b.spans[db + 1] - delta, sb) + 1);
  const int64_t hi = std::min(b.sizes[db] - 1, floor_div(a.spans[da] - delta - 1, sb));
  for (int64_t j = lo; j <= hi; ++j) {
    if (may_overlap(a, da, b, db + 1, delta + j * sb, budget)) {
      return true;
    }
  }
  return false;
}

// Whether two distinct elements of a (dims d..) share a byte.
bool internal_overlap(const Layout& a, int d, int64_t& budget) {
  if (d == a.n) {
    return false;
  }
  if (internal_overlap(a, d + 1, budget)) {
    return true;
  }
  // Blocks i and i + t of dim d; none meet when the stride clears a block's span.
  for (int64_t t = 1; t < a.sizes[d] && t * a.strides[d] < a.spans[d + 1]; ++t) {
    if (may_overlap(a, d + 1, a, d + 1, t * a.strides[d], budget)) {
      return true;
    }
  }
  return false;
}

// Work allowed for one overlap question before it is answered "cannot prove" (a few ms at
// worst; views of real models take tens of steps).
constexpr int64_t kOverlapBudget = 100000;

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "sizes " << t.sizes() << ", strides " << t.strides();
  return out.str();
}

}  // namespace

void check_inplace_target(const char* op, const char* name, const at::Tensor& x,
                          const char* needs, const char* fix) {
  for (int64_t d = 0; d < x.dim(); ++d) {
    TORCH_CHECK_VALUE(
        x.stride(d) != 0 || x.size(d) <= 1, op, ": ", name, " has overlapping memory (dim ", d,
        " of size ", x.size(d), " has stride 0, e.g. from expand); ", needs,
        " distinct elements, ", fix);
  }
  if (x.numel() == 0) {
    return;
  }
  int64_t budget = kOverlapBudget;
  const bool overlap = internal_overlap(Layout(x), 0, budget);
  TORCH_CHECK_VALUE(budget >= 0, op, ": cannot prove that the elements of ", name,
                    " are distinct (", describe(x), "); ", needs, " that: make it "
                    "contiguous or ", fix);
  TORCH_CHECK_VALUE(!overlap, op, ": ", name, " has overlapping memory (", describe(x),
                    ": two of its elements share memory); ", needs, " distinct elements, ",
                    fix);
}

void check_disjoint(const char* op, const char* a_name, const at::Tensor& a, const char* b_name,
                    const at::Tensor& b, const char* needs, const char* fix) {
  if (a.numel() == 0 || b.numel() == 0 || !a.is_alias_of(b)) {
    return;
  }
  const int64_t delta =
      b.storage_offset() * b.element_size() - a.storage_offset() * a.element_size();
  int64_t budget = kOverlapBudget;
  const bool overlap = may_overlap(Layout(a), 0, Layout(b), 0, delta, budget);
  TORCH_CHECK_VALUE(budget >= 0, op, ": cannot prove that ", a_name, " and ", b_name,
                    " are disjoint in memory (", a_name, ": ", describe(a), "; ", b_name, ": ",
                    describe(b), "); ", needs, " that: make them contiguous or ", fix);
  TORCH_CHECK_VALUE(!overlap, op, ": ", a_name, " and ", b_name, " overlap in memory; ", needs,
                    " them disjoint");
}

void check_qk_disjoint(const char* op, const at::Tensor& q, const at::Tensor& k) {
  check_disjoint(op, "q", q, "k", k, "an in-place call needs", "use the out-of-place op");
}

void check_inplace_call(const char* op, c10::ArrayRef<at::Tensor> targets) {
  TORCH_INTERNAL_ASSERT(targets.size() == 1 || targets.size() == 2);
  if (targets.size() == 1) {
    check_inplace_target(op, "x", targets[0]);
    return;
  }
  check_inplace_target(op, "q", targets[0]);
  check_inplace_target(op, "k", targets[1]);
  check_qk_disjoint(op, targets[0], targets[1]);
}

void check_norm_weight(const char* op, const char* name, const at::Tensor& weight,
                       const char* x_name, const at::Tensor& x) {
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat || weight.scalar_type() == x.scalar_type(),
                   op, ": ", name, " must be float32 or ", x_name, "'s dtype ", x.scalar_type(),
                   ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": ", name,
                    " must have shape [", x.size(-1), "] (the head_dim of ", x_name, "), got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.device() == x.device(), op, ": ", name, " is on ", weight.device(),
                    " but ", x_name, " is on ", x.device());
}

void check_norm_eps(const char* op, double eps) {
  TORCH_CHECK_VALUE(eps > 0 && std::isfinite(eps), op,
                    ": eps must be a positive finite number, got ", eps);
}

void check_freqs_table(const char* op, const at::Tensor& out, const at::Tensor& inv_freq) {
  TORCH_CHECK_TYPE(
      out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble,
      op, ": out must be float32 or float64, got ", out.scalar_type());
  TORCH_CHECK_TYPE(inv_freq.scalar_type() == at::kDouble, op,
                   ": inv_freq must be float64, got ", inv_freq.scalar_type());
  TORCH_CHECK_VALUE(inv_freq.dim() == 1, op, ": inv_freq must be 1-D, got shape ",
                    inv_freq.sizes());
  TORCH_CHECK_VALUE(
      out.dim() == 3 && out.size(1) == inv_freq.size(0) && out.size(2) == 2, op,
      ": out must have shape [end, inv_freq.shape[0], 2] = [end, ", inv_freq.size(0),
      ", 2], got ", out.sizes());
  TORCH_CHECK_VALUE(inv_freq.device() == out.device(), op, ": inv_freq is on ",
                    inv_freq.device(), " but out is on ", out.device());
}

RotaryParams make_params(
    const at::Tensor& table,
    const std::optional<at::Tensor>& positions,
    int64_t offset,
    bool interleaved,
    bool inverse,
    at::OptionalIntArrayRef mrope_section,
    bool mrope_interleaved) {
  RotaryParams p{};
  p.num_operands = 0;
  p.table = table.data_ptr();
  p.table_rows = table.size(0);
  p.rot_pairs = table.size(1);
  // A complex table is read through its real view: strides in real elements, cos and sin
  // side by side (no view tensor is made: at::view_as_real costs a dispatch per call).
  const int64_t scale = table.is_complex() ? 2 : 1;
  p.table_row_stride = scale * table.stride(0);
  p.table_pair_stride = scale * table.stride(1);
  p.table_cs_stride = table.is_complex() ? 1 : table.stride(2);
  p.positions = positions.has_value() ? positions->data_ptr() : nullptr;
  p.positions_int64 = positions.has_value() && positions->scalar_type() == at::kLong;
  p.offset = offset;
  p.interleaved = interleaved;
  p.inverse = inverse;
  if (mrope_section.has_value()) {
    p.mrope_axes = static_cast<int>(mrope_section->size());
    p.mrope_interleaved = mrope_interleaved;
    p.mrope_axis_stride = positions->stride(0);
    int64_t end = 0;
    for (int a = 0; a < p.mrope_axes; ++a) {
      end += (*mrope_section)[a];
      p.mrope_bounds[a] = mrope_interleaved ? 3 * (*mrope_section)[a] : end;
    }
  }
  return p;
}

void add_operand(
    const char* op,
    RotaryParams& p,
    const at::Tensor& x,
    const at::Tensor& out,
    const std::optional<at::Tensor>& positions,
    int64_t seq_dim) {
  if (x.numel() == 0) {
    return;
  }
  TORCH_INTERNAL_ASSERT(p.num_operands < 2);
  const int64_t lead = x.dim() - 1;
  RotaryOperand& o = p.operands[p.num_operands++];
  o.x = x.data_ptr();
  o.out = out.data_ptr();
  o.x_feature_stride = x.stride(-1);
  o.out_feature_stride = out.stride(-1);
  o.head_dim = x.size(-1);
  o.rows = 1;
  o.ndim = 0;
  // Walk the leading dims from the innermost out, dropping size-1 dims and merging a dim
  // into the one inside it when x, out and positions all step through them as one.
  int64_t sizes[kMaxDims], xs[kMaxDims], os[kMaxDims], ps[kMaxDims];
  int64_t n = 0;
  for (int64_t d = lead - 1; d >= 0; --d) {
    const int64_t size = x.size(d);
    o.rows *= size;
    if (size == 1) {
      continue;
    }
    int64_t pos_stride = 0;
    if (positions.has_value()) {
      // With MRoPE, positions[0] (one axis) is what broadcasts against x.
      const int64_t skip = p.mrope_axes > 0 ? 1 : 0;
      const int64_t pd = d - (lead - (positions->dim() - skip));
      pos_stride = (pd >= 0 && positions->size(pd + skip) != 1) ? positions->stride(pd + skip)
                                                                  : 0;
    } else {
      pos_stride = d == seq_dim ? 1 : 0;
    }
    if (n > 0 && xs[n - 1] * sizes[n - 1] == x.stride(d) &&
        os[n - 1] * sizes[n - 1] == out.stride(d) && ps[n - 1] * sizes[n - 1] == pos_stride) {
      sizes[n - 1] *= size;
      continue;
    }
    TORCH_INTERNAL_ASSERT(n < kMaxDims, op, ": more leading dims than checked");
    sizes[n] = size;
    xs[n] = x.stride(d);
    os[n] = out.stride(d);
    ps[n] = pos_stride;
    ++n;
  }
  // Stored outermost first, as row_offsets expects.
  o.ndim = n;
  for (int64_t i = 0; i < n; ++i) {
    o.sizes[i] = sizes[n - 1 - i];
    o.x_strides[i] = xs[n - 1 - i];
    o.out_strides[i] = os[n - 1 - i];
    o.pos_strides[i] = ps[n - 1 - i];
  }
}

}  // namespace rope_ext
