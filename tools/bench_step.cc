// tools/bench_step.cc: the whole context-parallel step on P real GPUs for `cpidx bench`. Per
// shape, each GPU's thread captures S back-to-back cp_decode calls (input sets rotated past the
// L2) in one CUDA graph; all graphs are launched together and timed with events on GPU 0 that
// wait for the other GPUs (EXCHANGE_H200x2.md's method); median replay / S. The same for the two
// all-gathers alone. Set 0 is checked bitwise against the plain decode on GPU 0. The exchanges
// run through NCCL (make_nccl_communicators_single_process) or the peer communicator
// (make_peer_communicator over thread communicators, sized for the shape's larger gather).
// Under mpirun each process is one rank on its own GPU (tools/rank_comm.h makes its NCCL or
// peer communicator over MPI); each times its own replays, launched back to back after a
// barrier so the ranks run in step, and the step's time is the slowest rank's median.
#include "bench_step.h"

#include <cstdlib>
#include <string>

#if defined(CPIDX_WITH_CUDA) && defined(CPIDX_WITH_NCCL)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "cpidx/comm_nccl.h"
#include "cpidx/indexer.h"
#include "random_bits.h"
#include "rank_comm.h"
#if defined(CPIDX_WITH_PEER)
#include "cpidx/comm_peer.h"
#endif
#endif

namespace cpidx::tools {

std::string StepBench::environment() {
  const char* mixing = std::getenv("NCCL_GRAPH_MIXING_SUPPORT");
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  std::string text;
#if defined(CPIDX_WITH_CUDA) && defined(CPIDX_WITH_NCCL)
  text = nccl_version_text() + "; ";
#endif
  text += std::string("NCCL_GRAPH_MIXING_SUPPORT=") +
          (mixing ? mixing : "unset (NCCL's default, 1)") + "; NCCL_NVLS_ENABLE=" +
          (nvls ? nvls : "unset (cpidx sets 0)");
  return text;
}

#if !(defined(CPIDX_WITH_CUDA) && defined(CPIDX_WITH_NCCL))

struct StepBench::Impl {};
StepBench::StepBench(int64_t, std::string, bool, Communicator*) {}
StepBench::~StepBench() = default;
std::string StepBench::unavailable(int) const {
  return "this build has no NCCL communicator (needs CUDA and NCCL)";
}
StepResult StepBench::run(const StepShape&, int) {
  StepResult r;
  r.check = unavailable(0);
  return r;
}

#else

namespace {

constexpr int kHeads = 4, kTopk = 16;
constexpr int64_t kPageBytesBf16 = 128 * 128 * 2;

Status cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(e));
}
#define STEP_CUDA(expr) CPIDX_RETURN_IF_ERROR(cuda_ok((expr), #expr))

struct HostSet {
  std::vector<int32_t> seq_lens, block_table;
  std::vector<uint16_t> query;  // [n, T, D]
};

struct DeviceSet {
  uint16_t* query = nullptr;        // [n, T, D]: every head (the plain decode of the check)
  uint16_t* local_query = nullptr;  // [n, L, D]: this rank's heads, contiguous, as an engine's
                                    // tensor-parallel rank holds them
  int32_t* block_table = nullptr;
  int32_t* seq_lens = nullptr;
};

// What one rank holds for one shape, on its own GPU.
struct RankState {
  int device = 0;
  Status status;
  std::unique_ptr<Decoder> dec;
  Geometry geo;
  cudaStream_t stream = nullptr;
  std::vector<void*> allocations;
  std::vector<DeviceSet> sets;
  int32_t* ids = nullptr;
  void *q_send = nullptr, *q_recv = nullptr, *k_send = nullptr, *k_recv = nullptr;
  cudaGraph_t step_graph = nullptr, xchg_graph = nullptr;
  cudaGraphExec_t step_exec = nullptr, xchg_exec = nullptr;
  std::vector<int32_t> ids0;  // set 0, eager: [L][n][K]

