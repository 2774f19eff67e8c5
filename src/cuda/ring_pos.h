// src/cuda/ring_pos.h: a page's place in the scoring kernel's stage ring (score_topk.cu's
// consumers, page_producer.cuh's producer), on host and device so that CI checks it
// (tests/gpu/test_ring_pos.cc).
#pragma once

#include <cstdint>

#include "cpidx/contract.h"

namespace cpidx {
namespace cuda {

// The n-th page through a ring of `stages` stages sits in stage n % stages, and its stage's
// barriers are on phase parity (n / stages) & 1 (the full barrier's; the empty barrier's is the
// other one). Stepped once per page, so the page loops carry no 64-bit division by the stage
// count: it was ~25 dependent instructions a page before each wait (docs/perf/README.md, v31b).
struct RingPos {
  int st;
  uint32_t phase;
  CPIDX_HD explicit RingPos(int64_t n, int stages)
      : st(static_cast<int>(n % stages)), phase(static_cast<uint32_t>((n / stages) & 1)) {}
  CPIDX_HD void next(int stages) {
    if (++st == stages) {
      st = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace cuda
}  // namespace cpidx
