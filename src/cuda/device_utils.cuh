// src/cuda/device_utils.cuh: small device helpers shared by the decode kernels: mbarrier +
// bulk-copy wrappers (sm_90 async copy engine), the bf16 tensor-core MMA, and an exact
// block-wide top-K by counting ranks (keys are unique, so rank = number of larger keys).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <utility>

#include "cpidx/contract.h"

namespace cpidx {
namespace cuda {

// ---- mbarrier + bulk copy ------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Make barrier initialisation visible to the async proxy (the bulk-copy engine).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Adds `bytes` to the barrier's expected transaction count without arriving: the phase then
// completes once the bytes have landed and its arrivals (a later mbar_arrive) are in.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t addr = smem_addr(bar);
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}

// mbar_wait for a warp that has nothing else to do (the producer waiting for a free stage): each
// try_wait may suspend the thread for up to `ns` nanoseconds (it resumes as soon as the phase
// completes), instead of the hardware's short default, so the wait polls a few times a page
// instead of ~37 (docs/perf/README.md, v30-ncu) and leaves the issue slots to the consumers.
__device__ __forceinline__ void mbar_wait_suspended(uint64_t* bar, uint32_t parity,
                                                    uint32_t ns) {
  uint32_t addr = smem_addr(bar);
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(addr),
      "r"(parity), "r"(ns)
      : "memory");
}

// Global -> shared bulk copy of `bytes` (multiple of 16, both addresses 16-byte aligned),
// completing on `bar`. Streaming data: evict-first in L2, so what the step reads again (the
// per-CTA lists the selection merges, the tables, the queries) is not pushed out by the pages.
// NOTE: measured 1-3 us faster than no hint on one machine, alternated builds (8 x 256K plain
// 139.0 -> 135.6-136.0 us, the 2-GPU step at 8 x 1M 265.1-265.5 -> 262.0-262.2;
// docs/perf/README.md, v9).
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// The GPU's global nanosecond timer (%globaltimer).
__device__ __forceinline__ long long globaltimer_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- Programmatic dependent launch ------------------------------------------------------------
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Warms L2 with a line the kernel will read after pdl_wait(). Safe before the wait: a prefetch
// only moves the line into L2, the point of coherence, so a later write by the previous kernel
// is still what the real load sees.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Launches `kernel` with programmatic stream serialization, so the launch overlaps the tail of
// the previous kernel in the stream (also inside CUDA graphs). The kernel calls pdl_wait()
// before touching memory the previous kernel may write.
template <typename... KArgs, typename... Args>
cudaError_t launch_with_pdl(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                            size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Raises `kernel`'s dynamic shared-memory cap to all the device allows (smem_optin less its static
// shared memory). NOTE: the cap is per function and process-wide; always the device maximum, so
// a later Decoder or Prefiller with a smaller layout cannot lower it under an earlier one's
// launches.
template <typename... KArgs>
cudaError_t raise_smem_cap(void (*kernel)(KArgs...), int smem_optin) {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              smem_optin - static_cast<int>(attr.sharedSizeBytes));
}

// Asks that an SM running `kernel` keep the largest shared-memory carveout. Every decode kernel
// asks it, so the SMs never change their L1 / shared-memory split between them (a split changes
// only on an idle SM). Without it, a score_topk grid (sized to the resident capacity) launched
// by PDL behind select_topk sometimes found SMs that took only two of its three CTAs a SM, and
// the CTAs left over waited ~500 us for the others to exit: 4 of 6 traced launches of plain
// 64 x 256K fp8 Q = 4 had one to five, 0 of 6 with this. select_topk and the merge asking it
// alone was not enough (2 of 4): score_topk's own preference matters. The cost: its L1
// drops to 28 KB, which a build whose registers spill pays (the trace build paid 8-33% until
// its sums left the registers, v42-trace); release rows moved within +-0.5% from 256K tokens
// up (docs/perf/README.md, v42, v42c).
// NOTE: a kernel before a call that keeps the driver's carveout did not bring the late CTAs
// back: `cpidx bench --neighbour-us` put one holding 20-150 KiB a CTA (one to four an SM, with
// and without PDL's early trigger) before every call: of 700 replays of plain 64 x 256K fp8
// Q = 4, none ran more than 11 us a call over its run's median, and none of 10 traced launches
// had a late CTA. Back to back, behind the previous call's selection, 3 of 260 replays still ran
// 32-37 us a call over it (docs/perf/README.md, v43-neighbour).
template <typename... KArgs>
cudaError_t prefer_max_shared(void (*kernel)(KArgs...)) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

// Lowers *smallest to `kernel`'s carveout preference (-1: none asked; tests).
template <typename... KArgs>
cudaError_t lower_to_carveout(void (*kernel)(KArgs...), int* smallest) {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  if (e == cudaSuccess && attr.preferredShmemCarveout < *smallest) {
    *smallest = attr.preferredShmemCarveout;
  }
  return e;
}

// ---- Tensor-core MMA: D[16x8] += A[16x16] * B[16x8], fp32 accumulation ---------------------
// bf16 inputs, or fp16 with kHalf (fp8 pages: keys widened exactly to fp16, queries scaled into
// its range; PageTraits).
#define CPIDX_MMA_16816(type)                                                               \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 {%0,%1,%2,%3}, " \
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                      \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                              \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool kHalf = false>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (kHalf) CPIDX_MMA_16816("f16");
  else CPIDX_MMA_16816("bf16");
}
#undef CPIDX_MMA_16816

// NaN-ignoring max (IEEE maxNum): with -inf as the start value, NaN dots never win.
__device__ __forceinline__ float max_num(float a, float b) { return fmaxf(a, b); }

}  // namespace cuda
}  // namespace cpidx