  template <typename T>
  Status alloc(T** p, size_t bytes) {
    void* raw = nullptr;
    STEP_CUDA(cudaMalloc(&raw, std::max<size_t>(bytes, 1)));
    allocations.push_back(raw);
    *p = static_cast<T*>(raw);
    return Status::ok();
  }
  void release() {
    cudaSetDevice(device);
    if (step_exec) cudaGraphExecDestroy(step_exec);
    if (xchg_exec) cudaGraphExecDestroy(xchg_exec);
    if (step_graph) cudaGraphDestroy(step_graph);
    if (xchg_graph) cudaGraphDestroy(xchg_graph);
    if (stream) cudaStreamDestroy(stream);
    for (void* p : allocations) cudaFree(p);
    allocations.clear();
    dec.reset();
  }
};

}  // namespace

struct StepBench::Impl {
  std::string dtype;
  bool pdl = true;
  // Under MPI: the host communicator of the processes (not owned), this process's GPU, and its
  // device communicators (the peer one with the payload bound it was made for).
  Communicator* processes = nullptr;
  int process_device = 0;
  std::unique_ptr<Communicator> process_nccl, process_peer;
  size_t process_peer_max = 0;
  int64_t page_bytes = 0, pool_pages = 0;
  std::vector<uint16_t> h_pool;  // the same random pages on every GPU
  std::vector<void*> pools;      // [device], uploaded by that device's thread on first use
  std::map<int, std::vector<std::unique_ptr<Communicator>>> comms;  // NCCL, by world size
  // Peer communicators by world size, over thread communicators (their bootstrap, kept alive
  // longer), and the payload bound they were made for.
  std::map<int, std::vector<std::unique_ptr<Communicator>>> peer_boot, peers;
  std::map<int, size_t> peer_max;

  ~Impl() {
    process_peer.reset();  // collective across the processes (IPC): every rank gets here
    process_nccl.reset();
    peers.clear();
    peer_boot.clear();
    comms.clear();
    for (size_t d = 0; d < pools.size(); ++d) {
      if (pools[d] == nullptr) continue;
      cudaSetDevice(static_cast<int>(d));
      cudaFree(pools[d]);
    }
    cudaSetDevice(0);
  }

  DecodeInputs inputs(const StepShape& sh, const DeviceSet& s, int device, int head_offset,
                      int heads) const {
    DecodeInputs in;
    in.query = s.query + static_cast<int64_t>(head_offset) * kHeadDim;
    in.q_row_stride = static_cast<int64_t>(kHeads) * kHeadDim;
    in.q_head_stride = kHeadDim;
    in.num_heads = heads;
    in.cache.data = pools[static_cast<size_t>(device)];
    in.cache.dtype = dtype == "fp8" ? DType::kFP8E4M3 : DType::kBF16;
    in.cache.num_pages = pool_pages;
    in.block_table = s.block_table;
    in.bt_row_stride = cdiv(sh.context, kBlockSize);
    in.seq_lens = s.seq_lens;
    in.num_reqs = sh.reqs;
    in.query_len = sh.qlen;
    in.max_seq_len = static_cast<int32_t>(sh.context);
    in.scale = 0.08838834764831845f;
    return in;
  }

  DecodeConfig config(const StepShape& sh, int world, int rank) const {
    DecodeConfig c;
    c.total_heads = kHeads;
    c.world_size = world;
    c.rank = rank;
    c.max_tokens = sh.reqs * sh.qlen;
    c.max_seq_len = static_cast<int32_t>(sh.context);
    c.max_query_len = sh.qlen;
    c.cache_dtype = dtype == "fp8" ? DType::kFP8E4M3 : DType::kBF16;
    c.programmatic_launch = pdl;
    c.fused_exchange = sh.exchange != "peer-gather";
    c.work_stealing = sh.work_stealing;
    return c;
  }

