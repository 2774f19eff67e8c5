// tests/mpi/test_mpi_calls.cc: what the MPI communicator asks of MPI, seen through MPI's
// profiling interface (each MPI_X below counts the call and forwards it to PMPI_X): one
// MPI_Allgather per GiB, MPI_IN_PLACE exactly when in place, derived types committed before use
// and freed after, errors returned on the duplicate and passed on as kCommError, the duplicate
// freed with the communicator, and MPI's state checked before anything is created. The wrappers
// change nothing unless a test arms a failure or a pretence, and every rank arms the same, so no
// rank is left waiting in a collective.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpidx/comm_mpi.h"
#include "mpi_util.h"
#include "test_util.h"

namespace {

// What the wrappers saw. Each rank runs its tests on one thread, so plain globals do.
struct Seen {
  int allgathers = 0;         // MPI_Allgather calls
  int in_place = 0;           // ... with MPI_IN_PLACE
  int uncommitted_types = 0;  // ... with a derived datatype not committed (or already freed)
  int fatal_handlers = 0;     // ... on a communicator whose errors are not returned
  int types_made = 0;         // MPI_Type_contiguous and MPI_Type_create_resized
  int types_freed = 0;        // MPI_Type_free
  int dups = 0;               // MPI_Comm_dup
  int frees = 0;              // MPI_Comm_free
};
Seen seen;
std::vector<MPI_Aint> recv_extents;  // each MPI_Allgather's recvtype extent, in call order
std::set<MPI_Datatype> committed;  // derived datatypes committed and not freed since
// Armed by a test: the next call fails with MPI_ERR_OTHER without reaching MPI.
bool fail_next_allgather = false, fail_next_barrier = false;
// Armed by a test: MPI_Initialized says no, or MPI_Finalized says yes.
bool pretend_uninitialized = false, pretend_finalized = false;

bool is_predefined(MPI_Datatype type) {
  int integers = 0, addresses = 0, types = 0, combiner = MPI_UNDEFINED;
  PMPI_Type_get_envelope(type, &integers, &addresses, &types, &combiner);
  return combiner == MPI_COMBINER_NAMED;
}

}  // namespace

// ---- The wrappers -------------------------------------------------------------------------------

int MPI_Allgather(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf,
                  int recvcount, MPI_Datatype recvtype, MPI_Comm comm) {
  ++seen.allgathers;
  seen.in_place += sendbuf == MPI_IN_PLACE;
  MPI_Aint lb = 0, extent = 0;
  PMPI_Type_get_extent(recvtype, &lb, &extent);
  recv_extents.push_back(extent);
  for (MPI_Datatype type : {sendtype, recvtype}) {
    seen.uncommitted_types += !is_predefined(type) && committed.count(type) == 0;
  }
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  PMPI_Comm_get_errhandler(comm, &handler);
  seen.fatal_handlers += handler != MPI_ERRORS_RETURN;
  PMPI_Errhandler_free(&handler);
  if (fail_next_allgather) {
    fail_next_allgather = false;
    return MPI_ERR_OTHER;
  }
  return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}

int MPI_Barrier(MPI_Comm comm) {
  if (fail_next_barrier) {
    fail_next_barrier = false;
    return MPI_ERR_OTHER;
  }
  return PMPI_Barrier(comm);
}

int MPI_Type_contiguous(int count, MPI_Datatype old, MPI_Datatype* type) {
  ++seen.types_made;
  return PMPI_Type_contiguous(count, old, type);
}

int MPI_Type_create_resized(MPI_Datatype old, MPI_Aint lb, MPI_Aint extent, MPI_Datatype* type) {
  ++seen.types_made;
  return PMPI_Type_create_resized(old, lb, extent, type);
}

int MPI_Type_commit(MPI_Datatype* type) {
  const int rc = PMPI_Type_commit(type);
  if (rc == MPI_SUCCESS) committed.insert(*type);
  return rc;
}

int MPI_Type_free(MPI_Datatype* type) {
  ++seen.types_freed;
  committed.erase(*type);
  return PMPI_Type_free(type);
}

int MPI_Comm_dup(MPI_Comm comm, MPI_Comm* dup) {
  ++seen.dups;
  return PMPI_Comm_dup(comm, dup);
}

int MPI_Comm_free(MPI_Comm* comm) {
  ++seen.frees;
  return PMPI_Comm_free(comm);
}

int MPI_Initialized(int* flag) {
  if (!pretend_uninitialized) return PMPI_Initialized(flag);
  *flag = 0;
  return MPI_SUCCESS;
}

int MPI_Finalized(int* flag) {
  if (!pretend_finalized) return PMPI_Finalized(flag);
  *flag = 1;
  return MPI_SUCCESS;
}

