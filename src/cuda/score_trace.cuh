// src/cuda/score_trace.cuh: an opt-in timeline of the fused decode kernel, for finding where a
// step's fixed cost goes. Built only with -DCPIDX_TRACE (never in a release build: the macros
// below are empty otherwise); `cpidx bench --trace` prints it. Per CTA, slot kT* of
// g_score_trace holds a %globaltimer stamp (ns) or a sum of clock64 cycles.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#if defined(CPIDX_TRACE) && defined(__CUDACC__)
#include "device_utils.cuh"  // the device side only: host code (bench.cc) reads the constants
#endif

namespace cpidx {
namespace cuda {

constexpr int kTraceCtas = 1024, kTraceSlots = 22;
enum TraceSlot : int {
  kTEntry = 0,        // stamp: kernel entry
  kTWaited,           // stamp: past the PDL wait
  kTPrefix,           // stamp: the request prefix sum done
  kTFirstPage,        // stamp: the first page landed (consumer)
  kTLastPage,         // stamp: the last page scored (consumer)
  kTExit,             // stamp: the consumers are done (merges and outputs included)
  kTFullWait,         // cycles: consumer thread 0 waiting for pages
  kTEmptyWait,        // cycles: the producer waiting for free stages
  kTSegEnd,           // cycles: ends of request segments (compact, then outputs or lists)
  kTQueries,          // cycles: query loads at segment starts
  kTPages,            // count: pages consumed
  kTSegments,         // count: segment ends
  kTSmid,             // the SM the CTA ran on
  kTStolen,           // count: pages taken from other CTAs' ranges (split path, v15)
  kTFirstIssue,       // stamp: the producer's first bulk copy issued
  kTLastIssue,        // stamp: the producer's last bulk copy issued
  kTEntryClock,       // clock64 at entry and at exit: with the stamps, the SM's clock rate
  kTExitClock,
  kTHandedOver,       // stamp: the early ring's stages handed to the consumers (0: no early ring)
  kTFirstMma,         // stamp: the first page's MMAs issued (consumer thread 0)
  kTFirstMax,         // stamp: the first page's column maxima complete (after the barrier)
  kTRingIssue,        // stamp: the first copy after the early stages issued (0: no early ring)
  kTSlotCount
};
static_assert(kTSlotCount <= kTraceSlots, "trace slots");
// select_topk's CTAs with an item (blockIdx < items), stamps in g_select_trace: entry, the
// PDL wait's return, exit, and the phases of select_item (the group bound known with the keys
// loaded, winners gathered, ranked; inside the bound, a thread's keys in registers and the
// groups' maxima in shared memory) of the CTA's last item (a CTA with several items restamps).
constexpr int kSelectSlots = 10;
enum SelectTraceSlot : int {
  kSEntry = 0, kSWaited, kSBound, kSGathered, kSRanked, kSExit, kSLoaded, kSMaxima,
  kSWaitedClock, kSExitClock  // clock64 at the wait's return and at exit (the SM's clock rate)
};
// Each CTA's first kTracePages page landings (stamps, in g_page_trace; kTPages says how many are
// this launch's): the rate at which the step's bytes arrive, over time.
constexpr int kTracePages = 512;

#if defined(CPIDX_TRACE) && defined(__CUDACC__)
static __device__ long long g_score_trace[kTraceCtas * kTraceSlots];
__device__ __forceinline__ long long trace_now() { return globaltimer_ns(); }
__device__ __forceinline__ long long trace_smid() {
  int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  return smid;
}
__device__ __forceinline__ void trace_reset() {
  if (blockIdx.x < kTraceCtas)
    for (int i = 0; i < kTraceSlots; ++i) g_score_trace[blockIdx.x * kTraceSlots + i] = 0;
}
__device__ __forceinline__ void trace_set(int slot, long long v) {
  if (blockIdx.x < kTraceCtas) g_score_trace[blockIdx.x * kTraceSlots + slot] = v;
}
// The sums (cycles, counts) go to the CTA's row as they are taken, by reductions whose result
// is not read (RED: the thread does not wait for L2), so a recording thread keeps only its page
// count in a register (the page stamps' index; written once, at its end: CPIDX_TRACE_FLUSH).
// NOTE: `row += v` where a sum was taken stalled that thread on a load (an L2 round trip) on
// the very path being timed: the consumers' first page was stamped ~1 us late behind two of
// them, and the producer paused at every page (v25). Kept in registers instead, the sums and
// their 64-bit clocks spilled the 96-register fp8 instances 136-140 B, which the largest
// carveout's 28 KB of L1 (v42) no longer held: the trace build ran fp8 8 x 256K Q = 1 at 101 us
// against the release build's 76 (docs/perf/README.md, v42-run).
__device__ __forceinline__ void trace_add(int slot, unsigned v) {
  if (blockIdx.x >= kTraceCtas) return;
  long long* row = g_score_trace + blockIdx.x * kTraceSlots;
  atomicAdd(reinterpret_cast<unsigned long long*>(row + slot), static_cast<unsigned long long>(v));
}
struct TraceSums {
  unsigned pages = 0;
};
__device__ __forceinline__ void trace_flush(const TraceSums& sums) {
  if (sums.pages != 0) trace_add(kTPages, sums.pages);  // counted by consumer thread 0 only
}
// The SM's cycle counter, 32 bits: one register across a wait (differences wrap correctly
// below 2 s at 2 GHz).
__device__ __forceinline__ unsigned trace_clock32() {
  unsigned c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
  return c;
}
// A CTA placed late, on purpose: the grid's last CTA waits g_trace_late_ns (0: none) at entry,
// every thread, before anything else, as one that found no SM with room until the others
// began to exit (docs/perf/README.md, v41-slow, v47). Set by set_score_trace_late.
static __device__ long long g_trace_late_ns;
__device__ __forceinline__ void trace_late() {
  if (blockIdx.x != gridDim.x - 1) return;
  const long long ns = *static_cast<volatile long long*>(&g_trace_late_ns);
  const long long t0 = trace_now();
  while (trace_now() - t0 < ns) __nanosleep(256);
}
#define CPIDX_TRACE_LATE() trace_late()
// `cond` selects the one thread that records.
#define CPIDX_TRACE_RESET(cond) ((cond) ? trace_reset() : (void)0)
#define CPIDX_TRACE_STAMP(cond, slot) ((cond) ? trace_set(slot, trace_now()) : (void)0)
// A function that adds declares CPIDX_TRACE_SUMS(); before it returns, CPIDX_TRACE_FLUSH.
#define CPIDX_TRACE_SUMS() TraceSums trace_sums
#define CPIDX_TRACE_ADD(cond, slot, v) \
  ((cond) ? trace_add(slot, static_cast<unsigned>(v)) : (void)0)
#define CPIDX_TRACE_FLUSH(cond) ((cond) ? trace_flush(trace_sums) : (void)0)
#define CPIDX_TRACE_CLOCK(name) const unsigned name = trace_clock32()
#define CPIDX_TRACE_SINCE(name) (trace_clock32() - (name))
#define CPIDX_TRACE_SMID(cond) ((cond) ? trace_set(kTSmid, trace_smid()) : (void)0)
// clock64 in a slot (with the stamps beside it, the SM's clock rate).
#define CPIDX_TRACE_CYCLES(cond, slot) ((cond) ? trace_set(slot, clock64()) : (void)0)
static __device__ long long g_select_trace[kTraceCtas * kSelectSlots];
static __device__ long long g_page_trace[kTraceCtas * kTracePages];
// A page consumed (in a function with CPIDX_TRACE_SUMS): counted in kTPages, its landing stamped
// at the count's index and, the first, in kTFirstPage. Indexed by the pages counted, not by the
// ring position: a stage handed back unscored (kSkipStage) or the second of a pair would leave
// a slot unwritten below kTPages (stale stamps, read as this launch's; v41-slow).
#define CPIDX_TRACE_PAGE(cond)                                                              \
  do {                                                                                      \
    if ((cond) && blockIdx.x < kTraceCtas) {                                                \
      const unsigned i_ = trace_sums.pages++;                                               \
      const long long now_ = trace_now();                                                   \
      if (i_ == 0) trace_set(kTFirstPage, now_);                                            \
      if (i_ < static_cast<unsigned>(kTracePages))                                          \
        g_page_trace[blockIdx.x * kTracePages + i_] = now_;                                 \
    }                                                                                       \
  } while (0)
#define CPIDX_SELECT_RESET(cond)                                                            \
  do {                                                                                      \
    if ((cond) && blockIdx.x < kTraceCtas)                                                  \
      for (int i_ = 0; i_ < kSelectSlots; ++i_)                                             \
        g_select_trace[blockIdx.x * kSelectSlots + i_] = 0;                                 \
  } while (0)
#define CPIDX_SELECT_STAMP(cond, slot)                                                      \
  ((cond) && blockIdx.x < kTraceCtas                                                       \
       ? (void)(g_select_trace[blockIdx.x * kSelectSlots + (slot)] = trace_now()) : (void)0)
#define CPIDX_SELECT_CLOCK(cond, slot)                                                      \
  ((cond) && blockIdx.x < kTraceCtas                                                       \
       ? (void)(g_select_trace[blockIdx.x * kSelectSlots + (slot)] = clock64()) : (void)0)
// The first `ctas` CTAs' `slots` values of a trace symbol (of the calling translation unit, the
// symbols being per file) copied to `host`.
template <typename Symbol>
cudaError_t copy_trace(const Symbol& symbol, int slots, long long* host, int ctas) {
  if (ctas > kTraceCtas) ctas = kTraceCtas;
  return cudaMemcpyFromSymbol(host, symbol, sizeof(long long) * slots * ctas);
}
#define CPIDX_COPY_TRACE(symbol, slots, host, ctas) copy_trace(symbol, slots, host, ctas)
#define CPIDX_SET_TRACE_LATE(ns) cudaMemcpyToSymbol(g_trace_late_ns, &(ns), sizeof(long long))
#else
#define CPIDX_TRACE_LATE() ((void)0)
#define CPIDX_TRACE_RESET(cond) ((void)0)
#define CPIDX_TRACE_STAMP(cond, slot) ((void)0)
#define CPIDX_TRACE_SUMS() static_assert(true, "")
#define CPIDX_TRACE_ADD(cond, slot, v) ((void)0)
#define CPIDX_TRACE_FLUSH(cond) ((void)0)
#define CPIDX_TRACE_CLOCK(name) ((void)0)
#define CPIDX_TRACE_SINCE(name) 0
#define CPIDX_TRACE_SMID(cond) ((void)0)
#define CPIDX_TRACE_CYCLES(cond, slot) ((void)0)
#define CPIDX_SELECT_RESET(cond) ((void)0)
#define CPIDX_SELECT_STAMP(cond, slot) ((void)0)
#define CPIDX_SELECT_CLOCK(cond, slot) ((void)0)
#define CPIDX_TRACE_PAGE(cond) ((void)0)
#define CPIDX_COPY_TRACE(symbol, slots, host, ctas) \
  ((void)(host), (void)(ctas), cudaErrorNotSupported)
#define CPIDX_SET_TRACE_LATE(ns) ((void)(ns), cudaErrorNotSupported)
#endif

}  // namespace cuda
}  // namespace cpidx
