// The GPU Decoder against host-visible bad input (CONTRACT.md section 8), table-driven like
// tests/test_validation_table.cc: every entry point (decode, shard_keys, merge, cp_decode) with
// each bad argument fails before any kernel runs, names the argument and the expected value,
// leaves the (poisoned) device outputs and the error flag untouched, and starts no collective.
// Plus GpuSanitize.*: one tiny end-to-end case per path, sized for compute-sanitizer
// (scripts/gpu_sanitize.sh). Every test skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpidx/prefill.h"
#include "gpu_util.h"

namespace {

using namespace cpidx_gpu_test;
using cpidx::DecodeInputs;
using cpidx::Key;
using cpidx::Selection;
using cpidx::Status;
using cpidx::StatusCode;
using cpidx_test::random_decode;

constexpr StatusCode kInv = StatusCode::kInvalidArgument;
constexpr StatusCode kUnsup = StatusCode::kUnsupported;
constexpr int kT = 4, kK = 8;

template <typename T>
T* shift_bytes(T* p, int bytes) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + bytes);
}

struct Expected {
  StatusCode code = kInv;
  std::vector<std::string> needles;
};

::testing::AssertionResult failed_as(const Status& s, const Expected& e) {
  if (s.is_ok()) return ::testing::AssertionFailure() << "accepted";
  if (s.code() != e.code) {
    return ::testing::AssertionFailure() << "code " << cpidx::to_string(s.code()) << ", want "
                                         << cpidx::to_string(e.code) << ": " << s.message();
  }
  for (const auto& n : e.needles) {
    if (s.message().find(n) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks \"" << n << "\": " << s.message();
    }
  }
  return ::testing::AssertionSuccess();
}

// 4 heads, Q = 2, 3 requests (one padding), max_seq_len 1024.
const cpidx_test::DecodeData& batch() {
  static const cpidx_test::DecodeData d = random_decode(5151, kT, 2, {300, 0, 700}, 1024);
  return d;
}

// batch() with its first length past max_seq_len: scoring it raises the error flag, so a call
// refused only after a kernel ran shows there (Fixture::expect_untouched).
const cpidx_test::DecodeData& flagged_batch() {
  static const cpidx_test::DecodeData d = [] {
    cpidx_test::DecodeData f = batch();
    f.seq_lens[0] = f.max_seq_len + 1;
    return f;
  }();
  return d;
}

struct InputCase {
  std::string name;
  std::function<void(DecodeInputs&)> edit;
  Expected e;
};

// Bad inputs every GPU entry point checks (the Decoder's bounds: max_tokens 6, max_seq_len 1024,
// max_query_len 8, bf16 cache, K 8).
std::vector<InputCase> input_cases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  using I = DecodeInputs;
  return {
      {"query_len 0", [](I& in) { in.query_len = 0; }, {kInv, {"query_len", "[1, 8]", "got 0"}}},
      {"query_len 9", [](I& in) { in.query_len = 9; }, {kInv, {"query_len", "[1, 8]", "got 9"}}},
      {"num_reqs 0", [](I& in) { in.num_reqs = 0; }, {kInv, {"num_reqs", ">= 1", "got 0"}}},
      {"batch above max_tokens",
       [](I& in) { in.query_len = 3; },
       {kInv, {"num_reqs * query_len (9)", "max_tokens (6)"}}},
      {"max_seq_len mismatch",
       [](I& in) { in.max_seq_len = 896; },
       {kInv, {"max_seq_len", "Decoder's bound 1024", "got 896"}}},
      {"max_seq_len 0", [](I& in) { in.max_seq_len = 0; }, {kInv, {"max_seq_len", ">= 1"}}},
      {"scale 0", [](I& in) { in.scale = 0.0f; }, {kInv, {"scale", "> 0 and finite"}}},
      {"scale nan", [=](I& in) { in.scale = nan; }, {kInv, {"scale", "> 0 and finite"}}},
      {"q_head_stride 64",
       [](I& in) { in.q_head_stride = 64; },
       {kInv, {"q_head_stride", ">= 128", "got 64"}}},
      {"q_row_stride 0",
       [](I& in) { in.q_row_stride = 0; },
       {kInv, {"q_row_stride", ">= 128", "got 0"}}},
      {"q_row_stride not a multiple of 8",
       [](I& in) { in.q_row_stride += 4; },
       {kInv, {"index_query", "multiples of 8"}}},
      {"query null", [](I& in) { in.query = nullptr; }, {kInv, {"query is null"}}},
      {"query 2-byte aligned only",
       [](I& in) { in.query = shift_bytes(in.query, 2); },
       {kInv, {"index_query", "16-byte aligned"}}},
      {"query odd address",
       [](I& in) { in.query = shift_bytes(in.query, 1); },
       {kInv, {"query", "2-byte aligned"}}},
      {"cache null", [](I& in) { in.cache.data = nullptr; }, {kInv, {"cache data is null"}}},
      {"cache 2-byte aligned only",
       [](I& in) { in.cache.data = shift_bytes(static_cast<const char*>(in.cache.data), 2); },
       {kInv, {"index_cache", "16-byte aligned"}}},
      {"cache dtype differs from the Decoder's",
       [](I& in) { in.cache.dtype = cpidx::DType::kFP8E4M3; },
       {kInv, {"index_cache dtype", "bf16", "got fp8_e4m3"}}},
      {"dtype code 9",
       [](I& in) { in.cache.dtype = static_cast<cpidx::DType>(9); },
       {kUnsup, {"dtype", "bf16 or fp8_e4m3"}}},
      {"num_pages 0", [](I& in) { in.cache.num_pages = 0; }, {kInv, {"num_pages", ">= 1"}}},
      {"block_table null",
       [](I& in) { in.block_table = nullptr; },
       {kInv, {"block_table is null"}}},
      {"block_table misaligned",
       [](I& in) { in.block_table = shift_bytes(in.block_table, 2); },
       {kInv, {"block_table", "4-byte aligned"}}},
      {"bt_row_stride 7",
       [](I& in) { in.bt_row_stride = 7; },
       {kInv, {"bt_row_stride", "= 8", "got 7"}}},
      {"seq_lens null", [](I& in) { in.seq_lens = nullptr; }, {kInv, {"seq_lens is null"}}},
      {"seq_lens misaligned",
       [](I& in) { in.seq_lens = shift_bytes(in.seq_lens, 1); },
       {kInv, {"seq_lens", "4-byte aligned"}}},
  };
}

struct OutCase {
  std::string name;
  std::function<cpidx::TopkOutput(int32_t*, int heads, int64_t rows)> out;
  Expected e;
};

