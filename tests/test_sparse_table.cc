// Fused sparse-table rows (CONTRACT.md section 6, REFERENCE_NOTES.md 9.1): the worked example
// of 12.6, own partial block last, padding rows, strides 8 and 16, invalid ids skipped, the
// context length capped at pos + 1, and a second implementation of the row rules on random
// selections.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

struct TableRun {
  std::vector<int32_t> table, ctx;
  cpidx::Status status;
};

TableRun run_table(const std::vector<int32_t>& ids, int topk, const std::vector<int32_t>& seq_lens,
                   int query_len, int32_t max_seq_len, const std::vector<int32_t>& attn,
                   int64_t attn_stride, int page_stride, int64_t row_stride = -1) {
  const int64_t rows = static_cast<int64_t>(seq_lens.size()) * query_len;
  if (row_stride < 0) row_stride = topk * 8;
  TableRun run;
  run.table.assign(static_cast<size_t>(rows * row_stride), kPoison);
  run.ctx.assign(static_cast<size_t>(rows), kPoison);
  cpidx::SparseTableOutput out;
  out.attention_block_table = attn.data();
  out.attn_bt_row_stride = attn_stride;
  out.table = run.table.data();
  out.table_row_stride = row_stride;
  out.context_lens = run.ctx.data();
  out.block_page_stride = page_stride;
  run.status =
      cpidx::ref::sparse_table(ids.data(), topk, seq_lens.data(), static_cast<int>(seq_lens.size()),
                               query_len, max_seq_len, topk, out);
  return run;
}

std::vector<int32_t> pages(int32_t attn_block, int stride) {
  std::vector<int32_t> p;
  for (int j = 0; j < 8; ++j) p.push_back(attn_block * stride + j);
  return p;
}