  // Everything local to rank r (on GPU `device`) before its first collective.
  Status set_up(RankState& rs, const StepShape& sh, const std::vector<HostSet>& hsets, int r,
                int device) {
    rs.device = device;
    STEP_CUDA(cudaSetDevice(device));
    void*& pool = pools[static_cast<size_t>(device)];
    if (pool == nullptr) {
      STEP_CUDA(cudaMalloc(&pool, h_pool.size() * 2));
      STEP_CUDA(cudaMemcpy(pool, h_pool.data(), h_pool.size() * 2, cudaMemcpyHostToDevice));
    }
    CPIDX_RETURN_IF_ERROR(Decoder::create(config(sh, sh.world, r), device, &rs.dec));
    rs.geo = rs.dec->geometry();
    STEP_CUDA(cudaStreamCreateWithFlags(&rs.stream, cudaStreamNonBlocking));
    for (const HostSet& h : hsets) {
      DeviceSet d;
      CPIDX_RETURN_IF_ERROR(rs.alloc(&d.query, h.query.size() * 2));
      CPIDX_RETURN_IF_ERROR(rs.alloc(&d.block_table, h.block_table.size() * 4));
      CPIDX_RETURN_IF_ERROR(rs.alloc(&d.seq_lens, h.seq_lens.size() * 4));
      STEP_CUDA(cudaMemcpy(d.query, h.query.data(), h.query.size() * 2, cudaMemcpyHostToDevice));
      STEP_CUDA(cudaMemcpy(d.block_table, h.block_table.data(), h.block_table.size() * 4,
                           cudaMemcpyHostToDevice));
      STEP_CUDA(cudaMemcpy(d.seq_lens, h.seq_lens.data(), h.seq_lens.size() * 4,
                           cudaMemcpyHostToDevice));
      const size_t rows = static_cast<size_t>(sh.reqs) * sh.qlen, L = rs.geo.local_heads;
      std::vector<uint16_t> local(rows * L * kHeadDim);
      for (size_t row = 0; row < rows; ++row) {
        std::copy_n(h.query.begin() + static_cast<std::ptrdiff_t>(
                                          (row * kHeads + rs.geo.head_offset) * kHeadDim),
                    L * kHeadDim, local.begin() + static_cast<std::ptrdiff_t>(row * L * kHeadDim));
      }
      CPIDX_RETURN_IF_ERROR(rs.alloc(&d.local_query, local.size() * 2));
      STEP_CUDA(cudaMemcpy(d.local_query, local.data(), local.size() * 2, cudaMemcpyHostToDevice));
      rs.sets.push_back(d);
    }
    const size_t n = static_cast<size_t>(sh.reqs) * sh.qlen, L = rs.geo.local_heads;
    CPIDX_RETURN_IF_ERROR(rs.alloc(&rs.ids, L * n * kTopk * 4));
    CPIDX_RETURN_IF_ERROR(rs.alloc(&rs.q_send, n * L * kHeadDim * 2));
    CPIDX_RETURN_IF_ERROR(rs.alloc(&rs.q_recv, sh.world * n * L * kHeadDim * 2));
    CPIDX_RETURN_IF_ERROR(rs.alloc(&rs.k_send, kHeads * n * kTopk * sizeof(Key)));
    CPIDX_RETURN_IF_ERROR(rs.alloc(&rs.k_recv, sh.world * kHeads * n * kTopk * sizeof(Key)));
    STEP_CUDA(cudaMemset(rs.q_send, 0, n * L * kHeadDim * 2));
    STEP_CUDA(cudaMemset(rs.k_send, 0, kHeads * n * kTopk * sizeof(Key)));
    return Status::ok();
  }