std::vector<OutCase> out_cases() {
  using O = cpidx::TopkOutput;
  const Expected strides{kInv, {"ids strides", "topk = 8", "without overlap"}};
  return {
      {"ids null",
       [](int32_t*, int, int64_t) {
         return O{nullptr, 0, 0};
       },
       {kInv, {"ids output is null"}}},
      {"ids misaligned",
       [](int32_t* b, int, int64_t r) {
         return O{shift_bytes(b, 2), r * kK, kK};
       },
       {kInv, {"ids output", "4-byte aligned"}}},
      {"row stride < topk",
       [](int32_t* b, int, int64_t r) {
         return O{b, r * kK, kK - 1};
       },
       strides},
      {"heads overlap",
       [](int32_t* b, int, int64_t) {
         return O{b, kK, kK};
       },
       strides},
      {"negative row stride",
       [](int32_t* b, int, int64_t r) {
         return O{b, r * kK, -kK};
       },
       strides},
  };
}

struct Fixture {
  explicit Fixture(int world = 1, int rank = 0)
      : d(flagged_batch()), b(d), ids(static_cast<size_t>(kT * d.rows() * kK + 64)) {
    cpidx::DecodeConfig c = config_for(d, {kK, 1, 1}, world, rank);
    const Status s = cpidx::Decoder::create(c, 0, &dec);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
  }
  void poison() {
    ids.poison();
    cudaMemset(dec->error_flag(), 0, sizeof(int32_t));
    cudaDeviceSynchronize();
  }
  // After a rejected call: nothing ran.
  void expect_untouched(const std::string& where) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where;
    for (int32_t v : ids.download()) {
      ASSERT_EQ(v, cpidx_test::kPoison) << where << ": an id was written";
    }
    int32_t flag = -1;
    cudaMemcpy(&flag, dec->error_flag(), sizeof(flag), cudaMemcpyDeviceToHost);
    EXPECT_EQ(flag, 0) << where << ": the error flag was raised";
  }
  // Ids [heads, n, K], dense.
  cpidx::TopkOutput dense() { return {ids.ptr, d.rows() * kK, kK}; }
  const cpidx_test::DecodeData& d;
  DeviceBatch b;
  DeviceVec<int32_t> ids;
  std::unique_ptr<cpidx::Decoder> dec;
};

TEST(GpuValidation, DecodeRejectsEachBadArgumentBeforeAnyKernel) {
  SKIP_WITHOUT_GPU();
  Fixture f;
  ASSERT_NE(f.dec, nullptr);
  for (const auto& c : input_cases()) {
    f.poison();
    DecodeInputs in = f.b.all_heads();
    c.edit(in);
    EXPECT_TRUE(failed_as(f.dec->decode(in, f.dense(), nullptr, nullptr), c.e)) << c.name;
    // A world of one's cp_decode without a communicator checks as decode does.
    EXPECT_TRUE(failed_as(f.dec->cp_decode(in, f.dense(), nullptr, nullptr), c.e)) << c.name;
    f.expect_untouched("decode: " + c.name);
  }
  for (const auto& c : out_cases()) {
    f.poison();
    const cpidx::TopkOutput out = c.out(f.ids.ptr, kT, f.d.rows());
    EXPECT_TRUE(failed_as(f.dec->decode(f.b.all_heads(), out, nullptr, nullptr), c.e)) << c.name;
    EXPECT_TRUE(failed_as(f.dec->cp_decode(f.b.all_heads(), out, nullptr, nullptr), c.e))
        << c.name;
    f.expect_untouched("decode: " + c.name);
  }
  // Heads: 0, more than the Decoder's T.
  for (int heads : {0, 5}) {
    f.poison();
    DecodeInputs in = f.b.all_heads();
    in.num_heads = heads;
    EXPECT_TRUE(failed_as(f.dec->decode(in, f.dense(), nullptr, nullptr),
                          {kInv, {"num_heads", "[1, 4]", "got " + std::to_string(heads)}}));
    f.expect_untouched("decode: heads " + std::to_string(heads));
  }
  // The untouched call works (the table's edits are what fail), and raises the flag that
  // expect_untouched reads: the batch's first length is past max_seq_len.
  f.poison();
  EXPECT_TRUE(f.dec->decode(f.b.all_heads(), f.dense(), nullptr, nullptr).is_ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int32_t flag = 0;
  cudaMemcpy(&flag, f.dec->error_flag(), sizeof(flag), cudaMemcpyDeviceToHost);
  EXPECT_NE(flag & cpidx::kErrSeqLenOutOfRange, 0) << "the fixture's batch left the flag " << flag;
}

TEST(GpuValidation, SparseTableArgumentsOnDecodeMergeAndCp) {
  SKIP_WITHOUT_GPU();
  const cpidx_test::DecodeData& d = batch();
  const int64_t n = d.rows(), G = d.max_blocks();
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, {kK, 1, 1}, 4, 0), 0, &dec).is_ok());
  DeviceVec<int32_t> attn(std::vector<int32_t>(static_cast<size_t>(d.num_reqs() * G), 1));
  DeviceVec<int32_t> table(static_cast<size_t>(n * kK * 8 + 8)), ctx(static_cast<size_t>(n + 8));
  DeviceVec<int32_t> ids(static_cast<size_t>(n * kK));
  DeviceVec<Key> gathered(static_cast<size_t>(4 * kT * n * kK));
  cudaMemset(gathered.ptr, 0, gathered.count * sizeof(Key));
  using T = cpidx::SparseTableOutput;
  struct Case {
    std::string name;
    std::function<void(T&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"partly", [](T& t) { t.context_lens = nullptr; }, {"all together or not at all"}},
      {"page stride 12",
       [](T& t) { t.block_page_stride = 12; },
       {"block_page_stride", "8 or 16", "got 12"}},
      {"table_row_stride",
       [](T& t) { t.table_row_stride = kK * 8 - 1; },
       {"table_row_stride", "topk * 8 = 64", "got 63"}},
      {"attn_bt_row_stride",
       [G](T& t) { t.attn_bt_row_stride = G - 1; },
       {"attn_bt_row_stride", "= 8", "got 7"}},
      {"misaligned table", [](T& t) { t.table = shift_bytes(t.table, 2); }, {"4-byte aligned"}},
  };
  for (const auto& c : cases) {
    T t{attn.ptr, G, table.ptr, kK * 8, ctx.ptr, 8};
    c.edit(t);
    table.poison();
    ctx.poison();
    ids.poison();
    ScriptedComm comm(0, 4);
    const cpidx::TopkOutput out{ids.ptr, n * kK, kK};
    // decode of one head (a plain decode on the rank-0 Decoder), merge and cp_decode (L = 1).
    EXPECT_TRUE(failed_as(dec->decode(b.inputs(0, 1), out, &t, nullptr), {kInv, c.needles}))
        << "decode " << c.name;
    EXPECT_TRUE(
        failed_as(dec->merge(gathered.ptr, b.all_heads(), out, &t, nullptr), {kInv, c.needles}))
        << "merge " << c.name;
    EXPECT_TRUE(
        failed_as(dec->cp_decode(comm, b.inputs(0, 1), out, &t, nullptr), {kInv, c.needles}))
        << "cp_decode " << c.name;
    EXPECT_EQ(comm.gathers, 0) << c.name << ": a collective started";
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const DeviceVec<int32_t>* v : {&table, &ctx, &ids}) {
      for (int32_t x : v->download()) ASSERT_EQ(x, cpidx_test::kPoison) << c.name;
    }
  }
  // A table with several heads.
  T t{attn.ptr, G, table.ptr, kK * 8, ctx.ptr, 8};
  DeviceVec<int32_t> ids4(static_cast<size_t>(kT * n * kK));
  ids4.poison();
  EXPECT_TRUE(failed_as(dec->decode(b.all_heads(), {ids4.ptr, n * kK, kK}, &t, nullptr),
                        {kInv, {"local_heads == 1", "got 4"}}));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const DeviceVec<int32_t>* v : {&table, &ctx, &ids4}) {
    for (int32_t x : v->download()) ASSERT_EQ(x, cpidx_test::kPoison) << "a table with 4 heads";
  }
}

