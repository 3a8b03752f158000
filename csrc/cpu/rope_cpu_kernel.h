// The vectorised CPU rotary kernel, compiled once per instruction set (as ATen's
// CPU_CAPABILITY builds are): rope_cpu_kernel_{default,avx2,avx512,avx512_bf16}.cpp.
// rope_cpu.cpp picks one at run time.
#pragma once

#include <c10/core/ScalarType.h>

#include "../kv_cache.h"
#include "../qk_norm.h"
#include "../rope_math.h"

namespace rope_ext::cpu {

// Hugging Face's [B, H, S, D] walks its tokens in tiles of kTileTokens (rope_cpu.cpp); the
// kernel keeps the rotations of one tile.
constexpr int64_t kTileTokens = 32;

// Out of place, a call whose operands move (read and write) more bytes than this writes its
// output with streaming stores (rope_cpu.cpp says how it is chosen). It follows the thread
// count, so it is asked at each call.
int64_t streaming_threshold();

using RotaryKernel = void (*)(const RotaryParams& p, at::ScalarType x_dtype,
                              at::ScalarType table_dtype);
// The fused RMSNorm + RoPE kernel (qk_norm_cpu_kernel_impl.h), forward or backward.
using NormRotaryKernel = void (*)(const NormRotaryParams& p, bool backward,
                                  at::ScalarType x_dtype, at::ScalarType table_dtype);
// The fused RoPE + KV-cache write (kv_cache.h); x_dtype is q's, k's and v's.
using KvCacheKernel = void (*)(const KvCacheParams& p, at::ScalarType x_dtype,
                               at::ScalarType table_dtype);

namespace DEFAULT {
void rotary_kernel(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
void norm_rotary_kernel(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                        at::ScalarType table_dtype);
void kv_cache_kernel(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
}
namespace AVX2 {
void rotary_kernel(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
void norm_rotary_kernel(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                        at::ScalarType table_dtype);
void kv_cache_kernel(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
}
namespace AVX512 {
void rotary_kernel(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
void norm_rotary_kernel(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                        at::ScalarType table_dtype);
void kv_cache_kernel(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
}
namespace AVX512_BF16 {  // AVX512 plus the AVX512-BF16 conversions
void rotary_kernel(const RotaryParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
void norm_rotary_kernel(const NormRotaryParams& p, bool backward, at::ScalarType x_dtype,
                        at::ScalarType table_dtype);
void kv_cache_kernel(const KvCacheParams& p, at::ScalarType x_dtype, at::ScalarType table_dtype);
}

}  // namespace rope_ext::cpu
