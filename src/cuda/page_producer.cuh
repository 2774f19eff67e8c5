// src/cuda/page_producer.cuh: the scoring kernel's producer warp. It fills the CTA's ring of
// stages with its pages (bulk copies, block-table reads batched 32 at a time): a static range
// of the step's flattened pages, or on large split steps the run-time share of work_steal.h;
// and its first page as soon as the PDL wait returns (EarlyRing). One read of each page.
#pragma once

#include <stdint.h>

#include "device_utils.cuh"
#include "kernels.h"
#include "page_order.cuh"
#include "page_traits.cuh"
#include "ring_pos.h"
#include "score_trace.cuh"
#include "shard_select.cuh"
#include "work_steal.h"

namespace cpidx {
namespace cuda {

// This CTA's share of a step of `total` pages. Split path (small steps): one key per (column,
// page) to p.split_keys, selection left to select_topk; every CTA that has a page takes one.
// Fused path: at least kMinPagesPerCta.
// NOTE: static ranges on the fused path; the split path shares them at run time when every CTA
// holds >= 16 pages (v15, below). A run-time pool for the split path (the last quarter of
// the pages claimed 2 at a time from an atomic cursor by CTAs done with their range) measured
// -2 to -4.5 us at plain 8 x 256K, +1 to +1.8 us at 8 x 64K and 64 x 8K (a CTA entering the
// pool reloads its queries after the page lands) and nothing on the 2-GPU step
// (docs/perf/README.md, v10-pool); not kept. Nor are pages weighted per SM by measured rates
// (24 of 132 SMs stream ~20% faster, always the same ones; shares claimed per SM): 2-4 us
// slower, since the other SMs keep DRAM saturated while the fast ones idle and the weights
// carry the last call's chance order into the next (v13-balance).
struct WorkRange {
  bool split;
  int64_t ctas, start, end;
};
__device__ __forceinline__ WorkRange work_range(const ScoreTopkParams& p, int64_t total,
                                                int64_t longest, int grid) {
  WorkRange w;
  w.split = split_path(p, total, longest);
  w.ctas = w.split ? (total < grid ? total : grid) : fused_ctas(total, grid);
  w.start = blockIdx.x < w.ctas ? blockIdx.x * total / w.ctas : 0;
  w.end = blockIdx.x < w.ctas ? (blockIdx.x + 1) * total / w.ctas : 0;
  return w;
}

// The split path's run-time share (v15, work stealing): work_steal.h.
__device__ __forceinline__ unsigned long long load_word(const unsigned long long* w) {
  unsigned long long v;  // volatile: read again on every look, never hoisted out of the loop
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(w) : "memory");
  return v;
}

// One page's bulk copy: its bytes and its source in the cache.
struct PageCopy {
  uint32_t bytes = 0;
  const uint8_t* src = nullptr;
};

// The bulk copy of block gblk of a request whose length and block-table entry read `seq_len`
// and `entry`: its source in the cache and its bytes, the block's tokens under the length.
// Both values are clamped as the reference clamps them (errors OR-ed into *err). At least one
// token: a block is below the length its prefix counted, but the early ring reads that length
// a second time, which may be newer (such a stage is handed back); the copy stays in its page.
template <DType kDType>
__device__ __forceinline__ PageCopy page_source(const ScoreTopkParams& p, int32_t seq_len,
                                                int32_t entry, int64_t gblk, int32_t* err) {
  using Page = PageTraits<kDType>;
  const int32_t len = clamp_seq_len(seq_len, p.max_seq_len, err);
  const int64_t page = clamp_page(entry, p.num_pages, err);
  int64_t tokens = len - gblk * kBlockSize;
  tokens = tokens < 1 ? 1 : (tokens < kBlockSize ? tokens : kBlockSize);
  return {static_cast<uint32_t>(tokens) * Page::kRowBytes,
          static_cast<const uint8_t*>(p.cache) + page * Page::kBytes};
}

// Lane i's page copy, in every lane of the warp (the producer's lanes look pages up 32 at a
// time; lane 0 issues the copies).
__device__ __forceinline__ PageCopy lane_copy(const PageCopy& mine, int i) {
  return {__shfl_sync(0xffffffffu, mine.bytes, i),
          reinterpret_cast<const uint8_t*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(mine.src), i))};
}

