// tools/demo_gpu.cc: the GPU part of `cpidx demo`: the plain GPU decode on the first GPU and the
// context-parallel step on P GPUs (one thread per GPU through NCCL, or one MPI process per GPU
// through NCCL or the peer communicator; stages timed one by one with CUDA events, then the
// library's whole cp_decode) or P ranks simulated on GPU 0, then the checks.
#include "demo_gpu.h"

#include <cstdio>

#include "subcommands.h"

#if defined(CPIDX_WITH_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "cpidx/indexer.h"
#include "cpidx/reference.h"
#include "rank_comm.h"
#if defined(CPIDX_WITH_NCCL)
#include "cpidx/comm_nccl.h"
#endif
#if defined(CPIDX_WITH_PEER)
#include "cpidx/comm_peer.h"
#endif
#endif

namespace cpidx::tools {

#if !defined(CPIDX_WITH_CUDA)

bool built_with_cuda() { return false; }
int gpu_count() { return 0; }
bool built_with_nccl() { return false; }
bool built_with_peer() { return false; }
int run_demo_gpu(const SyntheticStep&, const Selection&, int, bool, const std::vector<int32_t>&) {
  return kExitOk;
}
int run_demo_gpu_mpi(Communicator&, const SyntheticStep&, const Selection&, const std::string&,
                     const std::vector<int32_t>&) {
  return kExitOk;
}

#else

bool built_with_cuda() { return true; }

int gpu_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

bool built_with_nccl() {
#if defined(CPIDX_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

bool built_with_peer() {
#if defined(CPIDX_WITH_PEER)
  return true;
#else
  return false;
#endif
}

namespace {

Status cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(e));
}
#define DEMO_CUDA(expr) CPIDX_RETURN_IF_ERROR(cuda_ok((expr), #expr))


// One device allocation, freed on its own device.
struct DeviceBuffer {
  void* ptr = nullptr;
  int device = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr == nullptr) return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    cudaFree(ptr);
    cudaSetDevice(prev);
  }
  // On the current device.
  Status alloc(size_t bytes) {
    DEMO_CUDA(cudaGetDevice(&device));
    DEMO_CUDA(cudaMalloc(&ptr, std::max<size_t>(bytes, 1)));
    return Status::ok();
  }
  Status upload(const void* host, size_t bytes) {
    CPIDX_RETURN_IF_ERROR(alloc(bytes));
    DEMO_CUDA(cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice));
    return Status::ok();
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

// The step's inputs on the current device.
struct DeviceStep {
  DeviceBuffer query, cache, block_table, seq_lens;
  Status upload(const SyntheticStep& s) {
    CPIDX_RETURN_IF_ERROR(query.upload(s.query.data(), s.query.size() * 2));
    CPIDX_RETURN_IF_ERROR(cache.upload(s.cache.data(), s.cache.size()));
    CPIDX_RETURN_IF_ERROR(block_table.upload(s.block_table.data(), s.block_table.size() * 4));
    return seq_lens.upload(s.seq_lens.data(), s.seq_lens.size() * 4);
  }
  DecodeInputs inputs(const SyntheticStep& s, int head_offset, int heads) const {
    DecodeInputs in = s.for_heads(head_offset, heads);
    in.query = query.as<uint16_t>() + static_cast<int64_t>(head_offset) * kHeadDim;
    in.cache.data = cache.ptr;
    in.block_table = block_table.as<int32_t>();
    in.seq_lens = seq_lens.as<int32_t>();
    return in;
  }
};

// A stream and `count` timing events on the current device.
struct Timeline {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;
  int device = 0;
  Timeline() = default;
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  ~Timeline() {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaSetDevice(prev);
  }
  Status create(int count) {
    DEMO_CUDA(cudaGetDevice(&device));
    DEMO_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int i = 0; i < count; ++i) {
      cudaEvent_t e = nullptr;
      DEMO_CUDA(cudaEventCreate(&e));
      events.push_back(e);
    }
    return Status::ok();
  }
  Status mark(int i) { return cuda_ok(cudaEventRecord(events[i], stream), "cudaEventRecord"); }
  double ms(int a, int b) const {
    float m = 0;
    return cudaEventElapsedTime(&m, events[a], events[b]) == cudaSuccess ? m : -1.0;
  }
};

