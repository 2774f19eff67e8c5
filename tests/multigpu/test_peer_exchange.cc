// The peer communicator (cpidx/comm_peer.h) on real GPUs, one process, one host thread per GPU:
// its all_gather returns NCCL's bytes for 1 B .. 256 KiB (in place, out of place, misaligned),
// 1000 back-to-back gathers in one CUDA graph with payloads that change on every call (the
// device epochs and parities), mixed sizes in one graph, cp_decode through it equal to the plain
// decode bitwise (eager and 1000 graph replays; keys through the device channel, through
// all_gather, and both interleaved), an NCCL bootstrap, and the failure paths: a peer that never
// arrives (at a gather, or with its keys in the channel) raises the error word instead of
// hanging, refused sizes and worlds; abandon_peer_communicator letting go of one rank alone while
// its peer still stores into that rank's buffer. PeerOnOneGpu puts two ranks on one GPU: a
// timeout raises every rank's error word (also that of a rank one gather behind), a gather
// reports its own launch's error only, and gathers held by live CUDA graphs are counted and keep
// the buffers their replays use.
// Every test skips cleanly with fewer than 2 GPUs (PeerOnOneGpu: 1; the PeerExchangeLimits ones
// need no GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>

#include "cpidx/comm_nccl.h"
#include "cpidx/comm_peer.h"
#include "gather_util.h"
#include "multigpu_util.h"

namespace {

using namespace cpidx_multigpu_test;
using cpidx::StatusCode;
using cpidx_test::random_decode;

constexpr int kWorld = 2;
constexpr size_t kMaxBytes = 256 << 10;

using Comms = std::vector<std::unique_ptr<Communicator>>;

// Peer communicators over `boot` (collective: one thread per rank).
Comms make_peers(Comms& boot, size_t max_bytes, std::vector<Status>* status,
                 double timeout_seconds = 5.0) {
  Comms peers(boot.size());
  status->assign(boot.size(), Status::ok());
  on_threads(static_cast<int>(boot.size()), [&](int r) {
    peers[static_cast<size_t>(r)] =
        cpidx::make_peer_communicator(*boot[static_cast<size_t>(r)], r, max_bytes,
                                      &(*status)[static_cast<size_t>(r)], timeout_seconds);
  });
  return peers;
}

bool gpus_are_peers() {
  int can01 = 0, can10 = 0;
  cudaDeviceCanAccessPeer(&can01, 0, 1);
  cudaDeviceCanAccessPeer(&can10, 1, 0);
  return can01 && can10;
}

class PeerExchange : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (device_count() < kWorld) return;
    hosts_ = cpidx::make_thread_communicators(kWorld);
    nccl_ = cpidx::make_nccl_communicators_single_process({0, 1}, &nccl_status_);
    std::vector<Status> st;
    peers_ = make_peers(hosts_, kMaxBytes, &st);
    peer_status_ = st[0].is_ok() ? st[1] : st[0];
  }
  static void TearDownTestSuite() {
    peers_.clear();  // before their bootstrap
    hosts_.clear();
    nccl_.clear();
  }

  void SetUp() override {
    if (device_count() < kWorld) {
      GTEST_SKIP() << "needs " << kWorld << " GPUs, found " << device_count();
    }
    if (!gpus_are_peers()) {
      // The communicator must refuse, naming the reason; callers fall back to NCCL.
      EXPECT_EQ(peer_status_.code(), StatusCode::kUnsupported) << peer_status_.to_string();
      EXPECT_NE(peer_status_.message().find("peer access"), std::string::npos)
          << peer_status_.message();
      GTEST_SKIP() << "GPUs 0 and 1 have no peer access: " << peer_status_.to_string();
    }
    ASSERT_TRUE(peer_status_.is_ok()) << peer_status_.to_string();
    ASSERT_TRUE(nccl_status_.is_ok()) << nccl_status_.to_string();
    ASSERT_EQ(peers_.size(), static_cast<size_t>(kWorld));
    ASSERT_TRUE(peers_[0] && peers_[1]);
  }

  static void expect_error_words_clear(const std::string& what) {
    for (int r = 0; r < kWorld; ++r) {
      int32_t word = -1;
      ASSERT_TRUE(cpidx::read_peer_error_flag(*peers_[static_cast<size_t>(r)], &word).is_ok());
      EXPECT_EQ(word, 0) << what << ": rank " << r << "'s peer error word";
    }
  }

  static std::vector<Communicator*> peer_ptrs() {
    std::vector<Communicator*> v;
    for (auto& c : peers_) v.push_back(c.get());
    return v;
  }

  static Comms hosts_, nccl_, peers_;
  static Status nccl_status_, peer_status_;
};

Comms PeerExchange::hosts_, PeerExchange::nccl_, PeerExchange::peers_;
Status PeerExchange::nccl_status_, PeerExchange::peer_status_;

