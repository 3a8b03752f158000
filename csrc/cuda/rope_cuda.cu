// CUDA implementations of the rope_ext ops: thin kernels over the thread functions of
// rope_cuda_kernel.h (the design is described there), launched on the current stream without
// synchronising the host, so that calls can be captured in CUDA graphs.
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

#include "../kv_cache_ops.h"
#include "../qk_norm_ops.h"
#include "../rope_backend.h"
#include "../rope_build.h"
#include "qk_norm_cuda_dispatch.h"
#include "rope_cuda_dispatch.h"

namespace rope_ext {
namespace cuda {
namespace {

using cuda_kernel::Bits128;
using cuda_kernel::kThreads;

// Plain global memory accesses, and the device-side position check.
struct DeviceMem {
  template <typename T>
  __device__ __forceinline__ T load(const T* p) const {
    return *p;
  }
  template <typename T>
  __device__ __forceinline__ void store(T* p, T v) const {
    *p = v;
  }
  __device__ __forceinline__ Bits128 load128(const void* p) const {
    const uint4 v = *static_cast<const uint4*>(p);
    return {{v.x, v.y, v.z, v.w}};
  }
  // One 16-byte store, spelt out: with 64-bit offsets NVVM split a uint4 store into four
  // 32-bit ones. "memory": no load may move across it (in place, x and out are the same).
  __device__ __forceinline__ void store128(void* p, const Bits128& b) const {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(b.w[0]), "r"(b.w[1]),
                 "r"(b.w[2]), "r"(b.w[3])
                 : "memory");
  }
  // The first N bytes of b (N = 8, 4 or 2: a float8 cache row's chunk), in one store.
  template <int N>
  __device__ __forceinline__ void store_bytes(void* p, const Bits128& b) const {
    static_assert(N == 8 || N == 4 || N == 2, "a store of 8, 4 or 2 bytes");
    if constexpr (N == 8) {
      asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(b.w[0]), "r"(b.w[1])
                   : "memory");
    } else if constexpr (N == 4) {
      *static_cast<uint32_t*>(p) = b.w[0];
    } else {
      *static_cast<uint16_t*>(p) = static_cast<uint16_t>(b.w[0]);
    }
  }
  __device__ __forceinline__ void check_position(bool ok) const {
    CUDA_KERNEL_ASSERT_MSG(ok, "rope_ext: offset + positions must lie in [0, rows of freqs_cis)");
  }
  __device__ __forceinline__ void check_slot(bool ok) const {
    CUDA_KERNEL_ASSERT_MSG(ok, "rope_ext: slots must be < num_blocks * block_size");
  }
};

template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, bool kMrope,
          typename index_t>
__global__ void __launch_bounds__(kThreads, cuda_kernel::min_blocks_per_sm(kVector, kMrope))
    rotary_kernel(const cuda_kernel::KernelParams kp) {
  DeviceMem mem;
  cuda_kernel::rotary_thread<scalar_t, table_t, kInterleaved, kVector, kMrope, index_t>(
      kp, blockIdx.x, threadIdx.x, gridDim.x, mem);
}

// Fused RMSNorm + RoPE: each row's two stages around the group's butterfly (a shuffle every
// lane of the warp takes part in: NormRowThread::iterations() is the warp's).
template <typename scalar_t, bool kInterleaved, bool kVector, bool kBackward, bool kMrope>
__global__ void __launch_bounds__(kThreads, cuda_kernel::kNormMinBlocks)
    norm_rotary_kernel(const __grid_constant__ cuda_kernel::NormKernelParams kp) {
  using Thread = cuda_kernel::NormRowThread<scalar_t, kInterleaved, kVector, kBackward, kMrope>;
  DeviceMem mem;
  Thread t(kp, blockIdx.x, threadIdx.x);
  const int64_t iterations = t.iterations(kp);
#pragma unroll 1
  for (int64_t it = 0; it < iterations; ++it) {
    typename Thread::opmath sums[Thread::kSumCount];
    t.load(kp, it, mem, sums);
#pragma unroll 1
    for (int offset = kp.group / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int s = 0; s < Thread::kSumCount; ++s) {
        sums[s] = cuda_kernel::butterfly_add(sums[s], __shfl_xor_sync(0xffffffffu, sums[s], offset));
      }
    }
    t.finish(kp, sums, mem);
  }
}

