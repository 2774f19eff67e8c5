// fuzz/fuzz_reference.cc: libFuzzer target over the host validation and the CPU reference.
// Each input describes a tiny decode batch (shapes, strides, lengths, pages, values, K / init /
// local, scale, dtype, layouts of the outputs) plus a set of deliberate host-visible mistakes and
// device-side bad values. Invariants, checked by abort() so libFuzzer records the input:
//  - no crash, no out-of-bounds access, no undefined behaviour (built with ASan + UBSan);
//  - a call with a host mistake fails, names one of the mistaken arguments, writes nothing and
//    raises no error bit; a call without one succeeds;
//  - on success the ids equal a brute force of CONTRACT.md sections 3-4 on the clamped inputs
//    (so: distinct, in [0, V), -1 after min(K, V), forced blocks present unless something
//    scores above them), gaps of strided outputs stay untouched, the error bits are exactly
//    those of the bad device values, the sparse table rows hold only pages of selected blocks;
//  - the context-parallel decode over thread communicators at a random valid P equals the
//    plain decode bit for bit, error bits included; prefill and a merge of garbage keys hold
//    the same kind of invariants.
// Cost per input: at most a few million multiply-adds (max_seq_len <= 640, n <= 16, T <= 8).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/params.h"
#include "cpidx/reference.h"

namespace {

using cpidx::DType;
using cpidx::Key;
using cpidx::Status;
constexpr int kD = cpidx::kHeadDim;
constexpr int kBS = cpidx::kBlockSize;
constexpr int32_t kPoison = 0x7B7B7B7B;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "cpidx fuzz invariant broken: %s\n", what.c_str());
  std::abort();
}
#define FUZZ_CHECK(cond, msg)           \
  do {                                  \
    if (!(cond)) {                      \
      std::ostringstream fuzz_os_;      \
      fuzz_os_ << #cond << ": " << msg; \
      fail(fuzz_os_.str());             \
    }                                   \
  } while (0)

// Bulk values from a seed: SplitMix64.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// Misaligned by one byte (never dereferenced: validation must reject it first). Idempotent: a
// second mistake on the same argument must not shift it back onto an aligned, in-bounds-looking
// address one element past the buffer (a harness bug the fuzzer found, not a library one).
template <typename T>
T* misalign(T* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return a % 2 ? p : reinterpret_cast<T*>(a + 1);
}

// The mistakes injected into one call, by the argument names a message may carry.
struct Mistakes {
  std::vector<std::string> names;
  void add(const char* n) { names.emplace_back(n); }
  bool any() const { return !names.empty(); }
  void expect(const Status& s, const char* where) const {
    if (!any()) {
      FUZZ_CHECK(s.is_ok(), where << " rejected valid input: " << s.to_string());
      return;
    }
    FUZZ_CHECK(!s.is_ok(), where << " accepted input with a mistake in " << names[0]);
    FUZZ_CHECK(s.code() == cpidx::StatusCode::kInvalidArgument ||
                   s.code() == cpidx::StatusCode::kUnsupported,
               where << ": unexpected code " << s.to_string());
    bool named = false;
    for (const auto& n : names) named = named || s.message().find(n) != std::string::npos;
    FUZZ_CHECK(named, where << ": message names none of the mistaken arguments (first: " << names[0]
                            << "): " << s.message());
  }
};

float bf16(uint16_t b) { return cpidx::ref::bf16_to_float(b); }

// One tiny decode batch, its buffers sized exactly by its strides (so ASan sees any overrun).
struct Batch {
  int T = 1, Q = 1, reqs = 1;
  int32_t max_seq_len = 1;
  DType dtype = DType::kBF16;
  int64_t num_pages = 1;
  std::vector<uint16_t> query;
  int64_t q_row = 0, q_head = 0;
  std::vector<uint16_t> cache16;
  std::vector<uint8_t> cache8;
  std::vector<int32_t> block_table;
  int64_t bt_stride = 0;
  std::vector<int32_t> seq_lens;
  float scale = 1.0f;
  cpidx::Selection sel;