DecodeConfig config_of(const SyntheticStep& s, const Selection& sel, int world, int rank) {
  DecodeConfig c;
  c.total_heads = s.config.total_heads;
  c.world_size = world;
  c.rank = rank;
  c.max_tokens = static_cast<int>(s.num_rows());
  c.max_seq_len = s.config.context;
  c.max_query_len = s.config.query_len;
  c.sel = sel;
  c.cache_dtype = s.config.cache_dtype;
  return c;
}

Status download(const DeviceBuffer& buf, size_t count, std::vector<int32_t>* out) {
  out->assign(count, -2);
  DEMO_CUDA(cudaMemcpy(out->data(), buf.ptr, count * 4, cudaMemcpyDeviceToHost));
  return Status::ok();
}

struct GpuRank {
  Status status;
  int rank = 0, device = 0, head_offset = 0, local_heads = 0;
  int32_t device_errors = 0;
  // Stage times (ms); < 0 where the mode has no such stage.
  double gather_q_ms = -1, score_ms = -1, gather_keys_ms = -1, merge_ms = -1, step_ms = -1;
  std::vector<int32_t> ids;        // [L][n][K]: cp_decode (real GPUs) or the simulated merge
  std::vector<int32_t> stage_ids;  // [L][n][K]: the stage-by-stage run (real GPUs)
};

struct GpuPlain {
  Status status;
  int device = 0;
  double ms = 0;
  int32_t device_errors = 0;
  std::vector<int32_t> ids;  // [T][n][K]
};

// The plain decode of all heads on `device`: one warm-up call, one timed call.
GpuPlain run_plain(const SyntheticStep& s, const Selection& sel, int device = 0) {
  GpuPlain res;
  res.device = device;
  const int T = s.config.total_heads;
  const int64_t n = s.num_rows();
  res.status = [&]() -> Status {
    DEMO_CUDA(cudaSetDevice(device));
    DeviceStep d;
    CPIDX_RETURN_IF_ERROR(d.upload(s));
    std::unique_ptr<Decoder> dec;
    CPIDX_RETURN_IF_ERROR(Decoder::create(config_of(s, sel, 1, 0), device, &dec));
    DeviceBuffer ids;
    const size_t count = static_cast<size_t>(T * n * sel.topk);
    CPIDX_RETURN_IF_ERROR(ids.alloc(count * 4));
    Timeline tl;
    CPIDX_RETURN_IF_ERROR(tl.create(2));
    const TopkOutput out{ids.as<int32_t>(), n * sel.topk, sel.topk};
    CPIDX_RETURN_IF_ERROR(dec->decode(d.inputs(s, 0, T), out, nullptr, tl.stream));
    CPIDX_RETURN_IF_ERROR(tl.mark(0));
    CPIDX_RETURN_IF_ERROR(dec->decode(d.inputs(s, 0, T), out, nullptr, tl.stream));
    CPIDX_RETURN_IF_ERROR(tl.mark(1));
    DEMO_CUDA(cudaStreamSynchronize(tl.stream));
    res.ms = tl.ms(0, 1);
    DEMO_CUDA(cudaMemcpy(&res.device_errors, dec->error_flag(), 4, cudaMemcpyDeviceToHost));
    return download(ids, count, &res.ids);
  }();
  return res;
}

