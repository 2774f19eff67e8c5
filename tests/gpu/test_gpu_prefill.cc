// GPU prefill indexer against the CPU reference: random packed batches (query lengths 1..4K,
// prefixes 0..1M not multiples of 128, 1..8 heads, K in {1, 6, 16, 64}, forced blocks), golden
// cases and tie-heavy inputs exactly, fp8 caches, rows past the batch untouched, rows outside
// every request at -1, bad device values clamped and flagged, repeat runs and CUDA-graph replays
// bitwise equal to eager runs, the mixed decode + prefill batch, and host errors before any
// kernel. Every test runs both score kernels (mma.sync and, where the device has it, Hopper
// wgmma) on the same inputs: ids bitwise equal between them (and to each token's decode), and
// within the contract's near-tie rule of the reference on random data.
// Every test skips cleanly without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpidx/prefill.h"
#include "gpu_util.h"
#include "json_lite.h"

namespace {

using namespace cpidx_gpu_test;
using cpidx::DType;
using cpidx::PrefillKernel;
using cpidx::Selection;
using cpidx_test::Values;
using cpidx_test::kBS;
using cpidx_test::kD;
using cpidx_test::sel_of;

// ---- Score kernels -------------------------------------------------------------------------------
// Which score kernel the helpers' Prefillers use (UseKernel sets it while in scope).
PrefillKernel& test_kernel() {
  static PrefillKernel kernel = PrefillKernel::kAuto;
  return kernel;
}
using UseKernel = ScopedChoice<PrefillKernel, test_kernel>;

// mma.sync always; wgmma where a Prefiller can be built with it (Hopper, sm_90a build).
const std::vector<PrefillKernel>& test_kernels() {
  static const std::vector<PrefillKernel> kernels = [] {
    std::vector<PrefillKernel> k = {PrefillKernel::kMmaSync};
    cpidx::PrefillConfig cfg;
    cfg.num_heads = 1;
    cfg.max_tokens = 1;
    cfg.max_seq_len = 128;
    cfg.kernel = PrefillKernel::kWgmma;
    std::unique_ptr<cpidx::Prefiller> pre;
    const cpidx::Status st = cpidx::Prefiller::create(cfg, 0, &pre);
    if (st.is_ok()) {
      k.push_back(PrefillKernel::kWgmma);
    } else {
      std::printf("[ NOTE     ] wgmma prefill kernel not tested: %s\n", st.to_string().c_str());
    }
    return k;
  }();
  return kernels;
}

// ---- Inputs ------------------------------------------------------------------------------------
// Fast random values (a 1M-token cache is 134M of them): SplitMix64 bits, four draws per call.
class FastRandom {
 public:
  explicit FastRandom(uint64_t seed) : s_(seed) {}
  uint16_t next16() {
    if (left_ == 0) {
      uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      bits_ = z ^ (z >> 31);
      left_ = 4;
    }
    --left_;
    const uint16_t r = static_cast<uint16_t>(bits_);
    bits_ >>= 16;
    return r;
  }
  // bf16 in +-[2^-6, 1): never zero, never NaN, a wide spread of magnitudes (few ties).
  uint16_t bf16() {
    const uint16_t r = next16();
    return static_cast<uint16_t>((r & 0x8000) | ((121 + (r >> 7) % 6) << 7) | (r & 0x7F));
  }
  uint16_t small_int(int lo, int hi) {  // bf16 of an integer in [lo, hi]
    return cpidx_test::bf16_of(static_cast<float>(lo + next16() % (hi - lo + 1)));
  }

 private:
  uint64_t s_, bits_ = 0;
  int left_ = 0;
};

// A packed prefill batch: queries [tokens][heads][D] (or head-major), a shuffled paged cache with
// exactly the pages the requests use (+3 spare), block-table columns past each request holding
// garbage outside the cache (reading one would trip the page flag).
struct PrefillCase {
  int heads = 0;
  int32_t max_seq_len = 0;
  DType dtype = DType::kBF16;
  float scale = 0.0883883f;
  std::vector<int32_t> cu, context_lens, seq_lens;
  int64_t tokens = 0;
  std::vector<uint16_t> query;
  int64_t q_row_stride = 0, q_head_stride = 0;
  std::vector<uint16_t> cache16;
  std::vector<uint8_t> cache8;
  int64_t num_pages = 0;
  std::vector<int32_t> block_table;
  int64_t bt_row_stride = 0;

  int num_reqs() const { return static_cast<int>(context_lens.size()); }
  cpidx::PrefillInputs host() const {
    cpidx::PrefillInputs in;
    in.query = query.data();
    in.q_row_stride = q_row_stride;
    in.q_head_stride = q_head_stride;
    in.num_heads = heads;
    in.cache.data = dtype == DType::kBF16 ? static_cast<const void*>(cache16.data())
                                          : static_cast<const void*>(cache8.data());
    in.cache.dtype = dtype;
    in.cache.num_pages = num_pages;
    in.block_table = block_table.data();
    in.bt_row_stride = bt_row_stride;
    in.cu_seqlens_q = cu.data();
    in.context_lens = context_lens.data();
    in.seq_lens = seq_lens.data();
    in.num_reqs = num_reqs();
    in.num_tokens = tokens;
    in.max_seq_len = max_seq_len;
    in.scale = scale;
    return in;
  }
};

PrefillCase make_case(uint64_t seed, int heads, const std::vector<int32_t>& q_lens,
                      const std::vector<int32_t>& context_lens, DType dtype = DType::kBF16,
                      Values values = Values::kRandom, bool head_major = false) {
  PrefillCase c;
  FastRandom rnd(seed);
  c.heads = heads;
  c.dtype = dtype;
  c.context_lens = context_lens;
  c.cu.push_back(0);
  for (size_t r = 0; r < q_lens.size(); ++r) {
    c.seq_lens.push_back(context_lens[r] + q_lens[r]);
    c.cu.push_back(c.cu.back() + q_lens[r]);
  }
  c.tokens = c.cu.back();
  const int32_t longest = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  c.max_seq_len = longest + 77;  // not a multiple of 128
  c.query.resize(static_cast<size_t>(c.tokens * heads * kD));
  for (auto& q : c.query) q = values == Values::kTies ? rnd.small_int(-2, 2) : rnd.bf16();
  c.q_row_stride = head_major ? kD : heads * kD;
  c.q_head_stride = head_major ? c.tokens * kD : kD;

  int64_t used = 0;
  for (int32_t s : c.seq_lens) used += cpidx::cdiv(s, kBS);
  c.num_pages = used + 3;
  const size_t elems = static_cast<size_t>(c.num_pages) * kBS * kD;
  if (dtype == DType::kBF16) {
    c.cache16.resize(elems);
    for (auto& k : c.cache16) k = values == Values::kTies ? rnd.small_int(-1, 1) : rnd.bf16();
  } else {
    c.cache8.resize(elems);
    const uint8_t ties[3] = {0xB8, 0x00, 0x38};  // -1, 0, +1 in e4m3
    for (auto& k : c.cache8) {
      do k = values == Values::kTies ? ties[rnd.next16() % 3] : static_cast<uint8_t>(rnd.next16());
      while ((k & 0x7F) == 0x7F);  // no NaN codes
    }
  }
  std::vector<int32_t> pages(static_cast<size_t>(c.num_pages));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), std::mt19937_64(seed));
  c.bt_row_stride = cpidx::cdiv(c.max_seq_len, kBS) + 2;
  c.block_table.assign(static_cast<size_t>(c.num_reqs() * c.bt_row_stride), 0);
  size_t next = 0;
  for (int r = 0; r < c.num_reqs(); ++r) {
    const int64_t blocks = cpidx::cdiv(c.seq_lens[r], kBS);
    for (int64_t b = 0; b < c.bt_row_stride; ++b) {
      c.block_table[static_cast<size_t>(r * c.bt_row_stride + b)] =
          b < blocks ? pages[next++] : (b % 2 ? -1000003 : 1 << 30);
    }
  }
  return c;
}

