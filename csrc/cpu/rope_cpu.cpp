// CPU implementations of the rope_ext ops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include "../kv_cache_ops.h"
#include "../qk_norm_ops.h"
#include "../rope_backend.h"
#include "../rope_build.h"
#include "../cuda/rope_cuda_emulate.h"
#include "rope_cpu_kernel.h"

namespace rope_ext {
namespace cpu {
namespace {

struct KernelChoice {
  RotaryKernel kernel;
  NormRotaryKernel norm_kernel;
  KvCacheKernel kv_kernel;
  const char* name;
};

bool cpu_has(const std::string& variant) {
  if (variant == "AVX2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (variant == "AVX512") {
    return avx512;
  }
  return variant == "AVX512_BF16" && avx512 && __builtin_cpu_supports("avx512bf16");
}

// The widest kernel this build holds that this processor runs and torch's own choice allows
// (torch honours ATEN_CPU_CAPABILITY=default|avx2|avx512). ROPE_EXT_CPU_KERNEL names a
// variant outright (DEFAULT, AVX2, AVX512, AVX512_BF16), for tests and comparisons.
KernelChoice choose_kernel() {
  std::vector<KernelChoice> built = {{DEFAULT::rotary_kernel, DEFAULT::norm_rotary_kernel, DEFAULT::kv_cache_kernel,
                    "DEFAULT"}};
#if defined(ROPE_EXT_HAVE_AVX2)
  built.push_back({AVX2::rotary_kernel, AVX2::norm_rotary_kernel, AVX2::kv_cache_kernel,
                    "AVX2"});
#endif
#if defined(ROPE_EXT_HAVE_AVX512)
  built.push_back({AVX512::rotary_kernel, AVX512::norm_rotary_kernel, AVX512::kv_cache_kernel,
                    "AVX512"});
  built.push_back({AVX512_BF16::rotary_kernel, AVX512_BF16::norm_rotary_kernel, AVX512_BF16::kv_cache_kernel,
                    "AVX512_BF16"});
#endif
  if (const char* forced = std::getenv("ROPE_EXT_CPU_KERNEL")) {
    for (const auto& k : built) {
      if (forced == std::string(k.name)) {
        TORCH_CHECK(k.name == std::string("DEFAULT") || cpu_has(k.name),
                    "ROPE_EXT_CPU_KERNEL=", forced, ": this processor cannot run it");
        return k;
      }
    }
    TORCH_CHECK(false, "ROPE_EXT_CPU_KERNEL=", forced, " names no kernel of this build");
  }
  const std::string torch_choice = at::get_cpu_capability();
  const int allowed = torch_choice == "AVX512" ? 3 : torch_choice == "AVX2" ? 1 : 0;
  KernelChoice choice = built.front();
  for (size_t i = 1; i < built.size(); ++i) {
    if (static_cast<int>(i) <= allowed && cpu_has(built[i].name)) {
      choice = built[i];
    }
  }
  return choice;
}

const KernelChoice& kernel_choice() {
  static const KernelChoice choice = choose_kernel();
  return choice;
}

// The bytes of the level-3 cache instance that cpu0 shares, as lscpu reports it (sysfs);
// sysconf's figure where sysfs has none, 0 when neither knows. sysfs comes first because
// glibc's sysconf gives a whole AMD package's L3: 256 MiB on an EPYC whose cores share 32 MiB
// a core complex.
int64_t l3_instance_bytes() {
  for (int index = 0; index < 16; ++index) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level");
    int level = 0;
    if (!(level_file >> level)) {
      break;
    }
    std::ifstream size_file(dir + "size");
    int64_t size = 0;
    char unit = 0;
    if (level != 3 || !(size_file >> size)) {
      continue;
    }
    size_file >> unit;
    return unit == 'K' ? size << 10 : unit == 'M' ? size << 20 : size;
  }
  const long size = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return size > 0 ? size : 0;
}

struct StreamingCaches {
  int64_t per_thread;  // bytes a thread's own cache holds: its core's L2
  int64_t shared;      // bytes the threads' shared cache holds for them, 0 for none
};

// Streaming stores pay off once the output would not stay in a cache that the next call (or
// the next op) reads at near-L2 speed; below that, the regular stores' read for ownership
// costs less than writing past the caches to memory. Measured (out of place, 2 threads):
// - Xeon (Sapphire Rapids, 2 MiB L2 a core, 105 MiB mesh L3): streaming already wins at 6 MiB
//   moved (a copy: 0.38 against 0.23 ms); the L3 is no faster for a core's stores than
//   memory. So only the threads' L2 counts.
// - AMD EPYC (Zen 3/4, 512 KiB L2, 32 MiB L3 a core complex): regular stores win up to
//   ~16-20 MiB moved (float32 q, k [1, 32, 32, 128], 2 MiB moved: 28 against 63 us); the core
//   complex's L3 holds the output. So half that L3 counts too.
StreamingCaches streaming_caches() {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  StreamingCaches caches{l2 > 0 ? static_cast<int64_t>(l2) : int64_t{1} << 20, 0};
  if (__builtin_cpu_is("amd")) {
    caches.shared = l3_instance_bytes() / 2;
  }
  return caches;
}

}  // namespace

int64_t streaming_threshold() {
  static const int mode = [] {
    const char* value = std::getenv("ROPE_EXT_STREAMING_STORES");
    if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) {
      return -1;
    }
    TORCH_CHECK(std::strcmp(value, "0") == 0 || std::strcmp(value, "1") == 0,
                "ROPE_EXT_STREAMING_STORES=", value, ": expected 0, 1 or auto");
    return value[0] - '0';
  }();
  if (mode >= 0) {
    return mode == 0 ? std::numeric_limits<int64_t>::max() : 0;
  }
  static const StreamingCaches caches = streaming_caches();
  return std::max(at::get_num_threads() * caches.per_thread, caches.shared);
}

