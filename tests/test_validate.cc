// Host-visible bad input (CONTRACT.md section 8): each error is a Status that names the
// argument and the expected value, and nothing is written to the outputs. The edges of the
// query checks too: query_len 8 and a free row stride with one row pass, heads 127 apart fail.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;
using cpidx::StatusCode;

struct BadDecode {
  std::string name;
  std::function<void(cpidx::DecodeInputs&, cpidx::Selection&)> edit;
  std::string needle;
  StatusCode code = StatusCode::kInvalidArgument;
};

const DecodeData& shared_data() {
  static const DecodeData d = random_decode(900, 2, 2, {300, 700}, 1024);
  return d;
}

TEST(Validate, DecodeErrorsNameTheArgumentAndWriteNothing) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<BadDecode> cases = {
      {"topk 0", [](auto&, auto& s) { s.topk = 0; }, "topk must be in [1, 64], got 0"},
      {"topk 65", [](auto&, auto& s) { s.topk = 65; }, "topk must be in [1, 64], got 65",
       StatusCode::kUnsupported},
      {"init -1", [](auto&, auto& s) { s.init_blocks = -1; }, "init_blocks must be >= 0, got -1"},
      {"local -2", [](auto&, auto& s) { s.local_blocks = -2; },
       "local_blocks must be >= 0, got -2"},
      {"query_len 9", [](auto& in, auto&) { in.query_len = 9; },
       "query_len must be in [1, 8], got 9"},
      {"query_len 0", [](auto& in, auto&) { in.query_len = 0; },
       "query_len must be in [1, 8], got 0"},
      {"query null", [](auto& in, auto&) { in.query = nullptr; }, "query is null"},
      {"seq_lens null", [](auto& in, auto&) { in.seq_lens = nullptr; }, "seq_lens is null"},
      {"block_table null", [](auto& in, auto&) { in.block_table = nullptr; },
       "block_table is null"},
      {"cache null", [](auto& in, auto&) { in.cache.data = nullptr; }, "cache data is null"},
      {"pages 0", [](auto& in, auto&) { in.cache.num_pages = 0; }, "num_pages must be >= 1, got 0"},
      {"dtype", [](auto& in, auto&) { in.cache.dtype = static_cast<cpidx::DType>(7); },
       "dtype must be bf16 or fp8_e4m3", StatusCode::kUnsupported},
      {"scale 0", [](auto& in, auto&) { in.scale = 0.0f; }, "scale must be > 0 and finite, got 0"},
      {"scale -1", [](auto& in, auto&) { in.scale = -1.0f; }, "scale must be > 0 and finite"},
      {"scale inf", [=](auto& in, auto&) { in.scale = inf; }, "scale must be > 0 and finite"},
      {"scale nan", [](auto& in, auto&) { in.scale = std::nanf(""); },
       "scale must be > 0 and finite"},
      {"num_heads 0", [](auto& in, auto&) { in.num_heads = 0; },
       "num_heads must be in [1, 8], got 0"},
      {"num_heads 9", [](auto& in, auto&) { in.num_heads = 9; },
       "num_heads must be in [1, 8], got 9"},
      {"head stride", [](auto& in, auto&) { in.q_head_stride = 64; },
       "q_head_stride must be >= 128"},
      {"row stride", [](auto& in, auto&) { in.q_row_stride = 0; }, "q_row_stride must be >= 128"},
      {"bt stride", [](auto& in, auto&) { in.bt_row_stride = 7; },
       "bt_row_stride must be >= cdiv(max_seq_len, 128) = 8, got 7"},
      {"max_seq_len 0", [](auto& in, auto&) { in.max_seq_len = 0; },
       "max_seq_len must be >= 1, got 0"},
      {"num_reqs 0", [](auto& in, auto&) { in.num_reqs = 0; }, "num_reqs must be >= 1, got 0"},
  };
  const DecodeData& d = shared_data();
  for (const auto& c : cases) {
    cpidx::DecodeInputs in = d.all_heads();
    cpidx::Selection sel{16, 0, 1};
    c.edit(in, sel);
    IdsBuffer ids(2, d.rows(), 16);
    int32_t err = 0;
    const cpidx::Status s = cpidx::ref::decode_topk(in, sel, ids.out(), nullptr, &err);
    EXPECT_EQ(s.code(), c.code) << c.name << ": " << s.to_string();
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << c.name << ": " << s.message();
    EXPECT_TRUE(ids.all_poison()) << c.name;
    EXPECT_EQ(err, 0) << c.name;

    // The same check fails the context-parallel path (world 1) and the shard scorer.
    cpidx::Geometry g;
    ASSERT_TRUE(cpidx::make_geometry(2, 1, 0, &g).is_ok());
    auto comms = cpidx::make_thread_communicators(1);
    const cpidx::Status cp = cpidx::ref::cp_decode(*comms[0], g, in, sel, ids.out(), nullptr, &err);
    EXPECT_EQ(cp.code(), c.code) << c.name << ": " << cp.to_string();
    EXPECT_TRUE(ids.all_poison()) << c.name;
    std::vector<cpidx::Key> keys(static_cast<size_t>(2 * d.rows() * 16), 0x5A5Aull);
    EXPECT_FALSE(cpidx::ref::shard_topk_keys(in, sel, 1, 0, keys.data(), &err).is_ok()) << c.name;
    EXPECT_EQ(keys, std::vector<cpidx::Key>(keys.size(), 0x5A5Aull)) << c.name;
  }
}

