// tests/mpi/test_mpi_cp.cc: the MPI communicator and the context-parallel decode over MPI
// processes (ctest runs it with mpirun -np 2 and -np 4). Every rank checks its own heads against
// the plain decode, exactly; failures print on every rank, and the exit code is global.
//
// Rule for these tests: no ASSERT or early return before a collective, so a failure on one rank
// never leaves the others waiting in a collective.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpidx/comm_mpi.h"
#include "cpidx/contract.h"
#include "cpidx/reference.h"
#include "mpi_util.h"
#include "test_util.h"

namespace {

using cpidx::Communicator;
using cpidx::DType;
using cpidx::Geometry;
using cpidx::Selection;
using cpidx::Status;
using cpidx::StatusCode;
using cpidx_test::DecodeData;
using cpidx_test::IdsBuffer;
using cpidx_test::Values;

using cpidx_mpi_test::shared_fresh_seed;
using cpidx_mpi_test::world_comm;
using cpidx_mpi_test::world_rank;
using cpidx_mpi_test::world_size;

// FNV-1a of the bytes: ranks compare it to prove they generated identical inputs.
uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 0xCBF29CE484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}
long long input_hash(const DecodeData& d) {
  uint64_t h = fnv1a(d.query.data(), d.query.size() * 2);
  h = fnv1a(d.cache_bf16.data(), d.cache_bf16.size() * 2, h);
  h = fnv1a(d.cache_fp8.data(), d.cache_fp8.size(), h);
  h = fnv1a(d.block_table.data(), d.block_table.size() * 4, h);
  h = fnv1a(d.seq_lens.data(), d.seq_lens.size() * 4, h);
  return static_cast<long long>(h >> 1);
}

// ---- The communicator --------------------------------------------------------------------

TEST(MpiComm, RankAndSizeMatchTheWorld) {
  auto comm = world_comm();
  EXPECT_EQ(comm->rank(), world_rank());
  EXPECT_EQ(comm->world_size(), world_size());
  EXPECT_EQ(comm->memory_space(), cpidx::MemorySpace::kHost);
  EXPECT_TRUE(comm->barrier().is_ok());
}

TEST(MpiComm, AllGatherPlacesEachRankAtItsOffset) {
  auto comm = world_comm();
  const int p = comm->world_size(), r = comm->rank();
  for (size_t bytes : {size_t{1}, size_t{7}, size_t{4099}}) {
    std::vector<unsigned char> send(bytes), recv(bytes * p, 0xEE);
    for (size_t i = 0; i < bytes; ++i) send[i] = static_cast<unsigned char>(r * 31 + i * 7);
    Status s = comm->all_gather(send.data(), recv.data(), bytes, nullptr);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    size_t wrong = 0;
    for (int src = 0; src < p; ++src) {
      for (size_t i = 0; i < bytes; ++i) {
        wrong += recv[src * bytes + i] != static_cast<unsigned char>(src * 31 + i * 7);
      }
    }
    EXPECT_EQ(wrong, 0u) << "of " << bytes * p << " bytes gathered (" << bytes << " per rank)";
  }
}

