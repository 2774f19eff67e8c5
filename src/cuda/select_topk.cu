// src/cuda/select_topk.cu: the selection kernel after score_topk, chained with programmatic
// dependent launch. Split path (small steps): score_topk does not select; it writes one key per
// (column, owned page) into split_keys ([column][page], pages flattened request by request), and
// this kernel picks each (request, column)'s top K. Fused path: score_topk selected per CTA, and
// this kernel merges the ordered lists of every request that spans CTAs (the same selection over
// the request's slots of `partial`: the union of the CTAs' top K holds the request's top K).
// One CTA per item. Lists of <= 128 keys are ordered by rank counting directly. Longer ones:
// a lower bound on the K-th largest key from 32 group maxima (one barrier-light pass), and when
// at most 128 keys pass it, those are ranked; otherwise the K-th largest key by an MSD radix
// select on the 64-bit keys (8 bits a pass, usually 3-4 passes on real scores), then the <= K
// winners ranked. Keys are kept in registers up to 2048 per list (1024 in the narrow grid for
// steps of many items, kNarrow; 8192 in the deep grid for steps of few, long lists, kDeep);
// longer lists (a rank's request past 1M tokens on the split path, merges of many CTAs' lists)
// are re-read from L2 every pass, 8 independent loads in flight per thread.
// NOTE: merging the fused path's lists as ordered lists (each key that can still win counts
// the larger keys of the other lists by binary search in shared memory) was measured 27-36 us
// slower at 8 x 1M and equal at 8 x 256K (docs/perf/README.md, v8); not used.
// NOTE: a tournament threshold (each thread's largest key, then the K-th largest of those) was
// measured ~1 us slower than the radix passes at 512-2048 keys (docs/perf/README.md, v7).
// NOTE: where an item's time goes after the wait (8 x 1M, 34 lists of 16 keys; %globaltimer
// stamps, docs/perf/README.md, v9): the keys arrived after ~1.3 us (a DRAM round trip: the
// scoring's stream had evicted them from L2; its page copies now carry an evict-first hint,
// v9b), the radix passes take ~2.3, gathering and ranking the K winners ~1, the store and exit
// ~0.7: ~5.3 us. Bounding the merge by the K-th largest of the lists' heads instead of the
// radix passes measured no faster (A/B: 256.1-257.0 us vs 256.7-257.3, CP P=2).
// NOTE: merging the split path's keys beside the scoring grid (per-range words released by the
// scoring consumers, each range's keys merged into a running warp top K as its pages complete,
// outputs written before the PDL wait) was measured slower everywhere: +15 us at 8 x 256K
// merging whole ranges (they all end in the last few us), +36 us streaming them every 2 pages,
// +5 to +9 us at 1 x 8K (docs/perf/README.md, v16-overlap); not kept.
// NOTE: the phases after the wait (keys loaded and bounded ~1.9 us, then ~0.5-1 us each for
// gathering, ranking, storing) are not cold code: running the item code once before the wait,
// on made-up keys in registers, left them as long and cost +0.8 to +3.3 us, the warm pass
// itself taking 4-5 us (docs/perf/README.md, v19-warm).
// Keys are distinct (the block id is in the low bits); kPadKey marks an invisible block and is
// never selected: a list with fewer than K real keys is padded, as the fused path pads.
#include "channel.cuh"
#include "device_utils.cuh"
#include "kernels.h"
#include "page_order.cuh"
#include "score_trace.cuh"
#include "sparse_table.cuh"