TEST(Validate, BatchAboveMaxTokens) {
  std::vector<int32_t> seq_lens(1024, 100);
  std::vector<int32_t> table(1024 * 8, 0);
  std::vector<uint16_t> q(16), cache(16);
  cpidx::DecodeInputs in;
  in.query = q.data();
  in.q_row_stride = 4 * 128;
  in.q_head_stride = 128;
  in.num_heads = 4;
  in.cache = {cache.data(), cpidx::DType::kBF16, 1};
  in.block_table = table.data();
  in.bt_row_stride = 8;
  in.seq_lens = seq_lens.data();
  in.num_reqs = 1024;
  in.query_len = 4;
  in.max_seq_len = 1024;
  const cpidx::Status s = cpidx::ref::validate(in, cpidx::Selection{}, 2048);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("num_reqs * query_len (4096) exceeds max_tokens (2048)"),
            std::string::npos)
      << s.message();
  EXPECT_TRUE(cpidx::ref::validate(in, cpidx::Selection{}, 4096).is_ok());
}

TEST(Validate, OutputsAndSparseTable) {
  const DecodeData& d = shared_data();
  const cpidx::Selection sel{16, 0, 1};
  cpidx::TopkOutput no_ids;
  cpidx::Status s = cpidx::ref::decode_topk(d.all_heads(), sel, no_ids, nullptr, nullptr);
  EXPECT_NE(s.message().find("ids output is null"), std::string::npos) << s.message();

  std::vector<int32_t> attn(16, 1), table(static_cast<size_t>(d.rows() * 128), kPoison);
  std::vector<int32_t> ctx(static_cast<size_t>(d.rows()), kPoison);
  const cpidx::SparseTableOutput good{attn.data(), 8, table.data(), 128, ctx.data(), 8};
  struct BadTable {
    std::string name;
    cpidx::SparseTableOutput t;
    int heads;
    std::string needle;
  };
  cpidx::SparseTableOutput partial = good;
  partial.context_lens = nullptr;
  partial.block_page_stride = 0;
  cpidx::SparseTableOutput stride12 = good;
  stride12.block_page_stride = 12;
  cpidx::SparseTableOutput narrow = good;
  narrow.table_row_stride = 100;
  cpidx::SparseTableOutput short_attn = good;
  short_attn.attn_bt_row_stride = 3;
  const std::vector<BadTable> cases = {
      {"partial", partial, 1, "all together or not at all"},
      {"stride 12", stride12, 1, "block_page_stride must be 8 or 16, got 12"},
      {"two heads", good, 2, "local_heads == 1"},
      {"row stride", narrow, 1, "table_row_stride must be >= topk * 8 = 128, got 100"},
      {"attn stride", short_attn, 1, "attn_bt_row_stride must be >= cdiv(max_seq_len, 128) = 8"},
  };
  for (const auto& c : cases) {
    IdsBuffer ids(c.heads, d.rows(), 16);
    s = cpidx::ref::decode_topk(d.inputs(0, c.heads), sel, ids.out(), &c.t, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << c.name << ": " << s.message();
    EXPECT_TRUE(ids.all_poison()) << c.name;
    cpidx::Geometry g;
    ASSERT_TRUE(cpidx::make_geometry(c.heads, 1, 0, &g).is_ok());
    auto comms = cpidx::make_thread_communicators(1);
    s = cpidx::ref::cp_decode(*comms[0], g, d.inputs(0, c.heads), sel, ids.out(), &c.t, nullptr);
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << c.name << ": " << s.message();
    EXPECT_TRUE(ids.all_poison()) << c.name;
    EXPECT_EQ(table, std::vector<int32_t>(table.size(), kPoison)) << c.name;
    EXPECT_EQ(ctx, std::vector<int32_t>(ctx.size(), kPoison)) << c.name;
  }
  // Disabled (all four absent) is fine with any head count.
  const cpidx::SparseTableOutput none;
  IdsBuffer ids(2, d.rows(), 16);
  EXPECT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), &none, nullptr).is_ok());
}

