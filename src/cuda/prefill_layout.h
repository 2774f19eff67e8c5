// src/cuda/prefill_layout.h: where the wgmma prefill kernel (prefill.cu) puts a key row's dims
// in its shared-memory page, on host and device so that CI checks it
// (tests/gpu/test_prefill_layout.cc).
#pragma once

#include "cpidx/contract.h"
#include "k_steps.h"

namespace cpidx {
namespace cuda {

constexpr int kSw128Half = kBlockSize * 128;  // 64 dims of every key of a page: 16 KB

// Compute-page layout of key row r (0..127), 16-byte chunk c (0..15) of slots [8 c, 8 c + 8):
// two K-major halves of 64 slots, each 128 rows x 128 bytes in 8-row atoms of 1024 bytes, chunk
// (c & 7) of row r at (c & 7) ^ (r & 7): the address function of the 128-byte swizzle, which
// the tensor cores apply to the descriptor's addresses (the page is 1024-byte aligned).
CPIDX_HD int sw128(int r, int c) {
  return (c >> 3) * kSw128Half + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// The kernel's k-step s = 2 j + h reads slots [16 s, 16 s + 16) of each key row. They hold the
// dims every scoring kernel's k-step (j, h) sums (k_steps.h), {kstep_dim(j, c) + 4 h + e : c, e
// in 0..3}, at slot 16 s + 4 c + e, so that the fp32 sums group the products as the decode's
// do (CONTRACT.md section 4: bit for bit). Inside a step the slots' order is not the decode's:
// an mma.sync step's result does not depend on it (bench/probes/mma_k_order.cu); that a wgmma
// step's does not either is what GpuPrefill.SameIdsAsEachTokensDecode checks. In 8-byte pieces
// of 4 dims: dims [4 d, 4 d + 4), d = kstep_dim(j, c) / 4 + h = 16 (j >> 1) + 4 c + 2 (j & 1) + h,
// at slot piece 4 s + c. The byte offset of piece d (0..31) of row r in the page.
CPIDX_HD int sw128_piece(int r, int d) {
  const int slot = (d & ~15) | (((d >> 1) & 1) << 3) | ((d & 1) << 2) | ((d >> 2) & 3);
  return sw128(r, slot >> 1) + (slot & 1) * 8;
}

// The fp8 widening's unit q (0..511) of a page: raw chunks 2 m and 2 m + 1 of key row r. The 8
// lanes of a shared-memory phase (q 8 b .. 8 b + 7) take 8 rows, lane L row 8 (b / 4) + L, and
// m = (L / 2 + b) % 4: with odd rows reading their second chunk first, their 16-byte loads hit 8
// bank groups, and so does each of their four stores (rows apart by the swizzle, lanes of one
// row pair by m's slot order). PrefillLayout.TheFp8WideningsUnitsCoverThePageWithoutConflicts.
CPIDX_HD void sw128_widen_unit(int q, int* r, int* m) {
  const int lane8 = q & 7, b = q >> 3;
  *r = 8 * (b >> 2) + lane8;
  *m = ((lane8 >> 1) + b) & 3;
}

// The byte offset in the raw fp8 page (rows of kHeadDim bytes) of unit (r, m)'s n-th 16-byte
// load (n 0, 1): raw chunk 2 m + (n ^ (r & 1)), so odd rows read their second chunk first.
CPIDX_HD int sw128_widen_load(int r, int m, int n) {
  return r * kHeadDim + m * 32 + 16 * (n ^ (r & 1));
}

// The query fragment of k-step s in that order: lane c4 of a quad holds slots 16 s + 2 c4 + e'
// (the A fragment's k-slots 2 c4 + e', hi = 0) and 16 s + 8 + 2 c4 + e' (k-slots 2 c4 + 8 + e',
// hi = 1), e' 0..1: dims 2 w and 2 w + 1 of the query row for the w returned.
CPIDX_HD int sw128_query_word(int s, int c4, int hi) {
  const int j = s >> 1, h = s & 1, c = 2 * hi + (c4 >> 1), e = 2 * (c4 & 1);
  return (kstep_dim(j, c) + 4 * h + e) / 2;
}

}  // namespace cuda
}  // namespace cpidx
