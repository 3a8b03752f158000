// The CUDA kernels run on the host: every block and thread of the launch plan the CUDA
// launcher would use, through the same thread functions (rope_cuda_kernel.h), with each
// memory access checked. Built in every configuration, so CPU-only machines test the GPU code.
//
// Turned on by torch.ops.rope_ext._cuda_emulation(sm_count, blocks_per_sm): the CPU ops then
// launch the emulated CUDA kernels instead of the CPU kernels, on the same checked arguments.
// A launch fails (RuntimeError) when a thread
//   - reads anything but an element of x, the table or positions, or an element of out that
//     some thread already wrote, or writes one another thread read (races on a GPU);
//   - makes a 16-byte access at an address that is not 16-byte aligned;
//   - writes anything but an element of out;
// and, after the launch, unless every element of out was written exactly once (pass-through
// features of an in-place call: never). The fused KV-cache write's "out" is q's output and
// both caches: the rows of the call's slots once each, every other slot never.
#include "rope_cuda_emulate.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "qk_norm_cuda_dispatch.h"
#include "rope_cuda_dispatch.h"

namespace rope_ext {
namespace cuda_emulation {
namespace {

using cuda_kernel::Bits128;
using cuda_kernel::kChunkBytes;
using cuda_kernel::kThreads;

std::atomic<int64_t> g_sm_count{0};
std::atomic<int64_t> g_blocks_per_sm{0};
std::mutex g_log_mutex;
std::string g_log;

void log_line(const std::string& line) {
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  g_log += line + "\n";
}

// Global memory as one kernel launch may touch it.
class CheckedMem {
 public:
  // The elements of a tensor (element address -> size in bytes) a thread may read.
  void allow_read(const void* p, size_t size) {
    readable_[reinterpret_cast<uintptr_t>(p)] = static_cast<uint8_t>(size);
  }
  // An element of a scratch buffer (the norm kernels' weight-gradient partials): read and
  // written any number of times, by one thread only.
  void allow_scratch(void* p, size_t size) {
    scratch_[reinterpret_cast<uintptr_t>(p)] = Scratch{static_cast<uint8_t>(size), -1};
  }
  // An element of out, and how many times the launch must write it (0 or 1).
  void expect_write(void* p, size_t size, int expected) {
    auto& w = writes_[reinterpret_cast<uintptr_t>(p)];
    w.size = static_cast<uint8_t>(size);
    w.expected = expected;
  }
  void at(int64_t block, int32_t thread) {
    block_ = block;
    thread_ = thread;
  }

  template <typename T>
  T load(const T* p) {
    check_read(reinterpret_cast<uintptr_t>(p), sizeof(T));
    return *p;
  }
  template <typename T>
  void store(T* p, T v) {
    check_write(reinterpret_cast<uintptr_t>(p), sizeof(T));
    *p = v;
  }
  Bits128 load128(const void* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    check_aligned(a, "load");
    for (uintptr_t e = a; e < a + kChunkBytes;) {
      e += check_read(e, 0);
    }
    Bits128 b;
    memcpy(&b, p, sizeof(b));
    return b;
  }
  void store128(void* p, const Bits128& b) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    check_aligned(a, "store");
    for (uintptr_t e = a; e < a + kChunkBytes;) {
      e += check_write(e, 0);
    }
    memcpy(p, &b, sizeof(b));
  }
  // The first N bytes of b in one store of N bytes (a float8 cache row's chunk).
  template <int N>
  void store_bytes(void* p, const Bits128& b) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    TORCH_CHECK(a % N == 0, where(), " made a ", N, "-byte store at an address ", a % N,
                " bytes past a ", N, "-byte boundary");
    for (uintptr_t e = a; e < a + N;) {
      e += check_write(e, 0);
    }
    memcpy(p, &b, N);
  }
  void check_position(bool ok) {
    TORCH_CHECK(ok, where(), " read a position outside [0, rows of freqs_cis)");
  }
  void check_slot(bool ok) {
    TORCH_CHECK(ok, where(), " read a slot at or beyond num_blocks * block_size");
  }