namespace cpidx {
namespace cuda {
namespace {

// Threads per CTA, one item per CTA: 256 (4 CTAs per SM), or 128 (8 per SM) when a step has
// more items than the wide grid holds, so they still run in one round instead of two.
// NOTE: 1024 items (64 requests x 16 columns) on 528 wide CTAs took ~4 us longer after the
// scoring grid than 256 items did; the narrow grid measured 2.4-4.1 us faster there
// (docs/perf/README.md, v14).
// Steps of at most one item per SM whose lists can pass what the wide grid holds in registers
// (kWide x kPerThread keys: a request of more than 2048 owned pages, 256K tokens on the rank)
// take the deep grid instead: 512 threads of 16 keys each, one CTA per SM, so lists of up to
// 8192 keys (1M tokens on the rank) are read once and kept in registers instead of re-read from
// L2 on every pass (the group maxima's, then the gather's).
// NOTE: measured (docs/perf/README.md, v45) -1.4 to -4.5 us at plain 1 x 1M (bf16 and fp8),
// -0.3 to -1.8 at CP P=2 1 x 1M, 0 to -3.6 at plain 8 x 1M and within noise at CP 8 x 1M; its
// 128-register CTAs hold a whole SM, yet the next call's scoring CTAs lose nothing measurable
// (8 x 1M at Q = 4: 128 items, the deep grid on 128 SMs).
constexpr int kWide = 256, kNarrow = 128, kDeep = 512;
constexpr int kPerThread = 8;       // keys kept in registers by the wide and narrow grids,
constexpr int kDeepPerThread = 16;  // by the deep grid; longer lists are re-read from L2
constexpr int kUnroll = 8;      // L2 loads in flight per thread when re-reading
constexpr int kBins = 256;
// The channel use count whose select CTAs leave merge_topk to launch at the grid's end (below).
constexpr uint32_t kUsesWithoutEarlyMerge = 0xffffffffu;
// Lists up to this long are ranked directly, where they lie (one key a thread, v48). NOTE: rank
// counting reads every key once per key (serial shared-memory loads): measured 1.4 us faster
// than the radix passes at 32 keys, equal at 128, 2-3 us slower at 256 (docs/perf/README.md,
// v7), when the keys were still gathered one shared-memory atomicAdd each; not measured again
// since they rank in place.
constexpr int kRankDirect = 128;
constexpr int kCand = kRankDirect;  // winners gathered for ranking: <= max(K, kRankDirect)
static_assert(kCand >= kMaxTopK, "a long list's K winners must fit the candidate buffer");
// Key groups whose maxima bound the K-th key (K <= kGroups): thread t's keys belong to group
// t / (threads / kGroups), so a group is 8 (wide) or 4 (narrow) adjacent lanes of one warp.
constexpr int kGroups = 32;
// NOTE: the request offsets in dynamic shared memory are kept for every 2^shift-th request when
// all of them would pass this many bytes (1,023 requests). Sized per launch from the step's
// requests: sized by max_tokens instead (16384: 128 KB a CTA), the select CTAs no longer fit
// beside the scoring grid and 64 x 8K at Q = 4 took 66 us instead of 47 (docs/perf/README.md,
// v17f).
constexpr size_t kPrefixBytes = 8192;
static_assert(kNarrow % kGroups == 0 && kWide % kGroups == 0, "one warp ranks the maxima");

struct SelectSmem {
  int64_t* prefix;                 // [(num_reqs >> shift) + 1] (dynamic): RequestOffsets
  int hist[kBins];
  alignas(16) Key cand[kCand];     // the winners, unordered (a short list: 16-byte loads)
  Key sorted[kMaxTopK];            // the winners, descending, padded with kPadKey
  int count;                       // winners gathered so far
  Key prefix_bits;                 // radix select state: the K-th key's high bits found so far
  int need;                        // winners still to find below prefix_bits' bin
  int done;
  Key group_max[kGroups];          // group bound: each group's largest key
  Key bound;                       // the K-th largest group maximum (1: no bound)
};

// The digit of the K-th largest key among those matching the prefix: bins are scanned from the
// top by warp 0 (8 bins per lane); the bin holding it becomes part of the prefix and `need`
// drops by the keys in higher bins (all of them winners).
__device__ void pick_bin(SelectSmem& s, int shift) {
  const int lane = threadIdx.x % 32;
  const int need = s.need;
  __syncwarp();  // every lane has read `need` before one of them rewrites it
  int c[8], sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    c[j] = s.hist[kBins - 1 - (lane * 8 + j)];
    sum += c[j];
  }
  int above = sum;  // inclusive scan over lanes, then exclusive
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, above, d);
    if (lane >= d) above += v;
  }
  above -= sum;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (above < need && need <= above + c[j]) {
      const int bin = kBins - 1 - (lane * 8 + j);
      s.prefix_bits |= static_cast<Key>(bin) << shift;
      s.need = need - above;
      s.done = c[j] == need - above;  // every key of this bin wins: stop refining
    }
    above += c[j];
  }
}

