// GPU decode kernels against the CPU reference: random shapes (Q, T, K, contexts to 1M tokens,
// padding rows, shuffled block tables, bf16 and fp8), the golden cases (exact, plain and
// context-parallel), simulated context-parallel ranks == plain decode bitwise, tie-heavy inputs,
// block scores rising through long requests (candidate buffers refilled), the fused sparse
// table, CUDA-graph replay with changing lengths, objects torn down during a capture, bad
// device values, garbage keys in the merge, and the selection's three grids (many items, few
// long lists).
// Every test skips cleanly without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>

#include "cpidx/comm.h"
#include "cpidx/prefill.h"
#include "cpidx/workspace.h"
#include "cuda/kernels.h"
#include "gpu_util.h"
#include "json_lite.h"

namespace {

using namespace cpidx_gpu_test;
using cpidx::DType;
using cpidx::Selection;
using cpidx_test::Values;
using cpidx_test::bf16_of;
using cpidx_test::kBS;
using cpidx_test::kD;
using cpidx_test::lengths;
using cpidx_test::random_decode;
using cpidx_test::sel_of;

// Bodies run once per path by the tests below.
void graph_replay_follows_new_lengths_and_tables();
void bad_device_values_are_clamped_and_flagged();

// Every (T, Q) runs the instance of its own padded width (8 to 64 columns), with col % Q
// non-trivial from Q = 2: bf16 and fp8 pages (fp8's 8- and 16-column instances are their own code:
// four and three CTAs a SM, paired pages at 16).
TEST(GpuDecode, RandomShapesMatchReference) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    std::mt19937 rng(7);
    int seed = 100;
    for (int T : {1, 2, 4, 8}) {
      for (int Q : {1, 2, 4, 8}) {
        const int32_t max_len = 3000 + 997 * Q;
        DecodeData d = random_decode(seed++, T, Q, lengths(rng, 5, max_len, true), max_len, dtype);
        expect_matches_reference(d, sel_of(16), std::string(cpidx::to_string(dtype)) +
                                                    " T=" + std::to_string(T) +
                                                    " Q=" + std::to_string(Q));
      }
    }
  }
}

TEST(GpuDecode, TopKRange) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  for (int K : {1, 4, 16, 33, 64}) {
    for (auto [init, local] : {std::pair{0, 1}, std::pair{1, 2}, std::pair{2, 4}}) {
      DecodeData d = random_decode(200 + K, 4, 2, lengths(rng, 6, 20000, true), 20000);
      expect_matches_reference(d, sel_of(K, init, local), "K=" + std::to_string(K));
    }
  }
}

TEST(GpuDecode, ContextsFromOneTokenTo1M) {
  SKIP_WITHOUT_GPU();
  const int32_t bound = 1 << 20;
  // One token, block edges, a long one and a full 1M-token request, plus a padding request.
  DecodeData d = random_decode(300, 4, 1, {1, 127, 128, 129, 0, 70001, bound}, bound);
  expect_matches_reference(d, sel_of(16), "1..1M");
}

// fp8 pages on the default query bound (4 heads x 8: 32 columns, two scoring CTAs per SM) and on
// each batch's own (4 heads x Q = 4 and 1: 16 and 8 columns, three and four CTAs per SM).
TEST(GpuDecode, Fp8CacheMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (bool tight : {false, true}) {
    UseTightQueryBound bound(tight);
    const std::string what = tight ? "fp8, max_query_len = Q" : "fp8";
    std::mt19937 rng(13);
    for (int q : {4, 1}) {
      DecodeData d = random_decode(400 + q, 4, q, lengths(rng, 7, 40000, true), 40000,
                                   DType::kFP8E4M3);
      expect_matches_reference(d, sel_of(16), what + ", Q=" + std::to_string(q));
    }
    DecodeData t = random_decode(401, 4, 1, lengths(rng, 7, 9000, true), 9000, DType::kFP8E4M3,
                                 Values::kTies, 1.0f);
    const Selection sel = sel_of(16, 1, 2);
    const std::vector<int32_t> want = cpu_decode(t, sel);
    for (Path path : kBothPaths) {
      UsePath use(path);
      EXPECT_EQ(gpu_decode(t, sel), want) << what << ": ties must match exactly, "
                                          << path_name(path);
    }
  }
}

// Block scores that rise through every request: each page's key beats every column's running
// K-th, so on the fused path a CTA's candidate buffers fill every cap pages and are compacted on
// the next. fp8 at 16 columns (4 heads, Q = 4) offers two pages' keys a barrier (score_topk.cu,
// kPairPages) and compacts while two slots are left. One scoring CTA per SM, so each holds ~80
// pages (two fills or more at K = 16, cap 32; one at K = 33, cap 66); odd page counts and CTA
// ranges that end anywhere put pairs against every boundary. Queries are all 1 and every key a
// small integer, so each dot is exact and the ids must match the reference in order: token 0 of
// block b holds 200 + b (in 16s and a remainder, every one exact in e4m3 and bf16), above any
// other token's dot (|dot| <= 128, keys of -1, 0 or 1).
TEST(GpuDecode, RisingBlockScoresRefillTheCandidateBuffers) {
  SKIP_WITHOUT_GPU();
  UseTightQueryBound bound(true);  // the 16-column instance
  UseCtasPerSm one(1);
  // The e4m3 bits of the integers 0-16, each exact (exponent bias 7, three mantissa bits).
  uint8_t e4m3[17] = {};
  for (int v = 1; v <= 16; ++v) {
    int e = 0;
    while ((v >> (e + 1)) != 0) ++e;
    e4m3[v] = static_cast<uint8_t>(((e + 7) << 3) | (((v << 3) >> e) & 7));
    ASSERT_EQ(cpidx::ref::fp8e4m3_to_float(e4m3[v]), static_cast<float>(v)) << "e4m3 of " << v;
  }
  const std::vector<int32_t> lens = {150000, 0,      3 * kBS + 1, 149873, 131071,
                                     140000, 150000, 99999,       150000, 150000};
  for (DType dtype : {DType::kFP8E4M3, DType::kBF16}) {
    DecodeData d = random_decode(610 + static_cast<int>(dtype), 4, 4, lens, 150000, dtype,
                                 Values::kTies, 1.0f);
    for (auto& q : d.query) q = bf16_of(1.0f);
    for (int req = 0; req < d.num_reqs(); ++req) {
      const int64_t used = cpidx::cdiv(lens[static_cast<size_t>(req)], kBS);
      for (int64_t b = 0; b < used; ++b) {
        const int64_t page = d.block_table[static_cast<size_t>(req * d.bt_row_stride + b)];
        const int sum = 200 + static_cast<int>(b);  // <= 1371: 85 dims of 16 and one of 11
        for (int dim = 0; dim < kD; ++dim) {
          const int v = dim < sum / 16 ? 16 : dim == sum / 16 ? sum % 16 : 0;
          const size_t at = static_cast<size_t>(page) * kBS * kD + static_cast<size_t>(dim);
          if (dtype == DType::kBF16) d.cache_bf16[at] = bf16_of(static_cast<float>(v));
          else d.cache_fp8[at] = e4m3[v];
        }
      }
    }
    for (int K : {16, 33}) {
      const Selection sel = sel_of(K, 1, 2);
      const std::vector<int32_t> want = cpu_decode(d, sel);
      for (Path path : kBothPaths) {
        UsePath use(path);
        EXPECT_EQ(gpu_decode(d, sel), want)
            << cpidx::to_string(dtype) << " K=" << K << " " << path_name(path);
      }
    }
  }
}