  // Raises unless every element of out was written as often as expected.
  void check_all_written() const {
    for (const auto& [address, w] : writes_) {
      TORCH_CHECK(w.writes == w.expected, "CUDA emulation: the element of out at byte ",
                  address - first_out(), " was written ", w.writes, " times, expected ",
                  w.expected);
    }
  }
  size_t reads() const { return reads_; }
  size_t writes() const { return stores_; }

 private:
  struct Write {
    uint8_t size = 0;
    int expected = 0;
    int writes = 0;
    int64_t reader = -1;        // the thread that read it (in place), if one did
    bool many_readers = false;  // more than one thread read it
  };

  int64_t thread_id() const { return block_ * kThreads + thread_; }

  std::string where() const {
    std::ostringstream s;
    s << "CUDA emulation: block " << block_ << ", thread " << thread_;
    return s.str();
  }
  void check_aligned(uintptr_t a, const char* what) const {
    TORCH_CHECK(a % kChunkBytes == 0, where(), " made a 16-byte ", what, " at an address ",
                a % kChunkBytes, " bytes past a 16-byte boundary");
  }
  // The size of the element at a (size: what the access expects, 0 = any), or raises.
  size_t check_read(uintptr_t a, size_t size) {
    if (const size_t s = check_scratch(a, size)) {
      return s;
    }
    const auto w = writes_.find(a);
    if (w != writes_.end()) {  // in place: x and out are the same elements
      TORCH_CHECK(w->second.writes == 0, where(),
                  " read an element of out that was already written (a race on a GPU)");
      w->second.many_readers |= w->second.reader >= 0 && w->second.reader != thread_id();
      w->second.reader = thread_id();
    }
    const auto r = readable_.find(a);
    TORCH_CHECK(r != readable_.end() && (size == 0 || r->second == size), where(),
                " read outside x, freqs_cis and positions (", size == 0 ? 16 : size,
                " bytes at address ", a, ")");
    ++reads_;
    return r->second;
  }
  size_t check_write(uintptr_t a, size_t size) {
    if (const size_t s = check_scratch(a, size)) {
      ++stores_;
      return s;
    }
    const auto w = writes_.find(a);
    TORCH_CHECK(w != writes_.end() && (size == 0 || w->second.size == size), where(),
                " wrote outside out (", size == 0 ? 16 : size, " bytes at address ", a, ")");
    // Whichever thread runs first on a GPU, an element read by another thread than its
    // writer is a race (the emulation runs threads in one order and would not see it).
    TORCH_CHECK(!w->second.many_readers &&
                    (w->second.reader < 0 || w->second.reader == thread_id()),
                where(), " wrote an element of out that another thread read (a race on a GPU)");
    ++w->second.writes;
    ++stores_;
    return w->second.size;
  }
  // The size of the scratch element at a (0: not scratch); raises if another thread owns it.
  size_t check_scratch(uintptr_t a, size_t size) {
    const auto s = scratch_.find(a);
    if (s == scratch_.end()) {
      return 0;
    }
    TORCH_CHECK(size == 0 || s->second.size == size, where(), " accessed a scratch element of ",
                static_cast<int>(s->second.size), " bytes as one of ", size);
    TORCH_CHECK(s->second.owner < 0 || s->second.owner == thread_id(), where(),
                " accessed a scratch element of another thread (a race on a GPU)");
    s->second.owner = thread_id();
    return s->second.size;
  }
  uintptr_t first_out() const {
    uintptr_t first = UINTPTR_MAX;
    for (const auto& entry : writes_) first = std::min(first, entry.first);
    return first;
  }