  int64_t rows() const { return int64_t{reqs} * Q; }
  int64_t blocks() const { return cpidx::cdiv(max_seq_len, kBS); }
  cpidx::DecodeInputs inputs(int head_begin, int heads) const {
    cpidx::DecodeInputs in;
    in.query = query.data() + head_begin * q_head;
    in.q_row_stride = q_row;
    in.q_head_stride = q_head;
    in.num_heads = heads;
    in.cache.data = dtype == DType::kBF16 ? static_cast<const void*>(cache16.data())
                                          : static_cast<const void*>(cache8.data());
    in.cache.dtype = dtype;
    in.cache.num_pages = num_pages;
    in.block_table = block_table.data();
    in.bt_row_stride = bt_stride;
    in.seq_lens = seq_lens.data();
    in.num_reqs = reqs;
    in.query_len = Q;
    in.max_seq_len = max_seq_len;
    in.scale = scale;
    return in;
  }
  std::vector<float> keys;  // the cache decoded once, for the brute force
  void decode_keys() {
    keys.resize(dtype == DType::kBF16 ? cache16.size() : cache8.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      keys[i] = dtype == DType::kBF16 ? bf16(cache16[i]) : cpidx::ref::fp8e4m3_to_float(cache8[i]);
    }
  }
  const float* key(int64_t page, int64_t token) const {
    return keys.data() + (page * kBS + token) * kD;
  }
  int32_t clamped_seq(int req) const {
    return std::clamp(seq_lens[static_cast<size_t>(req)], 0, max_seq_len);
  }
  int64_t page(int req, int64_t b) const {
    const int64_t raw = block_table[static_cast<size_t>(req * bt_stride + b)];
    return std::clamp<int64_t>(raw, 0, num_pages - 1);
  }
  // The device-error bits a correct implementation raises.
  int32_t expected_err() const {
    int32_t e = 0;
    for (int r = 0; r < reqs; ++r) {
      const int32_t s = seq_lens[static_cast<size_t>(r)];
      if (s < 0 || s > max_seq_len) e |= cpidx::kErrSeqLenOutOfRange;
      const int64_t v = cpidx::visible_blocks(int64_t{clamped_seq(r)} - 1);
      for (int64_t b = 0; b < v; ++b) {
        const int32_t p = block_table[static_cast<size_t>(r * bt_stride + b)];
        if (p < 0 || p >= num_pages) e |= cpidx::kErrPageOutOfRange;
      }
    }
    return e;
  }
};

// Brute force of sections 3-4 for head h at position pos of request req over a query vector.
void brute_row(const Batch& b, const uint16_t* q, int req, int64_t pos, const cpidx::Selection& sel,
               int32_t* out) {
  const int64_t V = cpidx::visible_blocks(pos);
  float qf[kD];
  for (int d = 0; d < kD; ++d) qf[d] = bf16(q[d]);
  std::vector<std::pair<float, int64_t>> s;
  for (int64_t blk = 0; blk < V; ++blk) {
    const int64_t page = b.page(req, blk);
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t p = blk * kBS; p <= std::min(pos, blk * kBS + kBS - 1); ++p) {
      const float* k = b.key(page, p % kBS);
      float acc = 0.0f;
      for (int d = 0; d < kD; ++d) acc += qf[d] * k[d];
      if (acc > best) best = acc;
    }
    float score = b.scale * best;
    FUZZ_CHECK(!std::isnan(score), "a block score is NaN");
    if (blk < sel.init_blocks) score = cpidx::kInitScore;
    if (blk >= std::max<int64_t>(0, V - sel.local_blocks)) score = cpidx::kLocalScore;
    s.emplace_back(score == 0.0f ? 0.0f : score, blk);
  }
  std::sort(s.begin(), s.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first > y.first : x.second > y.second;
  });
  for (int i = 0; i < sel.topk; ++i) {
    out[i] = i < static_cast<int>(s.size()) ? static_cast<int32_t>(s[static_cast<size_t>(i)].second)
                                            : -1;
  }
}

// Ids [heads, n, K] in a random legal layout with gaps; the rest of the buffer stays poisoned.
struct IdsOut {
  std::vector<int32_t> buf;
  cpidx::TopkOutput out;
  int heads = 0;
  int64_t rows = 0;
  int k = 0;
  IdsOut(FuzzedDataProvider& fdp, int heads_, int64_t rows_, int k_)
      : heads(heads_), rows(rows_), k(std::max(k_, 1)) {
    const int gap_inner = fdp.ConsumeIntegralInRange(0, 3);
    const int gap_outer = fdp.ConsumeIntegralInRange(0, 5);
    if (fdp.ConsumeBool()) {  // [heads, n, K]
      out.row_stride = k + gap_inner;
      out.head_stride = rows * out.row_stride + gap_outer;
    } else {  // [n, heads, K]
      out.head_stride = k + gap_inner;
      out.row_stride = heads * out.head_stride + gap_outer;
    }
    const int64_t last = (heads - 1) * out.head_stride + (rows - 1) * out.row_stride + k;
    buf.assign(static_cast<size_t>(std::max<int64_t>(last, 1)), kPoison);
    out.ids = buf.data();
  }
  const int32_t* at(int h, int64_t r) const {
    return buf.data() + h * out.head_stride + r * out.row_stride;
  }
  bool untouched() const {
    return std::all_of(buf.begin(), buf.end(), [](int32_t v) { return v == kPoison; });
  }
  // Every slot outside the [heads, n, K] lists still poisoned.
  bool gaps_untouched() const {
    std::vector<bool> used(buf.size(), false);
    for (int h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int i = 0; i < k; ++i) used[static_cast<size_t>(at(h, r) - buf.data() + i)] = true;
      }
    }
    for (size_t i = 0; i < buf.size(); ++i) {
      if (!used[i] && buf[i] != kPoison) return false;
    }
    return true;
  }
};

