// tools/synthetic.cc: builds the demo's decode step. Every page and every query row draws from
// its own SplitMix64 stream (Box-Muller normals), so the data are a function of the seed only and
// the pages can be filled on several threads. ~1 s for the default 128 MiB cache on one core.
#include "synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

namespace cpidx::tools {
namespace {

// Independent stream ids: the seed mixed with a tag and an index.
uint64_t stream_seed(uint64_t seed, uint64_t tag, uint64_t index) {
  SplitMix64 mix(seed ^ (tag * 0xD1B54A32D192ED03ull) ^ (index * 0x9E3779B97F4A7C15ull));
  return mix.next();
}

// Fills out[0, count) with standard normals (Box-Muller, both outputs used).
void normals(SplitMix64& rng, float* out, int64_t count) {
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < count; i += 2) {
    const double u1 = 1.0 - rng.uniform();  // (0, 1]: log stays finite
    const double u2 = rng.uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (i + 1 < count) out[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
  }
}

// The positive finite e4m3 values in code order (codes 0x00..0x7E; 0x7F is NaN).
struct Fp8Table {
  float value[127];
  Fp8Table() {
    for (int code = 0; code < 127; ++code) {
      const int exp = code >> 3, man = code & 7;
      value[code] = exp == 0 ? std::ldexp(static_cast<float>(man), -9)
                             : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
    }
  }
};

// Runs body(i) for i in [0, count) on `threads` threads (0 = all cores), in contiguous ranges.
template <typename Body>
void parallel_for(int64_t count, int threads, const Body& body) {
  int n = threads > 0 ? threads
                      : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n = static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(count, 1)));
  std::vector<std::thread> pool;
  for (int t = 0; t < n; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = count * t / n; i < count * (t + 1) / n; ++i) body(i);
    });
  }
  for (std::thread& th : pool) th.join();
}

}  // namespace

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint8_t to_fp8e4m3(float f) {
  static const Fp8Table table;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (!(a < table.value[126])) return sign | 0x7E;  // saturate (and NaN) to the largest, 448
  // First code whose value is >= a, then the nearer of it and its predecessor (ties to even).
  const float* first_not_below = std::lower_bound(table.value, table.value + 127, a);
  const int hi = static_cast<int>(first_not_below - table.value);
  if (hi == 0) return sign;
  const int lo = hi - 1;
  const float dlo = a - table.value[lo], dhi = table.value[hi] - a;
  const int code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint8_t>(sign | code);
}

DecodeInputs SyntheticStep::for_heads(int head_offset, int num_heads) const {
  DecodeInputs in;
  const int64_t T = config.total_heads;
  in.query = query.data() + static_cast<int64_t>(head_offset) * kHeadDim;
  in.q_row_stride = T * kHeadDim;
  in.q_head_stride = kHeadDim;
  in.num_heads = num_heads;
  in.cache.data = cache.data();
  in.cache.dtype = config.cache_dtype;
  in.cache.num_pages = num_pages;
  in.block_table = block_table.data();
  in.bt_row_stride = max_blocks;
  in.seq_lens = seq_lens.data();
  in.num_reqs = config.num_reqs;
  in.query_len = config.query_len;
  in.max_seq_len = config.context;
  in.scale = scale;
  return in;
}

SyntheticStep build_synthetic_step(const SyntheticConfig& config) {
  SyntheticStep step;
  step.config = config;
  step.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  const int32_t spread = std::min<int32_t>(kBlockSize, std::max<int32_t>(config.context, 1));

  // seq_lens uniform in (context - 128, context].
  SplitMix64 lens(stream_seed(config.seed, 1, 0));
  step.seq_lens.resize(static_cast<size_t>(config.num_reqs));
  for (int32_t& s : step.seq_lens) {
    s = config.context - static_cast<int32_t>(lens.next() % static_cast<uint64_t>(spread));
  }

  // Each request's pages, drawn from one shuffled permutation of the whole cache.
  step.max_blocks = cdiv(config.context, kBlockSize);
  for (int32_t s : step.seq_lens) step.num_pages += cdiv(s, kBlockSize);
  std::vector<int32_t> pages(static_cast<size_t>(step.num_pages));
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<int32_t>(i);
  SplitMix64 shuffle(stream_seed(config.seed, 2, 0));
  for (size_t i = pages.size(); i > 1; --i) {
    std::swap(pages[i - 1], pages[static_cast<size_t>(shuffle.next() % i)]);
  }
  step.block_table.assign(static_cast<size_t>(config.num_reqs * step.max_blocks), 0);
  size_t next_page = 0;
  for (int req = 0; req < config.num_reqs; ++req) {
    const int64_t blocks = cdiv(step.seq_lens[static_cast<size_t>(req)], kBlockSize);
    for (int64_t b = 0; b < blocks; ++b) {
      step.block_table[static_cast<size_t>(req * step.max_blocks + b)] = pages[next_page++];
    }
  }

  // The cache: one stream per page, normals never rounded to zero (the smallest value instead).
  const int64_t page_elems = int64_t{kBlockSize} * kHeadDim;
  const int elem_bytes = dtype_bytes(config.cache_dtype);
  step.cache.resize(static_cast<size_t>(step.num_pages * page_elems * elem_bytes));
  parallel_for(step.num_pages, config.threads, [&](int64_t page) {
    std::vector<float> values(static_cast<size_t>(page_elems));
    SplitMix64 rng(stream_seed(config.seed, 3, static_cast<uint64_t>(page)));
    normals(rng, values.data(), page_elems);
    uint8_t* base = step.cache.data() + page * page_elems * elem_bytes;
    for (int64_t i = 0; i < page_elems; ++i) {
      const float v = values[static_cast<size_t>(i)];
      if (config.cache_dtype == DType::kBF16) {
        uint16_t bits = to_bf16(v);
        if ((bits & 0x7FFF) == 0) bits |= 0x0080;  // +-smallest normal bf16
        std::memcpy(base + 2 * i, &bits, 2);
      } else {
        uint8_t bits = to_fp8e4m3(v);
        if ((bits & 0x7F) == 0) bits |= 0x01;  // +-smallest subnormal e4m3
        base[i] = bits;
      }
    }
  });

  // Queries [n, T, D]: one stream per row.
  const int64_t row_elems = int64_t{config.total_heads} * kHeadDim;
  step.query.resize(static_cast<size_t>(step.num_rows() * row_elems));
  std::vector<float> values(static_cast<size_t>(row_elems));
  for (int64_t row = 0; row < step.num_rows(); ++row) {
    SplitMix64 rng(stream_seed(config.seed, 4, static_cast<uint64_t>(row)));
    normals(rng, values.data(), row_elems);
    for (int64_t i = 0; i < row_elems; ++i) {
      uint16_t bits = to_bf16(values[static_cast<size_t>(i)]);
      if ((bits & 0x7FFF) == 0) bits |= 0x0080;
      step.query[static_cast<size_t>(row * row_elems + i)] = bits;
    }
  }
  return step;
}

}  // namespace cpidx::tools
