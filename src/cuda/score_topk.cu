// src/cuda/score_topk.cu: the fused decode kernel. A persistent grid splits the flattened list of
// the shard's (request, owned block) pages evenly across CTAs (large split steps then share the
// ranges at run time: work stealing, v15). In each CTA a producer warp (page_producer.cuh) brings
// every 32 KB key page in once with the bulk-copy engine (several pages in flight, block-table
// reads batched 32 at a time), and four consumer warps score it on tensor cores against every
// (head, query-token) column of its request, reduce it to a causal block max, force it, and keep
// a running per-column top K. A request inside one CTA is finished there; a request split
// across CTAs leaves each CTA's ordered lists in the workspace, and select_topk (the next
// kernel, chained by programmatic dependent launch) merges them exactly, every request in
// parallel, so no CTA stops streaming to merge. Cost: one read of the shard's cache bytes.
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"
#include "kernels.h"
#include "page_order.cuh"
#include "page_producer.cuh"
#include "page_traits.cuh"
#include "query_scale.h"
#include "score_trace.cuh"
#include "shard_select.cuh"
#include "work_steal.h"

namespace cpidx {
namespace cuda {
namespace {

constexpr int kQStride = kHeadDim + 8;  // bf16 elements per query row in smem (padded)

// fp8 pages at 16 columns (Q = 4 at 4 heads, Q = 2 at 8) are scored two at a time under one
// barrier when they follow each other in one request (the kernel's kPairPages): their maxima
// take two slots of a red set. Not at 8 columns, whose 96-register instance spills with it.
__host__ __device__ constexpr bool pairs_pages(DType dtype, int ncols) {
  return dtype == DType::kFP8E4M3 && ncols == 16;
}

// Shared-memory layout, computed identically on host (sizing) and device (carving).
struct SmemLayout {
  size_t stages_off, q_off, qinv_off, red_off, cbuf_off, tmp_off, cnt_off, tau_off, prefix_off,
      full_off, empty_off, stage_x_off, misc_off, total;
  __host__ __device__ SmemLayout(int stages, DType dtype, int ncols, int topk, int max_reqs,
                                 int prefix_shift) {
    const size_t page_bytes = static_cast<size_t>(kBlockSize) * kHeadDim * dtype_bytes(dtype);
    // fp8 query scales, the current request's and the next one's (staged: load_queries); bf16
    // queries are not scaled.
    const size_t scale_sets = dtype == DType::kFP8E4M3 ? 2 : 0;
    size_t o = 0;
    auto take = [&](size_t bytes, size_t align) {
      o = (o + align - 1) / align * align;
      size_t at = o;
      o += bytes;
      return at;
    };
    const int cap = cand_capacity(topk);
    stages_off = take(static_cast<size_t>(stages) * page_bytes, 128);
    q_off = take(static_cast<size_t>(ncols) * kQStride * 2, 16);
    qinv_off = take(scale_sets * ncols * sizeof(float), 16);
    const size_t red_sets = pairs_pages(dtype, ncols) ? 4 : 2;  // two a barrier, two pages a set
    red_off = take(red_sets * kConsumerWarps * ncols * sizeof(float), 16);
    cbuf_off = take(static_cast<size_t>(ncols) * cap * sizeof(Key), 16);
    tmp_off = take(static_cast<size_t>(ncols) * topk * sizeof(Key), 16);
    cnt_off = take(static_cast<size_t>(ncols) * sizeof(int), 16);
    tau_off = take(static_cast<size_t>(ncols) * sizeof(Key), 16);
    prefix_off = take((static_cast<size_t>(max_reqs >> prefix_shift) + 1) * sizeof(int64_t), 16);
    full_off = take(static_cast<size_t>(stages) * sizeof(uint64_t), 8);
    empty_off = take(static_cast<size_t>(stages) * sizeof(uint64_t), 8);
    stage_x_off = take(static_cast<size_t>(stages) * sizeof(int64_t), 8);
    misc_off = take(16 * sizeof(int), 16);
    total = o;
  }
};

// The B fragment of MMA (j, half) for lane (g, c4): 4 dims of column nt * 8 + g, those its A
// fragment holds of the keys (Page::dim), staged at kstep_dim(j, c4) (Page::query_chunk).
template <typename Page>
__device__ __forceinline__ uint2 query_frag(const Smem& s, int nt, int g, int j, int c4, int half) {
  return *reinterpret_cast<const uint2*>(s.q + (nt * 8 + g) * kQStride + kstep_dim(j, c4) +
                                         half * 4);
}

// fp8 pages (fp16 MMAs, PageTraits): eight of a column's bf16 query values, scaled by 2^e into
// fp16, e from the column's largest finite |q| over its 16 chunks (16 adjacent lanes, one chunk
// each; query_scale.h): every value within 2^32 of that one is then exactly an fp16 value, each
// product is the bf16 path's times 2^e (keys are exact in fp16 too), and so is every fp32 sum.
// Returns 2^-e, which scales the dots back exactly. A value over 2^32 below its column's largest
// rounds to fp16's 2^-24 step (its share of the dot is below fp32's rounding of it). inf and NaN
// stay what they are.
__device__ __forceinline__ float scale_query_chunk(uint4* v) {
  uint32_t w[4] = {v->x, v->y, v->z, v->w};
  float f[8], m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = bits_float((i % 2 ? w[i / 2] >> 16 : w[i / 2] & 0xFFFFu) << 16);  // bf16 -> f32
    if (isfinite(f[i])) m = fmaxf(m, fabsf(f[i]));
  }
#pragma unroll
  for (int o = 1; o < 16; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int e = query_scale_exponent(m);
  const float up = pow2(e);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 h = __floats2half2_rn(f[2 * i] * up, f[2 * i + 1] * up);
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  *v = make_uint4(w[0], w[1], w[2], w[3]);
  return pow2(-e);
}

// Scoring CTAs an SM can hold by registers: for fp8 pages four at 8 columns (96 registers a
// thread) and three at 16 (136), two otherwise.
// NOTE: an fp8 page is half a bf16 page's bytes for nearly the same per-page work, so its
// consumers, not the memory, set the rate: at 64 x 256K, 4 heads, Q = 1, two CTAs per SM read
// fp8 at 2.48 TB/s, three at 2.91, with straight loads (kSwizzle) 3.16, with fp16 MMAs (v29)
// 3.49 and with four CTAs 4.07 (docs/perf/README.md, v28b-v29b). Four at 16 columns fit only
// with the query fragments read from shared memory every page, and that was 13-22% slower than
// three with them in registers (v29c); with the columns split between warp pairs (each key
// widened twice), 30-43% slower (v30a). Wider instances need more than 136 registers.
template <int NT, DType kDType>
constexpr int kMinCtasPerSm = kDType == DType::kFP8E4M3 ? (NT == 1 ? 4 : NT == 2 ? 3 : 2) : 2;

template <int NT, DType kDType, bool kSparse>
__global__ void __launch_bounds__(kThreads, (kMinCtasPerSm<NT, kDType>))
    score_topk_kernel(const ScoreTopkParams p, const int stages, const int max_reqs_smem,
                      const int prefix_shift) {
  // 16-byte fp8 key loads in the 16-column instance: -3.7% plain, -5.1% CP P=2 at 64 x 1M, Q = 4
  // (v40b). At 8 columns they cost the 96-register instance spills and gained nothing (plain
  // 1 x 1M +4%, v40); above 16, spills (64 columns: 312 B).
  using Page = PageTraits<kDType, kDType == DType::kFP8E4M3 && NT == 2 ? 2 : 1>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const int Q = p.query_len, H = p.num_heads, K = p.topk, cap = cand_capacity(K);
  const int ncols = H * Q;  // <= NT * 8
  const int grid = gridDim.x;
  const SmemLayout lay(stages, kDType, NT * 8, K, max_reqs_smem, prefix_shift);
  const Smem s{smem_raw + lay.stages_off,
               reinterpret_cast<__nv_bfloat16*>(smem_raw + lay.q_off),
               reinterpret_cast<float*>(smem_raw + lay.qinv_off),
               reinterpret_cast<float*>(smem_raw + lay.red_off),
               reinterpret_cast<Key*>(smem_raw + lay.cbuf_off),
               reinterpret_cast<Key*>(smem_raw + lay.tmp_off),
               reinterpret_cast<int*>(smem_raw + lay.cnt_off),
               reinterpret_cast<Key*>(smem_raw + lay.tau_off),
               reinterpret_cast<int64_t*>(smem_raw + lay.prefix_off),
               reinterpret_cast<uint64_t*>(smem_raw + lay.full_off),
               reinterpret_cast<uint64_t*>(smem_raw + lay.empty_off),
               reinterpret_cast<int64_t*>(smem_raw + lay.stage_x_off),
               reinterpret_cast<int*>(smem_raw + lay.misc_off)};
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c4 = lane % 4;
  int32_t err = 0;
  CPIDX_TRACE_LATE();
  CPIDX_TRACE_RESET(tid == 0);
  CPIDX_TRACE_SUMS();
  CPIDX_TRACE_STAMP(tid == 0, kTEntry);
  CPIDX_TRACE_CYCLES(tid == 0, kTEntryClock);
  CPIDX_TRACE_SMID(tid == 0);
  // ---- 1. Owned pages per request and their prefix sum (every CTA computes the same). -----
  // Programmatic dependent launch: this grid may start while the previous kernel in the stream
  // drains, and only what is read after pdl_wait() is guaranteed current. The prefix sum is
  // computed before the wait from lengths read speculatively (through L2, the point of
  // coherence), and the first request's queries are prefetched into L2 (a prefetch only warms
  // L2: a later write still wins). After the wait every length is read again, and the prefix is
  // recomputed if any page count changed.
  // NOTE: L2 prefetches of each CTA's first pages before the wait (cp.async.bulk.prefetch) were
  // measured 0.3-1.8 us slower at 1 x 64K to 8 x 256K and only 0.3 us faster at 1 x 8K
  // (docs/perf/README.md, v7); they are not issued. Nor are the first pages' bulk copies
  // themselves before the wait (checked against the table and lengths after it, redone if they
  // changed): within +-1 us of waiting, on one GPU back to back and on the 2-GPU step behind the
  // query gather (v12-early, not kept; it also cannot check page contents the kernel before it
  // may still be writing). A steady L2 prefetch 3 pages ahead of the ring was 12% slower, and
  // one of a short range's pages past its first ring, as they are looked up, 1.2-1.7 us slower
  // on steps of ~4 pages a CTA (v49): the prefetched bytes delay the ring's own.
  const int B = p.num_reqs;
  int r0 = 0, r1 = 0;
  thread_requests<kThreads>(B, &r0, &r1);
  if (tid < 16) s.misc[tid] = 0;
  if (tid < NT * 8) { s.cnt[tid] = 0; s.tau[tid] = kPadKey; }
  if (tid < stages) { mbar_init(&s.full[tid], 1); mbar_init(&s.empty[tid], kConsumerWarps); }
  if (tid == 0) fence_barrier_init();
  const RequestOffsets<kSparse> offs{s.prefix, prefix_shift, B};
  int64_t total = 0;
  int64_t longest = pages_prefix<kThreads>(p, s.prefix, prefix_shift, r0, r1, &total);
  WorkRange w = work_range(p, total, longest, grid);
  if (tid < ncols && w.start < w.end) {
    int64_t unused = 0;
    const int r = offs.find(p, w.start, &unused), h = tid / Q, t = tid % Q;
    const __nv_bfloat16* q = p.q_head[h] + (static_cast<int64_t>(r) * Q + t) * p.q_row_stride;
    prefetch_l2(q);
    prefetch_l2(q + kHeadDim - 8);  // a 256-byte row may span two lines
  }
  // The producer's first page is looked up before the wait and copied right after it (EarlyRing).
  const int early =
      early_stages(w, steals(w.split, p.steal_words != nullptr, total, grid), stages, kSparse);
  EarlyRing ring;
  if (warp == kConsumerWarps && early > 0) ring = look_up_early(p, offs, w, early, lane);
  pdl_wait();
  pdl_launch_dependents();
  CPIDX_TRACE_STAMP(tid == 0, kTWaited);
  if (warp == kConsumerWarps && early > 0) copy_early<kDType>(p, s, ring, lane);
  bool changed = prefix_shift > 0;  // offsets kept every 2^shift requests: always recomputed
  for (int r = r0; r < r1; ++r) {
    const int64_t own = owned_pages(p, __ldcg(p.seq_lens + r), &err);
    changed |= prefix_shift == 0 && own != s.prefix[r + 1] - s.prefix[r];
  }
  const bool prefix_changed = __syncthreads_or(changed);
  if (prefix_changed) {
    longest = pages_prefix<kThreads>(p, s.prefix, prefix_shift, r0, r1, &total);
    w = work_range(p, total, longest, grid);
  }
  CPIDX_TRACE_STAMP(tid == 0, kTPrefix);
  if (blockIdx.x == 0 && err) atomicOr(p.error_flag, err);
  err = 0;
  const int64_t g_eff = w.ctas, start = w.start, end = w.end;
  const bool split = w.split;

  // Every CTA has a share (g_eff == grid) when it steals: all of them count out of the words.
  const bool steal = steals(split, p.steal_words != nullptr, total, grid);
  if (warp == kConsumerWarps) {  // ---- the producer warp ------------------------------------
    produce<kDType, kSparse>(p, s, offs, w, total, steal, stages, ring, prefix_changed, &err);
    if (err) atomicOr(p.error_flag, err);
    return;
  }

  // ---- 2. Requests with no owned page: their outputs are all padding. ----------------------
  for (int r = blockIdx.x; !split && r < B; r += grid) {
    if (offs.pages(p, r) != 0) continue;
    for (int idx = tid; idx < ncols * cap; idx += kConsumerThreads) s.cbuf[idx] = kPadKey;
    consumer_sync();
    finalize_request(p, s, r, clamp_seq_len(p.seq_lens[r], p.max_seq_len, &err), ncols);
    consumer_sync();
  }
  if (blockIdx.x >= g_eff && early == 0) return;  // else the early stages are handed back

  // ---- 3. Consume this CTA's pages [start, end). -------------------------------------------
  // The request being scored and its pages [req_lo(), req_hi()), kept in registers and looked
  // up at a request change only (sparse offsets read L2; dense ones would make every page's
  // range checks wait on shared memory). The 64-column instances, short of registers, read
  // dense offsets from shared memory.
  // NOTE: the fp8 consumers are latency-bound, and a quarter of their time went to the
  // bookkeeping before each page's loads (Nsight Compute, docs/perf/README.md, v30-ncu); these
  // ranges in registers with the stepped RingPos took 8-9% off fp8 Q = 4 steps (v31b).
  constexpr bool kRangeRegs = kSparse || NT <= 4;
  int64_t r_lo = 0, r_hi = 0;  // kRangeRegs only
  int r = offs.find(p, start, &r_lo);
  if constexpr (kRangeRegs) r_hi = r_lo + offs.pages(p, r);
  auto req_lo = [&]() -> int64_t {
    if constexpr (kRangeRegs) return r_lo; else return s.prefix[r];
  };
  auto req_hi = [&]() -> int64_t {
    if constexpr (kRangeRegs) return r_hi; else return s.prefix[r + 1];
  };
  auto find_req = [&](int64_t x) {
    r = offs.find(p, x, &r_lo);
    if constexpr (kRangeRegs) r_hi = r_lo + offs.pages(p, r);
  };
  int seg_req = -1;
  // NOTE: above 16 columns (NT >= 4) the accumulators leave no registers for the swizzle's
  // chunk groups and selects (ptxas spills): those instances load straight, bank conflicts and
  // all, and read the query fragments from shared memory. fp8 pages load straight at every width
  // (PageTraits).
  constexpr bool kSwizzle = NT <= 2 && Page::kSwizzleMask != 0;
  const int swz = kSwizzle ? g & Page::kSwizzleMask : 0;
  // Up to 16 columns the segment's query fragments stay in registers (16 or 32 per thread)
  // instead of being read from shared memory on every page.
  constexpr bool kQueryRegs = NT <= 2;
  uint2 qreg[4][2][NT];  // unused (and dropped by the compiler) without kQueryRegs
  int32_t seq_len = 0;
  // Loads request r's queries (a new segment).
  auto load_queries = [&](int req) {
    CPIDX_TRACE_CLOCK(tq);
    seg_req = req;
    seq_len = clamp_seq_len(p.seq_lens[req], p.max_seq_len, &err);
    for (int idx = tid; idx < NT * 8 * (kHeadDim / 8); idx += kConsumerThreads) {
      const int col = idx / (kHeadDim / 8), chunk = idx % (kHeadDim / 8);
      uint4 v = make_uint4(0, 0, 0, 0);
      if (col < ncols) {
        const int h = col / Q, t = col % Q;
        v = *reinterpret_cast<const uint4*>(p.q_head[h] + (static_cast<int64_t>(req) * Q + t) *
                                                              p.q_row_stride + chunk * 8);
      }
      if constexpr (Page::kHalf) {  // every thread takes NT turns: the shuffles see whole warps
        const float down = scale_query_chunk(&v);
        if (chunk == 0) s.qinv[NT * 8 + col] = down;  // staged: see below
      }
      *reinterpret_cast<uint4*>(s.q + col * kQStride + Page::query_chunk(chunk) * 8) = v;
    }
    consumer_sync();
    // The new scales replace the previous request's only now: on the split path warp 0 may have
    // been forming the previous page's keys with those until this barrier (racecheck, v34a).
    // Each is moved by the thread that staged it, and read after the next page's barrier.
    if constexpr (Page::kHalf) {
      if (tid % (kHeadDim / 8) == 0) {
#pragma unroll
        for (int k = 0; k < NT; ++k) {  // the columns of this thread's chunk 0s
          const int col = (tid + k * kConsumerThreads) / (kHeadDim / 8);
          s.qinv[col] = s.qinv[NT * 8 + col];
        }
      }
    }
    if constexpr (kQueryRegs) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            qreg[j][half][nt] = query_frag<Page>(s, nt, g, j, c4, half);
    }
    CPIDX_TRACE_ADD(tid == 0, kTQueries, CPIDX_TRACE_SINCE(tq));
  };
  // The stages' pages come from the producer (s.stage_x). The next one is expected to follow the
  // last (always on the static ranges), so a new request's queries load while its page is in
  // flight; a page that did not follow (the split path's share moved) is checked after it lands.
  RingPos at(0, stages);  // page lp's stage and its full barrier's parity
  constexpr bool kPairPages = pairs_pages(kDType, NT * 8);
  constexpr int kRedSet = (kPairPages ? 2 : 1) * kConsumerWarps * NT * 8;  // one set a barrier
  int rs = 0;  // kPairPages: the red set of this iteration (two, alternating; else lp's)
  for (int64_t lp = 0, next = start;; ++lp, at.next(stages)) {
    if (next < end) {
      while (req_hi() <= next && r + 1 < B) {
        ++r;
        if constexpr (kRangeRegs) {
          r_lo = r_hi;
          r_hi = r_lo + offs.pages(p, r);
        }
      }
      if (r != seg_req) load_queries(r);
    }
    const int st = at.st;
    CPIDX_TRACE_CLOCK(tf);
    mbar_wait(&s.full[st], at.phase);
    CPIDX_TRACE_ADD(tid == 0, kTFullWait, CPIDX_TRACE_SINCE(tf));
    const int64_t x = s.stage_x[st];
    if (x < 0) {  // a marker
      if (x == kNoMorePages) break;
      // kSkipStage: an early copy whose inputs changed (only ever the first stages)
      __syncwarp();
      if (lane == 0) mbar_arrive(&s.empty[st]);
      continue;
    }
    next = x >= start && x < end ? x + 1 : end;  // a taken page predicts nothing
    if (x < req_lo() || x >= req_hi()) find_req(x);
    if (r != seg_req) load_queries(r);
    CPIDX_TRACE_PAGE(tid == 0);
    const int64_t gblk = (x - req_lo()) * p.world + p.rank;
    // Scores stage sst (block blk of the request) into this warp's column maxima at rmax,
    // releasing the stage once the warp's loads are done.
    auto score_stage = [&](int sst, int64_t blk, float* rmax) {
      const uint8_t* page = s.pages + static_cast<size_t>(sst) * Page::kBytes;

      // Tensor-core scores of this warp's 32 tokens x all columns. Dims are permuted identically
      // in A (keys) and B (queries) so each thread reads 16 contiguous bytes per row; the key
      // loads are bank-swizzled (PageTraits). Every accumulator sees the same MMAs in the same
      // order as a straight loop over (j, half), so the scores do not depend on the swizzle.
      float acc[2][NT][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
      constexpr int kGroup = kSwizzle ? Page::kSwizzleMask + 1 : 1;  // loads swizzled together
      constexpr int kPer = Page::kChunksPerLoad;                       // chunks a load brings
#pragma unroll
      for (int l0 = 0; l0 < 4 / kPer; l0 += kGroup) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          typename Page::Raw lo_raw[kGroup], hi_raw[kGroup];
#pragma unroll
          for (int i = 0; i < kGroup; ++i) {
            lo_raw[i] = Page::load(page, warp * 32 + mt * 16 + g, l0 + (i ^ swz), c4);
            hi_raw[i] = Page::load(page, warp * 32 + mt * 16 + g + 8, l0 + (i ^ swz), c4);
          }
          unswizzle(lo_raw, swz);
          unswizzle(hi_raw, swz);
#pragma unroll
          for (int jj = 0; jj < kGroup * kPer; ++jj) {
            const int j = l0 * kPer + jj;
            const uint4 lo = Page::widen(lo_raw[jj / kPer], jj % kPer),
                        hi = Page::widen(hi_raw[jj / kPer], jj % kPer);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                const uint2 b =
                    kQueryRegs ? qreg[j][half][nt] : query_frag<Page>(s, nt, g, j, c4, half);
                const uint32_t a0 = half ? lo.z : lo.x, a1 = half ? hi.z : hi.x;
                const uint32_t a2 = half ? lo.w : lo.y, a3 = half ? hi.w : hi.y;
                mma_16816<Page::kHalf>(acc[mt][nt], a0, a1, a2, a3, b.x, b.y);
              }
            }
          }
        }
      }
      // NOTE: the warp's loads are ordered before the stage's next bulk copy by this arrive (after
      // __syncwarp) and the producer's wait. racecheck reports those copies against these loads
      // where the producer is held by its consumers (two-stage rings, the 64-column instances) and
      // not on the same code at 8-16 columns with deeper rings; a proxy fence before the arrive did
      // not change that and cost fp8 Q = 4 up to 1.9% (docs/reliability.md, v34b).
      __syncwarp();
      if (lane == 0) mbar_arrive(&s.empty[sst]);  // this warp is done with the stage
      if (lp == 0) CPIDX_TRACE_STAMP(tid == 0, kTFirstMma);

