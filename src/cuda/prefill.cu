// src/cuda/prefill.cu: the prefill indexer (CONTRACT.md section 7) as plan + score + merge.
// The score kernel is the matrix work: a CTA holds a tile of 256 (token, head) query rows in
// registers (8 warps x 32 rows) and streams the key pages of its split once, through a ring of
// shared-memory stages filled by cp.async in a swizzled layout; each warp multiplies its 32 rows
// by every 128-key page on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate), reduces the
// page to a causal block max per row, forces it and offers it to the row's running top-K.
// Cost: 2 * rows * visible keys * 128 FLOP of tensor work (full pages; masked keys are computed
// and discarded), plus one read per split of the split's pages from L2, plus S * K keys per row
// written and merged. No [tokens, heads, blocks] score tensor exists at any point.
#include "host_util.h"
#include "k_steps.h"
#include "prefill_device.cuh"
#include "prefill_kernels.h"
#include "prefill_layout.h"

namespace cpidx {
namespace cuda {
namespace {

constexpr int kPlanThreads = 1024;
constexpr int kMergeLanes = kPrefillMaxSplits;  // one lane per split list of a row
constexpr int kRowBytes16 = kHeadDim * 2;       // a bf16 key row in a compute stage
constexpr int kStage16Bytes = kBlockSize * kRowBytes16;

template <DType kDType>
struct PageBytes {
  static constexpr int kRow = kHeadDim * (kDType == DType::kBF16 ? 2 : 1);
  static constexpr int kPage = kBlockSize * kRow;
  static constexpr int kChunks = kPage / 16;  // 16-byte copies per page
};

// Shared memory of the score kernel, computed identically on host (sizing) and device (carving):
// the stage ring (raw pages), a bf16 compute page (fp8 only: pages are widened into it), and the
// rows' top-K lists [K][kPrefillRows].
struct ScoreSmem {
  size_t stages_off, convert_off, lists_off, total;
  __host__ __device__ ScoreSmem(int stages, int topk, DType dtype) {
    const size_t page = static_cast<size_t>(kBlockSize) * kHeadDim * dtype_bytes(dtype);
    stages_off = 0;
    convert_off = stages * page;
    lists_off = convert_off + (dtype == DType::kBF16 ? 0 : kStage16Bytes);
    total = lists_off + static_cast<size_t>(topk) * kPrefillRows * sizeof(Key);
  }
};

// ---- Plan ------------------------------------------------------------------------------------
// Clamps cu_seqlens_q into a non-decreasing sequence in [0, num_tokens] (start_i = min(max(0,
// cu_0..cu_i), num_tokens), the reference's sequential clamp in closed form), clamps and flags
// context_lens / seq_lens, and lists each request's tiles. Requests go 1023 at a time.
__global__ void __launch_bounds__(kPlanThreads) prefill_plan_kernel(const PrefillParams p) {
  __shared__ int32_t scan_buf[32];
  __shared__ int32_t starts[kPlanThreads];
  const int tid = threadIdx.x, per_pass = kPlanThreads - 1, R = p.num_reqs;
  const int32_t N = static_cast<int32_t>(p.num_tokens);
  const int tpt = prefill_tokens_per_tile(p.num_heads);
  auto max_op = [](int32_t a, int32_t b) { return a > b ? a : b; };
  auto sum_op = [](int32_t a, int32_t b) { return a + b; };
  int32_t err = 0, carry_max = 0, carry_tiles = 0, total = 0;
  for (int base = 0; base < R; base += per_pass) {
    const int i = base + tid;  // index into cu_seqlens_q, [0, R]
    const int32_t cu = i <= R ? p.cu_seqlens_q[i] : INT32_MIN;
    const int32_t m = max_op(block_scan_1024(cu, max_op, scan_buf, &total), carry_max);
    carry_max = max_op(total, carry_max);
    const int32_t start = m < N ? m : N;
    starts[tid] = start;
    if (i <= R && (tid < per_pass || i == R) && start != cu) err |= kErrSeqLenOutOfRange;
    if (i == 0) p.header->covered_begin = start;
    if (i == R) p.header->covered_end = start;
    __syncthreads();
    const int r = base + tid;
    int32_t len = 0, ctx = 0, ntiles = 0;
    if (tid < per_pass && r < R) {
      len = starts[tid + 1] - starts[tid];
      ctx = clamp_seq_len(p.context_lens[r], p.max_seq_len, &err);
      clamp_seq_len(p.seq_lens[r], p.max_seq_len, &err);  // reported, not used (as the reference)
      ntiles = (len + tpt - 1) / tpt;
    }
    const int32_t first = carry_tiles + block_scan_1024(ntiles, sum_op, scan_buf, &total) - ntiles;
    carry_tiles += total;
    for (int32_t k = 0; k < ntiles; ++k) {
      if (first + k >= p.tiles_capacity) break;
      const int64_t pos0 = int64_t{ctx} + int64_t{k} * tpt;
      p.tiles[first + k] = PrefillTile{r, starts[tid] + k * tpt, min(tpt, len - k * tpt),
                                       static_cast<int32_t>(pos0 < p.max_seq_len ? pos0
                                                                                 : p.max_seq_len)};
    }
    __syncthreads();  // starts[] is rewritten by the next pass
  }
  if (tid == 0) {
    p.header->num_tiles =
        carry_tiles < p.tiles_capacity ? carry_tiles : static_cast<int32_t>(p.tiles_capacity);
  }
  if (err) atomicOr(p.error_flag, err);
}

// ---- Score -----------------------------------------------------------------------------------
// Position of tile row `row` (token-major), -1 for a padding row. Positions at or past
// max_seq_len are clamped to its last token and flagged (as the reference does).
__device__ __forceinline__ int64_t row_position(const PrefillParams& p, const PrefillTile& tile,
                                                int row, int32_t* err) {
  const int t = row / p.num_heads;
  if (t >= tile.ntok) return -1;
  const int64_t pos = int64_t{tile.pos0} + t;
  if (pos < p.max_seq_len) return pos;
  *err |= kErrSeqLenOutOfRange;
  return p.max_seq_len - 1;
}

// The pages a tile's split scores. The tile's last token sees V blocks (positions clamped to
// max_seq_len); they are cut into at most S key ranges of >= kPrefillMinPagesPerSplit pages, and
// split `split` scores pages [b0, b1) (empty for the splits left over). first_pos is the tile's
// first position, clamped alike: pages wholly at or before it need no causal mask.
struct SplitPages {
  int64_t b0, b1, first_pos;
};
__device__ __forceinline__ SplitPages split_pages(const PrefillParams& p, const PrefillTile& tile,
                                                  int split, int S) {
  const int64_t last = int64_t{tile.pos0} + tile.ntok - 1;
  const int64_t V = visible_blocks(last < p.max_seq_len ? last : p.max_seq_len - 1);
  const int64_t s_eff = min(int64_t{S}, cdiv(V, kPrefillMinPagesPerSplit));
  SplitPages r;
  r.b0 = split < s_eff ? split * V / s_eff : 0;
  r.b1 = split < s_eff ? (split + 1) * V / s_eff : 0;
  r.first_pos = tile.pos0 < p.max_seq_len ? tile.pos0 : p.max_seq_len - 1;
  return r;
}

// Tile row `row`'s ordered list (K keys `stride` apart in shared memory) as split `split`'s
// candidates: partial[split][token][head][K], merged by prefill_merge_kernel.
__device__ __forceinline__ void store_split_list(const PrefillParams& p, const PrefillTile& tile,
                                                 int split, int row, const Key* list,
                                                 int stride) {
  const int t = row / p.num_heads, h = row % p.num_heads;
  Key* dst = p.partial + ((int64_t{split} * p.num_tokens + tile.tok0 + t) * p.num_heads + h) *
                             p.topk;
  for (int i = 0; i < p.topk; ++i) dst[i] = list[i * stride];
}

// The A fragments of this thread's quad rows for all 128 dims: qa[mt][rh][j] holds dims
// [kstep_dim(j, c4), +8) of row warp*32 + 16 mt + 8 rh + g (the k-steps' grouping, k_steps.h).
// Dims are permuted identically in A and B (k-slot 2c4 <-> dims +0..1, k-slot 2c4+8 <-> dims
// +2..3 of each half-uint4), so one 16-byte load feeds two k-steps. Padding rows are zero.
__device__ __forceinline__ void load_queries(const PrefillParams& p, const PrefillTile& tile,
                                             int warp, int g, int c4, uint4 (&qa)[2][2][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int row = warp * 32 + mt * 16 + rh * 8 + g;
      const int t = row / p.num_heads, h = row % p.num_heads;
      const uint4* q = reinterpret_cast<const uint4*>(
          p.query + int64_t{tile.tok0 + t} * p.q_row_stride + h * p.q_head_stride);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        qa[mt][rh][j] = t < tile.ntok ? __ldg(q + kstep_dim(j, c4) / 8) : uint4{};
    }
  }
}

// Raw page -> compute-stage layout: key row r, 16-byte chunk c (dims [8c, 8c+8)) lands at chunk
// c ^ (r & 1). A warp's B loads (8 lanes per phase = two adjacent keys x the 4 chunks
// kstep_dim(j, c4) / 8 of one j, 32 bytes apart) then hit all 32 banks once.
__device__ __forceinline__ int swizzled(int r, int c) {
  return r * kRowBytes16 + ((c ^ (r & 1)) << 4);
}

// The mma.sync kernel's compute-page layout, for the page helpers below: 16-byte chunks c of
// dims [8 c, 8 c + 8) (its k-steps take their dims as they lie, load_queries).
struct MmaPageLayout {
  static constexpr int kThreads = kPrefillThreads;
  static constexpr bool kPieces = false;
  __device__ static int at(int r, int c) { return swizzled(r, c); }
};

// One page's copies into a stage: bf16 goes straight to the compute layout, fp8 lands raw (and
// is widened later). Layout: the CTA's kThreads, and at(row, chunk) of 16-byte chunks or, with
// kPieces, piece(row, piece) of 8-byte pieces.
template <DType kDType, typename Layout>
__device__ __forceinline__ void issue_page(const PrefillParams& p, const int32_t* bt_row,
                                           int64_t block, uint8_t* stage, int32_t* err) {
  using PB = PageBytes<kDType>;
  const int64_t page = clamp_page(bt_row[block], p.num_pages, err);
  const uint8_t* src = static_cast<const uint8_t*>(p.cache) + page * PB::kPage;
  static_assert(kDType != DType::kBF16 || PB::kRow == 16 * 16, "a bf16 row is 16 chunks");
  if constexpr (kDType != DType::kBF16) {
    for (int q = threadIdx.x; q < PB::kChunks; q += Layout::kThreads) {
      cp_async16(stage + q * 16, src + q * 16);
    }
  } else if constexpr (Layout::kPieces) {
    // 32 pieces of 4 dims a row, a thread's piece the same in every row it copies: rows 16 apart
    // (512 threads), so the same place in their 8-row swizzle atoms, 16 rows x 128 B further.
    constexpr int kRowsAPass = Layout::kThreads / 32;
    static_assert(kRowsAPass % 8 == 0, "a thread's rows must share their place in the atom");
    uint8_t* dst = stage + Layout::piece(threadIdx.x >> 5, threadIdx.x & 31);
    src += threadIdx.x * 8;
#pragma unroll
    for (int i = 0; i < PB::kChunks * 2 / Layout::kThreads; ++i) {
      cp_async8(dst + i * kRowsAPass * 128, src + i * Layout::kThreads * 8);
    }
  } else {
    for (int q = threadIdx.x; q < PB::kChunks; q += Layout::kThreads) {
      cp_async16(stage + Layout::at(q >> 4, q & 15), src + q * 16);
    }
  }
}

// fp8 page (raw) -> bf16 compute page in Layout; each 16-byte fp8 chunk is two bf16 chunks.
template <typename Layout>
__device__ __forceinline__ void widen_page(const uint8_t* raw, uint8_t* out) {
  constexpr int kChunks = PageBytes<DType::kFP8E4M3>::kChunks;
  if constexpr (Layout::kPieces) {
    // Raw chunks 2 m and 2 m + 1 of row r (dims [32 m, 32 m + 32), pieces 8 m + i, i 0..7) a
    // thread: pieces 8 m + i and 8 m + i + 4 sit side by side in one 16-byte chunk of the layout
    // (k-step slot pieces 4 s + c and 4 s + c + 1, prefill_layout.h), so four 16-byte stores;
    // thread q's (r, m) from sw128_widen_unit, odd rows reading their second chunk first, so that
    // the 8 lanes of a shared-memory phase hit 8 bank groups in each load and store.
    static_assert(Layout::kThreads % 8 == 0, "a phase's 8 lanes are 8 units");
    static_assert(PageBytes<DType::kFP8E4M3>::kRow == kHeadDim, "sw128_widen_load's rows");
    for (int q = threadIdx.x; q < kChunks / 2; q += Layout::kThreads) {
      int r = 0, m = 0;
      sw128_widen_unit(q, &r, &m);
      const uint4 v0 = *reinterpret_cast<const uint4*>(raw + sw128_widen_load(r, m, 0));
      const uint4 v1 = *reinterpret_cast<const uint4*>(raw + sw128_widen_load(r, m, 1));
      const bool odd = r & 1;
      const uint4 a = odd ? v1 : v0, b = odd ? v0 : v1;  // raw chunks 2 m, 2 m + 1
      const uint4 alo = fp8x8_to_bf16x8(make_uint2(a.x, a.y));
      const uint4 ahi = fp8x8_to_bf16x8(make_uint2(a.z, a.w));
      const uint4 blo = fp8x8_to_bf16x8(make_uint2(b.x, b.y));
      const uint4 bhi = fp8x8_to_bf16x8(make_uint2(b.z, b.w));
      auto store = [&](int i, uint2 first, uint2 second) {  // pieces 8 m + i, 8 m + i + 4
        *reinterpret_cast<uint4*>(out + Layout::piece(r, 8 * m + i)) =
            make_uint4(first.x, first.y, second.x, second.y);
      };
      store(0, make_uint2(alo.x, alo.y), make_uint2(blo.x, blo.y));
      store(1, make_uint2(alo.z, alo.w), make_uint2(blo.z, blo.w));
      store(2, make_uint2(ahi.x, ahi.y), make_uint2(bhi.x, bhi.y));
      store(3, make_uint2(ahi.z, ahi.w), make_uint2(bhi.z, bhi.w));
    }
  } else {
    for (int q = threadIdx.x; q < kChunks; q += Layout::kThreads) {
      const int r = q >> 3, c = q & 7;
      const uint4 v = *reinterpret_cast<const uint4*>(raw + q * 16);
      *reinterpret_cast<uint4*>(out + Layout::at(r, 2 * c)) = fp8x8_to_bf16x8(make_uint2(v.x, v.y));
      *reinterpret_cast<uint4*>(out + Layout::at(r, 2 * c + 1)) =
          fp8x8_to_bf16x8(make_uint2(v.z, v.w));
    }
  }
}

// Max over one 128-key page of this thread's 4 quad rows, in two halves of 64 keys (64
// accumulators each). kMasked: key kk of the page counts only when kk <= lim[mt][rh] (the row's
// position relative to the page start). NaN dots never win (max_num), as in the reference.
template <bool kMasked>
__device__ __forceinline__ void page_max(const uint8_t* page, const uint4 (&qa)[2][2][4], int g,
                                         int c4, const int (&lim)[2][2], float (&rm)[2][2]) {
  const uint8_t* base = page + g * kRowBytes16;
  const int gb = g & 1;  // key rows half*64 + nt*8 + g: the swizzle bit is g's
  // NOTE: not unrolled: the compiler would overlap the two halves and keep 128 accumulators
  // live next to the 64 query registers (spilling past 255 registers).
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int joff = 2 * kstep_dim(j ^ gb, c4);  // where row g's swizzle put chunk j's dims
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const uint4 b =
            *reinterpret_cast<const uint4*>(base + (half * 64 + nt * 8) * kRowBytes16 + joff);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const uint4& lo = qa[mt][0][j];
          const uint4& hi = qa[mt][1][j];
          mma_16816(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
          mma_16816(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kk = half * 64 + nt * 8 + 2 * c4 + e;
            if (!kMasked || kk <= lim[mt][rh]) rm[mt][rh] = max_num(rm[mt][rh], acc[mt][nt][rh * 2 + e]);
          }
  }
}

template <typename T>
__device__ __forceinline__ T pick(int c4, const T (&v)[2][2]) {
  return c4 == 0 ? v[0][0] : c4 == 1 ? v[0][1] : c4 == 2 ? v[1][0] : v[1][1];
}

template <DType kDType>
__global__ void __launch_bounds__(kPrefillThreads, 1)
    prefill_score_kernel(const PrefillParams p, const int stages) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int S = p.splits, num_tiles = p.header->num_tiles;
  const int tile_rank = static_cast<int>(blockIdx.x) / S, split = static_cast<int>(blockIdx.x) % S;
  if (tile_rank >= num_tiles) return;
  // The last tiles of a request see the most keys: run them first (tiles are listed in order).
  const PrefillTile tile = p.tiles[num_tiles - 1 - tile_rank];
  const ScoreSmem lay(stages, p.topk, kDType);
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, c4 = tid & 3;
  const int K = p.topk;
  int32_t err = 0, ignored = 0;

