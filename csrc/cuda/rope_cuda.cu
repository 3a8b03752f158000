// CUDA implementations of the rope_ext ops.
//
// Memory-bound design: a thread moves 16-byte chunks of a row (scalar elements when the
// features are strided or misaligned), keeps the chunk's (cos, sin) in registers and applies
// them to up to kRowsPerThread rows that share the position (the heads of one token). q and
// k are one launch; the grid is sized from the SM count; indices are 64-bit; the launch uses
// the current stream and never synchronises the host, so calls can be captured in CUDA graphs.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <vector>

#include "../rope_backend.h"
#include "../rope_build.h"

namespace rope_ext {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 4;  // rows sharing one (cos, sin) load
constexpr int kChunkBytes = 16;

template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T, int N>
struct alignas(sizeof(T) * N) Chunk {
  T v[N];
};

// How one operand's rows are split among threads: `inner` rows share a position and are
// walked by one thread (kRowsPerThread at a time); the other leading dims index the outer rows.
struct OperandShape {
  RotaryOperand outer;      // leading dims without the inner one
  int64_t inner;            // rows sharing a position (1 if none)
  int64_t inner_x_stride;
  int64_t inner_out_stride;
  int64_t inner_groups;     // ceil(inner / kRowsPerThread)
  int64_t chunks;           // work units per row: rotary chunks, then pass-through chunks
  int64_t rotary_chunks;
  int64_t items;            // outer.rows * inner_groups * chunks
};

struct LaunchParams {
  RotaryParams p;
  OperandShape shape[2];
};

template <typename scalar_t, int N, bool kVector>
struct Access {
  // Loads N elements starting at feature f (stride s) of row base b.
  __device__ __forceinline__ static void load(const scalar_t* b, int64_t f, int64_t s,
                                              opmath_t<scalar_t>* out) {
    if constexpr (kVector) {
      const Chunk<scalar_t, N> c = *reinterpret_cast<const Chunk<scalar_t, N>*>(b + f);
#pragma unroll
      for (int j = 0; j < N; ++j) out[j] = static_cast<opmath_t<scalar_t>>(c.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) out[j] = static_cast<opmath_t<scalar_t>>(b[(f + j) * s]);
    }
  }
  __device__ __forceinline__ static void store(scalar_t* b, int64_t f, int64_t s,
                                               const opmath_t<scalar_t>* in) {
    if constexpr (kVector) {
      Chunk<scalar_t, N> c;
#pragma unroll
      for (int j = 0; j < N; ++j) c.v[j] = static_cast<scalar_t>(in[j]);
      *reinterpret_cast<Chunk<scalar_t, N>*>(b + f) = c;
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) b[(f + j) * s] = static_cast<scalar_t>(in[j]);
    }
  }
};