// P ranks simulated on GPU 0: every rank's shard keys into one gathered buffer, then every
// rank's merge of the owned heads (the exchanges are in-place reads, so they cost nothing here).
std::vector<GpuRank> run_simulated(const SyntheticStep& s, const Selection& sel, int P) {
  std::vector<GpuRank> ranks(static_cast<size_t>(P));
  const int T = s.config.total_heads;
  const int64_t n = s.num_rows();
  const size_t per_rank = static_cast<size_t>(T * n * sel.topk);
  Status st = [&]() -> Status {
    DEMO_CUDA(cudaSetDevice(0));
    DeviceStep d;
    CPIDX_RETURN_IF_ERROR(d.upload(s));
    std::vector<std::unique_ptr<Decoder>> decs(static_cast<size_t>(P));
    std::vector<std::unique_ptr<DeviceBuffer>> ids(static_cast<size_t>(P));
    DeviceBuffer gathered;
    CPIDX_RETURN_IF_ERROR(gathered.alloc(per_rank * P * sizeof(Key)));
    Timeline tl;
    CPIDX_RETURN_IF_ERROR(tl.create(4 * P));
    for (int r = 0; r < P; ++r) {
      CPIDX_RETURN_IF_ERROR(Decoder::create(config_of(s, sel, P, r), 0, &decs[r]));
      ids[r] = std::make_unique<DeviceBuffer>();
      CPIDX_RETURN_IF_ERROR(ids[r]->alloc(static_cast<size_t>(
          decs[r]->geometry().local_heads * n * sel.topk * 4)));
    }
    auto step = [&](bool timed) -> Status {
      for (int r = 0; r < P; ++r) {
        if (timed) CPIDX_RETURN_IF_ERROR(tl.mark(4 * r));
        CPIDX_RETURN_IF_ERROR(decs[r]->shard_keys(d.inputs(s, 0, T),
                                                  gathered.as<Key>() + per_rank * r, tl.stream));
        if (timed) CPIDX_RETURN_IF_ERROR(tl.mark(4 * r + 1));
      }
      for (int r = 0; r < P; ++r) {
        const Geometry& g = decs[r]->geometry();
        if (timed) CPIDX_RETURN_IF_ERROR(tl.mark(4 * r + 2));
        CPIDX_RETURN_IF_ERROR(decs[r]->merge(
            gathered.as<Key>(), d.inputs(s, g.head_offset, g.local_heads),
            TopkOutput{ids[r]->as<int32_t>(), n * sel.topk, sel.topk}, nullptr, tl.stream));
        if (timed) CPIDX_RETURN_IF_ERROR(tl.mark(4 * r + 3));
      }
      return Status::ok();
    };
    CPIDX_RETURN_IF_ERROR(step(false));  // warm-up
    CPIDX_RETURN_IF_ERROR(step(true));
    DEMO_CUDA(cudaStreamSynchronize(tl.stream));
    for (int r = 0; r < P; ++r) {
      GpuRank& rep = ranks[static_cast<size_t>(r)];
      const Geometry& g = decs[r]->geometry();
      rep.rank = r;
      rep.head_offset = g.head_offset;
      rep.local_heads = g.local_heads;
      rep.score_ms = tl.ms(4 * r, 4 * r + 1);
      rep.merge_ms = tl.ms(4 * r + 2, 4 * r + 3);
      rep.step_ms = rep.score_ms + rep.merge_ms;
      DEMO_CUDA(cudaMemcpy(&rep.device_errors, decs[r]->error_flag(), 4, cudaMemcpyDeviceToHost));
      CPIDX_RETURN_IF_ERROR(
          download(*ids[r], static_cast<size_t>(g.local_heads * n * sel.topk), &rep.ids));
    }
    return Status::ok();
  }();
  for (GpuRank& r : ranks) r.status = st;
  return ranks;
}