TEST(GpuValidation, ShardKeysAndMerge) {
  SKIP_WITHOUT_GPU();
  Fixture f(2, 1);  // rank 1 of 2: owns heads 2-3
  ASSERT_NE(f.dec, nullptr);
  const int64_t n = f.d.rows();
  DeviceVec<Key> keys(static_cast<size_t>(2 * kT * n * kK + 1));
  auto keys_untouched = [&](const std::string& where) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (Key k : keys.download()) ASSERT_EQ(k, 0x7B7B7B7B7B7B7B7Bull) << where;
  };
  for (const auto& c : input_cases()) {
    keys.poison();
    f.poison();
    DecodeInputs in = f.b.all_heads();
    c.edit(in);
    EXPECT_TRUE(failed_as(f.dec->shard_keys(in, keys.ptr, nullptr), c.e)) << "shard " << c.name;
    keys_untouched("shard_keys: " + c.name);
  }
  keys.poison();
  EXPECT_TRUE(failed_as(f.dec->shard_keys(f.b.all_heads(), nullptr, nullptr),
                        {kInv, {"keys must not be null"}}));
  EXPECT_TRUE(failed_as(f.dec->shard_keys(f.b.all_heads(), shift_bytes(keys.ptr, 4), nullptr),
                        {kInv, {"keys", "8-byte aligned"}}));
  EXPECT_TRUE(failed_as(f.dec->shard_keys(f.b.inputs(0, 2), keys.ptr, nullptr),
                        {kInv, {"num_heads", "must be 4", "got 2"}}));
  keys_untouched("shard_keys: keys / heads");

  // merge: the batch shape, the gathered keys and the outputs.
  struct MergeCase {
    std::string name;
    std::function<void(const Key*&, DecodeInputs&)> edit;
    Expected e;
  };
  const std::vector<MergeCase> cases = {
      {"gathered null",
       [](const Key*& g, DecodeInputs&) { g = nullptr; },
       {kInv, {"gathered keys must not be null"}}},
      {"gathered misaligned",
       [](const Key*& g, DecodeInputs&) { g = shift_bytes(g, 4); },
       {kInv, {"gathered keys", "8-byte aligned"}}},
      {"seq_lens null",
       [](const Key*&, DecodeInputs& in) { in.seq_lens = nullptr; },
       {kInv, {"seq_lens must not be null"}}},
      {"seq_lens misaligned",
       [](const Key*&, DecodeInputs& in) { in.seq_lens = shift_bytes(in.seq_lens, 2); },
       {kInv, {"seq_lens", "4-byte aligned"}}},
      {"num_reqs 0",
       [](const Key*&, DecodeInputs& in) { in.num_reqs = 0; },
       {kInv, {"num_reqs", ">= 1", "got 0"}}},
      {"query_len 0",
       [](const Key*&, DecodeInputs& in) { in.query_len = 0; },
       {kInv, {"query_len", "max_query_len = 8", "got 0"}}},
      {"query_len 9",
       [](const Key*&, DecodeInputs& in) { in.query_len = 9; },
       {kInv, {"query_len", "max_query_len = 8", "got 9"}}},
      {"batch above max_tokens",
       [](const Key*&, DecodeInputs& in) { in.num_reqs = 4; },
       {kInv, {"num_reqs * query_len (8)", "max_tokens (6)"}}},
  };
  for (const auto& c : cases) {
    f.poison();
    const Key* g = keys.ptr;
    DecodeInputs in = f.b.all_heads();
    c.edit(g, in);
    EXPECT_TRUE(failed_as(f.dec->merge(g, in, f.dense(), nullptr, nullptr), c.e)) << c.name;
    f.expect_untouched("merge: " + c.name);
  }
  for (const auto& c : out_cases()) {
    f.poison();
    EXPECT_TRUE(failed_as(
        f.dec->merge(keys.ptr, f.b.all_heads(), c.out(f.ids.ptr, 2, n), nullptr, nullptr), c.e))
        << c.name;
    f.expect_untouched("merge: " + c.name);
  }
}

