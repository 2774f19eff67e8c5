// src/cuda/prefill_device.cuh: device helpers of the prefill kernels: Ampere-style cp.async
// (16-byte copies that the kernel places in a swizzled layout itself), exact fp8 e4m3 -> bf16
// widening, a 1024-thread block scan, and the per-row sorted top-K list kept in shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "device_utils.cuh"

namespace cpidx {
namespace cuda {

// ---- cp.async ------------------------------------------------------------------------------
// 16 bytes global -> shared, L2 only (keys are reused across CTAs through L2, never in L1).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most `pending` of this thread's most recent groups are still in flight.
__device__ __forceinline__ void cp_async_wait(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
  }
}

// ---- fp8 e4m3 -> bf16 ------------------------------------------------------------------------
// Two e4m3 bytes -> two bf16 in one register. Exact: every e4m3 value (NaN included) is a half,
// and every half of that range is a bf16.
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 b = __float22bfloat162_rn(f);
  return *reinterpret_cast<const uint32_t*>(&b);
}
// Eight e4m3 bytes (little-endian in a uint2) -> eight bf16 (a uint4), order kept.
__device__ __forceinline__ uint4 fp8x8_to_bf16x8(uint2 raw) {
  return make_uint4(fp8x2_to_bf16x2(raw.x & 0xFFFFu), fp8x2_to_bf16x2(raw.x >> 16),
                    fp8x2_to_bf16x2(raw.y & 0xFFFFu), fp8x2_to_bf16x2(raw.y >> 16));
}

// ---- Block scan (exactly 32 warps) ----------------------------------------------------------
// Inclusive scan of `v` under `op` over the 1024 threads of the block; *total gets the block's
// reduction. `warp_buf` holds 32 values. Every thread must call it (it synchronises).
template <typename T, typename Op>
__device__ __forceinline__ T block_scan_1024(T v, Op op, T* warp_buf, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    const T o = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v = op(v, o);
  }
  if (lane == 31) warp_buf[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = warp_buf[lane];
    for (int d = 1; d < 32; d <<= 1) {
      const T o = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w = op(w, o);
    }
    warp_buf[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v = op(v, warp_buf[warp - 1]);
  *total = warp_buf[31];
  __syncthreads();  // warp_buf is free for the next scan
  return v;
}

// ---- Per-row running top-K ------------------------------------------------------------------
// One row's K best keys, descending, in shared memory with a stride of `stride` keys between
// entries (the rows of a block interleave, so a warp's accesses never share a bank). `tau` (a
// register) is the K-th key, kPadKey while the list is not full: most blocks fail `key > tau`
// and cost one compare. Keys of a row are unique (distinct block ids).
__device__ __forceinline__ void list_insert(Key* list, int stride, int k, Key key, Key& tau) {
  if (key <= tau) return;
  int i = k - 1;
  while (i > 0) {
    const Key prev = list[(i - 1) * stride];
    if (prev > key) break;
    list[i * stride] = prev;
    --i;
  }
  list[i * stride] = key;
  tau = list[(k - 1) * stride];
}

}  // namespace cuda
}  // namespace cpidx