namespace {

// The innermost dim of op's rows that share a position (the heads) when op's innermost
// leading dim steps through positions (Hugging Face's [B, H, S, D]), else -1. The rows are
// independent, so the order they are walked in is free; rope_cpu walks such operands as
// below rather than in memory order, where every row would read and convert a table row of
// its own.
int64_t shared_position_dim(const RotaryOperand& op) {
  const int64_t last = op.ndim - 1;
  if (last < 1 || op.pos_strides[last] == 0) {
    return -1;
  }
  int64_t d = last - 1;
  while (d >= 0 && (op.pos_strides[d] != 0 || op.sizes[d] == 1)) {
    --d;
  }
  return d;
}

// Moves op's dim `from` to `to` (> from), the dims between one step out.
void move_dim(RotaryOperand& op, int64_t from, int64_t to) {
  for (int64_t* a : {op.sizes, op.x_strides, op.out_strides, op.pos_strides}) {
    std::rotate(a + from, a + from + 1, a + to + 1);
  }
}

// The heads of a token walked together (the dim d of shared_position_dim innermost): the
// kernel rotates them as one span, the table row read once and the rotation in registers.
// Where heads lie far apart, that is as many streams as there are heads, so: all heads where
// they lie a few KiB apart at most (decode, short sequences, [B, S, H, D] memory), else
// groups of kHeadGroup heads (dim d split in two). The fused norm kernel walks rows this way;
// the rotary kernel tiles long sequences instead (walk_in_tiles). bf16 half-split q, k
// [1, 32, 2048, 128], 2 threads, AMD EPYC (Zen 4), all heads / groups of 4 / memory order:
// AVX2 in place 9.3 / 1.4 / 2.9 ms, out of place 10.1 / 2.3 / 3.0 ms; AVX512_BF16 in place
// 1.9 / 1.0 / 1.5 ms, out of place 3.8 / 1.6 / 2.1 ms (groups of 8 out of place: 5.8 ms).
// [8, 32, 16, 128] out of place, all heads vs memory order: 113 vs 181 us.
constexpr int64_t kHeadGroup = 4;

// The bytes between two heads (dim d) of op in x or out, whichever is further: S rows in
// [B, H, S, D] memory, one row in a [B, H, S, D] view of [B, S, H, D] memory (what
// transformers' attention passes after its transpose).
int64_t head_bytes(const RotaryOperand& op, int64_t d, int64_t row_bytes) {
  return std::max(std::abs(op.x_strides[d]), std::abs(op.out_strides[d])) * row_bytes /
         op.head_dim;
}

// The bytes between two heads up to which all heads of a token are walked together.
int64_t max_head_bytes(bool inplace) {
  return inplace ? 64 * 1024 : 8 * 1024;
}

void walk_heads_together(RotaryOperand& op, int64_t row_bytes, bool inplace) {
  const int64_t d = shared_position_dim(op);
  if (d < 0) {
    return;
  }
  const int64_t last = op.ndim - 1;
  const int64_t group = op.sizes[d] % kHeadGroup == 0 ? kHeadGroup : 2;
  if (head_bytes(op, d, row_bytes) > max_head_bytes(inplace) && op.sizes[d] > group) {
    if (op.sizes[d] % group != 0 || op.ndim == kMaxDims) {
      return;  // memory order
    }
    // Split dim d into [size / group, group] and make the group the innermost dim.
    op.sizes[op.ndim] = group;
    op.x_strides[op.ndim] = op.x_strides[d];
    op.out_strides[op.ndim] = op.out_strides[d];
    op.pos_strides[op.ndim] = 0;
    op.sizes[d] /= group;
    op.x_strides[d] *= group;
    op.out_strides[d] *= group;
    ++op.ndim;
    return;
  }
  move_dim(op, d, last);
}

// The rotary kernel's walk of an operand of shared_position_dim d >= 0 whose heads lie more
// than max_head_bytes apart: its tokens in tiles of kTileTokens, and within a tile each head's
// run of kTileTokens contiguous rows in turn ([..., H, S] -> [..., S / T, H, T]). The kernel
// builds the tile's rotations once for all heads, and prefetches the next head's run while it
// rotates one (rotate_contiguous_tile). Walking heads side by side (walk_heads_together)
// strides over as many streams S rows apart, which on some processors the hardware
// prefetchers cannot follow. bf16 half-split q, k [1, 32, 2048, 128] out of place, 2 threads,
// AMD EPYC (Zen 5), median ratio to clone: groups of 4 heads 2.6-4.5, memory order 1.1-1.5,
// tiles of 32 with the prefetch 1.1-1.65, of 16 or 64 no better over both kernels (in place,
// to copy_: 1.4-2.3, 0.8-1.4, 0.5-1.0).
//
// The last S % T tokens go into a RotaryParams of their own (op's view of them as its one
// operand, the offset or positions moved to their first token; their heads walked together),
// returned for a launch of its own; returns nothing when S divides.
std::optional<RotaryParams> walk_in_tiles(RotaryParams& p, int o, int64_t row_bytes) {
  RotaryOperand& op = p.operands[o];
  int64_t d = shared_position_dim(op);
  const int64_t last = op.ndim - 1;
  if (d < 0 || head_bytes(op, d, row_bytes) <= max_head_bytes(op.out == op.x) ||
      op.sizes[last] < 2 * kTileTokens || op.ndim == kMaxDims) {
    walk_heads_together(op, row_bytes, op.out == op.x);
    return std::nullopt;
  }
  if (d != last - 1) {
    move_dim(op, d, last - 1);
  }
  const int64_t tokens = op.sizes[last];
  const int64_t tiled = tokens / kTileTokens * kTileTokens;
  std::optional<RotaryParams> rest;
  if (tiled < tokens) {
    rest = p;
    rest->num_operands = 1;
    RotaryOperand& tail = rest->operands[0];
    tail = op;
    tail.sizes[last] = tokens - tiled;
    tail.rows = op.rows / tokens * (tokens - tiled);
    const int64_t element = row_bytes / op.head_dim;
    tail.x = static_cast<const char*>(op.x) + tiled * op.x_strides[last] * element;
    tail.out = static_cast<char*>(op.out) + tiled * op.out_strides[last] * element;
    const int64_t first = tiled * op.pos_strides[last];
    if (p.positions == nullptr) {
      rest->offset += first;
    } else {
      rest->positions = static_cast<const char*>(p.positions) +
                        first * (p.positions_int64 ? sizeof(int64_t) : sizeof(int32_t));
    }
    move_dim(tail, last - 1, last);  // fewer than kTileTokens rows a head
    op.sizes[last] = tiled;
    op.rows -= tail.rows;
  }
  // [..., H, S] -> [..., S / T, H, T]: dim d becomes the tiles, last - 1 the heads.
  const int64_t heads = op.sizes[d], hx = op.x_strides[d], hout = op.out_strides[d];
  op.sizes[d] = tiled / kTileTokens;
  op.x_strides[d] = op.x_strides[last] * kTileTokens;
  op.out_strides[d] = op.out_strides[last] * kTileTokens;
  op.pos_strides[d] = op.pos_strides[last] * kTileTokens;
  op.sizes[last] = heads;
  op.x_strides[last] = hx;
  op.out_strides[last] = hout;
  op.pos_strides[last] = 0;
  op.sizes[last + 1] = kTileTokens;
  op.x_strides[last + 1] = op.x_strides[d] / kTileTokens;
  op.out_strides[last + 1] = op.out_strides[d] / kTileTokens;
  op.pos_strides[last + 1] = op.pos_strides[d] / kTileTokens;
  ++op.ndim;
  return rest;
}

// Whether every operand's innermost leading dim holds rows of one position (the heads of a
// token in [B, S, H, D]), so the kernel rotates a token's rows as one span.
bool tokens_innermost(const RotaryParams& p) {
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    if (op.ndim > 0 && op.pos_strides[op.ndim - 1] != 0) {
      return false;
    }
  }
  return true;
}

