// Outputs that share memory with an input or with each other are refused before anything is
// written (CONTRACT.md section 8: bad input never corrupts memory or gives silently wrong ids),
// and arguments laid back to back in one buffer, touching but not overlapping, are accepted.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;
using cpidx::StatusCode;

constexpr int kTopK = 16;
constexpr int64_t kTableWidth = kTopK * cpidx::kPagesPerBlock;

// One head, Q = 1 (the sparse table needs both), two requests.
const DecodeData& data() {
  static const DecodeData d = random_decode(4242, 1, 1, {300, 700}, 1024);
  return d;
}

// Where each int32 argument of a decode step with a sparse table sits in one arena (in int32
// elements). The query and the cache stay in the data's own vectors.
struct Layout {
  int64_t seq_lens = 0, block_table = 0, attn = 0, ids = 0, table = 0, ctx = 0, err = 0;
};

int64_t attn_stride() { return data().max_blocks(); }
int64_t seq_lens_size() { return data().num_reqs(); }
int64_t block_table_size() { return static_cast<int64_t>(data().block_table.size()); }
// The block table's columns read: cdiv(max_seq_len, 128) of each row (its last row's spare
// columns are not the call's memory).
int64_t block_table_read() {
  return (data().num_reqs() - 1) * data().bt_row_stride + data().max_blocks();
}
int64_t attn_size() { return data().num_reqs() * attn_stride(); }
int64_t ids_size() { return data().rows() * kTopK; }
int64_t table_size() { return data().rows() * kTableWidth; }

// Every argument right after the previous one: touching, no overlap.
Layout back_to_back() {
  Layout at;
  at.seq_lens = 0;
  at.block_table = at.seq_lens + seq_lens_size();
  at.attn = at.block_table + block_table_size();
  at.ids = at.attn + attn_size();
  at.table = at.ids + ids_size();
  at.ctx = at.table + table_size();
  at.err = at.ctx + data().rows();
  return at;
}

// Every argument 512 elements after the previous one's start (each is shorter): an output moved
// onto another argument's last element overlaps that argument alone.
Layout spread() {
  Layout at;
  int64_t* fields[] = {&at.seq_lens, &at.block_table, &at.attn, &at.ids,
                       &at.table,    &at.ctx,         &at.err};
  int64_t offset = 0;
  for (int64_t* f : fields) {
    *f = offset;
    offset += 512;
  }
  return at;
}

struct Arena {
  std::vector<int32_t> mem = std::vector<int32_t>(4096, kPoison);
  int32_t* at(int64_t offset) { return mem.data() + offset; }
};

struct Step {
  cpidx::DecodeInputs in;
  cpidx::TopkOutput out;
  cpidx::SparseTableOutput table;
  int32_t* err = nullptr;
  cpidx::Status run() const {
    return cpidx::ref::decode_topk(in, {kTopK, 0, 1}, out, &table, err);
  }
};

// The inputs copied into their places; outputs are placed, not filled (where one overlaps an
// input, the input's values stand).
Step place(Arena& arena, const Layout& at, const DecodeData& d) {
  *arena.at(at.err) = 0;
  std::copy(d.seq_lens.begin(), d.seq_lens.end(), arena.at(at.seq_lens));
  std::copy(d.block_table.begin(), d.block_table.end(), arena.at(at.block_table));
  for (int64_t i = 0; i < attn_size(); ++i) *arena.at(at.attn + i) = static_cast<int32_t>(i % 97);
  Step step;
  step.in = d.all_heads();
  step.in.seq_lens = arena.at(at.seq_lens);
  step.in.block_table = arena.at(at.block_table);
  step.out = {arena.at(at.ids), ids_size(), kTopK};
  step.table = {arena.at(at.attn), attn_stride(), arena.at(at.table), kTableWidth,
                arena.at(at.ctx),  8};
  step.err = arena.at(at.err);
  return step;
}

TEST(Aliasing, ArgumentsBackToBackInOneBufferAreAccepted) {
  const DecodeData& d = data();
  Arena arena;
  const Layout at = back_to_back();
  ASSERT_LE(at.err + 1, static_cast<int64_t>(arena.mem.size()));
  const cpidx::Status s = place(arena, at, d).run();
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  // The same ids as with every argument in its own buffer.
  IdsBuffer want(1, d.rows(), kTopK);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), {kTopK, 0, 1}, want.out(), nullptr, nullptr)
                  .is_ok());
  EXPECT_FALSE(want.any_poison());
  EXPECT_EQ(std::vector<int32_t>(arena.at(at.ids), arena.at(at.ids) + ids_size()), want.ids);
  EXPECT_NE(*arena.at(at.ctx), kPoison);
  EXPECT_EQ(*arena.at(at.err), 0);
}