// N elements per chunk: N/2 pairs interleaved; N pairs (N from each half) otherwise.
template <typename scalar_t, typename table_t, bool kInterleaved, int N, bool kVector>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const LaunchParams lp, int64_t total_items) {
  using opmath = opmath_t<scalar_t>;
  using Io = Access<scalar_t, N, kVector>;
  constexpr int kPairs = kInterleaved ? N / 2 : N;
  const RotaryParams& p = lp.p;
  const auto* table = static_cast<const table_t*>(p.table);

  for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       item < total_items; item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int o = item < lp.shape[0].items ? 0 : 1;
    const OperandShape& sh = lp.shape[o];
    const RotaryOperand& op = p.operands[o];
    int64_t local = o == 0 ? item : item - lp.shape[0].items;
    const int64_t chunk = local % sh.chunks;
    local /= sh.chunks;
    const int64_t group = local % sh.inner_groups;
    const int64_t outer_row = local / sh.inner_groups;

    const RowOffsets off = row_offsets(sh.outer, outer_row);
    const int64_t first = group * kRowsPerThread;
    const int64_t last = min(first + kRowsPerThread, sh.inner);
    const auto* x = static_cast<const scalar_t*>(op.x) + off.x + first * sh.inner_x_stride;
    auto* out = static_cast<scalar_t*>(op.out) + off.out + first * sh.inner_out_stride;
    const int64_t xs = op.x_feature_stride, os = op.out_feature_stride;

    if (chunk >= sh.rotary_chunks) {  // pass-through features, out-of-place calls only
      const int64_t f = 2 * p.rot_pairs + (chunk - sh.rotary_chunks) * N;
      const int64_t count = min(static_cast<int64_t>(N), op.head_dim - f);
      for (int64_t r = first; r < last; ++r) {
        if constexpr (kVector) {  // whole chunks: vectorisable() checked the sizes
          *reinterpret_cast<Chunk<scalar_t, N>*>(out + f) =
              *reinterpret_cast<const Chunk<scalar_t, N>*>(x + f);
        } else {
          for (int64_t j = 0; j < count; ++j) {
            out[(f + j) * os] = x[(f + j) * xs];
          }
        }
        x += sh.inner_x_stride;
        out += sh.inner_out_stride;
      }
      continue;
    }

    const int64_t position = row_position(p, off.pos);
    CUDA_KERNEL_ASSERT_MSG(position >= 0 && position < p.table_rows,
                           "rope_ext: offset + positions must lie in [0, rows of freqs_cis)");
    const table_t* entry = table + position * p.table_row_stride;
    const int64_t pair0 = chunk * kPairs;
    opmath c[kPairs], s[kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const table_t* e = entry + (pair0 + j) * p.table_pair_stride;
      c[j] = static_cast<opmath>(e[0]);
      s[j] = static_cast<opmath>(p.inverse ? -e[p.table_cs_stride] : e[p.table_cs_stride]);
    }

    for (int64_t r = first; r < last; ++r) {
      if constexpr (kInterleaved) {
        opmath v[N];
        Io::load(x, 2 * pair0, xs, v);
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          rotate_pair(v[2 * j], v[2 * j + 1], c[j], s[j], v[2 * j], v[2 * j + 1]);
        }
        Io::store(out, 2 * pair0, os, v);
      } else {
        opmath a[N], b[N];
        Io::load(x, pair0, xs, a);
        Io::load(x, pair0 + p.rot_pairs, xs, b);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          rotate_pair(a[j], b[j], c[j], s[j], a[j], b[j]);
        }
        Io::store(out, pair0, os, a);
        Io::store(out, pair0 + p.rot_pairs, os, b);
      }
      x += sh.inner_x_stride;
      out += sh.inner_out_stride;
    }
  }
}

__global__ void fill_freqs_cis_kernel(float* f32, double* f64, const double* inv_freq,
                                      double magnitude, int64_t end, int64_t pairs,
                                      int64_t row_stride, int64_t pair_stride,
                                      int64_t cs_stride) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end * pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / pairs, pair = i % pairs;
    double c, s;
    table_entry(t, inv_freq[pair], magnitude, c, s);
    const int64_t at = t * row_stride + pair * pair_stride;
    if (f32 != nullptr) {
      f32[at] = static_cast<float>(c);
      f32[at + cs_stride] = static_cast<float>(s);
    } else {
      f64[at] = c;
      f64[at + cs_stride] = s;
    }
  }
}

int sm_count(int device) {
  static std::mutex mutex;
  static std::vector<int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(counts.size())) {
    counts.resize(device + 1, 0);
  }
  if (counts[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

int64_t grid_for(int64_t items, int device) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{sm_count(device)} * 8));
}

// Splits off the innermost leading dim as the rows sharing a position, when it has one.
OperandShape shape_of(const RotaryOperand& op, int64_t rot_pairs, int n, bool interleaved) {
  OperandShape sh{};
  sh.outer = op;
  sh.inner = 1;
  if (op.ndim > 0 && op.pos_strides[op.ndim - 1] == 0) {
    sh.inner = op.sizes[op.ndim - 1];
    sh.inner_x_stride = op.x_strides[op.ndim - 1];
    sh.inner_out_stride = op.out_strides[op.ndim - 1];
    sh.outer.ndim = op.ndim - 1;
    sh.outer.rows = op.rows / sh.inner;
  }
  sh.inner_groups = (sh.inner + kRowsPerThread - 1) / kRowsPerThread;
  const int64_t pairs_per_chunk = interleaved ? n / 2 : n;
  sh.rotary_chunks = rot_pairs / pairs_per_chunk;
  const int64_t pass = op.out != op.x ? op.head_dim - 2 * rot_pairs : 0;
  sh.chunks = sh.rotary_chunks + (pass + n - 1) / n;
  sh.items = sh.outer.rows * sh.inner_groups * sh.chunks;
  return sh;
}

