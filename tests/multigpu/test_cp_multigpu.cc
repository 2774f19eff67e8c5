// The context-parallel decode on real GPUs through NCCL, one process, one host thread per GPU
// (communicators from make_nccl_communicators_single_process): each rank's cp_decode equals the
// plain decode of all heads on GPU 0 bitwise for its owned heads (random batches, 1 token to 1M,
// replicated heads, golden cases), inside CUDA graphs replayed 1000 times with changing inputs,
// disagreeing batch sizes fail before any collective, and one workspace serves 60 layers; the
// gathers held by live CUDA graphs are counted. Every test skips cleanly without its GPUs.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "cpidx/comm_nccl.h"
#include "json_lite.h"
#include "multigpu_util.h"

namespace {

using namespace cpidx_multigpu_test;
using cpidx::StatusCode;
using cpidx_test::random_decode;

constexpr int kWorld = 2;  // ranks = GPUs 0 and 1

class MultiGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (device_count() < kWorld) return;
    std::vector<int> devices;
    for (int r = 0; r < kWorld; ++r) devices.push_back(r);
    comms_ = cpidx::make_nccl_communicators_single_process(devices, &init_status_);
  }
  static void TearDownTestSuite() { comms_.clear(); }

  void SetUp() override {
    if (device_count() < kWorld) {
      GTEST_SKIP() << "needs " << kWorld << " GPUs, found " << device_count();
    }
    ASSERT_TRUE(init_status_.is_ok()) << init_status_.to_string();
    ASSERT_EQ(comms_.size(), static_cast<size_t>(kWorld));
  }

  // fn(rank, comm) on one thread per rank, with the rank's GPU current; returns when all end.
  static void on_ranks(const std::function<void(int, Communicator&)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&fn, r] {
        cudaSetDevice(r);
        fn(r, *comms_[static_cast<size_t>(r)]);
      });
    }
    for (auto& t : threads) t.join();
  }

  // Every rank's cp_decode against the plain decode on GPU 0; returns the rank results.
  static std::vector<Communicator*> comm_ptrs() {
    std::vector<Communicator*> v;
    for (auto& c : comms_) v.push_back(c.get());
    return v;
  }
  static std::vector<RankResult> expect_cp_equals_plain(const DecodeData& d, const Selection& sel,
                                                        const std::string& what) {
    return expect_threads_cp_equals_plain(comm_ptrs(), d, sel, what);
  }

  static std::vector<std::unique_ptr<Communicator>> comms_;
  static Status init_status_;
};

std::vector<std::unique_ptr<Communicator>> MultiGpu::comms_;
Status MultiGpu::init_status_;