// One rank of the real step, on GPU `device` (the device of `comm`), from its own thread or
// process. The stages run one by one with events between them (gather q; score + top-k of all
// heads on this rank's shard, from this GPU's copy of the queries, identical to the gathered ones;
// gather keys; merge), then the library's cp_decode as one call. A rank that fails before its
// first collective still takes part in the agreement the peers wait in.
GpuRank real_rank(Communicator& comm, int device, const SyntheticStep& s, const Selection& sel) {
  GpuRank rep;
  const int P = comm.world_size(), T = s.config.total_heads, K = sel.topk;
  const int64_t n = s.num_rows();
  rep.rank = comm.rank();
  rep.device = device;
  DeviceStep d;
  std::unique_ptr<Decoder> dec;
  DeviceBuffer q_local, q_recv, keys_send, keys_recv, ids_stage, ids_cp;
  Timeline tl;
  Status st = [&]() -> Status {
    DEMO_CUDA(cudaSetDevice(rep.device));
    CPIDX_RETURN_IF_ERROR(d.upload(s));
    CPIDX_RETURN_IF_ERROR(Decoder::create(config_of(s, sel, P, comm.rank()), rep.device, &dec));
    rep.head_offset = dec->geometry().head_offset;
    rep.local_heads = dec->geometry().local_heads;
    const size_t L = static_cast<size_t>(rep.local_heads);
    CPIDX_RETURN_IF_ERROR(q_local.alloc(n * L * kHeadDim * 2));
    CPIDX_RETURN_IF_ERROR(q_recv.alloc(P * n * L * kHeadDim * 2));
    CPIDX_RETURN_IF_ERROR(keys_send.alloc(static_cast<size_t>(T * n * K) * sizeof(Key)));
    CPIDX_RETURN_IF_ERROR(keys_recv.alloc(static_cast<size_t>(P * T * n * K) * sizeof(Key)));
    CPIDX_RETURN_IF_ERROR(ids_stage.alloc(L * n * K * 4));
    CPIDX_RETURN_IF_ERROR(ids_cp.alloc(L * n * K * 4));
    CPIDX_RETURN_IF_ERROR(tl.create(6));
    // This rank's local queries [n, L, D], packed.
    DEMO_CUDA(cudaMemcpy2D(q_local.ptr, L * kHeadDim * 2,
                           d.query.as<uint16_t>() + rep.head_offset * kHeadDim,
                           static_cast<size_t>(T) * kHeadDim * 2, L * kHeadDim * 2,
                           static_cast<size_t>(n), cudaMemcpyDeviceToDevice));
    return Status::ok();
  }();
  if (!st.is_ok()) {
    comm.check_agree(-1, cpidx::kCpRowsAgreement);
    rep.status = st;
    return rep;
  }
  const DecodeInputs local = d.inputs(s, rep.head_offset, rep.local_heads);
  const TopkOutput out_cp{ids_cp.as<int32_t>(), n * K, K};
  const TopkOutput out_stage{ids_stage.as<int32_t>(), n * K, K};
  // Warm-up (NCCL connects on first use); it fails on every rank together or on none.
  st = dec->cp_decode(comm, local, out_cp, nullptr, tl.stream);
  if (st.is_ok()) st = cuda_ok(cudaStreamSynchronize(tl.stream), "cudaStreamSynchronize");
  if (st.is_ok()) st = comm.barrier();  // start the timed part together
  if (!st.is_ok()) {
    rep.status = st;
    return rep;
  }
  // Every collective below is issued whatever happened before it, so no peer is left waiting.
  auto keep = [&st](Status s2) {
    if (st.is_ok()) st = std::move(s2);
  };
  const size_t q_bytes = static_cast<size_t>(n) * rep.local_heads * kHeadDim * 2;
  const size_t k_bytes = static_cast<size_t>(T * n * K) * sizeof(Key);
  keep(tl.mark(0));
  keep(comm.all_gather(q_local.ptr, q_recv.ptr, q_bytes, tl.stream));
  keep(tl.mark(1));
  keep(dec->shard_keys(d.inputs(s, 0, T), keys_send.as<Key>(), tl.stream));
  keep(tl.mark(2));
  keep(comm.all_gather(keys_send.ptr, keys_recv.ptr, k_bytes, tl.stream));
  keep(tl.mark(3));
  keep(dec->merge(keys_recv.as<Key>(), local, out_stage, nullptr, tl.stream));
  keep(tl.mark(4));
  keep(dec->cp_decode(comm, local, out_cp, nullptr, tl.stream));
  keep(tl.mark(5));
  keep(cuda_ok(cudaStreamSynchronize(tl.stream), "cudaStreamSynchronize"));
#if defined(CPIDX_WITH_PEER)
  // A peer wait that timed out leaves undefined ids behind: fail the rank, naming the cause.
  if (peer_error_flag(comm) != nullptr && st.is_ok()) {
    int32_t bits = 0;
    keep(read_peer_error_flag(comm, &bits));
    if (bits != 0) {
      keep(Status(StatusCode::kCommError, "peer communicator: error word " +
                                              std::to_string(bits) + " (a peer wait timed out)"));
    }
  }
#endif
  if (st.is_ok()) {
    rep.gather_q_ms = tl.ms(0, 1);
    rep.score_ms = tl.ms(1, 2);
    rep.gather_keys_ms = tl.ms(2, 3);
    rep.merge_ms = tl.ms(3, 4);
    rep.step_ms = tl.ms(4, 5);
    keep(cuda_ok(cudaMemcpy(&rep.device_errors, dec->error_flag(), 4, cudaMemcpyDeviceToHost),
                 "cudaMemcpy (error flag)"));
    const size_t count = static_cast<size_t>(rep.local_heads * n * K);
    keep(download(ids_cp, count, &rep.ids));
    keep(download(ids_stage, count, &rep.stage_ids));
  }
  rep.status = st;
  return rep;
}

