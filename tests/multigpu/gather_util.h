// All-gather test helpers shared by the single-process and the MPI multi-GPU suites: one rank's
// gather of known bytes through any device communicator (guard bytes around the result, in place
// or not, misaligned pointers), and two CUDA graphs of many gathers whose payloads change on every
// call: a chain of back-to-back gathers (the next call sends what the previous one received) and
// mixed sizes with in-place calls. Each rank computes every rank's payloads from seeds, so it
// checks its own results without any other exchange.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "gpu/gpu_util.h"

namespace cpidx_multigpu_test {

// `bytes` deterministic bytes from `seed` (SplitMix64).
inline std::vector<uint8_t> seeded_bytes(uint64_t seed, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (size_t i = 0; i < bytes; i += 8) {
    s += 0x9E3779B97F4A7C15ull;
    uint64_t z = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (size_t j = 0; j < 8 && i + j < bytes; ++j) v[i + j] = static_cast<uint8_t>(z >> (8 * j));
  }
  return v;
}

// Rank r's payload of a case: distinct per (case seed, rank).
inline std::vector<uint8_t> rank_payload(uint64_t seed, int rank, size_t bytes) {
  return seeded_bytes(seed * 131 + static_cast<uint64_t>(rank) * 7 + bytes, bytes);
}

struct GatherOut {
  cpidx::Status status;
  std::vector<uint8_t> got;  // [P * bytes]
  bool guards_ok = false;    // the bytes before and after the result are untouched
};

// One gather of `mine` through `comm` on the current device, eager on its own stream, then
// synchronised. recv sits `recv_offset` bytes into its allocation (send `send_offset`), so odd
// offsets test misaligned pointers; in place sends from recv + rank * bytes.
inline GatherOut gather_once(cpidx::Communicator& comm, const std::vector<uint8_t>& mine,
                             bool in_place, size_t send_offset = 0, size_t recv_offset = 0) {
  using cpidx_gpu_test::DeviceVec;
  constexpr size_t kGuard = 64;
  constexpr uint8_t kGuardByte = 0xEE;
  const size_t bytes = mine.size(), P = static_cast<size_t>(comm.world_size());
  const size_t r = static_cast<size_t>(comm.rank());
  GatherOut out;
  DeviceVec<uint8_t> recv(recv_offset + P * bytes + kGuard), send(send_offset + bytes);
  EXPECT_EQ(cudaMemset(recv.ptr, kGuardByte, recv.count), cudaSuccess);
  uint8_t* recv_at = recv.ptr + recv_offset;
  uint8_t* send_at = in_place ? recv_at + r * bytes : send.ptr + send_offset;
  EXPECT_EQ(cudaMemcpy(send_at, mine.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  // A pageable cudaMemcpy may return before its DMA lands; the gather runs on another stream.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  out.status = comm.all_gather(send_at, recv_at, bytes, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  const std::vector<uint8_t> all = recv.download();
  out.got.assign(all.begin() + static_cast<std::ptrdiff_t>(recv_offset),
                 all.begin() + static_cast<std::ptrdiff_t>(recv_offset + P * bytes));
  out.guards_ok = true;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i >= recv_offset && i < recv_offset + P * bytes) continue;
    out.guards_ok = out.guards_ok && all[i] == kGuardByte;
  }
  return out;
}

// "" when `got` equals `want`, else where they first differ.
inline std::string first_difference(const std::vector<uint8_t>& got,
                                    const std::vector<uint8_t>& want, size_t bytes_per_rank) {
  if (got.size() != want.size()) {
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    return "byte " + std::to_string(i % bytes_per_rank) + " of rank " +
           std::to_string(i / bytes_per_rank) + "'s slice: got " + std::to_string(got[i]) +
           ", want " + std::to_string(want[i]);
  }
  return {};
}

// Runs a graph captured on the current device: capture(stream) enqueues the work, then the graph
// is replayed `replays` times; before_replay(i) may enqueue stream-ordered set-up and
// after_replay(i) runs after the replay completed. Returns "" or what failed.
inline std::string run_graph(const std::function<cpidx::Status(cudaStream_t)>& capture, int replays,
                             const std::function<void(int, cudaStream_t)>& before_replay,
                             const std::function<std::string(int)>& after_replay) {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::string error;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    return "cudaStreamCreate failed";
  }
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    error = "cudaStreamBeginCapture failed";
  } else {
    const cpidx::Status st = capture(stream);
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (!st.is_ok())
      error = "capture: " + st.to_string();
    else if (end != cudaSuccess)
      error = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
    else if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
      error = "cudaGraphInstantiate failed";
  }
  for (int i = 0; i < replays && error.empty(); ++i) {
    before_replay(i, stream);
    if (cudaGraphLaunch(exec, stream) != cudaSuccess) error = "cudaGraphLaunch failed";
    const cudaError_t e = cudaStreamSynchronize(stream);
    if (error.empty() && e != cudaSuccess) error = std::string("replay: ") + cudaGetErrorString(e);
    if (error.empty()) error = after_replay(i);
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return error;
}