template <typename T>
T pick(FuzzedDataProvider& fdp, std::initializer_list<T> values) {
  return *(values.begin() + fdp.ConsumeIntegralInRange<size_t>(0, values.size() - 1));
}

// A bf16 / fp8 value: small integers (many ties), a spread of magnitudes, or raw bits (NaN,
// inf, denormals, huge values).
uint16_t draw16(Rng& rng, int mode) {
  switch (mode == 3 ? static_cast<int>(rng.below(3)) : mode) {
    case 0:
      return cpidx::ref::float_to_bf16(static_cast<float>(rng.below(5) - 2));
    case 1:
      return static_cast<uint16_t>(0x3C00 + rng.below(0x0800)) ^ (rng.below(2) ? 0x8000 : 0);
    default:
      return static_cast<uint16_t>(rng.next());
  }
}
uint8_t draw8(Rng& rng, int mode) {
  static const uint8_t small[5] = {0xC0, 0xB8, 0x00, 0x38, 0x40};  // -2 -1 0 1 2
  switch (mode == 3 ? static_cast<int>(rng.below(3)) : mode) {
    case 0:
      return small[rng.below(5)];
    case 1:
      return static_cast<uint8_t>(0x20 + rng.below(0x30)) ^ (rng.below(2) ? 0x80 : 0);
    default:
      return static_cast<uint8_t>(rng.next());
  }
}

Batch make_batch(FuzzedDataProvider& fdp) {
  Batch b;
  b.T = fdp.ConsumeIntegralInRange(1, 8);
  b.Q = fdp.ConsumeIntegralInRange(1, 8);
  b.reqs = fdp.ConsumeIntegralInRange(1, std::max(1, 16 / b.Q));
  b.max_seq_len = fdp.ConsumeIntegralInRange(1, 520);
  b.dtype = fdp.ConsumeBool() ? DType::kFP8E4M3 : DType::kBF16;
  b.num_pages = fdp.ConsumeIntegralInRange(1, 8);
  b.sel.topk =
      fdp.ConsumeBool() ? fdp.ConsumeIntegralInRange(1, 64) : fdp.ConsumeIntegralInRange(1, 8);
  b.sel.init_blocks = fdp.ConsumeIntegralInRange(0, 3);
  b.sel.local_blocks = fdp.ConsumeIntegralInRange(0, 3);
  b.scale =
      pick(fdp, {0.0883883f, 1.0f, 1e-30f, 3.0e38f, std::numeric_limits<float>::denorm_min()});
  const int64_t n = b.rows();
  const int gap_head = fdp.ConsumeIntegralInRange(0, 8), gap_row = fdp.ConsumeIntegralInRange(0, 8);
  if (fdp.ConsumeBool()) {  // [n, T, D] with gaps
    b.q_head = kD + gap_head;
    b.q_row = b.T * b.q_head + gap_row;
  } else {  // [T, n, D] with gaps
    b.q_row = kD + gap_row;
    b.q_head = n * b.q_row + gap_head;
  }
  Rng rng{fdp.ConsumeIntegral<uint64_t>()};
  const int mode = fdp.ConsumeIntegralInRange(0, 3);
  b.query.resize(static_cast<size_t>((n - 1) * b.q_row + (b.T - 1) * b.q_head + kD));
  for (auto& q : b.query) q = draw16(rng, mode == 2 ? 3 : mode);  // raw bits only mixed in
  const size_t cache_elems = static_cast<size_t>(b.num_pages) * kBS * kD;
  if (b.dtype == DType::kBF16) {
    b.cache16.resize(cache_elems);
    for (auto& k : b.cache16) k = draw16(rng, mode);
  } else {
    b.cache8.resize(cache_elems);
    for (auto& k : b.cache8) k = draw8(rng, mode);
  }
  // A few special values at chosen places: NaN, +-inf, the largest finite, -0.
  const int specials = fdp.ConsumeIntegralInRange(0, 6);
  for (int i = 0; i < specials; ++i) {
    const uint16_t v = pick<uint16_t>(fdp, {0x7FC0, 0x7F80, 0xFF80, 0x7F7F, 0x8000, 0xFFFF});
    if (fdp.ConsumeBool()) {
      b.query[fdp.ConsumeIntegralInRange<size_t>(0, b.query.size() - 1)] = v;
    } else if (b.dtype == DType::kBF16) {
      const size_t at = fdp.ConsumeIntegralInRange<size_t>(0, cache_elems - 1);
      if (fdp.ConsumeBool()) {
        b.cache16[at] = v;
      } else {  // a whole key
        std::fill_n(b.cache16.begin() + static_cast<std::ptrdiff_t>(at / kD * kD), kD, v);
      }
    } else {
      b.cache8[fdp.ConsumeIntegralInRange<size_t>(0, cache_elems - 1)] =
          pick<uint8_t>(fdp, {0x7F, 0xFF});
    }
  }
  b.decode_keys();
  // Block table and lengths, with device-side bad values now and then.
  const int64_t G = b.blocks();
  b.bt_stride = G + fdp.ConsumeIntegralInRange(0, 2);
  const bool bad_pages = fdp.ConsumeIntegralInRange(0, 3) == 0;
  b.block_table.resize(static_cast<size_t>(b.reqs * b.bt_stride));
  for (auto& e : b.block_table) {
    e = static_cast<int32_t>(rng.below(b.num_pages));
    if (bad_pages && rng.below(4) == 0) {
      const int32_t picks[5] = {
          -1, static_cast<int32_t>(b.num_pages), std::numeric_limits<int32_t>::min(),
          std::numeric_limits<int32_t>::max(), static_cast<int32_t>(rng.next())};
      e = picks[rng.below(5)];
    }
  }
  const bool bad_lens = fdp.ConsumeIntegralInRange(0, 3) == 0;
  b.seq_lens.resize(static_cast<size_t>(b.reqs));
  for (auto& s : b.seq_lens) {
    switch (fdp.ConsumeIntegralInRange(0, 3)) {
      case 0:
        s = 0;
        break;
      case 1:
        s = b.max_seq_len;
        break;
      default:
        s = fdp.ConsumeIntegralInRange<int32_t>(0, b.max_seq_len);
    }
    if (bad_lens && fdp.ConsumeBool()) {
      s = pick<int32_t>(fdp, {-1, b.max_seq_len + 1, std::numeric_limits<int32_t>::min(),
                              std::numeric_limits<int32_t>::max()});
    }
  }
  return b;
}