      // Causal block max per column: starts at -inf; NaN dots never win (fmaxf), as in the
      // reference, so a block whose visible dots are all NaN scores -inf. A block every column
      // sees whole (all but a request's last one or two) takes the same maxima in the same order
      // without the mask's per-token compares.
      auto column_maxima = [&](auto masked) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = nt * 8 + c4 * 2 + e;
            float v = -INFINITY;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int rh = 0; rh < 2; ++rh) {
                if constexpr (decltype(masked)::value) {
                  const int64_t pos = static_cast<int64_t>(seq_len) - Q + (col % Q);
                  const int64_t tok = blk * kBlockSize + warp * 32 + mt * 16 + g + rh * 8;
                  if (tok <= pos) v = max_num(v, acc[mt][nt][rh * 2 + e]);
                } else {
                  v = max_num(v, acc[mt][nt][rh * 2 + e]);
                }
              }
            v = max_num(v, __shfl_xor_sync(0xffffffffu, v, 4));
            v = max_num(v, __shfl_xor_sync(0xffffffffu, v, 8));
            v = max_num(v, __shfl_xor_sync(0xffffffffu, v, 16));
            if (g == 0) rmax[warp * NT * 8 + col] = v;
          }
        }
      };
      // NOTE: at 8 columns (NT = 1) the unmasked copy cost fp8's 96-register instance 2-3% and
      // bought bf16 nothing (docs/perf/README.md, v29d): from 16 columns up only, where it took
      // 4.8% off fp8 plain 64 x 256K at Q = 4 (v29e).
      if (NT >= 2 && (blk + 1) * kBlockSize <= static_cast<int64_t>(seq_len) - Q + 1)
        column_maxima(std::false_type{});
      else
        column_maxima(std::true_type{});
    };
    // fp8 at 16 columns: two pages of one request under one barrier when the next stage holds
    // the next page (kPairPages: the per-page barrier, maxima hand-over and key offers are paid
    // once per two 16 KB pages). Every consumer warp waits for that stage and reads the same
    // index, so they all decide alike. It is always filled: the producer fills the stages in
    // order and ends with a marker, and its previous page was released before this one. Only
    // where x + 1 is predicted (x and x + 1 inside this CTA's range and request), and not on a
    // CTA's first page: that one is scored while the rest of the ring lands (v35b paired it and
    // lost the overlap on CTAs of 2-3 pages, up to +0.9 us on small steps).
    // The next stage (recomputed where needed: the 16-column fp8 instance is short of registers).
    auto next_stage = [&]() {
      RingPos nb = at;
      nb.next(stages);
      return nb;
    };
    bool paired = false;  // the next stage holds page x + 1
    if constexpr (kPairPages) {
      if (x > start && x + 1 < end && x + 1 < req_hi()) {
        const RingPos nb = next_stage();
        mbar_wait(&s.full[nb.st], nb.phase);
        paired = s.stage_x[nb.st] == x + 1;  // else a marker, or a page from elsewhere: next time
      }
    }
    float* red = s.red + (kPairPages ? rs : static_cast<int>(lp & 1)) * kRedSet;
    if constexpr (kPairPages) rs ^= 1;
    score_stage(st, gblk, red);
    if constexpr (kPairPages) {
      if (paired) {
        CPIDX_TRACE_PAGE(tid == 0);
        score_stage(next_stage().st, gblk + p.world, red + kConsumerWarps * NT * 8);
      }
    }
    const int64_t x_last = x + (paired ? 1 : 0);
    if (paired) next = x_last >= start && x_last < end ? x_last + 1 : end;
    consumer_sync();  // the column maxima are complete
    if (lp == 0) CPIDX_TRACE_STAMP(tid == 0, kTFirstMax);
    if (paired) {  // the second page's stage is this iteration's last
      ++lp;
      at.next(stages);
    }
    if (s.misc[0]) {  // a candidate buffer filled up on the previous page
      consumer_sync();
      if (tid == 0) s.misc[0] = 0;
      compact_all(s, ncols, K);
    }
    if (tid < ncols) {
      const int col = tid;
      // Offers the key of page xp (block gb) whose column maxima are at rd.
      auto offer = [&](const float* rd, int64_t gb, int64_t xp) {
        float v = rd[col];
#pragma unroll
        for (int w = 1; w < kConsumerWarps; ++w) v = max_num(v, rd[w * NT * 8 + col]);
        if constexpr (Page::kHalf) v *= s.qinv[col];  // exact: a power of two
        const int64_t pos = static_cast<int64_t>(seq_len) - Q + (col % Q);
        const int64_t vis = visible_blocks(pos);
        if (split) {
          const float score = forced_score(p.scale * v, gb, vis, p.init_blocks, p.local_blocks);
          p.split_keys[col * p.split_max_pages + xp] = gb < vis ? make_key(score, gb) : kPadKey;
        } else if (gb < vis) {
          const float score = forced_score(p.scale * v, gb, vis, p.init_blocks, p.local_blocks);
          const Key key = make_key(score, gb);
          if (key > s.tau[col]) {
            s.cbuf[col * cap + s.cnt[col]] = key;
            // Paired pages offer two keys a barrier: compacted while two slots are left.
            if (++s.cnt[col] == cap - (kPairPages ? 1 : 0)) s.misc[0] = 1;
          }
        }
      };
      offer(red, gblk, x);
      if constexpr (kPairPages) {
        if (paired) offer(red + kConsumerWarps * NT * 8, gblk + p.world, x + 1);
      }
    }
    CPIDX_TRACE_STAMP(tid == 0 && split, kTLastPage);  // split: no segment end
    if (split || (x_last + 1 != req_hi() && x_last + 1 != end)) continue;

    // ---- 4. End of this CTA's part of request r: finish it, or leave its list for the merge.
    CPIDX_TRACE_STAMP(tid == 0, kTLastPage);  // the last one recorded is the CTA's last page
    CPIDX_TRACE_CLOCK(ts);
    consumer_sync();
    if (tid == 0) s.misc[0] = 0;
    compact_all(s, ncols, K);
    if (cta_of(req_lo(), total, g_eff) == cta_of(req_hi() - 1, total, g_eff)) {
      finalize_request(p, s, r, seq_len, ncols);  // the whole request was scored here
    } else {
      for (int idx = tid; idx < ncols * K; idx += kConsumerThreads) {
        const int col = idx / K, i = idx % K;
        p.partial[partial_index(col, blockIdx.x + r, p.num_slots, K) + i] = s.cbuf[col * cap + i];
      }
    }
    consumer_sync();
    for (int col = tid; col < ncols; col += kConsumerThreads) { s.cnt[col] = 0; s.tau[col] = kPadKey; }
    consumer_sync();
    CPIDX_TRACE_ADD(tid == 0, kTSegEnd, CPIDX_TRACE_SINCE(ts));
    CPIDX_TRACE_ADD(tid == 0, kTSegments, 1);
  }
  CPIDX_TRACE_STAMP(tid == 0, kTExit);
  CPIDX_TRACE_CYCLES(tid == 0, kTExitClock);
  CPIDX_TRACE_FLUSH(tid == 0);
  if (err) atomicOr(p.error_flag, err);
}