// ---- Runs --------------------------------------------------------------------------------------
struct DevicePrefill {
  explicit DevicePrefill(const PrefillCase& c)
      : query(c.query), cu(c.cu), ctx(c.context_lens), seq(c.seq_lens), table(c.block_table) {
    if (c.dtype == DType::kBF16) cache16 = std::make_unique<DeviceVec<uint16_t>>(c.cache16);
    else cache8 = std::make_unique<DeviceVec<uint8_t>>(c.cache8);
  }
  cpidx::PrefillInputs inputs(const PrefillCase& c) const {
    cpidx::PrefillInputs in = c.host();
    in.query = query.ptr;
    in.cache.data = cache16 ? static_cast<const void*>(cache16->ptr)
                            : static_cast<const void*>(cache8->ptr);
    in.cu_seqlens_q = cu.ptr;
    in.context_lens = ctx.ptr;
    in.seq_lens = seq.ptr;
    in.block_table = table.ptr;
    return in;
  }
  DeviceVec<uint16_t> query;
  DeviceVec<int32_t> cu, ctx, seq, table;
  std::unique_ptr<DeviceVec<uint16_t>> cache16;
  std::unique_ptr<DeviceVec<uint8_t>> cache8;
};

cpidx::PrefillConfig config_of(const PrefillCase& c, const Selection& sel, int extra_tokens = 3) {
  cpidx::PrefillConfig cfg;
  cfg.num_heads = c.heads;
  cfg.max_tokens = static_cast<int>(c.tokens) + extra_tokens;
  cfg.max_seq_len = c.max_seq_len;
  cfg.sel = sel;
  cfg.cache_dtype = c.dtype;
  cfg.kernel = test_kernel();
  return cfg;
}

constexpr int kExtraRows = 5;  // output rows past the batch: must stay poisoned

// GPU ids [heads][tokens][K] (compacted) through an output with kExtraRows more rows per head.
std::vector<int32_t> gpu_prefill(const PrefillCase& c, const Selection& sel,
                                 int32_t* flag = nullptr) {
  DevicePrefill d(c);
  std::unique_ptr<cpidx::Prefiller> pre;
  cpidx::Status st = cpidx::Prefiller::create(config_of(c, sel), 0, &pre);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (!st.is_ok()) return {};
  if (test_kernel() != PrefillKernel::kAuto) EXPECT_EQ(pre->plan().kernel, test_kernel());
  const int64_t rows = c.tokens + kExtraRows, K = sel.topk;
  DeviceVec<int32_t> ids(static_cast<size_t>(c.heads * rows * K));
  ids.poison();
  st = pre->prefill(d.inputs(c), cpidx::TopkOutput{ids.ptr, rows * K, K}, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (flag) cudaMemcpy(flag, pre->error_flag(), 4, cudaMemcpyDeviceToHost);
  const std::vector<int32_t> all = ids.download();
  std::vector<int32_t> out;
  for (int h = 0; h < c.heads; ++h) {
    const auto head = all.begin() + h * rows * K;
    out.insert(out.end(), head, head + c.tokens * K);
    EXPECT_TRUE(std::all_of(head + c.tokens * K, head + rows * K,
                            [](int32_t v) { return v == cpidx_test::kPoison; }))
        << "head " << h << ": a row past the batch was written";
  }
  return out;
}

std::vector<int32_t> cpu_prefill(const PrefillCase& c, const Selection& sel, int32_t* err) {
  cpidx_test::IdsBuffer ids(c.heads, c.tokens, sel.topk);
  const cpidx::Status st = cpidx::ref::prefill_topk(c.host(), sel, ids.out(), err);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return ids.ids;
}

// The contract's comparison of two id sets [heads][tokens][K] of case `c`.
cpidx::ref::IdsComparison compare(const PrefillCase& c, const Selection& sel,
                                  const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  const int64_t K = sel.topk;
  return cpidx::ref::compare_ids(
      c.host(), sel, cpidx::TopkOutput{const_cast<int32_t*>(got.data()), c.tokens * K, K},
      cpidx::TopkOutput{const_cast<int32_t*>(want.data()), c.tokens * K, K});
}

// Every kernel against the reference (equal rows, or swaps among blocks within the contract's
// near-tie band: the reference sums in another order), and the kernels against each other, bit
// for bit (both group the 128 products of a dot product into the decode kernel's k-steps).
void expect_matches_reference(const PrefillCase& c, const Selection& sel, const std::string& what) {
  int32_t err = 0;
  const std::vector<int32_t> cpu = cpu_prefill(c, sel, &err);
  EXPECT_EQ(err, 0) << what;
  std::vector<int32_t> first;
  for (const PrefillKernel kernel : test_kernels()) {
    const UseKernel use(kernel);
    const std::string label = what + " [" + cpidx::to_string(kernel) + "]";
    int32_t flag = -1;
    const std::vector<int32_t> gpu = gpu_prefill(c, sel, &flag);
    ASSERT_EQ(gpu.size(), cpu.size()) << label;
    EXPECT_EQ(flag, 0) << label;
    for (int32_t v : gpu) ASSERT_NE(v, cpidx_test::kPoison) << label << ": unwritten output";
    const cpidx::ref::IdsComparison r = compare(c, sel, gpu, cpu);
    EXPECT_EQ(r.bad_rows, 0) << label << ": " << r.first_bad;
    // Near ties are rare on random data; a systematic error would show up as many of them.
    EXPECT_LE(r.near_tie_rows, std::max<int64_t>(2, (r.exact_rows + r.near_tie_rows) / 50)) << label;
    if (first.empty()) {
      first = gpu;
      continue;
    }
    EXPECT_EQ(gpu, first) << label << " vs " << cpidx::to_string(test_kernels()[0]);
  }
}

// Runs `body` once per score kernel, with the helpers' Prefillers on that kernel.
template <typename Body>
void for_each_kernel(Body body) {
  for (const PrefillKernel kernel : test_kernels()) {
    const UseKernel use(kernel);
    SCOPED_TRACE(std::string("kernel ") + cpidx::to_string(kernel));
    body();
  }
}

// ids of every kernel, required bitwise equal to each other (exact arithmetic); returns them.
std::vector<int32_t> gpu_prefill_all_equal(const PrefillCase& c, const Selection& sel,
                                           const std::string& what, int32_t* flag = nullptr) {
  std::vector<int32_t> first;
  for (const PrefillKernel kernel : test_kernels()) {
    const UseKernel use(kernel);
    int32_t f = -1;
    const std::vector<int32_t> ids = gpu_prefill(c, sel, &f);
    if (first.empty()) {
      first = ids;
      if (flag) *flag = f;
      continue;
    }
    EXPECT_EQ(ids, first) << what << ": " << cpidx::to_string(kernel) << " != "
                          << cpidx::to_string(test_kernels()[0]);
    if (flag) EXPECT_EQ(f, *flag) << what << ": error flags differ";
  }
  return first;
}

// ---- Tests -------------------------------------------------------------------------------------
TEST(GpuPrefill, RandomBatchesMatchReference) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int heads, k, init, local;
    std::vector<int32_t> q_lens, contexts;
    bool head_major;
  };
  const std::vector<Shape> shapes = {
      {1, 1, 0, 1, {1, 200, 37}, {0, 129, 5000}, false},
      {2, 6, 1, 2, {4096}, {3001}, false},  // a 4K-token chunk after a cached prefix
      {3, 16, 0, 1, {300, 1, 65}, {700, 131071, 0}, true},
      {4, 16, 1, 2, {3, 2}, {1000033, 77}, false},  // a 1M-token prefix
      {5, 64, 0, 1, {500}, {9000}, false},
      {6, 6, 1, 2, {64, 64, 64}, {128, 255, 256}, true},
      {7, 16, 0, 1, {37, 1000}, {10, 2000}, false},
      {8, 64, 1, 2, {257, 20}, {64 * 128 + 5, 300}, false},
  };
  uint64_t seed = 1000;
  for (const Shape& s : shapes) {
    const PrefillCase c = make_case(seed++, s.heads, s.q_lens, s.contexts, DType::kBF16,
                                    Values::kRandom, s.head_major);
    expect_matches_reference(c, sel_of(s.k, s.init, s.local),
                             "H=" + std::to_string(s.heads) + " K=" + std::to_string(s.k) +
                                 " tokens=" + std::to_string(c.tokens));
  }
}