TEST_F(MultiGpu, CommunicatorBasics) {
  EXPECT_EQ(cpidx::nccl_version_text().rfind("NCCL ", 0), 0u) << cpidx::nccl_version_text();
  const size_t bytes = 1001;  // not a multiple of any word size
  std::vector<std::vector<uint8_t>> got(kWorld), got_in_place(kWorld);
  std::vector<Status> agree(kWorld), disagree(kWorld), gather(kWorld), barrier(kWorld);
  on_ranks([&](int r, Communicator& comm) {
    EXPECT_EQ(comm.rank(), r);
    EXPECT_EQ(comm.world_size(), kWorld);
    EXPECT_EQ(comm.memory_space(), cpidx::MemorySpace::kDevice);
    std::vector<uint8_t> mine(bytes);
    for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<uint8_t>(r * 101 + i * 7);
    DeviceVec<uint8_t> send(mine), recv(bytes * kWorld), in_place(bytes * kWorld);
    cudaMemset(recv.ptr, 0xEE, recv.count);
    cudaMemset(in_place.ptr, 0xEE, in_place.count);
    cudaMemcpy(in_place.ptr + bytes * r, mine.data(), bytes, cudaMemcpyHostToDevice);
    cudaStream_t stream = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    gather[r] = comm.all_gather(send.ptr, recv.ptr, bytes, stream);
    if (gather[r].is_ok()) {
      gather[r] = comm.all_gather(in_place.ptr + bytes * r, in_place.ptr, bytes, stream);
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
    got[r] = recv.download();
    got_in_place[r] = in_place.download();
    agree[r] = comm.check_agree(42, "the answer");
    disagree[r] = comm.check_agree(r, "the rank");
    barrier[r] = comm.barrier();
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(gather[r].is_ok()) << gather[r].to_string();
    for (int src = 0; src < kWorld; ++src) {
      for (size_t i = 0; i < bytes; ++i) {
        const auto want = static_cast<uint8_t>(src * 101 + i * 7);
        ASSERT_EQ(got[r][src * bytes + i], want) << "rank " << r << " from " << src << " at " << i;
        ASSERT_EQ(got_in_place[r][src * bytes + i], want) << "in place, rank " << r;
      }
    }
    EXPECT_TRUE(agree[r].is_ok()) << agree[r].to_string();
    EXPECT_EQ(disagree[r].code(), StatusCode::kCommError);
    EXPECT_NE(disagree[r].message().find("the rank"), std::string::npos) << disagree[r].message();
    EXPECT_TRUE(barrier[r].is_ok()) << barrier[r].to_string();
  }
}

TEST_F(MultiGpu, RandomBatchesEqualPlainBitwise) {
  std::mt19937 rng(31);
  int seed = 1000;
  // T=4: two owned heads per rank; T=2: one; T=1: replicated on both ranks. A rank's query is a
  // slice of one [n, T, D] tensor: strided for T=4 and T=2 (cp_decode packs it before the
  // gather), contiguous for T=1 (gathered in place).
  for (int T : {4, 2, 1}) {
    for (int Q : {1, 4}) {
      // Short requests where one rank owns no block, a padding request, long ones.
      std::vector<int32_t> s = lengths(rng, 6, 50000, true);
      s[0] = 100;
      s[2] = 129;
      DecodeData d = random_decode(seed++, T, Q, s, 50000);
      const std::string what = "T=" + std::to_string(T) + " Q=" + std::to_string(Q);
      std::vector<RankResult> res = expect_cp_equals_plain(d, sel_of(16), what);
      if (T == 1) {
        EXPECT_EQ(res[0].ids, res[1].ids) << what << ": replicas differ";
      }
    }
  }
  // Other K and forced blocks, and an fp8 cache.
  DecodeData d = random_decode(seed++, 4, 2, lengths(rng, 5, 20000, true), 20000);
  expect_cp_equals_plain(d, sel_of(33, 1, 2), "K=33 init=1 local=2");
  DecodeData f = random_decode(seed++, 4, 4, lengths(rng, 5, 30000, true), 30000,
                               cpidx::DType::kFP8E4M3);
  expect_cp_equals_plain(f, sel_of(16), "fp8");
}

TEST_F(MultiGpu, ContextsFromOneTokenTo1M) {
  const int32_t bound = 1 << 20;
  DecodeData d = random_decode(1100, 4, 1, {1, 127, 128, 129, 0, 70001, bound}, bound);
  expect_cp_equals_plain(d, sel_of(16), "1..1M Q=1");
  // The same cache with Q=4 (new queries).
  std::mt19937_64 rng(1101);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  d.query_len = 4;
  d.query.resize(static_cast<size_t>(d.rows()) * d.total_heads * cpidx::kHeadDim);
  for (auto& q : d.query) q = cpidx_test::bf16_of(normal(rng));
  expect_cp_equals_plain(d, sel_of(16), "1..1M Q=4");
}

TEST_F(MultiGpu, GoldenCases) {
  const json_lite::Value cases =
      json_lite::parse_file(std::string(CPIDX_TEST_DATA_DIR) + "/golden_cases.json")["cases"];
  int checked = 0;
  for (const auto& c : cases.array) {
    if (c["kind"].string != "decode") continue;
    const DecodeData d = cpidx_test::golden_decode(
        static_cast<uint64_t>(c["seed"].number), c["T"].as_int(), c["Q"].as_int(),
        c["seq_lens"].ints(), static_cast<float>(c["scale"].number));
    const std::vector<int> worlds = cpidx_test::valid_worlds(d.total_heads);
    if (std::find(worlds.begin(), worlds.end(), kWorld) == worlds.end()) continue;
    const Selection sel = sel_of(c["K"].as_int(), c["init"].as_int(), c["local"].as_int());
    std::vector<int32_t> want;
    for (const auto& head : c["ids"].array)
      for (const auto& row : head.array)
        for (int32_t v : row.ints()) want.push_back(v);
    const std::string what = "golden seed " + std::to_string(c["seed"].as_int());
    EXPECT_EQ(plain_decode_on(0, d, sel), want) << what << " plain";
    std::vector<RankResult> results(kWorld);
    on_ranks([&](int r, Communicator& comm) { results[r] = cp_rank(comm, r, d, sel); });
    for (const RankResult& res : results) expect_rank_matches(res, want, d.rows(), sel.topk, what);
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

TEST_F(MultiGpu, GraphReplay1000WithChangingInputs) {
  const int reqs = 8, replays = 1000, check_every = 100;
  const int32_t bound = 1 << 16;
  for (int Q : {1, 4}) {
    std::mt19937 rng(41 + Q);
    DecodeData d = random_decode(1200 + Q, 4, Q, lengths(rng, reqs, bound, false), bound);
    const int checks = replay_threads_cp_graphs(comm_ptrs(), d, sel_of(16), rng, bound, replays,
                                                check_every, "Q=" + std::to_string(Q));
    EXPECT_EQ(checks, replays / check_every + 1) << "Q=" << Q;
  }
}

TEST_F(MultiGpu, DisagreeingBatchSizeFailsBeforeAnyCollective) {
  DecodeData d = random_decode(1300, 4, 2, {3000, 500, 7000, 100}, 8192);
  const Selection sel = sel_of(16);
  // Rank 1 claims 3 requests, rank 0 all 4: both fail in the agreement, no NCCL call is made
  // and no id is written.
  std::vector<RankResult> res(kWorld);
  std::vector<int> gathers(kWorld, -1);
  on_ranks([&](int r, Communicator& comm) {
    cpidx_test::RecordingComm recording(comm);
    res[r] = cp_rank(recording, r, d, sel, r == 1 ? 3 : -1);
    gathers[r] = static_cast<int>(recording.sizes.size());
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(res[r].status.code(), StatusCode::kCommError) << res[r].status.to_string();
    EXPECT_NE(res[r].status.message().find("decode rows"), std::string::npos)
        << res[r].status.message();
    EXPECT_EQ(gathers[r], 0) << "rank " << r;
    ASSERT_FALSE(res[r].ids.empty());
    for (int32_t x : res[r].ids) ASSERT_EQ(x, cpidx_test::kPoison) << "rank " << r;
  }
  // The communicators are still in step: a correct batch goes through.
  expect_cp_equals_plain(d, sel, "after the refused steps");
}

TEST_F(MultiGpu, RefusedInputsOnOneRankFailEveryRank) {
  DecodeData d = random_decode(1350, 4, 1, {3000, 500}, 4096);
  const Selection sel = sel_of(16);
  std::vector<Status> st(kWorld);
  on_ranks([&](int r, Communicator& comm) {
    DeviceBatch b(d);
    std::unique_ptr<cpidx::Decoder> dec;
    Status created = cpidx::Decoder::create(config_for(d, sel, kWorld, r), r, &dec);
    if (!created.is_ok()) {
      comm.check_agree(-1, cpidx::kCpRowsAgreement);
      st[r] = created;
      return;
    }
    const cpidx::Geometry& geo = dec->geometry();
    cpidx::DecodeInputs in = b.inputs(geo.head_offset, geo.local_heads);
    if (r == 1) in.scale = -1.0f;  // refused by validation on rank 1 only
    DeviceVec<int32_t> ids(static_cast<size_t>(geo.local_heads * d.rows() * sel.topk));
    ids.poison();
    st[r] = dec->cp_decode(comm, in, cpidx::TopkOutput{ids.ptr, d.rows() * sel.topk, sel.topk},
                           nullptr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int32_t x : ids.download()) {
      ASSERT_EQ(x, cpidx_test::kPoison) << "rank " << r << ": a refused step wrote ids";
    }
  });
  EXPECT_EQ(st[0].code(), StatusCode::kCommError) << st[0].to_string();
  EXPECT_EQ(st[1].code(), StatusCode::kInvalidArgument) << st[1].to_string();
  expect_cp_equals_plain(d, sel, "after the refused step");
}

TEST_F(MultiGpu, OneWorkspaceServesSixtyLayers) {
  const int layers = 60;
  DecodeData d = random_decode(1400, 4, 2, {3000, 0, 4096, 1000}, 4096);
  const Selection sel = sel_of(16);
  const int64_t n = d.rows();
  const size_t q_elems = d.query.size();
  std::vector<std::vector<uint16_t>> layer_q(layers);
  std::mt19937_64 rng(1401);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& q : layer_q) {
    q.resize(q_elems);
    for (auto& v : q) v = cpidx_test::bf16_of(normal(rng));
  }
  std::vector<std::vector<int32_t>> shared_ids(kWorld), fresh_ids(kWorld);
  std::vector<cpidx::Geometry> geos(kWorld);
  std::vector<size_t> free_before(kWorld, 0), free_after(kWorld, 1);
  std::vector<Status> st(kWorld);
  on_ranks([&](int r, Communicator& comm) {
    DeviceBatch b(d);
    std::vector<std::unique_ptr<DeviceVec<uint16_t>>> q;
    for (const auto& lq : layer_q) q.push_back(std::make_unique<DeviceVec<uint16_t>>(lq));
    std::unique_ptr<cpidx::Decoder> dec;
    st[r] = cpidx::Decoder::create(config_for(d, sel, kWorld, r), r, &dec);
    if (!st[r].is_ok()) {
      for (int l = 0; l < 2 * layers + 1; ++l) comm.check_agree(-1, cpidx::kCpRowsAgreement);
      return;
    }
    const cpidx::Geometry geo = dec->geometry();
    geos[r] = geo;
    const size_t per_layer = static_cast<size_t>(geo.local_heads * n * sel.topk);
    DeviceVec<int32_t> ids(per_layer * layers), fresh(per_layer * layers);
    ids.poison();
    fresh.poison();
    cudaStream_t stream = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    auto layer_in = [&](int l) {
      cpidx::DecodeInputs in = b.inputs(geo.head_offset, geo.local_heads);
      in.query = q[static_cast<size_t>(l)]->ptr + geo.head_offset * cpidx::kHeadDim;
      return in;
    };
    auto out = [&](DeviceVec<int32_t>& v, int l) {
      return cpidx::TopkOutput{v.ptr + per_layer * l, n * sel.topk, sel.topk};
    };
    // Warm-up (NCCL connects on first use), then 60 layers back to back on one stream.
    Status s = dec->cp_decode(comm, layer_in(0), out(ids, 0), nullptr, stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ids.poison();  // layer 0's slot too: only the loop below may write it
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    size_t total = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_before[r], &total), cudaSuccess);
    for (int l = 0; l < layers; ++l) {
      Status sl = dec->cp_decode(comm, layer_in(l), out(ids, l), nullptr, stream);
      if (s.is_ok()) s = sl;
    }
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaMemGetInfo(&free_after[r], &total), cudaSuccess);
    // The same layers through 60 separate decoders.
    for (int l = 0; l < layers; ++l) {
      std::unique_ptr<cpidx::Decoder> own;
      Status so = cpidx::Decoder::create(config_for(d, sel, kWorld, r), r, &own);
      Status sl = so;
      if (so.is_ok()) {
        sl = own->cp_decode(comm, layer_in(l), out(fresh, l), nullptr, stream);
      } else {
        comm.check_agree(-1, cpidx::kCpRowsAgreement);  // the peer's cp_decode waits for this
      }
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      if (s.is_ok()) s = sl;
    }
    st[r] = s;
    shared_ids[r] = ids.download();
    fresh_ids[r] = fresh.download();
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
    EXPECT_EQ(free_before[r], free_after[r]) << "rank " << r << ": device memory changed by "
                                             << static_cast<long long>(free_before[r]) -
                                                    static_cast<long long>(free_after[r])
                                             << " bytes over " << layers << " layers";
    EXPECT_EQ(shared_ids[r], fresh_ids[r]) << "rank " << r << ": one decoder != 60 decoders";
  }
  // And every layer equals the plain decode on GPU 0.
  const size_t per_head_layer = static_cast<size_t>(n * sel.topk);
  for (int l = 0; l < layers; ++l) {
    d.query = layer_q[static_cast<size_t>(l)];
    const std::vector<int32_t> plain = plain_decode_on(0, d, sel);
    for (int r = 0; r < kWorld; ++r) {
      const size_t per_layer = per_head_layer * geos[r].local_heads;
      const std::vector<int32_t> ids(shared_ids[r].begin() + per_layer * l,
                                     shared_ids[r].begin() + per_layer * (l + 1));
      expect_owned_heads_equal(geos[r], ids, plain, n, sel.topk, "layer " + std::to_string(l));
    }
    if (HasFailure()) break;
  }
}

// No GPU needed: a rank whose device is refused (one past the last) makes every rank of the
// host-bootstrapped factory fail, naming the reason, instead of leaving them in ncclCommInitRank.
TEST(NcclOverHost, RanksFailTogetherWhenOneRefusesItsDevice) {
  std::vector<std::unique_ptr<Communicator>> hosts = cpidx::make_thread_communicators(kWorld);
  const int bad = device_count();  // one past the last device (0 without a GPU)
  std::vector<Status> st(kWorld);
  std::vector<std::unique_ptr<Communicator>> made(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      const int device = r == kWorld - 1 || bad == 0 ? bad : 0;
      const auto i = static_cast<size_t>(r);
      made[i] = cpidx::make_nccl_communicator(*hosts[i], device, &st[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_EQ(made[i], nullptr) << "rank " << r;
    EXPECT_FALSE(st[i].is_ok()) << "rank " << r;
    EXPECT_FALSE(st[i].message().empty()) << "rank " << r;
  }
  // With a GPU, rank 0's device is fine: it fails through the agreement, and the refusing rank
  // names its device. (Without one, every rank's device query fails on its own.)
  if (bad > 0) {
    EXPECT_NE(st[kWorld - 1].message().find("device must be in"), std::string::npos)
        << st[kWorld - 1].message();
    EXPECT_NE(st[0].message().find("NCCL communicator world size"), std::string::npos)
        << st[0].message();
  }
}

// One GPU: the gathers captured into CUDA graphs are counted while a graph or an instantiation of
// it lives (NCCL's destroy would wait for them), and leave the count when both are gone.
TEST(NcclOverHost, GathersInLiveGraphsAreCounted) {
  if (device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Status st;
  std::vector<std::unique_ptr<Communicator>> comms =
      cpidx::make_nccl_communicators_single_process({0}, &st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  Communicator& comm = *comms[0];
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(*cpidx::make_thread_communicators(1)[0]), -1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 512), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  char* send = static_cast<char*>(buf);
  ASSERT_TRUE(comm.all_gather(send, send + 256, 256, stream).is_ok());  // eager: not counted
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(comm), 0);

  auto capture_two = [&]() {
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_TRUE(comm.all_gather(send, send + 256, 256, stream).is_ok());
    EXPECT_TRUE(comm.all_gather(send + 256, send, 256, stream).is_ok());
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    return graph;
  };
  // A graph and its instantiation: counted until both are gone.
  cudaGraph_t graph = capture_two();
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(comm), 2);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(comm, 0.2), 2) << "the instantiation holds them";
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(comm, 5.0), 0);
  // A captured graph never instantiated.
  graph = capture_two();
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(comm), 2);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(comm, 5.0), 0);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  ASSERT_EQ(cudaFree(buf), cudaSuccess);
  comms.clear();  // returns: no graph holds a gather
}