TEST_F(PeerExchange, CommunicatorBasics) {
  std::vector<Status> agree(kWorld), disagree(kWorld), barrier(kWorld), clear(kWorld);
  on_threads(kWorld, [&](int r) {
    Communicator& c = *peers_[static_cast<size_t>(r)];
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.world_size(), kWorld);
    EXPECT_EQ(c.memory_space(), cpidx::MemorySpace::kDevice);
    EXPECT_NE(cpidx::peer_error_flag(c), nullptr);
    EXPECT_EQ(cpidx::peer_error_flag(*nccl_[static_cast<size_t>(r)]), nullptr);
    agree[r] = c.check_agree(42, "the answer");  // forwarded to the thread bootstrap
    disagree[r] = c.check_agree(r, "the rank");
    barrier[r] = c.barrier();
    clear[r] = cpidx::clear_peer_error_flag(c, nullptr);
    cudaDeviceSynchronize();
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(agree[r].is_ok()) << agree[r].to_string();
    EXPECT_EQ(disagree[r].code(), StatusCode::kCommError) << disagree[r].to_string();
    EXPECT_NE(disagree[r].message().find("the rank"), std::string::npos);
    EXPECT_TRUE(barrier[r].is_ok()) << barrier[r].to_string();
    EXPECT_TRUE(clear[r].is_ok()) << clear[r].to_string();
  }
  EXPECT_EQ(cpidx::clear_peer_error_flag(*nccl_[0], nullptr).code(), StatusCode::kInvalidArgument);
  int32_t word = -1;
  EXPECT_EQ(cpidx::read_peer_error_flag(*nccl_[0], &word).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cpidx::read_peer_error_flag(*peers_[0], nullptr).code(),
            StatusCode::kInvalidArgument);
  // Read from another device than the word's: the copy finds the word's device by its address.
  DeviceScope scope(kWorld - 1);
  ASSERT_TRUE(cpidx::read_peer_error_flag(*peers_[0], &word).is_ok());
  EXPECT_EQ(word, 0);
}

TEST_F(PeerExchange, GatherEqualsNcclFromOneByteTo256KiB) {
  // Line and grid edges: 8 B per line, 256 lines per CTA, 32 CTAs (64 KiB), then 2-4 lines per
  // thread; sizes that are not multiples of 8 take the byte path (the last line is padded).
  const std::vector<size_t> sizes = {
      1,     2,     3,     7,      8,      9,      15,     16,     17,     100,   255,   256,
      511,   512,   1000,  1001,   2047,   2048,   2056,   4095,   8192,   16384, 16391, 40960,
      65528, 65536, 65544, 100003, 131072, 131079, 196608, 262136, 262143, 262144};
  int checked = 0;
  for (size_t bytes : sizes) {
    const uint64_t seed = 7000 + bytes;
    std::vector<GatherOut> nccl(kWorld), out(kWorld), in_place(kWorld), odd(kWorld);
    on_threads(kWorld, [&](int r) {
      const std::vector<uint8_t> mine = rank_payload(seed, r, bytes);
      nccl[r] = gather_once(*nccl_[static_cast<size_t>(r)], mine, false);
      Communicator& peer = *peers_[static_cast<size_t>(r)];
      out[r] = gather_once(peer, mine, false);
      in_place[r] = gather_once(peer, mine, true);
      odd[r] = gather_once(peer, mine, false, /*send_offset=*/1, /*recv_offset=*/3);
    });
    std::vector<uint8_t> want;
    for (int q = 0; q < kWorld; ++q) {
      const std::vector<uint8_t> p = rank_payload(seed, q, bytes);
      want.insert(want.end(), p.begin(), p.end());
    }
    for (int r = 0; r < kWorld; ++r) {
      const std::string what = std::to_string(bytes) + " B, rank " + std::to_string(r);
      ASSERT_TRUE(nccl[r].status.is_ok()) << what << ": " << nccl[r].status.to_string();
      EXPECT_EQ(first_difference(nccl[r].got, want, bytes), "") << what << " (NCCL)";
      for (const auto& [name, g] :
           {std::pair<const char*, const GatherOut*>{"out of place", &out[r]},
            {"in place", &in_place[r]},
            {"misaligned", &odd[r]}}) {
        ASSERT_TRUE(g->status.is_ok()) << what << " " << name << ": " << g->status.to_string();
        EXPECT_EQ(first_difference(g->got, nccl[r].got, bytes), "")
            << what << " " << name << ": peer != NCCL";
        EXPECT_TRUE(g->guards_ok) << what << " " << name << ": wrote outside recv";
      }
    }
    ++checked;
    if (HasFailure()) break;
  }
  EXPECT_EQ(checked, static_cast<int>(sizes.size()));
  expect_error_words_clear("sizes");
}

TEST_F(PeerExchange, RefusesPayloadsAboveItsBound) {
  std::vector<Status> st(kWorld);
  on_threads(kWorld, [&](int r) {
    DeviceVec<uint8_t> buf(2 * (kMaxBytes + 8));
    st[r] = peers_[static_cast<size_t>(r)]->all_gather(buf.ptr, buf.ptr + kMaxBytes + 8,
                                                       kMaxBytes + 8, nullptr);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].to_string();
    EXPECT_NE(st[r].message().find("max_bytes_per_rank"), std::string::npos) << st[r].message();
  }
}

TEST_F(PeerExchange, Graph1000BackToBackGathersWithChangingPayloads) {
  // 1001 B: one CTA, byte path, misaligned results; 24 KiB: 12 CTAs; 72 KiB: 32 CTAs of 2
  // lines per thread. 1000 calls pass the 512-call flag refresh of every CTA's region.
  for (size_t bytes : {size_t{1001}, size_t{24} << 10, size_t{72} << 10}) {
    std::vector<std::string> err(kWorld);
    on_threads(kWorld, [&](int r) {
      err[r] = chain_of_gathers(*peers_[static_cast<size_t>(r)], bytes, 1000, 3, 9000 + bytes);
    });
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(err[r], "") << bytes << " B, rank " << r;
    }
  }
  expect_error_words_clear("chain");
}