// Calls f(key) for this thread's keys of keys[0..n): registers when they fit, else L2
// loads kUnroll at a time.
template <int kThreads, int kPer, typename F>
__device__ __forceinline__ void for_each_key(const Key* keys, int64_t n, bool in_regs,
                                             const Key (&mine)[kPer], F&& f) {
  const int tid = threadIdx.x;
  if (in_regs) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) f(mine[j]);
    return;
  }
  const auto* src = reinterpret_cast<const unsigned long long*>(keys);
  for (int64_t i0 = tid; i0 < n; i0 += static_cast<int64_t>(kThreads) * kUnroll) {
    Key v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + static_cast<int64_t>(u) * kThreads;
      v[u] = i < n ? __ldcg(src + i) : kPadKey;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) f(v[u]);
  }
}

// The exact K-th largest real key by MSD radix select (1 when fewer than K keys are real).
template <int kThreads, typename Each>
__device__ Key radix_kth(int K, SelectSmem& s, Each&& each) {
  const int tid = threadIdx.x;
  if (tid == 0) { s.prefix_bits = 0; s.need = K; s.done = 0; }
  __syncthreads();
  Key mask = 0;
  for (int shift = 56; shift >= 0 && !s.done; shift -= 8) {
    for (int b = tid; b < kBins; b += kThreads) s.hist[b] = 0;
    __syncthreads();
    const Key want = s.prefix_bits;
    // NOTE: warp-aggregating these increments (__match_any_sync per key) was measured slower,
    // up to 2x at 1 x 64K, Q=4 (docs/perf/README.md, v7).
    each([&](Key k) {
      if (k != kPadKey && (k & mask) == want) atomicAdd(&s.hist[(k >> shift) & 0xFF], 1);
    });
    __syncthreads();
    if (tid < 32) {
      if (tid == 0) s.done = 1;  // stays set if fewer than `need` real keys are left
      __syncwarp();
      pick_bin(s, shift);
    }
    __syncthreads();
    mask |= Key{0xFF} << shift;
  }
  // No bin held the K-th key only when fewer than K keys are real: prefix_bits stayed 0 and
  // every real key wins.
  return s.prefix_bits > 1 ? s.prefix_bits : 1;
}

// Calls f(v[i], rank) once for each i < n, rank = how many of v[0..n) are larger than v[i]:
// each v[i] is counted by 8 lanes, one eighth of the others each, summed by shuffles
// (kThreads / 8 values a pass), instead of one thread reading all n. Every thread of the CTA
// calls it with the same n (the shuffles take whole warps).
template <int kThreads, typename F>
__device__ __forceinline__ void for_each_rank(const Key* v, int n, F&& f) {
  constexpr int kLanes = 8, kPerPass = kThreads / kLanes;
  const int sub = threadIdx.x % kLanes;
  for (int i0 = 0; i0 < n; i0 += kPerPass) {
    const int i = i0 + static_cast<int>(threadIdx.x) / kLanes;
    const Key mine = i < n ? v[i] : kPadKey;
    int rank = 0;
    for (int j = sub; j < n; j += kLanes) rank += v[j] > mine;
#pragma unroll
    for (int d = 1; d < kLanes; d *= 2) rank += __shfl_xor_sync(0xffffffffu, rank, d);
    if (sub == 0 && i < n) f(mine, rank);
  }
}