// Queries far from 1 and non-finite values, bf16 and fp8 caches. An fp8 page's MMAs are fp16,
// with each query column scaled into fp16's range by its own power of two (score_topk.cu): a
// column of 2^100 or 2^-130 (bf16 subnormals), or one with halves 2^120 apart, must score as
// the reference does. A column holding an inf or a NaN keeps the other values' scaling, and
// NaN keys sprinkled through the cache never win (CONTRACT.md): those ids must match exactly.
// Each on the default query bound (32 columns: fragments read from shared memory) and on the
// batch's own at Q = 1 and 4 (8 and 16 columns: fragments in registers, 4 and 3 fp8 CTAs/SM).
TEST(GpuDecode, QueriesOfAnyMagnitudeAndNonFiniteValues) {
  SKIP_WITHOUT_GPU();
  using cpidx::ref::bf16_to_float;
  for (const auto& [tight, Q] : {std::pair{false, 2}, std::pair{true, 1}, std::pair{true, 4}}) {
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      UseTightQueryBound bound(tight);
      const bool fp8 = dtype == DType::kFP8E4M3;
      const std::string what = std::string(fp8 ? "fp8" : "bf16") + ", Q=" + std::to_string(Q) +
                               (tight ? ", max_query_len = Q" : "");
      std::mt19937 rng(19);
      // Scale a whole (row, head) column by 2^e (e = ±60 on its two halves for the split kind);
      // bf16 pages skip 2^-130: tensor cores need not keep fp32 subnormal products.
      DecodeData d = random_decode(420, 4, Q, lengths(rng, 6, 20000, true), 20000, dtype);
      const std::vector<int> exps = fp8 ? std::vector<int>{0, 100, -100, -130, 1000}
                                        : std::vector<int>{0, 100, -100, 1000};
      const int64_t columns = d.rows() * d.total_heads;
      for (int64_t c = 0; c < columns; ++c) {
        const int e = exps[static_cast<size_t>(c) % exps.size()];
        for (int i = 0; i < cpidx_test::kD; ++i) {
          uint16_t& q = d.query[static_cast<size_t>(c * cpidx_test::kD + i)];
          const int ei = e == 1000 ? (i < cpidx_test::kD / 2 ? 60 : -60) : e;
          q = bf16_of(std::ldexp(bf16_to_float(q), ei));
        }
      }
      expect_matches_reference(d, sel_of(16), what + ", queries scaled by 2^e");

      // Non-finite: every column gets an inf, a -inf or a NaN at a random dim; 1 in 64 keys NaN.
      DecodeData n = random_decode(421, 4, Q, lengths(rng, 6, 20000, true), 20000, dtype);
      const uint16_t specials[3] = {0x7F80, 0xFF80, 0x7FC0};
      for (int64_t c = 0; c < n.rows() * n.total_heads; ++c) {
        n.query[static_cast<size_t>(c * cpidx_test::kD + rng() % cpidx_test::kD)] =
            specials[c % 3];
      }
      if (fp8) {
        for (auto& k : n.cache_fp8) if (rng() % 64 == 0) k = rng() % 2 ? 0x7F : 0xFF;
      } else {
        for (auto& k : n.cache_bf16) if (rng() % 64 == 0) k = 0x7FC0;
      }
      const Selection sel = sel_of(16, 1, 2);
      const std::vector<int32_t> want = cpu_decode(n, sel);
      for (Path path : kBothPaths) {
        UsePath use(path);
        EXPECT_EQ(gpu_decode(n, sel), want) << what << ", non-finite: " << path_name(path);
      }
    }
  }
}

TEST(GpuDecode, TieHeavyInputsFollowContractOrder) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  // Up to 12000 tokens (<= 94 blocks: every list is ranked directly), and up to 100000 (782
  // blocks): there most blocks share the top score, so the selection's group bound passes about
  // K / 32 of them: K = 4 ranks those (~100), K = 16 and 32 find too many and take the radix
  // select, K = 33 takes it directly.
  for (int32_t max_len : {12000, 100000}) {
    for (int Q : {1, 4}) {
      for (int K : {4, 16, 32, 33}) {
        if (max_len == 12000 && (K == 32 || K == 33)) continue;
        // Small integers: every dot product is exact, so ids must match in order, ties included.
        DecodeData d = random_decode(500 + Q * 10 + K + max_len, 4, Q,
                                     lengths(rng, 6, max_len, true), max_len, DType::kBF16,
                                     Values::kTies, 1.0f);
        expect_exact_on_both_paths(d, sel_of(K, 1, 2),
                                   "L<=" + std::to_string(max_len) + " Q=" + std::to_string(Q) +
                                       " K=" + std::to_string(K));
      }
    }
  }
}

TEST(GpuDecode, EqualScoresEverywhereFollowContractOrder) {
  SKIP_WITHOUT_GPU();
  // Every key row the same: within a request every block scores the same, so the ids are the
  // contract's tie order alone. The selection's group bound then passes about K / 32 of a long
  // list's blocks: over 128 (the radix select) at 300000 and 100000 tokens for every K, and at
  // 64000 for K >= 16; under it (ranked from the bound) at 64000 for K = 4. 300000 tokens (2344
  // blocks) also re-read their list from L2 (over 2048 keys).
  for (int Q : {1, 4}) {
    const int32_t longest = Q == 1 ? 300000 : 100000;  // the CPU reference's time
    for (int K : {4, 16, 32}) {
      DecodeData d = random_decode(700 + Q * 100 + K, 4, Q, {1000, longest, 0, 64000, 129},
                                   longest);
      std::fill(d.cache_bf16.begin(), d.cache_bf16.end(), bf16_of(0.5f));
      const Selection sel = sel_of(K, 1, 2);
      const std::vector<int32_t> want = cpu_decode(d, sel);
      for (Path path : kBothPaths) {
        UsePath use(path);
        EXPECT_EQ(gpu_decode(d, sel), want) << "Q=" << Q << " K=" << K << " " << path_name(path);
        EXPECT_EQ(gpu_cp_simulated(d, sel, 2), want)
            << "CP P=2, Q=" << Q << " K=" << K << " " << path_name(path);
      }
    }
  }
}

TEST(GpuDecode, ContextParallelSimulatedEqualsPlainBitwise) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(19);
  for (int P : {2, 4, 8}) {
    for (int Q : {1, 4}) {
      // Short requests where some ranks own no block, a padding request, long ones.
      std::vector<int32_t> s = lengths(rng, 6, 50000, true);
      s[0] = 100;
      s[2] = 300;
      DecodeData d = random_decode(600 + P * 10 + Q, 4, Q, s, 50000);
      // The merge ranks P * K candidates less the shards' pads: 32-512 at K = 16 and 64, one
      // key a lane up to 32 and two past it, odd counts from the short requests.
      for (int K : {16, 64}) {
        const Selection sel = sel_of(K);
        const std::vector<int32_t> plain = gpu_decode(d, sel);  // automatic path
        for (Path path : kBothPaths) {
          UsePath use(path);
          EXPECT_EQ(gpu_cp_simulated(d, sel, P), plain)
              << "P=" << P << " Q=" << Q << " K=" << K << " " << path_name(path);
        }
      }
    }
  }
  // Replicated heads: T=1 at P=4 and T=2 at P=8.
  DecodeData d1 = random_decode(650, 1, 2, lengths(rng, 5, 30000, true), 30000);
  DecodeData d2 = random_decode(651, 2, 1, lengths(rng, 5, 30000, true), 30000);
  const std::vector<int32_t> plain1 = gpu_decode(d1, sel_of(16)), plain2 = gpu_decode(d2, sel_of(16));
  for (Path path : kBothPaths) {
    UsePath use(path);
    EXPECT_EQ(gpu_cp_simulated(d1, sel_of(16), 4), plain1) << path_name(path);
    EXPECT_EQ(gpu_cp_simulated(d2, sel_of(16), 8), plain2) << path_name(path);
  }
}

// A Decoder made without cp_decode's gather buffers (for a caller that runs the exchange itself,
// as Python's torch exchange does) runs shard_keys and merge to the plain decode's ids on a
// smaller workspace, and its cp_decode refuses before anything runs, naming the setting.
TEST(GpuDecode, WithoutExchangeBuffersShardKeysAndMergeStillEqualPlain) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  DecodeData d = random_decode(660, 4, 2, lengths(rng, 5, 40000, true), 40000);
  const Selection sel = sel_of(16);
  const std::vector<int32_t> plain = gpu_decode(d, sel);
  {
    UseExchangeBuffers none(false);
    for (int P : {2, 4}) EXPECT_EQ(gpu_cp_simulated(d, sel, P), plain) << "P=" << P;
  }
  cpidx::DecodeConfig with = config_for(d, sel, 2, 0);
  with.check_agreement = false;  // the refusal below comes before any collective either way
  cpidx::DecodeConfig without = with;
  without.exchange_buffers = false;
  std::unique_ptr<cpidx::Decoder> full, lean;
  ASSERT_TRUE(cpidx::Decoder::create(with, 0, &full).is_ok());
  ASSERT_TRUE(cpidx::Decoder::create(without, 0, &lean).is_ok());
  const cpidx::DecodeWorkspaceLayout w =
      cpidx::decode_workspace_layout(with, full->plan().max_grid);
  EXPECT_EQ(w.total, full->plan().workspace_bytes);
  EXPECT_EQ(full->plan().workspace_bytes - lean->plan().workspace_bytes, w.split_keys - w.q_send)
      << "full " << full->plan().workspace_bytes << ", lean " << lean->plan().workspace_bytes;
  // The exchange's buffers are the four gathers' alone, and none without them.
  EXPECT_GT(w.split_keys - w.q_send, 0u);
  EXPECT_EQ(full->exchange_buffer_bytes(), w.split_keys - w.q_send);
  EXPECT_EQ(lean->exchange_buffer_bytes(), 0u);
  auto comms = cpidx::make_thread_communicators(2);
  DeviceBatch b(d);
  const int64_t n = d.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(2 * n * sel.topk));
  ids.poison();
  const cpidx::Status st = lean->cp_decode(*comms[0], b.inputs(0, 2),
                                           cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk},
                                           nullptr, nullptr);
  EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("exchange_buffers = false"), std::string::npos) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int32_t v : ids.download()) ASSERT_EQ(v, cpidx_test::kPoison);  // nothing ran
}