  // This thread's quad rows warp*32 + 16 mt + 8 rh + g; it owns the list of row (mt, rh) = c4.
  int64_t pos[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
      pos[mt][rh] = row_position(p, tile, warp * 32 + mt * 16 + rh * 8 + g,
                                 split == 0 && c4 == mt * 2 + rh ? &err : &ignored);
  const int own_row = warp * 32 + (c4 >> 1) * 16 + (c4 & 1) * 8 + g;
  const int64_t own_pos = pick(c4, pos), own_visible = visible_blocks(own_pos);

  const SplitPages range = split_pages(p, tile, split, S);
  const int64_t first_pos = range.first_pos, b0 = range.b0, b1 = range.b1;

  Key* list = reinterpret_cast<Key*>(smem + lay.lists_off) + tid;
  for (int i = 0; i < K; ++i) list[i * kPrefillThreads] = kPadKey;
  Key tau = kPadKey;

  if (b1 > b0) {
    uint4 qa[2][2][4];
    load_queries(p, tile, warp, g, c4, qa);
    const int32_t* bt_row = p.block_table + int64_t{tile.req} * p.bt_row_stride;
    uint8_t* ring = smem + lay.stages_off;
    constexpr int kPage = PageBytes<kDType>::kPage;
    for (int s = 0; s < stages - 1; ++s) {
      if (b0 + s < b1) {
        issue_page<kDType, MmaPageLayout>(p, bt_row, b0 + s, ring + s * kPage, &err);
      }
      cp_async_commit();
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int i = static_cast<int>(b - b0);
      cp_async_wait(stages - 2);  // this thread's copies of page b have landed
      __syncthreads();            // everyone's have, and everyone is done with page b - 1
      if (b + stages - 1 < b1) {
        issue_page<kDType, MmaPageLayout>(p, bt_row, b + stages - 1,
                                          ring + ((i + stages - 1) % stages) * kPage, &err);
      }
      cp_async_commit();
      const uint8_t* page = ring + (i % stages) * kPage;
      if constexpr (kDType == DType::kFP8E4M3) {
        widen_page<MmaPageLayout>(page, smem + lay.convert_off);
        __syncthreads();
        page = smem + lay.convert_off;
      }
      float rm[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
      const int64_t kbase = b * kBlockSize;
      if (kbase + kBlockSize - 1 <= first_pos) {  // every row sees the whole page
        const int lim[2][2] = {};
        page_max<false>(page, qa, g, c4, lim, rm);
      } else {
        int lim[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) {
            const int64_t d = pos[mt][rh] - kbase;
            lim[mt][rh] = d < -1 ? -1 : d > kBlockSize ? kBlockSize : static_cast<int>(d);
          }
        page_max<true>(page, qa, g, c4, lim, rm);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          rm[mt][rh] = max_num(rm[mt][rh], __shfl_xor_sync(0xffffffffu, rm[mt][rh], 1));
          rm[mt][rh] = max_num(rm[mt][rh], __shfl_xor_sync(0xffffffffu, rm[mt][rh], 2));
        }
      if (b < own_visible) {
        const float score =
            forced_score(p.scale * pick(c4, rm), b, own_visible, p.init_blocks, p.local_blocks);
        list_insert(list, kPrefillThreads, K, make_key(score, b), tau);
      }
    }
    cp_async_wait(0);  // nothing may land in shared memory after the CTA exits
  }
  if (own_pos >= 0) store_split_list(p, tile, split, own_row, list, kPrefillThreads);
  if (err) atomicOr(p.error_flag, err);
}

// ---- Score, Hopper warpgroup MMA -------------------------------------------------------------
// The same work as prefill_score_kernel on wgmma (sm_90a): 4 warpgroups x 64 rows = the tile's
// 256 rows, 512 threads. Each warpgroup multiplies its 64 rows (A fragments in registers, held
// for the whole split) by every 128-key page with 8 x wgmma.m64n128k16, B read by the tensor
// cores straight from shared memory through a descriptor. Warp w of the CTA holds rows 16 w + g
// and 16 w + g + 8 (g = lane / 4); of each quad, lane c4 = 0 owns the first row's list, c4 = 1
// the second's. Pages land (bf16) or are widened (fp8) into the 128-byte swizzle layout below.
constexpr int kWgThreads = 512;

// Shared memory of the wgmma kernel, from a 1024-byte aligned base (`total` includes the slack
// to reach it): the stage ring, the bf16 compute page (fp8 only), the lists [K][kPrefillRows].
struct WgmmaSmem {
  size_t stages_off, convert_off, lists_off, total;
  __host__ __device__ WgmmaSmem(int stages, int topk, DType dtype) {
    const size_t page = static_cast<size_t>(kBlockSize) * kHeadDim * dtype_bytes(dtype);
    stages_off = 0;
    convert_off = stages * page;  // a multiple of 16 KB
    lists_off = convert_off + (dtype == DType::kBF16 ? 0 : kStage16Bytes);
    total = lists_off + static_cast<size_t>(topk) * kPrefillRows * sizeof(Key) + 1024;
  }
};

// The wgmma kernel's compute-page layout: 8-byte pieces of 4 dims in the decode kernel's k-step
// grouping (prefill_layout.h).
struct Sw128PageLayout {
  static constexpr int kThreads = kWgThreads;
  static constexpr bool kPieces = true;
  __device__ static int piece(int r, int d) { return sw128_piece(r, d); }
};

// A fragments of rows row0 and row0 + 8 in the layout's slot order: qa[s] feeds k-step s =
// 2 j + h: {row0 slots 2c4..+1, row0+8 the same, row0 slots 8+2c4..+1, row0+8 the same}, the
// dims sw128_query_word names (Sw128PageLayout). Padding rows are zero.
__device__ __forceinline__ void load_queries_rs(const PrefillParams& p, const PrefillTile& tile,
                                                int row0, int c4, uint32_t (&qa)[8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    const int t = row / p.num_heads, head = row % p.num_heads;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(
        p.query + int64_t{tile.tok0 + t} * p.q_row_stride + head * p.q_head_stride);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      qa[s][h] = t < tile.ntok ? __ldg(q + sw128_query_word(s, c4, 0)) : 0u;
      qa[s][2 + h] = t < tile.ntok ? __ldg(q + sw128_query_word(s, c4, 1)) : 0u;
    }
  }
}

template <DType kDType>
__global__ void __launch_bounds__(kWgThreads, 1)
    prefill_score_wgmma_kernel(const PrefillParams p, const int stages) {
#if defined(CPIDX_PREFILL_WGMMA)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // NOTE: the 128-byte swizzle is a function of address bits [4, 10): pages must start on
  // 1024-byte boundaries, whatever alignment the dynamic window gets.
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int S = p.splits, num_tiles = p.header->num_tiles;
  const int tile_rank = static_cast<int>(blockIdx.x) / S, split = static_cast<int>(blockIdx.x) % S;
  if (tile_rank >= num_tiles) return;
  const PrefillTile tile = p.tiles[num_tiles - 1 - tile_rank];  // longest tiles first
  const WgmmaSmem lay(stages, p.topk, kDType);
  const int tid = threadIdx.x, g = (tid & 31) >> 2, c4 = tid & 3;
  const int row0 = (tid >> 5) * 16 + g;  // warpgroup tid / 128 holds rows [64 wg, 64 wg + 64)
  const int K = p.topk;
  int32_t err = 0;

  // NOTE: 32-bit positions and block indices (all below max_seq_len, an int32): the 64
  // accumulators and 32 query registers leave little of the 128 a 512-thread CTA may use.
  int32_t pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int32_t row_err = 0;  // each row's flag is raised once: by its owner in split 0
    pos[h] = static_cast<int32_t>(row_position(p, tile, row0 + 8 * h, &row_err));
    if (split == 0 && c4 == h) err |= row_err;
  }
  const bool owner = c4 < 2;
  const int own_row = row0 + 8 * (c4 & 1);
  const int32_t own_pos = owner ? (c4 == 0 ? pos[0] : pos[1]) : -1;
  const int32_t own_visible = static_cast<int32_t>(visible_blocks(own_pos));