#if defined(CPIDX_WITH_NCCL)
std::vector<GpuRank> run_real(const SyntheticStep& s, const Selection& sel, int P) {
  std::vector<GpuRank> ranks(static_cast<size_t>(P));
  std::vector<int> devices;
  for (int r = 0; r < P; ++r) devices.push_back(r);
  Status st;
  std::vector<std::unique_ptr<Communicator>> comms =
      make_nccl_communicators_single_process(devices, &st);
  if (!st.is_ok()) {
    for (GpuRank& r : ranks) r.status = st;
    return ranks;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back(
        [&, r] { ranks[static_cast<size_t>(r)] = real_rank(*comms[r], r, s, sel); });
  }
  for (std::thread& t : threads) t.join();
  return ranks;
}
#endif

// GPU plain ids vs CPU reference ids [T][n][K] by the contract's rule (ref::compare_ids).
ref::IdsComparison compare_with_cpu(const SyntheticStep& s, const Selection& sel,
                                    const std::vector<int32_t>& gpu,
                                    const std::vector<int32_t>& cpu) {
  const int64_t n = s.num_rows();
  const TopkOutput got{const_cast<int32_t*>(gpu.data()), n * sel.topk, sel.topk};
  const TopkOutput want{const_cast<int32_t*>(cpu.data()), n * sel.topk, sel.topk};
  return ref::compare_ids(s.for_heads(0, s.config.total_heads), sel, got, want);
}

// First slot where a rank's ids differ from the plain GPU ids of its heads; empty if none.
std::string first_difference(const GpuRank& r, const std::vector<int32_t>& ids,
                             const std::vector<int32_t>& plain, int64_t n, int K,
                             const char* what) {
  const size_t per_head = static_cast<size_t>(n * K);
  if (ids.size() != per_head * r.local_heads) return std::string(what) + ": no ids";
  for (int j = 0; j < r.local_heads; ++j) {
    for (size_t i = 0; i < per_head; ++i) {
      const int32_t got = ids[per_head * j + i];
      const int32_t want = plain[per_head * (r.head_offset + j) + i];
      if (got == want) continue;
      char text[200];
      std::snprintf(text, sizeof(text), "rank %d, head %d, row %lld, slot %d: %s id %d, plain "
                    "GPU id %d", r.rank, r.head_offset + j, static_cast<long long>(i / K),
                    static_cast<int>(i % K), what, got, want);
      return text;
    }
  }
  return {};
}

std::string head_span(int first, int count) {
  return count == 1 ? std::to_string(first)
                    : std::to_string(first) + "-" + std::to_string(first + count - 1);
}

void print_ms(double ms, int width) {
  if (ms < 0) {
    std::printf("  %*s", width, "-");
  } else {
    std::printf("  %*.3f", width, ms);
  }
}