// A world of one's cp_decode without a communicator: the plain decode's ids, eager and in a
// replayed graph, and the checks cp_decode runs (nothing runs for a refused step); refused by a
// Decoder of a larger world, naming what it is.
TEST(GpuDecode, AWorldOfOneNeedsNoCommunicator) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(29);
  const DecodeData d = random_decode(670, 4, 2, lengths(rng, 6, 30000, true), 30000);
  const Selection sel = sel_of(16);
  const std::vector<int32_t> plain = gpu_decode(d, sel);
  std::unique_ptr<cpidx::Decoder> one, two;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &one).is_ok());
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel, 2, 0), 0, &two).is_ok());
  DeviceBatch b(d);
  const int64_t n = d.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(4 * n * sel.topk));
  const cpidx::TopkOutput out{ids.ptr, n * sel.topk, sel.topk};
  ids.poison();
  const cpidx::Status few = one->cp_decode(b.inputs(0, 2), out, nullptr, nullptr);
  EXPECT_EQ(few.code(), cpidx::StatusCode::kInvalidArgument) << few.to_string();
  EXPECT_NE(few.message().find("query heads (num_heads) must be 4, got 2"), std::string::npos)
      << few.to_string();
  const cpidx::Status wide = two->cp_decode(b.inputs(0, 2), out, nullptr, nullptr);
  EXPECT_EQ(wide.code(), cpidx::StatusCode::kInvalidArgument) << wide.to_string();
  EXPECT_NE(wide.message().find("world of one"), std::string::npos) << wide.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int32_t v : ids.download()) ASSERT_EQ(v, cpidx_test::kPoison);  // nothing ran
  ASSERT_TRUE(one->cp_decode(b.all_heads(), out, nullptr, nullptr).is_ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(ids.download(), plain);
  ids.poison();
  CapturedGraph graph([&](cudaStream_t stream) {
    return one->cp_decode(b.all_heads(), out, nullptr, stream);
  });
  ASSERT_TRUE(graph.status().is_ok()) << graph.status().to_string();
  EXPECT_EQ(one->launches_in_live_graphs(), 1);  // the workspace stays while the graph lives
  ASSERT_EQ(graph.replay(), cudaSuccess);
  EXPECT_EQ(ids.download(), plain);
}

// ---- Golden cases --------------------------------------------------------------------------
const json_lite::Value& golden() {
  static const json_lite::Value cases =
      json_lite::parse_file(std::string(CPIDX_TEST_DATA_DIR) + "/golden_cases.json")["cases"];
  return cases;
}

TEST(GpuDecode, GoldenCasesPlainAndContextParallel) {
  SKIP_WITHOUT_GPU();
  int checked = 0;
  for (const auto& c : golden().array) {
    if (c["kind"].string != "decode") continue;
    const DecodeData d = cpidx_test::golden_decode(
        static_cast<uint64_t>(c["seed"].number), c["T"].as_int(), c["Q"].as_int(),
        c["seq_lens"].ints(), static_cast<float>(c["scale"].number));
    const Selection sel = sel_of(c["K"].as_int(), c["init"].as_int(), c["local"].as_int());
    std::vector<int32_t> want;
    for (const auto& head : c["ids"].array)
      for (const auto& row : head.array)
        for (int32_t v : row.ints()) want.push_back(v);
    for (Path path : kBothPaths) {
      UsePath use(path);
      EXPECT_EQ(gpu_decode(d, sel), want)
          << "seed " << c["seed"].number << " plain " << path_name(path);
      for (int P : cpidx_test::valid_worlds(d.total_heads)) {
        if (P == 1) continue;
        EXPECT_EQ(gpu_cp_simulated(d, sel, P), want)
            << "seed " << c["seed"].number << " P=" << P << " " << path_name(path);
      }
    }
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

// ---- Sparse table ------------------------------------------------------------------------
TEST(GpuDecode, FusedSparseTableMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (Path path : kBothPaths) {
  UsePath use(path);
  SCOPED_TRACE(path_name(path));
  for (int stride : {8, 16}) {
    for (int Q : {1, 4}) {
      DecodeData d = random_decode(700 + Q + stride, 1, Q, {1, 127, 128, 129, 0, 4097, 300},
                                   4200);
      const Selection sel = sel_of(16);
      const int64_t n = d.rows(), G = d.max_blocks();
      std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G));
      for (int r = 0; r < d.num_reqs(); ++r)
        for (int64_t b = 0; b < G; ++b) attn[r * G + b] = 1000 + 37 * r + static_cast<int32_t>(b);
      // CPU.
      cpidx_test::IdsBuffer ids(1, n, sel.topk);
      std::vector<int32_t> table(static_cast<size_t>(n * sel.topk * 8), cpidx_test::kPoison);
      std::vector<int32_t> ctx(static_cast<size_t>(n), cpidx_test::kPoison);
      cpidx::SparseTableOutput t{attn.data(), G, table.data(), sel.topk * 8, ctx.data(), stride};
      int32_t err = 0;
      ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), &t, &err).is_ok());
      // GPU.
      DeviceBatch b(d);
      DeviceVec<int32_t> dattn(attn), dids(ids.ids.size()), dtable(table.size()), dctx(ctx.size());
      dids.poison();
      dtable.poison();
      dctx.poison();
      std::unique_ptr<cpidx::Decoder> dec;
      ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
      cpidx::SparseTableOutput dt{dattn.ptr, G, dtable.ptr, sel.topk * 8, dctx.ptr, stride};
      ASSERT_TRUE(dec->decode(b.all_heads(), cpidx::TopkOutput{dids.ptr, n * sel.topk, sel.topk},
                              &dt, nullptr).is_ok());
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(dids.download(), ids.ids);
      EXPECT_EQ(dtable.download(), table) << "stride " << stride << " Q " << Q;
      EXPECT_EQ(dctx.download(), ctx);
    }
  }
  }
}

// Keys handed to Decoder::merge (a custom transport's) may be any 64-bit patterns, equal keys
// among them, which no rank sends (a block is one rank's): every rank's merge gives the
// reference's ids and sparse-table rows for them, every output written. Equal keys share a rank
// in the merge's first ranking, and the slots after it were left unwritten (shared memory);
// a tail block selected twice left a table entry as it was.
TEST(GpuDecode, MergeOfGarbageKeysEqualsReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(1901);
  const int Q = 2, bound = 768;
  for (int world : {2, 4}) {
    for (int K : {4, 16}) {
      const int T = world;  // one head a rank: the sparse table is written too
      DecodeData d = random_decode(1902, T, Q, {700, 300, 768}, bound);
      d.seq_lens = {700, -3, 1 << 30};  // clamped: 700, 0, 768
      const Selection sel = sel_of(K);
      const int64_t n = d.rows(), G = d.max_blocks();
      std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G));
      for (size_t i = 0; i < attn.size(); ++i) attn[i] = 11 + 5 * static_cast<int32_t>(i);
      DeviceBatch b(d);
      DeviceVec<int32_t> dattn(attn);
      for (int trial = 0; trial < 6; ++trial) {
        const std::vector<cpidx::Key> keys =
            cpidx_test::garbage_keys(rng, static_cast<size_t>(world * T * n * K), 2);
        DeviceVec<cpidx::Key> gathered(keys);
        for (int r = 0; r < world; ++r) {
          SCOPED_TRACE("P = " + std::to_string(world) + ", rank " + std::to_string(r) +
                       ", K = " + std::to_string(K) + ", trial " + std::to_string(trial));
          cpidx_test::IdsBuffer ids(1, n, K);
          std::vector<int32_t> table(static_cast<size_t>(n * K * 8), cpidx_test::kPoison);
          std::vector<int32_t> ctx(static_cast<size_t>(n), cpidx_test::kPoison);
          const cpidx::SparseTableOutput t{attn.data(), G, table.data(), K * 8, ctx.data(), 8};
          ASSERT_TRUE(cpidx::ref::merge_topk_keys(keys.data(), world, T, n, sel, r, 1,
                                                  d.seq_lens.data(), d.num_reqs(), Q, bound,
                                                  ids.out(), &t)
                          .is_ok());
          std::unique_ptr<cpidx::Decoder> dec;
          ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel, world, r), 0, &dec).is_ok());
          DeviceVec<int32_t> dids(ids.ids.size()), dtable(table.size()), dctx(ctx.size());
          dids.poison();
          dtable.poison();
          dctx.poison();
          const cpidx::SparseTableOutput dt{dattn.ptr, G, dtable.ptr, K * 8, dctx.ptr, 8};
          ASSERT_TRUE(dec->merge(gathered.ptr, b.all_heads(),
                                 cpidx::TopkOutput{dids.ptr, n * K, K}, &dt, nullptr)
                          .is_ok());
          CUDA_OK(cudaDeviceSynchronize());
          EXPECT_EQ(dids.download(), ids.ids);
          EXPECT_EQ(dtable.download(), table);
          EXPECT_EQ(dctx.download(), ctx);
        }
      }
    }
  }
}