// MRoPE where a token's rows are not walked together (Hugging Face's [B, H, S, D]): each row
// would gather its rotation from A table rows anew. Instead, the rotation of every distinct
// positions entry is gathered once into a table of its own, indexed by the entry's offset
// in positions, and the call becomes plain RoPE on it (no positions, offset 0). Its entries
// are copies of the table's, so the results are the same bits. Returns the gathered table.
template <typename table_t>
at::Tensor gather_mrope_rows(RotaryParams& p, at::ScalarType table_dtype) {
  // The distinct offsets into positions: the dims that step through them.
  std::vector<int64_t> offsets;
  int64_t extent = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    std::vector<int64_t> sizes, strides;
    for (int64_t d = 0; d < op.ndim; ++d) {
      if (op.pos_strides[d] != 0 && op.sizes[d] > 1) {
        sizes.push_back(op.sizes[d]);
        strides.push_back(op.pos_strides[d]);
      }
    }
    std::vector<int64_t> index(sizes.size(), 0);
    for (int64_t at = 0;;) {
      offsets.push_back(at);
      extent = std::max(extent, at + 1);
      int64_t d = static_cast<int64_t>(sizes.size()) - 1;
      for (; d >= 0 && ++index[d] == sizes[d]; --d) {
        at -= (sizes[d] - 1) * strides[d];
        index[d] = 0;
      }
      if (d < 0) {
        break;
      }
      at += strides[d];
    }
  }
  std::sort(offsets.begin(), offsets.end());
  offsets.erase(std::unique(offsets.begin(), offsets.end()), offsets.end());

  const int64_t pairs = p.rot_pairs;
  std::vector<int> axes(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    axes[i] = pair_axis(p, i);
  }
  at::Tensor gathered = at::empty({extent, pairs, 2}, at::TensorOptions().dtype(table_dtype));
  auto* out = gathered.data_ptr<table_t>();
  const auto* table = static_cast<const table_t*>(p.table);
  at::parallel_for(0, static_cast<int64_t>(offsets.size()), 64, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const int64_t at = offsets[n];
      const table_t* rows[kMaxMropeAxes];
      for (int a = 0; a < p.mrope_axes; ++a) {
        rows[a] = table + axis_position(p, at, a) * p.table_row_stride;
      }
      table_t* row = out + at * 2 * pairs;
      for (int64_t i = 0; i < pairs; ++i) {
        const table_t* entry = rows[axes[i]] + i * p.table_pair_stride;
        row[2 * i] = entry[0];
        row[2 * i + 1] = entry[p.table_cs_stride];
      }
    }
  });
  p.table = out;
  p.table_rows = extent;
  p.table_row_stride = 2 * pairs;
  p.table_pair_stride = 2;
  p.table_cs_stride = 1;
  p.positions = nullptr;
  p.offset = 0;
  p.mrope_axes = 0;
  return gathered;
}