std::vector<int32_t> concat(std::vector<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(SparseTable, WorkedExamplePaddedRows) {
  // REFERENCE_NOTES.md 12.6: topk [[1,0,-1],[0,1,-1]], block table [[5,7],[11,13]],
  // seq_lens [129, 0] -> ctx [129, 0].
  for (int stride : {8, 16}) {
    const TableRun run =
        run_table({1, 0, -1, 0, 1, -1}, 3, {129, 0}, 1, 256, {5, 7, 11, 13}, 2, stride);
    ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
    EXPECT_EQ(run.ctx, (std::vector<int32_t>{129, 0}));
    const std::vector<int32_t> want =
        concat({pages(5, stride), pages(7, stride),  // tail last
                std::vector<int32_t>(8, 0), std::vector<int32_t>(24, 0)});
    EXPECT_EQ(run.table, want) << "stride " << stride;
  }
}

TEST(SparseTable, OwnBlockLastAndContextLength) {
  const std::vector<int32_t> attn = {100, 101, 102, 103};
  // seq 300: own block 2 selected first in order, placed last; ctx = 2*128 + 44.
  TableRun run = run_table({2, 0, 1, -1}, 4, {300}, 1, 512, attn, 4, 8);
  ASSERT_TRUE(run.status.is_ok());
  EXPECT_EQ(run.table,
            concat({pages(100, 8), pages(101, 8), pages(102, 8), std::vector<int32_t>(8, 0)}));
  EXPECT_EQ(run.ctx[0], 300);
  // Own block not selected: ctx = min(valid * 128, causal).
  run = run_table({1, 0, -1, -1}, 4, {300}, 1, 512, attn, 4, 16);
  EXPECT_EQ(run.table, concat({pages(101, 16), pages(100, 16), std::vector<int32_t>(16, 0)}));
  EXPECT_EQ(run.ctx[0], 256);
  // Ids past the own block are not valid and are skipped.
  run = run_table({3, 0, 2, -1}, 4, {300}, 1, 512, attn, 4, 8);
  EXPECT_EQ(run.table, concat({pages(100, 8), pages(102, 8), std::vector<int32_t>(16, 0)}));
  EXPECT_EQ(run.ctx[0], 128 + 44);
  // Row stride wider than the row: the gap is never written.
  run = run_table({0, -1}, 2, {5}, 1, 128, {9}, 1, 8, 20);
  EXPECT_EQ(std::vector<int32_t>(run.table.begin(), run.table.begin() + 16),
            concat({pages(9, 8), std::vector<int32_t>(8, 0)}));
  EXPECT_EQ(std::vector<int32_t>(run.table.begin() + 16, run.table.end()),
            std::vector<int32_t>(4, kPoison));
  EXPECT_EQ(run.ctx[0], 5);
}

// CONTRACT.md section 6: without the own block the context length is min(valid * 128, pos + 1);
// a repeated id counts twice in valid, so only the pos + 1 cap keeps it at 200.
TEST(SparseTable, ContextLengthIsCappedByThePosition) {
  const TableRun run = run_table({0, 0}, 2, {200}, 1, 256, {7, 8}, 2, 8);
  ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
  EXPECT_EQ(run.ctx[0], 200);
}

// 9.1 written out with explicit slot arrays, independent of the library's loop.
void second_opinion(const int32_t* sel, int topk, int64_t abs_pos, const int32_t* attn_row,
                    int stride, int32_t* table, int32_t* ctx) {
  const int64_t causal = std::max<int64_t>(abs_pos + 1, 0);
  const int64_t self_blk = abs_pos >= 0 ? abs_pos / 128 : -1;
  std::vector<int> valid(topk), full(topk), tail(topk), slot(topk);
  int n_full = 0, n_valid = 0;
  bool has_tail = false;
  for (int i = 0; i < topk; ++i) {
    valid[i] = causal > 0 && sel[i] >= 0 && sel[i] <= self_blk;
    full[i] = valid[i] && sel[i] < self_blk;
    tail[i] = valid[i] && sel[i] == self_blk;
    n_full += full[i];
    n_valid += valid[i];
    has_tail = has_tail || tail[i];
  }
  for (int i = 0, before = 0; i < topk; ++i) {
    slot[i] = full[i] ? before : n_full;
    before += full[i];
  }
  std::fill(table, table + topk * 8, 0);
  for (int i = 0; i < topk; ++i) {
    if (!valid[i]) continue;
    for (int j = 0; j < 8; ++j) table[slot[i] * 8 + j] = attn_row[sel[i]] * stride + j;
  }
  *ctx = static_cast<int32_t>(has_tail ? n_full * 128 + (causal - self_blk * 128)
                                       : std::min<int64_t>(n_valid * 128, causal));
}

TEST(SparseTable, RandomSelectionsMatchTheRowRules) {
  std::mt19937_64 rng(77);
  const int query_len = 4;
  const int topk = 6;
  const int32_t max_seq_len = 4224;
  const int64_t blocks = cpidx::cdiv(max_seq_len, 128);
  for (int stride : {8, 16}) {
    const std::vector<int32_t> seq_lens = {1, 127, 128, 129, 255, 256, 257, 4097, 0, 260, 132};
    std::vector<int32_t> attn(seq_lens.size() * blocks);
    for (auto& a : attn) a = static_cast<int32_t>(rng() % 100000);
    const int64_t rows = static_cast<int64_t>(seq_lens.size()) * query_len;
    std::vector<int32_t> ids(static_cast<size_t>(rows * topk));
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t pos =
          seq_lens[static_cast<size_t>(row / query_len)] - query_len + row % query_len;
      const int64_t visible = cpidx::visible_blocks(pos);
      // A distinct selection of min(K, V) blocks in random order, own block included, -1 after.
      std::vector<int32_t> all(static_cast<size_t>(visible));
      for (int64_t b = 0; b < visible; ++b) all[static_cast<size_t>(b)] = static_cast<int32_t>(b);
      std::shuffle(all.begin(), all.end(), rng);
      if (visible > 0) {
        auto own = std::find(all.begin(), all.end(), static_cast<int32_t>(visible - 1));
        std::iter_swap(all.begin() + static_cast<int64_t>(rng() % std::min<int64_t>(visible, topk)),
                       own);
      }
      for (int s = 0; s < topk; ++s) {
        ids[static_cast<size_t>(row * topk + s)] = s < visible ? all[static_cast<size_t>(s)] : -1;
      }
    }
    const TableRun run =
        run_table(ids, topk, seq_lens, query_len, max_seq_len, attn, blocks, stride);
    ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
    for (int64_t row = 0; row < rows; ++row) {
      const size_t req = static_cast<size_t>(row / query_len);
      std::vector<int32_t> want(topk * 8);
      int32_t want_ctx = 0;
      second_opinion(&ids[static_cast<size_t>(row * topk)], topk,
                     seq_lens[req] - query_len + row % query_len, &attn[req * blocks], stride,
                     want.data(), &want_ctx);
      EXPECT_EQ(std::vector<int32_t>(run.table.begin() + row * topk * 8,
                                     run.table.begin() + (row + 1) * topk * 8),
                want)
          << "row " << row;
      EXPECT_EQ(run.ctx[static_cast<size_t>(row)], want_ctx) << "row " << row;
    }
  }
}

TEST(SparseTable, FusedDecodeEqualsTopkThenTable) {
  const DecodeData d = random_decode(88, 1, 4, {1, 129, 4097, 0, 127, 256}, 4224);
  const cpidx::Selection sel{16, 0, 1};
  const int64_t blocks = d.max_blocks();
  std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * blocks));
  for (size_t i = 0; i < attn.size(); ++i) attn[i] = static_cast<int32_t>(5000 + 3 * i);
  IdsBuffer ids(1, d.rows(), sel.topk);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, nullptr).is_ok());
  for (int stride : {8, 16}) {
    const TableRun standalone =
        run_table(ids.ids, sel.topk, d.seq_lens, d.query_len, d.max_seq_len, attn, blocks, stride);
    std::vector<int32_t> table(standalone.table.size(), kPoison),
        ctx(standalone.ctx.size(), kPoison);
    cpidx::SparseTableOutput out{attn.data(),  blocks,     table.data(),
                                 sel.topk * 8, ctx.data(), stride};
    IdsBuffer fused_ids(1, d.rows(), sel.topk);
    ASSERT_TRUE(
        cpidx::ref::decode_topk(d.all_heads(), sel, fused_ids.out(), &out, nullptr).is_ok());
    EXPECT_EQ(fused_ids.ids, ids.ids);
    EXPECT_EQ(table, standalone.table);
    EXPECT_EQ(ctx, standalone.ctx);
  }
}

}  // namespace
