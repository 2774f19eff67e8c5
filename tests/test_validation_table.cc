// Every public C++ entry point against every kind of host-visible bad input (CONTRACT.md
// section 8), table-driven: wrong dtype, shape and stride, null and misaligned pointers, K / D
// out of the compiled set, batch above max_tokens, geometry that does not divide, a sparse table
// given partly, query_len and scale out of range, rank disagreement. Each case checks the
// Status code, that the message names the argument and the expected value, and that every
// output (ids, keys, scores, table rows, error flag) still holds its poison.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpidx/indexer.h"
#include "cpidx/prefill.h"
#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;
using cpidx::DecodeInputs;
using cpidx::Key;
using cpidx::Selection;
using cpidx::Status;
using cpidx::StatusCode;

constexpr Key kKeyPoison = 0x5A5A5A5A5A5A5A5Aull;
constexpr uint32_t kScorePoison = 0x7FA5A5A5u;  // a NaN payload no scorer writes
constexpr StatusCode kInv = StatusCode::kInvalidArgument;
constexpr StatusCode kUnsup = StatusCode::kUnsupported;
constexpr int kT = 4;  // heads of the shared batch
constexpr int kK = 8;  // topk of the shared selection

// An address one byte past `p`: misaligned for every type wider than a byte. Never read.
template <typename T>
T* misalign(T* p) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + 1);
}

// 4 heads, Q = 2, a padding request; max_seq_len 1024 (8 blocks), so n = 6 rows.
const DecodeData& batch() {
  static const DecodeData d = random_decode(4242, kT, 2, {300, 0, 700}, 1024);
  return d;
}

struct Expected {
  StatusCode code = StatusCode::kInvalidArgument;
  std::vector<std::string> needles;  // the argument, the expected value, the value given
};

::testing::AssertionResult failed_as(const Status& s, const Expected& e) {
  if (s.is_ok()) return ::testing::AssertionFailure() << "accepted";
  if (s.code() != e.code) {
    return ::testing::AssertionFailure() << "code " << cpidx::to_string(s.code()) << ", want "
                                         << cpidx::to_string(e.code) << ": " << s.message();
  }
  for (const std::string& n : e.needles) {
    if (s.message().find(n) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks \"" << n << "\": " << s.message();
    }
  }
  return ::testing::AssertionSuccess();
}

bool all_poison(const std::vector<Key>& v) {
  return std::all_of(v.begin(), v.end(), [](Key k) { return k == kKeyPoison; });
}
bool all_poison(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(),
                     [](float f) { return cpidx::float_bits(f) == kScorePoison; });
}
bool all_poison(const std::vector<int32_t>& v) {
  return std::all_of(v.begin(), v.end(), [](int32_t x) { return x == kPoison; });
}

// ---- Decode inputs and the selection: every decode entry point ----------------------------

struct DecodeCase {
  std::string name;
  std::function<void(DecodeInputs&, Selection&)> edit;
  Expected expected;
  bool selection_only = false;               // block_scores takes no Selection
  std::vector<std::string> cp_needles = {};  // cp_decode's wording when it differs
};

std::vector<DecodeCase> decode_cases() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  using E = Expected;
  std::vector<DecodeCase> c = {
      // Selection: K out of the compiled set, negative forced counts.
      {"topk 0", [](auto&, auto& s) { s.topk = 0; }, E{kInv, {"topk", "[1, 64]", "got 0"}}, true},
      {"topk -3", [](auto&, auto& s) { s.topk = -3; }, E{kInv, {"topk", "[1, 64]", "got -3"}},
       true},
      {"topk 65", [](auto&, auto& s) { s.topk = 65; }, E{kUnsup, {"topk", "[1, 64]", "got 65"}},
       true},
      {"topk int max", [](auto&, auto& s) { s.topk = std::numeric_limits<int>::max(); },
       E{kUnsup, {"topk", "[1, 64]"}}, true},
      {"init -1", [](auto&, auto& s) { s.init_blocks = -1; },
       E{kInv, {"init_blocks", ">= 0", "got -1"}}, true},
      {"local -1", [](auto&, auto& s) { s.local_blocks = -1; },
       E{kInv, {"local_blocks", ">= 0", "got -1"}}, true},
      // Shape of the batch.
      {"query_len 0", [](auto& in, auto&) { in.query_len = 0; },
       E{kInv, {"query_len", "[1, 8]", "got 0"}}},
      {"query_len 9", [](auto& in, auto&) { in.query_len = 9; },
       E{kInv, {"query_len", "[1, 8]", "got 9"}}},
      {"query_len -1", [](auto& in, auto&) { in.query_len = -1; },
       E{kInv, {"query_len", "[1, 8]", "got -1"}}},
      {"num_reqs 0", [](auto& in, auto&) { in.num_reqs = 0; },
       E{kInv, {"num_reqs", ">= 1", "got 0"}}},
      {"num_reqs -2", [](auto& in, auto&) { in.num_reqs = -2; },
       E{kInv, {"num_reqs", ">= 1", "got -2"}}},
      {"max_seq_len 0", [](auto& in, auto&) { in.max_seq_len = 0; },
       E{kInv, {"max_seq_len", ">= 1", "got 0"}}},
      {"max_seq_len -128", [](auto& in, auto&) { in.max_seq_len = -128; },
       E{kInv, {"max_seq_len", ">= 1", "got -128"}}},
      // Scale.
      {"scale 0", [](auto& in, auto&) { in.scale = 0.0f; }, E{kInv, {"scale", "> 0 and finite"}}},
      {"scale -0", [](auto& in, auto&) { in.scale = -0.0f; }, E{kInv, {"scale", "> 0 and finite"}}},
      {"scale -1", [](auto& in, auto&) { in.scale = -1.0f; },
       E{kInv, {"scale", "> 0 and finite", "got -1"}}},
      {"scale nan", [=](auto& in, auto&) { in.scale = nan; }, E{kInv, {"scale", "> 0 and finite"}}},
      {"scale inf", [=](auto& in, auto&) { in.scale = inf; }, E{kInv, {"scale", "> 0 and finite"}}},
      {"scale -inf", [=](auto& in, auto&) { in.scale = -inf; },
       E{kInv, {"scale", "> 0 and finite"}}},
      // Query: heads, strides, pointer.
      {"num_heads 0",
       [](auto& in, auto&) { in.num_heads = 0; },
       E{kInv, {"num_heads", "[1, 8]", "got 0"}},
       false,
       {"num_heads", "local_heads", "got 0"}},
      {"num_heads 9",
       [](auto& in, auto&) { in.num_heads = 9; },
       E{kInv, {"num_heads", "[1, 8]", "got 9"}},
       false,
       {"num_heads", "local_heads", "got 9"}},
      {"q_head_stride 64", [](auto& in, auto&) { in.q_head_stride = 64; },
       E{kInv, {"q_head_stride", ">= 128", "got 64"}}},
      {"q_head_stride -128", [](auto& in, auto&) { in.q_head_stride = -128; },
       E{kInv, {"q_head_stride", ">= 128", "got -128"}}},
      {"q_row_stride 0", [](auto& in, auto&) { in.q_row_stride = 0; },
       E{kInv, {"q_row_stride", ">= 128", "got 0"}}},
      {"q_row_stride 127", [](auto& in, auto&) { in.q_row_stride = 127; },
       E{kInv, {"q_row_stride", ">= 128", "got 127"}}},
      {"q_row_stride -512", [](auto& in, auto&) { in.q_row_stride = -512; },
       E{kInv, {"q_row_stride", ">= 128", "got -512"}}},
      {"query null", [](auto& in, auto&) { in.query = nullptr; }, E{kInv, {"query is null"}}},
      {"query misaligned", [](auto& in, auto&) { in.query = misalign(in.query); },
       E{kInv, {"query", "2-byte aligned (bf16)"}}},
      // Cache: dtype, pages, pointer.
      {"dtype 7", [](auto& in, auto&) { in.cache.dtype = static_cast<cpidx::DType>(7); },
       E{kUnsup, {"dtype", "bf16 or fp8_e4m3", "7"}}},
      {"dtype -1", [](auto& in, auto&) { in.cache.dtype = static_cast<cpidx::DType>(-1); },
       E{kUnsup, {"dtype", "bf16 or fp8_e4m3", "-1"}}},
      {"num_pages 0", [](auto& in, auto&) { in.cache.num_pages = 0; },
       E{kInv, {"num_pages", ">= 1", "got 0"}}},
      {"num_pages -1", [](auto& in, auto&) { in.cache.num_pages = -1; },
       E{kInv, {"num_pages", ">= 1", "got -1"}}},
      {"cache null", [](auto& in, auto&) { in.cache.data = nullptr; },
       E{kInv, {"cache data is null"}}},
      {"cache misaligned bf16",
       [](auto& in, auto&) { in.cache.data = misalign(static_cast<const char*>(in.cache.data)); },
       E{kInv, {"cache data", "2-byte aligned (bf16)"}}},
      // Block table and lengths.
      {"block_table null", [](auto& in, auto&) { in.block_table = nullptr; },
       E{kInv, {"block_table is null"}}},
      {"block_table misaligned", [](auto& in, auto&) { in.block_table = misalign(in.block_table); },
       E{kInv, {"block_table", "4-byte aligned"}}},
      {"bt_row_stride 7", [](auto& in, auto&) { in.bt_row_stride = 7; },
       E{kInv, {"bt_row_stride", "cdiv(max_seq_len, 128) = 8", "got 7"}}},
      {"bt_row_stride 0", [](auto& in, auto&) { in.bt_row_stride = 0; },
       E{kInv, {"bt_row_stride", "= 8", "got 0"}}},
      {"bt_row_stride -10", [](auto& in, auto&) { in.bt_row_stride = -10; },
       E{kInv, {"bt_row_stride", "= 8", "got -10"}}},
      {"bt_row_stride below a larger bound",
       [](auto& in, auto&) { in.max_seq_len = 4096; },  // 32 blocks > the 10 columns given
       E{kInv, {"bt_row_stride", "= 32", "got 10"}}},
      {"seq_lens null", [](auto& in, auto&) { in.seq_lens = nullptr; },
       E{kInv, {"seq_lens is null"}}},
      {"seq_lens misaligned", [](auto& in, auto&) { in.seq_lens = misalign(in.seq_lens); },
       E{kInv, {"seq_lens", "4-byte aligned"}}},
  };
  return c;
}

