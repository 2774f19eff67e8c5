// tools/random_bits.h: the benchmarks' random bf16 data: values in +-[2^-7, 1), never zero and
// never NaN, from a SplitMix64 stream (4 values per draw). Shared by bench.cc and bench_step.cc
// so both time the same pages.
#pragma once

#include <cstdint>
#include <vector>

namespace cpidx::tools {

inline void fill_random_bf16(std::vector<uint16_t>& v, uint64_t seed) {
  uint64_t s = seed;
  for (size_t i = 0; i < v.size(); i += 4) {
    s += 0x9E3779B97F4A7C15ull;
    uint64_t z = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (size_t j = 0; j < 4 && i + j < v.size(); ++j) {
      const uint16_t r = static_cast<uint16_t>(z >> (16 * j));
      const uint16_t sign = r & 0x8000, exp = 120 + (r >> 7) % 7, mant = r & 0x7F;
      v[i + j] = static_cast<uint16_t>(sign | (exp << 7) | mant);
    }
  }
}

}  // namespace cpidx::tools