  const SplitPages range = split_pages(p, tile, split, S);
  const int32_t first_pos = static_cast<int32_t>(range.first_pos);
  const int32_t b0 = static_cast<int32_t>(range.b0), b1 = static_cast<int32_t>(range.b1);

  Key* list = reinterpret_cast<Key*>(smem + lay.lists_off) + own_row;
  if (owner)
    for (int i = 0; i < K; ++i) list[i * kPrefillRows] = kPadKey;

  if (b1 > b0) {
    uint32_t qa[8][4];
    load_queries_rs(p, tile, row0, c4, qa);
    const int32_t* bt_row = p.block_table + int64_t{tile.req} * p.bt_row_stride;
    uint8_t* ring = smem + lay.stages_off;
    constexpr int kPage = PageBytes<kDType>::kPage;
    for (int s = 0; s < stages - 1; ++s) {
      if (b0 + s < b1) {
        issue_page<kDType, Sw128PageLayout>(p, bt_row, b0 + s, ring + s * kPage, &err);
      }
      cp_async_commit();
    }
    // Per page b: wait for the MMA, reduce the accumulators to the two rows' block maxima, then
    // (barrier) issue page b + 1's MMA before offering page b's maxima to the lists and issuing
    // the next copies, so that the tensor cores work under both.
    // NOTE: ptxas serializes the MMAs of a commit group if any of their accumulators is read
    // before the group's wait, and waits for all of them where a conditional issue merges: one
    // accumulator set, read only after wait_all, and the last page peeled off the loop.
    float acc[64];
    float rm[2];
    const auto mma_page = [&](int32_t b) {  // waits for page b to land, issues its MMAs
      const int i = b - b0;
      cp_async_wait(stages - 2);  // this thread's copies of page b have landed
      if constexpr (kDType == DType::kBF16) fence_proxy_async_smem();  // ... for the tensor cores
      __syncthreads();  // everyone's have, and every warpgroup is done with page b - 1
      const uint8_t* page = ring + (i % stages) * kPage;
      if constexpr (kDType == DType::kFP8E4M3) {
        widen_page<Sw128PageLayout>(page, smem + lay.convert_off);
        fence_proxy_async_smem();
        __syncthreads();
        page = smem + lay.convert_off;
      }
      const uint32_t page_addr = smem_addr(page);
      wgmma_fence_operands(acc);
      wgmma_fence();
      // k-step s: slots [16 s, 16 s + 16) (the decode's dims, prefill_layout.h), 32 bytes into
      // the rows of half s / 4.
      wgmma_m64n128k16_rs<false>(acc, qa[0], wgmma_desc_sw128(page_addr));
#pragma unroll
      for (int s = 1; s < 8; ++s) {
        wgmma_m64n128k16_rs<true>(
            acc, qa[s], wgmma_desc_sw128(page_addr + (s >> 2) * kSw128Half + (s & 3) * 32));
      }
      wgmma_commit();
      // Page b + stages - 1 into the slot of page b - 1, free since the barrier.
      if (b + stages - 1 < b1) {
        issue_page<kDType, Sw128PageLayout>(p, bt_row, b + stages - 1,
                                            ring + ((i + stages - 1) % stages) * kPage, &err);
      }
      cp_async_commit();
    };
    // acc[4 j + e] is key 8 j + 2 c4 + e of row row0, acc[4 j + 2 + e] the same key of row0 + 8.
    const auto reduce_page = [&](int32_t b) {
      wgmma_wait_all();
      wgmma_fence_operands(acc);
      rm[0] = rm[1] = -INFINITY;
      const int64_t kbase = int64_t{b} * kBlockSize;
      if (kbase + kBlockSize - 1 <= first_pos) {  // every row sees the whole page
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          rm[0] = max_num(rm[0], max_num(acc[4 * j], acc[4 * j + 1]));
          rm[1] = max_num(rm[1], max_num(acc[4 * j + 2], acc[4 * j + 3]));
        }
      } else {
        int lim[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t d = pos[h] - kbase;
          lim[h] = d < -1 ? -1 : d > kBlockSize ? kBlockSize : static_cast<int>(d);
        }
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kk = 8 * j + 2 * c4 + e;
            if (kk <= lim[0]) rm[0] = max_num(rm[0], acc[4 * j + e]);
            if (kk <= lim[1]) rm[1] = max_num(rm[1], acc[4 * j + 2 + e]);
          }
      }
    };
    const auto offer = [&](int32_t b) {  // page b's maxima (over the quad) to the owner's list
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        rm[h] = max_num(rm[h], __shfl_xor_sync(0xffffffffu, rm[h], 1));
        rm[h] = max_num(rm[h], __shfl_xor_sync(0xffffffffu, rm[h], 2));
      }
      if (b < own_visible) {  // owners only (own_visible is 0 elsewhere)
        const float score = forced_score(p.scale * (c4 == 0 ? rm[0] : rm[1]), b, own_visible,
                                         p.init_blocks, p.local_blocks);
        Key tau = list[(K - 1) * kPrefillRows];  // re-read: a register less across the MMAs
        list_insert(list, kPrefillRows, K, make_key(score, b), tau);
      }
      // NOTE: the wgmma instructions that follow are .sync.aligned: the warp must be converged
      // again after the owners' inserts (there is no barrier before the next page's wait).
      __syncwarp();
    };
    mma_page(b0);
    int32_t b = b0;
    for (; b + 1 < b1; ++b) {
      reduce_page(b);
      mma_page(b + 1);
      offer(b);
    }
    reduce_page(b);
    offer(b);
    cp_async_wait(0);  // nothing may land in shared memory after the CTA exits
  }
  if (own_pos >= 0) store_split_list(p, tile, split, own_row, list, kPrefillRows);
  if (err) atomicOr(p.error_flag, err);