// Prepares p for the CPU kernels: gathers an MRoPE table where a token's rows are not walked
// together (returned, to stay alive through the call) and orders the rows: the rotary
// kernel's with long sequences in tiles, the params of the tokens left over added to `rest`
// (walk_in_tiles); the fused norm kernel's (rest nullptr) with heads together.
at::Tensor prepare(RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
                   std::vector<RotaryParams>* rest) {
  at::Tensor gathered;
  if (p.mrope_axes > 0 && !tokens_innermost(p)) {
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_gather_mrope", [&] {
      gathered = gather_mrope_rows<scalar_t>(p, table_dtype);
    });
  }
  for (int o = 0; o < p.num_operands; ++o) {
    RotaryOperand& op = p.operands[o];
    const int64_t row_bytes = op.head_dim * c10::elementSize(x_dtype);
    if (rest == nullptr) {
      walk_heads_together(op, row_bytes, op.out == op.x);
    } else if (auto left = walk_in_tiles(p, o, row_bytes)) {
      rest->push_back(*left);
    }
  }
  return gathered;
}

void launch(const RotaryParams& params, at::ScalarType x_dtype, at::ScalarType table_dtype,
            c10::Device) {
  if (cuda_emulation::active()) {
    cuda_emulation::launch(params, x_dtype, table_dtype);
    return;
  }
  RotaryParams p = params;
  std::vector<RotaryParams> rest;
  const at::Tensor gathered = prepare(p, x_dtype, table_dtype, &rest);
  kernel_choice().kernel(p, x_dtype, table_dtype);
  for (const RotaryParams& tail : rest) {
    kernel_choice().kernel(tail, x_dtype, table_dtype);
  }
}