  // Rank r's thread or process: set up, warm up, check run, then capture the step and exchange
  // graphs. Every failure after the first collective is one all ranks see (the agreement in
  // cp_decode).
  void rank_work(RankState& rs, Communicator& comm, const StepShape& sh,
                 const std::vector<HostSet>& hsets, int calls_per_set, int device) {
    const int r = comm.rank();
    Status local = set_up(rs, sh, hsets, r, device);
    if (!local.is_ok()) {
      comm.check_agree(-1, cpidx::kCpRowsAgreement);  // the peers' first cp_decode fails, no hang
      rs.status = local;
      return;
    }
    const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
    const TopkOutput out{rs.ids, n * kTopk, kTopk};
    auto step = [&](const DeviceSet& s) {
      DecodeInputs in = inputs(sh, s, device, 0, rs.geo.local_heads);
      in.query = s.local_query;
      in.q_row_stride = static_cast<int64_t>(rs.geo.local_heads) * kHeadDim;
      return rs.dec->cp_decode(comm, in, out, nullptr, rs.stream);
    };
    rs.status = [&]() -> Status {
      for (const DeviceSet& s : rs.sets) CPIDX_RETURN_IF_ERROR(step(s));  // warm-up
      CPIDX_RETURN_IF_ERROR(step(rs.sets[0]));
      STEP_CUDA(cudaStreamSynchronize(rs.stream));
      rs.ids0.resize(static_cast<size_t>(rs.geo.local_heads * n * kTopk));
      STEP_CUDA(cudaMemcpy(rs.ids0.data(), rs.ids, rs.ids0.size() * 4, cudaMemcpyDeviceToHost));

      STEP_CUDA(cudaStreamBeginCapture(rs.stream, cudaStreamCaptureModeThreadLocal));
      Status captured = Status::ok();
      for (const DeviceSet& s : rs.sets) {
        for (int c = 0; c < calls_per_set && captured.is_ok(); ++c) captured = step(s);
      }
      STEP_CUDA(cudaStreamEndCapture(rs.stream, &rs.step_graph));
      CPIDX_RETURN_IF_ERROR(captured);
      STEP_CUDA(cudaGraphInstantiate(&rs.step_exec, rs.step_graph, 0));

      // The exchanges alone, with the step's payload sizes.
      const CpGatherBytes payload = cp_gather_bytes(rs.geo, n, kTopk);
      auto exchange = [&]() -> Status {
        CPIDX_RETURN_IF_ERROR(comm.all_gather(rs.q_send, rs.q_recv, payload.queries, rs.stream));
        return comm.all_gather(rs.k_send, rs.k_recv, payload.keys, rs.stream);
      };
      CPIDX_RETURN_IF_ERROR(exchange());
      STEP_CUDA(cudaStreamSynchronize(rs.stream));
      STEP_CUDA(cudaStreamBeginCapture(rs.stream, cudaStreamCaptureModeThreadLocal));
      const int calls = static_cast<int>(rs.sets.size()) * calls_per_set;
      for (int i = 0; i < calls && captured.is_ok(); ++i) captured = exchange();
      STEP_CUDA(cudaStreamEndCapture(rs.stream, &rs.xchg_graph));
      CPIDX_RETURN_IF_ERROR(captured);
      STEP_CUDA(cudaGraphInstantiate(&rs.xchg_exec, rs.xchg_graph, 0));
      return Status::ok();
    }();
  }

  // Launches every rank's graph, GPU 0 first; events on GPU 0, its stop event waiting on every
  // other GPU's stream. Returns the median replay over `calls`, in µs.
  Status time_graphs(std::vector<RankState>& ranks, bool exchange, int replays, int calls,
                     double* us) {
    const int P = static_cast<int>(ranks.size());
    std::vector<cudaEvent_t> done(static_cast<size_t>(P), nullptr);
    cudaEvent_t start = nullptr, stop = nullptr;
    Status st = [&]() -> Status {
      for (int r = 1; r < P; ++r) {
        STEP_CUDA(cudaSetDevice(r));
        STEP_CUDA(cudaEventCreateWithFlags(&done[r], cudaEventDisableTiming));
      }
      STEP_CUDA(cudaSetDevice(0));
      STEP_CUDA(cudaEventCreate(&start));
      STEP_CUDA(cudaEventCreate(&stop));
      std::vector<float> times;
      for (int i = 0; i < replays + 3; ++i) {
        STEP_CUDA(cudaSetDevice(0));
        STEP_CUDA(cudaEventRecord(start, ranks[0].stream));
        for (int r = 0; r < P; ++r) {
          STEP_CUDA(cudaSetDevice(r));
          STEP_CUDA(cudaGraphLaunch(exchange ? ranks[r].xchg_exec : ranks[r].step_exec,
                                    ranks[r].stream));
        }
        for (int r = 1; r < P; ++r) {
          STEP_CUDA(cudaSetDevice(r));
          STEP_CUDA(cudaEventRecord(done[r], ranks[r].stream));
          STEP_CUDA(cudaSetDevice(0));
          STEP_CUDA(cudaStreamWaitEvent(ranks[0].stream, done[r], 0));
        }
        STEP_CUDA(cudaSetDevice(0));
        STEP_CUDA(cudaEventRecord(stop, ranks[0].stream));
        STEP_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        STEP_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 3) times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      *us = times[times.size() / 2] * 1e3 / calls;
      return Status::ok();
    }();
    for (int r = 1; r < P; ++r) {
      if (done[r] == nullptr) continue;
      cudaSetDevice(r);
      cudaEventDestroy(done[r]);
    }
    cudaSetDevice(0);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    return st;
  }