void expect_decode_case(const DecodeCase& c) {
  SCOPED_TRACE(c.name);
  const DecodeData& d = batch();
  const int64_t n = d.rows();
  auto edited = [&](DecodeInputs in) {
    Selection sel{kK, 1, 1};
    c.edit(in, sel);
    return std::make_pair(in, sel);
  };
  const auto [in, sel] = edited(d.all_heads());

  EXPECT_TRUE(failed_as(cpidx::ref::validate(in, sel), c.expected)) << "validate";
  EXPECT_TRUE(failed_as(cpidx::ref::validate(in, sel, 1 << 20), c.expected)) << "validate bound";

  if (!c.selection_only) {
    std::vector<float> scores(static_cast<size_t>(kT * n * 64), cpidx::bits_float(kScorePoison));
    int32_t err = 0;
    EXPECT_TRUE(failed_as(cpidx::ref::block_scores(in, 1, 0, scores.data(), &err), c.expected))
        << "block_scores";
    EXPECT_TRUE(all_poison(scores)) << "block_scores wrote scores";
    EXPECT_EQ(err, 0);
  }
  for (int world : {1, 2}) {
    std::vector<Key> keys(static_cast<size_t>(kT * n * 64), kKeyPoison);
    int32_t err = 0;
    EXPECT_TRUE(failed_as(cpidx::ref::shard_topk_keys(in, sel, world, world - 1, keys.data(), &err),
                          c.expected))
        << "shard_topk_keys world " << world;
    EXPECT_TRUE(all_poison(keys)) << "shard_topk_keys wrote keys";
    EXPECT_EQ(err, 0);
  }
  {
    IdsBuffer ids(kT, n, kK);
    int32_t err = 0;
    EXPECT_TRUE(failed_as(cpidx::ref::decode_topk(in, sel, ids.out(), nullptr, &err), c.expected))
        << "decode_topk";
    EXPECT_TRUE(ids.all_poison());
    EXPECT_EQ(err, 0);
  }
  const Expected cp_expected{c.expected.code,
                             c.cp_needles.empty() ? c.expected.needles : c.cp_needles};
  {  // context-parallel, one rank
    cpidx::Geometry g;
    ASSERT_TRUE(cpidx::make_geometry(kT, 1, 0, &g).is_ok());
    auto comms = cpidx::make_thread_communicators(1);
    IdsBuffer ids(kT, n, kK);
    int32_t err = 0;
    EXPECT_TRUE(failed_as(cpidx::ref::cp_decode(*comms[0], g, in, sel, ids.out(), nullptr, &err),
                          cp_expected))
        << "cp_decode P=1";
    EXPECT_TRUE(ids.all_poison());
    EXPECT_EQ(err, 0);
  }
  // Context-parallel over 2 ranks with the bad input on rank 1 only: rank 1 names the
  // argument, rank 0 fails with a communicator error, nobody writes, nobody hangs.
  std::vector<Status> status(2);
  std::vector<IdsBuffer> ids;
  for (int r = 0; r < 2; ++r) ids.emplace_back(2, n, kK);
  std::vector<int32_t> errs(2, 0);
  run_ranks(2, [&](int r, cpidx::Communicator& comm) {
    cpidx::Geometry g;
    cpidx::make_geometry(kT, 2, r, &g);
    DecodeInputs local = d.inputs(g.head_offset, g.local_heads);
    Selection s{kK, 1, 1};
    if (r == 1) std::tie(local, s) = edited(local);
    const auto i = static_cast<size_t>(r);
    status[i] = cpidx::ref::cp_decode(comm, g, local, s, ids[i].out(), nullptr, &errs[i]);
  });
  EXPECT_TRUE(failed_as(status[1], cp_expected)) << "cp_decode P=2, bad rank";
  EXPECT_TRUE(failed_as(status[0], {StatusCode::kCommError, {"ranks disagree", "rejected"}}))
      << "cp_decode P=2, good rank";
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(ids[static_cast<size_t>(r)].all_poison()) << "rank " << r;
    EXPECT_EQ(errs[static_cast<size_t>(r)], 0) << "rank " << r;
  }
}

