// src/cuda/prefill_kernels.h: Params and launchers of the prefill kernels (CONTRACT.md section 7),
// no framework types. One prefill call is three launches on the caller's stream:
//  - plan: one CTA turns cu_seqlens_q / context_lens into a list of tiles (up to 256 (token,
//    head) rows of one request each), clamping and flagging bad device values;
//  - score: one CTA per (tile, key split) streams the split's 128-token key pages through a
//    shared-memory ring and scores them on tensor cores against the tile's rows (queries held in
//    registers; mma.sync, or Hopper wgmma with keys read from shared memory by descriptor);
//    causal block max, forcing and a per-row running top-K are fused, and the split's ordered
//    top-K keys per row go to the workspace;
//  - merge: the splits' ordered lists of each row are merged exactly into the final ids.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "cpidx/contract.h"

namespace cpidx {
namespace cuda {

constexpr int kPrefillRows = 256;            // (token, head) rows of a tile: 8 warps x 32 rows
constexpr int kPrefillThreads = 256;         // one row's top-K list per thread
constexpr int kPrefillMaxSplits = 16;        // key-range splits per tile (merge lanes per row)
constexpr int kPrefillMinPagesPerSplit = 8;  // shorter splits spend more on set-up than keys

// Tokens of one tile: rows are token-major (row = token * H + head), at most kPrefillRows.
__host__ __device__ inline int prefill_tokens_per_tile(int heads) { return kPrefillRows / heads; }

// Tiles a batch of `tokens` tokens in `reqs` requests can need: every request cut into tiles adds
// at most one partial tile, and only requests with a token have tiles.
__host__ __device__ inline int64_t prefill_max_tiles(int64_t tokens, int64_t reqs, int heads) {
  return cdiv(tokens, prefill_tokens_per_tile(heads)) + (reqs < tokens ? reqs : tokens);
}

// One tile: tokens [tok0, tok0 + ntok) of request `req`; the first one sits at pos0 (the clamped
// context plus its offset in the request, capped at max_seq_len: positions at or past it are
// clamped, and flagged, by the score kernel).
struct PrefillTile {
  int32_t req, tok0, ntok, pos0;
};

// Written by the plan kernel. Rows outside [covered_begin, covered_end) belong to no request
// (cu_seqlens_q after clamping) and get -1 ids.
struct PrefillPlanHeader {
  int32_t num_tiles, covered_begin, covered_end, unused;
};

struct PrefillParams {
  const uint16_t* query = nullptr;  // [num_tokens, H, D] bf16 bits, strided, 16-byte rows
  int64_t q_row_stride = 0, q_head_stride = 0;  // elements, multiples of 8
  int num_heads = 0;                            // H <= kMaxHeads
  const void* cache = nullptr;                  // [num_pages, BS, D] bf16 or fp8 e4m3
  int64_t num_pages = 0;
  const int32_t* block_table = nullptr;  // [num_reqs, >= cdiv(max_seq_len, BS)]
  int64_t bt_row_stride = 0;
  const int32_t* cu_seqlens_q = nullptr;  // [num_reqs + 1]
  const int32_t* context_lens = nullptr;  // [num_reqs]
  const int32_t* seq_lens = nullptr;      // [num_reqs] (checked and flagged only)
  int num_reqs = 0;
  int64_t num_tokens = 0;
  int32_t max_seq_len = 0;
  float scale = 1.f;
  int topk = 16, init_blocks = 0, local_blocks = 1;

  int32_t* ids = nullptr;  // [H, num_tokens, K] with strides
  int64_t ids_head_stride = 0, ids_row_stride = 0;

  // Workspace (carved by the Prefiller).
  PrefillPlanHeader* header = nullptr;
  PrefillTile* tiles = nullptr;  // [tiles_capacity]
  int64_t tiles_capacity = 0;
  Key* partial = nullptr;        // [splits, num_tokens, H, K]: each split's ordered keys per row
  int splits = 1;                // S <= kPrefillMaxSplits
  int32_t* error_flag = nullptr;
};

struct PrefillLaunch {
  int sms = 0;            // multiprocessors of the device
  int stages = 0;         // key pages in flight per CTA
  size_t smem_bytes = 0;  // dynamic shared memory of the score kernel
  int topk = 0;           // K the layout was sized for
  DType dtype = DType::kBF16;
  bool wgmma = false;     // the Hopper warpgroup-MMA score kernel (512 threads), else mma.sync
};

// Whether the wgmma score kernel runs on `device`: compute capability 9.0 and a build holding
// sm_90a code (a one-thread probe launch; synchronises). Called once at construction.
cudaError_t prefill_wgmma_available(int device, bool* available);

// Chooses the pipeline depth for (K, dtype) and the score kernel (wgmma: only where available)
// on `device` and raises that kernel's shared-memory cap. Called once at construction.
cudaError_t plan_prefill(int topk, DType dtype, int device, bool wgmma, PrefillLaunch* launch);

// Key-range splits for a call: enough (tile, split) CTAs to fill the device in whole waves,
// within what the workspace holds (max_splits).
int prefill_splits(int64_t num_tokens, int heads, int sms, int max_splits);

// The three launches; p.splits must come from prefill_splits.
cudaError_t launch_prefill(const PrefillParams& p, const PrefillLaunch& l, cudaStream_t stream);

}  // namespace cuda
}  // namespace cpidx