TEST_F(PeerExchange, GraphOfMixedSizesAndInPlaceGathers) {
  // One CTA, 20 CTAs, 32 CTAs x 2 lines, and a byte-path size: the per-CTA epochs advance
  // unevenly, as with the step's query and key gathers.
  const std::vector<size_t> sizes = {512, 40968, 100003, 4096, 7};
  std::vector<std::string> err(kWorld);
  on_threads(kWorld, [&](int r) {
    err[r] = mixed_gathers(*peers_[static_cast<size_t>(r)], sizes, 600, 2, 31337);
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(err[r], "") << "rank " << r;
  expect_error_words_clear("mixed");
}

TEST_F(PeerExchange, CpDecodeEqualsPlainBitwise) {
  std::mt19937 rng(77);
  int seed = 5000;
  for (int T : {4, 2, 1}) {
    for (int Q : {1, 4}) {
      std::vector<int32_t> s = lengths(rng, 6, 50000, true);
      s[0] = 100;
      s[2] = 129;
      DecodeData d = random_decode(seed++, T, Q, s, 50000);
      expect_threads_cp_equals_plain(peer_ptrs(), d, sel_of(16),
                                     "T=" + std::to_string(T) + " Q=" + std::to_string(Q));
    }
  }
  DecodeData d = random_decode(seed++, 4, 2, lengths(rng, 5, 20000, true), 20000);
  expect_threads_cp_equals_plain(peer_ptrs(), d, sel_of(33, 1, 2), "K=33");
  // More (request, column) items than the selection's wide grid (4 CTAs per SM): its narrow
  // grid stores the keys into the channel.
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  DecodeData many =
      random_decode(seed++, 4, 4, lengths(rng, (4 * sms + 16) / 16, 20000, true), 20000);
  expect_threads_cp_equals_plain(peer_ptrs(), many, sel_of(16), "more items than the wide grid");
  expect_error_words_clear("cp_decode");
}

TEST_F(PeerExchange, CpDecodeGraphReplay1000WithChangingInputs) {
  const int reqs = 8, replays = 1000, check_every = 100, Q = 2;
  const int32_t bound = 1 << 16;
  std::mt19937 rng(88);
  DecodeData d = random_decode(5100, 4, Q, lengths(rng, reqs, bound, false), bound);
  const int checks = replay_threads_cp_graphs(peer_ptrs(), d, sel_of(16), rng, bound, replays,
                                              check_every, "peer");
  EXPECT_EQ(checks, replays / check_every + 1);
  expect_error_words_clear("cp_decode graph");
}

// The key gather through the communicator's all_gather instead of its device channel: the
// route of every other communicator, and of payloads above the channel's capacity.
TEST_F(PeerExchange, CpDecodeWithoutTheChannelEqualsPlainBitwise) {
  std::mt19937 rng(79);
  int seed = 5050;
  for (int T : {4, 1}) {
    for (int Q : {1, 4}) {
      DecodeData d = random_decode(seed++, T, Q, lengths(rng, 6, 50000, true), 50000);
      expect_threads_cp_equals_plain(peer_ptrs(), d, sel_of(16),
                                     "gather T=" + std::to_string(T) + " Q=" + std::to_string(Q),
                                     /*fused_exchange=*/false);
    }
  }
  expect_error_words_clear("cp_decode without the channel");
}

// Steps through the channel and through all_gather on one communicator, interleaved (two
// Decoders per rank, 2 x 40 steps: the channel's parities and epochs advance across the gathers'),
// every step compared with the plain decode.
TEST_F(PeerExchange, ChannelAndGatherStepsInterleave) {
  std::mt19937 rng(81);
  const int steps = 40;
  std::vector<DecodeData> batches;
  for (int i = 0; i < steps; ++i) {
    const int T = i % 3 == 0 ? 1 : 4, Q = 1 + i % 2;
    batches.push_back(random_decode(5200 + i, T, Q, lengths(rng, 1 + i % 5, 30000, true), 30000));
  }
  std::vector<std::vector<RankResult>> fused(steps, std::vector<RankResult>(kWorld)),
      gathered(steps, std::vector<RankResult>(kWorld));
  on_threads(kWorld, [&](int r) {
    for (int i = 0; i < steps; ++i) {
      Communicator& comm = *peers_[static_cast<size_t>(r)];
      fused[i][r] = cp_rank(comm, r, batches[i], sel_of(16), -1, true);
      gathered[i][r] = cp_rank(comm, r, batches[i], sel_of(16), -1, false);
    }
  });
  for (int i = 0; i < steps && !HasFailure(); ++i) {
    const std::vector<int32_t> plain = plain_decode_on(0, batches[i], sel_of(16));
    for (int r = 0; r < kWorld; ++r) {
      const std::string what = "step " + std::to_string(i);
      expect_rank_matches(fused[i][r], plain, batches[i].rows(), 16, what + " channel");
      expect_rank_matches(gathered[i][r], plain, batches[i].rows(), 16, what + " gather");
    }
  }
  expect_error_words_clear("interleaved");
}

TEST_F(PeerExchange, NcclCommunicatorAsBootstrap) {
  std::vector<Status> st;
  Comms peers = make_peers(nccl_, 4096, &st);  // handles staged through device memory
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  std::vector<GatherOut> out(kWorld);
  std::vector<Status> agree(kWorld);
  on_threads(kWorld, [&](int r) {
    out[r] = gather_once(*peers[static_cast<size_t>(r)], rank_payload(11, r, 3001), false);
    agree[r] = peers[static_cast<size_t>(r)]->check_agree(r, "the rank");  // NCCL's host channel
  });
  std::vector<uint8_t> want = rank_payload(11, 0, 3001), one = rank_payload(11, 1, 3001);
  want.insert(want.end(), one.begin(), one.end());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(out[r].status.is_ok()) << out[r].status.to_string();
    EXPECT_EQ(first_difference(out[r].got, want, 3001), "") << "rank " << r;
    EXPECT_EQ(agree[r].code(), StatusCode::kCommError) << agree[r].to_string();
  }
  peers.clear();
}

// A bad device on one rank over an NCCL bootstrap: that rank cannot stage its set-up message
// there, so it stages on its current device and still joins the gathers; every rank fails,
// naming rank 1, instead of rank 0 waiting in NCCL for it. The bootstrap stays in step.
TEST_F(PeerExchange, BadDeviceOverAnNcclBootstrapFailsEveryRank) {
  std::vector<Status> st(kWorld);
  Comms peers(kWorld);
  on_threads(kWorld, [&](int r) {
    DeviceScope scope(r);  // the caller's current device is its NCCL device
    peers[r] = cpidx::make_peer_communicator(*nccl_[static_cast<size_t>(r)], r == 1 ? 999 : r,
                                             4096, &st[r]);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(peers[r], nullptr);
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank 1"), std::string::npos) << st[r].message();
  }
  peers = make_peers(nccl_, 4096, &st);
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(st[r].is_ok()) << st[r].to_string();
  peers.clear();
}

TEST_F(PeerExchange, MissingPeerRaisesTheErrorWordInsteadOfHanging) {
  Comms boot = cpidx::make_thread_communicators(kWorld);
  std::vector<Status> st;
  Comms peers = make_peers(boot, 4096, &st, /*timeout_seconds=*/0.25);
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  // Only rank 0 gathers: it must come back with its error word set.
  DeviceScope scope(0);
  DeviceVec<uint8_t> buf(2 * 4096);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(peers[0]->all_gather(buf.ptr, buf.ptr, 4096, stream).is_ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  // Once raised, later gathers do not wait again.
  for (int i = 0; i < 20; ++i)
    ASSERT_TRUE(peers[0]->all_gather(buf.ptr, buf.ptr, 4096, stream).is_ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int32_t word = 0;
  ASSERT_TRUE(cpidx::read_peer_error_flag(*peers[0], &word).is_ok());
  EXPECT_EQ(word & cpidx::kPeerErrorTimeout, cpidx::kPeerErrorTimeout);
  EXPECT_LT(seconds, 5.0) << "21 gathers without a peer should cost about one timeout";
  ASSERT_TRUE(cpidx::clear_peer_error_flag(*peers[0], stream).is_ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_TRUE(cpidx::read_peer_error_flag(*peers[0], &word).is_ok());
  EXPECT_EQ(word, 0);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  peers.clear();
}

// Rank 1 joins the query gather of rank 0's step but never sends its keys: rank 0's merge must
// give up after the timeout with the error word raised, not hang.
TEST_F(PeerExchange, MissingKeysInTheChannelRaiseTheErrorWordInsteadOfHanging) {
  Comms boot = cpidx::make_thread_communicators(kWorld);
  std::vector<Status> st;
  Comms peers = make_peers(boot, 64 << 10, &st, /*timeout_seconds=*/0.25);
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  std::mt19937 rng(83);
  DecodeData d = random_decode(5300, 2, 1, lengths(rng, 3, 20000, true), 20000);
  const int64_t q_bytes = d.rows() * 1 * cpidx::kHeadDim * 2;  // one local head per rank
  std::vector<Status> result(kWorld);
  double seconds = 0;
  on_threads(kWorld, [&](int r) {
    Communicator& comm = *peers[static_cast<size_t>(r)];
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    if (r == 1) {  // the query gather alone
      DeviceVec<uint8_t> q(static_cast<size_t>(kWorld * q_bytes));
      result[r] = comm.all_gather(q.ptr + q_bytes, q.ptr, static_cast<size_t>(q_bytes), stream);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    } else {
      DeviceBatch b(d);
      cpidx::DecodeConfig cfg = config_for(d, sel_of(16), kWorld, r);
      cfg.check_agreement = false;  // rank 1 has no Decoder to agree with
      std::unique_ptr<cpidx::Decoder> dec;
      result[r] = cpidx::Decoder::create(cfg, r, &dec);
      if (result[r].is_ok()) {
        DeviceVec<int32_t> ids(static_cast<size_t>(d.rows() * 16));
        const auto t0 = std::chrono::steady_clock::now();
        result[r] = dec->cp_decode(comm, b.inputs(0, 1),
                                   cpidx::TopkOutput{ids.ptr, d.rows() * 16, 16}, nullptr, stream);
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    }
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(result[r].is_ok()) << result[r].to_string();
  for (int r = 0; r < kWorld; ++r) {  // rank 1's by rank 0's merge, through the peer mapping
    int32_t word = 0;
    ASSERT_TRUE(cpidx::read_peer_error_flag(*peers[static_cast<size_t>(r)], &word).is_ok());
    EXPECT_EQ(word & cpidx::kPeerErrorTimeout, cpidx::kPeerErrorTimeout) << "rank " << r;
  }
  EXPECT_LT(seconds, 5.0) << "the merge should give up after about one timeout";
  peers.clear();
}

// Rank 0 lets go of its communicator alone (abandon_peer_communicator) while rank 1 does nothing;
// rank 0's buffer stays allocated, so rank 1's next gather still stores into it without a fault
// and then times out instead of hanging. (Ranks of one process make no barrier when destroyed
// either; MpiPeer.AbandonWaitsForNoPeer checks that across processes.)
TEST_F(PeerExchange, AbandonIsLocalAndKeepsTheBufferPeersStoreInto) {
  Comms boot = cpidx::make_thread_communicators(kWorld);
  std::vector<Status> st;
  Comms peers = make_peers(boot, 4096, &st, /*timeout_seconds=*/0.25);
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  std::vector<GatherOut> out(kWorld);
  on_threads(kWorld, [&](int r) {
    out[r] = gather_once(*peers[static_cast<size_t>(r)], rank_payload(23, r, 4096), false);
  });
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(out[r].status.is_ok()) << out[r].status.to_string();

  auto abandoned = std::async(std::launch::async, [&] {
    DeviceScope scope(0);
    return cpidx::abandon_peer_communicator(&peers[0]);
  });
  const bool returned = abandoned.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "abandon_peer_communicator waited for its peer";
  if (!returned) peers[1]->barrier();  // the barrier rank 0 should not have entered: release it
  const Status released = abandoned.get();
  EXPECT_TRUE(released.is_ok()) << released.to_string();
  EXPECT_EQ(peers[0], nullptr);

  DeviceScope scope(1);
  DeviceVec<uint8_t> buf(2 * 4096);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(peers[1]->all_gather(buf.ptr + 4096, buf.ptr, 4096, stream).is_ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess) << "a store into rank 0's buffer faulted";
  int32_t word = 0;
  ASSERT_TRUE(cpidx::read_peer_error_flag(*peers[1], &word).is_ok());
  EXPECT_EQ(word & cpidx::kPeerErrorTimeout, cpidx::kPeerErrorTimeout);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  const Status second = cpidx::abandon_peer_communicator(&peers[1]);
  EXPECT_TRUE(second.is_ok()) << second.to_string();
  EXPECT_EQ(peers[1], nullptr);
}

// One rank with fused_exchange off, its peer with it on: the route is part of the agreed rows,
// so both fail at once (kCommError) instead of each waiting out the 5 s timeout in a collective
// the other never joins; the error words stay clear and the next step goes through.
TEST_F(PeerExchange, RanksOnDifferentKeyRoutesFailTogether) {
  DecodeData d = random_decode(5300, 4, 2, {3000, 500, 7000}, 8192);
  std::vector<RankResult> res(kWorld);
  on_threads(kWorld, [&](int r) {
    res[r] = cp_rank(*peers_[static_cast<size_t>(r)], r, d, sel_of(16), -1, r == 0);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(res[r].status.code(), StatusCode::kCommError) << res[r].status.to_string();
    EXPECT_NE(res[r].status.message().find("fused exchange"), std::string::npos)
        << res[r].status.message();
    for (int32_t x : res[r].ids) ASSERT_EQ(x, cpidx_test::kPoison) << "rank " << r;
  }
  expect_error_words_clear("ranks on different routes");
  expect_threads_cp_equals_plain(peer_ptrs(), d, sel_of(16), "after the refused step");
}

TEST_F(PeerExchange, RanksThatDisagreeFailTogether) {
  Comms boot = cpidx::make_thread_communicators(kWorld);
  std::vector<Status> st(kWorld);
  Comms peers(kWorld);
  // Different bounds: every rank fails, naming the bound.
  on_threads(kWorld, [&](int r) {
    peers[r] = cpidx::make_peer_communicator(*boot[r], r, r == 0 ? 4096 : 8192, &st[r]);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(peers[r], nullptr);
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].to_string();
    EXPECT_NE(st[r].message().find("max_bytes_per_rank"), std::string::npos) << st[r].message();
  }
  // A bad device on rank 1: rank 0 fails too, naming rank 1.
  on_threads(kWorld, [&](int r) {
    peers[r] = cpidx::make_peer_communicator(*boot[r], r == 1 ? 999 : r, 4096, &st[r]);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(peers[r], nullptr);
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].to_string();
    EXPECT_NE(st[r].message().find("rank 1"), std::string::npos) << st[r].message();
  }
  // The bootstrap is still in step: a good creation works afterwards.
  on_threads(kWorld,
             [&](int r) { peers[r] = cpidx::make_peer_communicator(*boot[r], r, 4096, &st[r]); });
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(st[r].is_ok()) << st[r].to_string();
  peers.clear();
}

// ---- Two ranks on one GPU ---------------------------------------------------------------------
// Both ranks are threads of this process on GPU 0: the peer communicator takes ranks that share
// a device when allowed (allow_shared_gpu; no peer access is needed), so these run wherever one
// GPU is. They share one CUDA
// context: a host call that waits for the device (a Decoder's creation synchronises it) waits
// out the other rank's spinning gather, and a scoring grid launched early can hold every SM
// that gather needs, so each test orders its ranks' launches. As a precaution against the same
// with kernels loaded lazily at their first launch (CUDA's default), this binary loads its
// modules eagerly, set before the CUDA runtime starts (a value the caller set stays).
const bool kEagerModuleLoading = setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0;

// fn(rank) on one thread per rank, GPU 0 current on each.
void on_gpu0(int world, const std::function<void(int)>& fn) { on_threads(world, fn, 0); }

class PeerOnOneGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() < 1) GTEST_SKIP() << "needs a GPU";
    ASSERT_TRUE(kEagerModuleLoading);
    make(0.25);
  }
  // Both ranks' communicators on GPU 0, over a fresh thread bootstrap.
  void make(double timeout_seconds) {
    peers_.clear();
    boot_ = cpidx::make_thread_communicators(kWorld);
    peers_.resize(kWorld);
    std::vector<Status> st(kWorld);
    on_gpu0(kWorld, [&](int r) {
      peers_[static_cast<size_t>(r)] = cpidx::make_peer_communicator(
          *boot_[static_cast<size_t>(r)], 0, 64 << 10, &st[static_cast<size_t>(r)],
          timeout_seconds, /*allow_shared_gpu=*/true);
    });
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  }
  void TearDown() override {
    peers_.clear();  // before their bootstrap
    boot_.clear();
  }
  int32_t error_word(int r) {
    int32_t word = -1;
    EXPECT_TRUE(cpidx::read_peer_error_flag(*peers_[static_cast<size_t>(r)], &word).is_ok());
    return word;
  }
  Comms boot_, peers_;
};

// Without allow_shared_gpu the two ranks on GPU 0 are refused, on both, naming the pair and
// the GPU (NCCL refuses them too): their kernels would compete for its SMs.
TEST_F(PeerOnOneGpu, RanksSharingAGpuAreRefusedUnlessAllowed) {
  Comms boot = cpidx::make_thread_communicators(kWorld);
  Comms peers(kWorld);
  std::vector<Status> st(kWorld);
  on_gpu0(kWorld, [&](int r) {
    peers[static_cast<size_t>(r)] = cpidx::make_peer_communicator(
        *boot[static_cast<size_t>(r)], 0, 4096, &st[static_cast<size_t>(r)]);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(peers[static_cast<size_t>(r)], nullptr) << "rank " << r;
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << st[r].to_string();
    EXPECT_NE(st[r].message().find("ranks 0 and 1 share GPU"), std::string::npos)
        << st[r].message();
  }
}

// Rank 0 gathers alone; rank 1 launches nothing. Rank 0's waiter times out and raises rank 1's
// word as well as its own: every rank reading its own word learns of the failure.
TEST_F(PeerOnOneGpu, ATimeoutRaisesEveryRanksErrorWord) {
  DeviceScope scope(0);
  DeviceVec<uint8_t> buf(2 * 4096);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(error_word(r), 0) << "rank " << r;
  ASSERT_TRUE(peers_[0]->all_gather(buf.ptr, buf.ptr, 4096, stream).is_ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(error_word(0), cpidx::kPeerErrorTimeout);
  EXPECT_EQ(error_word(1), cpidx::kPeerErrorTimeout) << "rank 1, which never gathered";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Rank 0 skips the second of four gathers (as a rank that failed a step on its own would).
// Rank 1 times out there; from then on rank 0 is one call behind, and its waits would find rank
// 1's lines of the previous call with its own word clear. Rank 1's waiter raises rank 0's word,
// so rank 0 sees the failure in its own word.
TEST_F(PeerOnOneGpu, ARankThatSkippedAGatherLearnsOfIt) {
  on_gpu0(kWorld, [&](int r) {
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    DeviceVec<uint64_t> send(1), recv(kWorld);
    for (int k = 0; k < 4; ++k) {
      const uint64_t v = 1000u * static_cast<uint64_t>(r) + static_cast<uint64_t>(k);
      ASSERT_EQ(cudaMemcpy(send.ptr, &v, sizeof(v), cudaMemcpyHostToDevice), cudaSuccess);
      if (r != 0 || k != 1) {
        ASSERT_TRUE(peers_[static_cast<size_t>(r)]->all_gather(send.ptr, recv.ptr, 8, stream)
                        .is_ok());
      }
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      if (k == 0) {  // in step: each rank has both payloads
        std::vector<uint64_t> got(kWorld);
        ASSERT_EQ(cudaMemcpy(got.data(), recv.ptr, sizeof(uint64_t) * kWorld,
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(got, (std::vector<uint64_t>{0, 1000})) << "rank " << r;
      }
      ASSERT_TRUE(boot_[static_cast<size_t>(r)]->barrier().is_ok());
    }
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  });
  EXPECT_EQ(error_word(1), cpidx::kPeerErrorTimeout) << "rank 1, which waited for call 1";
  EXPECT_EQ(error_word(0), cpidx::kPeerErrorTimeout) << "rank 0, one call behind since";
}

// A CUDA error the caller left pending is neither reported by the gather (whose kernel ran) nor
// taken from the caller: a gather reported failed after it ran would have its caller skip the
// rest of a step its peers run.
TEST_F(PeerOnOneGpu, AGatherReturnsItsOwnLaunchErrorOnly) {
  make(2.0);
  std::vector<Status> result(kWorld);
  std::vector<std::vector<uint64_t>> got(kWorld, std::vector<uint64_t>(kWorld));
  cudaError_t pending = cudaSuccess;
  on_gpu0(kWorld, [&](int r) {
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    DeviceVec<uint64_t> send(1), recv(kWorld);
    const uint64_t v = 7u + static_cast<uint64_t>(r);
    ASSERT_EQ(cudaMemcpy(send.ptr, &v, sizeof(v), cudaMemcpyHostToDevice), cudaSuccess);
    if (r == 0) {  // an allocation that fails leaves its error pending in this thread
      void* huge = nullptr;
      EXPECT_EQ(cudaMalloc(&huge, size_t{1} << 52), cudaErrorMemoryAllocation);
    }
    // The gathers start together: once on the H100 rank 1's gather timed out (0.25 s) waiting
    // for rank 0's, which came after the failing allocation (d1206e).
    EXPECT_TRUE(boot_[static_cast<size_t>(r)]->barrier().is_ok());
    result[r] = peers_[static_cast<size_t>(r)]->all_gather(send.ptr, recv.ptr, 8, stream);
    if (r == 0) pending = cudaGetLastError();  // still the caller's to read
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got[r].data(), recv.ptr, sizeof(uint64_t) * kWorld,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(result[r].is_ok()) << "rank " << r << ": " << result[r].to_string();
    EXPECT_EQ(got[r], (std::vector<uint64_t>{7, 8})) << "rank " << r;
    EXPECT_EQ(error_word(r), 0) << "rank " << r;
  }
  EXPECT_EQ(pending, cudaErrorMemoryAllocation);
}

// Gathers captured into CUDA graphs are counted until the graphs go (an instantiation holds them
// too), for both ranks together: a replay of either rank's graph stores into both buffers.
TEST_F(PeerOnOneGpu, GathersInLiveGraphsAreCountedForTheWholeProcess) {
  EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*boot_[0]), -1) << "not a peer communicator";
  DeviceScope scope(0);
  DeviceVec<uint64_t> buf(2 * kWorld);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*peers_[static_cast<size_t>(r)]), 0);
  }
  // Rank 0 captures two gathers (nothing runs, so no peer is waited for).
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_TRUE(peers_[0]->all_gather(buf.ptr, buf.ptr, 8, stream).is_ok());
  EXPECT_TRUE(peers_[0]->all_gather(buf.ptr + kWorld, buf.ptr + kWorld, 8, stream).is_ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*peers_[0]), 2);
  EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*peers_[1]), 2) << "rank 1 counts rank 0's graph";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*peers_[1], 0.2), 2) << "the instantiation";
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*peers_[static_cast<size_t>(r)], 5.0), 0);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Both ranks' communicators destroyed while each rank's instantiated graph of a gather lives:
// their buffers and words stay allocated, so the graphs still replay into them and gather
// right, and memory allocated after the destruction (which a freed buffer would have become)
// is never stored into. Freed, the replays' stores land in that memory or fault.
TEST_F(PeerOnOneGpu, DestroyedUnderLiveGraphsTheBuffersStayForTheirReplays) {
  constexpr size_t kBytes = 4096;
  constexpr size_t kLater = size_t{2} << 20;
  std::vector<cudaStream_t> streams(kWorld, nullptr);
  std::vector<cudaGraphExec_t> execs(kWorld, nullptr);
  std::vector<std::unique_ptr<DeviceVec<uint8_t>>> bufs(kWorld);
  on_gpu0(kWorld, [&](int r) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
    bufs[r] = std::make_unique<DeviceVec<uint8_t>>(kWorld * kBytes);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(streams[r], cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_TRUE(peers_[static_cast<size_t>(r)]
                    ->all_gather(bufs[r]->ptr + r * kBytes, bufs[r]->ptr, kBytes, streams[r])
                    .is_ok());
    ASSERT_EQ(cudaStreamEndCapture(streams[r], &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&execs[r], graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  });
  ASSERT_EQ(cpidx::peer_gathers_in_live_graphs(*peers_[0]), 2);
  peers_.clear();  // ranks of one process: no collective, a 0.1 s grace, then 0.01 s each
  DeviceScope scope(0);
  const cpidx_gpu_test::LaterAllocations later(8, kLater);  // where freed buffers would go
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<uint8_t>> got(kWorld);
    on_gpu0(kWorld, [&](int r) {
      const std::vector<uint8_t> mine = rank_payload(60 + round, r, kBytes);
      ASSERT_EQ(
          cudaMemcpy(bufs[r]->ptr + r * kBytes, mine.data(), kBytes, cudaMemcpyHostToDevice),
          cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(execs[r], streams[r]), cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(streams[r]), cudaSuccess) << "rank " << r;
      got[r].resize(kWorld * kBytes);
      ASSERT_EQ(cudaMemcpy(got[r].data(), bufs[r]->ptr, kWorld * kBytes, cudaMemcpyDeviceToHost),
                cudaSuccess);
    });
    std::vector<uint8_t> want;
    for (int q = 0; q < kWorld; ++q) {
      const std::vector<uint8_t> p = rank_payload(60 + round, q, kBytes);
      want.insert(want.end(), p.begin(), p.end());
    }
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(got[r], want) << "rank " << r << ", round " << round;
  }
  EXPECT_TRUE(later.untouched())
      << "a replay stored into memory allocated after the communicators were destroyed";
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(cudaGraphExecDestroy(execs[r]), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(streams[r]), cudaSuccess);
  }
}

// Rank 1 joins the query gather of rank 0's step but never sends its keys: rank 0's merge gives
// up and raises both ranks' words (the device channel's alarm). On a shared GPU rank 1's gather
// must be resident before rank 0's step is enqueued: rank 0's scoring grid, launched early
// behind its gather, can take every SM, and rank 1's gather would then find none until rank
// 0's gather timed out (which raised rank 1's word before its gather, measured on the H100).
TEST_F(PeerOnOneGpu, MissingKeysInTheChannelRaiseEveryRanksErrorWord) {
  make(2.0);
  std::mt19937 rng(84);
  DecodeData d = random_decode(5301, 2, 1, lengths(rng, 3, 20000, true), 20000);
  const int64_t q_bytes = d.rows() * 1 * cpidx::kHeadDim * 2;  // one local head per rank
  std::vector<Status> result(kWorld);
  on_gpu0(kWorld, [&](int r) {
    Communicator& comm = *peers_[static_cast<size_t>(r)];
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    // Barrier 1: everything made (a Decoder's creation synchronises the device, so it must not
    // wait out rank 1's gather); barrier 2: rank 1's gather launched.
    if (r == 1) {  // the query gather alone, launched first
      DeviceVec<uint8_t> q(static_cast<size_t>(kWorld * q_bytes));
      EXPECT_TRUE(boot_[1]->barrier().is_ok());
      result[r] = comm.all_gather(q.ptr + q_bytes, q.ptr, static_cast<size_t>(q_bytes), stream);
      EXPECT_TRUE(boot_[1]->barrier().is_ok());
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      // Its gather met rank 0's (no timeout of its own): its word is raised later, by rank 0.
      EXPECT_EQ(error_word(1), 0) << "rank 1 right after its gather";
    } else {
      DeviceBatch b(d);
      cpidx::DecodeConfig cfg = config_for(d, sel_of(16), kWorld, r);
      cfg.check_agreement = false;  // rank 1 has no Decoder to agree with
      std::unique_ptr<cpidx::Decoder> dec;
      DeviceVec<int32_t> ids(static_cast<size_t>(d.rows() * 16));
      result[r] = cpidx::Decoder::create(cfg, 0, &dec);
      EXPECT_TRUE(boot_[0]->barrier().is_ok());
      EXPECT_TRUE(boot_[0]->barrier().is_ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 1's gather resident
      if (result[r].is_ok()) {
        result[r] = dec->cp_decode(comm, b.inputs(0, 1),
                                   cpidx::TopkOutput{ids.ptr, d.rows() * 16, 16}, nullptr, stream);
      }
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(result[r].is_ok()) << result[r].to_string();
  EXPECT_EQ(error_word(0), cpidx::kPeerErrorTimeout);
  EXPECT_EQ(error_word(1), cpidx::kPeerErrorTimeout) << "rank 1, whose keys never came";
}

// No GPU needed: the world bound is checked before anything else (no collective is made).
TEST(PeerExchangeLimits, MoreThanEightRanksAreRefused) {
  Comms boot = cpidx::make_thread_communicators(cpidx::kPeerMaxRanks + 1);
  Status st;
  auto peer = cpidx::make_peer_communicator(*boot[0], 0, 4096, &st);
  EXPECT_EQ(peer, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  EXPECT_NE(st.message().find("use NCCL"), std::string::npos) << st.message();
}

// No GPU needed: the error-word helpers refuse a communicator that is not a peer one, by name,
// before any CUDA call, and leave the caller's word alone.
TEST(PeerExchangeLimits, ErrorWordHelpersRefuseOtherCommunicators) {
  Comms threads = cpidx::make_thread_communicators(2);
  EXPECT_EQ(cpidx::peer_error_flag(*threads[0]), nullptr);
  const Status clear = cpidx::clear_peer_error_flag(*threads[0], nullptr);
  EXPECT_EQ(clear.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(clear.message().find("not a peer communicator"), std::string::npos) << clear.message();
  int32_t word = 12345;
  const Status read = cpidx::read_peer_error_flag(*threads[0], &word);
  EXPECT_EQ(read.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(read.message().find("read_peer_error_flag"), std::string::npos) << read.message();
  EXPECT_EQ(word, 12345);
}

// No GPU needed: abandon_peer_communicator takes peer communicators only and leaves any other one
// to its owner, untouched.
TEST(PeerExchangeLimits, AbandonTakesOnlyPeerCommunicators) {
  const Status null_comm = cpidx::abandon_peer_communicator(nullptr);
  EXPECT_EQ(null_comm.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(null_comm.message().find("comm"), std::string::npos) << null_comm.message();
  std::unique_ptr<Communicator> empty;
  EXPECT_TRUE(cpidx::abandon_peer_communicator(&empty).is_ok());
  Comms threads = cpidx::make_thread_communicators(2);
  const Communicator* before = threads[0].get();
  const Status other = cpidx::abandon_peer_communicator(&threads[0]);
  EXPECT_EQ(other.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other.message().find("not a peer communicator"), std::string::npos) << other.message();
  EXPECT_EQ(threads[0].get(), before);
}

}  // namespace