// Optional page-16 sparse table outputs, exact sizes.
struct TableOut {
  std::vector<int32_t> attn, table, ctx;
  cpidx::SparseTableOutput t;
  TableOut(const Batch& b, int page_stride, Rng& rng,
           const std::vector<int32_t>* same_attn = nullptr) {
    const int64_t n = b.rows(), G = b.blocks();
    attn.resize(static_cast<size_t>(b.reqs * G));
    for (auto& a : attn) a = static_cast<int32_t>(rng.below(1000));
    if (same_attn != nullptr) attn = *same_attn;
    table.assign(static_cast<size_t>(n * b.sel.topk * 8), kPoison);
    ctx.assign(static_cast<size_t>(n), kPoison);
    t = {attn.data(), G, table.data(), int64_t{b.sel.topk} * 8, ctx.data(), page_stride};
  }
  bool untouched() const {
    auto p = [](int32_t v) { return v == kPoison; };
    return std::all_of(table.begin(), table.end(), p) && std::all_of(ctx.begin(), ctx.end(), p);
  }
  // Each row: the pages of blocks <= the row's own block, each block's 8 pages in order, then
  // zeros; the context length within [0, pos + 1] (ids from a decode are distinct), or within
  // [0, K * 128] for arbitrary ids (duplicates count twice).
  void check(const Batch& b, const char* where, bool distinct_ids) const {
    const int64_t n = b.rows(), width = int64_t{b.sel.topk} * 8;
    for (int64_t row = 0; row < n; ++row) {
      const int req = static_cast<int>(row / b.Q);
      const int64_t pos = int64_t{b.clamped_seq(req)} - b.Q + row % b.Q;
      const int32_t c = ctx[static_cast<size_t>(row)];
      const int64_t bound =
          distinct_ids ? std::max<int64_t>(pos + 1, 0) : int64_t{b.sel.topk} * kBS;
      FUZZ_CHECK(c >= 0 && c <= bound, where << " context length " << c << " above " << bound);
      const int32_t* r = table.data() + row * width;
      bool zeros = false;
      for (int64_t slot = 0; slot < b.sel.topk; ++slot) {
        const int32_t first = r[slot * 8];
        if (first == 0 &&
            std::all_of(r + slot * 8, r + slot * 8 + 8, [](int32_t v) { return v == 0; })) {
          zeros = true;
          continue;
        }
        FUZZ_CHECK(!zeros, where << " a block after the zero tail");
        bool known = false;
        for (int64_t blk = 0; blk <= pos / kBS && !known; ++blk) {
          known =
              int64_t{attn[static_cast<size_t>(req * b.blocks() + blk)]} * t.block_page_stride ==
              first;
        }
        FUZZ_CHECK(known, where << " page " << first << " of no visible block");
        for (int j = 1; j < 8; ++j) FUZZ_CHECK(r[slot * 8 + j] == first + j, where << " page run");
      }
    }
  }
};

