// Multi-GPU test helpers shared by the single-process (one thread per GPU) and the MPI (one
// process per GPU) suites: one rank's cp_decode on its own GPU through a device communicator,
// the plain GPU decode on a chosen GPU, a rank's cp_decode captured in a CUDA graph for replays
// with changing inputs, and the bitwise comparison of a rank's owned heads with the plain ids.
//
// Rule for every caller: no ASSERT or early return before a collective, so a failure on one rank
// never leaves its peers waiting (the helpers below follow it too).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/indexer.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace cpidx_multigpu_test {

using cpidx::Communicator;
using cpidx::Selection;
using cpidx::Status;
using cpidx_gpu_test::config_for;
using cpidx_gpu_test::DeviceBatch;
using cpidx_gpu_test::DeviceVec;
using cpidx_test::DecodeData;

inline int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// Makes `device` current for the scope, then restores the previous device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&prev_);
    cudaSetDevice(device);
  }
  ~DeviceScope() { cudaSetDevice(prev_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
};

using cpidx_test::lengths;
using cpidx_test::sel_of;

// The plain GPU decode of every head on `device`: ids [T][n][K] (host copy).
inline std::vector<int32_t> plain_decode_on(int device, const DecodeData& d, const Selection& sel) {
  DeviceScope scope(device);
  return cpidx_gpu_test::gpu_decode(d, sel, nullptr, device);
}

struct RankResult {
  Status status;
  cpidx::Geometry geo;
  int64_t rows = 0;
  std::vector<int32_t> ids;  // [L][rows][K]
};

// One rank's cp_decode of `d` on `device` through `comm` (eager, then synchronised). With
// `num_reqs` >= 0 the rank claims that many requests instead (to test disagreeing ranks).
inline RankResult cp_rank(Communicator& comm, int device, const DecodeData& d,
                          const Selection& sel, int num_reqs = -1, bool fused_exchange = true) {
  RankResult res;
  DeviceScope scope(device);
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  cpidx::DecodeConfig cfg = config_for(d, sel, comm.world_size(), comm.rank());
  cfg.fused_exchange = fused_exchange;
  res.status = cpidx::Decoder::create(cfg, device, &dec);
  if (!res.status.is_ok()) {
    comm.check_agree(-1, cpidx::kCpRowsAgreement);  // the peers fail instead of waiting for it
    return res;
  }
  res.geo = dec->geometry();
  cpidx::DecodeInputs in = b.inputs(res.geo.head_offset, res.geo.local_heads);
  if (num_reqs >= 0) in.num_reqs = num_reqs;
  res.rows = in.num_rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(res.geo.local_heads * res.rows * sel.topk));
  ids.poison();
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  res.status = dec->cp_decode(comm, in, cpidx::TopkOutput{ids.ptr, res.rows * sel.topk, sel.topk},
                              nullptr, stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  res.ids = ids.download();
  return res;
}

// A rank's ids [L][n][K] must equal the plain ids [T][n][K] of its owned heads, bitwise.
inline void expect_owned_heads_equal(const cpidx::Geometry& geo, const std::vector<int32_t>& ids,
                                     const std::vector<int32_t>& plain, int64_t n, int topk,
                                     const std::string& what) {
  const size_t per_head = static_cast<size_t>(n * topk);
  ASSERT_EQ(ids.size(), per_head * geo.local_heads) << what;
  ASSERT_GE(plain.size(), per_head * (geo.head_offset + geo.local_heads)) << what;
  for (int j = 0; j < geo.local_heads; ++j) {
    const int32_t* got = ids.data() + per_head * j;
    const int32_t* want = plain.data() + per_head * (geo.head_offset + j);
    for (size_t i = 0; i < per_head; ++i) {
      if (got[i] == want[i]) continue;
      ADD_FAILURE() << what << ": rank " << geo.rank << ", head " << geo.head_offset + j
                    << ", row " << i / topk << ", slot " << i % topk << ": context-parallel id "
                    << got[i] << ", plain id " << want[i];
      return;
    }
  }
}

inline void expect_rank_matches(const RankResult& r, const std::vector<int32_t>& plain,
                                int64_t n, int topk, const std::string& what) {
  EXPECT_TRUE(r.status.is_ok()) << what << ": rank " << r.geo.rank << ": " << r.status.to_string();
  if (r.status.is_ok()) expect_owned_heads_equal(r.geo, r.ids, plain, n, topk, what);
}

// A rank's cp_decode captured once in a CUDA graph on its own stream. Replays re-read the device
// seq_lens and block table, so set_inputs() between replays changes the step. Construction makes
// no collective call; warm_up() and capture() are collective (every rank calls them, each from
// its own thread or process).
class GraphRank {
 public:
  GraphRank(Communicator& comm, int device, const DecodeData& d, const Selection& sel,
            bool fused_exchange = true)
      : comm_(comm), device_(device), sel_(sel) {
    DeviceScope scope(device);
    batch_ = std::make_unique<DeviceBatch>(d);
    cpidx::DecodeConfig cfg = config_for(d, sel, comm.world_size(), comm.rank());
    cfg.fused_exchange = fused_exchange;
    status_ = cpidx::Decoder::create(cfg, device, &dec_);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    if (!status_.is_ok()) return;
    geo_ = dec_->geometry();
    rows_ = d.rows();
    ids_ = std::make_unique<DeviceVec<int32_t>>(
        static_cast<size_t>(geo_.local_heads * rows_ * sel.topk));
  }
  ~GraphRank() {
    DeviceScope scope(device_);
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  GraphRank(const GraphRank&) = delete;
  GraphRank& operator=(const GraphRank&) = delete;

  // Eager steps: NCCL connects its channels on first use, which must not happen mid-capture.
  Status warm_up(int steps = 2) {
    DeviceScope scope(device_);
    for (int i = 0; i < steps; ++i) {
      Status st = step();
      if (!st.is_ok()) return st;
    }
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return Status::ok();
  }

  Status capture() {
    DeviceScope scope(device_);
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      comm_.check_agree(-1, cpidx::kCpRowsAgreement);
      return Status(cpidx::StatusCode::kCudaError, "cudaStreamBeginCapture failed");
    }
    Status st = step();
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph_);
    if (!st.is_ok()) return st;
    if (end != cudaSuccess) return Status(cpidx::StatusCode::kCudaError, "cudaStreamEndCapture");
    if (cudaGraphInstantiate(&exec_, graph_, 0) != cudaSuccess) {
      return Status(cpidx::StatusCode::kCudaError, "cudaGraphInstantiate failed");
    }
    return Status::ok();
  }

  // Stream-ordered copies of h's seq_lens and block table (same shapes as at construction).
  void set_inputs(const DecodeData& h) {
    DeviceScope scope(device_);
    EXPECT_EQ(cudaMemcpyAsync(batch_->seq_lens.ptr, h.seq_lens.data(), h.seq_lens.size() * 4,
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(batch_->block_table.ptr, h.block_table.data(),
                              h.block_table.size() * 4, cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
  }
  void poison_ids() {
    DeviceScope scope(device_);
    if (ids_) {
      EXPECT_EQ(cudaMemsetAsync(ids_->ptr, 0x7B, ids_->count * 4, stream_), cudaSuccess);
    }
  }
  void launch() {
    DeviceScope scope(device_);
    if (exec_ != nullptr) {
      EXPECT_EQ(cudaGraphLaunch(exec_, stream_), cudaSuccess);
    }
  }
  void sync() { EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }
  std::vector<int32_t> ids() {
    DeviceScope scope(device_);
    return ids_ ? ids_->download() : std::vector<int32_t>();
  }

  const Status& status() const { return status_; }
  const cpidx::Geometry& geometry() const { return geo_; }
  int64_t rows() const { return rows_; }
  bool captured() const { return exec_ != nullptr; }

 private:
  // One cp_decode on stream_ (or, without a decoder, the agreement the peers wait for).
  Status step() {
    if (!status_.is_ok()) {
      comm_.check_agree(-1, cpidx::kCpRowsAgreement);
      return status_;
    }
    return dec_->cp_decode(
        comm_, batch_->inputs(geo_.head_offset, geo_.local_heads),
        cpidx::TopkOutput{ids_->ptr, rows_ * sel_.topk, sel_.topk}, nullptr, stream_);
  }

  Communicator& comm_;
  int device_;
  Selection sel_;
  Status status_;
  std::unique_ptr<DeviceBatch> batch_;
  std::unique_ptr<cpidx::Decoder> dec_;
  std::unique_ptr<DeviceVec<int32_t>> ids_;
  cpidx::Geometry geo_;
  int64_t rows_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The replay schedule shared by both suites (identical on every rank: same seed): new lengths
// up to `bound` or short ones, padding requests, every few steps a smaller real batch (trailing
// requests padded), and a reshuffled block table whose entries stay inside the cache.
inline void next_replay_inputs(std::mt19937& rng, int step, int32_t bound, DecodeData* h) {
  const int reqs = h->num_reqs();
  h->seq_lens = lengths(rng, reqs, step % 2 ? 3000 : bound, step % 3 != 0);
  if (step % 5 == 4) {
    const int real = 1 + static_cast<int>(rng() % static_cast<unsigned>(reqs));
    for (int r = real; r < reqs; ++r) h->seq_lens[static_cast<size_t>(r)] = 0;
  }
  if (step % 250 == 17) h->seq_lens.assign(static_cast<size_t>(reqs), 0);
  std::shuffle(h->block_table.begin(), h->block_table.end(), rng);
  for (auto& e : h->block_table) e = static_cast<int32_t>(std::abs(e) % h->num_pages);
}

// fn(rank) on one thread per rank, with the rank's GPU current (GPU `device` for every rank
// when given: ranks sharing one GPU); returns when all end.
inline void on_threads(int world, const std::function<void(int)>& fn, int device = -1) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&fn, r, device] {
      cudaSetDevice(device < 0 ? r : device);
      fn(r);
    });
  }
  for (auto& t : threads) t.join();
}