// Decoders of different geometry live side by side (an engine's registry holds several): creating
// a small one must not shrink what an earlier, larger one launches with.
TEST(GpuDecode, DecodersOfDifferentGeometryCoexist) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  DecodeData big = random_decode(900, 8, 4, lengths(rng, 6, 9000, true), 9000);
  DecodeData small = random_decode(901, 1, 1, lengths(rng, 1, 300, false), 300);
  DeviceBatch b(big);
  std::unique_ptr<cpidx::Decoder> first, second;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(big, sel_of(64), 1, 0, 64), 0, &first).is_ok());
  ASSERT_TRUE(cpidx::Decoder::create(config_for(small, sel_of(1)), 0, &second).is_ok());
  const int64_t n = big.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(8 * n * 64));
  ids.poison();
  const cpidx::Status st =
      first->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * 64, 64}, nullptr, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(ids.download(), gpu_decode(big, sel_of(64)));
  EXPECT_EQ(gpu_decode(small, sel_of(1)), cpu_decode(small, sel_of(1)));
}

// Every decode kernel a Decoder may launch keeps the largest shared-memory carveout, so no SM
// changes its L1 / shared-memory split between them (a score_topk grid launched behind
// select_topk then found SMs that held fewer of its CTAs: docs/perf/README.md, v42).
TEST(GpuDecode, DecodeKernelsKeepTheLargestCarveout) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(33);
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    SCOPED_TRACE(cpidx::to_string(dtype));
    DecodeData d = random_decode(960 + static_cast<int>(dtype), 4, 1, lengths(rng, 3, 2000, true),
                                 2000, dtype);
    std::unique_ptr<cpidx::Decoder> decoder;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel_of(16)), 0, &decoder).is_ok());
    int score = -2, select = -2, merge = -2;
    CUDA_OK(cpidx::cuda::smallest_score_topk_carveout(dtype, &score));
    CUDA_OK(cpidx::cuda::smallest_select_topk_carveout(&select));
    CUDA_OK(cpidx::cuda::smallest_merge_carveout(&merge));
    EXPECT_EQ(score, cudaSharedmemCarveoutMaxShared);
    EXPECT_EQ(select, cudaSharedmemCarveoutMaxShared);
    EXPECT_EQ(merge, cudaSharedmemCarveoutMaxShared);
  }
}

// The launch shape (one to four persistent CTAs per SM, hence the pipeline depth) never changes
// the ids. The automatic plan takes four where the registers allow them (fp8 pages at 8
// columns) and two for bf16; forcing more than fit is an error that says so.
TEST(GpuDecode, CtasPerSmDoNotChangeIds) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(37);
  UseTightQueryBound bound(true);  // 4 heads x 2 tokens: 8 columns
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    DecodeData d = random_decode(950 + static_cast<int>(dtype), 4, 2,
                                 lengths(rng, 9, 70000, true), 70000, dtype);
    const Selection sel = sel_of(16);
    DeviceBatch b(d);
    const int64_t n = d.rows();
    const int auto_ctas = dtype == DType::kFP8E4M3 ? 4 : 2;
    std::vector<std::vector<int32_t>> got;
    for (int64_t split : {int64_t{0}, int64_t{1} << 17}) {
      for (int ctas : {0, 1, 2, 3, 4}) {
        const std::string what = std::string(cpidx::to_string(dtype)) + ", split " +
                                  std::to_string(split) + ", " + std::to_string(ctas) +
                                  " CTA(s)/SM";
        cpidx::DecodeConfig c = config_for(d, sel);
        c.split_max_pages = split;
        c.scoring_ctas_per_sm = ctas;
        std::unique_ptr<cpidx::Decoder> dec;
        const cpidx::Status st = cpidx::Decoder::create(c, 0, &dec);
        if (ctas > auto_ctas) {
          ASSERT_FALSE(st.is_ok()) << what;
          const std::string says =
              "scoring_ctas_per_sm = " + std::to_string(ctas) + " does not fit";
          EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
          continue;
        }
        ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
        EXPECT_EQ(dec->plan().grid, (ctas == 0 ? auto_ctas : ctas) * sms) << what;
        EXPECT_EQ(dec->step_plan(4, 2).grid, dec->plan().grid) << what << ": the bound's step";
        DeviceVec<int32_t> ids(static_cast<size_t>(4 * n * sel.topk));
        ids.poison();
        ASSERT_TRUE(dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk},
                                nullptr, nullptr).is_ok());
        CUDA_OK(cudaDeviceSynchronize());
        got.push_back(ids.download());
        EXPECT_EQ(got.back(), got.front()) << what;
      }
    }
    const CompareResult r = compare_ids(d, sel, got.front(), cpu_decode(d, sel));
    EXPECT_EQ(r.bad_rows, 0) << cpidx::to_string(dtype) << ": " << r.first_bad;
    // A bound above a step's columns (4 heads x 8 tokens: 32 columns, two CTAs per SM): a step
    // of fewer columns launches its own instance's plan (v32b), fp8 at 8 columns four CTAs.
    cpidx::DecodeConfig wide = config_for(d, sel);
    wide.max_query_len = 8;
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(wide, 0, &dec).is_ok());
    EXPECT_EQ(dec->plan().grid, 2 * sms) << cpidx::to_string(dtype);
    EXPECT_EQ(dec->step_plan(4, 8).grid, 2 * sms) << cpidx::to_string(dtype);
    EXPECT_EQ(dec->step_plan(4, 2).grid, auto_ctas * sms) << cpidx::to_string(dtype);
    // The workspace holds the widest grid a step may launch (fp8: the 8-column instance's),
    // laid out as decode_workspace_layout lays it out for max_grid.
    EXPECT_EQ(dec->plan().max_grid, auto_ctas * sms) << cpidx::to_string(dtype);
    EXPECT_EQ(cpidx::decode_workspace_layout(wide, dec->plan().max_grid).total,
              dec->plan().workspace_bytes)
        << cpidx::to_string(dtype);
  }
}

// Steps with more (request, column) items than the selection's wide grid (4 CTAs per SM) take
// its narrow grid (8 per SM of 128 threads), and beyond that loop: both against the reference,
// on both paths, lists short (one CTA's, ranked directly) and long (group bound, radix).
TEST(GpuDecode, StepsWithMoreItemsThanTheWideSelectionGrid) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(61);
  const int T = 4, Q = 4, cols = T * Q;
  for (int items : {4 * sms + 1, 8 * sms + 3 * cols}) {
    for (int32_t max_len : {2000, 20000}) {
      const int reqs = (items + cols - 1) / cols;
      DecodeData d = random_decode(6100 + items + max_len, T, Q, lengths(rng, reqs, max_len, true),
                                   max_len);
      expect_matches_reference(
          d, sel_of(16),
          "items=" + std::to_string(reqs * cols) + " max_len=" + std::to_string(max_len));
    }
  }
}