// Applies up to three host-visible mistakes to a decode call, recording the argument names.
void inject(FuzzedDataProvider& fdp, const Batch& b, cpidx::DecodeInputs& in, cpidx::Selection& sel,
            cpidx::TopkOutput& out, TableOut& table, bool& table_on, Mistakes& m) {
  if (fdp.ConsumeIntegralInRange(0, 3) != 0) return;
  const float inf = std::numeric_limits<float>::infinity();
  const int count = fdp.ConsumeIntegralInRange(1, 3);
  const int64_t n = b.rows();
  for (int i = 0; i < count; ++i) {
    switch (fdp.ConsumeIntegralInRange(0, 19)) {
      case 0:
        sel.topk = pick(fdp, {0, -1, 65, std::numeric_limits<int>::max()});
        m.add("topk");
        break;
      case 1:
        sel.init_blocks = pick(fdp, {-1, std::numeric_limits<int>::min()});
        m.add("init_blocks");
        break;
      case 2:
        sel.local_blocks = -1;
        m.add("local_blocks");
        break;
      case 3:
        in.query_len = pick(fdp, {0, 9, -1});
        m.add("query_len");
        break;
      case 4:
        in.num_reqs = pick(fdp, {0, -1});
        m.add("num_reqs");
        break;
      case 5:
        in.max_seq_len = pick(fdp, {0, -1, std::numeric_limits<int32_t>::min()});
        m.add("max_seq_len");
        break;
      case 6:
        in.scale = pick(fdp, {0.0f, -0.0f, -1.0f, inf, -inf, std::nanf("")});
        m.add("scale");
        break;
      case 7:
        in.num_heads = pick(fdp, {0, 9, -1});
        m.add("num_heads");
        break;
      case 8:
        if (b.T > 1) {
          in.q_head_stride = pick<int64_t>(fdp, {0, 127, -128});
          m.add("q_head_stride");
        }
        break;
      case 9:
        if (n > 1) {
          in.q_row_stride = pick<int64_t>(fdp, {0, 64, -1});
          m.add("q_row_stride");
        }
        break;
      case 10:
        in.query = fdp.ConsumeBool() ? nullptr : misalign(in.query);
        m.add("query");
        break;
      case 11:
        if (b.dtype == DType::kBF16 && fdp.ConsumeBool()) {
          in.cache.data = misalign(static_cast<const char*>(in.cache.data));
        } else {
          in.cache.data = nullptr;
        }
        m.add("cache");
        break;
      case 12:
        in.cache.num_pages = pick<int64_t>(fdp, {0, -5});
        m.add("num_pages");
        break;
      case 13:
        in.cache.dtype = static_cast<DType>(pick(fdp, {2, 7, -1}));
        m.add("dtype");
        break;
      case 14:
        in.block_table = fdp.ConsumeBool() ? nullptr : misalign(in.block_table);
        m.add("block_table");
        break;
      case 15:
        if (b.reqs > 1) {
          in.bt_row_stride = pick<int64_t>(fdp, {b.blocks() - 1, -1});
          m.add("bt_row_stride");
        }
        break;
      case 16:
        in.seq_lens = fdp.ConsumeBool() ? nullptr : misalign(in.seq_lens);
        m.add("seq_lens");
        break;
      case 17:
        out.ids = fdp.ConsumeBool() ? nullptr : misalign(out.ids);
        m.add("ids");
        break;
      case 18:
        if (n > 1) {
          out.row_stride = -1;
          m.add("ids");
        } else if (b.T > 1) {
          out.head_stride = -1;
          m.add("ids");
        }
        break;
      default:
        if (!table_on) {
          if (b.T > 1) {  // a sparse table with several heads
            table_on = true;
            m.add("local_heads");
          }
          break;
        }
        switch (fdp.ConsumeIntegralInRange(0, 4)) {
          case 0:
            table.t.context_lens = nullptr;
            m.add("attention_block_table");
            break;
          case 1:
            table.t.block_page_stride = pick(fdp, {0, 12, -8});
            m.add("block_page_stride");
            break;
          case 2:
            if (n > 1) {
              table.t.table_row_stride = b.sel.topk * 8 - 1;
              m.add("table_row_stride");
            }
            break;
          case 3:
            if (b.reqs > 1) {
              table.t.attn_bt_row_stride = b.blocks() - 1;
              m.add("attn_bt_row_stride");
            }
            break;
          default:
            table.t.table = misalign(table.t.table);
            m.add("attention_block_table");
            break;
        }
    }
  }
}