// Ranks as threads of this process (rank r on GPU r, comms[r]): every rank's cp_decode of `d`
// == the plain decode on GPU 0, bitwise. Returns the ranks' results.
inline std::vector<RankResult> expect_threads_cp_equals_plain(
    const std::vector<Communicator*>& comms, const DecodeData& d, const Selection& sel,
    const std::string& what, bool fused_exchange = true) {
  const int world = static_cast<int>(comms.size());
  const std::vector<int32_t> plain = plain_decode_on(0, d, sel);
  std::vector<RankResult> results(static_cast<size_t>(world));
  on_threads(world, [&](int r) {
    results[static_cast<size_t>(r)] =
        cp_rank(*comms[static_cast<size_t>(r)], r, d, sel, -1, fused_exchange);
  });
  for (const RankResult& res : results) expect_rank_matches(res, plain, d.rows(), sel.topk, what);
  return results;
}

// Ranks as threads: cp_decode captured once per GPU (after an eager warm-up, every rank at the
// same time), then `replays` replays with the shared schedule of new inputs (next_replay_inputs),
// every GPU's graph launched before waiting for any; every `check_every`-th replay and the last
// compared with the plain decode. Returns the number of checks made.
inline int replay_threads_cp_graphs(const std::vector<Communicator*>& comms, DecodeData& d,
                                    const Selection& sel, std::mt19937& rng, int32_t bound,
                                    int replays, int check_every, const std::string& what,
                                    bool fused_exchange = true) {
  const int world = static_cast<int>(comms.size());
  std::vector<std::unique_ptr<GraphRank>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::make_unique<GraphRank>(*comms[static_cast<size_t>(r)], r, d, sel,
                                                fused_exchange));
  }
  std::vector<Status> warm(static_cast<size_t>(world)), cap(static_cast<size_t>(world));
  on_threads(world, [&](int r) {
    warm[r] = ranks[r]->warm_up();
    cap[r] = warm[r].is_ok() ? ranks[r]->capture() : warm[r];
  });
  bool ready = true;
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(warm[r].is_ok()) << what << ": rank " << r << " warm-up: " << warm[r].to_string();
    EXPECT_TRUE(cap[r].is_ok()) << what << ": rank " << r << " capture: " << cap[r].to_string();
    ready = ready && cap[r].is_ok() && ranks[r]->captured();
  }
  EXPECT_TRUE(ready) << what;  // nothing is in flight here: every warm-up and capture ended
  if (!ready) return 0;
  int checks = 0;
  for (int step = 0; step < replays; ++step) {
    next_replay_inputs(rng, step, bound, &d);
    const bool check = step % check_every == 0 || step == replays - 1;
    for (auto& rk : ranks) {
      rk->set_inputs(d);
      if (check) rk->poison_ids();
    }
    for (auto& rk : ranks) rk->launch();  // every GPU's graph before waiting for any
    for (auto& rk : ranks) rk->sync();
    if (!check) continue;
    const std::vector<int32_t> plain = plain_decode_on(0, d, sel);
    for (auto& rk : ranks) {
      expect_owned_heads_equal(rk->geometry(), rk->ids(), plain, d.rows(), sel.topk,
                               what + " replay " + std::to_string(step));
    }
    ++checks;
    if (::testing::Test::HasFailure()) break;
  }
  return checks;
}

}  // namespace cpidx_multigpu_test
