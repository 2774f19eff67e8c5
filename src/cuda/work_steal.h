// src/cuda/work_steal.h: the split path's run-time share of pages (v15, work stealing): the
// packed range words and the claim rules, shared by the scoring kernel's producer warp
// (page_producer.cuh) and the host test that plays the protocol under random interleavings
// (tests/gpu/test_work_split.cc).
//
// CTA c's pages not yet claimed are [front, back) of its word (front in the low 32 bits, back
// in the high 32), or all of its static range [c * total / ctas, (c + 1) * total / ctas) while
// the word is kUnstarted. The owner starts its word (compare-and-swap from kUnstarted) keeping
// a first chunk, then claims chunks from the front with atomicAdd (what lies below the
// returned back is its own); a CTA done with its pages takes up to kStealPages from the back
// of another CTA's range within reach, whatever request they belong to (its consumers load that
// request's queries when the page lands): by compare-and-swap on the word it read when that
// starts the range (its owner has not run yet), else by subtracting from the back (atomicAdd of
// steal_delta), what lies between the returned back and the front being its own (stolen_range).
// The back is signed: takers that subtract together may move it below the front (nothing left:
// their claims come out empty). The last producer done with the words (a count after them) sets
// them all back to kUnstarted for the next call.
// NOTE: every taker of a range wins its pages in one atomic, where a compare-and-swap lets one
// of the takers reading the same word win and the others read again. Measured (v46, fp8
// 64 x 256K Q = 4, 4 runs of 100 back-to-back replays a build): medians unchanged; the slowest
// replay over the median plain 36-38 -> 15-20 us (in 3 of 4 runs each), CP P=2 14-15 -> 4-7 us.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace cpidx {
namespace cuda {

// Steps whose CTAs hold fewer pages each keep static ranges (at 15.5 pages a CTA, 64 x 8K,
// stealing measured 0.2-0.4 us slower: a short tail, and the owners' claims).
constexpr int64_t kMinStealShare = 16;
constexpr int64_t kStealPages = 2;  // pages per steal (one atomic each)
constexpr int kStealNear = 8;  // CTAs looked at on each side (one producer lane each), and as
constexpr int kStealFar = 16;  // many spread evenly over the rest of the grid
constexpr int kStealLanes = 2 * kStealNear + kStealFar;  // lanes (CTAs) of one look
static_assert(kStealLanes == 32, "steal_victim gives each lane of the producer warp one CTA");
constexpr unsigned long long kUnstarted = ~0ull;

// What a taker claims of `left` pages a range has unclaimed: kStealPages at most.
__host__ __device__ inline int64_t steal_take(int64_t left) {
  return left < kStealPages ? left : kStealPages;
}
// Whether a step of `total` pages on `grid` CTAs shares its ranges (every CTA then has pages).
__host__ __device__ inline bool steals(bool split, bool enabled, int64_t total, int grid) {
  return split && enabled && total >= kMinStealShare * grid && total < (int64_t{1} << 31);
}
__host__ __device__ inline unsigned long long pack_range(int64_t front, int64_t back) {
  return (static_cast<unsigned long long>(back) << 32) | static_cast<uint32_t>(front);
}
__host__ __device__ inline int64_t range_front(unsigned long long w) { return w & 0xffffffffu; }
__host__ __device__ inline int64_t range_back(unsigned long long w) {
  return static_cast<int32_t>(static_cast<uint32_t>(w >> 32));  // signed: see steal_delta
}
// Added to a started word, takes `take` pages off its back (the low half, the front, is left as
// it is: no borrow crosses into it). Takers together move the back at most
// kStealPages x grid below the front, far above INT32_MIN.
__host__ __device__ inline unsigned long long steal_delta(int64_t take) {
  return 0ull - (static_cast<unsigned long long>(take) << 32);
}
// The pages a taker that added steal_delta(take) to a word reading `old` has won: [*lo, *hi),
// empty when the front had passed the back.
__host__ __device__ inline bool stolen_range(unsigned long long old, int64_t take, int64_t* lo,
                                             int64_t* hi) {
  const int64_t front = range_front(old), back = range_back(old);
  *hi = back;
  *lo = back - take > front ? back - take : front;
  return *hi > *lo;
}
// The owner's next claim from `left` unclaimed pages: a quarter, one at a time near the end so
// that what is not yet in its ring stays available to others.
// NOTE: claims of at most 4 pages measured +0.1 to +3 us, with steals as rare as before (median
// 0 a CTA): the CTAs' spread at the end is their rings draining at unequal per-SM rates, not
// claimed pages (docs/perf/README.md, v21-chunks).
__host__ __device__ inline int64_t own_chunk(int64_t left) {
  return left <= 8 ? 1 : (left / 4 < 32 ? left / 4 : 32);
}
// The owner's next claim from [front, back), what its word leaves of its static range
// [.., end): own_chunk while no taker has been there, a taker's steal_take once one has
// (back < end: a CTA done with its own pages is here, so what the owner claims it may score
// alone after the others; an owner placed late finds its range so, started by a taker).
// NOTE: an owner placed late claiming own_chunk's 32 pages scored them alone for ~47 us after
// every other CTA was done. With these claims (v47, fp8 64 x 256K Q = 4, 5 runs of 100
// back-to-back replays a build): the slowest replay over the median 15-20 -> 4-7 us, medians
// unchanged (docs/perf/README.md).
__host__ __device__ inline int64_t owner_chunk(int64_t front, int64_t back, int64_t end) {
  const int64_t left = back - front;
  return back < end ? steal_take(left) : own_chunk(left);
}
// The CTA that producer lane `lane` of CTA `self` (of `ctas`) looks at: lanes below 16 the
// (lane / 2 + 1)-th to the right (even lanes) or left (odd lanes), the others one of 16 points
// spread evenly around the grid from self (a slow stretch of CTAs anywhere is seen).
__host__ __device__ inline int64_t steal_victim(int64_t self, int lane, int64_t ctas) {
  if (lane < 2 * kStealNear) return self + ((lane & 1) ? -(lane / 2 + 1) : lane / 2 + 1);
  const int64_t k = lane - 2 * kStealNear + 1;  // 1 .. kStealFar
  return (self + k * ctas / (kStealFar + 1)) % ctas;
}
// What the word `seen` of CTA `victim` leaves unclaimed: [*front, *back).
__host__ __device__ inline void unclaimed(unsigned long long seen, int64_t victim, int64_t total,
                                          int64_t ctas, int64_t* front, int64_t* back) {
  *front = seen == kUnstarted ? victim * total / ctas : range_front(seen);
  *back = seen == kUnstarted ? (victim + 1) * total / ctas : range_back(seen);
}
// Whether the CTA a producer lane looks at (steal_victim) is one of the step's `ctas`.
// NOTE: v15 looked only at the CTAs sharing the thief's last request, so that it kept its
// queries; any CTA within reach measured 1.4-8.3 us faster at 64 requests (a request then spans
// ~4 CTAs) and the same at 8 (docs/perf/README.md, v19-steal).
__host__ __device__ inline bool in_grid(int64_t victim, int64_t ctas) {
  return victim >= 0 && victim < ctas;
}
// Pages that may be taken from the back of [front, back), the unclaimed pages of a CTA looked at
// (`can`; else none).
__host__ __device__ inline int64_t stealable(bool can, int64_t front, int64_t back) {
  return can && back > front ? back - front : 0;
}

}  // namespace cuda
}  // namespace cpidx