// `calls` back-to-back gathers of `bytes` in one graph with no other node: call 0 sends the
// replay's first payload, call i + 1 sends the slice of call i's result that came from rank
// (r + 1) % P, so every call moves new bytes. Each call's result is kept and checked against a
// host simulation from every rank's first payload. Replays start again from new first payloads
// (the device epochs keep counting). Returns "" or the first mismatch.
inline std::string chain_of_gathers(cpidx::Communicator& comm, size_t bytes, int calls, int replays,
                                    uint64_t seed) {
  using cpidx_gpu_test::DeviceVec;
  const int P = comm.world_size(), r = comm.rank();
  const size_t row = static_cast<size_t>(P) * bytes;
  DeviceVec<uint8_t> first(bytes), results(row * static_cast<size_t>(calls));
  auto first_of = [&](int replay, int rank) {
    return rank_payload(seed + static_cast<uint64_t>(replay) * 1000003, rank, bytes);
  };
  auto capture = [&](cudaStream_t stream) -> cpidx::Status {
    const uint8_t* send = first.ptr;
    for (int i = 0; i < calls; ++i) {
      uint8_t* recv = results.ptr + row * static_cast<size_t>(i);
      CPIDX_RETURN_IF_ERROR(comm.all_gather(send, recv, bytes, stream));
      send = recv + static_cast<size_t>((r + 1) % P) * bytes;
    }
    return cpidx::Status::ok();
  };
  auto before = [&](int replay, cudaStream_t stream) {
    // Pageable source: cudaMemcpyAsync has staged it before returning.
    const std::vector<uint8_t> host = first_of(replay, r);
    EXPECT_EQ(cudaMemcpyAsync(first.ptr, host.data(), bytes, cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(results.ptr, 0xA5, results.count, stream), cudaSuccess);
  };
  auto after = [&](int replay) -> std::string {
    const std::vector<uint8_t> got = results.download();
    std::vector<std::vector<uint8_t>> p(static_cast<size_t>(P));
    for (int q = 0; q < P; ++q) p[static_cast<size_t>(q)] = first_of(replay, q);
    std::vector<uint8_t> want(row);
    for (int i = 0; i < calls; ++i) {
      for (int q = 0; q < P; ++q) {
        std::copy(p[static_cast<size_t>(q)].begin(), p[static_cast<size_t>(q)].end(),
                  want.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(q) * bytes));
      }
      const std::vector<uint8_t> slice(got.begin() + static_cast<std::ptrdiff_t>(row * i),
                                       got.begin() + static_cast<std::ptrdiff_t>(row * (i + 1)));
      const std::string diff = first_difference(slice, want, bytes);
      if (!diff.empty()) {
        return "replay " + std::to_string(replay) + ", call " + std::to_string(i) + ": " + diff;
      }
      std::vector<std::vector<uint8_t>> next(static_cast<size_t>(P));
      for (int q = 0; q < P; ++q)
        next[static_cast<size_t>(q)] = p[static_cast<size_t>((q + 1) % P)];
      p.swap(next);
    }
    return {};
  };
  return run_graph(capture, replays, before, after);
}

