// The rotary kernel for AVX512 with the AVX512-BF16 conversions, built with the AVX512_BF16
// flags from setup.py and CMakeLists.txt.
#define CPU_CAPABILITY AVX512_BF16
#define CPU_CAPABILITY_AVX512
#include "rope_cpu_kernel_impl.h"
#include "qk_norm_cpu_kernel_impl.h"