  // The plain decode of all heads for set 0 on rank state `rs`'s GPU: [T][n][K].
  Status plain_ids(const StepShape& sh, const RankState& rs, std::vector<int32_t>* plain) {
    const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
    plain->assign(static_cast<size_t>(kHeads * n * kTopk), -1);
    STEP_CUDA(cudaSetDevice(rs.device));
    std::unique_ptr<Decoder> dec;
    CPIDX_RETURN_IF_ERROR(Decoder::create(config(sh, 1, 0), rs.device, &dec));
    int32_t* ids = nullptr;
    STEP_CUDA(cudaMalloc(&ids, plain->size() * 4));
    Status s = dec->decode(inputs(sh, rs.sets[0], rs.device, 0, kHeads),
                           TopkOutput{ids, n * kTopk, kTopk}, nullptr, rs.stream);
    cudaError_t e = cudaStreamSynchronize(rs.stream);
    if (e == cudaSuccess) {
      e = cudaMemcpy(plain->data(), ids, plain->size() * 4, cudaMemcpyDeviceToHost);
    }
    cudaFree(ids);
    CPIDX_RETURN_IF_ERROR(s);
    return cuda_ok(e, "plain decode");
  }

  // Rows of one rank's owned heads (ids [L][n][K]) that differ from the plain ids, bitwise.
  static int64_t bad_rows(int64_t n, const Geometry& geo, const int32_t* ids,
                          const std::vector<int32_t>& plain) {
    int64_t bad = 0;
    for (int j = 0; j < geo.local_heads; ++j) {
      for (int64_t row = 0; row < n; ++row) {
        const int32_t* got = ids + (j * n + row) * kTopk;
        const int32_t* want = plain.data() + ((geo.head_offset + j) * n + row) * kTopk;
        if (!std::equal(got, got + kTopk, want)) ++bad;
      }
    }
    return bad;
  }

  // Set 0: every rank's owned heads against the plain decode of all heads on GPU 0, bitwise.
  std::string check(const StepShape& sh, std::vector<RankState>& ranks) {
    const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
    std::vector<int32_t> plain;
    if (Status st = plain_ids(sh, ranks[0], &plain); !st.is_ok()) return "plain: " + st.message();
    int64_t bad = 0;
    for (const RankState& rs : ranks) bad += bad_rows(n, rs.geo, rs.ids0.data(), plain);
    return bad == 0 ? "ok" : "FAIL(" + std::to_string(bad) + ")";
  }