TEST(GpuPrefill, Fp8CacheMatchesReference) {
  SKIP_WITHOUT_GPU();
  const PrefillCase c = make_case(1100, 4, {200, 33}, {4000, 129}, DType::kFP8E4M3);
  expect_matches_reference(c, sel_of(16), "fp8");
}

TEST(GpuPrefill, TieHeavyInputsMatchExactly) {
  SKIP_WITHOUT_GPU();
  // Small integers: every dot is exact in fp32, so ids must match in order, ties included.
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int k : {1, 6, 16, 64}) {
      const PrefillCase c =
          make_case(1200 + k, 4, {150, 7, 70}, {1000, 0, 8300}, dtype, Values::kTies);
      const Selection sel = sel_of(k, 1, 2);
      const std::string what = "K=" + std::to_string(k) + " dtype " + cpidx::to_string(dtype);
      int32_t err = 0;
      EXPECT_EQ(gpu_prefill_all_equal(c, sel, what), cpu_prefill(c, sel, &err)) << what;
    }
  }
}

const json_lite::Value& golden() {
  static const json_lite::Value cases =
      json_lite::parse_file(std::string(CPIDX_TEST_DATA_DIR) + "/golden_cases.json")["cases"];
  return cases;
}

// The golden generator's prefill layout (tests/test_golden.cc): queries [tokens][T][D] then the
// cache from one stream, block_table[req][b] = b * reqs + req.
PrefillCase golden_case(const json_lite::Value& c) {
  PrefillCase p;
  p.heads = c["T"].as_int();
  p.context_lens = c["context_lens"].ints();
  p.seq_lens = c["seq_lens"].ints();
  p.scale = static_cast<float>(c["scale"].number);
  p.cu.push_back(0);
  for (int32_t q : c["q_lens"].ints()) p.cu.push_back(p.cu.back() + q);
  p.tokens = p.cu.back();
  cpidx_test::GoldenStream stream(static_cast<uint64_t>(c["seed"].number));
  p.query.resize(static_cast<size_t>(p.tokens * p.heads * kD));
  for (auto& q : p.query) q = cpidx_test::bf16_of(static_cast<float>(stream.next()));
  p.q_row_stride = p.heads * kD;
  p.q_head_stride = kD;
  const int reqs = p.num_reqs();
  const int64_t blocks = std::max<int64_t>(
      1, cpidx::cdiv(*std::max_element(p.seq_lens.begin(), p.seq_lens.end()), kBS));
  p.num_pages = reqs * blocks;
  p.cache16.resize(static_cast<size_t>(p.num_pages * kBS * kD));
  for (auto& k : p.cache16) k = cpidx_test::bf16_of(static_cast<float>(stream.next()));
  p.bt_row_stride = blocks;
  p.block_table.resize(static_cast<size_t>(reqs * blocks));
  for (int r = 0; r < reqs; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      p.block_table[static_cast<size_t>(r * blocks + b)] = static_cast<int32_t>(b * reqs + r);
  p.max_seq_len = static_cast<int32_t>(blocks * kBS);
  return p;
}

TEST(GpuPrefill, GoldenCasesExactly) {
  SKIP_WITHOUT_GPU();
  int checked = 0;
  for (const auto& c : golden().array) {
    if (c["kind"].string != "prefill") continue;
    const PrefillCase p = golden_case(c);
    const Selection sel = sel_of(c["K"].as_int(), c["init"].as_int(), c["local"].as_int());
    std::vector<int32_t> want;
    for (const auto& head : c["ids"].array)
      for (const auto& row : head.array)
        for (int32_t v : row.ints()) want.push_back(v);
    const std::string what =
        "golden prefill seed " + std::to_string(static_cast<long long>(c["seed"].number));
    EXPECT_EQ(gpu_prefill_all_equal(p, sel, what), want) << what;
    ++checked;
  }
  EXPECT_GE(checked, 2);
}

// Each run of q_len prefill tokens of a request (q_len divides every request's tokens) decoded
// as one request of q_len query tokens: its last token's position + 1 tokens, its request's
// block-table row, its queries. Rows stay in token order, and the contract's block scores are
// the same for both.
cpidx_test::DecodeData as_decode(const PrefillCase& c, int q_len = 1) {
  cpidx_test::DecodeData d;
  d.total_heads = c.heads;
  d.query_len = q_len;
  d.max_seq_len = c.max_seq_len;
  d.dtype = c.dtype;
  d.cache_bf16 = c.cache16;
  d.cache_fp8 = c.cache8;
  d.num_pages = c.num_pages;
  d.bt_row_stride = c.bt_row_stride;
  d.scale = c.scale;
  d.query.resize(static_cast<size_t>(c.tokens * c.heads * kD));
  for (int r = 0; r < c.num_reqs(); ++r) {
    if ((c.cu[r + 1] - c.cu[r]) % q_len != 0) {
      ADD_FAILURE() << "request " << r << ": " << c.cu[r + 1] - c.cu[r] << " tokens, not runs of "
                    << q_len;
      return {};
    }
    for (int32_t t = c.cu[r]; t < c.cu[r + 1]; ++t) {
      if ((t - c.cu[r]) % q_len == 0) {
        d.seq_lens.push_back(c.context_lens[r] + (t - c.cu[r]) + q_len);
        const auto row = c.block_table.begin() + static_cast<int64_t>(r) * c.bt_row_stride;
        d.block_table.insert(d.block_table.end(), row, row + c.bt_row_stride);
      }
      for (int h = 0; h < c.heads; ++h) {
        const auto q = c.query.begin() + t * c.q_row_stride + h * c.q_head_stride;
        std::copy(q, q + kD, d.query.begin() + (static_cast<int64_t>(t) * c.heads + h) * kD);
      }
    }
  }
  return d;
}

// Keys whose block scores tie exactly and differ only by how their fp32 sums group the 128
// products: token 0 of every page a shuffle of one vector of key values, the page's other keys
// 0, every query row the same. Each block's score is then the sum of one multiset of products
// in its own order, rounded by the path's grouping of the dims into k-steps (a tensor-core
// k-step sums its 16 products alike in any order; across steps fp32 rounds:
// bench/probes/mma_k_order.cu), so the blocks' order is that rounding's. The products must span
// more than fp32's 24 bits, or every sum is exact in any grouping: bf16 keys over 2^16 (query
// 1); normal e4m3 keys (2^-6..240, in steps of 2^-9 at least) times 1 sum exactly in fp32, so
// the fp8 query is 2^-12, 1 or 2^12 by dim % 3 and the keys are shuffled among the dims of one
// query value. Mixed signs, a positive sum.
void make_grouping_sensitive(PrefillCase* c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const bool fp8 = c->dtype == DType::kFP8E4M3;
  std::vector<uint16_t> u(kD);  // bf16 bits, or e4m3 bits
  std::vector<float> q(kD, 1.0f);
  if (fp8)
    for (int d = 0; d < kD; ++d) q[d] = std::ldexp(1.0f, 12 * (d % 3 - 1));
  double sum = 0;
  for (int d = 0; d < kD; ++d) {
    if (fp8) {  // exponent field 1..14, any mantissa: no NaN, no subnormal
      u[d] = static_cast<uint16_t>(((1 + rng() % 14) << 3) | (rng() % 8) | (rng() % 2 ? 0x80 : 0));
      sum += q[d] * static_cast<double>(cpidx::ref::fp8e4m3_to_float(static_cast<uint8_t>(u[d])));
    } else {
      const float x = std::ldexp(1.0f + static_cast<float>(rng() % 128) / 128.0f,
                                 static_cast<int>(rng() % 17) - 8);
      u[d] = cpidx_test::bf16_of(rng() % 2 ? -x : x);
      sum += cpidx::ref::bf16_to_float(u[d]);
    }
  }
  if (sum < 0)
    for (auto& v : u) v ^= fp8 ? 0x80 : 0x8000;
  for (size_t i = 0; i < c->query.size(); ++i) c->query[i] = cpidx_test::bf16_of(q[i % kD]);
  if (fp8) std::fill(c->cache8.begin(), c->cache8.end(), uint8_t{0});
  else std::fill(c->cache16.begin(), c->cache16.end(), cpidx_test::bf16_of(0.0f));
  const int classes = fp8 ? 3 : 1;  // shuffled among the dims d with one d % classes
  std::vector<uint16_t> part;
  for (int64_t page = 0; page < c->num_pages; ++page) {
    for (int k = 0; k < classes; ++k) {
      part.clear();
      for (int d = k; d < kD; d += classes) part.push_back(u[d]);
      std::shuffle(part.begin(), part.end(), rng);
      for (int d = k, i = 0; d < kD; d += classes, ++i) u[d] = part[i];
    }
    for (int d = 0; d < kD; ++d) {
      if (fp8) c->cache8[static_cast<size_t>(page * kBS * kD + d)] = static_cast<uint8_t>(u[d]);
      else c->cache16[static_cast<size_t>(page * kBS * kD + d)] = u[d];
    }
  }
}

// CONTRACT.md section 4: every path gives the same ids for the same scores, bit for bit between
// the GPU paths. Rows whose ids differ from each token's GPU decode, per kernel and per decode
// width (at 4 heads a request of one token is 4 columns; of four, 16; of eight, 32; at 8 heads
// eight tokens are 64: the decode kernel's instances load keys and query fragments otherwise):
// on random values of a wide spread and normal ones (near ties are rare there), and on blocks
// that tie but for the grouping of their sums (make_grouping_sensitive: nearly every row, if a
// kernel grouped the dims otherwise than the decode; every head's query the same there, so
// shapes 8-9 draw the 8-head cases' values at random), bf16 and fp8.
TEST(GpuPrefill, SameIdsAsEachTokensDecode) {
  SKIP_WITHOUT_GPU();
  for (int shape = 0; shape < 10; ++shape) {
    const DType dtype = shape % 2 == 1 && shape != 3 ? DType::kFP8E4M3 : DType::kBF16;
    const int heads = shape < 6 ? 4 : 8;
    PrefillCase c = shape < 2 ? make_case(91, heads, {700, 300, 1000}, {30000, 5000, 60000}, dtype)
                              : make_case(90 + shape, heads, {512, 512, 512, 512},
                                          {16000, 40000, 3000, 64000}, dtype);
    if (shape == 2 || shape == 3) {  // normal values (as torch.randn), rounded to bf16
      std::mt19937 rng(shape);
      std::normal_distribution<float> normal;
      for (auto& q : c.query) q = cpidx_test::bf16_of(normal(rng));
      for (auto& k : c.cache16) k = cpidx_test::bf16_of(normal(rng));
    }
    if (shape >= 4 && shape < 8) make_grouping_sensitive(&c, 90 + shape);
    const Selection sel = sel_of(16, 1, 2);
    // 700 and 300 tokens are no runs of 8.
    const std::vector<int> q_lens = shape < 2   ? std::vector<int>{1, 4}
                                    : shape < 6 ? std::vector<int>{1, 4, 8}
                                                : std::vector<int>{2, 8};
    std::vector<std::vector<int32_t>> decoded;
    for (int q_len : q_lens) decoded.push_back(gpu_decode(as_decode(c, q_len), sel));
    for_each_kernel([&] {
      const std::vector<int32_t> ids = gpu_prefill(c, sel);
      for (size_t w = 0; w < q_lens.size(); ++w) {
        ASSERT_EQ(ids.size(), decoded[w].size());
        int64_t differing = 0;
        for (size_t row = 0; row < ids.size() / sel.topk; ++row) {
          differing += !std::equal(ids.begin() + row * sel.topk,
                                   ids.begin() + (row + 1) * sel.topk,
                                   decoded[w].begin() + row * sel.topk);
        }
        std::printf("[ PROBE    ] shape %d, %s, %s, %d heads x decode Q=%d: %lld of %zu rows "
                    "differ\n",
                    shape, cpidx::to_string(dtype), cpidx::to_string(test_kernel()), heads,
                    q_lens[w], static_cast<long long>(differing), ids.size() / sel.topk);
        EXPECT_EQ(differing, 0) << "shape " << shape << ", " << cpidx::to_string(dtype) << ", "
                                << heads << " heads x Q=" << q_lens[w];
      }
    });
  }
}

TEST(GpuPrefill, RepeatRunsAreBitwiseEqual) {
  SKIP_WITHOUT_GPU();
  const PrefillCase c = make_case(1300, 4, {900, 5}, {20000, 3}, DType::kBF16);
  for_each_kernel([&] { EXPECT_EQ(gpu_prefill(c, sel_of(16)), gpu_prefill(c, sel_of(16))); });
}

TEST(GpuPrefill, RowsOutsideEveryRequestAreMinusOne) {
  SKIP_WITHOUT_GPU();
  PrefillCase c = make_case(1400, 2, {10, 6}, {0, 50}, DType::kBF16);
  c.cu = {0, 10};  // one request: the last 6 rows are covered by none
  c.context_lens.resize(1);
  c.seq_lens.resize(1);
  const Selection sel = sel_of(4);
  int32_t flag = -1, err = 0;
  const std::vector<int32_t> gpu = gpu_prefill_all_equal(c, sel, "rows outside", &flag);
  EXPECT_EQ(gpu, cpu_prefill(c, sel, &err));
  EXPECT_EQ(flag, err);
  for (int h = 0; h < 2; ++h)
    for (int64_t row = 10; row < c.tokens; ++row)
      for (int s = 0; s < 4; ++s) EXPECT_EQ(gpu[static_cast<size_t>((h * c.tokens + row) * 4 + s)], -1);
}

TEST(GpuPrefill, BadDeviceValuesAreClampedAndFlagged) {
  SKIP_WITHOUT_GPU();
  for_each_kernel([&] {
    {  // cu_seqlens_q out of order and past num_tokens, contexts and seq_lens out of range
      PrefillCase c = make_case(1500, 4, {50, 30, 20}, {300, 1000, 2000}, DType::kBF16);
      // Request 2 runs past max_seq_len: its positions clamp to the last token, and it reads
      // block-table columns past its pages (garbage outside the cache: clamped too).
      c.cu = {0, 60, 55, 130};
      c.context_lens = {-5, c.max_seq_len + 1000, c.max_seq_len - 10};
      c.seq_lens = {355, 1030, -1};
      const Selection sel = sel_of(16, 1, 2);
      int32_t flag = 0, err = 0;
      const std::vector<int32_t> gpu = gpu_prefill(c, sel, &flag);
      const std::vector<int32_t> cpu = cpu_prefill(c, sel, &err);
      EXPECT_EQ(flag, cpidx::kErrSeqLenOutOfRange | cpidx::kErrPageOutOfRange);
      EXPECT_EQ(flag, err);
      const cpidx::ref::IdsComparison r = cpidx::ref::compare_ids(
          c.host(), sel, cpidx::TopkOutput{const_cast<int32_t*>(gpu.data()), c.tokens * 16, 16},
          cpidx::TopkOutput{const_cast<int32_t*>(cpu.data()), c.tokens * 16, 16});
      EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
    }
    {  // block-table entries outside the cache, in the blocks the requests read
      PrefillCase c = make_case(1501, 2, {40, 40}, {1000, 500}, DType::kBF16);
      c.block_table[1] = 1 << 30;
      c.block_table[static_cast<size_t>(c.bt_row_stride + 2)] = -7;
      const Selection sel = sel_of(6);
      int32_t flag = 0, err = 0;
      const std::vector<int32_t> gpu = gpu_prefill(c, sel, &flag);
      const std::vector<int32_t> cpu = cpu_prefill(c, sel, &err);
      EXPECT_EQ(flag, cpidx::kErrPageOutOfRange);
      EXPECT_EQ(flag, err);
      const cpidx::ref::IdsComparison r = cpidx::ref::compare_ids(
          c.host(), sel, cpidx::TopkOutput{const_cast<int32_t*>(gpu.data()), c.tokens * 6, 6},
          cpidx::TopkOutput{const_cast<int32_t*>(cpu.data()), c.tokens * 6, 6});
      EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
    }
  });
}

// A call whose inputs name a flag of their own ORs its bits there, never into the Prefiller's;
// a misaligned one is refused before any kernel.
TEST(GpuPrefill, PerCallErrorFlagTakesTheCallsBits) {
  SKIP_WITHOUT_GPU();
  PrefillCase c = make_case(1502, 2, {40, 40}, {1000, 500}, DType::kBF16);
  c.block_table[1] = 1 << 30;
  const Selection sel = sel_of(6);
  constexpr int32_t kOther = 1 << 20;  // a bit of the caller's, kept (OR, not a store)
  for_each_kernel([&] {
    DevicePrefill d(c);
    std::unique_ptr<cpidx::Prefiller> pre;
    ASSERT_TRUE(cpidx::Prefiller::create(config_of(c, sel), 0, &pre).is_ok());
    ASSERT_TRUE(pre->clear_error_flag(nullptr).is_ok());
    const int64_t K = sel.topk;
    DeviceVec<int32_t> flag(std::vector<int32_t>{kOther, 0});
    DeviceVec<int32_t> ids(static_cast<size_t>(c.heads * c.tokens * K));
    ids.poison();
    cpidx::PrefillInputs in = d.inputs(c);
    in.error_flag = flag.ptr;
    ASSERT_TRUE(pre->prefill(in, cpidx::TopkOutput{ids.ptr, c.tokens * K, K}, nullptr).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(read_device_int(flag.ptr), kOther | cpidx::kErrPageOutOfRange);
    EXPECT_EQ(read_device_int(pre->error_flag()), 0);
    EXPECT_EQ(ids.download(), gpu_prefill(c, sel)) << "the flag changed the ids";

    ids.poison();
    in.error_flag = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(flag.ptr) + 2);
    const cpidx::Status st = pre->prefill(in, cpidx::TopkOutput{ids.ptr, c.tokens * K, K}, nullptr);
    EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("error_flag"), std::string::npos) << st.message();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(flag.download(), (std::vector<int32_t>{kOther | cpidx::kErrPageOutOfRange, 0}));
    for (int32_t v : ids.download()) ASSERT_EQ(v, cpidx_test::kPoison) << "a kernel ran";
  });
}