TEST(Aliasing, OverlappingOutputsAreRefusedNamingBothAndNothingIsWritten) {
  const DecodeData& d = data();
  struct Case {
    std::string name;
    void (*move)(Layout&);
    std::string first, second;
  };
  // Each output moved onto the last element of another argument (one int32 of overlap).
  const std::vector<Case> cases = {
      {"ids on seq_lens", [](Layout& a) { a.ids = a.seq_lens + seq_lens_size() - 1; },
       "ids output (out)", "seq_lens"},
      {"ids on block_table", [](Layout& a) { a.ids = a.block_table + block_table_read() - 1; },
       "ids output (out)", "block_table"},
      {"ids on the attention table", [](Layout& a) { a.ids = a.attn + attn_size() - 1; },
       "ids output (out)", "attention_block_table"},
      {"table on ids", [](Layout& a) { a.table = a.ids + ids_size() - 1; }, "ids output (out)",
       "sparse table (sparse_block_table_out)"},
      {"context lens on table", [](Layout& a) { a.ctx = a.table + table_size() - 1; },
       "sparse table (sparse_block_table_out)", "sparse context lens (sparse_context_lens_out)"},
      {"context lens on seq_lens", [](Layout& a) { a.ctx = a.seq_lens + seq_lens_size() - 1; },
       "sparse context lens (sparse_context_lens_out)", "seq_lens"},
      {"err on block_table", [](Layout& a) { a.err = a.block_table + 3; }, "err",
       "block_table"},
  };
  for (const Case& c : cases) {
    Layout at = spread();
    c.move(at);
    Arena arena;
    const Step step = place(arena, at, d);
    const std::vector<int32_t> before = arena.mem;
    const cpidx::Status s = step.run();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.name << ": " << s.to_string();
    EXPECT_NE(s.message().find(c.first + " and " + c.second + " share memory"),
              std::string::npos)
        << c.name << ": " << s.message();
    EXPECT_EQ(arena.mem, before) << c.name << ": something was written";
  }
  // The spread layout itself is accepted, so each refusal above is the one overlap; so is an
  // output on the block table's spare columns past the last row's cdiv(max_seq_len, 128).
  Arena arena;
  EXPECT_TRUE(place(arena, spread(), d).run().is_ok());
  Layout spare = spread();
  spare.ids = spare.block_table + block_table_read();
  ASSERT_LT(block_table_read(), block_table_size());
  Arena arena2;
  const cpidx::Status s = place(arena2, spare, d).run();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// Each entry point of the reference checks its own arguments: an output on one input of each
// is refused, naming both, before anything is written.
TEST(Aliasing, EveryReferenceEntryPointRefusesAnOutputOnAnInput) {
  DecodeData d = data();  // a copy: outputs are placed inside its vectors
  const cpidx::Selection sel{kTopK, 0, 1};
  auto expect_refused = [](const cpidx::Status& s, const std::string& pair,
                           const std::string& what) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s.to_string();
    EXPECT_NE(s.message().find(pair + " share memory"), std::string::npos)
        << what << ": " << s.message();
  };
  auto* query_words = reinterpret_cast<int32_t*>(d.query.data());
  auto* cache_words = reinterpret_cast<int32_t*>(d.cache_bf16.data());
  const std::vector<uint16_t> query_before = d.query;
  const std::vector<uint16_t> cache_before = d.cache_bf16;

  // decode_topk: ids on the query's last element, and on the cache's first page.
  const int64_t q_words = static_cast<int64_t>(d.query.size()) / 2;
  cpidx::TopkOutput on_query{query_words + q_words - 1, ids_size(), kTopK};
  expect_refused(cpidx::ref::decode_topk(d.all_heads(), sel, on_query, nullptr, nullptr),
                 "ids output (out) and query (index_query)", "decode_topk, query");
  cpidx::TopkOutput on_cache{cache_words + 100, ids_size(), kTopK};
  expect_refused(cpidx::ref::decode_topk(d.all_heads(), sel, on_cache, nullptr, nullptr),
                 "ids output (out) and cache (index_cache)", "decode_topk, cache");

  // A query strided with gaps: an output in a gap is refused too (the rule is each argument's
  // first to last element).
  std::vector<uint16_t> gappy(static_cast<size_t>(d.rows()) * 4 * kD);
  for (int64_t r = 0; r < d.rows(); ++r) {
    std::copy_n(d.query.begin() + r * kD, kD, gappy.begin() + r * 4 * kD);
  }
  cpidx::DecodeInputs strided = d.all_heads();
  strided.query = gappy.data();
  strided.q_row_stride = 4 * kD;
  cpidx::TopkOutput in_gap{reinterpret_cast<int32_t*>(gappy.data() + kD), ids_size(), kTopK};
  expect_refused(cpidx::ref::decode_topk(strided, sel, in_gap, nullptr, nullptr),
                 "ids output (out) and query (index_query)", "decode_topk, strided query");

  // shard_topk_keys: keys on the seq_lens.
  std::vector<cpidx::Key> keys(static_cast<size_t>(ids_size()));
  cpidx::DecodeInputs keys_on_lens = d.all_heads();
  std::vector<int64_t> lens_and_keys(static_cast<size_t>(ids_size()) + 1);
  auto* lens_words = reinterpret_cast<int32_t*>(lens_and_keys.data());
  std::copy(d.seq_lens.begin(), d.seq_lens.end(), lens_words);
  keys_on_lens.seq_lens = lens_words;
  expect_refused(cpidx::ref::shard_topk_keys(keys_on_lens, sel, 1, 0,
                                             reinterpret_cast<cpidx::Key*>(lens_and_keys.data()),
                                             nullptr),
                 "keys and seq_lens", "shard_topk_keys");
  EXPECT_EQ(lens_words[0], d.seq_lens[0]);
  EXPECT_EQ(lens_words[1], d.seq_lens[1]);

  // block_scores: scores on the block table's last row, and its error word on the scores.
  const int64_t slots = d.all_heads().max_blocks();
  const size_t score_count = static_cast<size_t>(d.all_heads().num_heads * d.rows() * slots);
  std::vector<int32_t> table_and_scores = d.block_table;
  table_and_scores.resize(table_and_scores.size() + score_count, kPoison);
  cpidx::DecodeInputs scores_on_table = d.all_heads();
  scores_on_table.block_table = table_and_scores.data();
  const std::vector<int32_t> table_before = table_and_scores;
  auto* scores_at = reinterpret_cast<float*>(table_and_scores.data() + block_table_read() - 1);
  expect_refused(cpidx::ref::block_scores(scores_on_table, 1, 0, scores_at, nullptr),
                 "scores and block_table", "block_scores");
  EXPECT_EQ(table_and_scores, table_before);
  std::vector<float> scores(score_count, 0.f);
  expect_refused(cpidx::ref::block_scores(d.all_heads(), 1, 0, scores.data(),
                                          reinterpret_cast<int32_t*>(scores.data()) + 5),
                 "scores and err", "block_scores, err");
  EXPECT_EQ(scores, std::vector<float>(score_count, 0.f));

  // merge_topk_keys: ids on the gathered keys.
  ASSERT_TRUE(cpidx::ref::shard_topk_keys(d.all_heads(), sel, 1, 0, keys.data(), nullptr).is_ok());
  const std::vector<cpidx::Key> keys_before = keys;
  cpidx::TopkOutput on_keys{reinterpret_cast<int32_t*>(keys.data()) + 7, ids_size(), kTopK};
  expect_refused(cpidx::ref::merge_topk_keys(keys.data(), 1, 1, d.rows(), sel, 0, 1,
                                             d.seq_lens.data(), d.num_reqs(), 1, d.max_seq_len,
                                             on_keys, nullptr),
                 "ids output (out) and gathered keys", "merge_topk_keys");
  EXPECT_EQ(keys, keys_before);

  // sparse_table: the table on the ids it reads. Both lie in one vector (the table's span is
  // larger than the ids'), so that no other argument can fall inside the table's span wherever
  // the heap puts it, and the refusal names this pair.
  IdsBuffer ids(1, d.rows(), kTopK);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, nullptr).is_ok());
  std::vector<int32_t> ids_and_table(static_cast<size_t>(3 + table_size()), kPoison);
  std::copy(ids.ids.begin(), ids.ids.end(), ids_and_table.begin());
  const std::vector<int32_t> both_before = ids_and_table;
  std::vector<int32_t> attn(static_cast<size_t>(attn_size()), 1), ctx(2, kPoison);
  const cpidx::SparseTableOutput on_ids{attn.data(), attn_stride(), ids_and_table.data() + 3,
                                        kTableWidth, ctx.data(), 8};
  expect_refused(cpidx::ref::sparse_table(ids_and_table.data(), kTopK, d.seq_lens.data(),
                                          d.num_reqs(), 1, d.max_seq_len, kTopK, on_ids),
                 "sparse table (sparse_block_table_out) and ids", "sparse_table");
  EXPECT_EQ(ids_and_table, both_before);
  EXPECT_EQ(ctx, std::vector<int32_t>(2, kPoison));

  // cp_decode (one rank): ids on the block table.
  std::vector<int32_t> table_and_ids = d.block_table;
  table_and_ids.resize(table_and_ids.size() + static_cast<size_t>(ids_size()), kPoison);
  cpidx::DecodeInputs cp_in = d.all_heads();
  cp_in.block_table = table_and_ids.data();
  cpidx::TopkOutput on_table{table_and_ids.data() + 5, ids_size(), kTopK};
  cpidx::Geometry g;
  ASSERT_TRUE(cpidx::make_geometry(1, 1, 0, &g).is_ok());
  auto comms = cpidx::make_thread_communicators(1);
  expect_refused(cpidx::ref::cp_decode(*comms[0], g, cp_in, sel, on_table, nullptr, nullptr),
                 "ids output (out) and block_table", "cp_decode");
  EXPECT_TRUE(std::equal(d.block_table.begin(), d.block_table.end(), table_and_ids.begin()));

  // prefill_topk: ids on cu_seqlens_q, and on context_lens.
  std::vector<int32_t> meta = {0, 1, 2, 299, 699, 300, 700};  // cu, context_lens, seq_lens
  meta.resize(meta.size() + static_cast<size_t>(ids_size()), kPoison);
  const cpidx::PrefillInputs pre =
      prefill_over(d, 1, 2, meta.data(), meta.data() + 3, meta.data() + 5, 2);
  IdsBuffer pre_ids(1, 2, kTopK);
  ASSERT_TRUE(cpidx::ref::prefill_topk(pre, sel, pre_ids.out(), nullptr).is_ok());
  const std::vector<int32_t> meta_before = meta;
  cpidx::TopkOutput on_cu{meta.data() + 2, 2 * kTopK, kTopK};
  expect_refused(cpidx::ref::prefill_topk(pre, sel, on_cu, nullptr),
                 "ids output (out) and cu_seqlens_q", "prefill_topk, cu_seqlens_q");
  // The ids' last element on context_lens' first.
  std::vector<int32_t> ids_then_ctx(static_cast<size_t>(2 * kTopK + 1), kPoison);
  std::copy_n(meta.data() + 3, 2, ids_then_ctx.data() + 2 * kTopK - 1);
  cpidx::PrefillInputs ctx_after_ids = pre;
  ctx_after_ids.context_lens = ids_then_ctx.data() + 2 * kTopK - 1;
  cpidx::TopkOutput on_ctx{ids_then_ctx.data(), 2 * kTopK, kTopK};
  expect_refused(cpidx::ref::prefill_topk(ctx_after_ids, sel, on_ctx, nullptr),
                 "ids output (out) and context_lens", "prefill_topk, context_lens");
  EXPECT_EQ(ids_then_ctx[0], kPoison);
  EXPECT_EQ(meta, meta_before);

  EXPECT_EQ(d.query, query_before);
  EXPECT_EQ(d.cache_bf16, cache_before);
}