// The plain decode's expected ids, [T][n][K] dense.
std::vector<int32_t> brute_decode(const Batch& b) {
  const int64_t n = b.rows();
  const int K = b.sel.topk;
  std::vector<int32_t> want(static_cast<size_t>(b.T * n * K));
  for (int h = 0; h < b.T; ++h) {
    for (int64_t row = 0; row < n; ++row) {
      const int req = static_cast<int>(row / b.Q);
      const int64_t pos = int64_t{b.clamped_seq(req)} - b.Q + row % b.Q;
      brute_row(b, b.query.data() + row * b.q_row + h * b.q_head, req, pos, b.sel,
                want.data() + (h * n + row) * K);
    }
  }
  return want;
}

void check_ids(const IdsOut& ids, const std::vector<int32_t>& want, int head_begin,
               const char* where) {
  FUZZ_CHECK(ids.gaps_untouched(), where << " wrote outside the id lists");
  for (int h = 0; h < ids.heads; ++h) {
    for (int64_t row = 0; row < ids.rows; ++row) {
      const int32_t* got = ids.at(h, row);
      const int32_t* exp = want.data() + ((head_begin + h) * ids.rows + row) * ids.k;
      for (int i = 0; i < ids.k; ++i) {
        FUZZ_CHECK(got[i] == exp[i], where << " head " << head_begin + h << " row " << row
                                           << " slot " << i << ": " << got[i] << " != " << exp[i]);
      }
    }
  }
}

// The context-parallel decode on P thread ranks must equal the plain decode, error bits too.
void check_cp(FuzzedDataProvider& fdp, const Batch& b, const std::vector<int32_t>& want,
              int32_t want_err, bool with_table, const TableOut* plain_table) {
  std::vector<int> worlds;
  for (int p = 1; p <= 8; ++p) {
    cpidx::Geometry g;
    if (cpidx::make_geometry(b.T, p, 0, &g).is_ok()) worlds.push_back(p);
  }
  const int P = worlds[fdp.ConsumeIntegralInRange<size_t>(0, worlds.size() - 1)];
  auto comms = cpidx::make_thread_communicators(P);
  std::vector<cpidx::Geometry> geos(static_cast<size_t>(P));
  std::vector<std::unique_ptr<IdsOut>> ids;
  std::vector<std::unique_ptr<TableOut>> tables;
  Rng rng{7};
  for (int r = 0; r < P; ++r) {
    cpidx::make_geometry(b.T, P, r, &geos[static_cast<size_t>(r)]);
    ids.push_back(std::make_unique<IdsOut>(fdp, geos[static_cast<size_t>(r)].local_heads, b.rows(),
                                           b.sel.topk));
    tables.push_back(with_table ? std::make_unique<TableOut>(b, plain_table->t.block_page_stride,
                                                             rng, &plain_table->attn)
                                : nullptr);
  }
  std::vector<Status> st(static_cast<size_t>(P));
  std::vector<int32_t> errs(static_cast<size_t>(P), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<size_t>(r);
      const cpidx::Geometry& g = geos[i];
      st[i] = cpidx::ref::cp_decode(*comms[i], g, b.inputs(g.head_offset, g.local_heads), b.sel,
                                    ids[i]->out, with_table ? &tables[i]->t : nullptr, &errs[i]);
    });
  }
  for (auto& t : threads) t.join();
  int32_t err = 0;
  for (int r = 0; r < P; ++r) {
    const auto i = static_cast<size_t>(r);
    FUZZ_CHECK(st[i].is_ok(), "cp_decode P=" << P << " rank " << r << ": " << st[i].to_string());
    check_ids(*ids[i], want, geos[i].head_offset, "cp_decode");
    if (with_table) {
      FUZZ_CHECK(tables[i]->table == plain_table->table && tables[i]->ctx == plain_table->ctx,
                 "cp_decode P=" << P << " rank " << r << ": sparse table differs from plain");
    }
    err |= errs[i];
  }
  FUZZ_CHECK(err == want_err, "cp_decode error bits " << err << ", plain " << want_err);
}

