// tests/gpu/test_cuda_status.cc: CUDA errors as a Status (src/cuda/host_util.h), on the host (no
// GPU needed, so it runs in CI): a GPU without a kernel image for it is kUnsupported and says
// which architectures the kernels were built for; other errors stay kCudaError with their name.
#include <gtest/gtest.h>

#include <string>

#include "cuda/host_util.h"

namespace {

using cpidx::StatusCode;
using cpidx::cuda_host::cuda_status;

TEST(CudaStatus, NoKernelImageIsUnsupportedAndNamesTheBuiltArchitectures) {
  const cpidx::Status st = cuda_status(cudaErrorNoKernelImageForDevice, "plan_score_topk");
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  const std::string& m = st.message();
  EXPECT_NE(m.find("plan_score_topk: cudaErrorNoKernelImageForDevice"), std::string::npos) << m;
  EXPECT_NE(m.find(std::string("compiled for CUDA architectures ") + CPIDX_CUDA_ARCHS),
            std::string::npos) << m;
}

TEST(CudaStatus, OtherErrorsAreCudaErrorsByName) {
  EXPECT_TRUE(cuda_status(cudaSuccess, "x").is_ok());
  const cpidx::Status st = cuda_status(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)");
  EXPECT_EQ(st.code(), StatusCode::kCudaError);
  EXPECT_NE(st.message().find("cudaMalloc(&p, n): cudaErrorMemoryAllocation"), std::string::npos)
      << st.message();
  EXPECT_EQ(st.message().find("architectures"), std::string::npos) << st.message();
}

}  // namespace