// A short list's ranks (n <= kCand keys at v, pads up to kCand): f(v[i], rank) for each i < n,
// in one pass. Each thread ranks kKeys keys (2 on the wide grid, i and i + 64, with 4 lanes a
// pair; 1 on the narrow, 1 lane), each lane reading its share of the first n slots, rounded up
// to 16 kLanes, two keys (16 bytes) a load (pads are below every key: they add no rank).
// NOTE: for_each_rank's 8 lanes a key take n / (kThreads / 8) passes (4 for 128 keys on the
// wide grid): the ranks of 128 keys took 2.5-2.9 us (docs/perf/README.md, v50-trace), and one
// pass of 2 lanes a key took 0.7-3.4 us off those steps (v50). ptxas issues these loads one
// after another into the same registers whatever the source's order (its SASS, at 64 registers
// a thread or 128), so each load costs its latency, and the pass with the fewest loads wins:
// v50f, 1 key a thread (2 lanes a key wide, 32 loads at 128 keys), took 0.9-4.5 us off
// 128-key steps. 2 keys a thread (v52b) halve the wide grid's loads, which took nothing
// measurable more off 128 keys but, in the same instance, 0.15-0.4 us off the 33-64-key
// lists (8 loads against for_each_rank's two passes of 5-8), where a second instance of 4
// lanes a key had added 0.1-0.26 us to one-request steps that never ran it (v51).
// The end is tested every 8 loads: tested at each, the wide grid's kernels spilled.
template <int kThreads, typename F>
__device__ __forceinline__ void rank_short(const Key* v, int n, F&& f) {
  // Keys a thread: 2 on the wide grid (keys i and i + 64, 4 lanes a pair), 1 on the narrow
  // (1 lane a key: 2 keys a thread there spilled 8 B).
  constexpr int kKeys = kThreads > kCand ? 2 : 1, kSpan = kCand / kKeys;
  constexpr int kLanes = kThreads / kSpan;
  static_assert(kLanes >= 1 && kLanes <= 32 && kThreads % kSpan == 0, "lanes of one warp");
  const int i = static_cast<int>(threadIdx.x) / kLanes, sub = threadIdx.x % kLanes;
  Key mine[kKeys];
  int rank[kKeys];
#pragma unroll
  for (int k = 0; k < kKeys; ++k) {
    mine[k] = v[i + k * kSpan];  // pads past n (written up to kCand)
    rank[k] = 0;
  }
  const ulonglong2* pairs = reinterpret_cast<const ulonglong2*>(v) + sub;
#pragma unroll
  for (int j = 0; j < kCand / 2; j += kLanes) {
    if (j % (8 * kLanes) == 0 && 2 * j >= n) break;  // uniform: the slots past it hold pads
    const ulonglong2 two = pairs[j];
#pragma unroll
    for (int k = 0; k < kKeys; ++k) rank[k] += (two.x > mine[k]) + (two.y > mine[k]);
  }
#pragma unroll
  for (int k = 0; k < kKeys; ++k) {
#pragma unroll
    for (int d = 1; d < kLanes; d *= 2) rank[k] += __shfl_xor_sync(0xffffffffu, rank[k], d);
    if (sub == 0 && i + k * kSpan < n) f(mine[k], rank[k]);
  }
}