// An output sharing memory with an input (or with the per-call error flag) is refused by every
// Decoder entry point before any kernel runs: the inputs in one device buffer with the output
// placed on their last element stay as they were, and nothing else is written.
TEST(GpuValidation, OutputsOnInputsAreRefusedByEveryEntryPoint) {
  SKIP_WITHOUT_GPU();
  Fixture f(2, 1);  // rank 1 of 2: owns heads 2-3
  ASSERT_NE(f.dec, nullptr);
  const int64_t n = f.d.rows();
  // seq_lens, then room for ids: the ids placed on the seq_lens' last element.
  std::vector<int32_t> host(f.d.seq_lens);
  host.resize(host.size() + static_cast<size_t>(kT * n * kK), cpidx_test::kPoison);
  DeviceVec<int32_t> lens_then_out(host);
  const int32_t* lens = lens_then_out.ptr;
  int32_t* on_lens_end = lens_then_out.ptr + f.d.num_reqs() - 1;
  auto expect_kept = [&](const std::string& where) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where;
    EXPECT_EQ(lens_then_out.download(), host) << where << ": written";
    f.expect_untouched(where);
  };
  DecodeInputs in = f.b.all_heads();
  in.seq_lens = lens;
  const cpidx::TopkOutput out_all{on_lens_end, n * kK, kK};
  const Expected ids_on_lens{kInv, {"ids output (out) and seq_lens share memory"}};

  f.poison();
  EXPECT_TRUE(failed_as(f.dec->decode(in, out_all, nullptr, nullptr), ids_on_lens));
  expect_kept("decode");
  {  // a world of one's cp_decode without a communicator
    Fixture one;
    ASSERT_NE(one.dec, nullptr);
    one.poison();
    EXPECT_TRUE(failed_as(one.dec->cp_decode(in, out_all, nullptr, nullptr), ids_on_lens));
    expect_kept("cp_decode without a communicator");
    one.expect_untouched("cp_decode without a communicator");
  }
  // The per-call error flag on the seq_lens.
  DecodeInputs flag_on_lens = f.b.all_heads();
  flag_on_lens.seq_lens = lens;
  flag_on_lens.error_flag = on_lens_end;
  f.poison();
  EXPECT_TRUE(failed_as(f.dec->decode(flag_on_lens, f.dense(), nullptr, nullptr),
                        {kInv, {"error_flag and seq_lens share memory"}}));
  expect_kept("decode, error_flag");
  // shard_keys: keys on the seq_lens.
  f.poison();
  EXPECT_TRUE(failed_as(f.dec->shard_keys(in, reinterpret_cast<Key*>(lens_then_out.ptr), nullptr),
                        {kInv, {"keys and seq_lens share memory"}}));
  expect_kept("shard_keys");
  // merge: ids on the gathered keys. (It reads seq_lens only for a sparse table, and neither
  // the query, the cache nor the block table, as the reference's merge_topk_keys.)
  DeviceVec<Key> keys(static_cast<size_t>(2 * kT * n * kK));
  keys.poison();
  f.poison();
  EXPECT_TRUE(failed_as(
      f.dec->merge(keys.ptr, f.b.all_heads(),
                   {reinterpret_cast<int32_t*>(keys.ptr + keys.count) - 1, n * kK, kK}, nullptr,
                   nullptr),
      {kInv, {"ids output (out) and gathered keys share memory"}}));
  for (Key k : keys.download()) ASSERT_EQ(k, 0x7B7B7B7B7B7B7B7Bull) << "merge: gathered written";
  f.expect_untouched("merge, gathered keys");
  // A merge without a sparse table reads no seq_lens (nor the query, cache or block table):
  // ids over them are accepted, as by the reference's merge_topk_keys.
  {
    DeviceVec<int32_t> lens_copy(host);
    DecodeInputs merge_batch = f.b.all_heads();
    merge_batch.seq_lens = lens_copy.ptr;
    merge_batch.max_seq_len = 0;  // a merge's batch need not carry it
    const Status s =
        f.dec->merge(keys.ptr, merge_batch, {lens_copy.ptr + 1, n * kK, kK}, nullptr, nullptr);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // cp_decode's checks (before any collective): its local query's rows on the ids.
  DecodeInputs local = f.b.inputs(2, 2);
  local.seq_lens = lens;
  EXPECT_TRUE(failed_as(f.dec->check_cp_decode(local, {on_lens_end, n * kK, kK}, nullptr),
                        ids_on_lens));
  // With the ids just past the seq_lens (touching) the calls are accepted, and the decode
  // writes the ids the Decoder writes into a buffer of their own.
  int32_t* past_lens = lens_then_out.ptr + f.d.num_reqs();
  EXPECT_TRUE(f.dec->check_cp_decode(local, {past_lens, n * kK, kK}, nullptr).is_ok());
  const Status s = f.dec->decode(in, {past_lens, n * kK, kK}, nullptr, nullptr);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  f.poison();
  ASSERT_TRUE(f.dec->decode(f.b.all_heads(), f.dense(), nullptr, nullptr).is_ok());
  const std::vector<int32_t> got = lens_then_out.download(), want = f.ids.download();
  EXPECT_TRUE(std::equal(got.begin() + f.d.num_reqs(), got.end(), want.begin()));
  EXPECT_TRUE(std::equal(f.d.seq_lens.begin(), f.d.seq_lens.end(), got.begin()));
}

TEST(GpuValidation, CpDecodeRejectsBeforeAnyCollective) {
  SKIP_WITHOUT_GPU();
  Fixture f(2, 0);  // rank 0 of 2: L = 2
  ASSERT_NE(f.dec, nullptr);
  for (const auto& c : input_cases()) {
    f.poison();
    ScriptedComm comm(0, 2);
    DecodeInputs in = f.b.inputs(0, 2);
    c.edit(in);
    EXPECT_TRUE(failed_as(f.dec->cp_decode(comm, in, f.dense(), nullptr, nullptr), c.e)) << c.name;
    EXPECT_EQ(comm.gathers, 0) << c.name << ": a collective started";
    f.expect_untouched("cp_decode: " + c.name);
  }
  for (const auto& c : out_cases()) {
    f.poison();
    ScriptedComm comm(0, 2);
    EXPECT_TRUE(failed_as(
        f.dec->cp_decode(comm, f.b.inputs(0, 2), c.out(f.ids.ptr, 2, f.d.rows()), nullptr, nullptr),
        c.e))
        << c.name;
    EXPECT_EQ(comm.gathers, 0) << c.name;
    f.expect_untouched("cp_decode: " + c.name);
  }
  struct CommCase {
    std::string name;
    ScriptedComm comm;
    int heads;
    std::vector<std::string> needles;
  };
  std::vector<CommCase> comms;
  comms.push_back({"world 4 vs 2",
                   ScriptedComm(0, 4),
                   2,
                   {"communicator (rank 0 of 4)", "(rank 0 of 2)"}});
  comms.push_back({"rank 1 vs 0",
                   ScriptedComm(1, 2),
                   2,
                   {"communicator (rank 1 of 2)", "(rank 0 of 2)"}});
  comms.push_back(
      {"host memory", ScriptedComm(0, 2, cpidx::MemorySpace::kHost), 2, {"device memory"}});
  comms.push_back({"all heads instead of the local ones",
                   ScriptedComm(0, 2),
                   kT,
                   {"num_heads", "must be 2", "got 4"}});
  // A batch past the communicator's bound (the peer communicator's max_bytes_per_rank) is
  // refused here, not by the query gather or after the scoring (CONTRACT.md section 8).
  comms.push_back({"gathers past max_bytes_per_rank",
                   ScriptedComm(0, 2),
                   2,
                   {"exceed the communicator's max_bytes_per_rank (64)"}});
  comms.back().comm.max_bytes = 64;
  // A communicator of another device would gather there, unordered with the Decoder's stream.
  comms.push_back({"a communicator of another device",
                   ScriptedComm(0, 2),
                   2,
                   {"communicator gathers on device 1, the Decoder runs on device 0"}});
  comms.back().comm.gpu_device = 1;
  for (auto& c : comms) {
    f.poison();
    EXPECT_TRUE(
        failed_as(f.dec->cp_decode(c.comm, f.b.inputs(0, c.heads), f.dense(), nullptr, nullptr),
                  {kInv, c.needles}))
        << c.name;
    EXPECT_EQ(c.comm.gathers, 0) << c.name;
    EXPECT_EQ(c.comm.offered, std::vector<long long>{-1}) << c.name << ": refused, offered -1";
    EXPECT_TRUE(c.comm.settings.empty()) << c.name << ": no settings round after a refusal";
    f.expect_untouched("cp_decode: " + c.name);
  }
}

