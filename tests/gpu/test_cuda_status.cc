// tests/gpu/test_cuda_status.cc: CUDA errors as a Status (src/cuda/host_util.h), on the host (no
// GPU needed, so it runs in CI): a GPU without a kernel image for it is kUnsupported and says
// which architectures the kernels were built for; other errors stay kCudaError with their name;
// a call with another device current is refused naming both.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "cpidx/indexer.h"
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

// A Decoder's or Prefiller's call with another device current is refused, naming both devices
// and how to switch (the check itself, check_current_device, needs a second GPU: GpuValidation).
TEST(CudaStatus, AnotherCurrentDeviceIsRefusedNamingBoth) {
  EXPECT_TRUE(cpidx::cuda_host::device_mismatch(1, 1, "Decoder").is_ok());
  const cpidx::Status st = cpidx::cuda_host::device_mismatch(1, 0, "Prefiller");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("the current CUDA device is 1, but this Prefiller was created on "
                              "device 0: make device 0 current"),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("cudaSetDevice(0)"), std::string::npos) << st.message();
}

// Without a driver or a GPU (CI), creating a GPU object says so first, then the runtime's error
// (cudaErrorInsufficientDriver reads like a version problem on its own).
TEST(CudaStatus, CreateWithoutAGpuSaysSo) {
  if (cpidx::gpu_available()) GTEST_SKIP() << "a GPU is present";
  cpidx::DecodeConfig c;
  c.max_tokens = 8;
  c.max_seq_len = 1024;
  std::unique_ptr<cpidx::Decoder> dec;
  const cpidx::Status st = cpidx::Decoder::create(c, 0, &dec);
  EXPECT_EQ(st.code(), StatusCode::kCudaError) << st.to_string();
  EXPECT_EQ(st.message().rfind("no usable CUDA device (gpu_available() is false): "
                               "cudaGetDeviceCount: ", 0),
            0u)
      << st.message();
  EXPECT_EQ(dec, nullptr);
}

}  // namespace