// The fused RoPE + KV-cache write: each thread strides over the items of the plan.
template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, typename index_t>
__global__ void __launch_bounds__(kThreads, cuda_kernel::min_blocks_per_sm(kVector, false))
    kv_cache_kernel(const __grid_constant__ cuda_kernel::KvKernelParams kp) {
  DeviceMem mem;
  cuda_kernel::kv_cache_thread<scalar_t, table_t, kInterleaved, kVector, index_t>(
      kp, blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x,
      static_cast<int64_t>(gridDim.x) * kThreads, mem);
}

template <typename table_t>
__global__ void fill_freqs_cis_kernel(table_t* out, const double* inv_freq, double magnitude,
                                      int64_t end, int64_t pairs, int64_t row_stride,
                                      int64_t pair_stride, int64_t cs_stride) {
  DeviceMem mem;
  cuda_kernel::fill_freqs_cis_thread(out, inv_freq, magnitude, end, pairs, row_stride,
                                     pair_stride, cs_stride,
                                     blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
                                     static_cast<int64_t>(gridDim.x) * blockDim.x, mem);
}

// An int per device, asked of the driver once (by `query`, into its argument) and kept.
class PerDevice {
 public:
  template <typename Query>
  int get(int device, Query query) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (device >= static_cast<int>(values_.size())) {
      values_.resize(device + 1, 0);
    }
    if (values_[device] == 0) {
      query(&values_[device]);
    }
    return values_[device];
  }

 private:
  std::mutex mutex_;
  std::vector<int> values_;
};

int sm_count(int device) {
  static PerDevice counts;
  return counts.get(device, [&](int* count) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device));
  });
}

template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, bool kMrope,
          typename index_t>
struct LaunchRotary {
  static constexpr auto kernel =
      &rotary_kernel<scalar_t, table_t, kInterleaved, kVector, kMrope, index_t>;