  std::unordered_map<uintptr_t, uint8_t> readable_;
  std::unordered_map<uintptr_t, Write> writes_;
  struct Scratch {
    uint8_t size;
    int64_t owner;
  };
  std::unordered_map<uintptr_t, Scratch> scratch_;
  int64_t block_ = -1;
  int32_t thread_ = -1;
  size_t reads_ = 0;
  size_t stores_ = 0;
};

// Registers the elements a rotary launch may read and must write.
void map_memory(CheckedMem& mem, const RotaryParams& p, size_t elem, size_t table_elem) {
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    const auto* x = static_cast<const char*>(op.x);
    auto* out = static_cast<char*>(op.out);
    for (int64_t row = 0; row < op.rows; ++row) {
      const RowOffsets off = row_offsets(op, row);
      for (int64_t f = 0; f < op.head_dim; ++f) {
        mem.allow_read(x + (off.x + f * op.x_feature_stride) * elem, elem);
        const bool rotated = f < 2 * p.rot_pairs;
        mem.expect_write(out + (off.out + f * op.out_feature_stride) * elem, elem,
                         rotated || op.out != op.x ? 1 : 0);
      }
      if (p.positions != nullptr) {
        const size_t pos_elem = p.positions_int64 ? 8 : 4;
        for (int a = 0; a < std::max(p.mrope_axes, 1); ++a) {
          mem.allow_read(static_cast<const char*>(p.positions) +
                             (off.pos + a * p.mrope_axis_stride) * pos_elem,
                         pos_elem);
        }
      }
    }
  }
  const auto* table = static_cast<const char*>(p.table);
  for (int64_t t = 0; t < p.table_rows; ++t) {
    for (int64_t i = 0; i < p.rot_pairs; ++i) {
      const int64_t at = t * p.table_row_stride + i * p.table_pair_stride;
      mem.allow_read(table + at * table_elem, table_elem);
      mem.allow_read(table + (at + p.table_cs_stride) * table_elem, table_elem);
    }
  }
}

template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, bool kMrope,
          typename index_t>
struct EmulateRotary {
  static void run(const RotaryParams& p) {
    const cuda_kernel::LaunchPlan plan = cuda_kernel::plan_rotary(
        p, sizeof(scalar_t), sizeof(table_t), g_sm_count.load(), g_blocks_per_sm.load());
    TORCH_INTERNAL_ASSERT(plan.vector == kVector && plan.wide_index == (sizeof(index_t) == 8));
    CheckedMem mem;
    map_memory(mem, p, sizeof(scalar_t), sizeof(table_t));
    for (int64_t block = 0; block < plan.grid; ++block) {
      for (int32_t thread = 0; thread < kThreads; ++thread) {
        mem.at(block, thread);
        cuda_kernel::rotary_thread<scalar_t, table_t, kInterleaved, kVector, kMrope, index_t>(
            plan.k, block, thread, plan.grid, mem);
      }
    }
    mem.check_all_written();
    const cuda_kernel::KernelParams& k = plan.k;
    std::ostringstream s;
    s << "rotary vector=" << kVector << " mrope=" << kMrope << " index=" << 8 * sizeof(index_t)
      << " interleaved=" << kInterleaved << " grid=" << plan.grid << " blocks=" << k.blocks
      << " lane_threads=" << k.lane_threads;
    for (int o = 0; o < p.num_operands; ++o) {
      s << " op" << o << "=(heads=" << k.op[o].heads << " tokens=" << k.op[o].tokens
        << " lanes=" << k.op[o].lanes << " groups=" << k.op[o].groups
        << " rows_per_thread=" << k.op[o].rows_per_thread
        << " tokens_per_block=" << k.op[o].tokens_per_block << ")";
    }
    s << " reads=" << mem.reads() << " writes=" << mem.writes();
    log_line(s.str());
  }
};

// Registers what a norm launch may read and must write: the rotary operands' memory with
// every feature written once (the pass-through ones too, normalised), the weights, the
// forward's input (backward, at x's offsets) and the weight-gradient partials.
void map_norm_memory(CheckedMem& mem, const cuda_kernel::NormKernelParams& k, size_t elem,
                     size_t table_elem) {
  const NormRotaryParams& n = k.n;
  const RotaryParams& p = n.rotary;
  map_memory(mem, p, elem, table_elem);
  const size_t opmath_elem = elem == 8 ? 8 : 4;
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    for (int64_t row = 0; row < op.rows; ++row) {
      const RowOffsets off = row_offsets(op, row);
      for (int64_t f = 0; f < op.head_dim; ++f) {
        mem.expect_write(static_cast<char*>(op.out) + (off.out + f * op.out_feature_stride) * elem,
                         elem, 1);
        if (n.input[o] != nullptr) {
          mem.allow_read(static_cast<const char*>(n.input[o]) +
                             (off.x + f * op.x_feature_stride) * elem,
                         elem);
        }
      }
    }
    const size_t weight_elem = n.weight_float[o] ? 4 : elem;
    for (int64_t f = 0; f < op.head_dim; ++f) {
      mem.allow_read(static_cast<const char*>(n.weight[o]) + f * n.weight_stride[o] * weight_elem,
                     weight_elem);
    }
    if (k.partial[o] != nullptr) {
      for (int64_t e = 0; e < k.groups * op.head_dim; ++e) {
        mem.allow_scratch(static_cast<char*>(k.partial[o]) + e * opmath_elem, opmath_elem);
      }
    }
  }
}