// "# GPU: <count> x <name of `device`>; <how>", the first line of the GPU report.
void print_gpu_header(int device, const std::string& how) {
  cudaDeviceProp prop;
  const bool named = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
  std::printf("#\n# GPU: %d x %s; %s\n", gpu_count(), named ? prop.name : "CUDA device",
              how.c_str());
  std::fflush(stdout);
}

// What the real step exchanges through, for the header.
std::string exchange_text(const std::string& exchange) {
  if (exchange == "peer") return "the peer communicator";
#if defined(CPIDX_WITH_NCCL)
  return nccl_version_text();
#else
  return "NCCL (not built)";
#endif
}

// NCCL's NVLS setting for the header (the factories set it to 0 when unset); empty for peer.
std::string nvls_note(const std::string& exchange) {
  if (exchange == "peer") return {};
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  return std::string(" (NCCL_NVLS_ENABLE=") + (nvls ? nvls : "unset, set to 0 by cpidx") + ")";
}

// The GPU table and verdict, after the header; returns the exit code. `real_gpus`: the ranks ran
// on their own GPUs (stage-by-stage step and cp_decode, both checked); else simulated on one.
int print_gpu_report(const SyntheticStep& step, const Selection& sel, const GpuPlain& plain,
                     const std::vector<GpuRank>& runs, bool real_gpus,
                     const std::vector<int32_t>& cpu_plain_ids) {
  const int T = step.config.total_heads, K = sel.topk;
  const int64_t n = step.num_rows();
  std::printf("#                  -------------------- GPU time (ms, CUDA events) "
              "--------------------\n");
  std::printf("#  rank  gpu  heads   gather q  score+top-k  gather keys      merge  %s\n",
              real_gpus ? "cp_decode" : "    total");
  for (const GpuRank& r : runs) {
    std::printf("%7d  %3d  %5s", r.rank, r.device, head_span(r.head_offset, r.local_heads).c_str());
    print_ms(r.gather_q_ms, 9);
    print_ms(r.score_ms, 11);
    print_ms(r.gather_keys_ms, 11);
    print_ms(r.merge_ms, 9);
    print_ms(r.step_ms, 9);
    std::printf("\n");
  }
  std::printf("%7s  %3d  %5s", "plain", plain.device, head_span(0, T).c_str());
  print_ms(-1, 9);
  print_ms(plain.ms, 11);
  print_ms(-1, 11);
  print_ms(-1, 9);
  print_ms(plain.ms, 9);
  std::printf("\n");
  if (real_gpus) {
    std::printf("# (stages run one by one, events between them; the gathers include waiting for "
                "the peers; cp_decode is the library's whole step in one call, eager)\n");
  }

  // Verdict: errors first, then device flags, then CP vs plain GPU (bitwise), then GPU vs CPU.
  std::string failure;
  if (!plain.status.is_ok()) failure = "plain GPU decode: " + plain.status.to_string();
  if (failure.empty() && plain.device_errors != 0) {
    failure = "plain GPU decode: device error flag " + std::to_string(plain.device_errors);
  }
  for (const GpuRank& r : runs) {
    if (!failure.empty()) break;
    if (!r.status.is_ok()) {
      failure = "rank " + std::to_string(r.rank) + ": " + r.status.to_string();
    } else if (r.device_errors != 0) {
      failure = "rank " + std::to_string(r.rank) + ": device error flag " +
                std::to_string(r.device_errors);
    } else {
      failure = first_difference(r, r.ids, plain.ids, n, K,
                                 real_gpus ? "cp_decode" : "context-parallel");
      if (failure.empty() && real_gpus) {
        failure = first_difference(r, r.stage_ids, plain.ids, n, K, "stage-by-stage");
      }
    }
  }
  ref::IdsComparison cpu;
  if (failure.empty()) {
    cpu = compare_with_cpu(step, sel, plain.ids, cpu_plain_ids);
    if (cpu.bad_rows > 0) {
      failure = "plain GPU vs CPU reference: " + std::to_string(cpu.bad_rows) +
                " rows differ beyond near-ties (first: " + cpu.first_bad + ")";
    }
  }
  if (failure.empty()) {
    std::printf("gpu selection: plain GPU == CPU reference (%lld rows x %d heads: %lld exact, "
                "%lld near-ties within 1e-3 relative); context-parallel == plain GPU on every "
                "rank, bitwise\n",
                static_cast<long long>(n), T, static_cast<long long>(cpu.exact_rows),
                static_cast<long long>(cpu.near_tie_rows));
  } else {
    std::printf("gpu selection: FAILED: %s\n", failure.c_str());
  }
  std::fflush(stdout);
  return failure.empty() ? kExitOk : kExitFailed;
}