// The key gather's route joins the agreed rows (kCpFusedRouteTag): a rank whose keys would go
// through the device channel and a peer that gathers them (fused_exchange off, or a channel too
// small for the step) fail together instead of waiting for each other until the timeout.
TEST(GpuValidation, CpDecodeAgreesOnTheKeyRoute) {
  SKIP_WITHOUT_GPU();
  Fixture f(2, 0);
  ASSERT_NE(f.dec, nullptr);
  ASSERT_TRUE(f.dec->config().fused_exchange);
  cpidx::DecodeConfig gathered_cfg = f.dec->config();
  gathered_cfg.fused_exchange = false;
  std::unique_ptr<cpidx::Decoder> gathered;
  ASSERT_TRUE(cpidx::Decoder::create(gathered_cfg, 0, &gathered).is_ok());
  const long long rows = f.d.rows();
  const int64_t key_lines = kT * rows * kK;  // one 8-byte key a line
  cpidx::DeviceChannel fits;
  fits.world = 2;
  fits.rank = 0;
  fits.capacity = key_lines;
  cpidx::DeviceChannel small = fits;
  small.capacity = key_lines - 1;
  struct RouteCase {
    std::string name;
    cpidx::Decoder* dec;
    std::optional<cpidx::DeviceChannel> channel;
    long long offers;
  };
  const std::vector<RouteCase> cases = {
      {"fused, the peer gathers", f.dec.get(), fits, rows + cpidx::kCpFusedRouteTag},
      {"fused_exchange off, the peer fuses", gathered.get(), fits, rows},
      {"channel too small, the peer fuses", f.dec.get(), small, rows},
      {"no channel, the peer fuses", f.dec.get(), std::nullopt, rows},
  };
  for (const RouteCase& c : cases) {
    f.poison();
    const long long peer = c.offers == rows ? rows + cpidx::kCpFusedRouteTag : rows;
    ScriptedComm comm(0, 2, cpidx::MemorySpace::kDevice, peer);
    comm.channel = c.channel;
    EXPECT_TRUE(failed_as(c.dec->cp_decode(comm, f.b.inputs(0, 2), f.dense(), nullptr, nullptr),
                          {cpidx::StatusCode::kCommError, {"disagree"}}))
        << c.name;
    EXPECT_EQ(comm.offered, std::vector<long long>{c.offers}) << c.name;
    EXPECT_EQ(comm.labels, std::vector<std::string>{cpidx::kCpRowsAgreement}) << c.name;
    EXPECT_TRUE(comm.settings.empty()) << c.name << ": the settings round after rows that differ";
    EXPECT_EQ(comm.gathers, 0) << c.name;
    f.expect_untouched("cp_decode: " + c.name);
  }
}

// Once the rows agree, the settings that make the ranks' lists mergeable, in one round: a peer
// with the same rows but another query_len, scale or topk fails both ranks before any collective
// (the gathers would move as many bytes, and the merge would mix lists scored differently).
TEST(GpuValidation, CpDecodeAgreesOnItsSettings) {
  SKIP_WITHOUT_GPU();
  Fixture f(2, 0);
  ASSERT_NE(f.dec, nullptr);
  const DecodeInputs in = f.b.inputs(0, 2);
  const std::vector<long long> mine = {kK, 1, 1, in.query_len, in.max_seq_len, kT,
                                       static_cast<long long>(cpidx::float_bits(in.scale)),
                                       static_cast<long long>(in.cache.dtype)};
  const std::vector<std::string> names = {"topk",        "init_blocks", "local_blocks",
                                          "query_len",   "max_seq_len", "total_heads",
                                          "scale (bits)", "cache dtype"};
  {  // the same settings: asked once, after the rows, then the step runs (two gathers)
    ScriptedComm comm(0, 2, cpidx::MemorySpace::kDevice, f.d.rows());
    comm.peer_settings = mine;
    const Status s = f.dec->cp_decode(comm, in, f.dense(), nullptr, nullptr);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(comm.settings, mine);
    EXPECT_EQ(comm.setting_names, names);
    EXPECT_EQ(comm.gathers, 2);
  }
  const std::vector<std::pair<size_t, long long>> differ = {
      {3, in.query_len + 1},                                                 // query_len
      {6, static_cast<long long>(cpidx::float_bits(in.scale * 0.5f))},       // scale
      {0, kK * 2}};                                                          // topk
  for (const auto& [field, value] : differ) {
    SCOPED_TRACE(names[field]);
    f.poison();
    ScriptedComm comm(0, 2, cpidx::MemorySpace::kDevice, f.d.rows());
    comm.peer_settings = mine;
    (*comm.peer_settings)[field] = value;
    EXPECT_TRUE(failed_as(f.dec->cp_decode(comm, in, f.dense(), nullptr, nullptr),
                          {StatusCode::kCommError, {"disagree on " + names[field]}}));
    EXPECT_EQ(comm.gathers, 0);
    f.expect_untouched("cp_decode: " + names[field]);
  }
}

