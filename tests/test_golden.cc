// The golden cases of spec/golden: exact ids (order and ties included) through the plain
// decode, the context-parallel decode at every valid world size, prefill and the sparse table.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "json_lite.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;
using json_lite::Value;

const Value& golden_cases() {
  static const Value cases =
      json_lite::parse_file(std::string(CPIDX_TEST_DATA_DIR) + "/golden_cases.json")["cases"];
  return cases;
}

std::vector<const Value*> cases_of(const std::string& kind) {
  std::vector<const Value*> out;
  for (const auto& c : golden_cases().array) {
    if (c["kind"].string == kind) out.push_back(&c);
  }
  return out;
}

cpidx::Selection selection_of(const Value& c) {
  cpidx::Selection sel;
  sel.topk = c["K"].as_int();
  sel.init_blocks = c["init"].as_int();
  sel.local_blocks = c["local"].as_int();
  return sel;
}

DecodeData decode_data_of(const Value& c) {
  return golden_decode(static_cast<uint64_t>(c["seed"].number), c["T"].as_int(), c["Q"].as_int(),
                       c["seq_lens"].ints(), static_cast<float>(c["scale"].number));
}

// Expected ids of global head h, row r: ids[h][r][*].
void expect_head_rows(const Value& expected_ids, int head, const int32_t* got_base, int64_t rows,
                      int topk, int64_t row_stride, const std::string& where) {
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<int32_t> want =
        expected_ids[static_cast<size_t>(head)][static_cast<size_t>(r)].ints();
    const std::vector<int32_t> got(got_base + r * row_stride, got_base + r * row_stride + topk);
    ASSERT_EQ(got, want) << where << " head " << head << " row " << r;
  }
}

TEST(Golden, HasAllKinds) {
  EXPECT_GE(cases_of("decode").size(), 10u);
  EXPECT_GE(cases_of("prefill").size(), 2u);
  EXPECT_GE(cases_of("sparse_table").size(), 4u);
}

TEST(Golden, DecodePlain) {
  for (const Value* c : cases_of("decode")) {
    const DecodeData d = decode_data_of(*c);
    const cpidx::Selection sel = selection_of(*c);
    IdsBuffer ids(d.total_heads, d.rows(), sel.topk);
    int32_t err = 0;
    const cpidx::Status s = cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, &err);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(err, 0);
    const std::string where = "seed " + std::to_string(c->operator[]("seed").as_int());
    for (int h = 0; h < d.total_heads; ++h) {
      expect_head_rows((*c)["ids"], h, ids.row(h, 0), d.rows(), sel.topk, sel.topk, where);
    }
  }
}

TEST(Golden, DecodeContextParallelEveryWorld) {
  for (const Value* c : cases_of("decode")) {
    const DecodeData d = decode_data_of(*c);
    const cpidx::Selection sel = selection_of(*c);
    for (int world : valid_worlds(d.total_heads)) {
      std::vector<IdsBuffer> per_rank;
      std::vector<cpidx::Geometry> geos(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(
            cpidx::make_geometry(d.total_heads, world, r, &geos[static_cast<size_t>(r)]).is_ok());
        per_rank.emplace_back(geos[static_cast<size_t>(r)].local_heads, d.rows(), sel.topk);
      }
      std::vector<cpidx::Status> status(static_cast<size_t>(world));
      run_ranks(world, [&](int r, cpidx::Communicator& comm) {
        const cpidx::Geometry& g = geos[static_cast<size_t>(r)];
        int32_t err = 0;
        status[static_cast<size_t>(r)] =
            cpidx::ref::cp_decode(comm, g, d.inputs(g.head_offset, g.local_heads), sel,
                                  per_rank[static_cast<size_t>(r)].out(), nullptr, &err);
      });
      const std::string where =
          "seed " + std::to_string((*c)["seed"].as_int()) + " P " + std::to_string(world);
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(status[static_cast<size_t>(r)].is_ok())
            << status[static_cast<size_t>(r)].to_string();
        const cpidx::Geometry& g = geos[static_cast<size_t>(r)];
        for (int j = 0; j < g.local_heads; ++j) {
          expect_head_rows((*c)["ids"], g.head_offset + j,
                           per_rank[static_cast<size_t>(r)].row(j, 0), d.rows(), sel.topk, sel.topk,
                           where + " rank " + std::to_string(r));
        }
      }
    }
  }
}