// Whether every row start and the feature layout allow aligned 16-byte chunks of n elements.
bool vectorisable(const RotaryParams& p, int64_t n, size_t elem) {
  for (int o = 0; o < p.num_operands; ++o) {
    const RotaryOperand& op = p.operands[o];
    const int64_t pass = op.head_dim - 2 * p.rot_pairs;
    bool ok = op.x_feature_stride == 1 && op.out_feature_stride == 1 &&
              (p.interleaved ? (2 * p.rot_pairs) % n == 0 : p.rot_pairs % n == 0) &&
              pass % n == 0 &&
              reinterpret_cast<uintptr_t>(op.x) % (n * elem) == 0 &&
              reinterpret_cast<uintptr_t>(op.out) % (n * elem) == 0;
    for (int64_t d = 0; ok && d < op.ndim; ++d) {
      ok = op.x_strides[d] % n == 0 && op.out_strides[d] % n == 0;
    }
    if (!ok) {
      return false;
    }
  }
  return true;
}

template <typename scalar_t, typename table_t, bool kInterleaved, int N, bool kVector>
void launch_typed(const RotaryParams& p, int device) {
  LaunchParams lp{};
  lp.p = p;
  int64_t total = 0;
  for (int o = 0; o < p.num_operands; ++o) {
    lp.shape[o] = shape_of(p.operands[o], p.rot_pairs, N, kInterleaved);
    total += lp.shape[o].items;
  }
  if (total == 0) {
    return;
  }
  rotary_kernel<scalar_t, table_t, kInterleaved, N, kVector>
      <<<grid_for(total, device), kThreads, 0, c10::cuda::getCurrentCUDAStream(device)>>>(lp,
                                                                                         total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename table_t, bool kInterleaved>
void launch_layout(const RotaryParams& p, int device) {
  constexpr int kVec = kChunkBytes / sizeof(scalar_t);
  if (vectorisable(p, kVec, sizeof(scalar_t))) {
    launch_typed<scalar_t, table_t, kInterleaved, kVec, true>(p, device);
  } else {
    // One pair per chunk; pass-through features go one element at a time.
    launch_typed<scalar_t, table_t, kInterleaved, kInterleaved ? 2 : 1, false>(p, device);
  }
}

void launch(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
            c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_dtype, "rope_ext_cuda", [&] {
    using row_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(table_dtype, "rope_ext_cuda_table", [&] {
      if (p.interleaved) {
        launch_layout<row_t, scalar_t, true>(p, device.index());
      } else {
        launch_layout<row_t, scalar_t, false>(p, device.index());
      }
    });
  });
}

void fill_freqs_cis(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t items = out.size(0) * out.size(1);
  const bool f32 = out.scalar_type() == at::kFloat;
  fill_freqs_cis_kernel<<<grid_for(items, out.device().index()), kThreads, 0,
                          c10::cuda::getCurrentCUDAStream(out.device().index())>>>(
      f32 ? out.data_ptr<float>() : nullptr, f32 ? nullptr : out.data_ptr<double>(),
      inv_freq.data_ptr<double>(), magnitude, out.size(0), out.size(1), out.stride(0),
      out.stride(1), out.stride(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Positions are checked in the kernel (a device-side assert), never by reading them back.
constexpr Backend kCuda{&launch, nullptr, &fill_freqs_cis};

}  // namespace
}  // namespace cuda

std::string cuda_archs() {
#if defined(__CUDA_ARCH_LIST__)
  // e.g. 800,860,900: the archs nvcc compiled device code for.
  std::ostringstream s;
  const int archs[] = {__CUDA_ARCH_LIST__};
  for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); ++i) {
    s << (i ? " " : "") << "sm_" << archs[i] / 10;
  }
  return s.str();
#else
  return "unknown";
#endif
}

TORCH_LIBRARY_IMPL(rope_ext, CUDA, m) {
  m.impl("fill_freqs_cis_", &fill_freqs_cis_<cuda::kCuda>);
  m.impl("apply_rotary", &apply_rotary<cuda::kCuda>);
  m.impl("apply_rotary_", &apply_rotary_<cuda::kCuda>);
  m.impl("apply_rotary_qk", &apply_rotary_qk<cuda::kCuda>);
  m.impl("apply_rotary_qk_", &apply_rotary_qk_<cuda::kCuda>);
}

}  // namespace rope_ext