// Every call runs on the Decoder's device: with another current (its stream would be another
// device's, and a launch would fail after cp_decode's first collective) each is refused before
// anything runs, naming both devices; cp_decode offers -1 to its peers. Needs a second GPU.
TEST(GpuValidation, CallsWithAnotherDeviceCurrentAreRefused) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs a second GPU to make current";
  Fixture f(2, 0);  // on device 0
  ASSERT_NE(f.dec, nullptr);
  f.poison();
  Fixture one;  // a world of one, on device 0
  ASSERT_NE(one.dec, nullptr);
  one.poison();
  DeviceVec<Key> keys(static_cast<size_t>(2 * kT * f.d.rows() * kK));
  const Expected e{kInv,
                   {"the current CUDA device is 1, but this Decoder was created on device 0"}};
  cpidx::PrefillConfig pc;
  pc.num_heads = kT;
  pc.max_tokens = 64;
  pc.max_seq_len = 1024;
  pc.sel = {kK, 1, 1};
  std::unique_ptr<cpidx::Prefiller> pre;
  ASSERT_TRUE(cpidx::Prefiller::create(pc, 0, &pre).is_ok());
  const Expected pe{kInv, {"the current CUDA device is 1, but this Prefiller was created on "
                           "device 0"}};
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  // The device is checked first: these inputs are empty, and still named for the device.
  EXPECT_TRUE(failed_as(pre->prefill(cpidx::PrefillInputs{}, f.dense(), nullptr), pe));
  EXPECT_TRUE(failed_as(pre->clear_error_flag(nullptr), pe));
  ScriptedComm comm(0, 2, cpidx::MemorySpace::kDevice, f.d.rows());
  EXPECT_TRUE(failed_as(f.dec->cp_decode(comm, f.b.inputs(0, 2), f.dense(), nullptr, nullptr), e));
  EXPECT_EQ(comm.offered, std::vector<long long>{-1});
  EXPECT_EQ(comm.gathers, 0);
  EXPECT_TRUE(failed_as(f.dec->check_cp_decode(f.b.inputs(0, 2), f.dense(), nullptr), e));
  EXPECT_TRUE(failed_as(one.dec->cp_decode(one.b.all_heads(), one.dense(), nullptr, nullptr), e));
  EXPECT_TRUE(failed_as(f.dec->shard_keys(f.b.all_heads(), keys.ptr, nullptr), e));
  EXPECT_TRUE(failed_as(f.dec->merge(keys.ptr, f.b.inputs(0, 2), f.dense(), nullptr, nullptr), e));
  EXPECT_TRUE(failed_as(f.dec->clear_error_flag(nullptr), e));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  f.expect_untouched("another device current");
  one.expect_untouched("another device current, a world of one");
}

// A call whose launch fails returns the error and leaves none pending (see the helper), on every
// entry point: the plain decode, the context-parallel pieces, cp_decode (the launches after its
// agreement; a world of one's without a communicator), and clearing the error flag.
TEST(GpuValidation, FailedLaunchesLeaveNoErrorPending) {
  SKIP_WITHOUT_GPU();
  Fixture f(2, 0);  // rank 0 of 2: L = 2
  ASSERT_NE(f.dec, nullptr);
  Fixture one;  // a world of one
  ASSERT_NE(one.dec, nullptr);
  DeviceVec<Key> keys(static_cast<size_t>(2 * kT * f.d.rows() * kK));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ScriptedComm comm(0, 2);  // agrees with whatever this rank offers; gathers nothing
  // cp_decode whose query needs no packing: its first stream-ordered work is the query gather
  // (a communicator's, writing on the stream), whose failure is cleared too.
  const int64_t n = f.d.rows();
  std::vector<uint16_t> local_rows(static_cast<size_t>(n * 2 * 128));
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(f.d.query.begin() + r * kT * 128, 2 * 128, local_rows.begin() + r * 2 * 128);
  }
  DeviceVec<uint16_t> local_q(local_rows);
  ScriptedComm writing(0, 2);
  writing.gather_writes = true;
  DecodeInputs packed = f.b.inputs(0, 2);
  packed.query = local_q.ptr;
  packed.q_row_stride = 2 * 128;
  packed.q_head_stride = 128;
  const std::vector<std::pair<std::string, std::function<Status()>>> calls = {
      {"clear_error_flag", [&] { return f.dec->clear_error_flag(stream); }},
      {"decode", [&] { return f.dec->decode(f.b.all_heads(), f.dense(), nullptr, stream); }},
      {"shard_keys", [&] { return f.dec->shard_keys(f.b.all_heads(), keys.ptr, stream); }},
      {"merge",
       [&] { return f.dec->merge(keys.ptr, f.b.inputs(0, 2), f.dense(), nullptr, stream); }},
      {"cp_decode",
       [&] { return f.dec->cp_decode(comm, f.b.inputs(0, 2), f.dense(), nullptr, stream); }},
      {"cp_decode, its gather",
       [&] { return f.dec->cp_decode(writing, packed, f.dense(), nullptr, stream); }},
      {"cp_decode without a communicator",
       [&] { return one.dec->cp_decode(one.b.all_heads(), one.dense(), nullptr, stream); }},
  };
  for (const auto& [name, call] : calls) {
    SCOPED_TRACE(name);
    expect_failed_launch_leaves_nothing_pending(stream, call);
  }
  EXPECT_EQ(comm.gathers, 0);  // cp_decode's first launch (packing its queries) failed
  EXPECT_EQ(writing.gathers, 1);  // the query gather, which failed
  // The stream and the Decoder work again.
  f.poison();
  const Status again = f.dec->decode(f.b.all_heads(), f.dense(), nullptr, stream);
  EXPECT_TRUE(again.is_ok()) << again.to_string();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
}

// step_plan is a query of any int arguments: products past the bound (even past INT_MAX) read
// as the bound's plan, fewer than one column as the narrowest instance's.
TEST(GpuValidation, StepPlanReadsAnyArgumentsAsDocumented) {
  SKIP_WITHOUT_GPU();
  Fixture f;
  ASSERT_NE(f.dec, nullptr);
  const int max_q = f.dec->config().max_query_len;
  const cpidx::DecodePlan bound = f.dec->step_plan(kT, max_q), narrow = f.dec->step_plan(1, 1);
  EXPECT_EQ(bound.grid, f.dec->plan().grid);
  EXPECT_EQ(bound.smem_bytes, f.dec->plan().smem_bytes);
  auto same = [](const cpidx::DecodePlan& a, const cpidx::DecodePlan& b) {
    return a.grid == b.grid && a.stages == b.stages && a.offset_stride == b.offset_stride &&
           a.smem_bytes == b.smem_bytes;
  };
  const int big = std::numeric_limits<int>::max();
  for (const auto& [heads, q] : std::vector<std::pair<int, int>>{
           {kT, max_q + 1}, {65536, 65536}, {2147483640, 1}, {big, big}, {-big, -big}}) {
    EXPECT_TRUE(same(f.dec->step_plan(heads, q), bound)) << heads << " x " << q;
  }
  for (const auto& [heads, q] : std::vector<std::pair<int, int>>{{0, 1}, {-3, 2}, {1, 0}}) {
    EXPECT_TRUE(same(f.dec->step_plan(heads, q), narrow)) << heads << " x " << q;
  }
}

TEST(GpuValidation, CreateChecksTheDevice) {
  SKIP_WITHOUT_GPU();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  cpidx::DecodeConfig c = config_for(batch(), {kK, 0, 1});
  for (int device : {-1, count}) {
    std::unique_ptr<cpidx::Decoder> dec;
    EXPECT_TRUE(failed_as(cpidx::Decoder::create(c, device, &dec),
                          {kInv, {"device must be in [0, " + std::to_string(count) + ")"}}));
    EXPECT_EQ(dec, nullptr);
  }
}