void launch_norm(const NormRotaryParams& params, bool backward, at::ScalarType x_dtype,
                 at::ScalarType table_dtype, c10::Device) {
  if (cuda_emulation::active()) {
    cuda_emulation::launch_norm(params, backward, x_dtype, table_dtype);
    return;
  }
  NormRotaryParams p = params;
  const at::Tensor gathered = prepare(p.rotary, x_dtype, table_dtype, nullptr);
  kernel_choice().norm_kernel(p, backward, x_dtype, table_dtype);
}

void check_positions(const char* op, const at::Tensor& positions, int64_t offset,
                     int64_t rows) {
  const auto [lo, hi] = at::aminmax(positions);
  const int64_t first = lo.item<int64_t>() + offset;
  const int64_t last = hi.item<int64_t>() + offset;
  TORCH_CHECK_INDEX(
      first >= 0 && last < rows, op, ": offset + positions must lie in [0, ", rows,
      ") (the rows of freqs_cis), got values in [", first, ", ", last, "]");
}

void fill_freqs_cis(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude) {
  if (cuda_emulation::active()) {
    cuda_emulation::fill_freqs_cis(out, inv_freq, magnitude);
    return;
  }
  const int64_t end = out.size(0);
  const int64_t pairs = out.size(1);
  const double* inv = inv_freq.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "rope_ext_fill_freqs_cis", [&] {
    auto* data = out.data_ptr<scalar_t>();
    const int64_t row_stride = out.stride(0), pair_stride = out.stride(1),
                  cs_stride = out.stride(2);
    at::parallel_for(0, end, std::max<int64_t>(1, 4096 / pairs), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        for (int64_t i = 0; i < pairs; ++i) {
          double c, s;
          table_entry(t, inv[i], magnitude, c, s);
          scalar_t* entry = data + t * row_stride + i * pair_stride;
          entry[0] = static_cast<scalar_t>(c);
          entry[cs_stride] = static_cast<scalar_t>(s);
        }
      }
    });
  });
}

