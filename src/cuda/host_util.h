// src/cuda/host_util.h: host-side helpers shared by the GPU objects (Decoder, Prefiller): CUDA
// errors as Status, the checks every create() makes, and running setup code on a given device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "cpidx/contract.h"
#include "cpidx/params.h"
#include "cpidx/status.h"

// The CUDA architectures the kernels were compiled for (CMakeLists.txt passes
// CMAKE_CUDA_ARCHITECTURES to the library and the GPU tests).
#ifndef CPIDX_CUDA_ARCHS
#define CPIDX_CUDA_ARCHS "90a"
#endif

namespace cpidx {
namespace cuda_host {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  detail::Message msg;
  msg << what << ": " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e) << ")";
  if (e == cudaErrorNoKernelImageForDevice) {
    // A GPU of another architecture: the kernels use sm_90a's own instructions (bulk copies,
    // wgmma, programmatic launch), which no later architecture runs. A create() meets it first.
    msg << ": this GPU cannot run cpidx's kernels, compiled for CUDA architectures "
        << CPIDX_CUDA_ARCHS << " (NVIDIA Hopper: H100, H200)";
    return Status(StatusCode::kUnsupported, msg.str());
  }
  return Status(StatusCode::kCudaError, msg.str());
}

// A call's launch or stream-ordered copy on the caller's stream: its error as a Status, and the
// thread's last-error slot cleared when it holds that error, so that the caller's next error
// check (torch's after its next kernel, say) does not report this call's failure again, against
// another operation. The Status already says it. A refusal of the launch helpers' own (no
// runtime call made) leaves an earlier error of the caller's where it was; an error that is
// sticky (the context lost) stays whatever is cleared. Not for an object's creation, whose
// errors on_device reads and clears itself.
inline Status launch_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  if (cudaPeekAtLastError() == e) cudaGetLastError();
  return cuda_status(e, what);
}

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Frees device memory from an object's destructor (or a create that failed), which may run while
// a stream capture is under way: a Python object collected inside `torch.cuda.graph`, or another
// thread capturing in the global mode (torch's default). cudaFree is then a call the capture
// forbids, and the refusal would also invalidate that capture; in the relaxed mode the free goes
// through and the capture stays valid. The thread's own mode is restored after. Creating an
// object cannot be captured (it synchronizes the device): on_device's message says so.
inline void free_relaxed(void* p) {
  if (p == nullptr) return;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool relaxed = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  if (cudaFree(p) != cudaSuccess) cudaGetLastError();  // no one to tell; not left behind either
  if (relaxed) cudaThreadExchangeStreamCaptureMode(&mode);
}

// The index-cache dtypes the kernels are built for.
inline Status check_cache_dtype(DType dtype) {
  if (dtype == DType::kBF16 || dtype == DType::kFP8E4M3) return Status::ok();
  return unsupported("cache_dtype must be bf16 or fp8_e4m3, got dtype code " +
                     std::to_string(static_cast<int>(dtype)));
}

// What the scoring kernels need of a call's queries and cache beyond the reference's checks:
// the object's bound and dtype, and the 16-byte alignment of their vector loads. `owner` names
// the object in the message ("Decoder", "Prefiller").
inline Status check_kernel_inputs(const uint16_t* query, int64_t q_row_stride,
                                  int64_t q_head_stride, const PagedCache& cache,
                                  int32_t max_seq_len, int32_t bound, DType dtype,
                                  const int32_t* error_flag, const char* owner) {
  CPIDX_CHECK(max_seq_len == bound,
              "max_seq_len must equal the " << owner << "'s bound " << bound << ", got "
                                            << max_seq_len);
  CPIDX_CHECK(cache.dtype == dtype, "index_cache dtype must be " << to_string(dtype) << ", got "
                                                                 << to_string(cache.dtype));
  CPIDX_CHECK(reinterpret_cast<uintptr_t>(query) % 16 == 0 && q_row_stride % 8 == 0 &&
                  q_head_stride % 8 == 0,
              "index_query must be 16-byte aligned with row and head strides that are "
              "multiples of 8 elements (got row stride "
                  << q_row_stride << ", head stride " << q_head_stride << ")");
  CPIDX_CHECK(reinterpret_cast<uintptr_t>(cache.data) % 16 == 0,
              "index_cache must be 16-byte aligned");
  CPIDX_CHECK(reinterpret_cast<uintptr_t>(error_flag) % alignof(int32_t) == 0,
              "error_flag must be 4-byte aligned (int32), got address " << error_flag);
  return Status::ok();
}