// One rank's GpuRank without its ids, as fixed-size bytes for the host all_gather (the same
// binary on every rank, so the layout agrees).
struct GpuRankRecord {
  int32_t status_code = 0;  // StatusCode of the rank's run
  int32_t device_errors = 0;
  int32_t device = 0, head_offset = 0, local_heads = 0, unused = 0;
  double gather_q_ms = -1, score_ms = -1, gather_keys_ms = -1, merge_ms = -1, step_ms = -1;
  char message[200] = {};  // the status message, cut to fit
};

GpuRankRecord record_of(const GpuRank& r) {
  GpuRankRecord x;
  x.status_code = static_cast<int32_t>(r.status.code());
  x.device_errors = r.device_errors;
  x.device = r.device;
  x.head_offset = r.head_offset;
  x.local_heads = r.local_heads;
  x.gather_q_ms = r.gather_q_ms;
  x.score_ms = r.score_ms;
  x.gather_keys_ms = r.gather_keys_ms;
  x.merge_ms = r.merge_ms;
  x.step_ms = r.step_ms;
  std::snprintf(x.message, sizeof(x.message), "%s", r.status.message().c_str());
  return x;
}

// Rank `rank`'s GpuRank from its record and its [ids | stage ids] slice of `per_rank` ids each.
GpuRank rank_of(int rank, GpuRankRecord x, const int32_t* ids, size_t per_rank, int64_t n, int K) {
  GpuRank r;
  x.message[sizeof(x.message) - 1] = '\0';
  if (x.status_code != 0) r.status = Status(static_cast<StatusCode>(x.status_code), x.message);
  r.rank = rank;
  r.device = x.device;
  r.head_offset = x.head_offset;
  r.local_heads = x.local_heads;
  r.device_errors = x.device_errors;
  r.gather_q_ms = x.gather_q_ms;
  r.score_ms = x.score_ms;
  r.gather_keys_ms = x.gather_keys_ms;
  r.merge_ms = x.merge_ms;
  r.step_ms = x.step_ms;
  const size_t count =
      std::min(per_rank, static_cast<size_t>(std::max(x.local_heads, 0)) * n * K);
  r.ids.assign(ids, ids + count);
  r.stage_ids.assign(ids + per_rank, ids + per_rank + count);
  return r;
}

}  // namespace

int run_demo_gpu(const SyntheticStep& step, const Selection& sel, int ranks, bool real_gpus,
                 const std::vector<int32_t>& cpu_plain_ids) {
  const int P = ranks;
  std::string how;
  if (real_gpus) {
    how = "context-parallel step on GPUs 0-" + std::to_string(P - 1) + " through " +
          exchange_text("nccl") + ", one thread per GPU" + nvls_note("nccl");
  } else {
    how = "context-parallel rank work of " + std::to_string(P) + " ranks simulated on GPU 0 " +
          "(exchanges are in-place reads" +
          (gpu_count() >= 2 ? "; --gpus runs P ranks on P real GPUs)" : ")");
  }
  print_gpu_header(0, how);

  const GpuPlain plain = run_plain(step, sel);
  std::vector<GpuRank> runs;
#if defined(CPIDX_WITH_NCCL)
  if (real_gpus) runs = run_real(step, sel, P);
#endif
  if (!real_gpus) runs = run_simulated(step, sel, P);
  return print_gpu_report(step, sel, plain, runs, real_gpus, cpu_plain_ids);
}