#else
  (void)p;
  (void)stages;
  __trap();  // never launched: plan_prefill chooses this kernel only where the probe found sm_90a
#endif
}

// 1 where this build runs sm_90a code on the device (the wgmma kernel is real there).
__global__ void prefill_wgmma_probe_kernel(int* out) {
#if defined(CPIDX_PREFILL_WGMMA)
  *out = 1;
#else
  *out = 0;
#endif
}

// ---- Merge -----------------------------------------------------------------------------------
// kMergeLanes lanes per (token, head) row: lane l holds the head of split l's ordered list; K
// rounds of a lane max pick the next key. Exact: the lists are disjoint (a block belongs to one
// split) and each holds its split's K best, so the global K best are their K best heads in turn.
__global__ void __launch_bounds__(256) prefill_merge_kernel(const PrefillParams p) {
  const int64_t row = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kMergeLanes;
  const int lane = threadIdx.x % kMergeLanes, H = p.num_heads, K = p.topk;
  const bool live = row < p.num_tokens * H;
  const int64_t token = live ? row / H : 0;
  const int h = live ? static_cast<int>(row % H) : 0;
  const bool covered =
      live && token >= p.header->covered_begin && token < p.header->covered_end;
  const Key* list = p.partial + ((int64_t{lane} * p.num_tokens + token) * H + h) * K;
  int cursor = 0;
  Key head = covered && lane < p.splits ? list[0] : kPadKey;
  int32_t* out = p.ids + h * p.ids_head_stride + token * p.ids_row_stride;
  for (int i = 0; i < K; ++i) {
    Key best = head;
#pragma unroll
    for (int off = kMergeLanes / 2; off > 0; off >>= 1) {
      const Key o = __shfl_xor_sync(0xffffffffu, best, off, kMergeLanes);
      best = o > best ? o : best;
    }
    if (best != kPadKey && head == best) head = ++cursor < K ? list[cursor] : kPadKey;
    if (live && i % kMergeLanes == lane) out[i] = best == kPadKey ? -1 : key_block(best);
  }
}

}  // namespace

