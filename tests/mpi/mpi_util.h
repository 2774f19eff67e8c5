// Helpers shared by the MPI test files (one binary, run under mpirun): the world's rank and size,
// a communicator over MPI_COMM_WORLD, and a fresh seed every rank shares.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <memory>

#include "cpidx/comm_mpi.h"
#include "test_util.h"

namespace cpidx_mpi_test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

inline std::unique_ptr<cpidx::Communicator> world_comm() {
  cpidx::Status status;
  std::unique_ptr<cpidx::Communicator> comm = cpidx::make_mpi_communicator(&status);
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  return comm;
}

// A fresh seed for each run, the same on every rank (rank 0's). Collective.
inline uint64_t shared_fresh_seed() {
  uint64_t seed = cpidx_test::fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

}  // namespace cpidx_mpi_test
