// What a build of the library holds, reported by the build_info op.
#pragma once

#include <cstdint>
#include <string>

namespace rope_ext {

// The CPU kernel variant picked at run time: DEFAULT, AVX2, AVX512 or AVX512_BF16.
const char* cpu_kernel_name();

// The bytes an out-of-place CPU call must move, at the current thread count, for its output
// to take streaming stores (ROPE_EXT_STREAMING_STORES; INT64_MAX when they are off).
int64_t cpu_streaming_threshold();

// The CUDA architectures compiled in, e.g. "sm_80 sm_90 compute_90"; empty without CUDA.
std::string cuda_archs();

}  // namespace rope_ext
