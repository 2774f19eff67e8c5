// tools/gpu.cc: HOOK for the GPU path of the `cpidx` tool. gpu_available() is false in a CPU
// build; in a CUDA build it asks the runtime for a device (false on a machine without a GPU).
#include "subcommands.h"

#if defined(CPIDX_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace cpidx::tools {

bool gpu_available() {
#if defined(CPIDX_WITH_CUDA)
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

}  // namespace cpidx::tools