// Lists on both sides of each bound where the selection's ranks change form (8-lane passes,
// one pass of 16-byte loads past 32 keys on the wide grid and past 64 on the narrow, the group
// bound past 128), on the wide grid (4 columns a request) and the narrow one (64 columns, more
// items than the wide grid holds):
// 32-33, 63-65, 97, 127-129 blocks, odd counts included (the pass reads the pads after the last
// key).
// Tie-heavy keys at K = 16 and 64 must come out in contract order; random ones match the
// reference on both paths.
TEST(GpuDecode, ShortListsAroundTheOnePassRankOnBothGrids) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const std::vector<int32_t> edges = {4096,  4097,  8064,  8192,  8193,
                                      12289, 16255, 16256, 16384, 16385};
  for (int Q : {1, 8}) {
    const int T = Q == 1 ? 4 : 8, cols = T * Q;
    // The narrow grid: more items than the wide grid's 4 CTAs an SM.
    const int narrow_reqs = Q == 1 ? 0 : (4 * sms + cols) / cols;
    const int reqs = std::max(static_cast<int>(edges.size()), narrow_reqs);
    std::vector<int32_t> lens(static_cast<size_t>(reqs));
    for (int r = 0; r < reqs; ++r) lens[r] = edges[r % edges.size()];
    const std::string grid = Q == 1 ? "wide" : "narrow";
    for (int K : {16, 64}) {
      DecodeData ties = random_decode(7000 + Q * 100 + K, T, Q, lens, 16385, DType::kBF16,
                                      Values::kTies, 1.0f);
      expect_exact_on_both_paths(ties, sel_of(K, 1, 2), grid + " ties K=" + std::to_string(K));
    }
    DecodeData d = random_decode(7500 + Q, T, Q, lens, 16385);
    expect_matches_reference(d, sel_of(16), grid + " random");
  }
}

// Requests owning more of a rank's pages than the wide selection grid holds keys in registers
// (2048) take the deep grid (512 threads, 16 keys each, one CTA an SM) when the step has at most
// one item per SM: lists of 2049 to 8192 keys in its registers, longer ones re-read from L2.
// Both paths against the reference at K = 16 and 64, tie-heavy keys in contract order, and
// simulated context-parallel ranks (P = 2 and 4: a rank's share of a request's pages on either
// side of 2048) bit for bit equal to the plain decode.
TEST(GpuDecode, LongListsTakeTheDeepSelectionGrid) {
  SKIP_WITHOUT_GPU();
  // 2049 pages, a padding request, and 8193 (one past the deep grid's registers) less 5 tokens.
  const int32_t max_len = 8193 * kBS;
  const std::vector<int32_t> s = {2049 * kBS, 0, 8193 * kBS - 5};
  for (int Q : {1, 4}) {
    DecodeData d = random_decode(6700 + Q, 4, Q, s, max_len);
    for (int K : {16, 64}) {
      expect_matches_reference(d, sel_of(K), "Q=" + std::to_string(Q) + " K=" + std::to_string(K));
    }
    const Selection sel = sel_of(16);
    const std::vector<int32_t> plain = gpu_decode(d, sel);
    for (int P : {2, 4}) {
      for (Path path : kBothPaths) {
        UsePath use(path);
        EXPECT_EQ(gpu_cp_simulated(d, sel, P), plain)
            << "P=" << P << " Q=" << Q << " " << path_name(path);
      }
    }
  }
  DecodeData t = random_decode(6710, 2, 1, {3000 * kBS, 1000 * kBS}, 3000 * kBS, DType::kBF16,
                               Values::kTies, 1.0f);
  const Selection sel = sel_of(16, 1, 2);
  const std::vector<int32_t> want = cpu_decode(t, sel);
  for (Path path : kBothPaths) {
    UsePath use(path);
    EXPECT_EQ(gpu_decode(t, sel), want) << "ties must match exactly, " << path_name(path);
  }
}

// A Decoder planned for many more tokens than shared memory holds request offsets for at two
// CTAs per SM keeps every N-th request's offset (DecodePlan::offset_stride): steps of more than
// max_tokens / N requests sum the others again from the lengths (the sparse kernel), smaller
// ones keep them all on the same layout. Both: the reference's ids on both paths, and bit for
// bit those of a Decoder sized to the batch, plain and context-parallel (requests that own no
// page on a rank), with runs of padding requests across kept offsets; strides from 4 up. Steps
// of more than 1,023 requests also keep sparse offsets in the selection kernel; 12,000 requests
// on a Decoder planned for 65,536 tokens (once refused: the selection sized them by max_tokens).
TEST(GpuDecode, SparseRequestOffsetsForLargeMaxTokens) {
  SKIP_WITHOUT_GPU();
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(71);
  struct Case {
    int T, Q, reqs;
    int32_t max_len;
    int max_tokens;
    bool sparse;  // more requests than max_tokens / offset_stride
  };
  const Selection sel = sel_of(16);
  for (const Case c : {Case{1, 1, 4500, 600, 16384, true}, Case{4, 1, 2300, 1500, 16384, true},
                       Case{2, 2, 4200, 500, 16384, true}, Case{8, 8, 600, 800, 8192, true},
                       Case{1, 1, 12000, 128, 1 << 16, true},
                       Case{4, 1, 300, 6000, 16384, false}, Case{8, 8, 40, 5000, 8192, false}}) {
    const std::string what = "T=" + std::to_string(c.T) + " Q=" + std::to_string(c.Q) +
                             " reqs=" + std::to_string(c.reqs);
    SCOPED_TRACE(what);
    std::vector<int32_t> lens = lengths(rng, c.reqs, c.max_len, true);
    for (int r = 8; r < 21 && r < c.reqs; ++r) lens[r] = 0;  // padding across kept offsets
    // A page or two: requests that own no page on some ranks.
    for (int r = 30; r < c.reqs; r += 7) lens[r] = 1 + r % std::min<int32_t>(300, c.max_len);
    DecodeData d = random_decode(7100 + c.T * 10 + c.Q + c.reqs, c.T, c.Q, lens, c.max_len);
    const std::vector<int32_t> every_offset = gpu_decode(d, sel);
    UseMaxTokens large(c.max_tokens);
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
    const int stride = dec->plan().offset_stride;
    EXPECT_GT(stride, 1);
    EXPECT_EQ(c.reqs > c.max_tokens / stride, c.sparse) << "stride " << stride;
    EXPECT_EQ(dec->plan().grid, 2 * sms);
    expect_matches_reference(d, sel, what);
    EXPECT_EQ(gpu_decode(d, sel), every_offset);
    for (int world : {2, 4}) {
      EXPECT_EQ(gpu_cp_simulated(d, sel, world), every_offset) << "P=" << world;
    }
  }
}

// ---- CUDA graphs -----------------------------------------------------------------------------
TEST(GpuDecode, GraphReplayFollowsNewLengthsAndTables) {
  SKIP_WITHOUT_GPU();
  for (Path path : kBothPaths) {
    UsePath use(path);
    SCOPED_TRACE(path_name(path));
    graph_replay_follows_new_lengths_and_tables();
  }
}

// One graph of `dec`'s decode, captured once and replayed with each length vector of `steps`
// in turn (outputs poisoned first); every replay's ids against the CPU reference.
void expect_replays_follow_lengths(cpidx::Decoder& dec, DecodeData& d, DeviceBatch& b,
                                   const Selection& sel,
                                   std::initializer_list<std::vector<int32_t>> steps) {
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * d.rows() * sel.topk));
  const std::unique_ptr<CapturedGraph> graph = capture_decode(dec, b, ids, sel.topk);
  ASSERT_TRUE(graph->status().is_ok()) << graph->status().to_string();
  for (const std::vector<int32_t>& lens : steps) {
    d.seq_lens = lens;
    b.seq_lens.upload(d.seq_lens);
    ids.poison();
    CUDA_OK(graph->replay());
    const std::vector<int32_t> got = ids.download();
    const CompareResult r = compare_ids(d, sel, got, cpu_decode(d, sel));
    std::string which;
    for (int32_t len : lens) which += " " + std::to_string(len);
    EXPECT_EQ(r.bad_rows, 0) << "lengths" << which << ": " << r.first_bad;
  }
}