TEST(GpuPrefill, GraphReplayFollowsNewContextsAndTables) {
  SKIP_WITHOUT_GPU();
  for_each_kernel([&] {
    PrefillCase c = make_case(1600, 4, {300, 100}, {30000, 3000}, DType::kBF16);
    const Selection sel = sel_of(16);
    DevicePrefill d(c);
    std::unique_ptr<cpidx::Prefiller> pre;
    ASSERT_TRUE(cpidx::Prefiller::create(config_of(c, sel), 0, &pre).is_ok());
    const int64_t K = sel.topk;
    DeviceVec<int32_t> ids(static_cast<size_t>(4 * c.tokens * K));
    CapturedGraph graph([&](cudaStream_t stream) {
      return pre->prefill(d.inputs(c), cpidx::TopkOutput{ids.ptr, c.tokens * K, K}, stream);
    });
    ASSERT_TRUE(graph.status().is_ok()) << graph.status().to_string();
    std::mt19937 rng(5);
    std::vector<int64_t> valid_blocks;  // each row's real pages (garbage past them)
    for (int32_t len : c.seq_lens) valid_blocks.push_back(cpidx::cdiv(len, kBS));
    for (int step = 0; step < 3; ++step) {
      // Shorter contexts (the cache stays valid), a re-split of the same tokens, and each
      // request's real pages shuffled within its table row (its blocks read other pages).
      c.context_lens = {static_cast<int32_t>(rng() % 29600), static_cast<int32_t>(rng() % 2700)};
      const int32_t first = static_cast<int32_t>(1 + rng() % (c.tokens - 1));
      c.cu = {0, first, static_cast<int32_t>(c.tokens)};
      c.seq_lens = {c.context_lens[0] + first, c.context_lens[1] + static_cast<int32_t>(c.tokens) - first};
      for (int req = 0; req < c.num_reqs(); ++req) {
        const auto row = c.block_table.begin() + req * c.bt_row_stride;
        std::shuffle(row, row + valid_blocks[static_cast<size_t>(req)], rng);
      }
      d.ctx.upload(c.context_lens);
      d.cu.upload(c.cu);
      d.seq.upload(c.seq_lens);
      d.table.upload(c.block_table);
      ids.poison();
      CUDA_OK(graph.replay());
      const std::vector<int32_t> replayed = ids.download();
      std::vector<int32_t> eager = gpu_prefill(c, sel);
      EXPECT_EQ(replayed, eager) << "graph replay != eager at step " << step;
      int32_t err = 0;
      const std::vector<int32_t> cpu = cpu_prefill(c, sel, &err);
      const cpidx::ref::IdsComparison r = cpidx::ref::compare_ids(
          c.host(), sel, cpidx::TopkOutput{const_cast<int32_t*>(replayed.data()), c.tokens * K, K},
          cpidx::TopkOutput{const_cast<int32_t*>(cpu.data()), c.tokens * K, K});
      EXPECT_EQ(r.bad_rows, 0) << "step " << step << ": " << r.first_bad;
    }
  });
}

