// src/cuda/prefill_device.cuh: device helpers of the prefill kernels: Ampere-style cp.async
// (16-byte copies that the kernel places in a swizzled layout itself), exact fp8 e4m3 -> bf16
// widening, a 1024-thread block scan, Hopper warpgroup MMA (wgmma, sm_90a) with its shared-memory
// descriptor, and the per-row sorted top-K list kept in shared memory.
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
// 8 bytes global -> shared (.ca: cp.async takes fewer than 16 bytes only through L1).
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(dst)), "l"(src)
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

// ---- Hopper warpgroup MMA (sm_90a) ---------------------------------------------------------
// Compiled only for sm_90a (the instructions do not exist elsewhere); the kernels that use them
// are guarded by CPIDX_PREFILL_WGMMA and chosen at construction only where that build runs.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CPIDX_PREFILL_WGMMA 1
#endif

// Orders this thread's earlier generic-proxy shared-memory writes (st.shared, cp.async) before
// later async-proxy reads (wgmma operands); each writer runs it before the barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout: rows of
// 128 bytes (64 bf16), 8-row atoms of 1024 bytes at a stride of SBO = 1024, the atom 1024-byte
// aligned (base offset 0). LBO is unused by swizzled K-major layouts (encoded as 1).
// Bits: [0,14) address >> 4, [16,30) LBO >> 4, [32,46) SBO >> 4, [62,64) swizzle (1 = 128B).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_address) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

#if defined(CPIDX_PREFILL_WGMMA)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// Keeps the compiler from moving accesses of `d` across the asynchronous MMA's fence or wait.
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 128] (+)= A[64 x 16] * B[16 x 128] for the warpgroup: bf16 inputs, fp32 accumulators.
// A from registers (the m16n8k16 A fragment of each warp's 16 rows), B (128 keys x 16 dims,
// K-major) from shared memory through `desc_b`. kAccumulate = false overwrites D.
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
      " {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
}
#endif  // CPIDX_PREFILL_WGMMA

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