cudaError_t prefill_wgmma_available(int device, bool* available) {
  *available = false;
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess) {
    return e;
  }
  if (major != 9 || minor != 0) return cudaSuccess;
  // The build may hold sm_90 (not sm_90a) code, or PTX for an older target: ask the device.
  int* flag = nullptr;
  if ((e = cudaMalloc(&flag, sizeof(int))) != cudaSuccess) return e;
  // The launch's own status (not cudaGetLastError, which would also take, and clear, an error
  // the caller left pending: a failed allocation read as this probe's, or as "no wgmma").
  e = launch_with_pdl(false, prefill_wgmma_probe_kernel, dim3(1), dim3(1), 0, nullptr, flag);
  int found = 0;
  if (e == cudaSuccess) e = cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost);
  cuda_host::free_relaxed(flag);  // freed even when a capture under way refused the copy
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
    cudaGetLastError();  // the probe's own, not sticky: no image here simply means no wgmma
    return cudaSuccess;
  }
  *available = e == cudaSuccess && found == 1;
  return e;
}

cudaError_t plan_prefill(int topk, DType dtype, int device, bool wgmma, PrefillLaunch* launch) {
  int sms = 0, smem_optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  if (wgmma) {
    if ((e = raise_smem_cap(prefill_score_wgmma_kernel<DType::kBF16>, smem_optin)) != cudaSuccess) return e;
    if ((e = raise_smem_cap(prefill_score_wgmma_kernel<DType::kFP8E4M3>, smem_optin)) != cudaSuccess) return e;
  } else {
    if ((e = raise_smem_cap(prefill_score_kernel<DType::kBF16>, smem_optin)) != cudaSuccess) return e;
    if ((e = raise_smem_cap(prefill_score_kernel<DType::kFP8E4M3>, smem_optin)) != cudaSuccess) return e;
  }
  // NOTE: one CTA per SM (the query fragments and accumulators take ~170 registers per thread
  // on mma.sync, 96 of the 128 a 512-thread CTA allows on wgmma); 3-4 pages in flight cover the
  // L2 latency of a page that takes ~3000 (mma.sync) or ~2300 (wgmma) cycles to score.
  for (int stages = 4; stages >= 2; --stages) {
    const size_t total =
        wgmma ? WgmmaSmem(stages, topk, dtype).total : ScoreSmem(stages, topk, dtype).total;
    if (total + 1024 > static_cast<size_t>(smem_optin)) continue;
    launch->sms = sms;
    launch->stages = stages;
    launch->smem_bytes = total;
    launch->topk = topk;
    launch->dtype = dtype;
    launch->wgmma = wgmma;
    return cudaSuccess;
  }
  return cudaErrorInvalidConfiguration;
}