// Lane 0: starts page copy c into stage st, its bytes expected on the stage's full barrier
// (by the caller: with or without an arrive).
template <DType kDType>
__device__ __forceinline__ void start_copy(const Smem& s, int st, const PageCopy& c) {
  bulk_copy_g2s(s.pages + static_cast<size_t>(st) * PageTraits<kDType>::kBytes, c.src, c.bytes,
                &s.full[st]);
}

// How long the fp8 producer's wait for a free stage may suspend it per poll (it resumes when the
// stage frees): longer than a page takes, so it polls about once a page.
// NOTE: fp8 only. Its consumers are issue-bound and the suspended waits took 0.7-1.3% off its
// large Q = 4 steps and 3.3% off plain 64 x 8K Q = 4; bf16 lost 0.2-0.8% with them
// (docs/perf/README.md, v32a), so its producer polls as before.
constexpr uint32_t kProducerSuspendNs = 20000;

// Stage markers in s.stage_x besides a page: no more pages, or a stage to hand back unscored.
// Both negative: a page index never is, so one compare tells a marker.
constexpr int64_t kNoMorePages = -1, kSkipStage = -2;

// What an early page's copy depends on: its request's length and its block-table entry, read
// through L2 (before the wait for the copy, after it for the check).
struct CopyInputs {
  int32_t len, entry;
};
__device__ __forceinline__ CopyInputs read_copy_inputs(const ScoreTopkParams& p, int r,
                                                       int64_t gblk) {
  return {__ldcg(p.seq_lens + r), __ldcg(p.block_table + r * p.bt_row_stride + gblk)};
}

// The producer's first pages (up to kEarlyStages), looked up before the PDL wait and copied as soon
// as the wait returns: lane i holds the CTA's i-th page, its request and block, and the length and
// block-table entry as read before the wait. After the wait both are read again; the stages go to
// the consumers if nothing the copies used had changed (the prefix included) and, when the CTA
// steals, if its compare-and-swap started its own range (else a thief started it: the pages are
// claimed from the range word as usual); otherwise they are handed back unscored (kSkipStage) and
// the range is issued from its start. The copies themselves start after the wait, so they read the
// page contents the kernel before wrote.
// NOTE: (the whole ring early) -0.5 to -1.3 us on most steps of 8K-64K a request and on the CP
// 64-request steps, nothing at 1 x 8K (the first page lands ~0.6 us sooner, not the 1.4 us its
// copy moved) and +0.5-0.7 us at 1 x 256K. Copying after the prefix check instead, from lengths
// and entries read beside it, gained less and lost as much (docs/perf/README.md, v22, v22b).
// The stages wait for their bytes, not for the check: the second reads issued before the copies
// handed the stages over 1-3 us sooner and the first page landed no sooner (v23); touching each
// early page before the wait (its address translation warm) changed nothing either (v24).
struct EarlyRing {
  int n = 0;  // stages copied early (warp-uniform; 0: none)
  int r = 0;
  int64_t gblk = 0;
  CopyInputs in{};  // as read before the wait
};

