// src/comm/mpi.cc: the MPI Communicator (one rank per process, host buffers). all_gather is one
// MPI_Allgather per GiB of each rank's bytes, check_agree one MPI_Allgather of a long long.
// Every MPI error on the duplicated communicator is returned as kCommError with MPI's own error
// string, never fatal; MPI_Comm_dup itself follows the parent's error handler (the caller's).
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cpidx/comm_mpi.h"

namespace cpidx {
namespace {

// MPI counts are int: larger gathers go in chunks of at most this many bytes per rank.
constexpr size_t kMaxChunkBytes = size_t{1} << 30;

Status comm_error(std::string message) {
  return Status(StatusCode::kCommError, std::move(message));
}

// kCommError "MPI_Allgather failed on rank 1 of 4: <MPI's text>" for a failed call.
Status mpi_check(int rc, const char* call, int rank, int world) {
  if (rc == MPI_SUCCESS) return Status::ok();
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "MPI error code %d", rc);
  }
  ::cpidx::detail::Message os;
  os << call << " failed";
  if (rank >= 0) os << " on rank " << rank << " of " << world;
  os << ": " << text;
  return comm_error(os.str());
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int world) : comm_(comm), rank_(rank), world_(world) {}

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }

  Status all_gather(const void* send, void* recv, size_t bytes_per_rank,
                    cudaStream_t /*stream*/) override {
    if (bytes_per_rank == 0) return Status::ok();
    CPIDX_CHECK(send != nullptr && recv != nullptr,
                "all_gather: send and recv must be non-null host pointers");
    auto* out = static_cast<char*>(recv);
    const auto* in = static_cast<const char*>(send);
    const bool in_place = in == out + static_cast<size_t>(rank_) * bytes_per_rank;
    // Rank i's chunk [off, off + len) lands at recv + i * bytes_per_rank + off: a contiguous
    // type of len bytes resized to an extent of bytes_per_rank places it there in one call.
    for (size_t off = 0; off < bytes_per_rank; off += kMaxChunkBytes) {
      const int len = static_cast<int>(std::min(kMaxChunkBytes, bytes_per_rank - off));
      MPI_Datatype chunk = MPI_DATATYPE_NULL, strided = MPI_DATATYPE_NULL;
      int rc = MPI_Type_contiguous(len, MPI_BYTE, &chunk);
      if (rc == MPI_SUCCESS) {
        rc = MPI_Type_create_resized(chunk, 0, static_cast<MPI_Aint>(bytes_per_rank), &strided);
      }
      if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&strided);
      if (rc == MPI_SUCCESS) {
        rc = MPI_Allgather(in_place ? MPI_IN_PLACE : in + off, len, MPI_BYTE, out + off, 1,
                           strided, comm_);
      }
      if (strided != MPI_DATATYPE_NULL) MPI_Type_free(&strided);
      if (chunk != MPI_DATATYPE_NULL) MPI_Type_free(&chunk);
      CPIDX_RETURN_IF_ERROR(mpi_check(rc, "MPI_Allgather", rank_, world_));
    }
    return Status::ok();
  }

  Status check_agree(long long value, const char* what) override {
    std::vector<long long> values(static_cast<size_t>(world_));
    CPIDX_RETURN_IF_ERROR(mpi_check(
        MPI_Allgather(&value, 1, MPI_LONG_LONG, values.data(), 1, MPI_LONG_LONG, comm_),
        "MPI_Allgather (check_agree)", rank_, world_));
    if (std::all_of(values.begin(), values.end(), [&](long long v) { return v == values[0]; })) {
      return Status::ok();
    }
    // Every rank saw the same values, so every rank returns the same message.
    ::cpidx::detail::Message os;
    os << "ranks disagree on " << (what ? what : "a value") << ":";
    constexpr int kShown = 16;
    for (int r = 0; r < world_ && r < kShown; ++r) {
      os << (r ? ", " : " ") << "rank " << r << " has " << values[static_cast<size_t>(r)];
    }
    if (world_ > kShown) os << ", ... (" << world_ << " ranks)";
    return comm_error(os.str());
  }

  Status barrier() override {
    return mpi_check(MPI_Barrier(comm_), "MPI_Barrier", rank_, world_);
  }

 private:
  MPI_Comm comm_;
  int rank_;
  int world_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(void* mpi_comm_handle, Status* status) {
  Status ignored;
  Status& st = status ? *status : ignored;
  st = Status::ok();
  if (mpi_comm_handle == nullptr) {
    st = invalid_argument("make_mpi_communicator: mpi_comm_handle must point to an MPI_Comm");
    return nullptr;
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    st = comm_error(finalized ? "make_mpi_communicator: MPI is already finalized"
                              : "make_mpi_communicator: MPI is not initialized (call MPI_Init)");
    return nullptr;
  }
  const MPI_Comm parent = *static_cast<const MPI_Comm*>(mpi_comm_handle);
  if (parent == MPI_COMM_NULL) {
    st = invalid_argument("make_mpi_communicator: the MPI_Comm is MPI_COMM_NULL");
    return nullptr;
  }
  MPI_Comm comm = MPI_COMM_NULL;
  st = mpi_check(MPI_Comm_dup(parent, &comm), "MPI_Comm_dup", -1, 0);
  if (!st.is_ok()) return nullptr;
  int rank = 0, world = 0;
  int rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(comm, &rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, &world);
  st = mpi_check(rc, "MPI communicator setup", -1, 0);
  if (!st.is_ok()) {
    MPI_Comm_free(&comm);
    return nullptr;
  }
  return std::make_unique<MpiCommunicator>(comm, rank, world);
}

std::unique_ptr<Communicator> make_mpi_communicator(Status* status) {
  MPI_Comm world = MPI_COMM_WORLD;
  return make_mpi_communicator(&world, status);
}

}  // namespace cpidx