// Prefill over the same cache and block table: lengths and cu_seqlens_q possibly bad.
void check_prefill(FuzzedDataProvider& fdp, const Batch& b) {
  const int heads = fdp.ConsumeIntegralInRange(1, b.T);
  const int64_t tokens = fdp.ConsumeIntegralInRange(1, 16);
  const int reqs = b.reqs;
  Rng rng{fdp.ConsumeIntegral<uint64_t>()};
  std::vector<uint16_t> query(static_cast<size_t>(tokens * heads * kD));
  for (auto& q : query) q = draw16(rng, 0);
  std::vector<int32_t> cu(static_cast<size_t>(reqs) + 1, 0), ctx(static_cast<size_t>(reqs)),
      seq(ctx.size());
  for (int r = 1; r <= reqs; ++r) {
    cu[static_cast<size_t>(r)] =
        fdp.ConsumeIntegralInRange<int32_t>(-2, static_cast<int32_t>(tokens) + 2);
  }
  for (int r = 0; r < reqs; ++r) {
    ctx[static_cast<size_t>(r)] = fdp.ConsumeIntegralInRange<int32_t>(-3, b.max_seq_len + 3);
    seq[static_cast<size_t>(r)] = fdp.ConsumeIntegralInRange<int32_t>(-3, b.max_seq_len + 3);
  }
  cpidx::PrefillInputs in;
  in.query = query.data();
  in.q_row_stride = int64_t{heads} * kD;
  in.q_head_stride = kD;
  in.num_heads = heads;
  in.cache = b.inputs(0, 1).cache;
  in.block_table = b.block_table.data();
  in.bt_row_stride = b.bt_stride;
  in.cu_seqlens_q = cu.data();
  in.context_lens = ctx.data();
  in.seq_lens = seq.data();
  in.num_reqs = reqs;
  in.num_tokens = tokens;
  in.max_seq_len = b.max_seq_len;
  in.scale = b.scale;
  IdsOut ids(fdp, heads, tokens, b.sel.topk);
  int32_t err = 0;
  const Status s = cpidx::ref::prefill_topk(in, b.sel, ids.out, &err);
  FUZZ_CHECK(s.is_ok(), "prefill rejected valid input: " << s.to_string());
  // The documented clamps, and the bits they raise.
  int32_t want_err = 0;
  std::vector<int64_t> start(cu.size());
  for (size_t r = 0; r < cu.size(); ++r) {
    start[r] = std::clamp<int64_t>(cu[r], r ? start[r - 1] : 0, tokens);
    if (start[r] != cu[r]) want_err |= cpidx::kErrSeqLenOutOfRange;
  }
  const int K = b.sel.topk;
  std::vector<int32_t> want(static_cast<size_t>(heads * tokens * K), -1);
  for (int r = 0; r < reqs; ++r) {
    const int32_t c = ctx[static_cast<size_t>(r)];
    if (c < 0 || c > b.max_seq_len) want_err |= cpidx::kErrSeqLenOutOfRange;
    const int32_t sl = seq[static_cast<size_t>(r)];
    if (sl < 0 || sl > b.max_seq_len) want_err |= cpidx::kErrSeqLenOutOfRange;
    const int64_t first = start[static_cast<size_t>(r)],
                  len = start[static_cast<size_t>(r) + 1] - first;
    int64_t last_pos = -1;
    for (int64_t i = 0; i < len; ++i) {
      int64_t pos = int64_t{std::clamp(c, 0, b.max_seq_len)} + i;
      if (pos >= b.max_seq_len) {
        want_err |= cpidx::kErrSeqLenOutOfRange;
        pos = b.max_seq_len - 1;
      }
      last_pos = std::max(last_pos, pos);
      for (int h = 0; h < heads; ++h) {
        brute_row(b, query.data() + ((first + i) * heads + h) * kD, r, pos, b.sel,
                  want.data() + (h * tokens + first + i) * K);
      }
    }
    for (int64_t blk = 0; blk < cpidx::visible_blocks(last_pos); ++blk) {
      const int32_t p = b.block_table[static_cast<size_t>(r * b.bt_stride + blk)];
      if (p < 0 || p >= b.num_pages) want_err |= cpidx::kErrPageOutOfRange;
    }
  }
  check_ids(ids, want, 0, "prefill");
  FUZZ_CHECK(err == want_err, "prefill error bits " << err << ", want " << want_err);
}