// ---- Tiny end-to-end cases for compute-sanitizer ------------------------------------------------
// One small batch through every path (plain, simulated context-parallel at P = 2 and 4, the
// fused sparse table, bad device values), compared with the CPU reference. Sized so that
// memcheck, racecheck and synccheck each finish in well under a minute.

TEST(GpuSanitize, SmallDecodeEveryPath) {
  SKIP_WITHOUT_GPU();
  const Selection sel{8, 1, 1};
  cpidx_test::DecodeData d = random_decode(5252, kT, 2, {1, 129, 0, 700, 1024}, 1024);
  const std::vector<int32_t> plain = gpu_decode(d, sel);
  const std::vector<int32_t> cpu = cpu_decode(d, sel);
  const CompareResult r = compare_ids(d, sel, plain, cpu);
  EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
  for (int P : {2, 4}) EXPECT_EQ(gpu_cp_simulated(d, sel, P), plain) << "P=" << P;

  // Bad device values: clamped and flagged, same bits as the reference.
  d.seq_lens[1] = 5000;
  d.seq_lens[2] = -3;
  d.block_table[static_cast<size_t>(3 * d.bt_row_stride + 1)] = 1 << 30;
  int32_t flag = 0;
  const std::vector<int32_t> bad = gpu_decode(d, sel, &flag);
  int32_t cpu_err = 0;
  cpidx_test::IdsBuffer ids(kT, d.rows(), sel.topk);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, &cpu_err).is_ok());
  EXPECT_EQ(flag, cpidx::kErrSeqLenOutOfRange | cpidx::kErrPageOutOfRange);
  EXPECT_EQ(flag, cpu_err);
  EXPECT_EQ(compare_ids(d, sel, bad, ids.ids).bad_rows, 0);
}

TEST(GpuSanitize, LongListsTakeEverySelection) {
  SKIP_WITHOUT_GPU();
  // 157 blocks a request: past the 128 keys ranked directly, so select_topk bounds the K-th key
  // from its group maxima (random scores), falls back to the radix select when too many keys
  // pass the bound (every block scoring the same), or goes to it directly (K = 33 > 32 groups).
  for (bool equal : {false, true}) {
    for (int K : {16, 33}) {
      const Selection sel{K, 1, 1};
      cpidx_test::DecodeData d = random_decode(5454 + K, kT, 1, {20000, 0, 19990}, 20000);
      if (equal) std::fill(d.cache_bf16.begin(), d.cache_bf16.end(), cpidx_test::bf16_of(0.5f));
      const std::vector<int32_t> cpu = cpu_decode(d, sel);
      for (Path path : kBothPaths) {
        UsePath use(path);
        const std::vector<int32_t> gpu = gpu_decode(d, sel);
        EXPECT_EQ(compare_ids(d, sel, gpu, cpu).bad_rows, 0)
            << "equal=" << equal << " K=" << K << " " << path_name(path);
        if (equal) EXPECT_EQ(gpu, cpu) << "ties follow the contract's order exactly";
        EXPECT_EQ(gpu_cp_simulated(d, sel, 2), gpu) << "P=2 " << path_name(path);
      }
    }
  }
}

TEST(GpuSanitize, ManyItemsTakeTheNarrowSelection) {
  SKIP_WITHOUT_GPU();
  // More (request, column) items than the selection's wide grid (4 CTAs per SM): its narrow
  // grid runs, lists short (ranked directly) and one long (157 blocks: the group bound).
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int T = 8, Q = 8, reqs = (4 * sms + 1 + T * Q - 1) / (T * Q);
  std::mt19937 rng(5555);
  std::vector<int32_t> lens(static_cast<size_t>(reqs));
  for (auto& x : lens) x = static_cast<int32_t>(rng() % 600);
  lens[1] = 20000;
  const Selection sel{16, 1, 1};
  cpidx_test::DecodeData d = random_decode(5555, T, Q, lens, 20000);
  expect_matches_reference(d, sel, "");
}

TEST(GpuSanitize, SparseRequestOffsetsInBothKernels) {
  SKIP_WITHOUT_GPU();
  // A Decoder planned for 16K tokens of 64 columns keeps every 32nd request offset in the
  // scoring kernel; a step of 1,100 requests takes its sparse instance, and more than 1,023
  // requests keep every other offset in the selection kernel too (both paths).
  const int T = 8, Q = 8, reqs = 1100;
  std::mt19937 rng(5757);
  std::vector<int32_t> lens(static_cast<size_t>(reqs));
  for (auto& x : lens) x = static_cast<int32_t>(rng() % 257);
  for (int r = 40; r < 75; ++r) lens[static_cast<size_t>(r)] = 0;  // padding across kept offsets
  const Selection sel{16, 1, 1};
  cpidx_test::DecodeData d = random_decode(5757, T, Q, lens, 256);
  UseMaxTokens large(1 << 14);
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  const int stride = dec->plan().offset_stride;
  ASSERT_LT((1 << 14) / stride, reqs) << "stride " << stride;
  expect_matches_reference(d, sel, "");
}

TEST(GpuSanitize, ManyShortRequestsOfSixtyFourColumns) {
  SKIP_WITHOUT_GPU();
  // The step above with dense request offsets: as many requests of up to two blocks as the
  // Decoder keeps every offset of (64 columns), each page another request's, both paths. Each
  // CTA holds one or two pages here, so no stage is copied into twice (the next case's are).
  const int T = 8, Q = 8, max_tokens = 8800;
  const Selection sel{16, 1, 1};
  UseMaxTokens bound(max_tokens);
  int reqs = 0;
  {
    const cpidx_test::DecodeData probe = random_decode(5959, T, Q, {256}, 256);
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(probe, sel), 0, &dec).is_ok());
    reqs = std::min(1100, max_tokens / dec->plan().offset_stride);
  }
  ASSERT_GE(reqs, 200) << "too few requests for dense offsets at 64 columns";
  std::mt19937 rng(5959);
  std::vector<int32_t> lens(static_cast<size_t>(reqs));
  for (auto& x : lens) x = static_cast<int32_t>(rng() % 257);
  cpidx_test::DecodeData d = random_decode(5959, T, Q, lens, 256);
  expect_matches_reference(d, sel, std::to_string(reqs) + " requests");
}

