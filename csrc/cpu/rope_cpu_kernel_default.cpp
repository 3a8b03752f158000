// The rotary kernel for the DEFAULT instruction set, built with no instruction-set flags.
#define CPU_CAPABILITY DEFAULT
#include "rope_cpu_kernel_impl.h"
#include "qk_norm_cpu_kernel_impl.h"
