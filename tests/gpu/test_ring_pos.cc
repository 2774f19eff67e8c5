// tests/gpu/test_ring_pos.cc: the stage ring's stepped position (src/cuda/ring_pos.h), which the
// scoring kernel's producer and consumers use for every page's barrier waits, checked on the
// host (no GPU needed, so it runs in CI): stepped from any start, it names the stage and the
// barrier parity that n % stages and (n / stages) & 1 give, for every ring size the plan picks
// and past 32-bit page counts.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/ring_pos.h"

namespace {

using cpidx::cuda::RingPos;

void expect_steps_match_division(int64_t start, int stages, int steps) {
  RingPos at(start, stages);
  for (int64_t n = start; n < start + steps; ++n, at.next(stages)) {
    ASSERT_EQ(at.st, static_cast<int>(n % stages)) << "stages " << stages << ", page " << n;
    ASSERT_EQ(at.phase, static_cast<uint32_t>((n / stages) & 1))
        << "stages " << stages << ", page " << n;
  }
}

TEST(RingPos, SteppingFromAnyStartMatchesTheDivision) {
  for (int stages = 1; stages <= 8; ++stages) {  // the plan's rings are 2-6 stages
    for (int64_t start = 0; start <= 3 * stages; ++start) {
      expect_steps_match_division(start, stages, 1000);
    }
  }
}

TEST(RingPos, PageCountsPast32Bits) {
  for (int stages : {2, 3, 5, 6}) {
    expect_steps_match_division((int64_t{1} << 32) - 7, stages, 100);
    expect_steps_match_division((int64_t{1} << 40) + 3, stages, 100);
  }
}

}  // namespace