TEST(Golden, Prefill) {
  for (const Value* c : cases_of("prefill")) {
    const std::vector<int32_t> q_lens = (*c)["q_lens"].ints();
    const std::vector<int32_t> context = (*c)["context_lens"].ints();
    const std::vector<int32_t> seq_lens = (*c)["seq_lens"].ints();
    const int heads = (*c)["T"].as_int();
    int64_t tokens = 0;
    for (int32_t q : q_lens) tokens += q;
    // The generator draws [tokens][T][D] queries, then the cache, as for decode with Q = 1
    // over `tokens` pseudo-requests; build it with golden_decode's layout directly.
    GoldenStream stream(static_cast<uint64_t>((*c)["seed"].number));
    std::vector<uint16_t> query(static_cast<size_t>(tokens) * heads * kD);
    for (auto& q : query) q = bf16_of(static_cast<float>(stream.next()));
    const int reqs = static_cast<int>(seq_lens.size());
    const int64_t blocks =
        std::max<int64_t>(1, cpidx::cdiv(*std::max_element(seq_lens.begin(), seq_lens.end()), kBS));
    std::vector<uint16_t> cache(static_cast<size_t>(reqs * blocks) * kBS * kD);
    for (auto& k : cache) k = bf16_of(static_cast<float>(stream.next()));
    std::vector<int32_t> block_table(static_cast<size_t>(reqs * blocks));
    for (int req = 0; req < reqs; ++req) {
      for (int64_t b = 0; b < blocks; ++b) {
        block_table[static_cast<size_t>(req * blocks + b)] = static_cast<int32_t>(b * reqs + req);
      }
    }
    std::vector<int32_t> cu(1, 0);
    for (int32_t q : q_lens) cu.push_back(cu.back() + q);

    cpidx::PrefillInputs in;
    in.query = query.data();
    in.q_row_stride = static_cast<int64_t>(heads) * kD;
    in.q_head_stride = kD;
    in.num_heads = heads;
    in.cache = {cache.data(), cpidx::DType::kBF16, reqs * blocks};
    in.block_table = block_table.data();
    in.bt_row_stride = blocks;
    in.cu_seqlens_q = cu.data();
    in.context_lens = context.data();
    in.seq_lens = seq_lens.data();
    in.num_reqs = reqs;
    in.num_tokens = tokens;
    in.max_seq_len = static_cast<int32_t>(blocks * kBS);
    in.scale = static_cast<float>((*c)["scale"].number);
    const cpidx::Selection sel = selection_of(*c);
    IdsBuffer ids(heads, tokens, sel.topk);
    int32_t err = 0;
    const cpidx::Status s = cpidx::ref::prefill_topk(in, sel, ids.out(), &err);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(err, 0);
    for (int h = 0; h < heads; ++h) {
      expect_head_rows((*c)["ids"], h, ids.row(h, 0), tokens, sel.topk, sel.topk,
                       "prefill seed " + std::to_string((*c)["seed"].as_int()));
    }
  }
}

