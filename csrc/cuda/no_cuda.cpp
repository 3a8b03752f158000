// Compiled instead of rope_cuda.cu when the build has no CUDA.
#include "../rope_build.h"

namespace rope_ext {

std::string cuda_archs() {
  return "";
}

}  // namespace rope_ext