TEST(MpiComm, AllGatherInPlace) {
  auto comm = world_comm();
  const int p = comm->world_size(), r = comm->rank();
  const size_t count = 1000;
  std::vector<int64_t> buf(count * p, -1);
  for (size_t i = 0; i < count; ++i) buf[r * count + i] = r * 1000000 + static_cast<int64_t>(i);
  Status s = comm->all_gather(buf.data() + r * count, buf.data(), count * sizeof(int64_t), nullptr);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  size_t wrong = 0;
  for (int src = 0; src < p; ++src) {
    for (size_t i = 0; i < count; ++i) {
      wrong += buf[src * count + i] != src * 1000000 + static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(wrong, 0u);
  // Zero bytes is a no-op on every rank.
  EXPECT_TRUE(comm->all_gather(nullptr, nullptr, 0, nullptr).is_ok());
}

TEST(MpiComm, CheckAgreeAcceptsEqualValues) {
  auto comm = world_comm();
  Status s = comm->check_agree(42, "batch rows");
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(MpiComm, CheckAgreeFailsOnEveryRankNamingWhatAndValues) {
  auto comm = world_comm();
  if (comm->world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const long long mine = 100 + comm->rank();
  Status s = comm->check_agree(mine, "batch rows");
  EXPECT_EQ(s.code(), StatusCode::kCommError) << s.to_string();
  EXPECT_NE(s.message().find("batch rows"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("100"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("101"), std::string::npos) << s.message();
  // The ranks are still in step: the next collective completes.
  EXPECT_TRUE(comm->barrier().is_ok());
  EXPECT_TRUE(comm->check_agree(7, "after a disagreement").is_ok());
}

TEST(MpiComm, RejectsNullHandle) {
  Status status;
  auto comm = cpidx::make_mpi_communicator(nullptr, &status);
  EXPECT_EQ(comm, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
}

// Null buffers with bytes to send are refused before the collective, with kInvalidArgument (every
// rank makes the mistake here: MPI refuses it on that rank alone, leaving the others waiting).
TEST(MpiComm, AllGatherRefusesNullBuffers) {
  auto comm = world_comm();
  std::vector<char> send(8), recv(8 * comm->world_size());
  const Status null_send = comm->all_gather(nullptr, recv.data(), send.size(), nullptr);
  const Status null_recv = comm->all_gather(send.data(), nullptr, send.size(), nullptr);
  EXPECT_EQ(null_send.code(), StatusCode::kInvalidArgument) << null_send.to_string();
  EXPECT_EQ(null_recv.code(), StatusCode::kInvalidArgument) << null_recv.to_string();
  EXPECT_TRUE(comm->barrier().is_ok());
}

// The disagreement lists every rank's value once, in rank order (fresh values), under the name
// given or "a value" without one.
TEST(MpiComm, CheckAgreeMessageListsEachRanksValue) {
  auto comm = world_comm();
  const int p = comm->world_size();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  const uint64_t seed = shared_fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<long long> values(static_cast<size_t>(p));
  for (auto& v : values) v = static_cast<long long>(rng());
  values[1] = values[0] ^ 1;  // at least two differ
  std::string by_rank;
  for (int r = 0; r < p; ++r) {
    by_rank += std::string(r ? ", " : " ") + "rank " + std::to_string(r) + " has " +
               std::to_string(values[static_cast<size_t>(r)]);
  }
  const long long mine = values[static_cast<size_t>(comm->rank())];
  const Status named = comm->check_agree(mine, "batch rows");
  const Status unnamed = comm->check_agree(mine, nullptr);
  EXPECT_EQ(named.code(), StatusCode::kCommError) << named.to_string();
  EXPECT_EQ(named.message(), "ranks disagree on batch rows:" + by_rank);
  EXPECT_EQ(unnamed.code(), StatusCode::kCommError) << unnamed.to_string();
  EXPECT_EQ(unnamed.message(), "ranks disagree on a value:" + by_rank);
}

// No rank leaves barrier() before every rank has entered it: each rank raises its own counter in
// a shared-memory window before each barrier and finds every counter raised after it. The ranks
// sharing this host's memory form the communicator under test.
TEST(MpiComm, BarrierWaitsForEveryRank) {
  MPI_Comm node = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank(), MPI_INFO_NULL,
                                &node),
            MPI_SUCCESS);
  Status status;
  std::unique_ptr<Communicator> comm = cpidx::make_mpi_communicator(&node, &status);
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  const int p = comm->world_size();
  int64_t* mine = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  MPI_Win_allocate_shared(sizeof(int64_t), sizeof(int64_t), MPI_INFO_NULL, node, &mine, &win);
  std::vector<int64_t*> counters(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    MPI_Aint size = 0;
    int unit = 0;
    MPI_Win_shared_query(win, r, &size, &unit, &counters[static_cast<size_t>(r)]);
  }
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
  std::atomic_ref<int64_t>(*mine).store(0);
  MPI_Win_sync(win);
  MPI_Barrier(node);
  int early = 0;
  for (int round = 1; round <= 200; ++round) {
    std::atomic_ref<int64_t>(*mine).store(round);
    MPI_Win_sync(win);
    const Status s = comm->barrier();
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    MPI_Win_sync(win);
    for (int64_t* counter : counters) early += std::atomic_ref<int64_t>(*counter).load() < round;
  }
  MPI_Win_unlock_all(win);
  MPI_Win_free(&win);
  comm.reset();
  MPI_Comm_free(&node);
  EXPECT_EQ(early, 0) << "rank " << world_rank() << " left a barrier before every rank entered it";
}

// MPI_COMM_NULL is refused by name, before MPI is asked to duplicate it.
TEST(MpiComm, RejectsMpiCommNull) {
  MPI_Comm null_comm = MPI_COMM_NULL;
  Status status;
  auto comm = cpidx::make_mpi_communicator(&null_comm, &status);
  EXPECT_EQ(comm, nullptr);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
  EXPECT_NE(status.message().find("MPI_COMM_NULL"), std::string::npos) << status.message();
}

// ---- Context-parallel decode over MPI ---------------------------------------------------------

struct CpCase {
  int total_heads;
  int query_len;
  DType dtype;
  Values values;
  Selection sel;
  uint64_t seed;
};

std::string case_name(const testing::TestParamInfo<CpCase>& info) {
  const CpCase& c = info.param;
  return "T" + std::to_string(c.total_heads) + "_Q" + std::to_string(c.query_len) + "_" +
         (c.dtype == DType::kBF16 ? "bf16" : "fp8") + "_" +
         (c.values == Values::kTies ? "ties" : "random") + "_K" + std::to_string(c.sel.topk) +
         "_init" + std::to_string(c.sel.init_blocks) + "_local" +
         std::to_string(c.sel.local_blocks);
}

// Padding (0), shorter than Q (1, 2, 3), a block edge (128, 129), long, and the maximum.
const std::vector<int32_t> kSeqLens = {1000, 0, 2, 129, 4096, 1, 128, 3, 2500};
constexpr int32_t kMaxSeqLen = 4096;

// Runs one rank's context-parallel decode and checks it against the plain decode of the same
// heads. Every rank makes the same collective calls whatever happens.
void check_cp_decode_on_comm(Communicator& comm, const CpCase& c) {
  Geometry geo;
  Status gs = cpidx::make_geometry(c.total_heads, comm.world_size(), comm.rank(), &geo);
  if (!gs.is_ok()) GTEST_SKIP() << gs.to_string();  // same verdict on every rank
  const DecodeData d =
      cpidx_test::random_decode(c.seed, c.total_heads, c.query_len, kSeqLens, kMaxSeqLen,
                                c.dtype, c.values);
  Status agree = comm.check_agree(input_hash(d), "hash of the generated inputs");
  EXPECT_TRUE(agree.is_ok()) << agree.to_string();

  const int64_t n = d.rows();
  IdsBuffer cp(geo.local_heads, n, c.sel.topk);
  int32_t cp_err = 0;
  cpidx::ref::CpStageTimes times;
  Status s = cpidx::ref::cp_decode(comm, geo, d.inputs(geo.head_offset, geo.local_heads), c.sel,
                                   cp.out(), nullptr, &cp_err, &times);
  EXPECT_TRUE(s.is_ok()) << "rank " << comm.rank() << ": " << s.to_string();
  EXPECT_EQ(cp_err, 0);
  EXPECT_FALSE(cp.any_poison()) << "cp_decode left ids unwritten";

  IdsBuffer plain(geo.local_heads, n, c.sel.topk);
  int32_t plain_err = 0;
  Status ps = cpidx::ref::decode_topk(d.inputs(geo.head_offset, geo.local_heads), c.sel,
                                      plain.out(), nullptr, &plain_err);
  EXPECT_TRUE(ps.is_ok()) << ps.to_string();
  EXPECT_EQ(plain_err, 0);

  int mismatches = 0;
  for (int h = 0; h < geo.local_heads && mismatches < 3; ++h) {
    for (int64_t row = 0; row < n && mismatches < 3; ++row) {
      const int32_t* got = cp.row(h, row);
      const int32_t* want = plain.row(h, row);
      if (!std::equal(got, got + c.sel.topk, want)) {
        ++mismatches;
        std::string g, w;
        for (int k = 0; k < c.sel.topk; ++k) {
          g += " " + std::to_string(got[k]);
          w += " " + std::to_string(want[k]);
        }
        ADD_FAILURE() << "rank " << comm.rank() << " head " << geo.head_offset + h << " row "
                      << row << "\n  context-parallel:" << g << "\n  plain:           " << w;
      }
    }
  }

  // Replicas of a head produce identical ids: compare with every rank holding the same head.
  std::vector<int32_t> all(cp.ids.size() * comm.world_size());
  Status gather = comm.all_gather(cp.ids.data(), all.data(), cp.ids.size() * sizeof(int32_t),
                                  nullptr);
  EXPECT_TRUE(gather.is_ok()) << gather.to_string();
  for (int other = 0; other < comm.world_size(); ++other) {
    if (other / geo.replicas != comm.rank() / geo.replicas) continue;
    EXPECT_TRUE(std::equal(cp.ids.begin(), cp.ids.end(), all.begin() + other * cp.ids.size()))
        << "rank " << comm.rank() << " and its replica rank " << other << " differ";
  }
}

class MpiCpDecode : public testing::TestWithParam<CpCase> {};

TEST_P(MpiCpDecode, EveryRankMatchesPlainDecodeOfItsHeads) {
  auto comm = world_comm();
  check_cp_decode_on_comm(*comm, GetParam());
}

Selection sel(int topk, int init, int local) {
  Selection s;
  s.topk = topk;
  s.init_blocks = init;
  s.local_blocks = local;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MpiCpDecode,
    testing::Values(
        // The M3 setting: T = 4 (sharded) and T = 1 (replicated), Q = 1 and 4.
        CpCase{4, 1, DType::kBF16, Values::kRandom, sel(16, 0, 1), 11},
        CpCase{4, 4, DType::kBF16, Values::kRandom, sel(16, 0, 1), 12},
        CpCase{1, 1, DType::kBF16, Values::kRandom, sel(16, 0, 1), 13},
        CpCase{1, 4, DType::kBF16, Values::kRandom, sel(16, 0, 1), 14},
        // Many equal scores: the order of ties (higher block id first) must survive the merge.
        CpCase{4, 1, DType::kBF16, Values::kTies, sel(16, 0, 1), 21},
        CpCase{4, 4, DType::kBF16, Values::kTies, sel(16, 0, 1), 22},
        CpCase{1, 1, DType::kBF16, Values::kTies, sel(16, 0, 1), 23},
        CpCase{1, 4, DType::kBF16, Values::kTies, sel(16, 0, 1), 24},
        // fp8 cache, other forced-block settings, other head counts and K.
        CpCase{4, 4, DType::kFP8E4M3, Values::kRandom, sel(8, 1, 2), 31},
        CpCase{1, 4, DType::kFP8E4M3, Values::kTies, sel(8, 1, 2), 32},
        CpCase{2, 2, DType::kBF16, Values::kRandom, sel(16, 2, 1), 33},
        CpCase{8, 1, DType::kBF16, Values::kTies, sel(64, 0, 0), 34},
        CpCase{4, 8, DType::kBF16, Values::kRandom, sel(1, 0, 0), 35}),
    case_name);

// The caller's own MPI_Comm (here half of the world) works the same; it is duplicated, so the
// caller may free its handle while the cpidx communicator lives on.
TEST(MpiCommHandle, ContextParallelDecodeOnASplitCommunicator) {
  MPI_Comm half = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &half), MPI_SUCCESS);
  Status status;
  std::unique_ptr<Communicator> comm = cpidx::make_mpi_communicator(&half, &status);
  MPI_Comm_free(&half);
  ASSERT_TRUE(status.is_ok()) << status.to_string();  // collective creation succeeded everywhere
  EXPECT_EQ(comm->world_size(), (world_size() + 1 - world_rank() % 2) / 2);
  EXPECT_EQ(comm->rank(), world_rank() / 2);
  check_cp_decode_on_comm(*comm, CpCase{1, 2, DType::kBF16, Values::kRandom, sel(16, 1, 1), 41});
}

// ---- Disagreement and bad input: an error on every rank, never a hang --------------------------

TEST(MpiCpDecodeErrors, RanksWithDifferentBatchSizesFailOnEveryRank) {
  auto comm = world_comm();
  if (comm->world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Geometry geo;
  ASSERT_TRUE(cpidx::make_geometry(4, comm->world_size(), comm->rank(), &geo).is_ok());
  // Rank r sees 3 + r % 2 requests: n differs between neighbours.
  std::vector<int32_t> lens = {300, 0, 129};
  if (comm->rank() % 2) lens.push_back(77);
  const DecodeData d = cpidx_test::random_decode(51, 4, 1, lens, 512);
  IdsBuffer ids(geo.local_heads, d.rows(), 16);
  int32_t err = 0;
  Status s = cpidx::ref::cp_decode(*comm, geo, d.inputs(geo.head_offset, geo.local_heads),
                                   sel(16, 0, 1), ids.out(), nullptr, &err);
  EXPECT_EQ(s.code(), StatusCode::kCommError) << "rank " << comm->rank() << ": " << s.to_string();
  EXPECT_NE(s.message().find("disagree"), std::string::npos) << s.message();
  EXPECT_TRUE(ids.all_poison()) << "a failed call must not write ids";
  EXPECT_TRUE(comm->barrier().is_ok());  // still in step
}

TEST(MpiCpDecodeErrors, RanksWithDifferentTopkFailOnEveryRank) {
  auto comm = world_comm();
  if (comm->world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Geometry geo;
  ASSERT_TRUE(cpidx::make_geometry(1, comm->world_size(), comm->rank(), &geo).is_ok());
  const DecodeData d = cpidx_test::random_decode(52, 1, 1, {300, 129}, 512);
  const int topk = comm->rank() == 0 ? 8 : 16;
  IdsBuffer ids(geo.local_heads, d.rows(), topk);
  int32_t err = 0;
  Status s = cpidx::ref::cp_decode(*comm, geo, d.inputs(geo.head_offset, geo.local_heads),
                                   sel(topk, 0, 1), ids.out(), nullptr, &err);
  EXPECT_EQ(s.code(), StatusCode::kCommError) << "rank " << comm->rank() << ": " << s.to_string();
  EXPECT_NE(s.message().find("topk"), std::string::npos) << s.message();
  EXPECT_TRUE(comm->barrier().is_ok());
}

TEST(MpiCpDecodeErrors, BadInputOnOneRankFailsEveryRank) {
  auto comm = world_comm();
  if (comm->world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Geometry geo;
  ASSERT_TRUE(cpidx::make_geometry(4, comm->world_size(), comm->rank(), &geo).is_ok());
  const DecodeData d = cpidx_test::random_decode(53, 4, 2, {300, 129, 5}, 512);
  cpidx::DecodeInputs in = d.inputs(geo.head_offset, geo.local_heads);
  if (comm->rank() == 1) in.scale = -1.0f;  // rejected by validation on rank 1 only
  IdsBuffer ids(geo.local_heads, d.rows(), 16);
  int32_t err = 0;
  Status s = cpidx::ref::cp_decode(*comm, geo, in, sel(16, 0, 1), ids.out(), nullptr, &err);
  if (comm->rank() == 1) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("scale"), std::string::npos) << s.message();
  } else {
    EXPECT_EQ(s.code(), StatusCode::kCommError) << "rank " << comm->rank() << ": " << s.to_string();
  }
  EXPECT_TRUE(comm->barrier().is_ok());
}

// ---- main: MPI around GoogleTest --------------------------------------------------------------

// On ranks other than 0, gtest's printer is replaced by this one: failures only, prefixed.
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::printf("[rank %d] %s:%d: Failure\n%s\n", rank_,
                result.file_name() ? result.file_name() : "?", result.line_number(),
                result.summary());
    std::fflush(stdout);
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::printf("[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(), info.name());
      std::fflush(stdout);
    }
  }

 private:
  int rank_;
};

}  // namespace

// Under the asan preset: Open MPI keeps allocations until exit, many in plugins it has already
// unloaded (so no suppression can name them). Leaks of cpidx itself are covered by the CPU suites.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  const int rank = world_rank(), size = world_size();
  testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();

  // Closing lines: one per process (rank order), then the verdict over all ranks on rank 0.
  int any_failed = local_failed;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      std::printf("[rank %d of %d] %s: %d tests passed, %d failed, %d skipped\n", rank, size,
                  local_failed ? "FAILED" : "PASSED", unit.successful_test_count(),
                  unit.failed_test_count(), unit.skipped_test_count());
      std::fflush(stdout);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0) {
    std::printf("[==========] MPI world of %d ranks: %s\n", size,
                any_failed ? "FAILED on at least one rank" : "PASSED on every rank");
    std::fflush(stdout);
  }
  MPI_Finalize();
  return any_failed ? 1 : 0;
}