int run_demo_gpu_mpi(Communicator& host, const SyntheticStep& step, const Selection& sel,
                     const std::string& exchange, const std::vector<int32_t>& cpu_plain_ids) {
  const int P = host.world_size(), T = step.config.total_heads, K = sel.topk;
  const int64_t n = step.num_rows();
  const bool printer = host.rank() == 0;
  const int device = process_device(host);
  Geometry geo;
  if (Status s = make_geometry(T, P, 0, &geo); !s.is_ok()) {
    // The caller checked the geometry; the same answer on every rank, before any collective.
    if (printer) std::fprintf(stderr, "cpidx demo: --heads: %s\n", s.to_string().c_str());
    return kExitFailed;
  }
  // Every rank owns L heads, so every rank's ids have the same size.
  const size_t per_rank = static_cast<size_t>(geo.local_heads * n * K);
  if (printer) {
    print_gpu_header(device, "context-parallel step on GPUs 0-" + std::to_string(P - 1) +
                                 " through " + exchange_text(exchange) +
                                 ", one MPI process per GPU" + nvls_note(exchange));
  }
  GpuPlain plain;
  if (printer) plain = run_plain(step, sel, device);

  GpuRank mine;
  {
    const size_t peer_bytes = peer_payload_bound(cp_gather_bytes(geo, n, K).larger());
    std::unique_ptr<Communicator> comm;
    const Status made = make_process_communicator(host, device, exchange, peer_bytes, &comm);
    if (made.is_ok()) {
      mine = real_rank(*comm, device, step, sel);
      // No gather may be in flight when the communicator goes (the peer one unmaps its buffers).
      cudaSetDevice(device);
      cudaDeviceSynchronize();
    } else {
      mine.rank = host.rank();
      mine.device = device;
      mine.status = made;  // every rank failed with it together: no collective left waiting
    }
  }  // every rank destroys its communicator here (collective for the peer one)

  // Every rank sends the same byte count, a failed one its record and ids padded with -2.
  const GpuRankRecord record = record_of(mine);
  std::vector<int32_t> ids(2 * per_rank, -2);  // [ids | stage ids]
  std::copy_n(mine.ids.begin(), std::min(per_rank, mine.ids.size()), ids.begin());
  std::copy_n(mine.stage_ids.begin(), std::min(per_rank, mine.stage_ids.size()),
              ids.begin() + static_cast<int64_t>(per_rank));
  std::vector<GpuRankRecord> records(static_cast<size_t>(P));
  std::vector<int32_t> all_ids(2 * per_rank * static_cast<size_t>(P));
  Status s = host.all_gather(&record, records.data(), sizeof(GpuRankRecord), nullptr);
  if (s.is_ok()) {
    s = host.all_gather(ids.data(), all_ids.data(), ids.size() * sizeof(int32_t), nullptr);
  }
  int32_t verdict = kExitOk;
  if (!s.is_ok()) {
    std::fprintf(stderr, "cpidx demo: rank %d: %s\n", host.rank(), s.to_string().c_str());
    verdict = kExitFailed;
  } else if (printer) {
    std::vector<GpuRank> runs;
    for (int r = 0; r < P; ++r) {
      runs.push_back(rank_of(r, records[static_cast<size_t>(r)],
                             all_ids.data() + 2 * per_rank * static_cast<size_t>(r), per_rank, n,
                             K));
    }
    verdict = print_gpu_report(step, sel, plain, runs, true, cpu_plain_ids);
  }
  // Rank 0's verdict (or a rank's failed gather) on every rank.
  std::vector<int32_t> verdicts(static_cast<size_t>(P));
  if (Status v = host.all_gather(&verdict, verdicts.data(), sizeof(int32_t), nullptr);
      !v.is_ok()) {
    std::fprintf(stderr, "cpidx demo: rank %d: %s\n", host.rank(), v.to_string().c_str());
    return kExitFailed;
  }
  return *std::max_element(verdicts.begin(), verdicts.end());
}

#endif

}  // namespace cpidx::tools