// A lower bound on the K-th largest real key (K <= kGroups): the K-th largest of the groups'
// maxima. K groups each hold a key at least that large, so at least K keys pass it; on real
// scores about K plus a few do (each group holds n / 32 keys, strided over the list). 1 (every
// real key) when fewer than K groups hold a real key. Also zeroes s.count.
// Two barriers, against the radix passes' three per 8 bits whose first histograms put most keys
// in one or two bins (their shared-memory increments serialise).
template <int kThreads, typename Each>
__device__ Key group_bound(int K, SelectSmem& s, Each&& each) {
  constexpr int kGroupThreads = kThreads / kGroups;
  const int tid = threadIdx.x;
  Key m = kPadKey;
  each([&](Key k) { m = k > m ? k : m; });
  // The loads landed: the condition depends on every one, so the stamp cannot run earlier.
  CPIDX_SELECT_STAMP(tid == 0 && m != ~Key{0}, kSLoaded);
#pragma unroll
  for (int d = 1; d < kGroupThreads; d *= 2) {
    const Key other = __shfl_xor_sync(0xffffffffu, m, d);
    m = other > m ? other : m;
  }
  if (tid % kGroupThreads == 0) s.group_max[tid / kGroupThreads] = m;
  if (tid == 0) { s.bound = 1; s.count = 0; }
  __syncthreads();
  CPIDX_SELECT_STAMP(tid == 0, kSMaxima);
  // Real maxima are distinct (keys are), so at most one real one has rank K - 1.
  for_each_rank<kThreads>(s.group_max, kGroups, [&](Key mine, int rank) {
    if (rank == K - 1 && mine != kPadKey) s.bound = mine;
  });
  __syncthreads();
  return s.bound;
}

// Gathers the real keys >= lower into s.cand (up to kCand; s.count counts them all). s.count
// must be zero and visible to every thread; the caller synchronises afterwards.
template <typename Each>
__device__ __forceinline__ void gather_winners(Key lower, SelectSmem& s, Each&& each) {
  each([&](Key k) {
    if (k != kPadKey && k >= lower) {
      const int at = atomicAdd(&s.count, 1);
      if (at < kCand) s.cand[at] = k;
    }
  });
}

// Selects and orders the top K of keys[0..n) (read from L2) into s.sorted.
template <int kThreads, int kPer>
__device__ void select_item(const Key* keys, int64_t n, int K, SelectSmem& s) {
  const int tid = threadIdx.x;
  Key mine[kPer];
  const bool in_regs = n <= static_cast<int64_t>(kThreads) * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t i = tid + static_cast<int64_t>(j) * kThreads;
    mine[j] = in_regs && i < n ? __ldcg(reinterpret_cast<const unsigned long long*>(keys) + i)
                               : kPadKey;
  }
  auto each = [&](auto&& f) { for_each_key<kThreads, kPer>(keys, n, in_regs, mine, f); };
  // Every real key of a short list wins, ranked where it lies (thread t's key in s.cand[t]);
  // else the K largest, gathered above the group bound when at most kCand keys pass it, above
  // the exact K-th key (radix) otherwise.
  // NOTE: a short list's keys were gathered too, one shared-memory atomicAdd on one counter per
  // key, each thread waiting for its slot: the atomics serialise, and 128-key lists took ~3.5 us
  // from the wait to the ranks, where a 1024-key list's group bound, ~20 winners, took ~2.7
  // (docs/perf/README.md, v48). Written as a branch of the radix path's gather: each other
  // form tried made ptxas spill the 64-register instances (20-72 B).
  static_assert(kRankDirect <= kThreads, "a short list is one key a thread: mine[0]");
  Key lower = 1;
  bool gathered = false;
  if (n > kRankDirect && K <= kGroups) {
    lower = group_bound<kThreads>(K, s, each);
    CPIDX_SELECT_STAMP(threadIdx.x == 0, kSBound);
    gather_winners(lower, s, each);
    __syncthreads();
    CPIDX_SELECT_STAMP(threadIdx.x == 0, kSGathered);
    gathered = s.count <= kCand;  // uniform: every thread reads it after the barrier
  }
  int real = 0;  // a short list's real keys
  if (!gathered) {
    if (n > kRankDirect) lower = radix_kth<kThreads>(K, s, each);
    if (tid == 0) s.count = 0;
    __syncthreads();
    if (n > kRankDirect) {
      gather_winners(lower, s, each);
    } else if (tid < kCand) {  // a short list (n is uniform) ranks where it lies; the pads
      // past it (mine[0] of tid >= n) fill every slot rank_short may read.
      // The key landed: the condition depends on it, so the stamp cannot run earlier.
      CPIDX_SELECT_STAMP(tid == 0 && mine[0] != ~Key{0}, kSLoaded);
      s.cand[tid] = mine[0];
    }
    real = __syncthreads_count(tid < n && mine[0] != kPadKey);
  }
  // The winners in order (unique real keys), padded to K. A short list's pads are below every
  // real key, so they move no real key's rank, and are never written out.
  int ranked = s.count < kCand ? s.count : kCand, count = ranked;
  if (n <= kRankDirect) {
    ranked = static_cast<int>(n);
    count = real;
  }
  for (int i = tid; i < K; i += kThreads) {
    if (i >= count) s.sorted[i] = kPadKey;
  }
  auto place = [&](Key mine, int rank) {
    if (rank < K && mine != kPadKey) s.sorted[rank] = mine;
  };
  // One pass past 32 keys on the wide grid (8-16 loads a lane against for_each_rank's 10-64),
  // past 64 on the narrow (40-64 against 45-128; 24-32 against 15-32 below).
  constexpr int kOnePass = kThreads > kCand ? kCand / 4 : kCand / 2;
  if (n <= kRankDirect && n > kOnePass) {  // uniform
    rank_short<kThreads>(s.cand, ranked, place);
  } else {
    for_each_rank<kThreads>(s.cand, ranked, place);
  }
  __syncthreads();
  CPIDX_SELECT_STAMP(threadIdx.x == 0, kSRanked);
}