int prefill_splits(int64_t num_tokens, int heads, int sms, int max_splits) {
  const int64_t tiles = cdiv(num_tokens, prefill_tokens_per_tile(heads));
  const int limit = max_splits < kPrefillMaxSplits ? max_splits : kPrefillMaxSplits;
  // Equal splits of equal tiles take equal time: choose the split count whose CTAs fill their
  // waves best; among near-equal fills, the fewest splits (less query reloading and merging).
  int best = 1;
  double best_fill = 0;
  for (int s = 1; s <= limit; ++s) {
    const int64_t items = tiles * s, waves = cdiv(items, sms);
    const double fill = static_cast<double>(items) / static_cast<double>(waves * sms);
    if (fill > best_fill + 0.01) {
      best = s;
      best_fill = fill;
    }
  }
  return best;
}

cudaError_t launch_prefill(const PrefillParams& p, const PrefillLaunch& l, cudaStream_t stream) {
  if (p.splits < 1 || p.splits > kPrefillMaxSplits || p.topk != l.topk) return cudaErrorInvalidValue;
  // cudaLaunchKernelEx returns each launch's own error (cudaGetLastError after <<<>>> would also
  // return, and clear, an earlier one of the caller's).
  cudaError_t e = launch_with_pdl(false, prefill_plan_kernel, dim3(1), dim3(kPlanThreads), 0,
                                  stream, p);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(prefill_max_tiles(p.num_tokens, p.num_reqs, p.num_heads) *
                                        p.splits));
  if (l.wgmma) {
    auto* kernel = l.dtype == DType::kBF16 ? prefill_score_wgmma_kernel<DType::kBF16>
                                           : prefill_score_wgmma_kernel<DType::kFP8E4M3>;
    e = launch_with_pdl(false, kernel, grid, dim3(kWgThreads), l.smem_bytes, stream, p, l.stages);
  } else {
    auto* kernel = l.dtype == DType::kBF16 ? prefill_score_kernel<DType::kBF16>
                                           : prefill_score_kernel<DType::kFP8E4M3>;
    e = launch_with_pdl(false, kernel, grid, dim3(kPrefillThreads), l.smem_bytes, stream, p,
                        l.stages);
  }
  if (e != cudaSuccess) return e;
  const int64_t merge_threads = p.num_tokens * p.num_heads * kMergeLanes;
  return launch_with_pdl(false, prefill_merge_kernel,
                         dim3(static_cast<unsigned>(cdiv(merge_threads, 256))), dim3(256), 0,
                         stream, p);
}

}  // namespace cuda
}  // namespace cpidx