// What every scoring kernel's Params (decode, prefill) take by the same names: the call's
// head count and query row stride, the paged cache and its block table, the request lengths and
// the bound, the scale, and the selection rule.
template <typename Params, typename Inputs>
void set_common_params(Params& p, const Inputs& in, const Selection& sel) {
  p.num_heads = in.num_heads;
  p.q_row_stride = in.q_row_stride;
  p.cache = in.cache.data;
  p.num_pages = in.cache.num_pages;
  p.block_table = in.block_table;
  p.bt_row_stride = in.bt_row_stride;
  p.seq_lens = in.seq_lens;
  p.num_reqs = in.num_reqs;
  p.max_seq_len = in.max_seq_len;
  p.scale = in.scale;
  p.topk = sel.topk;
  p.init_blocks = sel.init_blocks;
  p.local_blocks = sel.local_blocks;
}

// The ids output of any kernel's Params (scoring, prefill, merge).
template <typename Params>
void set_ids_output(Params& p, const TopkOutput& out) {
  p.ids = out.ids;
  p.ids_head_stride = out.head_stride;
  p.ids_row_stride = out.row_stride;
}

// Whether a CUDA call was refused because a stream capture is under way.
inline bool capture_error(cudaError_t e) {
  switch (e) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureWrongThread:
      return true;
    default:
      return false;
  }
}

// A Decoder's or a Prefiller's calls run on the device it was created for: its workspace, its
// planned kernels and the caller's stream live there. Refused (kInvalidArgument) when another
// device is current: a launch would fail there, or (the default stream) run on the wrong GPU
// with pointers of another, and in cp_decode after its first collective, leaving the peers in
// the next one. device_mismatch is the message, apart for tests without a second GPU.
inline Status device_mismatch(int current, int device, const char* who) {
  if (current == device) return Status::ok();
  detail::Message msg;
  msg << "the current CUDA device is " << current << ", but this " << who
      << " was created on device " << device << ": make device " << device
      << " current before its calls (cudaSetDevice(" << device << "); in torch, "
      << "torch.cuda.set_device(" << device << ") or `with torch.cuda.device(" << device
      << "):`)";
  return Status(StatusCode::kInvalidArgument, msg.str());
}

inline Status check_current_device(int device, const char* who) {
  int current = -1;
  const Status st = cuda_status(cudaGetDevice(&current), "cudaGetDevice");
  return st.is_ok() ? device_mismatch(current, device, who) : st;
}

// Runs `setup` (an object's creation: it allocates and synchronizes the device) with `device`
// current and restores the caller's device afterwards. When setup fails, the thread's pending
// CUDA error is cleared whatever the Status (so that the caller's next error check does not
// report it again),
// and a failure caused by a capture under way (a create inside torch.cuda.graph, or the first
// Python call of a shape) says how to avoid it.
template <typename F>
Status on_device(int device, F&& setup) {
  int count = 0;
  Status st = cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!st.is_ok()) {  // no driver or no GPU: say so first, the runtime's words read otherwise
    cudaGetLastError();
    detail::Message msg;
    msg << "no usable CUDA device (gpu_available() is false): " << st.message();
    return Status(st.code(), msg.str());
  }
  CPIDX_CHECK(device >= 0 && device < count,
              "device must be in [0, " << count << "), got " << device);
  int prev = 0;
  st = cuda_status(cudaGetDevice(&prev), "cudaGetDevice");
  if (!st.is_ok()) return st;
  st = cuda_status(cudaSetDevice(device), "cudaSetDevice");
  if (st.is_ok()) st = setup();
  // Cleared whatever Status it became (a GPU without a kernel image is kUnsupported).
  const cudaError_t pending = st.is_ok() ? cudaSuccess : cudaGetLastError();
  if (st.code() == StatusCode::kCudaError && capture_error(pending)) {
    st = Status(st.code(), st.message() +
                         "; a stream capture is under way, and creating a Decoder or Prefiller "
                         "(the first call of a shape, through the Python functions) cannot be "
                         "captured: create it before capturing (the capture is now invalid)");
  }
  cudaSetDevice(prev);
  return st;
}

// Runs f() with `device` current, then makes the caller's device current again; skipped when
// the device cannot be made current (best effort: destructors and queries that do not fail).
template <typename F>
void on_device_best_effort(int device, F&& f) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return;
  f();
  cudaSetDevice(prev);
}

}  // namespace cuda_host
}  // namespace cpidx

#define CPIDX_CUDA_TRY(expr) \
  CPIDX_RETURN_IF_ERROR(::cpidx::cuda_host::cuda_status((expr), #expr))

// The calls' launches (decode, merge, prefill, clearing the error flag): see launch_status.
#define CPIDX_LAUNCH_TRY(expr) \
  CPIDX_RETURN_IF_ERROR(::cpidx::cuda_host::launch_status((expr), #expr))