// kSparse: the request offsets of a step of more than kPrefixBytes / 8 - 1 requests, every
// 2^prefix_shift-th kept; the dense instance carries none of it.
// The deep grid's bound is one CTA an SM: 128 registers a thread hold its 16 keys unspilled.
template <int kThreads, bool kSparse>
__global__ void __launch_bounds__(kThreads, kThreads == kDeep ? 1 : 1024 / kThreads)
    select_topk_kernel(const ScoreTopkParams p, int prefix_shift) {
  constexpr int kPer = kThreads == kDeep ? kDeepPerThread : kPerThread;
  __shared__ SelectSmem s;
  extern __shared__ int64_t prefix_smem[];
  const int Q = p.query_len, K = p.topk, ncols = p.num_heads * Q, B = p.num_reqs;
  const int64_t n_rows = static_cast<int64_t>(B) * Q, items = static_cast<int64_t>(B) * ncols;
  // The grid is sized for the largest step; CTAs without an item leave at once, so the next
  // kernel (launched when every CTA has triggered or exited) and this grid's end come sooner.
  // NOTE: measured ~1 us off the 2-GPU step at 1 x 8K and 8 x 8K (docs/perf/README.md, v8).
  if (blockIdx.x >= items) return;
  CPIDX_SELECT_RESET(threadIdx.x == 0);
  CPIDX_SELECT_STAMP(threadIdx.x == 0, kSEntry);
  const int ctas = static_cast<int>(items < static_cast<int64_t>(gridDim.x) ? items : gridDim.x);
  if (threadIdx.x == 0) s.prefix = prefix_smem;
  __syncthreads();
  const int shift = kSparse ? prefix_shift : 0;
  // Before the wait: only the step's inputs (seq_lens), never score_topk's outputs. score_topk
  // let this grid launch after its own wait, so the lengths it used are the ones read here.
  int r0 = 0, r1 = 0;
  thread_requests<kThreads>(B, &r0, &r1);
  int64_t total = 0;
  const int64_t longest = pages_prefix<kThreads>(p, s.prefix, shift, r0, r1, &total);
  pdl_wait();
  CPIDX_SELECT_STAMP(threadIdx.x == 0, kSWaited);
  CPIDX_SELECT_CLOCK(threadIdx.x == 0, kSWaitedClock);
  // Fused exchange: the channel's use count is read before merge_topk may launch (it counts the
  // use once every reader arrived). The trigger is no fence, and a CTA has triggered once any
  // thread of it has, so the trigger waits for a barrier predicated on every thread's count: each
  // thread's load has returned before any thread of the CTA triggers, and no merge CTA can have
  // counted this use yet. (Were the trigger free to pass a load, a count read one too high would
  // write the next use's epoch and parity, and the merge would time out waiting for it.) The one
  // value that skips the trigger, once in 2^32 uses, launches the merge at this grid's end.
  // Without a channel (grid-uniform) nothing is read and no barrier is taken.
  const bool channel = p.channel.world > 0;
  const uint32_t uses = channel ? channel_uses(p.channel) : 0;
  if (!channel || __syncthreads_and(uses != kUsesWithoutEarlyMerge)) pdl_launch_dependents();
  const bool split = split_path(p, total, longest);
  const int64_t g_eff = fused_ctas(total, p.fused_grid);

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int r = static_cast<int>(item / ncols), col = static_cast<int>(item % ncols);
    const int h = col / Q, t = col % Q;
    const int64_t row = static_cast<int64_t>(r) * Q + t;
    const RequestOffsets<kSparse> offs{s.prefix, shift, B};  // sparse: L2 reads too
    const int64_t first = offs.first(p, r), n = offs.pages(p, r);
    if (split) {
      select_item<kThreads, kPer>(p.split_keys + col * p.split_max_pages + first, n, K, s);
    } else {
      // Requests without pages or scored by one CTA alone were finished by score_topk (the
      // conditions are uniform across the CTA): with a channel, their keys are sent from here.
      const int64_t c0 = n == 0 ? 0 : cta_of(first, total, g_eff);
      const int64_t c1 = n == 0 ? 0 : cta_of(first + n - 1, total, g_eff);
      if (c0 == c1) {
        for (int i = threadIdx.x; channel && i < K; i += kThreads) {
          const int64_t j = (h * n_rows + row) * K + i;
          channel_put(p.channel, uses, j, p.keys[j]);
        }
        continue;
      }
      select_item<kThreads, kPer>(p.partial + partial_index(col, c0 + r, p.num_slots, K),
                            (c1 - c0 + 1) * K, K, s);
    }
    for (int i = threadIdx.x; i < K; i += kThreads) {
      const Key key = s.sorted[i];
      if (channel) {
        channel_put(p.channel, uses, (h * n_rows + row) * K + i, key);
      } else if (p.keys) {
        p.keys[(h * n_rows + row) * K + i] = key;
      } else {
        p.ids[h * p.ids_head_stride + row * p.ids_row_stride + i] =
            key == kPadKey ? -1 : key_block(key);
      }
    }
    if (p.table.table && threadIdx.x < 32) {  // one head: a table row per query token
      int32_t unused = 0;
      const int32_t len = clamp_seq_len(p.seq_lens[r], p.max_seq_len, &unused);
      write_sparse_row<true>(p.table, s.sorted, K, r, row, static_cast<int64_t>(len) - Q + t,
                             threadIdx.x);
    }
    __syncthreads();  // s.sorted is rewritten by the next item
  }
  if (channel) channel_clean(p.channel, uses, items * K, ctas);  // lines = H * n_rows * K
  CPIDX_SELECT_STAMP(threadIdx.x == 0, kSExit);
  CPIDX_SELECT_CLOCK(threadIdx.x == 0, kSExitClock);
}