  // Blocks of this kernel (kThreads threads) one SM of `device` holds at once, asked once per
  // kernel and device (a cache per instantiation: the kernels' registers differ).
  static int blocks_per_sm(int device) {
    static PerDevice blocks;
    return blocks.get(device, [](int* count) {
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel, kThreads, 0));
      *count = std::max(*count, 1);
    });
  }

  static void run(const RotaryParams& p, const int& device) {
    const cuda_kernel::LaunchPlan plan = cuda_kernel::plan_rotary(
        p, sizeof(scalar_t), sizeof(table_t), sm_count(device), blocks_per_sm(device));
    kernel<<<plan.grid, kThreads, 0, c10::cuda::getCurrentCUDAStream(device)>>>(plan.k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

template <typename scalar_t, bool kInterleaved, bool kVector, bool kBackward, bool kMrope>
struct LaunchNorm {
  static constexpr auto kernel =
      &norm_rotary_kernel<scalar_t, kInterleaved, kVector, kBackward, kMrope>;

  static int blocks_per_sm(int device) {
    static PerDevice blocks;
    return blocks.get(device, [](int* count) {
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel, kThreads, 0));
      *count = std::max(*count, 1);
    });
  }

  static void run(const NormRotaryParams& p, const at::ScalarType& table_dtype,
                  const c10::Device& device) {
    const int index = device.index();
    // The kernels rotate back exactly in backward (a compile-time negation of the sines).
    TORCH_INTERNAL_ASSERT(p.rotary.inverse == kBackward);
    cuda_kernel::NormLaunchPlan plan =
        cuda_kernel::plan_norm(p, sizeof(scalar_t), table_dtype == at::kDouble, kBackward,
                               sm_count(index), blocks_per_sm(index));
    constexpr auto x_dtype = c10::CppTypeToScalarType<scalar_t>::value;
    at::Tensor partials, vector_inputs[3];
    if (kVector) {
      cuda_kernel::make_norm_vector_inputs(plan, x_dtype, table_dtype, device, vector_inputs);
    }
    if (kBackward) {
      partials = cuda_kernel::make_norm_partials(plan, x_dtype, device);
    }
    kernel<<<plan.grid, kThreads, 0, c10::cuda::getCurrentCUDAStream(index)>>>(plan.k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (kBackward) {
      cuda_kernel::write_norm_weight_grads(p, x_dtype, partials);
    }
  }
};

template <typename scalar_t, typename table_t, bool kInterleaved, bool kVector, typename index_t>
struct LaunchKvCache {
  static constexpr auto kernel = &kv_cache_kernel<scalar_t, table_t, kInterleaved, kVector, index_t>;

  static int blocks_per_sm(int device) {
    static PerDevice blocks;
    return blocks.get(device, [](int* count) {
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(count, kernel, kThreads, 0));
      *count = std::max(*count, 1);
    });
  }

  static void run(const KvCacheParams& p, const int& device) {
    const cuda_kernel::KvLaunchPlan plan = cuda_kernel::plan_kv_cache(
        p, sizeof(scalar_t), sizeof(table_t), sm_count(device), blocks_per_sm(device));
    if (plan.k.items == 0) {
      return;
    }
    kernel<<<plan.grid, kThreads, 0, c10::cuda::getCurrentCUDAStream(device)>>>(plan.k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

void launch_kv_cache(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
                     c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  cuda_kernel::dispatch_kv_cache<LaunchKvCache>(p, x_dtype, table_dtype, index);
}

void launch_norm(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                 at::ScalarType table_dtype, c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  cuda_kernel::dispatch_norm<LaunchNorm>(p, backward, x_dtype, table_dtype, device);
}

void launch(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype,
            c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  cuda_kernel::dispatch_rotary<LaunchRotary>(p, x_dtype, table_dtype, index);
}

void fill_freqs_cis(const at::Tensor& out, const at::Tensor& inv_freq, double magnitude) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int device = out.device().index();
  const int64_t items = out.size(0) * out.size(1);
  const int64_t grid = cuda_kernel::fill_grid(items, sm_count(device));
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "rope_ext_fill_freqs_cis", [&] {
    fill_freqs_cis_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream(device)>>>(
        out.data_ptr<scalar_t>(), inv_freq.data_ptr<double>(), magnitude, out.size(0),
        out.size(1), out.stride(0), out.stride(1), out.stride(2));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Positions are checked in the kernel (a device-side assert), never by reading them back.
constexpr Backend kCuda{&launch, nullptr, &fill_freqs_cis};
constexpr NormBackend kCudaNorm{&launch_norm};
// Slots, as positions, are checked in the kernel (a device-side assert); two tokens given one
// slot are not detected (that would need the slots read back): documented.
constexpr KvCacheBackend kCudaKv{&launch_kv_cache, nullptr};

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
  m.impl("rms_norm_rotary_qk", &rms_norm_rotary_qk<cuda::kCuda, cuda::kCudaNorm>);
  m.impl("rms_norm_rotary_qk_", &rms_norm_rotary_qk_<cuda::kCuda, cuda::kCudaNorm>);
  m.impl("rms_norm_rotary_qk_backward",
         &rms_norm_rotary_qk_backward<cuda::kCuda, cuda::kCudaNorm>);
  m.impl("rotary_kv_cache_update",
         &rotary_kv_cache_update<cuda::kCuda, cuda::kCudaNorm, cuda::kCudaKv>);
  m.impl("rotary_kv_cache_update_",
         &rotary_kv_cache_update_<cuda::kCuda, cuda::kCudaNorm, cuda::kCudaKv>);
}

}  // namespace rope_ext