// How many stages a CTA copies early: its first kEarlyStages pages, and on a stealing step no
// more than its first claim (own_chunk), which its start compare-and-swap takes. Every thread
// computes it (the consumers must hand the stages back even when the range changed). The sparse
// offsets are recomputed after the wait anyway: none. The rest of the ring is issued after the
// hand-over (produce).
// NOTE: one stage, not the whole ring. Pages in flight together land together: the memory
// serves every outstanding request at once, so a page lands about (bytes in flight) / (the
// memory's rate) after its copy starts. The whole ring at the wait (264 CTAs x 3 stages, 26 MB)
// landed its first page ~6 us after the copies at 1 x 256K and 8 x 256K; one stage each
// (8.6 MB) ~3 us, which still keeps the memory busy. Measured (docs/perf/README.md, v27): the
// first page 1.4-3.5 us sooner from 1 x 64K up; 25 of 36 steps faster, by up to 1.2 us (most
// on Q = 4 and the context-parallel steps), the large plain steps within their noise, and
// plain 64 x 8K, Q = 1 +0.8 to +1.6 us (some SMs finish their static ranges late). Two stages
// gained less and lost 0.6 us at plain 8 x 256K (v27b); the whole ring with a 1 us gap after
// its first stage was mixed (v27c).
constexpr int kEarlyStages = 1;
__device__ __forceinline__ int early_stages(const WorkRange& w, bool steal, int stages,
                                            bool sparse) {
  const int64_t span = w.end - w.start;
  const int64_t cap = stages < kEarlyStages ? stages : kEarlyStages;
  int64_t n = span < cap ? span : cap;
  if (steal && own_chunk(span) < n) n = own_chunk(span);
  return sparse ? 0 : static_cast<int>(n);
}

// Before the wait (producer warp): looks up the CTA's first n pages of [w.start, w.end).
template <bool kSparse>
__device__ __forceinline__ EarlyRing look_up_early(const ScoreTopkParams& p,
                                                   const RequestOffsets<kSparse>& offs,
                                                   const WorkRange& w, int n, int lane) {
  EarlyRing e;
  e.n = n;
  if (lane < e.n) {
    int64_t lo = 0;
    e.r = offs.find(p, w.start + lane, &lo);
    e.gblk = (w.start + lane - lo) * p.world + p.rank;
    e.in = read_copy_inputs(p, e.r, e.gblk);
  }
  return e;
}

// After the wait (producer warp): expects each early page's bytes on its stage's full barrier
// and starts its copy; the barrier's arrival waits for the check (produce).
template <DType kDType>
__device__ __forceinline__ void copy_early(const ScoreTopkParams& p, const Smem& s,
                                           const EarlyRing& e, int lane) {
  int32_t unused = 0;  // errors are raised from the values read after the wait
  PageCopy mine;
  if (lane < e.n) mine = page_source<kDType>(p, e.in.len, e.in.entry, e.gblk, &unused);
  for (int i = 0; i < e.n; ++i) {
    const PageCopy c = lane_copy(mine, i);
    if (lane == 0) {
      if (i == 0) CPIDX_TRACE_STAMP(true, kTFirstIssue);
      CPIDX_TRACE_STAMP(true, kTLastIssue);
      mbar_expect_tx(&s.full[i], c.bytes);
      start_copy<kDType>(s, i, c);
    }
  }
}

// After the prefix check (producer warp): whether every early page's length and table entry
// read now equal the ones its copy used (and the prefix did not move). Raises the table errors
// issue() would have raised for those pages.
__device__ __forceinline__ bool early_ring_holds(const ScoreTopkParams& p, const EarlyRing& e,
                                                 bool prefix_changed, int lane, int32_t* err) {
  bool same = true;
  if (lane < e.n) {
    const CopyInputs now = read_copy_inputs(p, e.r, e.gblk);
    same = now.len == e.in.len && now.entry == e.in.entry;
    if (same && !prefix_changed) clamp_page(now.entry, p.num_pages, err);
  }
  return !prefix_changed && __all_sync(0xffffffffu, same);
}

