// What a build of the library holds, reported by the build_info op.
#pragma once

#include <string>

namespace rope_ext {

// The CPU kernel variant picked at run time: DEFAULT, AVX2, AVX512 or AVX512_BF16.
const char* cpu_kernel_name();

// The CUDA architectures compiled in, e.g. "sm_80 sm_90 compute_90"; empty without CUDA.
std::string cuda_archs();

}  // namespace rope_ext