// A Prefiller's launches in live graphs are counted; one destroyed under such a graph keeps its
// workspace, and the graph still replays the eager ids (GpuDecode's test of the same).
TEST(GpuPrefill, DestroyedUnderALiveGraphTheWorkspaceStays) {
  SKIP_WITHOUT_GPU();
  PrefillCase c = make_case(1602, 4, {300, 100}, {30000, 3000}, DType::kBF16);
  const Selection sel = sel_of(16);
  const std::vector<int32_t> eager = gpu_prefill(c, sel);
  DevicePrefill d(c);
  std::unique_ptr<cpidx::Prefiller> pre;
  ASSERT_TRUE(cpidx::Prefiller::create(config_of(c, sel), 0, &pre).is_ok());
  const int64_t K = sel.topk;
  DeviceVec<int32_t> ids(static_cast<size_t>(4 * c.tokens * K));
  EXPECT_EQ(pre->launches_in_live_graphs(), 0);
  CapturedGraph graph([&](cudaStream_t stream) {
    return pre->prefill(d.inputs(c), cpidx::TopkOutput{ids.ptr, c.tokens * K, K}, stream);
  });
  ASSERT_TRUE(graph.status().is_ok()) << graph.status().to_string();
  EXPECT_EQ(pre->launches_in_live_graphs(), 1);
  const size_t workspace = pre->plan().workspace_bytes;
  pre.reset();
  const LaterAllocations later(2, workspace);
  for (int replay = 0; replay < 2; ++replay) {
    ids.poison();
    CUDA_OK(graph.replay());
    EXPECT_EQ(ids.download(), eager) << "replay " << replay;
  }
  EXPECT_TRUE(later.untouched()) << "a replay stored into memory allocated after it went";
}