template <typename scalar_t, bool kInterleaved, bool kVector, bool kBackward, bool kMrope>
struct EmulateNorm {
  // Each warp as the GPU runs it: load() on its 32 lanes, the butterfly over each group's
  // lanes in the kernel's order, then finish().
  static void run(const NormRotaryParams& p, at::ScalarType table_dtype) {
    using Thread =
        cuda_kernel::NormRowThread<scalar_t, kInterleaved, kVector, kBackward, kMrope>;
    using opmath = typename Thread::opmath;
    constexpr int kWarp = cuda_kernel::kNormMaxGroup;
    TORCH_INTERNAL_ASSERT(p.rotary.inverse == kBackward);  // as the CUDA launcher
    cuda_kernel::NormLaunchPlan plan =
        cuda_kernel::plan_norm(p, sizeof(scalar_t), table_dtype == at::kDouble, kBackward,
                               g_sm_count.load(), g_blocks_per_sm.load());
    TORCH_INTERNAL_ASSERT(plan.vector == kVector);
    constexpr auto x_dtype = c10::CppTypeToScalarType<scalar_t>::value;
    at::Tensor partials, vector_inputs[3];
    if (kVector) {
      cuda_kernel::make_norm_vector_inputs(plan, x_dtype, table_dtype, c10::Device(c10::kCPU),
                                           vector_inputs);
    }
    if (kBackward) {
      partials = cuda_kernel::make_norm_partials(plan, x_dtype, c10::Device(c10::kCPU));
    }
    const cuda_kernel::NormKernelParams& k = plan.k;
    CheckedMem mem;
    map_norm_memory(mem, k, sizeof(scalar_t), k.table_double ? sizeof(double) : sizeof(float));
    for (int64_t block = 0; block < plan.grid; ++block) {
      for (int32_t warp = 0; warp < kThreads; warp += kWarp) {
        std::vector<Thread> lanes;
        for (int32_t l = 0; l < kWarp; ++l) {
          lanes.emplace_back(k, block, warp + l);
        }
        const int64_t iterations = lanes[0].iterations(k);
        for (int32_t l = 0; l < kWarp; ++l) {
          TORCH_INTERNAL_ASSERT(lanes[l].iterations(k) == iterations);
        }
        for (int64_t it = 0; it < iterations; ++it) {
          opmath sums[kWarp][Thread::kSumCount];
          for (int32_t l = 0; l < kWarp; ++l) {
            mem.at(block, warp + l);
            lanes[l].load(k, it, mem, sums[l]);
          }
          for (int32_t offset = k.group / 2; offset > 0; offset /= 2) {
            opmath before[kWarp][Thread::kSumCount];
            memcpy(before, sums, sizeof(sums));
            for (int32_t l = 0; l < kWarp; ++l) {
              for (int s = 0; s < Thread::kSumCount; ++s) {
                sums[l][s] = cuda_kernel::butterfly_add(before[l][s], before[l ^ offset][s]);
              }
            }
          }
          for (int32_t l = 0; l < kWarp; ++l) {
            mem.at(block, warp + l);
            lanes[l].finish(k, sums[l], mem);
          }
        }
      }
    }
    mem.check_all_written();
    if (kBackward) {
      cuda_kernel::write_norm_weight_grads(p, x_dtype, partials);
    }
    std::ostringstream s;
    s << "norm vector=" << kVector << " interleaved=" << kInterleaved
      << " backward=" << kBackward << " mrope=" << (p.rotary.mrope_axes > 0)
      << " grid=" << plan.grid << " group=" << k.group << " groups=" << k.groups
      << " rows_per_item=" << Thread::kRows;
    for (int o = 0; o < p.rotary.num_operands; ++o) {
      s << " op" << o << "=(rows=" << p.rotary.operands[o].rows << " items=" << k.items[o]
        << " lanes=" << k.lanes[o] << ")";
    }
    s << " reads=" << mem.reads() << " writes=" << mem.writes();
    log_line(s.str());
  }
};