// Objects torn down while a capture is under way (a Python object collected inside
// torch.cuda.graph; another thread destroying one while this thread captures in the global mode,
// torch's default): the capture stays valid, its replay gives the reference ids, and the torn
// down objects' workspaces are freed.
TEST(GpuDecode, ObjectsDestroyedDuringACaptureLeaveItValid) {
  SKIP_WITHOUT_GPU();
  DecodeData d = random_decode(870, 4, 1, {9000, 300, 1, 0}, 1 << 14);
  const Selection sel = sel_of(16);
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  const std::vector<int32_t> cpu = cpu_decode(d, sel);
  const int64_t n = d.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * sel.topk));
  for (bool other_thread : {false, true}) {
    SCOPED_TRACE(other_thread ? "torn down by another thread"
                              : "torn down by the capturing thread");
    cpidx::DecodeConfig big = config_for(d, sel);
    big.max_tokens = 8192;
    big.max_seq_len = 1 << 20;
    std::unique_ptr<cpidx::Decoder> doomed;
    ASSERT_TRUE(cpidx::Decoder::create(big, 0, &doomed).is_ok());
    cpidx::PrefillConfig pc;
    pc.num_heads = 4;
    pc.max_tokens = 8192;
    pc.max_seq_len = 1 << 20;
    pc.sel = sel;
    std::unique_ptr<cpidx::Prefiller> doomed_prefill;
    ASSERT_TRUE(cpidx::Prefiller::create(pc, 0, &doomed_prefill).is_ok());
    const size_t bytes = doomed->plan().workspace_bytes + doomed_prefill->plan().workspace_bytes;
    ASSERT_GE(bytes, size_t{32} << 20) << "workspaces too small to see them freed";
    size_t free_before = 0, free_after = 0, total = 0;
    CUDA_OK(cudaMemGetInfo(&free_before, &total));
    auto teardown = [&] {
      doomed.reset();
      doomed_prefill.reset();
    };
    CapturedGraph graph([&](cudaStream_t stream) {
      const cpidx::Status st = dec->decode(
          b.all_heads(), cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk}, nullptr, stream);
      if (other_thread) {
        std::thread(teardown).join();
      } else {
        teardown();
      }
      return st;
    });
    ASSERT_TRUE(graph.status().is_ok()) << graph.status().to_string();
    ASSERT_EQ(doomed, nullptr);
    ids.poison();
    CUDA_OK(graph.replay());
    const CompareResult r = compare_ids(d, sel, ids.download(), cpu);
    EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
    CUDA_OK(cudaMemGetInfo(&free_after, &total));
    // Allowance for the graph's own memory and 2 MiB granules.
    EXPECT_GE(free_after + (size_t{8} << 20), free_before + bytes)
        << "free before " << free_before << ", after " << free_after << ", workspaces " << bytes;
  }
}

// A Decoder's launches captured into CUDA graphs are counted until the graphs go; one destroyed
// while a graph that captured its call lives keeps its workspace, so the graph still replays
// right, and memory allocated after the destruction (where a freed workspace would go) is never
// stored into.
TEST(GpuDecode, DestroyedUnderALiveGraphTheWorkspaceStays) {
  SKIP_WITHOUT_GPU();
  DecodeData d = random_decode(871, 4, 1, {9000, 300, 1, 0}, 1 << 14);
  const Selection sel = sel_of(16);
  DeviceBatch b(d);
  const std::vector<int32_t> cpu = cpu_decode(d, sel);
  const int64_t n = d.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * sel.topk));
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  ASSERT_TRUE(dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk},
                          nullptr, nullptr)
                  .is_ok());
  EXPECT_EQ(dec->launches_in_live_graphs(), 0) << "an eager call";
  {
    const std::unique_ptr<CapturedGraph> graph = capture_decode(*dec, b, ids, sel.topk);
    ASSERT_TRUE(graph->status().is_ok()) << graph->status().to_string();
    EXPECT_EQ(dec->launches_in_live_graphs(), 1);
  }
  EXPECT_EQ(dec->launches_in_live_graphs(5.0), 0) << "the graph is gone";

  const std::unique_ptr<CapturedGraph> graph = capture_decode(*dec, b, ids, sel.topk);
  ASSERT_TRUE(graph->status().is_ok()) << graph->status().to_string();
  const size_t workspace = dec->plan().workspace_bytes;
  dec.reset();  // a grace (GraphHolds::destroy_grace), then the workspace is left to the process
  // Of the workspace's size, where CUDA puts a freed block's successor (8 MiB blocks did not
  // land on a freed decode workspace: the test passed against destructors that free regardless).
  const LaterAllocations later(2, workspace);
  for (int replay = 0; replay < 3; ++replay) {
    ids.poison();
    CUDA_OK(graph->replay());
    const CompareResult r = compare_ids(d, sel, ids.download(), cpu);
    EXPECT_EQ(r.bad_rows, 0) << "replay " << replay << ": " << r.first_bad;
  }
  EXPECT_TRUE(later.untouched()) << "a replay stored into memory allocated after the Decoder went";
}

// Creating an object while a capture is under way fails with a message that says to create it
// before capturing, leaves no CUDA error behind for the caller's next check, and works again
// once the capture has ended.
TEST(GpuDecode, CreatingDuringACaptureFailsAndSaysWhy) {
  SKIP_WITHOUT_GPU();
  DecodeData d = random_decode(880, 4, 1, {300, 5}, 1024);
  const Selection sel = sel_of(16);
  cpidx::PrefillConfig pc;
  pc.num_heads = 4;
  pc.max_tokens = 64;
  pc.max_seq_len = 1024;
  pc.sel = sel;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (bool prefiller : {false, true}) {
    SCOPED_TRACE(prefiller ? "Prefiller" : "Decoder");
    std::unique_ptr<cpidx::Decoder> dec;
    std::unique_ptr<cpidx::Prefiller> pre;
    auto create = [&] {
      return prefiller ? cpidx::Prefiller::create(pc, 0, &pre)
                       : cpidx::Decoder::create(config_for(d, sel), 0, &dec);
    };
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const cpidx::Status st = create();
    const cudaError_t left = cudaPeekAtLastError();
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream, &graph);  // refused: the create's calls invalidated it
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
    EXPECT_EQ(st.code(), cpidx::StatusCode::kCudaError) << st.to_string();
    EXPECT_NE(st.message().find("create it before capturing"), std::string::npos)
        << st.to_string();
    EXPECT_EQ(left, cudaSuccess) << cudaGetErrorName(left);
    EXPECT_EQ(dec, nullptr);
    EXPECT_EQ(pre, nullptr);
    const cpidx::Status after = create();
    EXPECT_TRUE(after.is_ok()) << after.to_string();
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(GpuDecode, GraphReplayCrossesBetweenPaths) {
  SKIP_WITHOUT_GPU();
  // One captured graph; the step's page count moves across the split threshold (100 pages here)
  // and back between replays.
  const int32_t bound = 1 << 14;
  DecodeData d = random_decode(810, 4, 1, {bound, bound, 5, 0}, bound);
  const Selection sel = sel_of(16);
  DeviceBatch b(d);
  cpidx::DecodeConfig config = config_for(d, sel);
  config.split_max_pages = 100;
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config, 0, &dec).is_ok());
  ASSERT_EQ(dec->plan().split_max_pages, 100);
  // Pages: 257 (fused), 100 (split, at the threshold), 101 (fused), 2 (split), 155 (fused).
  expect_replays_follow_lengths(*dec, d, b, sel,
                                {{bound, bound, 5, 0}, {99 * 128, 128, 0, 0},
                                 {99 * 128, 129, 0, 0}, {7, 0, 0, 1}, {bound, 3000, 3, 0}});
}

// Host only (no GPU): the automatic split limits by cache dtype and column count, and the
// buffer they cost. fp8 splits up to 2^18 pages where the 16 MiB buffer holds them (<= 8
// columns; 2^17 at 16, 2^16 at 32), bf16 up to 2^16; a request of up to 32768 / 8192 pages
// keeps a large step split.
TEST(DecodeWorkspace, AutomaticSplitLimitsFollowTheCacheDtype) {
  using cpidx::DecodeConfig;
  using cpidx::DType;
  struct Case {
    DType dtype;
    int query_len;  // x 4 heads = the columns
    int64_t max_pages, longest;
  };
  for (const Case& c : {Case{DType::kBF16, 1, 65536, 8192}, Case{DType::kBF16, 4, 65536, 8192},
                        Case{DType::kBF16, 8, 65536, 8192}, Case{DType::kFP8E4M3, 1, 262144, 32768},
                        Case{DType::kFP8E4M3, 4, 131072, 32768},
                        Case{DType::kFP8E4M3, 8, 65536, 32768}}) {
    DecodeConfig config;
    config.total_heads = 4;
    config.max_tokens = 256;
    config.max_seq_len = 1 << 22;
    config.max_query_len = c.query_len;
    config.sel = Selection{16, 1, 1};
    config.cache_dtype = c.dtype;
    const cpidx::DecodeWorkspaceLayout w = cpidx::decode_workspace_layout(config, 264);
    const std::string what =
        std::string(cpidx::to_string(c.dtype)) + ", Q=" + std::to_string(c.query_len);
    EXPECT_EQ(w.split_any_pages, DecodeConfig::kDefaultSplitPages) << what;
    EXPECT_EQ(w.split_max_pages, c.max_pages) << what;
    EXPECT_EQ(w.split_longest_pages, c.longest) << what;
    const size_t columns = static_cast<size_t>(cpidx::cuda::padded_columns(4 * c.query_len));
    EXPECT_LE(static_cast<size_t>(w.split_max_pages) * columns * sizeof(cpidx::Key),
              DecodeConfig::kSplitBufferBytes)
        << what;
    config.split_max_pages = 0;
    EXPECT_EQ(cpidx::decode_workspace_layout(config, 264).split_max_pages, 0) << what;
  }
}