// `calls` gathers cycling through `sizes` in one graph, every other one in place; each call's
// payload is copied in from a device pool first and its result copied out after (memcpy nodes),
// so sizes, grids and payloads change on every call. Returns "" or the first mismatch.
inline std::string mixed_gathers(cpidx::Communicator& comm, const std::vector<size_t>& sizes,
                                 int calls, int replays, uint64_t seed) {
  using cpidx_gpu_test::DeviceVec;
  const int P = comm.world_size(), r = comm.rank();
  std::vector<size_t> pool_at(static_cast<size_t>(calls) + 1, 0),
      result_at(static_cast<size_t>(calls) + 1, 0);
  size_t biggest = 0;
  for (int i = 0; i < calls; ++i) {
    const size_t s = sizes[static_cast<size_t>(i) % sizes.size()];
    biggest = std::max(biggest, s);
    pool_at[static_cast<size_t>(i) + 1] = pool_at[static_cast<size_t>(i)] + s;
    result_at[static_cast<size_t>(i) + 1] = result_at[static_cast<size_t>(i)] + s * P;
  }
  DeviceVec<uint8_t> pool(pool_at.back()), results(result_at.back()), send(biggest),
      work(biggest * static_cast<size_t>(P));
  auto payload_of = [&](int replay, int call, int rank) {
    const size_t s = sizes[static_cast<size_t>(call) % sizes.size()];
    return rank_payload(
        seed + static_cast<uint64_t>(replay) * 7919 + static_cast<uint64_t>(call) * 104729, rank,
        s);
  };
  auto capture = [&](cudaStream_t stream) -> cpidx::Status {
    for (int i = 0; i < calls; ++i) {
      const size_t s = sizes[static_cast<size_t>(i) % sizes.size()];
      const bool in_place = i % 2 == 1;
      uint8_t* src = in_place ? work.ptr + static_cast<size_t>(r) * s : send.ptr;
      if (cudaMemcpyAsync(src, pool.ptr + pool_at[static_cast<size_t>(i)], s,
                          cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
        return cpidx::Status(cpidx::StatusCode::kCudaError, "memcpy in");
      }
      CPIDX_RETURN_IF_ERROR(comm.all_gather(src, work.ptr, s, stream));
      if (cudaMemcpyAsync(results.ptr + result_at[static_cast<size_t>(i)], work.ptr, s * P,
                          cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
        return cpidx::Status(cpidx::StatusCode::kCudaError, "memcpy out");
      }
    }
    return cpidx::Status::ok();
  };
  std::vector<uint8_t> host_pool;
  auto before = [&](int replay, cudaStream_t stream) {
    host_pool.resize(pool.count);
    for (int i = 0; i < calls; ++i) {
      const std::vector<uint8_t> p = payload_of(replay, i, r);
      std::copy(p.begin(), p.end(),
                host_pool.begin() + static_cast<std::ptrdiff_t>(pool_at[static_cast<size_t>(i)]));
    }
    EXPECT_EQ(
        cudaMemcpyAsync(pool.ptr, host_pool.data(), pool.count, cudaMemcpyHostToDevice, stream),
        cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(results.ptr, 0x5A, results.count, stream), cudaSuccess);
  };
  auto after = [&](int replay) -> std::string {
    const std::vector<uint8_t> got = results.download();
    for (int i = 0; i < calls; ++i) {
      const size_t s = sizes[static_cast<size_t>(i) % sizes.size()];
      std::vector<uint8_t> want;
      for (int q = 0; q < P; ++q) {
        const std::vector<uint8_t> p = payload_of(replay, i, q);
        want.insert(want.end(), p.begin(), p.end());
      }
      const auto at = got.begin() + static_cast<std::ptrdiff_t>(result_at[static_cast<size_t>(i)]);
      const std::string diff = first_difference(
          std::vector<uint8_t>(at, at + static_cast<std::ptrdiff_t>(s * P)), want, s);
      if (!diff.empty()) {
        return "replay " + std::to_string(replay) + ", call " + std::to_string(i) + " (" +
               std::to_string(s) + " B" + (i % 2 ? ", in place" : "") + "): " + diff;
      }
    }
    return {};
  };
  return run_graph(capture, replays, before, after);
}

}  // namespace cpidx_multigpu_test