// A context-parallel rank whose error word overlaps its inputs is refused before the
// agreement, so its peers fail with it instead of waiting in the key gather.
TEST(Aliasing, AContextParallelRankWithAnOverlappingErrorWordFailsEveryRank) {
  const DecodeData d = random_decode(4343, 2, 1, {300, 700}, 1024);
  std::vector<cpidx::Status> got(2);
  // A rank failing alone leaves the other in a collective with no timeout: a watchdog turns
  // that hang into a failure.
  std::promise<void> finished;
  std::future<void> done = finished.get_future();
  std::thread ranks([&] {
    run_ranks(2, [&](int rank, cpidx::Communicator& comm) {
      cpidx::Geometry g;
      ASSERT_TRUE(cpidx::make_geometry(2, 2, rank, &g).is_ok());
      std::vector<int32_t> lens = d.seq_lens;
      IdsBuffer ids(1, d.rows(), kTopK);
      int32_t own_err = 0;
      int32_t* err = rank == 0 ? lens.data() + 1 : &own_err;  // rank 0's on its seq_lens
      cpidx::DecodeInputs local = d.inputs(rank, 1);
      local.seq_lens = lens.data();
      got[static_cast<size_t>(rank)] =
          cpidx::ref::cp_decode(comm, g, local, {kTopK, 0, 1}, ids.out(), nullptr, err);
      EXPECT_TRUE(ids.all_poison()) << "rank " << rank;
      EXPECT_EQ(lens, d.seq_lens) << "rank " << rank;
    });
    finished.set_value();
  });
  if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: a rank is still waiting in a collective after 60 s\n");
    std::fflush(nullptr);
    std::_Exit(1);
  }
  ranks.join();
  EXPECT_NE(got[0].message().find("err and seq_lens share memory"), std::string::npos)
      << got[0].to_string();
  EXPECT_FALSE(got[1].is_ok()) << "rank 1 went on alone";
}

}  // namespace