// Registers what a KV-cache launch may read (q, k and v rows, positions, slots, scales, the
// table) and must write: each rotated q element once (pass-through ones once out of place,
// never in place), and every element of both caches once where a token's slot is, never
// elsewhere (a slot two tokens share is written twice: the race the check reports).
void map_kv_memory(CheckedMem& mem, const KvCacheParams& p, size_t elem, size_t table_elem) {
  const RotaryParams& r = p.rot;
  std::vector<int64_t> written_slots;
  const size_t pos_elem = r.positions_int64 ? 8 : 4;
  const size_t slot_elem = p.slots_int64 ? 8 : 4;
  for (int64_t t = 0; t < p.tokens; ++t) {
    const TokenOffsets o = token_offsets(p, t);
    if (p.q != nullptr) {
      for (int64_t h = 0; h < p.q_heads; ++h) {
        const char* q = static_cast<const char*>(p.q) + (o.q + h * p.q_head_stride) * elem;
        char* out = static_cast<char*>(p.q_out) + (o.q_out + h * p.q_out_head_stride) * elem;
        for (int64_t f = 0; f < p.head_dim; ++f) {
          mem.allow_read(q + f * elem, elem);
          mem.expect_write(out + f * elem, elem,
                           f < 2 * r.rot_pairs || p.q_out != p.q ? 1 : 0);
        }
      }
    }
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      if (p.k != nullptr) {
        const char* k = static_cast<const char*>(p.k) + (o.k + h * p.k_head_stride) * elem;
        for (int64_t f = 0; f < p.head_dim; ++f) mem.allow_read(k + f * elem, elem);
      }
      if (p.v != nullptr) {
        const char* v = static_cast<const char*>(p.v) + (o.v + h * p.v_head_stride) * elem;
        for (int64_t f = 0; f < p.v_cache.head_dim; ++f) mem.allow_read(v + f * elem, elem);
      }
    }
    if (r.positions != nullptr) {
      mem.allow_read(static_cast<const char*>(r.positions) + o.pos * pos_elem, pos_elem);
    }
    if (p.k != nullptr || p.v != nullptr) {
      mem.allow_read(static_cast<const char*>(p.slots) + o.slot * slot_elem, slot_elem);
      const int64_t slot = token_slot(p, o.slot);
      if (slot >= 0 && slot < p.num_slots) written_slots.push_back(slot);
    }
  }
  const auto* table = static_cast<const char*>(r.table);
  for (int64_t t = 0; t < r.table_rows; ++t) {
    for (int64_t i = 0; i < r.rot_pairs; ++i) {
      const int64_t at = t * r.table_row_stride + i * r.table_pair_stride;
      mem.allow_read(table + at * table_elem, table_elem);
      mem.allow_read(table + (at + r.table_cs_stride) * table_elem, table_elem);
    }
  }
  std::vector<int> writes(p.num_slots, 0);
  for (const int64_t slot : written_slots) ++writes[slot];
  for (const auto& [c, source] : {std::pair<const CacheTarget*, const void*>{&p.k_cache, p.k},
                                  {&p.v_cache, p.v}}) {
    const size_t cache_elem = c->store == CacheStore::kSame ? elem : 1;
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      if (c->store != CacheStore::kSame) {
        mem.allow_read(c->scale + h * c->scale_stride, sizeof(float));
      }
      for (int64_t slot = 0; slot < p.num_slots; ++slot) {
        char* row = static_cast<char*>(c->data) +
                    (cache_row(*c, slot, p.block_size) + h * c->head_stride) * cache_elem;
        for (int64_t f = 0; f < c->head_dim; ++f) {
          // A slot two tokens share expects one write and gets two: reported.
          mem.expect_write(row + f * cache_elem, cache_elem,
                           source != nullptr && writes[slot] > 0 ? 1 : 0);
        }
      }
    }
  }
}