TEST(GpuPrefill, MixedBatchEqualsSeparateCalls) {
  SKIP_WITHOUT_GPU();
  for_each_kernel([&] {
    const int heads = 4;
    const Selection sel = sel_of(16, 1, 2);
    const cpidx_test::DecodeData dd = cpidx_test::random_decode(1700, heads, 2, {5000, 129, 70000}, 70000);
    const PrefillCase pc = make_case(1701, heads, {300, 41}, {2000, 6000}, DType::kBF16);
    DeviceBatch db(dd);
    DevicePrefill dp(pc);
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(dd, sel), 0, &dec).is_ok());
    std::unique_ptr<cpidx::Prefiller> pre;
    ASSERT_TRUE(cpidx::Prefiller::create(config_of(pc, sel), 0, &pre).is_ok());
    const int64_t nd = dd.rows(), np = pc.tokens, max_rows = nd + np + 9, K = sel.topk;
    DeviceVec<int32_t> out(static_cast<size_t>(heads * max_rows * K));
    out.poison();
    const cpidx::Status st = cpidx::mixed_topk(*dec, nullptr, db.all_heads(), *pre, dp.inputs(pc),
                                               out.ptr, max_rows * K, K, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> all = out.download();
    const std::vector<int32_t> decode = gpu_decode(dd, sel);
    const std::vector<int32_t> prefill = gpu_prefill(pc, sel);
    for (int h = 0; h < heads; ++h) {
      const auto head = all.begin() + h * max_rows * K;
      EXPECT_TRUE(std::equal(head, head + nd * K, decode.begin() + h * nd * K)) << "decode head " << h;
      EXPECT_TRUE(std::equal(head + nd * K, head + (nd + np) * K, prefill.begin() + h * np * K))
          << "prefill head " << h;
      EXPECT_TRUE(std::all_of(head + (nd + np) * K, head + max_rows * K,
                              [](int32_t v) { return v == cpidx_test::kPoison; }))
          << "rows past the mixed batch were written, head " << h;
    }
  });
}

// A mixed batch's two parts on the device: 2 decode requests of 2 heads (5000 and 900 tokens,
// seed `seed`) and a bf16 prefill case (seed + 1), with a Decoder (plain, or rank `rank` of
// `world`) and a Prefiller for them, K = 16.
struct MixedParts {
  MixedParts(uint64_t seed, int prefill_heads, const std::vector<int32_t>& q_lens,
             const std::vector<int32_t>& context_lens, int world = 1, int rank = 0)
      : dd(cpidx_test::random_decode(seed, 2, 1, {5000, 900}, 8192)),
        pc(make_case(seed + 1, prefill_heads, q_lens, context_lens, DType::kBF16)),
        db(dd),
        dp(pc) {
    made = cpidx::Decoder::create(config_for(dd, sel, world, rank), 0, &dec).is_ok() &&
           cpidx::Prefiller::create(config_of(pc, sel), 0, &pre).is_ok();
  }
  const Selection sel = sel_of(16, 1, 2);
  const cpidx_test::DecodeData dd;
  const PrefillCase pc;
  DeviceBatch db;
  DevicePrefill dp;
  std::unique_ptr<cpidx::Decoder> dec;
  std::unique_ptr<cpidx::Prefiller> pre;
  bool made = false;
};

