// src/cuda/channel.cuh: the decode kernels' side of a DeviceChannel (cpidx/device_channel.h):
// select_topk writes a step's exchange keys into every rank's buffer, merge_topk polls its own.
#pragma once

#include "../comm/ll_line.cuh"
#include "cpidx/contract.h"
#include "cpidx/device_channel.h"

namespace cpidx {
namespace cuda {

// The channel's uses so far: read by every writer CTA before it lets the readers launch, and by
// every reader CTA before it arrives, so the last reader's increment is seen by neither.
__device__ __forceinline__ uint32_t channel_uses(const DeviceChannel& c) {
  return *reinterpret_cast<const volatile uint32_t*>(c.calls);
}

// u64 offset of (parity of use `uses`, source `src`) in any rank's buffer.
__device__ __forceinline__ size_t channel_slot(const DeviceChannel& c, uint32_t uses, int src) {
  return ((static_cast<size_t>(uses & 1) * c.world) + src) * static_cast<size_t>(c.capacity) * 2;
}

// Element j of this rank's payload of use `uses`, to every rank (this one included).
__device__ __forceinline__ void channel_put(const DeviceChannel& c, uint32_t uses, int64_t j,
                                            Key key) {
  const size_t at = channel_slot(c, uses, c.rank) + 2 * static_cast<size_t>(j);
  for (int q = 0; q < c.world; ++q) ll::store_element(c.buffers[q] + at, key, uses + 1);
}

// Every 512 uses: stamps the lines of this rank's slot past a payload of `lines` lines, spread
// over every thread of CTAs [0, ctas).
__device__ __forceinline__ void channel_clean(const DeviceChannel& c, uint32_t uses, int64_t lines,
                                              int ctas) {
  if (!ll::clean_round(uses)) return;
  const int64_t stride = static_cast<int64_t>(ctas) * blockDim.x;
  for (int64_t j = lines + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       j < c.capacity; j += stride) {
    channel_put(c, uses, j, 0);
  }
}

// Rank q's error word as mapped on this GPU: the 16-byte line after its channel lines
// (DeviceChannel::error is this rank's).
__device__ __forceinline__ int32_t* channel_error(const DeviceChannel& c, int q) {
  return reinterpret_cast<int32_t*>(c.buffers[q] + channel_words(c.world, c.capacity));
}

// A waiter of this rank timed out: every peer's error word is raised too, so that a rank that
// skipped a use (one use behind) does not take the lines of the last use as its own unaware.
__device__ __forceinline__ void channel_alarm_peers(const DeviceChannel& c) {
  for (int q = 0; q < c.world; ++q) {
    if (q != c.rank) ll::alarm_peer(channel_error(c, q));
  }
}

// Element j of source `src` of use `uses` from this rank's buffer, waiting for it (bounded by
// the waiter); kPadKey once the waiter gave up.
__device__ __forceinline__ Key channel_get(const DeviceChannel& c, uint32_t uses, int src,
                                           int64_t j, ll::Waiter& waiter) {
  unsigned long long v = kPadKey;
  const size_t at = channel_slot(c, uses, src) + 2 * static_cast<size_t>(j);
  return waiter.wait(c.buffers[c.rank] + at, uses + 1, &v) ? v : kPadKey;
}

// A reader CTA has read `uses` (one thread per CTA, once all its threads have): the last CTA
// of the grid to arrive resets the arrivals and counts the use. The next use's kernels run after
// this grid (stream order), so the CTAs' later reads of this use's lines need no arrival.
__device__ __forceinline__ void channel_arrive(const DeviceChannel& c, uint32_t uses) {
  __threadfence();
  if (atomicAdd(c.arrivals, 1u) == gridDim.x - 1) {
    *reinterpret_cast<volatile uint32_t*>(c.arrivals) = 0;
    *reinterpret_cast<volatile uint32_t*>(c.calls) = uses + 1;
  }
}

}  // namespace cuda
}  // namespace cpidx