template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, typename index_t>
struct EmulateKvCache {
  static void run(const KvCacheParams& p) {
    const cuda_kernel::KvLaunchPlan plan = cuda_kernel::plan_kv_cache(
        p, sizeof(scalar_t), sizeof(table_t), g_sm_count.load(), g_blocks_per_sm.load());
    TORCH_INTERNAL_ASSERT(plan.vector == kVector && plan.wide_index == (sizeof(index_t) == 8));
    CheckedMem mem;
    map_kv_memory(mem, p, sizeof(scalar_t), sizeof(table_t));
    if (plan.k.items > 0) {
      for (int64_t block = 0; block < plan.grid; ++block) {
        for (int32_t thread = 0; thread < kThreads; ++thread) {
          mem.at(block, thread);
          cuda_kernel::kv_cache_thread<scalar_t, table_t, kInterleaved, kVector, index_t>(
              plan.k, block * kThreads + thread, plan.grid * kThreads, mem);
        }
      }
    }
    mem.check_all_written();
    const cuda_kernel::KvKernelParams& k = plan.k;
    std::ostringstream s;
    s << "kv_cache vector=" << kVector << " index=" << 8 * sizeof(index_t)
      << " interleaved=" << kInterleaved << " grid=" << plan.grid << " items=" << k.items
      << " lanes=" << k.lanes << " rows=(" << k.q_rows << " " << k.k_rows << " " << k.v_rows
      << ") row_lanes=(" << k.q_lanes << " " << k.k_lanes << " " << k.v_lanes
      << ") rotary_lanes=" << k.rotary_lanes << " reads=" << mem.reads()
      << " writes=" << mem.writes();
    log_line(s.str());
  }
};

std::string set_emulation(int64_t sm_count, int64_t blocks_per_sm) {
  TORCH_CHECK_VALUE(sm_count >= 0 && blocks_per_sm >= 1,
                    "_cuda_emulation: sm_count must be >= 0 and blocks_per_sm >= 1, got ",
                    sm_count, " and ", blocks_per_sm);
  g_blocks_per_sm = blocks_per_sm;
  g_sm_count = sm_count;
  const std::lock_guard<std::mutex> lock(g_log_mutex);
  std::string log;
  log.swap(g_log);
  return log;
}

}  // namespace

bool active() {
  return g_sm_count.load(std::memory_order_relaxed) > 0;
}

void launch(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype) {
  cuda_kernel::dispatch_rotary<EmulateRotary>(p, x_dtype, table_dtype);
}

void fill_freqs_cis(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude) {
  const int64_t end = out.size(0), pairs = out.size(1);
  const int64_t threads = kThreads * cuda_kernel::fill_grid(end * pairs, g_sm_count.load());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "rope_ext_emulate_fill", [&] {
    CheckedMem mem;
    auto* data = out.data_ptr<scalar_t>();
    for (int64_t t = 0; t < end; ++t) {
      for (int64_t i = 0; i < pairs; ++i) {
        scalar_t* entry = data + t * out.stride(0) + i * out.stride(1);
        mem.expect_write(entry, sizeof(scalar_t), 1);
        mem.expect_write(entry + out.stride(2), sizeof(scalar_t), 1);
      }
    }
    const double* inv = inv_freq.data_ptr<double>();
    for (int64_t i = 0; i < pairs; ++i) {
      mem.allow_read(inv + i, sizeof(double));
    }
    for (int64_t thread = 0; thread < threads; ++thread) {
      mem.at(thread / kThreads, static_cast<int32_t>(thread % kThreads));
      cuda_kernel::fill_freqs_cis_thread(data, inv, magnitude, end, pairs, out.stride(0),
                                         out.stride(1), out.stride(2), thread, threads, mem);
    }
    mem.check_all_written();
  });
  log_line("fill_freqs_cis threads=" + std::to_string(threads));
}

void launch_norm(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                 at::ScalarType table_dtype) {
  cuda_kernel::dispatch_norm<EmulateNorm>(p, backward, x_dtype, table_dtype);
}

void launch_kv_cache(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype) {
  cuda_kernel::dispatch_kv_cache<EmulateKvCache>(p, x_dtype, table_dtype);
}

}  // namespace cuda_emulation

TORCH_LIBRARY_IMPL(rope_ext, CompositeExplicitAutograd, m) {
  m.impl("_cuda_emulation", &cuda_emulation::set_emulation);
}

}  // namespace rope_ext