TEST(Validate, PrefillErrors) {
  const DecodeData& d = shared_data();
  std::vector<int32_t> cu = {0, 3, 5}, ctx = {10, 200}, seq = {13, 202};
  std::vector<uint16_t> query(5 * 2 * kD);
  for (size_t i = 0; i < query.size(); ++i) query[i] = bf16_of(static_cast<float>(i % 7) - 3.5f);
  cpidx::PrefillInputs good;
  good.query = query.data();
  good.q_row_stride = 2 * 128;
  good.q_head_stride = 128;
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
  struct Bad {
    std::string name;
    std::function<void(cpidx::PrefillInputs&, cpidx::Selection&)> edit;
    std::string needle;
  };
  const std::vector<Bad> cases = {
      {"cu null", [](auto& in, auto&) { in.cu_seqlens_q = nullptr; }, "cu_seqlens_q is null"},
      {"ctx null", [](auto& in, auto&) { in.context_lens = nullptr; }, "context_lens is null"},
      {"seq null", [](auto& in, auto&) { in.seq_lens = nullptr; }, "seq_lens is null"},
      {"tokens 0", [](auto& in, auto&) { in.num_tokens = 0; }, "num_tokens must be >= 1, got 0"},
      {"topk 0", [](auto&, auto& s) { s.topk = 0; }, "topk must be in [1, 64], got 0"},
      {"scale", [](auto& in, auto&) { in.scale = -2.0f; }, "scale must be > 0 and finite"},
      {"query", [](auto& in, auto&) { in.query = nullptr; }, "query is null"},
  };
  for (const auto& c : cases) {
    cpidx::PrefillInputs in = good;
    cpidx::Selection sel{6, 0, 1};
    c.edit(in, sel);
    IdsBuffer ids(2, 5, 6);
    const cpidx::Status s = cpidx::ref::prefill_topk(in, sel, ids.out(), nullptr);
    EXPECT_FALSE(s.is_ok()) << c.name;
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << c.name << ": " << s.message();
    EXPECT_TRUE(ids.all_poison()) << c.name;
  }
  IdsBuffer ids(2, 5, 6);
  EXPECT_TRUE(cpidx::ref::prefill_topk(good, {6, 0, 1}, ids.out(), nullptr).is_ok());
  EXPECT_FALSE(ids.any_poison());
}

// CONTRACT.md sections 1-2 and 8: query_len 1..8 includes 8; the row stride is free with one
// row; two heads closer than 128 elements overlap and are refused.
TEST(Validate, QueryLimitsAtTheirEdges) {
  const cpidx::Selection sel{2, 0, 1};
  {
    const DecodeData d = random_decode(910, 1, cpidx::kMaxQueryLen, {300}, 384);
    IdsBuffer ids(1, d.rows(), 2);
    EXPECT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, nullptr).is_ok());
  }
  {
    const DecodeData d = random_decode(911, 1, 1, {300}, 384);
    cpidx::DecodeInputs in = d.all_heads();
    in.q_row_stride = 0;
    IdsBuffer ids(1, 1, 2);
    EXPECT_TRUE(cpidx::ref::decode_topk(in, sel, ids.out(), nullptr, nullptr).is_ok());
  }
  {
    const DecodeData d = random_decode(912, 2, 1, {300}, 384);
    cpidx::DecodeInputs in = d.all_heads();
    in.q_head_stride = kD - 1;
    IdsBuffer ids(2, 1, 2);
    const cpidx::Status s = cpidx::ref::decode_topk(in, sel, ids.out(), nullptr, nullptr);
    EXPECT_NE(s.message().find("q_head_stride must be >= 128"), std::string::npos) << s.message();
  }
}

}  // namespace