  // Under MPI: this process's replays, launched back to back after a barrier (the exchanges keep
  // the ranks in step; the first 3 are warm-up), each timed between consecutive events on its
  // own GPU. Returns the slowest rank's median replay / calls, in µs, on every rank.
  Status time_process(RankState& rs, bool exchange, int replays, int calls, double* us) {
    std::vector<cudaEvent_t> marks(static_cast<size_t>(replays + 4), nullptr);
    Status st = [&]() -> Status {
      STEP_CUDA(cudaSetDevice(rs.device));
      for (cudaEvent_t& e : marks) STEP_CUDA(cudaEventCreate(&e));
      CPIDX_RETURN_IF_ERROR(processes->barrier());
      STEP_CUDA(cudaEventRecord(marks[0], rs.stream));
      for (int i = 0; i < replays + 3; ++i) {
        STEP_CUDA(cudaGraphLaunch(exchange ? rs.xchg_exec : rs.step_exec, rs.stream));
        STEP_CUDA(cudaEventRecord(marks[static_cast<size_t>(i + 1)], rs.stream));
      }
      STEP_CUDA(cudaStreamSynchronize(rs.stream));
      std::vector<float> times;
      for (int i = 3; i < replays + 3; ++i) {
        float ms = 0;
        STEP_CUDA(cudaEventElapsedTime(&ms, marks[static_cast<size_t>(i)],
                                       marks[static_cast<size_t>(i + 1)]));
        times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      *us = times[times.size() / 2] * 1e3 / calls;
      return Status::ok();
    }();
    for (cudaEvent_t e : marks) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    // Every rank takes part whatever happened here; a failed rank reports a negative time.
    const double mine = st.is_ok() ? *us : -1.0;
    std::vector<double> all(static_cast<size_t>(processes->world_size()));
    CPIDX_RETURN_IF_ERROR(processes->all_gather(&mine, all.data(), sizeof(double), nullptr));
    CPIDX_RETURN_IF_ERROR(st);
    for (double t : all) {
      if (t < 0) return Status(StatusCode::kCommError, "another rank failed to time its replays");
    }
    *us = *std::max_element(all.begin(), all.end());
    return Status::ok();
  }

  // Under MPI: this process's device communicator for the shape, made (collectively) on first
  // use; the peer one again when a larger payload needs it.
  Status process_comm(const StepShape& sh, size_t need, Communicator** comm) {
    const bool peer = sh.exchange != "nccl";
    std::unique_ptr<Communicator>& c = peer ? process_peer : process_nccl;
    const size_t bound = peer_payload_bound(need);
    if (c == nullptr || (peer && process_peer_max < need)) {
      c.reset();  // every rank's old one goes before the new ones are made
      CPIDX_RETURN_IF_ERROR(make_process_communicator(*processes, process_device,
                                                      peer ? "peer" : "nccl", bound, &c));
      if (peer) process_peer_max = bound;
    }
    *comm = c.get();
    return Status::ok();
  }

  // Under MPI: this process's rank of the shape; rank 0 checks every rank's set-0 ids.
  void run_process(const StepShape& sh, int replays, const std::vector<HostSet>& hsets,
                   int calls_per_set, size_t need, StepResult* res) {
    const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
    Communicator* comm = nullptr;
    if (Status st = process_comm(sh, need, &comm); !st.is_ok()) {
      res->check = sh.exchange + ": " + st.message();
      return;
    }
    RankState rs;
    rank_work(rs, *comm, sh, hsets, calls_per_set, process_device);
    // Every rank's status and ids reach every rank (same byte counts, failed or not).
    const int P = processes->world_size();
    const int32_t ok = rs.status.is_ok() ? 1 : 0;
    std::vector<int32_t> oks(static_cast<size_t>(P));
    Geometry geo;
    make_geometry(kHeads, P, 0, &geo);  // local_heads is the same on every rank
    const size_t count = static_cast<size_t>(geo.local_heads * n * kTopk);
    rs.ids0.resize(count, -2);
    std::vector<int32_t> all_ids(count * static_cast<size_t>(P));
    Status st = processes->all_gather(&ok, oks.data(), sizeof(int32_t), nullptr);
    if (st.is_ok()) {
      st = processes->all_gather(rs.ids0.data(), all_ids.data(), count * 4, nullptr);
    }
    if (st.is_ok() && !rs.status.is_ok()) st = rs.status;
    for (int r = 0; r < P && st.is_ok(); ++r) {
      if (oks[static_cast<size_t>(r)] == 0) {
        st = Status(StatusCode::kCommError, "rank " + std::to_string(r) + " failed its step");
      }
    }
    if (!st.is_ok()) {
      res->check = "rank " + std::to_string(processes->rank()) + ": " + st.message();
      rs.release();
      return;
    }
    // Rank 0's plain decode decides; its count of bad rows reaches every rank (-1: it failed).
    int64_t bad = 0;
    std::string plain_error;
    if (processes->rank() == 0) {
      std::vector<int32_t> plain;
      if (Status ps = plain_ids(sh, rs, &plain); !ps.is_ok()) {
        bad = -1;
        plain_error = ps.message();
      } else {
        for (int r = 0; r < P; ++r) {
          Geometry g;
          make_geometry(kHeads, P, r, &g);
          bad += bad_rows(n, g, all_ids.data() + count * static_cast<size_t>(r), plain);
        }
      }
    }
    std::vector<int64_t> verdicts(static_cast<size_t>(P));
    st = processes->all_gather(&bad, verdicts.data(), sizeof(int64_t), nullptr);
    bad = st.is_ok() ? verdicts[0] : -1;
    res->check = bad == 0 ? "ok"
                 : bad > 0 ? "FAIL(" + std::to_string(bad) + ")"
                           : "plain: " + (plain_error.empty() ? st.message() : plain_error);
    st = time_process(rs, false, replays, res->calls, &res->us);
    if (st.is_ok()) st = time_process(rs, true, replays, res->calls, &res->exchange_us);
    if (!st.is_ok()) res->check = "timing: " + st.message();
    rs.release();
  }
};

StepBench::StepBench(int64_t pool_mb, std::string dtype, bool pdl, Communicator* processes)
    : impl_(new Impl) {
  Impl& im = *impl_;
  im.processes = processes;
  if (processes != nullptr) im.process_device = process_device(*processes);
  im.dtype = std::move(dtype);
  im.pdl = pdl;
  im.page_bytes = im.dtype == "fp8" ? kPageBytesBf16 / 2 : kPageBytesBf16;
  im.pool_pages = pool_mb * (1 << 20) / im.page_bytes;
  im.h_pool.resize(static_cast<size_t>(im.pool_pages * im.page_bytes / 2));
  fill_random_bf16(im.h_pool, 1234);
  if (im.dtype == "fp8") {
    for (auto& v : im.h_pool) {  // two e4m3 bytes per element, NaN codes (x111_1111) avoided
      auto* b = reinterpret_cast<uint8_t*>(&v);
      for (int i = 0; i < 2; ++i) {
        if ((b[i] & 0x7F) == 0x7F) b[i] ^= 0x01;
      }
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  im.pools.assign(static_cast<size_t>(count), nullptr);
}

StepBench::~StepBench() = default;

std::string StepBench::unavailable(int world) const {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (world < 2) return "stepP needs P >= 2";
  if (impl_->processes != nullptr && impl_->processes->world_size() != world) {
    return "step" + std::to_string(world) + " under mpirun needs -np " + std::to_string(world) +
           " (one process per GPU), got " + std::to_string(impl_->processes->world_size());
  }
  if (count < world) {
    return "step" + std::to_string(world) + " needs " + std::to_string(world) + " GPUs, found " +
           std::to_string(count);
  }
  return {};
}

StepResult StepBench::run(const StepShape& sh, int replays) {
  Impl& im = *impl_;
  StepResult res;
  const int P = sh.world;
  if (std::string why = unavailable(P); !why.empty()) {
    res.check = why;
    return res;
  }
  const int64_t G = cdiv(sh.context, kBlockSize);
  const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
  const double cache_bytes =
      static_cast<double>(sh.reqs) * (sh.context - 64) * static_cast<double>(im.page_bytes) / 128;
  const double shard_bytes = cache_bytes / P;
  res.cache_mb = cache_bytes / 1e6;
  res.floor_us = shard_bytes / 4.5e12 * 1e6;
  // Enough sets that one graph replay reads >= 480 MiB per GPU (past the 60 MiB L2 8 times).
  // Through NCCL at most 128: each set's step holds two captured NCCL collectives, and a few
  // thousand of them made the 1 x 8K set-up outlast its time box on the 2-GPU machine
  // (docs/perf/README.md), so B*L = 8K rotates only 128 shards there: 127 MiB at P = 2 in bf16
  // (2.1 x the L2), 64 at P = 4 or fp8, 32 at both; its rows' rotated_mb says so
  // (compare_peer.py marks them off-method). The peer exchanges capture the library's own
  // kernels, no NCCL call: up to 512 sets, the 480 MiB at P = 2 in bf16.
  const bool peer_exchange = sh.exchange == "peer" || sh.exchange == "peer-gather";
  const double most_sets = peer_exchange ? 512 : 128;
  res.sets = static_cast<int>(
      std::min(most_sets, std::max<double>(1, std::ceil(480.0 * (1 << 20) / shard_bytes))));
  const int calls_per_set = res.sets == 1 ? 2 : 1;
  res.calls = res.sets * calls_per_set;

  std::mt19937_64 rng(42 + sh.reqs * 131 + sh.context + sh.qlen * 7 + P * 3);
  int64_t next_page = 0;
  std::vector<HostSet> hsets(static_cast<size_t>(res.sets));
  for (HostSet& h : hsets) {
    h.seq_lens.resize(static_cast<size_t>(sh.reqs));
    for (auto& l : h.seq_lens) l = static_cast<int32_t>(sh.context - static_cast<int64_t>(rng() % 128));
    h.block_table.resize(static_cast<size_t>(sh.reqs * G));
    for (auto& b : h.block_table) {  // distinct pages while the pool lasts, then random
      b = static_cast<int32_t>(next_page < im.pool_pages ? next_page++ : rng() % im.pool_pages);
    }
    std::shuffle(h.block_table.begin(), h.block_table.end(), rng);
    h.query.resize(static_cast<size_t>(n * kHeads * kHeadDim));
    fill_random_bf16(h.query, rng());
  }

  // The step's two gathers' payloads per rank; a peer communicator holds the larger.
  Geometry g;
  if (Status st = make_geometry(kHeads, P, 0, &g); !st.is_ok()) {
    res.check = st.message();
    return res;
  }
  const CpGatherBytes payload = cp_gather_bytes(g, n, kTopk);
  const size_t need = payload.larger();
  res.q_bytes = static_cast<int64_t>(payload.queries);
  res.k_bytes = static_cast<int64_t>(payload.keys);
  if (im.processes != nullptr) {
    im.run_process(sh, replays, hsets, calls_per_set, need, &res);
    res.gbps = res.us > 0 ? shard_bytes / (res.us * 1e-6) / 1e9 : 0;
    cudaSetDevice(im.process_device);
    return res;
  }

  auto& nccl = im.comms[P];
  if (nccl.empty() && !peer_exchange) {
    std::vector<int> devices;
    for (int r = 0; r < P; ++r) devices.push_back(r);
    Status st;
    nccl = make_nccl_communicators_single_process(devices, &st);
    if (!st.is_ok()) {
      res.check = "NCCL: " + st.message();
      return res;
    }
  }
  std::vector<std::unique_ptr<Communicator>>* comms_of_shape = &nccl;
  if (peer_exchange) {
#if defined(CPIDX_WITH_PEER)
    auto& peers = im.peers[P];
    if (peers.empty() || im.peer_max[P] < need) {
      peers.clear();  // every rank's old one goes before the new ones are made
      auto& boot = im.peer_boot[P];
      if (boot.empty()) boot = make_thread_communicators(P);
      peers.resize(static_cast<size_t>(P));
      std::vector<Status> st(static_cast<size_t>(P));
      const size_t bound = peer_payload_bound(need);
      std::vector<std::thread> threads;
      for (int r = 0; r < P; ++r) {
        threads.emplace_back([&, r] {
          peers[static_cast<size_t>(r)] =
              make_peer_communicator(*boot[static_cast<size_t>(r)], r, bound, &st[static_cast<size_t>(r)]);
        });
      }
      for (std::thread& t : threads) t.join();
      if (!st[0].is_ok()) {
        peers.clear();
        res.check = "peer: " + st[0].message();
        return res;
      }
      im.peer_max[P] = bound;
    }
    comms_of_shape = &peers;
#else
    res.check = "this build has no peer communicator";
    return res;
#endif
  }
  auto& comms = *comms_of_shape;

  std::vector<RankState> ranks(static_cast<size_t>(P));
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r) {
      threads.emplace_back([&, r] {
        im.rank_work(ranks[static_cast<size_t>(r)], *comms[static_cast<size_t>(r)], sh, hsets,
                     calls_per_set, r);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (const RankState& rs : ranks) {
    if (!rs.status.is_ok() && res.check.empty()) {
      res.check = "rank " + std::to_string(rs.device) + ": " + rs.status.message();
    }
  }
  if (res.check.empty()) {
    res.check = im.check(sh, ranks);
    Status st = im.time_graphs(ranks, false, replays, res.calls, &res.us);
    if (st.is_ok()) st = im.time_graphs(ranks, true, replays, res.calls, &res.exchange_us);
    if (!st.is_ok()) res.check = "timing: " + st.message();
    res.gbps = res.us > 0 ? shard_bytes / (res.us * 1e-6) / 1e9 : 0;
  }
  for (RankState& rs : ranks) rs.release();
  cudaSetDevice(0);
  return res;
}

#endif

}  // namespace cpidx::tools