template <int NT, DType kDType>
cudaError_t occupancy(int* blocks, size_t bytes, bool sparse) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks, sparse ? score_topk_kernel<NT, kDType, true> : score_topk_kernel<NT, kDType, false>,
      kThreads, bytes);
}

// Runtime (ncols, dtype) -> template instance.
template <typename F>
cudaError_t dispatch(int ncols_pad, DType dtype, F&& f) {
  auto by_dtype = [&](auto nt_tag) -> cudaError_t {
    constexpr int NT = decltype(nt_tag)::value;
    if (dtype == DType::kBF16) return f(std::integral_constant<int, NT>{},
                                        std::integral_constant<DType, DType::kBF16>{});
    return f(std::integral_constant<int, NT>{}, std::integral_constant<DType, DType::kFP8E4M3>{});
  };
  switch (ncols_pad / 8) {
    case 1: return by_dtype(std::integral_constant<int, 1>{});
    case 2: return by_dtype(std::integral_constant<int, 2>{});
    case 4: return by_dtype(std::integral_constant<int, 4>{});
    case 8: return by_dtype(std::integral_constant<int, 8>{});
    default: return cudaErrorInvalidValue;
  }
}

// Calls f(kernel) for every score_topk instance of `dtype` (8 to 64 columns, dense and sparse
// request offsets), up to the first error. Plan and tests both go through it.
template <typename F>
cudaError_t for_each_instance(DType dtype, F&& f) {
  for (int nc = 8; nc <= 64; nc *= 2) {
    const cudaError_t e = dispatch(nc, dtype, [&](auto nt, auto dt) {
      constexpr int NT = decltype(nt)::value;
      constexpr DType DT = decltype(dt)::value;
      const cudaError_t dense = f(score_topk_kernel<NT, DT, false>);
      return dense == cudaSuccess ? f(score_topk_kernel<NT, DT, true>) : dense;
    });
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

int padded_columns(int heads_x_q) {
  int nt = (heads_x_q + 7) / 8;
  int p2 = 1;
  while (p2 < nt) p2 *= 2;
  return p2 * 8;
}

cudaError_t plan_score_topk(int max_heads_x_q, int topk, DType dtype, int max_reqs, int device,
                            int ctas_per_sm, ScoreTopkLaunch* launch) {
  int sms = 0, smem_optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  const int ncols = padded_columns(max_heads_x_q);
  // NOTE: two CTAs per SM keep one CTA streaming while the other selects or merges; each keeps
  // `stages` pages in flight. Take the deepest pipeline that still fits two CTAs, else one
  // (four or three first where kMinCtasPerSm allows them: fp8).
  // The request offsets (8 bytes per request of max_reqs) are kept for every 2^shift-th request
  // when that is what lets two CTAs fit (the sparse instance): at plain 8 x 256K one CTA per SM
  // (4 pages in flight) took 162 us at Q = 1 and 181 us at Q = 4, two CTAs with every 2nd or
  // 8th offset kept 140-142 us, two with all kept 134-138 (2 or 3 pages in flight: the same);
  // small steps paid the sparse lookups' L2 reads, +2.5-3.5 us at 1 x 8K, until steps of at
  // most max_reqs >> shift requests launched the dense instance (launch_score_topk;
  // docs/perf/README.md, v17 and v17e).
  // Every instance's shared-memory cap at the device's limit, and the largest carveout asked.
  e = for_each_instance(dtype, [&](auto kernel) {
    const cudaError_t err = raise_smem_cap(kernel, smem_optin);
    return err == cudaSuccess ? prefer_max_shared(kernel) : err;
  });
  if (e != cudaSuccess) return e;
  // Automatic: four or three CTAs where the registers allow it (kMinCtasPerSm), each with a ring
  // of at least 3 pages and every offset kept; else two, else one. Each instance up to the
  // bound's columns on its own (a step launches the one for its columns).
  const bool automatic = ctas_per_sm == 0;
  const int most = automatic ? 4 : ctas_per_sm, least = automatic ? 1 : ctas_per_sm;
  auto plan_instance = [&](int nc, ScoreTopkInstance* out) -> cudaError_t {
    for (int ctas = most; ctas >= least; --ctas) {
      const bool strict = automatic && ctas >= 3;
      // Every offset kept first (shift 0), then sparser, down to a single kept offset.
      for (int shift = 0; shift == 0 || (!strict && (max_reqs >> (shift - 1)) > 0); ++shift) {
        for (int stages = 6; stages >= (strict ? 3 : 2); --stages) {
          SmemLayout lay(stages, dtype, nc, topk, max_reqs, shift);
          // NOTE: static shared memory (a few hundred bytes) counts against the same limit.
          if (lay.total + 1024 > static_cast<size_t>(smem_optin)) continue;
          int blocks = 0;
          cudaError_t err = dispatch(nc, dtype, [&](auto nt, auto dt) {
            return occupancy<decltype(nt)::value, decltype(dt)::value>(&blocks, lay.total,
                                                                       shift > 0);
          });
          if (err != cudaSuccess) return err;
          if (blocks < ctas) continue;
          out->grid = ctas * sms;
          out->stages = stages;
          out->prefix_shift = shift;
          out->smem_bytes = lay.total;
          return cudaSuccess;
        }
      }
    }
    return cudaErrorInvalidConfiguration;
  };
  *launch = ScoreTopkLaunch{};
  for (int i = 0, nc = 8; nc <= ncols; ++i, nc *= 2) {
    e = plan_instance(nc, &launch->inst[i]);
    if (e != cudaSuccess) return e;
    launch->grid = std::max(launch->grid, launch->inst[i].grid);
  }
  launch->max_reqs = max_reqs;
  launch->ncols_pad = ncols;
  launch->topk = topk;
  return cudaSuccess;
}

cudaError_t smallest_score_topk_carveout(DType dtype, int* smallest) {
  *smallest = cudaSharedmemCarveoutMaxShared;
  return for_each_instance(dtype, [&](auto kernel) { return lower_to_carveout(kernel, smallest); });
}

cudaError_t read_score_trace(long long* host, int ctas) {
  return CPIDX_COPY_TRACE(g_score_trace, kTraceSlots, host, ctas);
}

cudaError_t read_page_trace(long long* host, int ctas) {
  return CPIDX_COPY_TRACE(g_page_trace, kTracePages, host, ctas);
}

cudaError_t set_score_trace_late(long long ns) { return CPIDX_SET_TRACE_LATE(ns); }

cudaError_t launch_score_topk(const ScoreTopkParams& p, DType dtype, const ScoreTopkLaunch& l,
                              cudaStream_t stream) {
  const int ncols = padded_columns(p.num_heads * p.query_len);
  if (ncols > l.ncols_pad || p.num_reqs > l.max_reqs || p.topk != l.topk) {
    return cudaErrorInvalidValue;
  }
  // A step of at most max_reqs >> prefix_shift requests fits the planned prefix with every
  // offset kept: the dense instance runs on the same shared memory (the same bytes, so the
  // same CTAs per SM). The request count is a host value, so a captured graph keeps its choice.
  const ScoreTopkInstance& in = l.instance(ncols);
  if (p.fused_grid != in.grid) return cudaErrorInvalidValue;
  const int dense_reqs = l.max_reqs >> in.prefix_shift;
  const bool sparse = p.num_reqs > dense_reqs;
  const int reqs_smem = sparse ? l.max_reqs : dense_reqs;
  const int shift = sparse ? in.prefix_shift : 0;
  // plan_score_topk raised every instance's shared-memory cap to the device's limit.
  return dispatch(ncols, dtype, [&](auto nt, auto dt) -> cudaError_t {
    constexpr int NT = decltype(nt)::value;
    constexpr DType DT = decltype(dt)::value;
    const SmemLayout lay(in.stages, DT, NT * 8, p.topk, reqs_smem, shift);
    const auto kernel = sparse ? score_topk_kernel<NT, DT, true> : score_topk_kernel<NT, DT, false>;
    return launch_with_pdl(p.pdl, kernel, in.grid, kThreads, lay.total, stream, p, in.stages,
                           reqs_smem, shift);
  });
}

}  // namespace cuda
}  // namespace cpidx