namespace {

using cpidx::Communicator;
using cpidx::Status;
using cpidx::StatusCode;

using cpidx_mpi_test::shared_fresh_seed;
using cpidx_mpi_test::world_comm;
using cpidx_mpi_test::world_rank;

// Rank `rank`'s bytes for a gather: a stream of its own from the shared seed, so every rank can
// tell what each other rank sent.
std::vector<unsigned char> rank_bytes(uint64_t seed, int rank, size_t bytes) {
  std::mt19937_64 rng(seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(rank + 1)));
  std::vector<unsigned char> out(bytes);
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t word = rng();
    std::memcpy(out.data() + i, &word, std::min<size_t>(8, bytes - i));
  }
  return out;
}

// Under 1 GiB per rank (here 1 to 2 MiB, fresh sizes and bytes) a gather is one MPI_Allgather,
// with MPI_IN_PLACE exactly when in place, on committed datatypes it frees, on a communicator
// whose errors are returned.
TEST(MpiCalls, OneAllgatherUnderAGiBInPlaceOrNot) {
  auto comm = world_comm();
  const int p = comm->world_size(), r = comm->rank();
  const uint64_t seed = shared_fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (bool in_place : {false, true}) {
    const size_t bytes = (size_t{1} << 20) + 1 + rng() % (size_t{1} << 20);
    const uint64_t round_seed = rng();
    std::vector<unsigned char> send = rank_bytes(round_seed, r, bytes);
    std::vector<unsigned char> recv(bytes * static_cast<size_t>(p));
    const unsigned char* src = send.data();
    if (in_place) {
      std::copy(send.begin(), send.end(), recv.begin() + static_cast<ptrdiff_t>(bytes * r));
      src = recv.data() + bytes * static_cast<size_t>(r);
    }
    const Seen before = seen;
    const Status s = comm->all_gather(src, recv.data(), bytes, nullptr);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    SCOPED_TRACE(std::string(in_place ? "in place" : "out of place") + ", " +
                 std::to_string(bytes) + " bytes per rank");
    EXPECT_EQ(seen.allgathers - before.allgathers, 1);
    EXPECT_EQ(seen.in_place - before.in_place, in_place ? 1 : 0);
    EXPECT_EQ(seen.uncommitted_types - before.uncommitted_types, 0);
    EXPECT_EQ(seen.fatal_handlers - before.fatal_handlers, 0);
    EXPECT_EQ(seen.types_made - before.types_made, seen.types_freed - before.types_freed)
        << "datatypes made and not freed";
    int wrong_ranks = 0;
    for (int src_rank = 0; src_rank < p; ++src_rank) {
      const std::vector<unsigned char> want = rank_bytes(round_seed, src_rank, bytes);
      wrong_ranks += !std::equal(want.begin(), want.end(),
                                 recv.begin() + static_cast<ptrdiff_t>(bytes * src_rank));
    }
    EXPECT_EQ(wrong_ranks, 0);
  }
}

// MemAvailable of this host (/proc/meminfo) in bytes; 0 where it cannot be read.
long long available_memory_bytes() {
  std::FILE* meminfo = std::fopen("/proc/meminfo", "r");
  if (meminfo == nullptr) return 0;
  char line[256];
  long long kib = 0;
  while (std::fgets(line, sizeof line, meminfo) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  }
  std::fclose(meminfo);
  return kib * 1024;
}

