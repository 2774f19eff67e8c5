// Exact bf16 / fp8-e4m3 conversions, cache and query loads, and the reference's work-sharing
// loop. Conversions are O(1) bit manipulation.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {

float bf16_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
float fp8e4m3_to_float(uint8_t bits) {
  const bool negative = (bits & 0x80u) != 0;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  float value;
  if (exponent == 0xF && mantissa == 0x7) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);  // (m / 8) * 2^-6
  } else {
    value = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // (1 + m/8) * 2^(e-7)
  }
  return negative ? -value : value;
}

float cache_value(const PagedCache& cache, int64_t page, int token, int dim) {
  const int64_t index = (page * kBlockSize + token) * kHeadDim + dim;
  if (cache.dtype == DType::kBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(cache.data)[index]);
  }
  return fp8e4m3_to_float(static_cast<const uint8_t*>(cache.data)[index]);
}

namespace detail {

void load_key(const PagedCache& cache, int64_t page, int token, float* out) {
  const int64_t base = (page * kBlockSize + token) * kHeadDim;
  if (cache.dtype == DType::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(cache.data) + base;
    for (int d = 0; d < kHeadDim; ++d) out[d] = bf16_to_float(src[d]);
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(cache.data) + base;
    for (int d = 0; d < kHeadDim; ++d) out[d] = fp8e4m3_to_float(src[d]);
  }
}

void load_query(const uint16_t* query, int64_t row_stride, int64_t head_stride, int64_t row,
                int head, float* out) {
  const uint16_t* src = query + row * row_stride + head * head_stride;
  for (int d = 0; d < kHeadDim; ++d) out[d] = bf16_to_float(src[d]);
}

int max_workers() {
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(std::min(hw, 64u));
}

int parallel_for(int64_t count, double work, const std::function<void(int64_t, int)>& body) {
  constexpr double kWorkPerThread = 4.0e6;  // below this a thread costs more than it saves
  int64_t workers = std::min<int64_t>(max_workers(), count);
  workers = std::min<int64_t>(workers, static_cast<int64_t>(work / kWorkPerThread) + 1);
  if (workers <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i, 0);
    return 1;
  }
  // Items are handed out from one counter, so any number of threads covers them all: a thread
  // the system refuses is one fewer. A body that throws (std::bad_alloc) stops the hand-out, and
  // the first exception is rethrown on the calling thread once every thread has joined, instead
  // of ending the process from a worker.
  std::atomic<int64_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto run = [&](int worker) {
    try {
      for (int64_t i = next++; i < count; i = next++) body(i, worker);
    } catch (...) {
      next = count;
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(static_cast<size_t>(workers - 1));
    for (int w = 1; w < workers; ++w) threads.emplace_back(run, w);
  } catch (const std::exception&) {  // std::system_error (no thread), std::bad_alloc
  }
  run(0);
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  return static_cast<int>(threads.size()) + 1;
}

}  // namespace detail
}  // namespace ref
}  // namespace cpidx