TEST(GpuSanitize, SixtyFourColumnsRefillEveryStage) {
  SKIP_WITHOUT_GPU();
  // A 64-column step with dense request offsets in which every CTA scores more pages than it
  // has stages, so each stage is copied into again after the consumers read it (the ring wraps),
  // on both paths. The case above holds one or two pages a CTA, the sparse one ~6. racecheck
  // reports the refills against the previous page's loads here as on the sparse case, so its
  // reports come with the refill at 64 columns, not with sparse offsets (docs/reliability.md).
  const int T = 8, Q = 8, reqs = 12;
  const Selection sel{16, 1, 1};
  std::mt19937 rng(6060);
  std::vector<int32_t> lens(static_cast<size_t>(reqs));
  for (auto& x : lens) x = static_cast<int32_t>(19000 + rng() % 1001);
  cpidx_test::DecodeData d = random_decode(6060, T, Q, lens, 20000);
  {
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
    const cpidx::DecodePlan plan = dec->plan();
    int64_t pages = 0;
    for (int32_t len : lens) pages += cpidx::cdiv(len, cpidx::kBlockSize);
    ASSERT_EQ(plan.offset_stride, 1);
    ASSERT_GE(pages, 2ll * plan.stages * plan.grid) << "the ring would not wrap";
  }
  expect_matches_reference(d, sel, "");
}

TEST(GpuSanitize, WorkStealingSplitStep) {
  SKIP_WITHOUT_GPU();
  // A split step with >= 16 pages for each of two CTAs on up to 132 SMs: the CTAs take pages
  // from each other's ranges (page_producer.cuh, v15). Twice on one Decoder (the ranges reset).
  const Selection sel{16, 1, 1};
  cpidx_test::DecodeData d = random_decode(5656, kT, 1, {300000, 1, 250000}, 300000);
  const std::vector<int32_t> cpu = cpu_decode(d, sel);
  UsePath use(Path::kSplit);
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  DeviceVec<int32_t> ids(static_cast<size_t>(kT * d.rows() * sel.topk));
  for (int call = 0; call < 2; ++call) {
    ids.poison();
    ASSERT_TRUE(dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, d.rows() * sel.topk,
                                                             sel.topk},
                            nullptr, nullptr)
                    .is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(compare_ids(d, sel, ids.download(), cpu).bad_rows, 0) << "call " << call;
  }
}

TEST(GpuSanitize, Fp8SplitStepOfManyShortRequests) {
  SKIP_WITHOUT_GPU();
  // fp8 on the split path, 600 requests of 1-3 blocks: a CTA scores pages of several requests in
  // a row with no segment end between them. Each request's queries are scaled by its own power
  // of two, so each has its own fp8 query scales (s.qinv): a page's keys formed with the next
  // request's scales would show in the ids, and racecheck sees how the scales are handed over
  // between requests (docs/perf/README.md, v34a).
  std::mt19937 rng(5858);
  std::vector<int32_t> lens(600);
  for (auto& x : lens) x = static_cast<int32_t>(rng() % 384 + 1);
  cpidx_test::DecodeData d =
      random_decode(5858, kT, 1, lens, 384, cpidx::DType::kFP8E4M3);
  const int64_t per_req = static_cast<int64_t>(kT) * cpidx_test::kD;
  for (int r = 0; r < d.num_reqs(); ++r) {
    const float up = std::ldexp(1.0f, (r % 9) * 4 - 16);  // 2^-16 .. 2^16: exact in bf16
    for (int64_t i = r * per_req; i < (r + 1) * per_req; ++i) {
      const size_t at = static_cast<size_t>(i);
      d.query[at] = cpidx_test::bf16_of(cpidx::ref::bf16_to_float(d.query[at]) * up);
    }
  }
  const Selection sel{16, 1, 1};
  const std::vector<int32_t> cpu = cpu_decode(d, sel);
  UsePath use(Path::kSplit);
  const CompareResult r = compare_ids(d, sel, gpu_decode(d, sel), cpu);
  EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
}

TEST(GpuSanitize, Fp8PairedPagesOfSixteenColumns) {
  SKIP_WITHOUT_GPU();
  // fp8 at 16 columns (4 heads, Q = 4, the batch's own query bound) scores two consecutive pages
  // of a request under one barrier, after a CTA's first page and inside its range (score_topk.cu,
  // kPairPages, v35c). One CTA per SM gives each ~7 pages, so pairs meet request ends, range ends
  // and odd remainders; racecheck sees the paired maxima buffers and their reuse.
  UseTightQueryBound bound(true);
  UseCtasPerSm one(1);
  const Selection sel{16, 1, 1};
  const std::vector<int32_t> lens = {40000, 3 * cpidx::kBlockSize + 1, 39873, 0, 16385, 33000};
  cpidx_test::DecodeData d = random_decode(6161, kT, 4, lens, 40000, cpidx::DType::kFP8E4M3);
  {
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
    int64_t pages = 0;
    for (int32_t len : lens) pages += cpidx::cdiv(len, cpidx::kBlockSize);
    ASSERT_GE(pages, 4ll * dec->plan().grid) << "CTAs too short to pair pages";
  }
  expect_matches_reference(d, sel, "");
  EXPECT_EQ(gpu_cp_simulated(d, sel, 2), gpu_decode(d, sel)) << "P=2";
}

TEST(GpuSanitize, SmallSparseTable) {
  SKIP_WITHOUT_GPU();
  const Selection sel{8, 0, 1};
  const cpidx_test::DecodeData d = random_decode(5353, 1, 2, {1, 128, 0, 513}, 640);
  const int64_t n = d.rows(), G = d.max_blocks();
  std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G));
  for (size_t i = 0; i < attn.size(); ++i) attn[i] = static_cast<int32_t>(50 + 3 * i);
  cpidx_test::IdsBuffer ids(1, n, sel.topk);
  std::vector<int32_t> table(static_cast<size_t>(n * sel.topk * 8), cpidx_test::kPoison);
  std::vector<int32_t> ctx(static_cast<size_t>(n), cpidx_test::kPoison);
  cpidx::SparseTableOutput t{attn.data(), G, table.data(), sel.topk * 8, ctx.data(), 16};
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), &t, nullptr).is_ok());
  DeviceBatch b(d);
  DeviceVec<int32_t> dattn(attn), dids(ids.ids.size()), dtable(table.size()), dctx(ctx.size());
  dids.poison();
  dtable.poison();
  dctx.poison();
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  cpidx::SparseTableOutput dt{dattn.ptr, G, dtable.ptr, sel.topk * 8, dctx.ptr, 16};
  ASSERT_TRUE(dec->decode(b.all_heads(), {dids.ptr, n * sel.topk, sel.topk}, &dt, nullptr).is_ok());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dids.download(), ids.ids);
  EXPECT_EQ(dtable.download(), table);
  EXPECT_EQ(dctx.download(), ctx);
}

}  // namespace