// Over 1 GiB per rank, the gather goes in chunks of at most 1 GiB (MPI counts are int), each an
// MPI_Allgather whose recvtype spans a whole rank's bytes, and each chunk lands at its own offset.
// On rank 0 alone, over MPI_COMM_SELF (1 GiB and a fresh few bytes, so the host needs little):
// fresh random bytes at both edges of both chunks and at random places in otherwise zero buffers
// (calloc: pages never written cost no memory). Skipped where less than 4 GiB is available.
TEST(MpiCalls, OverAGiBGoesInChunksEachAtItsOffset) {
  if (world_rank() != 0) return;
  const long long available = available_memory_bytes();
  if (available < (4ll << 30)) {
    GTEST_SKIP() << "needs 4 GiB available, has " << (available >> 20) << " MiB";
  }
  MPI_Comm self = MPI_COMM_SELF;
  Status status;
  std::unique_ptr<Communicator> comm = cpidx::make_mpi_communicator(&self, &status);
  ASSERT_TRUE(status.is_ok()) << status.to_string();  // one rank: no one waits
  const uint64_t seed = cpidx_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  constexpr size_t kGiB = size_t{1} << 30;
  const size_t bytes = kGiB + 1 + rng() % 4096;
  std::vector<size_t> marked = {0, 1, kGiB - 1, kGiB, kGiB + 1, bytes - 1};
  for (int i = 0; i < 8; ++i) marked.push_back(rng() % kGiB);
  for (int i = 0; i < 8; ++i) marked.push_back(kGiB + rng() % (bytes - kGiB));
  std::sort(marked.begin(), marked.end());
  marked.erase(std::unique(marked.begin(), marked.end()), marked.end());
  std::vector<unsigned char> value(marked.size());  // the nonzero byte at marked[i]
  for (auto& v : value) v = static_cast<unsigned char>(1 + rng() % 255);

  using Bytes = std::unique_ptr<unsigned char[], decltype(&std::free)>;
  Bytes send(static_cast<unsigned char*>(std::calloc(bytes, 1)), &std::free);
  Bytes recv(static_cast<unsigned char*>(std::calloc(bytes, 1)), &std::free);
  ASSERT_TRUE(send != nullptr && recv != nullptr);
  for (size_t i = 0; i < marked.size(); ++i) send[marked[i]] = value[i];
  const Seen before = seen;
  recv_extents.clear();
  const Status s = comm->all_gather(send.get(), recv.get(), bytes, nullptr);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(seen.allgathers - before.allgathers, 2) << bytes << " bytes: two chunks";
  EXPECT_EQ(recv_extents, std::vector<MPI_Aint>(2, static_cast<MPI_Aint>(bytes)));
  EXPECT_EQ(seen.types_made - before.types_made, seen.types_freed - before.types_freed);
  size_t wrong = 0;
  for (size_t i = 0; i < marked.size(); ++i) wrong += recv[marked[i]] != value[i];
  const auto zeros = static_cast<size_t>(std::count(recv.get(), recv.get() + bytes, 0));
  EXPECT_EQ(wrong, 0u) << "of " << marked.size() << " marked bytes";
  EXPECT_EQ(bytes - zeros, marked.size()) << "nonzero bytes: some landed elsewhere";
}

// An MPI error in any call comes back as kCommError naming the call and the rank, and the
// communicator stays usable.
TEST(MpiCalls, MpiErrorsComeBackAsCommErrors) {
  auto comm = world_comm();
  const std::string where = " failed on rank " + std::to_string(comm->rank()) + " of " +
                            std::to_string(comm->world_size());
  std::vector<char> send(8), recv(8 * static_cast<size_t>(comm->world_size()));
  fail_next_allgather = true;
  const Status gather = comm->all_gather(send.data(), recv.data(), send.size(), nullptr);
  fail_next_allgather = true;
  const Status agree = comm->check_agree(7, "n");
  fail_next_barrier = true;
  const Status barrier = comm->barrier();
  fail_next_allgather = fail_next_barrier = false;  // where a call was not made
  EXPECT_EQ(gather.code(), StatusCode::kCommError) << gather.to_string();
  EXPECT_NE(gather.message().find("MPI_Allgather" + where), std::string::npos)
      << gather.message();
  EXPECT_EQ(agree.code(), StatusCode::kCommError) << agree.to_string();
  EXPECT_NE(agree.message().find("MPI_Allgather (check_agree)" + where), std::string::npos)
      << agree.message();
  EXPECT_EQ(barrier.code(), StatusCode::kCommError) << barrier.to_string();
  EXPECT_NE(barrier.message().find("MPI_Barrier" + where), std::string::npos)
      << barrier.message();
  EXPECT_TRUE(comm->barrier().is_ok());
}

// The communicator duplicates the caller's MPI_Comm once and frees the duplicate when destroyed.
TEST(MpiCalls, TheDuplicateIsFreedWithTheCommunicator) {
  const Seen before = seen;
  auto comm = world_comm();
  EXPECT_EQ(seen.dups - before.dups, 1);
  EXPECT_EQ(seen.frees - before.frees, 0);
  comm.reset();
  EXPECT_EQ(seen.frees - before.frees, 1);
}

// Before MPI_Init or after MPI_Finalize there is no communicator, and nothing is duplicated.
TEST(MpiCalls, RefusedUnlessMpiIsInitializedAndNotFinalized) {
  const Seen before = seen;
  Status uninitialized, finalized;
  pretend_uninitialized = true;
  std::unique_ptr<Communicator> a = cpidx::make_mpi_communicator(&uninitialized);
  pretend_uninitialized = false;
  pretend_finalized = true;
  std::unique_ptr<Communicator> b = cpidx::make_mpi_communicator(&finalized);
  pretend_finalized = false;
  EXPECT_EQ(a, nullptr);
  EXPECT_EQ(uninitialized.code(), StatusCode::kCommError) << uninitialized.to_string();
  EXPECT_NE(uninitialized.message().find("not initialized"), std::string::npos)
      << uninitialized.message();
  EXPECT_EQ(b, nullptr);
  EXPECT_EQ(finalized.code(), StatusCode::kCommError) << finalized.to_string();
  EXPECT_NE(finalized.message().find("already finalized"), std::string::npos)
      << finalized.message();
  EXPECT_EQ(seen.dups - before.dups, 0);
}

}  // namespace
