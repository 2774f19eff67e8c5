// The context-parallel decode over NCCL with one MPI process per GPU (run: mpirun -np 2): the
// NCCL unique id is broadcast with MPI and the MPI communicator is the host channel. Each rank
// checks its owned heads against the plain decode on its own GPU, bitwise: random batches,
// replicated heads, golden cases, a CUDA graph replayed 1000 times with changing inputs, and a
// disagreeing batch size (kCommError on every rank, no hang). The same through the peer
// communicator (cpidx/comm_peer.h, IPC-mapped buffers, MPI as bootstrap): its gathers equal
// NCCL's bytes, 1000 back-to-back gathers in one graph, mixed sizes, cp_decode eager and in 1000
// graph replays, and abandon_peer_communicator on one rank while its peers are elsewhere (no
// barrier, its buffer left mapped for them). Skips with fewer GPUs than ranks; but
// MpiPeerOnOneGpu puts every rank on GPU 0: a graph on one rank that holds a gather keeps every
// rank's buffers when all destroy their communicators.
//
// Rule: no ASSERT or early return before a collective (see multigpu_util.h).
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>

#include "cpidx/comm_mpi.h"
#include "cpidx/comm_nccl.h"
#include "cpidx/comm_peer.h"
#include "gather_util.h"
#include "json_lite.h"
#include "multigpu_util.h"

namespace {

using namespace cpidx_multigpu_test;
using cpidx::StatusCode;
using cpidx_test::random_decode;

struct World {
  int rank = 0, size = 1, device = 0;
  bool enough_gpus = false;
  Status status;
  std::unique_ptr<Communicator> mpi;   // host channel
  std::unique_ptr<Communicator> nccl;  // device communicator
  Status peer_status;
  std::unique_ptr<Communicator> peer;  // peer communicator, bootstrapped over `mpi`
};

constexpr size_t kPeerMaxBytes = 256 << 10;

World& world() {
  static World w;
  return w;
}

// Every process calls it once, after MPI_Init: same device count on every rank of one host, so
// every rank takes the same branch.
void set_up_world() {
  World& w = world();
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  const int gpus = device_count();
  w.enough_gpus = w.size >= 2 && gpus >= w.size;
  if (!w.enough_gpus) return;
  w.device = w.rank % gpus;
  w.mpi = cpidx::make_mpi_communicator(&w.status);
  if (!w.status.is_ok()) return;
  // Rank 0's unique id reaches every rank over MPI; a rank that cannot go on (its id, device or
  // arguments) makes every rank fail together.
  w.nccl = cpidx::make_nccl_communicator(*w.mpi, w.device, &w.status);
  // Collective over MPI; every rank with an MPI communicator gets here.
  w.peer = cpidx::make_peer_communicator(*w.mpi, w.device, kPeerMaxBytes, &w.peer_status);
}

// This rank's cp_decode through `c` on `device` captured in a CUDA graph (after an eager warm-up),
// then `replays` replays with the shared schedule of new inputs; every `check_every`-th and the
// last replay compared with the plain decode. The ranks agree through `host` that every capture
// succeeded before any replays (none replays alone).
void replay_graph_and_check(Communicator& c, Communicator& host, int device, DecodeData& d,
                            const Selection& sel, std::mt19937& rng, int32_t bound, int replays,
                            int check_every) {
  GraphRank rank(c, device, d, sel);
  Status st = rank.warm_up();
  if (st.is_ok()) st = rank.capture();
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  const Status ready = host.check_agree(st.is_ok() ? 1 : 0, "graph captured");
  ASSERT_TRUE(ready.is_ok()) << ready.to_string();
  for (int step = 0; step < replays; ++step) {
    next_replay_inputs(rng, step, bound, &d);
    const bool check = step % check_every == 0 || step == replays - 1;
    rank.set_inputs(d);
    if (check) rank.poison_ids();
    rank.launch();
    rank.sync();
    if (!check) continue;
    expect_owned_heads_equal(rank.geometry(), rank.ids(), plain_decode_on(device, d, sel),
                             d.rows(), sel.topk, "replay " + std::to_string(step));
  }
}

class MpiNccl : public ::testing::Test {
 protected:
  void SetUp() override {
    const World& w = world();
    if (!w.enough_gpus) {
      GTEST_SKIP() << "needs >= 2 ranks and one GPU per rank; " << w.size << " ranks, "
                   << device_count() << " GPUs";
    }
    ASSERT_TRUE(w.status.is_ok()) << w.status.to_string();
    ASSERT_TRUE(w.nccl != nullptr);
  }
  static Communicator& comm() { return *world().nccl; }
  static int device() { return world().device; }