TEST(ValidationTable, DecodeInputsOnEveryDecodeEntryPoint) {
  const std::vector<DecodeCase> cases = decode_cases();
  EXPECT_GE(cases.size(), 40u);
  for (const auto& c : cases) expect_decode_case(c);
  // The untouched batch passes everywhere (the table's edits are what fail).
  IdsBuffer ids(kT, batch().rows(), kK);
  EXPECT_TRUE(cpidx::ref::decode_topk(batch().all_heads(), {kK, 1, 1}, ids.out(), nullptr, nullptr)
                  .is_ok());
}

TEST(ValidationTable, BatchAboveMaxTokens) {
  const DecodeInputs in = batch().all_heads();  // n = 6
  for (int64_t bound : {0, 1, 5}) {
    EXPECT_TRUE(failed_as(
        cpidx::ref::validate(in, {kK, 0, 1}, bound),
        {StatusCode::kInvalidArgument,
         {"num_reqs * query_len (6)", "exceeds max_tokens (" + std::to_string(bound) + ")"}}));
  }
  EXPECT_TRUE(cpidx::ref::validate(in, {kK, 0, 1}, 6).is_ok());
  EXPECT_TRUE(cpidx::ref::validate(in, {kK, 0, 1}, -1).is_ok()) << "a negative bound skips";
}