// The instance for a launch: the narrow grid's (128 threads), the wide one's or the deep one's,
// with sparse request offsets or every one kept. Plan and launch both go through it.
enum class SelectGrid { kWide, kNarrow, kDeep };
using SelectKernel = void (*)(ScoreTopkParams, int);
SelectKernel select_kernel(SelectGrid grid, bool sparse) {
  switch (grid) {
    case SelectGrid::kNarrow:
      return sparse ? select_topk_kernel<kNarrow, true> : select_topk_kernel<kNarrow, false>;
    case SelectGrid::kDeep:
      return sparse ? select_topk_kernel<kDeep, true> : select_topk_kernel<kDeep, false>;
    default:
      return sparse ? select_topk_kernel<kWide, true> : select_topk_kernel<kWide, false>;
  }
}

// Calls f(kernel) for each of the six instances, up to the first error.
template <typename F>
cudaError_t for_each_instance(F&& f) {
  for (SelectGrid g : {SelectGrid::kWide, SelectGrid::kNarrow, SelectGrid::kDeep}) {
    for (bool sparse : {false, true}) {
      const cudaError_t e = f(select_kernel(g, sparse));
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t smallest_select_topk_carveout(int* smallest) {
  *smallest = cudaSharedmemCarveoutMaxShared;
  return for_each_instance([&](SelectKernel k) { return lower_to_carveout(k, smallest); });
}

cudaError_t plan_select_topk(int device, ScoreTopkLaunch* l) {
  int sms = 0, smem_optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  e = for_each_instance([&](SelectKernel kernel) {
    cudaFuncAttributes attr{};
    cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return err;
    if (kPrefixBytes + attr.sharedSizeBytes > static_cast<size_t>(smem_optin)) {
      return cudaErrorInvalidConfiguration;
    }
    // The cap is process-wide: raise it to the device limit, never to one Decoder's need.
    // NOTE: the offsets need no opt-in, but a first v17f build that left the cap at the default
    // (and had one instance for dense and sparse offsets) measured small steps 0.2-0.6 us
    // slower; with both as here, unchanged (docs/perf/README.md, v17f).
    err = raise_smem_cap(kernel, smem_optin);
    return err == cudaSuccess ? prefer_max_shared(kernel) : err;
  });
  if (e != cudaSuccess) return e;
  // Items beyond the grid loop; steps with more items than the wide grid take the narrow one.
  l->select_grid = 4 * sms;
  l->select_narrow_grid = 8 * sms;
  l->select_deep_grid = sms;
  return cudaSuccess;
}

cudaError_t read_select_trace(long long* host, int ctas) {
  return CPIDX_COPY_TRACE(g_select_trace, kSelectSlots, host, ctas);
}

cudaError_t launch_select_topk(const ScoreTopkParams& p, const ScoreTopkLaunch& l,
                               cudaStream_t stream) {
  if (p.num_reqs > l.max_reqs ||
      p.fused_grid != l.step_instance(p.num_heads, p.query_len).grid ||
      (p.split_max_pages >= 0 && p.split_keys == nullptr)) {
    return cudaErrorInvalidValue;
  }
  // The request count is a host value, so a captured graph keeps its offsets' layout.
  int shift = 0;
  while (((static_cast<size_t>(p.num_reqs) >> shift) + 1) * sizeof(int64_t) > kPrefixBytes) ++shift;
  const size_t smem = ((static_cast<size_t>(p.num_reqs) >> shift) + 1) * sizeof(int64_t);
  // Items per step are host values (requests x heads x Q), so a captured graph keeps its choice.
  const int64_t items = static_cast<int64_t>(p.num_reqs) * p.num_heads * p.query_len;
  // The deep grid where a request may own more of the rank's pages than the wide grid holds keys
  // in registers (the split path's list has a key per page; max_seq_len is a host value, so a
  // captured graph keeps its choice). Every grid is exact on lists of any length: past its
  // registers it re-reads them from L2.
  const int64_t rank_pages = owned_blocks(p.max_blocks, p.world, 0);  // rank 0 owns the most
  SelectGrid kind = SelectGrid::kWide;
  int grid = l.select_grid, threads = kWide;
  if (items > l.select_grid) {
    kind = SelectGrid::kNarrow;
    grid = l.select_narrow_grid;
    threads = kNarrow;
  } else if (items <= l.select_deep_grid && rank_pages > int64_t{kWide} * kPerThread) {
    kind = SelectGrid::kDeep;
    grid = l.select_deep_grid;
    threads = kDeep;
  }
  return launch_with_pdl(p.pdl, select_kernel(kind, shift > 0), grid, threads, smem, stream, p,
                         shift);
}

}  // namespace cuda
}  // namespace cpidx