// The merge of arbitrary 64-bit keys (a corrupted exchange): in bounds, equal to a plain
// sort of the candidates; the table holds only pages of visible blocks.
void check_merge(FuzzedDataProvider& fdp, const Batch& b) {
  std::vector<int> worlds;
  for (int p = 1; p <= 8; ++p) {
    cpidx::Geometry g;
    if (cpidx::make_geometry(b.T, p, 0, &g).is_ok()) worlds.push_back(p);
  }
  const int P = worlds[fdp.ConsumeIntegralInRange<size_t>(0, worlds.size() - 1)];
  cpidx::Geometry g;
  cpidx::make_geometry(b.T, P, fdp.ConsumeIntegralInRange(0, P - 1), &g);
  const int64_t n = b.rows();
  const int K = b.sel.topk;
  Rng rng{fdp.ConsumeIntegral<uint64_t>()};
  std::vector<Key> keys(static_cast<size_t>(P * b.T * n * K));
  for (auto& k : keys) {
    switch (rng.below(4)) {
      case 0:
        k = rng.next();
        break;
      case 1:
        k = cpidx::kPadKey;
        break;
      case 2:
        k = cpidx::make_key(std::nanf(""), rng.below(b.blocks() + 2));
        break;
      default:
        k = cpidx::make_key(static_cast<float>(rng.below(3)), rng.below(b.blocks() + 2));
    }
  }
  IdsOut ids(fdp, g.local_heads, n, K);
  const bool with_table = g.local_heads == 1 && fdp.ConsumeBool();
  TableOut table(b, 8, rng);
  const Status s = cpidx::ref::merge_topk_keys(
      keys.data(), P, b.T, n, b.sel, g.head_offset, g.local_heads, b.seq_lens.data(), b.reqs, b.Q,
      b.max_seq_len, ids.out, with_table ? &table.t : nullptr);
  FUZZ_CHECK(s.is_ok(), "merge rejected valid input: " << s.to_string());
  std::vector<int32_t> want(static_cast<size_t>(b.T * n * K), -1);
  for (int j = 0; j < g.local_heads; ++j) {
    const int h = g.head_offset + j;
    for (int64_t row = 0; row < n; ++row) {
      std::vector<Key> cand;
      for (int w = 0; w < P; ++w) {
        const Key* src = keys.data() + ((int64_t{w} * b.T + h) * n + row) * K;
        cand.insert(cand.end(), src, src + K);
      }
      std::sort(cand.begin(), cand.end(), std::greater<Key>());
      for (int i = 0; i < K; ++i) {
        want[static_cast<size_t>((h * n + row) * K + i)] =
            cpidx::key_is_pad(cand[static_cast<size_t>(i)])
                ? -1
                : cpidx::key_block(cand[static_cast<size_t>(i)]);
      }
    }
  }
  check_ids(ids, want, g.head_offset, "merge");
  if (with_table) table.check(b, "merge table", false);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  const Batch b = make_batch(fdp);
  const int64_t n = b.rows();
  Rng rng{fdp.ConsumeIntegral<uint64_t>()};
  const bool with_table = b.T == 1 && fdp.ConsumeBool();
  const int page_stride = fdp.ConsumeBool() ? 8 : 16;
  TableOut table(b, page_stride, rng);

  // The plain decode, with or without mistakes.
  cpidx::DecodeInputs in = b.inputs(0, b.T);
  cpidx::Selection sel = b.sel;
  IdsOut ids(fdp, b.T, n, b.sel.topk);
  cpidx::TopkOutput out = ids.out;
  Mistakes mistakes;
  bool table_on = with_table;
  inject(fdp, b, in, sel, out, table, table_on, mistakes);
  int32_t err = 0;
  const Status s = cpidx::ref::decode_topk(in, sel, out, table_on ? &table.t : nullptr, &err);
  mistakes.expect(s, "decode_topk");
  Mistakes bounded = mistakes;
  bounded.add("max_tokens");
  bounded.expect(cpidx::ref::validate(in, sel, n - 1), "validate(max_tokens = n - 1)");
  if (mistakes.any()) {
    FUZZ_CHECK(ids.untouched(), "decode_topk wrote ids before failing");
    FUZZ_CHECK(table.untouched(), "decode_topk wrote the sparse table before failing");
    FUZZ_CHECK(err == 0, "decode_topk raised error bits " << err << " before failing");
    return 0;
  }
  mistakes.expect(cpidx::ref::validate(in, sel, n), "validate(max_tokens = n)");

  const std::vector<int32_t> want = brute_decode(b);
  check_ids(ids, want, 0, "decode_topk");
  const int32_t want_err = b.expected_err();
  FUZZ_CHECK(err == want_err, "decode_topk error bits " << err << ", want " << want_err);
  if (table_on) table.check(b, "decode_topk table", true);

  if (fdp.ConsumeBool()) check_cp(fdp, b, want, want_err, with_table, &table);
  if (fdp.ConsumeBool()) check_prefill(fdp, b);
  if (fdp.ConsumeBool()) check_merge(fdp, b);
  return 0;
}
