// src/cuda/k_steps.h: which 16 of a key row's 128 dims each tensor-core k-step of a score sums,
// one grouping for every scoring kernel (the decode kernel at every width and dtype, both
// prefill kernels), so that their fp32 scores are equal bit for bit (CONTRACT.md section 4).
#pragma once

#include "cpidx/contract.h"

namespace cpidx {
namespace cuda {

// A dot product of 128 dims is 8 k-steps s = 2 j + h (j 0..3, h 0..1), summed in that order into
// one fp32 accumulator. In an m16n8k16 fragment lane c4 (0..3) of a quad holds, for chunk j, the 8
// dims [kstep_dim(j, c4), + 8): the first 4 feed step (j, 0), the last 4 step (j, 1). So step
// (j, h) sums the dims {kstep_dim(j, c) + 4 h + e : c, e in 0..3}.
//
// A step's fp32 result depends on which 16 products share it, not on their order inside it
// (bench/probes/mma_k_order.cu, bf16 mma.sync: 44% of sums changed with another grouping, none
// with another order; for the fp16 MMAs of fp8 pages and for wgmma, GpuPrefill.SameIds-
// AsEachTokensDecode shows it), so every kernel takes these sets in this order, each lane's
// share of a step where its loads fit. The grouping is the one a 16-byte fp8
// key load gives (lane c4's 16 bytes at 64 l + 16 c4 are chunks 2 l and 2 l + 1); a 16-byte bf16
// load of a chunk (8 dims) and an 8-byte fp8 load fit it too.
CPIDX_HD constexpr int kstep_dim(int j, int c4) { return 64 * (j >> 1) + 16 * c4 + 8 * (j & 1); }
static_assert(kstep_dim(1, 3) == kstep_dim(0, 3) + 8 && kstep_dim(3, 2) == kstep_dim(2, 2) + 8,
              "a 16-byte fp8 load of lane c4 holds its chunks 2 l and 2 l + 1");
static_assert(kstep_dim(3, 3) + 8 == 128, "the chunks cover the 128 dims");

}  // namespace cuda
}  // namespace cpidx