void launch_kv_cache(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
                     c10::Device) {
  if (cuda_emulation::active()) {
    cuda_emulation::launch_kv_cache(p, x_dtype, table_dtype);
    return;
  }
  kernel_choice().kv_kernel(p, x_dtype, table_dtype);
}

// Every token's position within the table and slot below num_slots, and no non-negative slot
// twice (two tokens written to one slot would leave whichever a thread wrote last): one pass
// over the tokens' values, read where they lie.
void check_tokens(const char* op, const KvCacheParams& p, int64_t num_slots) {
  if (cuda_emulation::active()) {
    return;  // as on CUDA: the (emulated) kernel checks positions and slots itself
  }
  int64_t first = std::numeric_limits<int64_t>::max(), last = std::numeric_limits<int64_t>::min();
  int64_t top = -1;
  std::vector<int64_t> used;
  used.reserve(p.tokens);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const TokenOffsets o = token_offsets(p, t);
    if (p.rot.positions != nullptr) {
      const int64_t position = row_position(p.rot, o.pos);
      first = std::min(first, position);
      last = std::max(last, position);
    }
    const int64_t slot = token_slot(p, o.slot);
    top = std::max(top, slot);
    if (slot >= 0) {
      used.push_back(slot);
    }
  }
  TORCH_CHECK_INDEX(p.rot.positions == nullptr || p.tokens == 0 ||
                        (first >= 0 && last < p.rot.table_rows),
                    op, ": offset + positions must lie in [0, ", p.rot.table_rows,
                    ") (the rows of freqs_cis), got values in [", first, ", ", last, "]");
  TORCH_CHECK_INDEX(top < num_slots, op, ": slots must be < num_blocks * block_size = ",
                    num_slots, " (negative slots write nothing), got ", top);
  std::sort(used.begin(), used.end());
  const auto twice = std::adjacent_find(used.begin(), used.end());
  TORCH_CHECK_VALUE(twice == used.end(), op, ": slot ", twice == used.end() ? 0 : *twice,
                    " is given to two tokens of one call; each token needs its own slot");
}

constexpr Backend kCpu{&launch, &check_positions, &fill_freqs_cis};
constexpr NormBackend kCpuNorm{&launch_norm};
constexpr KvCacheBackend kCpuKv{&launch_kv_cache, &check_tokens};

}  // namespace
}  // namespace cpu

const char* cpu_kernel_name() {
  return cpu::kernel_choice().name;
}

int64_t cpu_streaming_threshold() {
  return cpu::streaming_threshold();
}

TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  m.impl("fill_freqs_cis_", &fill_freqs_cis_<cpu::kCpu>);
  m.impl("apply_rotary", &apply_rotary<cpu::kCpu>);
  m.impl("apply_rotary_", &apply_rotary_<cpu::kCpu>);
  m.impl("apply_rotary_qk", &apply_rotary_qk<cpu::kCpu>);
  m.impl("apply_rotary_qk_", &apply_rotary_qk_<cpu::kCpu>);
  m.impl("rms_norm_rotary_qk", &rms_norm_rotary_qk<cpu::kCpu, cpu::kCpuNorm>);
  m.impl("rms_norm_rotary_qk_", &rms_norm_rotary_qk_<cpu::kCpu, cpu::kCpuNorm>);
  m.impl("rms_norm_rotary_qk_backward", &rms_norm_rotary_qk_backward<cpu::kCpu, cpu::kCpuNorm>);
  m.impl("rotary_kv_cache_update",
         &rotary_kv_cache_update<cpu::kCpu, cpu::kCpuNorm, cpu::kCpuKv>);
  m.impl("rotary_kv_cache_update_",
         &rotary_kv_cache_update_<cpu::kCpu, cpu::kCpuNorm, cpu::kCpuKv>);
}

}  // namespace rope_ext