  // This rank's cp_decode through `c` (NCCL by default) against the plain decode on its GPU.
  static void expect_cp_equals_plain(const DecodeData& d, const Selection& sel,
                                     const std::string& what, Communicator* c = nullptr) {
    const std::vector<int32_t> plain = plain_decode_on(device(), d, sel);
    const RankResult res = cp_rank(c ? *c : comm(), device(), d, sel);
    expect_rank_matches(res, plain, d.rows(), sel.topk, what);
  }
};

TEST_F(MpiNccl, CommunicatorShape) {
  EXPECT_EQ(comm().rank(), world().rank);
  EXPECT_EQ(comm().world_size(), world().size);
  EXPECT_EQ(comm().memory_space(), cpidx::MemorySpace::kDevice);
  EXPECT_TRUE(comm().check_agree(7, "seven").is_ok());
  const Status differ = comm().check_agree(world().rank, "the rank");
  EXPECT_EQ(differ.code(), StatusCode::kCommError) << differ.to_string();
  EXPECT_TRUE(comm().barrier().is_ok());
}

TEST_F(MpiNccl, RandomBatchesEqualPlainBitwise) {
  std::mt19937 rng(51);  // same seed on every rank: identical inputs
  int seed = 2000;
  for (int T : {4, 2, 1}) {
    cpidx::Geometry g;
    if (!cpidx::make_geometry(T, world().size, 0, &g).is_ok()) continue;  // same on every rank
    for (int Q : {1, 4}) {
      std::vector<int32_t> s = lengths(rng, 6, 200000, true);
      s[0] = 1;
      s[2] = 129;
      DecodeData d = random_decode(seed++, T, Q, s, 200000);
      expect_cp_equals_plain(d, sel_of(16), "T=" + std::to_string(T) + " Q=" + std::to_string(Q));
    }
  }
}

TEST_F(MpiNccl, GoldenCases) {
  const json_lite::Value cases =
      json_lite::parse_file(std::string(CPIDX_TEST_DATA_DIR) + "/golden_cases.json")["cases"];
  for (const auto& c : cases.array) {
    if (c["kind"].string != "decode") continue;
    const DecodeData d = cpidx_test::golden_decode(
        static_cast<uint64_t>(c["seed"].number), c["T"].as_int(), c["Q"].as_int(),
        c["seq_lens"].ints(), static_cast<float>(c["scale"].number));
    cpidx::Geometry g;
    if (!cpidx::make_geometry(d.total_heads, world().size, 0, &g).is_ok()) continue;
    const Selection sel = sel_of(c["K"].as_int(), c["init"].as_int(), c["local"].as_int());
    std::vector<int32_t> want;
    for (const auto& head : c["ids"].array)
      for (const auto& row : head.array)
        for (int32_t v : row.ints()) want.push_back(v);
    const RankResult res = cp_rank(comm(), device(), d, sel);
    expect_rank_matches(res, want, d.rows(), sel.topk,
                        "golden seed " + std::to_string(c["seed"].as_int()));
  }
}

TEST_F(MpiNccl, GraphReplay1000WithChangingInputs) {
  const int reqs = 8, replays = 1000, check_every = 100, Q = 2;
  const int32_t bound = 1 << 16;
  std::mt19937 rng(61);
  DecodeData d = random_decode(2100, 4, Q, lengths(rng, reqs, bound, false), bound);
  replay_graph_and_check(comm(), *world().mpi, device(), d, sel_of(16), rng, bound, replays,
                         check_every);
}

TEST_F(MpiNccl, DisagreeingBatchSizeFailsBeforeAnyCollective) {
  DecodeData d = random_decode(2200, 4, 2, {3000, 500, 7000, 100}, 8192);
  const Selection sel = sel_of(16);
  const RankResult res = cp_rank(comm(), device(), d, sel, world().rank == 1 ? 3 : -1);
  EXPECT_EQ(res.status.code(), StatusCode::kCommError) << res.status.to_string();
  EXPECT_NE(res.status.message().find("decode rows"), std::string::npos) << res.status.message();
  expect_cp_equals_plain(d, sel, "after the refused step");
}

class MpiPeer : public MpiNccl {
 protected:
  void SetUp() override {
    MpiNccl::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(world().peer_status.is_ok()) << world().peer_status.to_string();
    ASSERT_TRUE(world().peer != nullptr);
  }
  static Communicator& peer() { return *world().peer; }
  static void expect_error_word_clear(const std::string& what) {
    int32_t word = -1;
    ASSERT_TRUE(cpidx::read_peer_error_flag(peer(), &word).is_ok());
    EXPECT_EQ(word, 0) << what << ": peer error word";
  }
};

TEST_F(MpiPeer, GatherEqualsNccl) {
  EXPECT_EQ(peer().rank(), world().rank);
  EXPECT_EQ(peer().memory_space(), cpidx::MemorySpace::kDevice);
  EXPECT_TRUE(peer().check_agree(5, "five").is_ok());  // forwarded to MPI
  DeviceScope scope(device());
  for (size_t bytes : {size_t{1}, size_t{7}, size_t{8}, size_t{1001}, size_t{2048}, size_t{16391},
                       size_t{65536}, size_t{65544}, size_t{131079}, size_t{262144}}) {
    const uint64_t seed = 8000 + bytes;
    const std::vector<uint8_t> mine = rank_payload(seed, world().rank, bytes);
    const GatherOut nccl = gather_once(comm(), mine, false);
    const GatherOut out = gather_once(peer(), mine, false);
    const GatherOut in_place = gather_once(peer(), mine, true);
    const GatherOut odd = gather_once(peer(), mine, false, 5, 1);
    std::vector<uint8_t> want;
    for (int q = 0; q < world().size; ++q) {
      const std::vector<uint8_t> p = rank_payload(seed, q, bytes);
      want.insert(want.end(), p.begin(), p.end());
    }
    const std::string what = std::to_string(bytes) + " B";
    EXPECT_TRUE(nccl.status.is_ok()) << what << ": " << nccl.status.to_string();
    EXPECT_EQ(first_difference(nccl.got, want, bytes), "") << what << " (NCCL)";
    for (const GatherOut* g : {&out, &in_place, &odd}) {
      EXPECT_TRUE(g->status.is_ok()) << what << ": " << g->status.to_string();
      EXPECT_EQ(first_difference(g->got, nccl.got, bytes), "") << what << ": peer != NCCL";
      EXPECT_TRUE(g->guards_ok) << what << ": wrote outside recv";
    }
  }
  expect_error_word_clear("sizes");
}

TEST_F(MpiPeer, Graph1000BackToBackGathersAndMixedSizes) {
  DeviceScope scope(device());
  for (size_t bytes : {size_t{1001}, size_t{24} << 10}) {
    EXPECT_EQ(chain_of_gathers(peer(), bytes, 1000, 2, 9100 + bytes), "") << bytes << " B";
  }
  EXPECT_EQ(mixed_gathers(peer(), {512, 40968, 100003, 4096, 7}, 600, 1, 4242), "");
  expect_error_word_clear("graphs");
}

TEST_F(MpiPeer, CpDecodeEqualsPlainBitwise) {
  std::mt19937 rng(71);
  int seed = 2500;
  for (int Q : {1, 4}) {
    std::vector<int32_t> s = lengths(rng, 6, 100000, true);
    s[0] = 1;
    DecodeData d = random_decode(seed++, 4, Q, s, 100000);
    expect_cp_equals_plain(d, sel_of(16), "Q=" + std::to_string(Q), &peer());
  }
  expect_error_word_clear("cp_decode");
}

TEST_F(MpiPeer, CpDecodeGraphReplay1000WithChangingInputs) {
  const int reqs = 8, replays = 1000, check_every = 100, Q = 2;
  const int32_t bound = 1 << 16;
  std::mt19937 rng(62);
  DecodeData d = random_decode(2600, 4, Q, lengths(rng, reqs, bound, false), bound);
  replay_graph_and_check(peer(), *world().mpi, device(), d, sel_of(16), rng, bound, replays,
                         check_every);
  expect_error_word_clear("cp_decode graph");
}

// Rank 0 abandons its communicator and only then tells rank 1 so: if abandon_peer_communicator
// waited in the bootstrap's barrier, rank 0 would never send, and rank 1 joins that barrier after
// 30 s to release it (the test fails instead of hanging). Rank 1's next gather still stores into
// rank 0's buffer, which must stay mapped (no fault), and times out instead of hanging.
TEST_F(MpiPeer, AbandonWaitsForNoPeer) {
  constexpr int kTag = 7301;
  constexpr size_t kBytes = 4096;
  const int rank = world().rank;
  Status made;
  std::unique_ptr<Communicator> peer = cpidx::make_peer_communicator(
      *world().mpi, device(), kBytes, &made, /*timeout_seconds=*/0.25);
  EXPECT_TRUE(made.is_ok()) << made.to_string();  // the same verdict on every rank
  if (peer != nullptr) {
    DeviceScope scope(device());
    const GatherOut first = gather_once(*peer, rank_payload(31, rank, kBytes), false);
    EXPECT_TRUE(first.status.is_ok()) << first.status.to_string();
    if (rank == 0) {
      const Status released = cpidx::abandon_peer_communicator(&peer);
      EXPECT_TRUE(released.is_ok()) << released.to_string();
      int done = 1;
      MPI_Send(&done, 1, MPI_INT, 1, kTag, MPI_COMM_WORLD);
    } else if (rank == 1) {
      int done = 0, arrived = 0;
      MPI_Request request;
      MPI_Irecv(&done, 1, MPI_INT, 0, kTag, MPI_COMM_WORLD, &request);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!arrived && std::chrono::steady_clock::now() < deadline) {
        MPI_Test(&request, &arrived, MPI_STATUS_IGNORE);
        if (!arrived) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_TRUE(arrived) << "rank 0's abandon_peer_communicator waited for its peers";
      if (!arrived) {
        peer->barrier();  // the barrier rank 0 should not have entered: release it
        MPI_Wait(&request, MPI_STATUS_IGNORE);
      }
      DeviceVec<uint8_t> buf(2 * kBytes);
      cudaStream_t stream = nullptr;
      EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      const Status alone = peer->all_gather(buf.ptr + kBytes, buf.ptr, kBytes, stream);
      EXPECT_TRUE(alone.is_ok()) << alone.to_string();
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess)
          << "a store into rank 0's buffer faulted";
      EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
      int32_t word = 0;
      EXPECT_TRUE(cpidx::read_peer_error_flag(*peer, &word).is_ok());
      EXPECT_EQ(word & cpidx::kPeerErrorTimeout, cpidx::kPeerErrorTimeout);
    }
    if (peer != nullptr) {
      const Status released = cpidx::abandon_peer_communicator(&peer);
      EXPECT_TRUE(released.is_ok()) << released.to_string();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Ranks in separate processes that share GPU 0 (CUDA IPC maps a buffer of the same GPU into
// another process; the GPU time-slices the processes' contexts, so a gather that waits for the
// other rank's lines spins until that rank's slice comes: slow, but neither rank's kernels can
// hold the SMs the other needs). Runs with >= 2 ranks and >= 1 GPU.
class MpiPeerOnOneGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (world().size < 2 || device_count() < 1) {
      GTEST_SKIP() << "needs >= 2 ranks and a GPU; " << world().size << " ranks, "
                   << device_count() << " GPUs";
    }
  }
  // Whether `p` (this process's) still points into a device allocation.
  static bool allocated(const void* p) {
    cudaPointerAttributes attributes{};
    const cudaError_t e = cudaPointerGetAttributes(&attributes, p);
    if (e != cudaSuccess) cudaGetLastError();
    return e == cudaSuccess && attributes.type == cudaMemoryTypeDevice;
  }
};

// Ranks that share a GPU are refused unless allow_shared_gpu. Every rank destroys its
// communicator while rank 0 alone keeps an instantiated graph of a gather: no rank frees its
// buffer (rank 0's replays store into every peer's through its mappings), each told so through
// a word of its own buffer; rank 0's replay afterwards stores into them without a fault (and
// times out waiting for lines no peer sends). Seen through each rank's error word, which lives
// in its buffer: still allocated after the destruction. A control world destroyed with no graph
// frees them. (The GPU's free memory cannot tell: while a peer keeps its IPC mapping, CUDA keeps
// the memory of a buffer its owner freed.)
TEST_F(MpiPeerOnOneGpu, AGraphOnOneRankKeepsEveryRanksBuffers) {
  constexpr size_t kBytes = 4096;
  const int rank = world().rank, size = world().size;
  DeviceScope scope(0);
  Status st;
  std::unique_ptr<Communicator> mpi = cpidx::make_mpi_communicator(&st);
  EXPECT_TRUE(st.is_ok()) << st.to_string();  // the same verdict on every rank
  if (mpi == nullptr) return;

  // Refused without allow_shared_gpu, on every rank (bus ids compared across processes).
  std::unique_ptr<Communicator> peer = cpidx::make_peer_communicator(*mpi, 0, kBytes, &st, 0.25);
  EXPECT_EQ(peer, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("share GPU"), std::string::npos) << st.message();

  // Control: no graph, every rank frees.
  peer = cpidx::make_peer_communicator(*mpi, 0, kBytes, &st, 0.25, /*allow_shared_gpu=*/true);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (peer == nullptr) return;
  const int32_t* word = cpidx::peer_error_flag(*peer);
  EXPECT_TRUE(allocated(word));
  peer.reset();  // collective across processes
  EXPECT_FALSE(allocated(word)) << "the control world's buffer";

  peer = cpidx::make_peer_communicator(*mpi, 0, kBytes, &st, 0.25, /*allow_shared_gpu=*/true);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (peer == nullptr) return;
  word = cpidx::peer_error_flag(*peer);
  DeviceVec<uint8_t> buf(static_cast<size_t>(size) * kBytes);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  if (rank == 0) {
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_TRUE(peer->all_gather(buf.ptr, buf.ptr, kBytes, stream).is_ok());
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  EXPECT_EQ(cpidx::peer_gathers_in_live_graphs(*peer), rank == 0 ? 1 : 0)
      << "each process counts its own graphs";
  peer.reset();
  EXPECT_TRUE(allocated(word)) << "rank " << rank
                               << " freed its buffer while rank 0's graph held a gather";
  MPI_Barrier(MPI_COMM_WORLD);  // every rank destroyed its communicator
  if (exec != nullptr) {
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess) << "the replay's stores faulted";
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  MPI_Barrier(MPI_COMM_WORLD);
}

// cp_decode through the peer communicator across processes (CUDA IPC), keys through the device
// channel and through all_gather, eager and in 40 graph replays with changing inputs: each
// rank's owned heads equal the plain decode bitwise, and the error words stay clear.
TEST_F(MpiPeerOnOneGpu, CpDecodeEqualsPlainBitwise) {
  DeviceScope scope(0);
  Status st;
  std::unique_ptr<Communicator> mpi = cpidx::make_mpi_communicator(&st);
  EXPECT_TRUE(st.is_ok()) << st.to_string();  // the same verdict on every rank
  if (mpi == nullptr) return;
  std::unique_ptr<Communicator> peer =
      cpidx::make_peer_communicator(*mpi, 0, kPeerMaxBytes, &st, 5.0, /*allow_shared_gpu=*/true);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (peer == nullptr) return;
  std::mt19937 rng(72);
  int seed = 2700;
  for (bool fused : {true, false}) {
    for (int Q : {1, 4}) {
      std::vector<int32_t> s = lengths(rng, 6, 100000, true);
      s[0] = 1;
      DecodeData d = random_decode(seed++, 4, Q, s, 100000);
      const std::string what = "Q=" + std::to_string(Q) + (fused ? ", channel" : ", all_gather");
      const std::vector<int32_t> plain = plain_decode_on(0, d, sel_of(16));
      const RankResult res = cp_rank(*peer, 0, d, sel_of(16), -1, fused);
      expect_rank_matches(res, plain, d.rows(), 16, what);
    }
  }
  // Captured once, replayed with new lengths and tables (a check every 10 replays).
  const int32_t bound = 1 << 16;
  DecodeData d = random_decode(seed++, 4, 2, lengths(rng, 8, bound, false), bound);
  replay_graph_and_check(*peer, *mpi, 0, d, sel_of(16), rng, bound, 40, 10);
  int32_t word = -1;
  EXPECT_TRUE(cpidx::read_peer_error_flag(*peer, &word).is_ok());
  EXPECT_EQ(word, 0) << "peer error word";
  peer.reset();  // collective across processes
  MPI_Barrier(MPI_COMM_WORLD);
}

// Non-zero ranks print only failures, prefixed with their rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::printf("[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                r.line_number(), r.summary());
    std::fflush(stdout);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  set_up_world();
  const int rank = world().rank, size = world().size;
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = local_failed;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("[==========] MPI + NCCL world of %d ranks: %s\n", size,
                any_failed ? "FAILED on at least one rank" : "PASSED on every rank");
    std::fflush(stdout);
  }
  // Communicators go before MPI_Finalize (the peer and NCCL ones first: they use the MPI one;
  // the peer one's destructor is collective across processes).
  world().peer.reset();
  world().nccl.reset();
  world().mpi.reset();
  MPI_Finalize();
  return any_failed ? 1 : 0;
}