// Host only: the split limits stop at the pages a step can own, max_tokens requests of
// max_seq_len tokens, so a small Decoder reserves only the keys its steps can write; forced
// limits too. The path every reachable step takes is unchanged.
TEST(DecodeWorkspace, SplitLimitsStopAtTheReachablePages) {
  using cpidx::DecodeConfig;
  struct Case {
    int max_tokens;
    int32_t max_seq_len;
    int64_t forced;  // DecodeConfig::split_max_pages
    int64_t max_pages, any_pages;
  };
  for (const Case& c : {
           // 64 x 32 pages: both limits at 2048.
           Case{64, 4096, DecodeConfig::kAutoSplit, 2048, 2048},
           // 8 x 2049 pages (one past a page): above kDefaultSplitPages, under the buffer's.
           Case{8, 2048 * 128 + 1, DecodeConfig::kAutoSplit, 8 * 2049,
                DecodeConfig::kDefaultSplitPages},
           // Far past the buffer: the automatic limits as they were.
           Case{256, 1 << 22, DecodeConfig::kAutoSplit, 65536, DecodeConfig::kDefaultSplitPages},
           Case{4, 1000, 100, 32, 32},     // forced past the 4 x 8 pages
           Case{4, 1 << 20, 100, 100, 100},  // forced within them
       }) {
    DecodeConfig config;
    config.total_heads = 4;
    config.max_tokens = c.max_tokens;
    config.max_seq_len = c.max_seq_len;
    config.sel = Selection{16, 1, 1};
    config.split_max_pages = c.forced;
    const std::string what = std::to_string(c.max_tokens) + " x " +
                             std::to_string(c.max_seq_len) + ", forced " + std::to_string(c.forced);
    const cpidx::DecodeWorkspaceLayout w = cpidx::decode_workspace_layout(config, 264);
    EXPECT_EQ(w.split_max_pages, c.max_pages) << what;
    EXPECT_EQ(w.split_any_pages, c.any_pages) << what;
    if (c.forced > 0) EXPECT_EQ(w.split_longest_pages, c.max_pages) << what;  // all three alike
    // The key buffer holds the limit's pages (up to the next region's 256-byte alignment).
    const size_t keys = static_cast<size_t>(c.max_pages) *
                        cpidx::cuda::padded_columns(4 * cpidx::kMaxQueryLen) *
                        sizeof(cpidx::Key);
    EXPECT_GE(w.steal_words - w.split_keys, keys) << what;
    EXPECT_LT(w.steal_words - w.split_keys, keys + 256) << what;
  }
}

// Host only: cp_decode's four gather regions are in the workspace at P > 1 unless
// exchange_buffers is false, and never at P = 1; the rest of the layout is the same.
TEST(DecodeWorkspace, GatherBuffersOnlyWhereCpDecodeRuns) {
  cpidx::DecodeConfig c;
  c.total_heads = 8;
  c.world_size = 8;
  c.max_tokens = 8192;
  c.max_seq_len = 1 << 20;
  c.sel = Selection{64, 1, 1};
  const cpidx::DecodeWorkspaceLayout full = cpidx::decode_workspace_layout(c, 264);
  // (P + 1) x max_tokens x (L x 256 B of queries + T x K x 8 B of keys), L = 1 here.
  const size_t gathers = size_t{9} * 8192 * (256 + 8 * 64 * 8);
  EXPECT_GE(full.split_keys - full.q_send, gathers);
  EXPECT_LT(full.split_keys - full.q_send, gathers + 4 * 256);
  c.exchange_buffers = false;
  const cpidx::DecodeWorkspaceLayout lean = cpidx::decode_workspace_layout(c, 264);
  EXPECT_EQ(lean.q_send, lean.split_keys);  // all four empty
  EXPECT_EQ(full.total - lean.total, full.split_keys - full.q_send);
  EXPECT_EQ(full.steal_words - full.split_keys, lean.steal_words - lean.split_keys);
  c.world_size = 1;
  for (bool reserve : {true, false}) {
    c.exchange_buffers = reserve;
    const cpidx::DecodeWorkspaceLayout one = cpidx::decode_workspace_layout(c, 264);
    EXPECT_EQ(one.q_send, one.split_keys) << reserve;
    EXPECT_EQ(one.total, lean.total) << reserve;
  }
}

// The library's rule (DecodeConfig::kAutoSplit): above kDefaultSplitPages pages a step splits
// only while no request owns more than split_longest_pages(dtype) pages. Both kernels must reach
// the same verdict from the same lengths, inside one graph, whichever side a replay lands on.
// `heads` heads, Q = 1; the requests and their bound are the steps' (each step one length a
// request).
void graph_replay_crosses_the_automatic_rule(DType dtype, int heads,
                                             std::initializer_list<std::vector<int32_t>> steps) {
  using cpidx::DecodeConfig;
  const int64_t longest = DecodeConfig::split_longest_pages(dtype);
  const int reqs = static_cast<int>(steps.begin()->size());
  ASSERT_GT(reqs * longest, DecodeConfig::kDefaultSplitPages)
      << "the replays must reach past the size that always splits";
  int32_t bound = 0;
  for (const std::vector<int32_t>& lens : steps) {
    ASSERT_EQ(static_cast<int>(lens.size()), reqs) << "every step has the same requests";
    for (int32_t len : lens) bound = std::max(bound, len);
  }
  DecodeData d = random_decode(830, heads, 1, std::vector<int32_t>(reqs, bound), bound, dtype);
  const Selection sel = sel_of(16);
  DeviceBatch b(d);
  cpidx::DecodeConfig config = config_for(d, sel);
  config.split_max_pages = DecodeConfig::kAutoSplit;
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config, 0, &dec).is_ok());
  ASSERT_GE(dec->plan().split_max_pages, reqs * cpidx::cdiv(bound, 128));
  ASSERT_EQ(dec->plan().split_any_pages, DecodeConfig::kDefaultSplitPages);
  ASSERT_EQ(dec->plan().split_longest_pages, longest);
  expect_replays_follow_lengths(*dec, d, b, sel, steps);
}

// bf16: 8192 pages (1M tokens) a request. 24576 pages, longest 8192 (split); 24889 pages, one
// request of 8505 (fused); back to split; one request over the longest, 8505 pages in all
// (split: at most kDefaultSplitPages).
TEST(GpuDecode, GraphReplayCrossesTheAutomaticRule) {
  SKIP_WITHOUT_GPU();
  constexpr auto longest =
      static_cast<int32_t>(cpidx::DecodeConfig::split_longest_pages(DType::kBF16) * 128);
  constexpr int32_t over = longest + 40000;
  graph_replay_crosses_the_automatic_rule(
      DType::kBF16, 2,
      {std::vector<int32_t>(3, longest), {longest, over, longest},
       std::vector<int32_t>(3, longest - 1), {over, 0, 0}});
}

// fp8: 32768 pages (4M tokens) a request, one head (8 padded columns: the Decoder splits up to
// 2^18 pages). One request, so the CPU reference stays at ~4M tokens a replay: 32768 pages
// (past kDefaultSplitPages, at the longest: split); 33081 (fused); 32768 again (split).
TEST(GpuDecode, GraphReplayCrossesTheAutomaticRuleFp8) {
  SKIP_WITHOUT_GPU();
  constexpr auto longest =
      static_cast<int32_t>(cpidx::DecodeConfig::split_longest_pages(DType::kFP8E4M3) * 128);
  constexpr int32_t over = longest + 40000;
  graph_replay_crosses_the_automatic_rule(DType::kFP8E4M3, 1, {{longest}, {over}, {longest - 1}});
}

void graph_replay_follows_new_lengths_and_tables() {
  const int reqs = 8, Q = 2;
  const int32_t bound = 1 << 17;
  std::mt19937 rng(23);
  DecodeData d = random_decode(800, 4, Q, lengths(rng, reqs, bound, false), bound);
  const Selection sel = sel_of(16);
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  DeviceVec<int32_t> ids(static_cast<size_t>(4 * d.rows() * sel.topk));
  const std::unique_ptr<CapturedGraph> graph = capture_decode(*dec, b, ids, sel.topk);
  ASSERT_TRUE(graph->status().is_ok()) << graph->status().to_string();
  for (int step = 0; step < 6; ++step) {
    // New lengths (some padding requests: a smaller real batch) and a reshuffled table.
    DecodeData& h = d;
    h.seq_lens = lengths(rng, reqs, step % 2 ? 3000 : bound, true);
    if (step == 3) h.seq_lens.assign(reqs, 0);
    std::shuffle(h.block_table.begin(), h.block_table.end(), rng);
    for (auto& e : h.block_table) e = static_cast<int32_t>(std::abs(e) % h.num_pages);
    b.seq_lens.upload(h.seq_lens);
    b.block_table.upload(h.block_table);
    ids.poison();
    CUDA_OK(graph->replay());
    const std::vector<int32_t> got = ids.download();
    const CompareResult r = compare_ids(h, sel, got, cpu_decode(h, sel));
    EXPECT_EQ(r.bad_rows, 0) << "step " << step << ": " << r.first_bad;
    EXPECT_EQ(got, gpu_decode(h, sel)) << "graph replay != eager at step " << step;
  }
}