// A part is empty only at num_reqs == 0: a negative count (or prefill tokens without requests) is
// refused before anything runs, where it read as an empty part and left its rows unwritten.
TEST(GpuPrefill, MixedBatchRefusesNegativePartSizes) {
  SKIP_WITHOUT_GPU();
  MixedParts m(1720, 2, {40}, {3000});
  ASSERT_TRUE(m.made);
  const auto& [sel, dd, pc, db, dp, dec, pre, made] = m;
  const int64_t K = sel.topk, max_rows = dd.rows() + pc.tokens;
  DeviceVec<int32_t> out(static_cast<size_t>(2 * max_rows * K));
  struct Case {
    std::string name;
    int decode_reqs, prefill_reqs;
    int64_t prefill_tokens;
    std::string needle;
  };
  const int64_t tokens = pc.tokens;
  const std::vector<Case> cases = {
      {"decode num_reqs -5", -5, 1, tokens, "decode num_reqs must be >= 0 (0: no decode rows), got -5"},
      {"prefill num_reqs -1", dd.num_reqs(), -1, tokens,
       "prefill num_reqs must be >= 0 (0: no prefill rows), got -1"},
      {"prefill tokens without requests", dd.num_reqs(), 0, tokens,
       "prefill num_tokens must be 0 when its num_reqs is 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    cpidx::DecodeInputs d = db.all_heads();
    d.num_reqs = c.decode_reqs;
    cpidx::PrefillInputs p = dp.inputs(pc);
    p.num_reqs = c.prefill_reqs;
    p.num_tokens = c.prefill_tokens;
    out.poison();
    const cpidx::Status st =
        cpidx::mixed_topk(*dec, nullptr, d, *pre, p, out.ptr, max_rows * K, K, nullptr);
    EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> untouched = out.download();
    EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(),
                            [](int32_t v) { return v == cpidx_test::kPoison; }))
        << "a refused mixed batch wrote output";
  }
}

// An output on an input is refused before any kernel: the Prefiller's ids on cu_seqlens_q, and
// a mixed batch whose output rows (the decode part's, written first) reach the prefill part's
// context_lens. The inputs stay as they were; with the ids just past them, both are accepted.
TEST(GpuPrefill, OutputsOnInputsAreRefused) {
  SKIP_WITHOUT_GPU();
  MixedParts m(1730, 2, {40, 7}, {3000, 100});
  ASSERT_TRUE(m.made);
  const auto& [sel, dd, pc, db, dp, dec, pre, made] = m;
  const int64_t K = sel.topk, rows = dd.rows() + pc.tokens;
  // One int32 buffer: an input (cu_seqlens_q, or context_lens) and then room for every row.
  auto buffer_after = [&](const std::vector<int32_t>& input) {
    std::vector<int32_t> host(input);
    host.resize(input.size() + static_cast<size_t>(2 * rows * K), cpidx_test::kPoison);
    return host;
  };
  for (const bool mixed : {false, true}) {
    SCOPED_TRACE(mixed ? "mixed_topk" : "Prefiller::prefill");
    const std::vector<int32_t>& input = mixed ? pc.context_lens : pc.cu;
    const std::vector<int32_t> host = buffer_after(input);
    DeviceVec<int32_t> buf(host);
    cpidx::PrefillInputs p = dp.inputs(pc);
    (mixed ? p.context_lens : p.cu_seqlens_q) = buf.ptr;
    auto run = [&](int32_t* out) {
      if (!mixed) return pre->prefill(p, {out, pc.tokens * K, K}, nullptr);
      return cpidx::mixed_topk(*dec, nullptr, db.all_heads(), *pre, p, out, rows * K, K,
                               nullptr);
    };
    const cpidx::Status refused = run(buf.ptr + input.size() - 1);
    EXPECT_EQ(refused.code(), cpidx::StatusCode::kInvalidArgument) << refused.to_string();
    const std::string pair =
        mixed ? "ids output (out) and context_lens" : "ids output (out) and cu_seqlens_q";
    EXPECT_NE(refused.message().find(pair + " share memory"), std::string::npos)
        << refused.message();
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(buf.download(), host) << "a refused call wrote";
    const cpidx::Status ok = run(buf.ptr + input.size());
    EXPECT_TRUE(ok.is_ok()) << ok.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> after = buf.download();
    EXPECT_TRUE(std::equal(input.begin(), input.end(), after.begin()));
    EXPECT_NE(after[input.size()], cpidx_test::kPoison);
  }
  // A mixed batch's prefill error flag inside the decode part's rows: refused (the prefill would
  // OR its bits into decode ids); one flag of its own shared by both parts: accepted.
  DeviceVec<int32_t> out(static_cast<size_t>(2 * rows * K));
  DeviceVec<int32_t> shared_flag(1);
  CUDA_OK(cudaMemset(shared_flag.ptr, 0, sizeof(int32_t)));
  cpidx::DecodeInputs d = db.all_heads();
  cpidx::PrefillInputs p = dp.inputs(pc);
  p.error_flag = out.ptr + 3;
  out.poison();
  const cpidx::Status refused =
      cpidx::mixed_topk(*dec, nullptr, d, *pre, p, out.ptr, rows * K, K, nullptr);
  EXPECT_NE(refused.message().find("ids output (out) and prefill error_flag share memory"),
            std::string::npos)
      << refused.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> untouched = out.download();
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(),
                          [](int32_t v) { return v == cpidx_test::kPoison; }));
  d.error_flag = p.error_flag = shared_flag.ptr;
  const cpidx::Status ok = cpidx::mixed_topk(*dec, nullptr, d, *pre, p, out.ptr, rows * K, K,
                                             nullptr);
  EXPECT_TRUE(ok.is_ok()) << ok.to_string();
  CUDA_OK(cudaDeviceSynchronize());
}

// A prefill or a mixed batch whose launch fails returns the error and leaves none pending (the
// helper in gpu_util.h); so does clearing the Prefiller's flag.
TEST(GpuPrefill, FailedLaunchesLeaveNoErrorPending) {
  SKIP_WITHOUT_GPU();
  MixedParts m(1740, 2, {40, 7}, {3000, 100});
  ASSERT_TRUE(m.made);
  const auto& [sel, dd, pc, db, dp, dec, pre, made] = m;
  const int64_t K = sel.topk, rows = dd.rows() + pc.tokens;
  DeviceVec<int32_t> out(static_cast<size_t>(2 * rows * K));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto mixed = [&] {
    return cpidx::mixed_topk(*dec, nullptr, db.all_heads(), *pre, dp.inputs(pc), out.ptr,
                             rows * K, K, stream);
  };
  const std::vector<std::pair<std::string, std::function<cpidx::Status()>>> calls = {
      {"clear_error_flag", [&] { return pre->clear_error_flag(stream); }},
      {"prefill", [&] { return pre->prefill(dp.inputs(pc), {out.ptr, pc.tokens * K, K}, stream); }},
      {"mixed_topk", mixed},
  };
  for (const auto& [name, call] : calls) {
    SCOPED_TRACE(name);
    expect_failed_launch_leaves_nothing_pending(stream, call);
  }
  // The stream and both objects work again.
  out.poison();
  const cpidx::Status again = mixed();
  EXPECT_TRUE(again.is_ok()) << again.to_string();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
}

