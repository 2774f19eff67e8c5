// src/cuda/host_util.h: host-side helpers shared by the GPU objects (Decoder, Prefiller): CUDA
// errors as Status, the checks every create() makes, and running setup code on a given device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "cpidx/contract.h"
#include "cpidx/status.h"

namespace cpidx {
namespace cuda_host {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  detail::Message msg;
  msg << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ")";
  return Status(StatusCode::kCudaError, msg.str());
}

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The index-cache dtypes the kernels are built for.
inline Status check_cache_dtype(DType dtype) {
  if (dtype == DType::kBF16 || dtype == DType::kFP8E4M3) return Status::ok();
  return unsupported("cache_dtype must be bf16 or fp8_e4m3, got dtype code " +
                     std::to_string(static_cast<int>(dtype)));
}

// Runs `setup` with `device` current and restores the caller's device afterwards.
template <typename F>
Status on_device(int device, F&& setup) {
  int count = 0;
  Status st = cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!st.is_ok()) return st;
  CPIDX_CHECK(device >= 0 && device < count,
              "device must be in [0, " << count << "), got " << device);
  int prev = 0;
  st = cuda_status(cudaGetDevice(&prev), "cudaGetDevice");
  if (!st.is_ok()) return st;
  st = cuda_status(cudaSetDevice(device), "cudaSetDevice");
  if (st.is_ok()) st = setup();
  cudaSetDevice(prev);
  return st;
}

}  // namespace cuda_host
}  // namespace cpidx

#define CPIDX_CUDA_TRY(expr) \
  CPIDX_RETURN_IF_ERROR(::cpidx::cuda_host::cuda_status((expr), #expr))
