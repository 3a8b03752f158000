// The rotary kernel for the AVX512 instruction set, built with the AVX512 flags from setup.py and CMakeLists.txt.
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "rope_cpu_kernel_impl.h"
#include "qk_norm_cpu_kernel_impl.h"