// The same on a Decoder planned for 16K tokens: 8 requests keep every offset on the sparse
// layout; 4,500 take the sparse kernel (one head, Q = 1: every 4th offset kept).
TEST(GpuDecode, GraphReplayFollowsNewLengthsWithSparseRequestOffsets) {
  SKIP_WITHOUT_GPU();
  UseMaxTokens large(1 << 14);
  for (Path path : kBothPaths) {
    UsePath use(path);
    SCOPED_TRACE(path_name(path));
    graph_replay_follows_new_lengths_and_tables();
    std::mt19937 rng(73);
    const int reqs = 4500;
    DecodeData d = random_decode(840, 1, 1, lengths(rng, reqs, 700, true), 700);
    const Selection sel = sel_of(16);
    DeviceBatch b(d);
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
    ASSERT_LT((1 << 14) / dec->plan().offset_stride, reqs);
    std::vector<int32_t> shorter = lengths(rng, reqs, 300, true), zeros(reqs, 0);
    for (int r = 0; r < reqs; r += 3) zeros[r] = 1 + r % 700;  // two of three requests empty
    expect_replays_follow_lengths(*dec, d, b, sel, {d.seq_lens, shorter, zeros, d.seq_lens});
  }
}

// ---- Bad device values -------------------------------------------------------------------------
TEST(GpuDecode, BadDeviceValuesAreClampedAndFlagged) {
  SKIP_WITHOUT_GPU();
  for (Path path : kBothPaths) {
    UsePath use(path);
    SCOPED_TRACE(path_name(path));
    bad_device_values_are_clamped_and_flagged();
  }
  UseMaxTokens large(1 << 14);  // every 8th request offset kept: lengths read again, clamped alike
  bad_device_values_are_clamped_and_flagged();
}

void bad_device_values_are_clamped_and_flagged() {
  DecodeData d = random_decode(900, 4, 1, {5000, 700, 3000}, 4096);
  d.seq_lens = {5000, -7, 3000};  // above the bound, negative
  d.block_table[1] = 1 << 30;     // request 0, block 1: outside the cache
  d.block_table[2] = -5;
  const Selection sel = sel_of(16);
  int32_t flag = 0;
  const std::vector<int32_t> gpu = gpu_decode(d, sel, &flag);
  EXPECT_EQ(flag, cpidx::kErrSeqLenOutOfRange | cpidx::kErrPageOutOfRange);
  int32_t cpu_err = 0;
  cpidx_test::IdsBuffer ids(4, d.rows(), sel.topk);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, &cpu_err).is_ok());
  EXPECT_EQ(cpu_err, flag);
  const CompareResult r = compare_ids(d, sel, gpu, ids.ids);
  EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
}

// A step whose inputs name a flag of their own ORs its bits there (eager, replayed, a CP rank's
// shard scoring), never into the Decoder's; a misaligned one is refused before any kernel.
TEST(GpuDecode, PerCallErrorFlagTakesTheStepsBits) {
  SKIP_WITHOUT_GPU();
  DecodeData d = random_decode(902, 4, 1, {5000, 700, 3000}, 4096);
  d.seq_lens = {5000, -7, 3000};
  d.block_table[1] = 1 << 30;
  const Selection sel = sel_of(16);
  const int32_t bits = cpidx::kErrSeqLenOutOfRange | cpidx::kErrPageOutOfRange;
  constexpr int32_t kOther = 1 << 20;  // a bit of the caller's, kept (OR, not a store)
  const int64_t n = d.rows(), K = sel.topk;
  DeviceBatch b(d);
  for (Path path : kBothPaths) {
    UsePath use(path);
    SCOPED_TRACE(path_name(path));
    std::unique_ptr<cpidx::Decoder> dec;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
    ASSERT_TRUE(dec->clear_error_flag(nullptr).is_ok());
    DeviceVec<int32_t> flag(std::vector<int32_t>{kOther});
    DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * K));
    ids.poison();
    cpidx::DecodeInputs in = b.all_heads();
    in.error_flag = flag.ptr;
    ASSERT_TRUE(dec->decode(in, cpidx::TopkOutput{ids.ptr, n * K, K}, nullptr, nullptr).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(read_device_int(flag.ptr), kOther | bits);
    EXPECT_EQ(read_device_int(dec->error_flag()), 0);
    EXPECT_EQ(ids.download(), gpu_decode(d, sel)) << "the flag changed the ids";

    flag.upload({0});  // captured with the pointer: a replay ORs into the same flag
    CapturedGraph graph([&](cudaStream_t stream) {
      return dec->decode(in, cpidx::TopkOutput{ids.ptr, n * K, K}, nullptr, stream);
    });
    ASSERT_TRUE(graph.status().is_ok()) << graph.status().to_string();
    ASSERT_EQ(graph.replay(), cudaSuccess);
    EXPECT_EQ(read_device_int(flag.ptr), bits);
    EXPECT_EQ(read_device_int(dec->error_flag()), 0);
  }
  {  // a context-parallel rank's scoring
    std::unique_ptr<cpidx::Decoder> rank1;
    ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel, 2, 1), 0, &rank1).is_ok());
    ASSERT_TRUE(rank1->clear_error_flag(nullptr).is_ok());
    DeviceVec<int32_t> flag(std::vector<int32_t>{0});
    DeviceVec<cpidx::Key> keys(static_cast<size_t>(d.total_heads * n * K));
    cpidx::DecodeInputs in = b.all_heads();
    in.error_flag = flag.ptr;
    ASSERT_TRUE(rank1->shard_keys(in, keys.ptr, nullptr).is_ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(read_device_int(flag.ptr), bits);
    EXPECT_EQ(read_device_int(rank1->error_flag()), 0);
  }
  std::unique_ptr<cpidx::Decoder> dec;
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel), 0, &dec).is_ok());
  DeviceVec<int32_t> flag(std::vector<int32_t>{0, 0});
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * K));
  ids.poison();
  cpidx::DecodeInputs in = b.all_heads();
  in.error_flag = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(flag.ptr) + 2);
  const cpidx::Status st = dec->decode(in, cpidx::TopkOutput{ids.ptr, n * K, K}, nullptr, nullptr);
  EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("error_flag"), std::string::npos) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flag.download(), (std::vector<int32_t>{0, 0}));
  for (int32_t v : ids.download()) ASSERT_EQ(v, cpidx_test::kPoison) << "a kernel ran";
}

TEST(GpuDecode, HostErrorsBeforeAnyKernel) {
  SKIP_WITHOUT_GPU();
  DecodeData d = random_decode(901, 4, 1, {300, 400}, 4096);
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  cpidx::DecodeConfig bad = config_for(d, sel_of(16));
  bad.world_size = 3;
  cpidx::Status st = cpidx::Decoder::create(bad, 0, &dec);
  EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("world_size (3)"), std::string::npos) << st.message();
  EXPECT_EQ(dec, nullptr);
  // A Decoder of max_tokens 1 given 2 rows: refused, nothing written, the flag left as it was.
  ASSERT_TRUE(cpidx::Decoder::create(config_for(d, sel_of(16), 1, 0, 1), 0, &dec).is_ok());
  DeviceVec<int32_t> ids(4 * 2 * 16);
  ids.poison();
  CUDA_OK(cudaMemset(dec->error_flag(), 0, sizeof(int32_t)));
  st = dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, 32, 16}, nullptr, nullptr);
  EXPECT_EQ(st.code(), cpidx::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_tokens"), std::string::npos) << st.message();
  CUDA_OK(cudaDeviceSynchronize());
  for (int32_t v : ids.download()) ASSERT_EQ(v, cpidx_test::kPoison) << "an id was written";
  int32_t flag = -1;
  CUDA_OK(cudaMemcpy(&flag, dec->error_flag(), sizeof(flag), cudaMemcpyDeviceToHost));
  EXPECT_EQ(flag, 0);
}

}  // namespace
