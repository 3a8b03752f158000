// The rotary kernel for the AVX2 instruction set, built with the AVX2 flags from setup.py and CMakeLists.txt.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "rope_cpu_kernel_impl.h"
#include "qk_norm_cpu_kernel_impl.h"