// Producer warp: fills the stage ring with the CTA's pages (32 block-table reads at a time),
// recording each stage's page in s.stage_x, then marks the next stage kNoMorePages.
// steal: the split path's run-time share (work_steal.h); else the static range [w.start, w.end).
// The first ring.n stages were copied before this call (copy_early): they go to the consumers
// as the range's first pages if the ring holds (early_ring_holds, and a stealing CTA's start
// compare-and-swap took its own range), else they are handed back unscored.
template <DType kDType, bool kSparse>
__device__ void produce(const ScoreTopkParams& p, const Smem& s,
                        const RequestOffsets<kSparse>& offs, const WorkRange& w, int64_t total,
                        bool steal, int stages, const EarlyRing& ring, bool prefix_changed,
                        int32_t* err) {
  const int lane = threadIdx.x % 32;
  const int early = ring.n;
  CPIDX_TRACE_SUMS();
  int64_t lp = early;
  RingPos at(early, stages);  // lp's place in the ring
  // Hands the early stages over; returns the first page left to issue.
  auto hand_over = [&](bool holds) -> int64_t {
    if (lane == 0) {
      CPIDX_TRACE_STAMP(early > 0, kTHandedOver);
      for (int i = 0; i < early; ++i) {
        s.stage_x[i] = holds ? w.start + i : kSkipStage;  // released by the arrive
        mbar_arrive(&s.full[i]);
      }
    }
    return holds ? w.start + early : w.start;
  };
  // The request of the last page issued and its pages [cur_lo, cur_hi) (-1: none yet): most
  // pages of a batch belong to it, and need no lookup.
  int cur = -1;
  int64_t cur_lo = 0, cur_hi = 0;
  auto issue = [&](int64_t from, int64_t to) {  // pages [from, to)
    for (int64_t x0 = from; x0 < to; x0 += 32) {
      const int64_t x = x0 + lane;
      PageCopy mine;
      int r = cur;
      int64_t lo = cur_lo;
      if (x < to && (x < cur_lo || x >= cur_hi)) r = offs.find(p, x, &lo);
      if (x < to) {
        const int64_t gblk = (x - lo) * p.world + p.rank;
        mine = page_source<kDType>(p, p.seq_lens[r], p.block_table[r * p.bt_row_stride + gblk],
                                   gblk, err);
      }
      const int count = to - x0 < 32 ? static_cast<int>(to - x0) : 32;
      cur = __shfl_sync(0xffffffffu, r, count - 1);
      cur_lo = __shfl_sync(0xffffffffu, lo, count - 1);
      cur_hi = cur_lo + offs.pages(p, cur);
      for (int i = 0; i < count; ++i, ++lp) {
        const PageCopy c = lane_copy(mine, i);
        if (lane == 0) {
          CPIDX_TRACE_CLOCK(t0);
          if constexpr (kDType == DType::kFP8E4M3)
            mbar_wait_suspended(&s.empty[at.st], at.phase ^ 1u, kProducerSuspendNs);
          else
            mbar_wait(&s.empty[at.st], at.phase ^ 1u);
          CPIDX_TRACE_ADD(true, kTEmptyWait, CPIDX_TRACE_SINCE(t0));
          s.stage_x[at.st] = x0 + i;  // released to the consumers by the arrive below
          if (lp == 0) CPIDX_TRACE_STAMP(true, kTFirstIssue);
          // The copy's source came from this batch's table reads: the stamp follows them.
          if (early > 0 && lp == early) CPIDX_TRACE_STAMP(c.src != nullptr, kTRingIssue);
          CPIDX_TRACE_STAMP(true, kTLastIssue);
          mbar_arrive_expect_tx(&s.full[at.st], c.bytes);
          start_copy<kDType>(s, at.st, c);
        }
        at.next(stages);
      }
    }
  };
  if (!steal) {
    const bool holds = early > 0 && early_ring_holds(p, ring, prefix_changed, lane, err);
    issue(hand_over(holds), w.end);
  } else {
    unsigned long long* const words = p.steal_words;
    int64_t front = w.start + own_chunk(w.end - w.start), back = w.end;
    unsigned long long old = 0;
    // NOTE: looking the first chunk up while this compare-and-swap is in flight issued the first
    // copy ~0.35 us sooner and left the step as it was: the first ring lands at the memory's
    // rate either way (docs/perf/README.md, v20b).
    if (lane == 0) old = atomicCAS(words + blockIdx.x, kUnstarted, pack_range(front, back));
    const bool holds = early > 0 && early_ring_holds(p, ring, prefix_changed, lane, err);
    old = __shfl_sync(0xffffffffu, old, 0);
    const int64_t first = hand_over(holds && old == kUnstarted);
    if (old == kUnstarted) {
      issue(first, front);
    } else {  // started by a CTA that took pages from its back: claim all from the word
      front = range_front(old);
      back = range_back(old);
    }
    while (front < back) {  // claims from the front of this CTA's range
      const int64_t c = owner_chunk(front, back, w.end);
      if (lane == 0) old = atomicAdd(words + blockIdx.x, static_cast<unsigned long long>(c));
      old = __shfl_sync(0xffffffffu, old, 0);
      front = range_front(old);
      back = range_back(old);
      if (front >= back) break;
      issue(front, front + c < back ? front + c : back);
      front += c;
    }
    // Pages from the backs of the 8 CTAs on each side and 16 spread over the grid: each lane
    // looks at one of them (steal_victim), the lane that sees the most left takes up to
    // kStealPages: by compare-and-swap on the value it read if that starts the range, else by
    // subtracting them from the back (work_steal.h).
    const int64_t victim = steal_victim(blockIdx.x, lane, w.ctas);
    const bool can = in_grid(victim, w.ctas);
    for (;;) {
      const unsigned long long seen = can ? load_word(words + victim) : 0;
      int64_t vf = 0, vb = 0;
      unclaimed(seen, victim, total, w.ctas, &vf, &vb);
      const int64_t avail = stealable(can, vf, vb);
      int64_t best = avail;
      for (int o = 16; o > 0; o /= 2) {
        const int64_t other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
      }
      if (best == 0) break;
      const int taker = __ffs(__ballot_sync(0xffffffffu, avail == best)) - 1;
      const int64_t take = steal_take(best);
      int64_t lo = 0, hi = 0;
      if (lane == taker) {
        if (seen == kUnstarted) {
          if (atomicCAS(words + victim, seen, pack_range(vf, vb - take)) == seen) {
            lo = vb - take;
            hi = vb;
          }
        } else {
          stolen_range(atomicAdd(words + victim, steal_delta(take)), take, &lo, &hi);
        }
      }
      lo = __shfl_sync(0xffffffffu, lo, taker);
      hi = __shfl_sync(0xffffffffu, hi, taker);
      if (hi <= lo) continue;  // another CTA started the range, or it ran dry: look again
      CPIDX_TRACE_ADD(lane == 0, kTStolen, hi - lo);
      issue(lo, hi);
    }
    // Done with the words; the last producer of the grid resets them for the next call.
    bool reset = false;
    if (lane == 0) {
      __threadfence();
      reset = atomicAdd(words + p.steal_count_at, 1ull) == gridDim.x - 1;
      if (reset) __threadfence();
    }
    if (__shfl_sync(0xffffffffu, reset, 0)) {
      for (int i = lane; i < static_cast<int>(gridDim.x); i += 32) words[i] = kUnstarted;
      if (lane == 0) words[p.steal_count_at] = 0;
    }
  }
  if (lane == 0) {  // no more pages
    const int st = at.st;
    mbar_wait(&s.empty[st], at.phase ^ 1u);
    s.stage_x[st] = kNoMorePages;  // released to the consumers by the arrive (as a page's)
    // NOTE: compute-sanitizer's racecheck reports this write, and the page indices written in
    // issue(), against the consumers' reads of stage_x, although the arrive (release) and their
    // wait (acquire) order them; completing this phase by a 16-byte copy did not change that
    // (docs/perf/README.md, v16-racecheck), and storing the index by st.async (completing 8
    // bytes on the same barrier) traps with an illegal instruction in a launch without clusters
    // (v17-st.async).
    mbar_arrive(&s.full[st]);
  }
  CPIDX_TRACE_FLUSH(lane == 0);
  __syncwarp();
}

}  // namespace cuda
}  // namespace cpidx