// One GPU: a communicator destroyed while an instantiated graph still holds its gather returns
// (its ncclComm_t is left to the process; NCCL's destroy would wait for the graph forever), and
// the graph still replays.
TEST(NcclOverHost, DestroyedUnderALiveGraphReturnsAndTheGraphStillRuns) {
  if (device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Status st;
  std::vector<std::unique_ptr<Communicator>> comms =
      cpidx::make_nccl_communicators_single_process({0}, &st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  char* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 512), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(comms[0]->all_gather(buf, buf + 256, 256, stream).is_ok());  // connects eagerly
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_TRUE(comms[0]->all_gather(buf, buf + 256, 256, stream).is_ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(*comms[0]), 1);
  comms.clear();  // must return
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFree(buf), cudaSuccess);
}

// No GPU needed: init_timeout_seconds must be > 0 (NaN refused too), checked before any device
// or NCCL call, and named; through the host-bootstrapped factory every rank fails with it.
TEST(NcclOverHost, RefusesAnInitTimeoutThatIsNotPositive) {
  for (double bad : {0.0, -1.0, std::nan("")}) {
    Status st;
    EXPECT_EQ(cpidx::make_nccl_communicator(cpidx::NcclUniqueId{}, 1, 0, 0, &st, nullptr, bad),
              nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad << ": " << st.to_string();
    EXPECT_NE(st.message().find("init_timeout_seconds must be > 0"), std::string::npos)
        << st.message();
  }
  std::vector<std::unique_ptr<Communicator>> hosts = cpidx::make_thread_communicators(kWorld);
  std::vector<Status> st(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<size_t>(r);
      EXPECT_EQ(cpidx::make_nccl_communicator(*hosts[i], 0, &st[i], r == 0 ? -2.0 : 5.0),
                nullptr);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_FALSE(st[static_cast<size_t>(r)].is_ok()) << "rank " << r;
  }
  // Rank 0 refuses its timeout before any device query or id; rank 1 then fails in the
  // agreement before the init (without a GPU, on its own device query first).
  EXPECT_NE(st[0].message().find("init_timeout_seconds must be > 0"), std::string::npos)
      << st[0].message();
  if (device_count() > 0) {
    EXPECT_NE(st[1].message().find("NCCL communicator world size"), std::string::npos)
        << st[1].message();
  }
}

// One GPU: rank 0 of a world of 2 whose rank 1 never calls the init (a rank that failed before
// it with no host channel to tell, or whose process is gone) gets kCommError naming the deadline
// once init_timeout_seconds pass, instead of waiting in the init forever. The init left waiting
// on its thread does not stand in the way of the next: a world of one made the same way (its
// init on a thread too) gathers, eagerly and in a replayed CUDA graph, and barriers.
TEST(NcclOverHost, ARankThatNeverJoinsCostsItsPeersTheInitTimeout) {
  if (device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Status st;
  const cpidx::NcclUniqueId id = cpidx::nccl_unique_id(&st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(cpidx::make_nccl_communicator(id, 2, 0, 0, &st, nullptr, 1.0), nullptr);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(st.code(), StatusCode::kCommError) << st.to_string();
  EXPECT_NE(st.message().find("did not complete within init_timeout_seconds = 1"),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("a rank never joined"), std::string::npos) << st.message();
  EXPECT_GE(waited, 1.0);  // not a timing check: the deadline, not an early failure, ended it
  std::printf("[ info ] the init of a world of 2 with one rank returned after %.2f s\n", waited);

  const cpidx::NcclUniqueId one = cpidx::nccl_unique_id(&st);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  std::unique_ptr<Communicator> comm = cpidx::make_nccl_communicator(one, 1, 0, 0, &st);
  ASSERT_NE(comm, nullptr) << st.to_string();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  constexpr int kBytes = 4096;
  std::vector<unsigned char> host(2 * kBytes);
  std::mt19937 rng(7);
  for (auto& b : host) b = static_cast<unsigned char>(rng());
  unsigned char* buf = nullptr;
  ASSERT_EQ(cudaMalloc(&buf, 2 * kBytes), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto gathered_equals_sent = [&](const char* what) {
    std::vector<unsigned char> back(2 * kBytes);
    ASSERT_EQ(cudaMemcpy(back.data(), buf, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(std::equal(back.begin(), back.begin() + kBytes, back.begin() + kBytes)) << what;
    EXPECT_TRUE(std::equal(back.begin(), back.begin() + kBytes, host.begin())) << what;
  };
  ASSERT_EQ(cudaMemcpy(buf, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(comm->all_gather(buf, buf + kBytes, kBytes, stream).is_ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  gathered_equals_sent("eager");

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_TRUE(comm->all_gather(buf, buf + kBytes, kBytes, stream).is_ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (auto& b : host) b = static_cast<unsigned char>(rng());  // new bytes for the replay
  ASSERT_EQ(cudaMemcpy(buf, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  gathered_equals_sent("replayed");
  EXPECT_TRUE(comm->barrier().is_ok());
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cpidx::nccl_gathers_in_live_graphs(*comm, 5.0), 0);
  comm.reset();
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFree(buf), cudaSuccess);
}

// One GPU, two ranks: rank 0's deadline (1 ms) passes before its init can complete, rank 1's
// (60 s) does not. Rank 1 calls its init only once rank 0's call has returned: NCCL's bootstrap
// waits for every rank, so rank 0's init cannot end before rank 1 joins, and its deadline is what
// returns it (with both inits started at once, NCCL refused the shared GPU within 1 ms on one
// H100, d1207g, and rank 0 returned NCCL's error instead). Rank 0's init is left to its thread,
// still joining, and rank 1's init goes on with it: NCCL refuses two ranks on one GPU, so both
// end, rank 1 with NCCL's error, not its own deadline's (were they made, rank 0's thread would
// abort its communicator). Nothing waits past rank 1's deadline, and the abandoned thread is
// left to end on its own. Rank 1 waits at most 10 s for rank 0: a deadline not kept fails the
// test instead of hanging it.
TEST(NcclOverHost, AnInitPastItsDeadlineIsLeftToEndWithItsPeers) {
  if (device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Status id_status;
  const cpidx::NcclUniqueId id = cpidx::nccl_unique_id(&id_status);
  ASSERT_TRUE(id_status.is_ok()) << id_status.to_string();
  std::vector<Status> st(kWorld);
  std::vector<std::unique_ptr<Communicator>> made(kWorld);
  std::atomic<bool> rank0_returned{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      const auto i = static_cast<size_t>(r);
      if (r == 1) {
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!rank0_returned.load() && std::chrono::steady_clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      made[i] = cpidx::make_nccl_communicator(id, kWorld, r, 0, &st[i], nullptr,
                                              r == 0 ? 0.001 : 60.0);
      if (r == 0) rank0_returned.store(true);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(made[0], nullptr);
  EXPECT_EQ(made[1], nullptr);
  EXPECT_EQ(st[0].code(), StatusCode::kCommError) << st[0].to_string();
  EXPECT_NE(st[0].message().find("did not complete within init_timeout_seconds = 0.001"),
            std::string::npos)
      << st[0].message();
  // Rank 1 ended with the abandoned init's peer (NCCL's refusal), not alone at its deadline.
  EXPECT_FALSE(st[1].is_ok());
  EXPECT_NE(st[1].message().find("ncclCommInitRank failed"), std::string::npos)
      << st[1].message();
  EXPECT_EQ(st[1].message().find("did not complete within"), std::string::npos)
      << st[1].message();
  std::printf("[ info ] rank 1: %s\n", st[1].to_string().c_str());
}

// A device communicator cannot bootstrap NCCL (its all_gather takes device memory).
TEST(NcclOverHost, RefusesADeviceMemoryHost) {
  class DeviceSpaceComm final : public Communicator {
   public:
    int rank() const override { return 0; }
    int world_size() const override { return 1; }
    cpidx::MemorySpace memory_space() const override { return cpidx::MemorySpace::kDevice; }
    Status all_gather(const void*, void*, size_t, cudaStream_t) override {
      ADD_FAILURE() << "no gather may run";
      return Status::ok();
    }
    Status check_agree(long long, const char*) override { return Status::ok(); }
    Status barrier() override { return Status::ok(); }
  } device_space;
  Status st;
  EXPECT_EQ(cpidx::make_nccl_communicator(device_space, 0, &st), nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("host-memory communicator"), std::string::npos) << st.message();
}

}  // namespace
