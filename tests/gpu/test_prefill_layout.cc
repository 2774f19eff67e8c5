// tests/gpu/test_prefill_layout.cc: the wgmma prefill kernel's shared-memory page layout
// (src/cuda/prefill_layout.h) and the k-steps' grouping every scoring kernel shares
// (src/cuda/k_steps.h), checked on the host (no GPU needed, so it runs in CI): the grouping
// takes every dim once, every 8-byte piece of a key row has its own place in its row of the
// page, each k-step's 32 bytes hold the dims the decode kernel's k-step sums (CONTRACT.md
// section 4: the GPU paths bit for bit), the query fragments name the same dims as the key
// slots they meet, and the shortcuts the kernel's copies and fp8 widening take hold.
#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

#include "cuda/k_steps.h"
#include "cuda/prefill_layout.h"

namespace {

using cpidx::cuda::kstep_dim;
using cpidx::cuda::kSw128Half;
using cpidx::cuda::sw128_piece;
using cpidx::cuda::sw128_query_word;
using cpidx::cuda::sw128_widen_load;
using cpidx::cuda::sw128_widen_unit;

// The slot (0..127) of key row r that byte offset `at` of the page holds: the swizzle undone.
int slot_at(int at, int* row) {
  const int half = at / kSw128Half, in_half = at % kSw128Half;
  *row = in_half / 128;
  const int chunk = ((in_half % 128) / 16) ^ (*row & 7);
  return (half * 8 + chunk) * 8 + (at % 16) / 2;
}

// The dim the decode kernel's k-step (j, h) puts in its slot 4 c + e: lane c's dim 4 h + e of
// chunk j.
int decode_dim(int slot) {
  const int s = slot / 16, j = s / 2, h = s % 2, c = (slot % 16) / 4, e = slot % 4;
  return kstep_dim(j, c) + 4 * h + e;
}

TEST(KSteps, EveryDimIsSummedOnceAndALanesChunksAreWholeLoads) {
  std::set<int> dims;
  for (int slot = 0; slot < 128; ++slot) {
    const int d = decode_dim(slot);
    ASSERT_GE(d, 0);
    ASSERT_LT(d, 128);
    ASSERT_TRUE(dims.insert(d).second) << "dim " << d << " twice (slot " << slot << ")";
  }
  for (int c4 = 0; c4 < 4; ++c4) {
    for (int j = 0; j < 4; ++j) {  // a lane's 8 dims of chunk j: one 16-byte bf16 load
      EXPECT_EQ(kstep_dim(j, c4) % 8, 0) << j << " " << c4;
    }
    for (int l = 0; l < 2; ++l) {  // a 16-byte fp8 load l: chunks 2 l and 2 l + 1, in order
      EXPECT_EQ(kstep_dim(2 * l, c4), 64 * l + 16 * c4) << l << " " << c4;
      EXPECT_EQ(kstep_dim(2 * l + 1, c4), kstep_dim(2 * l, c4) + 8) << l << " " << c4;
    }
  }
}

TEST(PrefillLayout, EveryPieceHasItsOwnPlaceInItsRow) {
  std::set<int> seen;
  for (int r = 0; r < 128; ++r) {
    for (int d = 0; d < 32; ++d) {
      const int at = sw128_piece(r, d);
      ASSERT_EQ(at % 8, 0) << r << " " << d;
      ASSERT_GE(at, 0);
      ASSERT_LT(at, 2 * kSw128Half);
      ASSERT_TRUE(seen.insert(at).second) << "row " << r << " piece " << d;
      int row = -1;
      slot_at(at, &row);
      ASSERT_EQ(row, r) << "piece " << d;
    }
  }
}

TEST(PrefillLayout, EachKStepHoldsTheDecodeKernelsDims) {
  for (int r = 0; r < 128; ++r) {
    for (int d = 0; d < 32; ++d) {
      int row = -1;
      const int slot = slot_at(sw128_piece(r, d), &row);
      for (int e = 0; e < 4; ++e) {  // the piece's 4 dims, in their slots in order
        ASSERT_EQ(decode_dim(slot + e), 4 * d + e) << "row " << r << " piece " << d;
      }
    }
  }
}

TEST(PrefillLayout, QueryFragmentsMeetTheirKeySlots) {
  for (int s = 0; s < 8; ++s) {
    for (int c4 = 0; c4 < 4; ++c4) {
      for (int hi = 0; hi < 2; ++hi) {
        const int w = sw128_query_word(s, c4, hi);
        for (int e = 0; e < 2; ++e) {
          EXPECT_EQ(2 * w + e, decode_dim(16 * s + 8 * hi + 2 * c4 + e))
              << "step " << s << " lane " << c4 << " hi " << hi;
        }
      }
    }
  }
}

TEST(PrefillLayout, TheKernelsShortcutsHold) {
  for (int r = 0; r < 128; ++r) {
    for (int m = 0; m < 4; ++m) {  // fp8 widening: dims [32 m, 32 m + 32) in four 16-byte stores
      for (int i = 0; i < 4; ++i) {  // of pieces 8 m + i and 8 m + i + 4
        EXPECT_EQ(sw128_piece(r, 8 * m + i) % 16, 0) << r << " " << m << " " << i;
        EXPECT_EQ(sw128_piece(r, 8 * m + i + 4), sw128_piece(r, 8 * m + i) + 8)
            << r << " " << m << " " << i;
      }
    }
    if (r + 16 < 128) {  // bf16 copies: a thread's rows 16 apart, 16 x 128 bytes apart
      for (int d = 0; d < 32; ++d) {
        EXPECT_EQ(sw128_piece(r + 16, d), sw128_piece(r, d) + 16 * 128) << r << " " << d;
      }
    }
  }
}

// The fp8 widening's 512 units take every (row, m) once, and the 8 lanes of each shared-memory
// phase of a 16-byte access (units 8 b .. 8 b + 7) hit 8 different bank groups in both raw loads
// (odd rows first read their second chunk) and in each of the four stores.
TEST(PrefillLayout, TheFp8WideningsUnitsCoverThePageWithoutConflicts) {
  std::set<std::pair<int, int>> units;
  for (int q0 = 0; q0 < 512; q0 += 8) {
    std::set<int> load[2], store[4];
    for (int q = q0; q < q0 + 8; ++q) {
      int r = -1, m = -1;
      sw128_widen_unit(q, &r, &m);
      ASSERT_TRUE(r >= 0 && r < 128 && m >= 0 && m < 4) << q;
      ASSERT_TRUE(units.insert({r, m}).second) << "row " << r << " m " << m << " twice";
      for (int n = 0; n < 2; ++n) {  // the loads read the unit's two raw chunks, in the page
        const int at = sw128_widen_load(r, m, n);
        ASSERT_TRUE(at >= 0 && at + 16 <= 128 * 128) << q << " " << n;
        ASSERT_EQ(at / 32, r * 4 + m) << "row " << r << " m " << m << " load " << n;
        load[n].insert(at % 128 / 16);
      }
      EXPECT_NE(sw128_widen_load(r, m, 0), sw128_widen_load(r, m, 1));
      for (int i = 0; i < 4; ++i) store[i].insert(sw128_piece(r, 8 * m + i) % 128 / 16);
    }
    for (const auto& banks : load) EXPECT_EQ(banks.size(), 8u) << "phase " << q0 / 8;
    for (const auto& banks : store) EXPECT_EQ(banks.size(), 8u) << "phase " << q0 / 8;
  }
  EXPECT_EQ(units.size(), 512u);
}

}  // namespace