TEST(ValidationTable, ShardArguments) {
  const DecodeInputs in = batch().all_heads();
  const Selection sel{kK, 0, 1};
  const int64_t n = batch().rows();
  struct Case {
    std::string name;
    int world, rank;
    bool null_out, misaligned_out;
    Expected e;
  };
  const std::vector<Case> cases = {
      {"world 0", 0, 0, false, false, {kInv, {"world", ">= 1", "got 0"}}},
      {"world -1", -1, 0, false, false, {kInv, {"world", ">= 1", "got -1"}}},
      {"rank -1", 2, -1, false, false, {kInv, {"rank", "[0, 2)", "got -1"}}},
      {"rank = world", 2, 2, false, false, {kInv, {"rank", "[0, 2)", "got 2"}}},
      {"null out", 1, 0, true, false, {kInv, {"is null"}}},
      {"misaligned out", 1, 0, false, true, {kInv, {"4-byte aligned"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<float> scores(static_cast<size_t>(kT * n * 8) + 1, cpidx::bits_float(kScorePoison));
    float* s_out = c.null_out         ? nullptr
                   : c.misaligned_out ? misalign(scores.data())
                                      : scores.data();
    int32_t err = 0;
    EXPECT_TRUE(failed_as(cpidx::ref::block_scores(in, c.world, c.rank, s_out, &err), c.e));
    EXPECT_TRUE(all_poison(scores));
    std::vector<Key> keys(static_cast<size_t>(kT * n * kK) + 1, kKeyPoison);
    Key* k_out = c.null_out ? nullptr : c.misaligned_out ? misalign(keys.data()) : keys.data();
    Expected ke = c.e;
    if (c.misaligned_out) ke.needles = {"keys", "8-byte aligned"};
    EXPECT_TRUE(failed_as(cpidx::ref::shard_topk_keys(in, sel, c.world, c.rank, k_out, &err), ke));
    EXPECT_TRUE(all_poison(keys));
    EXPECT_EQ(err, 0);
  }
}

// ---- Outputs: ids strides and the sparse table ---------------------------------------------

struct IdsCase {
  std::string name;
  std::function<cpidx::TopkOutput(int32_t* base, int heads, int64_t rows)> out;
  bool accepted = false;  // a legal layout, listed to pin the rule down
  std::vector<std::string> needles = {};
};

std::vector<IdsCase> ids_cases() {
  using O = cpidx::TopkOutput;
  const std::vector<std::string> strides = {"ids strides", "topk = 8", "without overlap"};
  return {
      {"null",
       [](int32_t*, int, int64_t) {
         return O{nullptr, 0, 0};
       },
       false,
       {"ids output is null"}},
      {"misaligned",
       [](int32_t* b, int, int64_t r) {
         return O{misalign(b), r * kK, kK};
       },
       false,
       {"ids output", "4-byte aligned"}},
      {"row stride < topk",
       [](int32_t* b, int, int64_t r) {
         return O{b, r * kK, kK - 1};
       },
       false, strides},
      {"row stride 0",
       [](int32_t* b, int, int64_t) {
         return O{b, 0, 0};
       },
       false, strides},
      {"negative row stride",
       [](int32_t* b, int, int64_t r) {
         return O{b, r * kK, -kK};
       },
       false, strides},
      {"heads overlap rows",
       [](int32_t* b, int, int64_t r) {
         return O{b, (r - 1) * kK, kK};
       },
       false, strides},
      {"head stride 0",
       [](int32_t* b, int, int64_t) {
         return O{b, 0, kK};
       },
       false, strides},
      {"negative head stride",
       [](int32_t* b, int, int64_t r) {
         return O{b, -r * kK, kK};
       },
       false, strides},
      {"interleaved rows overlap",
       [](int32_t* b, int h, int64_t) {
         return O{b, kK, (h - 1) * kK};
       },
       false, strides},
      {"huge strides do not overflow the check",
       [](int32_t* b, int, int64_t) {
         return O{b, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
       },
       false, strides},
      // Legal layouts: [heads, n, K] and [n, heads, K], with gaps.
      {"head-major",
       [](int32_t* b, int, int64_t r) {
         return O{b, r * kK, kK};
       },
       true},
      {"row-major",
       [](int32_t* b, int h, int64_t) {
         return O{b, kK, h * kK};
       },
       true},
      {"head-major with gaps",
       [](int32_t* b, int, int64_t r) {
         return O{b, r * (kK + 3) + 5, kK + 3};
       },
       true},
  };
}

// Calls fn(out) with a poisoned buffer big enough for any listed legal layout; checks the
// outcome and that a rejected call wrote nothing.
void expect_ids_case(const IdsCase& c, int heads, int64_t rows, const char* where,
                     const std::function<Status(const cpidx::TopkOutput&)>& fn) {
  std::vector<int32_t> buf(static_cast<size_t>(heads * rows * (kK + 3) + 16), kPoison);
  const Status s = fn(c.out(buf.data(), heads, rows));
  if (c.accepted) {
    EXPECT_TRUE(s.is_ok()) << c.name << " @" << where << ": " << s.to_string();
    return;
  }
  EXPECT_TRUE(failed_as(s, {StatusCode::kInvalidArgument, c.needles})) << c.name << " @" << where;
  EXPECT_TRUE(all_poison(buf)) << c.name << " @" << where << " wrote ids";
}

TEST(ValidationTable, IdsOutputOnEveryEntryPoint) {
  const DecodeData& d = batch();
  const int64_t n = d.rows();
  const Selection sel{kK, 0, 1};
  // Prefill: 5 tokens of 2 requests on 2 heads.
  std::vector<int32_t> cu = {0, 3, 5}, ctx = {10, 200}, seq = {13, 202};
  const cpidx::PrefillInputs pre = prefill_over(d, 2, 5, cu.data(), ctx.data(), seq.data(), 2);
  std::vector<Key> keys(static_cast<size_t>(kT * n * kK));
  ASSERT_TRUE(cpidx::ref::shard_topk_keys(d.all_heads(), sel, 1, 0, keys.data(), nullptr).is_ok());

  for (const IdsCase& c : ids_cases()) {
    expect_ids_case(c, kT, n, "decode_topk", [&](const cpidx::TopkOutput& o) {
      int32_t err = 0;
      const Status s = cpidx::ref::decode_topk(d.all_heads(), sel, o, nullptr, &err);
      if (!s.is_ok()) {
        EXPECT_EQ(err, 0);
      }
      return s;
    });
    expect_ids_case(c, kT, n, "cp_decode", [&](const cpidx::TopkOutput& o) {
      cpidx::Geometry g;
      cpidx::make_geometry(kT, 1, 0, &g);
      auto comms = cpidx::make_thread_communicators(1);
      return cpidx::ref::cp_decode(*comms[0], g, d.all_heads(), sel, o, nullptr, nullptr);
    });
    expect_ids_case(c, kT, n, "merge_topk_keys", [&](const cpidx::TopkOutput& o) {
      return cpidx::ref::merge_topk_keys(keys.data(), 1, kT, n, sel, 0, kT, d.seq_lens.data(),
                                         d.num_reqs(), d.query_len, d.max_seq_len, o, nullptr);
    });
    expect_ids_case(c, 2, 5, "prefill_topk", [&](const cpidx::TopkOutput& o) {
      return cpidx::ref::prefill_topk(pre, sel, o, nullptr);
    });
  }
}

struct TableCase {
  std::string name;
  std::function<void(cpidx::SparseTableOutput&)> edit;
  std::vector<std::string> needles;
  int heads = 1;
  bool batch_check = false;  // needs the batch shape: not seen by validate(table, heads)
};

std::vector<TableCase> table_cases() {
  const std::vector<std::string> partly = {"all together or not at all", "attention_block_table",
                                           "block_page_stride"};
  using T = cpidx::SparseTableOutput;
  std::vector<TableCase> c = {
      {"block_page_stride 12",
       [](T& t) { t.block_page_stride = 12; },
       {"block_page_stride", "8 or 16", "got 12"}},
      {"block_page_stride -8",
       [](T& t) { t.block_page_stride = -8; },
       {"block_page_stride", "8 or 16", "got -8"}},
      {"two heads", [](T&) {}, {"local_heads == 1", "got 2"}, 2},
      {"table_row_stride",
       [](T& t) { t.table_row_stride = kK * 8 - 1; },
       {"table_row_stride", "topk * 8 = 64", "got 63"},
       1,
       true},
      {"table_row_stride negative",
       [](T& t) { t.table_row_stride = -64; },
       {"table_row_stride", "topk * 8 = 64", "got -64"},
       1,
       true},
      {"attn_bt_row_stride",
       [](T& t) { t.attn_bt_row_stride = 7; },
       {"attn_bt_row_stride", "cdiv(max_seq_len, 128) = 8", "got 7"},
       1,
       true},
      {"table misaligned", [](T& t) { t.table = misalign(t.table); }, {"4-byte aligned"}},
      {"context_lens misaligned",
       [](T& t) { t.context_lens = misalign(t.context_lens); },
       {"4-byte aligned"}},
      {"attention_block_table misaligned",
       [](T& t) { t.attention_block_table = misalign(t.attention_block_table); },
       {"4-byte aligned"}},
  };
  // Every way of giving the four arguments partly (1, 2 or 3 of 4): 14 combinations.
  for (int mask = 1; mask < 15; ++mask) {
    c.push_back({"partly, mask " + std::to_string(mask),
                 [mask](T& t) {
                   if (!(mask & 1)) t.attention_block_table = nullptr;
                   if (!(mask & 2)) t.table = nullptr;
                   if (!(mask & 4)) t.context_lens = nullptr;
                   if (!(mask & 8)) t.block_page_stride = 0;
                 },
                 partly});
  }
  return c;
}

TEST(ValidationTable, SparseTableOnEveryEntryPoint) {
  const DecodeData& d = batch();
  const int64_t n = d.rows(), G = d.max_blocks();
  const Selection sel{kK, 0, 1};
  std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G), 3);
  std::vector<int32_t> sel_ids(static_cast<size_t>(n * kK), 0);
  std::vector<Key> keys(static_cast<size_t>(kT * n * kK));
  ASSERT_TRUE(cpidx::ref::shard_topk_keys(d.all_heads(), sel, 1, 0, keys.data(), nullptr).is_ok());
  // The scoring calls take a batch whose scoring would raise the error flag (a length past
  // max_seq_len), so a table refused only after scoring shows in `err`.
  DecodeData flagged = d;
  flagged.seq_lens[0] = 5000;
  int checked = 0;
  for (const TableCase& c : table_cases()) {
    SCOPED_TRACE(c.name);
    std::vector<int32_t> table(static_cast<size_t>(n * kK * 8 + 1), kPoison);
    std::vector<int32_t> ctx(static_cast<size_t>(n + 1), kPoison);
    cpidx::SparseTableOutput t{attn.data(), G, table.data(), kK * 8, ctx.data(), 8};
    c.edit(t);
    const Expected e{StatusCode::kInvalidArgument, c.needles};
    IdsBuffer ids(c.heads, n, kK);
    int32_t err = 0;
    if (!c.batch_check) {
      EXPECT_TRUE(failed_as(cpidx::ref::validate(t, c.heads), e)) << "validate";
    }
    EXPECT_TRUE(
        failed_as(
            cpidx::ref::decode_topk(flagged.inputs(0, c.heads), sel, ids.out(), &t, &err), e))
        << "decode_topk";
    EXPECT_EQ(err, 0) << "decode_topk scored before rejecting the table";
    cpidx::Geometry g;
    ASSERT_TRUE(cpidx::make_geometry(c.heads, 1, 0, &g).is_ok());
    auto comms = cpidx::make_thread_communicators(1);
    EXPECT_TRUE(failed_as(
        cpidx::ref::cp_decode(*comms[0], g, flagged.inputs(0, c.heads), sel, ids.out(), &t, &err),
        e))
        << "cp_decode";
    EXPECT_EQ(err, 0) << "cp_decode scored before rejecting the table";
    EXPECT_TRUE(failed_as(
        cpidx::ref::merge_topk_keys(keys.data(), 1, kT, n, sel, 0, c.heads, d.seq_lens.data(),
                                    d.num_reqs(), d.query_len, d.max_seq_len, ids.out(), &t),
        e))
        << "merge_topk_keys";
    EXPECT_TRUE(ids.all_poison());
    if (c.heads == 1) {
      EXPECT_TRUE(
          failed_as(cpidx::ref::sparse_table(sel_ids.data(), kK, d.seq_lens.data(), d.num_reqs(),
                                             d.query_len, d.max_seq_len, kK, t),
                    e))
          << "sparse_table";
    }
    EXPECT_TRUE(all_poison(table));
    EXPECT_TRUE(all_poison(ctx));
    ++checked;
  }
  EXPECT_EQ(checked, 23);
}

// sparse_table's own batch arguments.
TEST(ValidationTable, SparseTableBatchArguments) {
  const DecodeData& d = batch();
  const int64_t n = d.rows(), G = d.max_blocks();
  std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G), 3);
  std::vector<int32_t> ids(static_cast<size_t>(n * kK), 0);
  struct Case {
    std::string name;
    const int32_t* ids;
    int64_t ids_row_stride;
    const int32_t* seq_lens;
    int num_reqs, query_len;
    int32_t max_seq_len;
    int topk;
    Expected e;
  };
  const int32_t* s = d.seq_lens.data();
  const int R = d.num_reqs(), Q = d.query_len;
  const std::vector<Case> cases = {
      {"ids null", nullptr, kK, s, R, Q, 1024, kK, {kInv, {"ids is null"}}},
      {"seq_lens null", ids.data(), kK, nullptr, R, Q, 1024, kK, {kInv, {"seq_lens is null"}}},
      {"ids misaligned", misalign(ids.data()), kK, s, R, Q, 1024, kK,
       {kInv, {"ids must be 4-byte aligned"}}},
      {"seq_lens misaligned", ids.data(), kK, misalign(s), R, Q, 1024, kK,
       {kInv, {"seq_lens must be 4-byte aligned"}}},
      {"ids_row_stride",
       ids.data(),
       kK - 1,
       s,
       R,
       Q,
       1024,
       kK,
       {kInv, {"ids_row_stride", "topk = 8", "got 7"}}},
      {"num_reqs 0", ids.data(), kK, s, 0, Q, 1024, kK, {kInv, {"num_reqs", ">= 1", "got 0"}}},
      {"query_len 0", ids.data(), kK, s, R, 0, 1024, kK, {kInv, {"query_len", "[1, 8]", "got 0"}}},
      {"query_len 9", ids.data(), kK, s, R, 9, 1024, kK, {kInv, {"query_len", "[1, 8]", "got 9"}}},
      {"max_seq_len 0", ids.data(), kK, s, R, Q, 0, kK, {kInv, {"max_seq_len", ">= 1", "got 0"}}},
      {"topk 0", ids.data(), kK, s, R, Q, 1024, 0, {kInv, {"topk", "[1, 64]", "got 0"}}},
      {"topk 65", ids.data(), kK, s, R, Q, 1024, 65, {kInv, {"topk", "[1, 64]", "got 65"}}},
      {"attn stride for a larger bound",
       ids.data(),
       kK,
       s,
       R,
       Q,
       4096,
       kK,
       {kInv, {"attn_bt_row_stride", "= 32", "got 8"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<int32_t> table(static_cast<size_t>(n * 65 * 8), kPoison);
    std::vector<int32_t> ctx(static_cast<size_t>(n), kPoison);
    cpidx::SparseTableOutput t{attn.data(), G, table.data(), 65 * 8, ctx.data(), 16};
    EXPECT_TRUE(failed_as(cpidx::ref::sparse_table(c.ids, c.ids_row_stride, c.seq_lens, c.num_reqs,
                                                   c.query_len, c.max_seq_len, c.topk, t),
                          c.e));
    EXPECT_TRUE(all_poison(table));
    EXPECT_TRUE(all_poison(ctx));
  }
}

// ---- Merge ---------------------------------------------------------------------------------

TEST(ValidationTable, MergeArguments) {
  const DecodeData& d = batch();
  const int64_t n = d.rows();
  const Selection sel{kK, 0, 1};
  std::vector<Key> keys(static_cast<size_t>(2 * kT * n * kK) + 1);
  ASSERT_TRUE(cpidx::ref::shard_topk_keys(d.all_heads(), sel, 1, 0, keys.data(), nullptr).is_ok());
  struct Case {
    std::string name;
    std::function<void(const Key*&, int& world, int& total, int64_t& n, Selection&, int& offset,
                       int& local, int& reqs, int& q)>
        edit;
    Expected e;
  };
  const std::vector<Case> cases = {
      {"world 0", [](auto&, int& w, auto&...) { w = 0; }, {kInv, {"world", ">= 1", "got 0"}}},
      {"total_heads 0",
       [](auto&, int&, int& t, auto&...) { t = 0; },
       {kInv, {"total_heads", "[1, 8]", "got 0"}}},
      {"total_heads 9",
       [](auto&, int&, int& t, auto&...) { t = 9; },
       {kInv, {"total_heads", "[1, 8]", "got 9"}}},
      {"topk 0",
       [](auto&, int&, int&, int64_t&, Selection& s, auto&...) { s.topk = 0; },
       {kInv, {"topk", "[1, 64]", "got 0"}}},
      {"topk 65",
       [](auto&, int&, int&, int64_t&, Selection& s, auto&...) { s.topk = 65; },
       {StatusCode::kUnsupported, {"topk", "[1, 64]", "got 65"}}},
      {"init -1",
       [](auto&, int&, int&, int64_t&, Selection& s, auto&...) { s.init_blocks = -1; },
       {kInv, {"init_blocks", ">= 0"}}},
      {"head_offset -1",
       [](auto&, int&, int&, int64_t&, Selection&, int& o, auto&...) { o = -1; },
       {kInv, {"head_offset", "must lie in [0, 4)"}}},
      {"owned heads past T",
       [](auto&, int&, int&, int64_t&, Selection&, int& o, int& l, auto&...) { o = 3, l = 2; },
       {kInv, {"[3, 5)", "must lie in [0, 4)"}}},
      {"local_heads 0",
       [](auto&, int&, int&, int64_t&, Selection&, int&, int& l, auto&...) { l = 0; },
       {kInv, {"local_heads", "must lie in [0, 4)"}}},
      {"query_len 0",
       [](auto&, int&, int&, int64_t&, Selection&, int&, int&, int&, int& q) { q = 0; },
       {kInv, {"query_len", "[1, 8]", "got 0"}}},
      {"query_len 9",
       [](auto&, int&, int&, int64_t&, Selection&, int&, int&, int&, int& q) { q = 9; },
       {kInv, {"query_len", "[1, 8]", "got 9"}}},
      {"n mismatch",
       [](auto&, int&, int&, int64_t& rows, auto&...) { rows = 5; },
       {kInv, {"n must equal num_reqs * query_len = 6", "got 5"}}},
      {"num_reqs -3",
       [](auto&, int&, int&, int64_t& rows, Selection&, int&, int&, int& r, int&) {
         r = -3, rows = -6;
       },
       {kInv, {"num_reqs", ">= 0", "got -3"}}},
      {"gathered null",
       [](const Key*& g, auto&...) { g = nullptr; },
       {kInv, {"gathered keys are null"}}},
      {"gathered misaligned",
       [](const Key*& g, auto&...) { g = misalign(g); },
       {kInv, {"gathered keys", "8-byte aligned"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const Key* g = keys.data();
    int world = 1, total = kT, offset = 0, local = kT, reqs = d.num_reqs(), q = d.query_len;
    int64_t rows = n;
    Selection s = sel;
    c.edit(g, world, total, rows, s, offset, local, reqs, q);
    IdsBuffer ids(kT, n, kK);
    EXPECT_TRUE(failed_as(
        cpidx::ref::merge_topk_keys(g, world, total, rows, s, offset, local, d.seq_lens.data(),
                                    reqs, q, d.max_seq_len, ids.out(), nullptr),
        c.e));
    EXPECT_TRUE(ids.all_poison());
  }
  {  // with the sparse table, which reads seq_lens: aligned, as every other int32 input
    const int64_t G = d.max_blocks();
    std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G), 3);
    std::vector<int32_t> table(static_cast<size_t>(n * kK * 8), kPoison);
    std::vector<int32_t> ctx(static_cast<size_t>(n), kPoison);
    const cpidx::SparseTableOutput t{attn.data(), G, table.data(), kK * 8, ctx.data(), 8};
    IdsBuffer ids(1, n, kK);
    EXPECT_TRUE(failed_as(cpidx::ref::merge_topk_keys(keys.data(), 1, kT, n, sel, 0, 1,
                                                      misalign(d.seq_lens.data()), d.num_reqs(),
                                                      d.query_len, d.max_seq_len, ids.out(), &t),
                          {kInv, {"seq_lens must be 4-byte aligned"}}));
    EXPECT_TRUE(ids.all_poison());
    EXPECT_TRUE(all_poison(table));
    EXPECT_TRUE(all_poison(ctx));
  }
}

// ---- Prefill -------------------------------------------------------------------------------

TEST(ValidationTable, PrefillInputs) {
  const DecodeData& d = batch();
  std::vector<int32_t> cu = {0, 3, 5}, ctx = {10, 200}, seq = {13, 202};
  cpidx::PrefillInputs good;
  good.query = d.query.data();
  good.q_row_stride = kT * kD;
  good.q_head_stride = kD;
  good.num_heads = 2;
  good.cache = d.all_heads().cache;
  good.block_table = d.block_table.data();
  good.bt_row_stride = d.bt_row_stride;
  good.cu_seqlens_q = cu.data();
  good.context_lens = ctx.data();
  good.seq_lens = seq.data();
  good.num_reqs = 2;
  good.num_tokens = 5;
  good.max_seq_len = d.max_seq_len;
  using P = cpidx::PrefillInputs;
  struct Case {
    std::string name;
    std::function<void(P&, Selection&)> edit;
    Expected e;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Case> cases = {
      {"topk 0", [](P&, Selection& s) { s.topk = 0; }, {kInv, {"topk", "[1, 64]", "got 0"}}},
      {"topk 65", [](P&, Selection& s) { s.topk = 65; }, {kUnsup, {"topk", "[1, 64]", "got 65"}}},
      {"local -1", [](P&, Selection& s) { s.local_blocks = -1; }, {kInv, {"local_blocks", ">= 0"}}},
      {"num_tokens 0",
       [](P& p, Selection&) { p.num_tokens = 0; },
       {kInv, {"num_tokens", ">= 1", "got 0"}}},
      {"num_tokens -5",
       [](P& p, Selection&) { p.num_tokens = -5; },
       {kInv, {"num_tokens", ">= 1", "got -5"}}},
      {"num_reqs 0", [](P& p, Selection&) { p.num_reqs = 0; }, {kInv, {"num_reqs", ">= 1"}}},
      {"max_seq_len 0",
       [](P& p, Selection&) { p.max_seq_len = 0; },
       {kInv, {"max_seq_len", ">= 1", "got 0"}}},
      {"scale nan", [=](P& p, Selection&) { p.scale = nan; }, {kInv, {"scale", "> 0 and finite"}}},
      {"scale -2", [](P& p, Selection&) { p.scale = -2; }, {kInv, {"scale", "> 0 and finite"}}},
      {"num_heads 9",
       [](P& p, Selection&) { p.num_heads = 9; },
       {kInv, {"num_heads", "[1, 8]", "got 9"}}},
      {"q_head_stride 1",
       [](P& p, Selection&) { p.q_head_stride = 1; },
       {kInv, {"q_head_stride", ">= 128", "got 1"}}},
      {"q_row_stride 64",
       [](P& p, Selection&) { p.q_row_stride = 64; },
       {kInv, {"q_row_stride", ">= 128", "got 64"}}},
      {"query null", [](P& p, Selection&) { p.query = nullptr; }, {kInv, {"query is null"}}},
      {"query misaligned",
       [](P& p, Selection&) { p.query = misalign(p.query); },
       {kInv, {"query", "2-byte aligned"}}},
      {"dtype 2",
       [](P& p, Selection&) { p.cache.dtype = static_cast<cpidx::DType>(2); },
       {kUnsup, {"dtype", "bf16 or fp8_e4m3"}}},
      {"cache null",
       [](P& p, Selection&) { p.cache.data = nullptr; },
       {kInv, {"cache data is null"}}},
      {"num_pages 0",
       [](P& p, Selection&) { p.cache.num_pages = 0; },
       {kInv, {"num_pages", ">= 1"}}},
      {"block_table null",
       [](P& p, Selection&) { p.block_table = nullptr; },
       {kInv, {"block_table is null"}}},
      {"bt_row_stride 3",
       [](P& p, Selection&) { p.bt_row_stride = 3; },
       {kInv, {"bt_row_stride", "= 8", "got 3"}}},
      {"cu_seqlens_q null",
       [](P& p, Selection&) { p.cu_seqlens_q = nullptr; },
       {kInv, {"cu_seqlens_q is null"}}},
      {"cu_seqlens_q misaligned",
       [](P& p, Selection&) { p.cu_seqlens_q = misalign(p.cu_seqlens_q); },
       {kInv, {"cu_seqlens_q", "4-byte aligned"}}},
      {"context_lens null",
       [](P& p, Selection&) { p.context_lens = nullptr; },
       {kInv, {"context_lens is null"}}},
      {"context_lens misaligned",
       [](P& p, Selection&) { p.context_lens = misalign(p.context_lens); },
       {kInv, {"context_lens", "4-byte aligned"}}},
      {"seq_lens null",
       [](P& p, Selection&) { p.seq_lens = nullptr; },
       {kInv, {"seq_lens is null"}}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    P in = good;
    Selection sel{6, 0, 1};
    c.edit(in, sel);
    EXPECT_TRUE(failed_as(cpidx::ref::validate(in, sel), c.e)) << "validate";
    IdsBuffer ids(2, 5, 6);
    int32_t err = 0;
    EXPECT_TRUE(failed_as(cpidx::ref::prefill_topk(in, sel, ids.out(), &err), c.e));
    EXPECT_TRUE(ids.all_poison());
    EXPECT_EQ(err, 0);
  }
  IdsBuffer ids(2, 5, 6);
  EXPECT_TRUE(cpidx::ref::prefill_topk(good, {6, 0, 1}, ids.out(), nullptr).is_ok());
}

// ---- Geometry ------------------------------------------------------------------------------

TEST(ValidationTable, Geometry) {
  struct Case {
    int t, p, r;
    bool null_out;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {4, 1, 0, true, {"geometry output is null"}},
      {0, 1, 0, false, {"total_heads", "[1, 8]", "got 0"}},
      {9, 1, 0, false, {"total_heads", "[1, 8]", "got 9"}},
      {-4, 1, 0, false, {"total_heads", "[1, 8]", "got -4"}},
      {4, 0, 0, false, {"world_size", ">= 1", "got 0"}},
      {4, -2, 0, false, {"world_size", ">= 1", "got -2"}},
      {4, 2, -1, false, {"rank", "[0, 2)", "got -1"}},
      {4, 2, 2, false, {"rank", "[0, 2)", "got 2"}},
      {3, 2, 0, false, {"total_heads (3)", "world_size (2)", "total_heads % world_size == 0"}},
      {4, 3, 0, false, {"total_heads (4)", "world_size (3)", "do not divide"}},
      {4, 6, 0, false, {"total_heads (4)", "world_size (6)", "world_size % total_heads == 0"}},
      {8, 12, 5, false, {"total_heads (8)", "world_size (12)"}},
      {3, 8, 0, false, {"total_heads (3)", "world_size (8)"}},
  };
  for (const auto& c : cases) {
    cpidx::Geometry g;
    g.local_heads = 77;
    const Status s = cpidx::make_geometry(c.t, c.p, c.r, c.null_out ? nullptr : &g);
    EXPECT_TRUE(failed_as(s, {StatusCode::kInvalidArgument, c.needles}))
        << "T=" << c.t << " P=" << c.p << " r=" << c.r;
    EXPECT_EQ(g.local_heads, 77) << "the output was written";
  }
}

// ---- Context-parallel specifics: geometry vs communicator, rank disagreement -----------------

TEST(ValidationTable, ContextParallelGeometryAndCommunicator) {
  const DecodeData& d = batch();
  const Selection sel{kK, 0, 1};
  struct Case {
    std::string name;
    int comm_world;
    std::function<cpidx::Geometry(int rank)> geo;
    std::vector<std::string> needles;
  };
  auto made = [](int t, int p, int r) {
    cpidx::Geometry g;
    cpidx::make_geometry(t, p, r, &g);
    return g;
  };
  const std::vector<Case> cases = {
      {"geometry for 4 ranks on 2",
       2,
       [&](int r) { return made(kT, 4, r); },
       {"communicator (rank", "of 2) does not match geometry", "of 4)"}},
      {"geometry of another rank",
       2,
       [&](int r) { return made(kT, 2, 1 - r); },
       {"does not match geometry"}},
      {"hand-edited head_offset",
       2,
       [&](int r) {
         cpidx::Geometry g = made(kT, 2, r);
         g.head_offset = 1;
         return g;
       },
       {"geometry fields are inconsistent", "make_geometry"}},
      {"geometry that does not divide",
       2,
       [&](int r) {
         cpidx::Geometry g = made(kT, 2, r);
         g.total_heads = 3;
         return g;
       },
       {"total_heads (3)", "world_size (2)"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<Status> status(static_cast<size_t>(c.comm_world));
    std::vector<IdsBuffer> ids;
    for (int r = 0; r < c.comm_world; ++r) ids.emplace_back(2, d.rows(), kK);
    run_ranks(c.comm_world, [&](int r, cpidx::Communicator& comm) {
      const auto i = static_cast<size_t>(r);
      status[i] = cpidx::ref::cp_decode(comm, c.geo(r), d.inputs(2 * r, 2), sel, ids[i].out(),
                                        nullptr, nullptr);
    });
    for (int r = 0; r < c.comm_world; ++r) {
      EXPECT_TRUE(
          failed_as(status[static_cast<size_t>(r)], {StatusCode::kInvalidArgument, c.needles}))
          << "rank " << r;
      EXPECT_TRUE(ids[static_cast<size_t>(r)].all_poison());
    }
  }
  // A device-memory communicator cannot serve the CPU reference.
  class DeviceComm final : public cpidx::Communicator {
   public:
    int rank() const override { return 0; }
    int world_size() const override { return 1; }
    cpidx::MemorySpace memory_space() const override { return cpidx::MemorySpace::kDevice; }
    Status all_gather(const void*, void*, size_t, cudaStream_t) override {
      ++gathers;
      return Status::ok();
    }
    Status barrier() override { return Status::ok(); }
    int gathers = 0;
  } comm;
  IdsBuffer ids(kT, d.rows(), kK);
  const Status s =
      cpidx::ref::cp_decode(comm, made(kT, 1, 0), d.all_heads(), sel, ids.out(), nullptr, nullptr);
  EXPECT_TRUE(failed_as(s, {StatusCode::kInvalidArgument, {"host-memory communicator"}}));
  EXPECT_TRUE(ids.all_poison());
}

TEST(ValidationTable, RanksDisagreeOnSettings) {
  const DecodeData& d = batch();
  struct Case {
    std::string name;
    std::function<void(DecodeInputs&, Selection&)> edit;  // applied on rank 1 of 2
    std::vector<std::string> needles;
  };
  // Every edit keeps rank 1's own inputs valid and its row count equal to rank 0's.
  const std::vector<Case> cases = {
      {"topk",
       [](DecodeInputs&, Selection& s) { s.topk = 4; },
       {"ranks disagree on topk", "[8, 4]"}},
      {"init_blocks",
       [](DecodeInputs&, Selection& s) { s.init_blocks = 2; },
       {"ranks disagree on init_blocks", "[1, 2]"}},
      {"local_blocks",
       [](DecodeInputs&, Selection& s) { s.local_blocks = 0; },
       {"ranks disagree on local_blocks", "[1, 0]"}},
      {"query_len (same rows)",
       [](DecodeInputs& in, Selection&) { in.query_len = 1, in.num_reqs = 6; },
       {"ranks disagree on query_len", "[2, 1]"}},
      {"max_seq_len",
       [](DecodeInputs& in, Selection&) { in.max_seq_len = 1000; },
       {"ranks disagree on max_seq_len", "[1024, 1000]"}},
      {"scale", [](DecodeInputs& in, Selection&) { in.scale *= 2; }, {"ranks disagree on scale"}},
      {"cache dtype",
       [](DecodeInputs& in, Selection&) { in.cache.dtype = cpidx::DType::kFP8E4M3; },
       {"ranks disagree on cache dtype", "[0, 1]"}},
      {"rows",
       [](DecodeInputs& in, Selection&) { in.num_reqs = 2; },
       {"ranks disagree on decode rows", "[6, 4]"}},
  };
  // Backing for the query_len edit's 6 requests (never read: the agreement fails first).
  std::vector<int32_t> six_lens(6, 300), six_tables(static_cast<size_t>(6 * d.bt_row_stride), 0);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<Status> status(2);
    std::vector<IdsBuffer> ids;
    for (int r = 0; r < 2; ++r) ids.emplace_back(2, d.rows(), kK);
    run_ranks(2, [&](int r, cpidx::Communicator& comm) {
      cpidx::Geometry g;
      cpidx::make_geometry(kT, 2, r, &g);
      DecodeInputs in = d.inputs(g.head_offset, 2);
      Selection sel{kK, 1, 1};
      if (r == 1) {
        c.edit(in, sel);
        if (in.num_reqs == 6) {
          in.seq_lens = six_lens.data();
          in.block_table = six_tables.data();
        }
      }
      const auto i = static_cast<size_t>(r);
      status[i] = cpidx::ref::cp_decode(comm, g, in, sel, ids[i].out(), nullptr, nullptr);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(failed_as(status[static_cast<size_t>(r)], {StatusCode::kCommError, c.needles}))
          << "rank " << r;
      EXPECT_TRUE(ids[static_cast<size_t>(r)].all_poison()) << "rank " << r;
    }
  }
}

// ---- The GPU Decoder's configuration (what can be checked without a GPU) ---------------------

// A configuration case: an edit of a valid one (64 tokens, 4096-token requests) and the Status
// that Object::create must return. The configuration is checked before any device query or
// allocation, so the cases hold without a GPU; a build without CUDA refuses them all as such.
template <typename Config>
struct ConfigCase {
  std::string name;
  std::function<void(Config&, int& device)> edit;
  Expected e;
};

// The fields both configurations share (selection, maxima, dtype), refused alike, after `own`.
template <typename Config>
std::vector<ConfigCase<Config>> with_shared_config_cases(std::vector<ConfigCase<Config>> own) {
  using C = Config;
  const std::vector<ConfigCase<C>> shared = {
      {"topk 0", [](C& c, int&) { c.sel.topk = 0; }, {kInv, {"topk", "[1, 64]", "got 0"}}},
      {"topk 65", [](C& c, int&) { c.sel.topk = 65; }, {kUnsup, {"topk", "[1, 64]", "got 65"}}},
      {"init -1", [](C& c, int&) { c.sel.init_blocks = -1; }, {kInv, {"init_blocks", ">= 0"}}},
      {"local -1", [](C& c, int&) { c.sel.local_blocks = -1; }, {kInv, {"local_blocks", ">= 0"}}},
      {"max_tokens 0", [](C& c, int&) { c.max_tokens = 0; }, {kInv, {"max_tokens", "got 0"}}},
      {"max_seq_len 0",
       [](C& c, int&) { c.max_seq_len = 0; },
       {kInv, {"max_seq_len", ">= 1", "got 0"}}},
      {"dtype 5",
       [](C& c, int&) { c.cache_dtype = static_cast<cpidx::DType>(5); },
       {kUnsup, {"cache_dtype", "bf16 or fp8_e4m3", "5"}}},
  };
  own.insert(own.end(), shared.begin(), shared.end());
  return own;
}

template <typename Object, typename Config>
void expect_configs_refused(const std::vector<ConfigCase<Config>>& cases) {
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    Config config;
    config.max_tokens = 64;
    config.max_seq_len = 4096;
    int device = 0;
    c.edit(config, device);
    std::unique_ptr<Object> made;
    const Status s = Object::create(config, device, &made);
#if defined(CPIDX_WITH_CUDA)
    EXPECT_TRUE(failed_as(s, c.e));
#else
    EXPECT_TRUE(failed_as(s, {kUnsup, {"built without CUDA"}}));
#endif
    EXPECT_EQ(made, nullptr);
  }
}

TEST(ValidationTable, DecoderConfig) {
  using C = cpidx::DecodeConfig;
  const std::vector<ConfigCase<C>> cases = {
      {"T 3 P 2",
       [](C& c, int&) { c.total_heads = 3, c.world_size = 2; },
       {kInv, {"total_heads (3)", "world_size (2)"}}},
      {"T 4 P 3", [](C& c, int&) { c.world_size = 3; }, {kInv, {"total_heads (4)", "(3)"}}},
      {"T 0", [](C& c, int&) { c.total_heads = 0; }, {kInv, {"total_heads", "[1, 8]", "got 0"}}},
      {"T 9", [](C& c, int&) { c.total_heads = 9; }, {kInv, {"total_heads", "[1, 8]", "got 9"}}},
      {"rank 2 of 2",
       [](C& c, int&) { c.world_size = 2, c.rank = 2; },
       {kInv, {"rank", "[0, 2)", "got 2"}}},
      {"P 16",
       [](C& c, int&) { c.world_size = 16, c.total_heads = 8; },
       {kInv, {"world_size", "<= 8", "got 16"}}},
      {"head_dim 64", [](C& c, int&) { c.head_dim = 64; }, {kUnsup, {"head_dim", "128", "got 64"}}},
      {"max_query_len 0",
       [](C& c, int&) { c.max_query_len = 0; },
       {kInv, {"max_query_len", "[1, 8]", "got 0"}}},
      {"max_query_len 9",
       [](C& c, int&) { c.max_query_len = 9; },
       {kInv, {"max_query_len", "[1, 8]", "got 9"}}},
      // Past kMaxTokens the kernels' 32-bit request and row indices would near INT_MAX, with a
      // workspace some GPUs could still hold (1 head, K = 1: about 16 GiB at 2^31 - 1 rows).
      {"max_tokens 0 (bounds)",
       [](C& c, int&) { c.max_tokens = 0; },
       {kInv, {"max_tokens must be in [1, 1073741824], got 0"}}},
      {"max_tokens 2^30 + 1",
       [](C& c, int&) { c.max_tokens = C::kMaxTokens + 1; },
       {kInv, {"max_tokens must be in [1, 1073741824], got 1073741825"}}},
      {"max_tokens INT_MAX",
       [](C& c, int&) { c.max_tokens = INT_MAX; },
       {kInv, {"max_tokens must be in [1, 1073741824], got 2147483647"}}},
  };
  expect_configs_refused<cpidx::Decoder>(with_shared_config_cases(cases));
  C config;
  config.max_tokens = 64;
  config.max_seq_len = 4096;
  EXPECT_FALSE(cpidx::Decoder::create(config, 0, nullptr).is_ok());
  if (!cpidx::gpu_available()) {
    // A valid configuration without a GPU: kUnsupported (CPU build) or kCudaError (no device).
    std::unique_ptr<cpidx::Decoder> dec;
    const Status s = cpidx::Decoder::create(config, 0, &dec);
    EXPECT_TRUE(s.code() == StatusCode::kUnsupported || s.code() == StatusCode::kCudaError)
        << s.to_string();
    EXPECT_EQ(dec, nullptr);
  }
}

// The GPU Prefiller's configuration, checked before any device query, as the Decoder's.
TEST(ValidationTable, PrefillerConfig) {
  using C = cpidx::PrefillConfig;
  const std::vector<ConfigCase<C>> cases = {
      {"heads 0", [](C& c, int&) { c.num_heads = 0; }, {kInv, {"num_heads", "[1, 8]", "got 0"}}},
      {"heads 9", [](C& c, int&) { c.num_heads = 9; }, {kInv, {"num_heads", "[1, 8]", "got 9"}}},
      {"kernel 7",
       [](C& c, int&) { c.kernel = static_cast<cpidx::PrefillKernel>(7); },
       {kInv, {"kernel", "auto, mma or wgmma", "code 7"}}},
  };
  expect_configs_refused<cpidx::Prefiller>(with_shared_config_cases(cases));
}

}  // namespace