TEST(Golden, SparseTable) {
  std::map<int, const Value*> decode_by_seed;
  for (const Value* c : cases_of("decode")) decode_by_seed[(*c)["seed"].as_int()] = c;
  for (const Value* c : cases_of("sparse_table")) {
    const Value& dc = *decode_by_seed.at((*c)["from_seed"].as_int());
    const DecodeData d = decode_data_of(dc);
    const int topk = (*c)["K"].as_int();
    ASSERT_EQ(topk, dc["K"].as_int());
    const int64_t rows = d.rows();
    const int64_t blocks = d.max_blocks();
    std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * blocks));
    for (int req = 0; req < d.num_reqs(); ++req) {
      for (int64_t b = 0; b < blocks; ++b) {
        attn[static_cast<size_t>(req * blocks + b)] = static_cast<int32_t>(1000 + 37 * req + b);
      }
    }
    std::vector<int32_t> table(static_cast<size_t>(rows * topk * 8), kPoison);
    std::vector<int32_t> ctx(static_cast<size_t>(rows), kPoison);
    cpidx::SparseTableOutput out;
    out.attention_block_table = attn.data();
    out.attn_bt_row_stride = blocks;
    out.table = table.data();
    out.table_row_stride = topk * 8;
    out.context_lens = ctx.data();
    out.block_page_stride = (*c)["block_page_stride"].as_int();

    // Standalone builder from the golden head-0 ids.
    std::vector<int32_t> head_ids;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<int32_t> row = dc["ids"][0][static_cast<size_t>(r)].ints();
      head_ids.insert(head_ids.end(), row.begin(), row.end());
    }
    cpidx::Status s = cpidx::ref::sparse_table(head_ids.data(), topk, d.seq_lens.data(),
                                               d.num_reqs(), d.query_len, d.max_seq_len, topk, out);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    std::vector<int32_t> want_table;
    for (const auto& row : (*c)["table"].array) {
      const std::vector<int32_t> v = row.ints();
      want_table.insert(want_table.end(), v.begin(), v.end());
    }
    EXPECT_EQ(table, want_table);
    EXPECT_EQ(ctx, (*c)["context_lens"].ints());

    // Fused emission through decode_topk on head 0 alone, and through cp_decode with L == 1.
    std::fill(table.begin(), table.end(), kPoison);
    std::fill(ctx.begin(), ctx.end(), kPoison);
    IdsBuffer ids(1, rows, topk);
    s = cpidx::ref::decode_topk(d.inputs(0, 1), selection_of(dc), ids.out(), &out, nullptr);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(ids.ids, head_ids);
    EXPECT_EQ(table, want_table);
    EXPECT_EQ(ctx, (*c)["context_lens"].ints());

    // Every rank owns one head (L == 1): its ids are the golden ids of that head, and its table
    // is built from them (the standalone builder above, checked against the golden table).
    const int world = d.total_heads;
    const auto size = static_cast<size_t>(world);
    std::vector<std::vector<int32_t>> tables(size, std::vector<int32_t>(table.size(), kPoison));
    std::vector<std::vector<int32_t>> ctxs(size, std::vector<int32_t>(ctx.size(), kPoison));
    std::vector<std::vector<int32_t>> got_ids(size);
    std::vector<cpidx::Status> status(size);
    run_ranks(world, [&](int r, cpidx::Communicator& comm) {
      cpidx::Geometry g;
      cpidx::make_geometry(d.total_heads, world, r, &g);
      cpidx::SparseTableOutput mine = out;
      mine.table = tables[static_cast<size_t>(r)].data();
      mine.context_lens = ctxs[static_cast<size_t>(r)].data();
      IdsBuffer rank_ids(1, rows, topk);
      status[static_cast<size_t>(r)] = cpidx::ref::cp_decode(
          comm, g, d.inputs(g.head_offset, 1), selection_of(dc), rank_ids.out(), &mine, nullptr);
      got_ids[static_cast<size_t>(r)] = rank_ids.ids;
    });
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(world));
      const auto rank = static_cast<size_t>(r);
      ASSERT_TRUE(status[rank].is_ok()) << status[rank].to_string();
      std::vector<int32_t> want_ids;
      for (int64_t row = 0; row < rows; ++row) {
        const std::vector<int32_t> v = dc["ids"][rank][static_cast<size_t>(row)].ints();
        want_ids.insert(want_ids.end(), v.begin(), v.end());
      }
      EXPECT_EQ(got_ids[rank], want_ids);
      std::vector<int32_t> want_rank_table(table.size(), kPoison);
      std::vector<int32_t> want_rank_ctx(ctx.size(), kPoison);
      cpidx::SparseTableOutput built = out;
      built.table = want_rank_table.data();
      built.context_lens = want_rank_ctx.data();
      ASSERT_TRUE(cpidx::ref::sparse_table(want_ids.data(), topk, d.seq_lens.data(), d.num_reqs(),
                                           d.query_len, d.max_seq_len, topk, built)
                      .is_ok());
      EXPECT_EQ(tables[rank], want_rank_table);
      EXPECT_EQ(ctxs[rank], want_rank_ctx);
      if (r == 0) EXPECT_EQ(tables[0], want_table);  // head 0's: the golden table itself
    }
  }
}

}  // namespace