// A context-parallel mixed batch whose own part fails, or that has no decode rows, still joins
// cp_decode's agreement (-1, or 0), so a peer that runs cp_decode fails instead of waiting for
// this rank in a collective.
TEST(GpuPrefill, MixedBatchJoinsTheAgreementWhenItRunsNoContextParallelDecode) {
  SKIP_WITHOUT_GPU();
  MixedParts m(1710, 1, {40}, {3000}, 2, 0);
  ASSERT_TRUE(m.made);
  const auto& [sel, dd, pc, db, dp, dec, pre, made] = m;
  ASSERT_EQ(dec->geometry().local_heads, 1);
  const int64_t K = sel.topk, max_rows = dd.rows() + pc.tokens;
  DeviceVec<int32_t> out(static_cast<size_t>(max_rows * K));
  out.poison();
  const cpidx::DecodeInputs decode_rows = db.inputs(0, 1);  // this rank's one head
  cpidx::DecodeInputs no_decode_rows = decode_rows;
  no_decode_rows.num_reqs = 0;
  constexpr cpidx::MemorySpace kDevice = cpidx::MemorySpace::kDevice;
  auto mixed = [&](cpidx::Communicator& comm, const cpidx::DecodeInputs& d,
                   const cpidx::PrefillInputs& p) {
    return cpidx::mixed_topk(*dec, &comm, d, *pre, p, out.ptr, max_rows * K, K, nullptr);
  };

  cpidx::PrefillInputs bad_prefill = dp.inputs(pc);
  bad_prefill.q_row_stride += 4;  // refused by the Prefiller's checks
  ScriptedComm peer_decodes(0, 2, kDevice, dd.rows());
  cpidx::Status st = mixed(peer_decodes, decode_rows, bad_prefill);
  EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("index_query"), std::string::npos) << st.message();
  EXPECT_EQ(peer_decodes.offered, std::vector<long long>{-1});
  EXPECT_EQ(peer_decodes.labels, std::vector<std::string>{cpidx::kCpRowsAgreement});

  ScriptedComm peer_decodes_too(0, 2, kDevice, dd.rows());
  st = mixed(peer_decodes_too, no_decode_rows, dp.inputs(pc));
  EXPECT_EQ(st.code(), cpidx::StatusCode::kCommError) << st.to_string();
  EXPECT_EQ(peer_decodes_too.offered, std::vector<long long>{0});

  ScriptedComm peer_has_no_decode_rows(0, 2, kDevice, 0);
  st = mixed(peer_has_no_decode_rows, decode_rows, dp.inputs(pc));
  EXPECT_EQ(st.code(), cpidx::StatusCode::kCommError) << st.to_string();
  EXPECT_EQ(peer_has_no_decode_rows.offered, std::vector<long long>{dd.rows()});  // cp_decode's
  for (const ScriptedComm* p : {&peer_decodes, &peer_decodes_too, &peer_has_no_decode_rows}) {
    EXPECT_EQ(p->gathers, 0);
  }
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> untouched = out.download();
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(),
                          [](int32_t v) { return v == cpidx_test::kPoison; }))
      << "a refused mixed batch wrote output";

  // Both ranks without decode rows agree on 0: the prefill part runs.
  ScriptedComm peer_prefills_only(0, 2, kDevice, 0);
  st = mixed(peer_prefills_only, no_decode_rows, dp.inputs(pc));
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(peer_prefills_only.offered, std::vector<long long>{0});
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> prefilled = out.download();
  const std::vector<int32_t> want = gpu_prefill(pc, sel);
  EXPECT_TRUE(std::equal(want.begin(), want.end(), prefilled.begin()))
      << "the prefill rows of a batch without decode rows";
}

TEST(GpuPrefill, HostErrorsBeforeAnyKernel) {
  SKIP_WITHOUT_GPU();
  for_each_kernel([&] {
    const PrefillCase c = make_case(1800, 4, {20}, {100}, DType::kBF16);
    const Selection sel = sel_of(16);
    std::unique_ptr<cpidx::Prefiller> pre;
    cpidx::PrefillConfig bad = config_of(c, sel);
    bad.num_heads = 9;
    cpidx::Status st = cpidx::Prefiller::create(bad, 0, &pre);
    EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("num_heads"), std::string::npos) << st.message();
    bad = config_of(c, sel);
    bad.sel.topk = 65;
    EXPECT_EQ(cpidx::Prefiller::create(bad, 0, &pre).code(), cpidx::StatusCode::kUnsupported);

    ASSERT_TRUE(cpidx::Prefiller::create(config_of(c, sel, -10), 0, &pre).is_ok());  // 10 tokens
    DevicePrefill d(c);
    DeviceVec<int32_t> ids(static_cast<size_t>(4 * c.tokens * 16));
    ids.poison();
    const cpidx::TopkOutput out{ids.ptr, c.tokens * 16, 16};
    st = pre->prefill(d.inputs(c), out, nullptr);
    EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("max_tokens"), std::string::npos) << st.message();

    ASSERT_TRUE(cpidx::Prefiller::create(config_of(c, sel), 0, &pre).is_ok());
    cpidx::PrefillInputs in = d.inputs(c);
    in.cache.dtype = DType::kFP8E4M3;
    st = pre->prefill(in, out, nullptr);
    EXPECT_NE(st.message().find("dtype"), std::string::npos) << st.message();
    in = d.inputs(c);
    in.q_row_stride += 4;  // not a multiple of 8 elements
    st = pre->prefill(in, out, nullptr);
    EXPECT_NE(st.message().find("index_query"), std::string::npos) << st.message();
    in = d.inputs(c);
    in.num_reqs = cpidx::kMaxPrefillRequests + 1;  // the plan kernel's int32 loop would wrap
    st = pre->prefill(in, out, nullptr);
    EXPECT_NE(st.message().find("num_reqs must be <= 2^30"), std::string::npos) << st.message();
    st = pre->prefill(d.inputs(c), cpidx::TopkOutput{ids.ptr, 16, 16}, nullptr);  // heads overlap
    EXPECT_NE(st.message().find("ids strides"), std::string::npos) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> h = ids.download();
    EXPECT_TRUE(std::all_of(h.begin(), h.end(), [](int32_t v) { return v == cpidx_test::kPoison; }))
        << "a rejected call wrote output";
  });
}

}  // namespace
