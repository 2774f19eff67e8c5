// GPU test helpers: device copies of a test batch, device output buffers poisoned before each run,
// the simulated context-parallel ranks on one GPU, and the id comparison of CONTRACT.md section 4
// (exact, except swaps among blocks within 1e-3 relative of the K-th score).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpidx/device_channel.h"
#include "cpidx/indexer.h"
#include "cpidx/reference.h"
#include "test_util.h"

namespace cpidx_gpu_test {

using cpidx_test::DecodeData;

// `expr` runs once (its error text is taken from the same result).
#define CUDA_OK(expr)                                                         \
  do {                                                                        \
    const cudaError_t cuda_ok_e_ = (expr);                                    \
    ASSERT_EQ(cuda_ok_e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(cuda_ok_e_); \
  } while (0)

#define SKIP_WITHOUT_GPU()                                                    \
  do {                                                                        \
    if (!cpidx::gpu_available()) GTEST_SKIP() << "no CUDA device";            \
  } while (0)

template <typename T>
struct DeviceVec {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceVec() = default;
  explicit DeviceVec(size_t n) : count(n) {
    if (n) cudaMalloc(&ptr, n * sizeof(T));
  }
  explicit DeviceVec(const std::vector<T>& host) : DeviceVec(host.size()) { upload(host); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  ~DeviceVec() { if (ptr) cudaFree(ptr); }
  void upload(const std::vector<T>& host) {
    cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> h(count);
    cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  void poison() { cudaMemset(ptr, 0x7B, count * sizeof(T)); }
};

// One enqueue (a decode or prefill call) captured into a CUDA graph on a stream of its own, for
// replays after the inputs change in place.
class CapturedGraph {
 public:
  explicit CapturedGraph(const std::function<cpidx::Status(cudaStream_t)>& enqueue) {
    if (!cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream")) return;
    if (!cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), "begin capture")) {
      return;
    }
    status_ = enqueue(stream_);
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    graph_ = graph;
    if (!status_.is_ok() || !cuda(end, "end capture")) return;
    cuda(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  // The enqueue's Status, or the CUDA call that failed around it.
  const cpidx::Status& status() const { return status_; }
  // One replay, waited for.
  cudaError_t replay() {
    const cudaError_t e = cudaGraphLaunch(exec_, stream_);
    return e != cudaSuccess ? e : cudaStreamSynchronize(stream_);
  }

 private:
  bool cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    status_ = cpidx::Status(cpidx::StatusCode::kCudaError,
                            std::string(what) + ": " + cudaGetErrorString(e));
    return false;
  }
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cpidx::Status status_;
};

// Device memory allocated after an object's destruction, filled with a pattern: where a freed
// workspace would go. untouched() says whether anything stored into it since (a graph replaying
// into the freed workspace would).
class LaterAllocations {
 public:
  LaterAllocations(int count, size_t bytes) : bytes_(bytes) {
    for (int i = 0; i < count; ++i) {
      blocks_.push_back(std::make_unique<DeviceVec<uint8_t>>(bytes));
      cudaMemset(blocks_.back()->ptr, 0xA5, bytes);
    }
  }
  bool untouched() const {
    std::vector<uint8_t> host(bytes_);
    for (const auto& b : blocks_) {
      if (cudaMemcpy(host.data(), b->ptr, bytes_, cudaMemcpyDeviceToHost) != cudaSuccess) {
        return false;
      }
      for (uint8_t v : host) {
        if (v != 0xA5) return false;
      }
    }
    return true;
  }

 private:
  size_t bytes_;
  std::vector<std::unique_ptr<DeviceVec<uint8_t>>> blocks_;
};

// A DecodeData mirrored on the device.
struct DeviceBatch {
  explicit DeviceBatch(const DecodeData& d)
      : host(d), query(d.query), seq_lens(d.seq_lens), block_table(d.block_table) {
    if (d.dtype == cpidx::DType::kBF16) {
      cache16 = std::make_unique<DeviceVec<uint16_t>>(d.cache_bf16);
    } else {
      cache8 = std::make_unique<DeviceVec<uint8_t>>(d.cache_fp8);
    }
  }
  // Device inputs for global heads [head_begin, head_begin + heads).
  cpidx::DecodeInputs inputs(int head_begin, int heads) const {
    cpidx::DecodeInputs in = host.inputs(head_begin, heads);
    in.query = query.ptr + static_cast<int64_t>(head_begin) * cpidx::kHeadDim;
    in.cache.data = cache16 ? static_cast<const void*>(cache16->ptr)
                            : static_cast<const void*>(cache8->ptr);
    in.block_table = block_table.ptr;
    in.seq_lens = seq_lens.ptr;
    return in;
  }
  cpidx::DecodeInputs all_heads() const { return inputs(0, host.total_heads); }
  const DecodeData& host;
  DeviceVec<uint16_t> query;
  DeviceVec<int32_t> seq_lens;
  DeviceVec<int32_t> block_table;
  std::unique_ptr<DeviceVec<uint16_t>> cache16;
  std::unique_ptr<DeviceVec<uint8_t>> cache8;
};

// Which decode path the helpers' Decoders take: the fused path, the split path (scores to L2,
// then a selection kernel) or the library's automatic choice. Tests run both paths on the same
// inputs and expect the same ids, bit for bit.
enum class Path { kAuto, kFused, kSplit };
constexpr Path kBothPaths[] = {Path::kFused, Path::kSplit};
inline Path& test_path() {
  static Path path = Path::kAuto;
  return path;
}
inline const char* path_name(Path p) {
  return p == Path::kFused ? "fused" : p == Path::kSplit ? "split" : "auto";
}

// Sets a test-wide choice (the static that `Get` returns) while in scope, then restores it.
template <typename T, T& (*Get)()>
struct ScopedChoice {
  explicit ScopedChoice(T v) : prev(Get()) { Get() = v; }
  ~ScopedChoice() { Get() = prev; }
  ScopedChoice(const ScopedChoice&) = delete;
  ScopedChoice& operator=(const ScopedChoice&) = delete;
  T prev;
};
// Sets the path for the helpers while in scope.
using UsePath = ScopedChoice<Path, test_path>;
// A floor under the helpers' DecodeConfig::max_tokens (0: each batch's own rows), as an engine
// that plans for far more tokens than a test's batch has.
inline int& test_max_tokens() {
  static int floor = 0;
  return floor;
}
using UseMaxTokens = ScopedChoice<int, test_max_tokens>;
// The helpers' DecodeConfig::max_query_len: the library's default (false) or each batch's own
// query length (true), which gives the narrowest scoring instance (and, for fp8 pages, four
// scoring CTAs per SM up to 8 columns, three up to 16).
inline bool& test_tight_query_bound() {
  static bool tight = false;
  return tight;
}
using UseTightQueryBound = ScopedChoice<bool, test_tight_query_bound>;
// The helpers' DecodeConfig::scoring_ctas_per_sm (0: the library's automatic count).
inline int& test_ctas_per_sm() {
  static int ctas = 0;
  return ctas;
}
using UseCtasPerSm = ScopedChoice<int, test_ctas_per_sm>;
// The helpers' DecodeConfig::exchange_buffers (cp_decode's gather buffers; the library's
// default, true).
inline bool& test_exchange_buffers() {
  static bool reserved = true;
  return reserved;
}
using UseExchangeBuffers = ScopedChoice<bool, test_exchange_buffers>;

inline cpidx::DecodeConfig config_for(const DecodeData& d, const cpidx::Selection& sel,
                                      int world = 1, int rank = 0, int max_tokens = 0) {
  cpidx::DecodeConfig c;
  c.total_heads = d.total_heads;
  c.world_size = world;
  c.rank = rank;
  c.max_tokens = max_tokens > 0 ? max_tokens : static_cast<int>(std::max<int64_t>(d.rows(), 1));
  c.max_tokens = std::max(c.max_tokens, test_max_tokens());
  c.max_seq_len = d.max_seq_len;
  c.sel = sel;
  c.cache_dtype = d.dtype;
  if (test_tight_query_bound()) c.max_query_len = d.query_len;
  c.scoring_ctas_per_sm = test_ctas_per_sm();
  c.exchange_buffers = test_exchange_buffers();
  // Split forced: every test shape (<= 16M tokens of context per step) fits 2^17 pages.
  c.split_max_pages = test_path() == Path::kFused   ? 0
                      : test_path() == Path::kSplit ? int64_t{1} << 17
                                                    : cpidx::DecodeConfig::kAutoSplit;
  return c;
}

// One int32 of device memory (an error flag), read back; -1 when the copy fails (also reported).
inline int32_t read_device_int(const int32_t* p) {
  int32_t v = -1;
  EXPECT_EQ(cudaMemcpy(&v, p, sizeof(v), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// The plain GPU decode of every head on `device` (the current device): ids [T][n][K], host copy.
inline std::vector<int32_t> gpu_decode(const DecodeData& d, const cpidx::Selection& sel,
                                       int32_t* error_flag = nullptr, int device = 0) {
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  cpidx::Status st = cpidx::Decoder::create(config_for(d, sel), device, &dec);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (!st.is_ok()) return {};
  const int64_t n = d.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * sel.topk));
  ids.poison();
  st = dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk}, nullptr,
                   nullptr);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (error_flag) cudaMemcpy(error_flag, dec->error_flag(), 4, cudaMemcpyDeviceToHost);
  return ids.download();
}

// A CUDA graph of one plain decode of every head of `b` into `ids` ([T][n][K]), for replays after
// the batch's device inputs change in place.
inline std::unique_ptr<CapturedGraph> capture_decode(cpidx::Decoder& dec, const DeviceBatch& b,
                                                     DeviceVec<int32_t>& ids, int topk) {
  const int64_t n = b.host.rows();
  return std::make_unique<CapturedGraph>([&dec, &b, &ids, n, topk](cudaStream_t stream) {
    return dec.decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * topk, topk}, nullptr, stream);
  });
}

// Context-parallel rank work of P simulated ranks on one GPU (the exchanges are device copies):
// returns the ids of every global head [T][n][K], assembled from each head's owner rank.
inline std::vector<int32_t> gpu_cp_simulated(const DecodeData& d, const cpidx::Selection& sel,
                                             int world) {
  DeviceBatch b(d);
  const int T = d.total_heads;
  const int64_t n = d.rows();
  const size_t per_rank = static_cast<size_t>(T) * n * sel.topk;
  DeviceVec<cpidx::Key> gathered(per_rank * world);
  cudaMemset(gathered.ptr, 0xAB, gathered.count * sizeof(cpidx::Key));
  std::vector<std::unique_ptr<cpidx::Decoder>> decs(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    cpidx::Status st = cpidx::Decoder::create(config_for(d, sel, world, r), 0, &decs[r]);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    if (!st.is_ok()) return {};
    st = decs[r]->shard_keys(b.all_heads(), gathered.ptr + per_rank * r, nullptr);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  std::vector<int32_t> all(per_rank, cpidx_test::kPoison);
  for (int r = 0; r < world; ++r) {
    const cpidx::Geometry& geo = decs[r]->geometry();
    DeviceVec<int32_t> ids(static_cast<size_t>(geo.local_heads) * n * sel.topk);
    ids.poison();
    cpidx::Status st = decs[r]->merge(gathered.ptr, b.all_heads(),
                                      cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk},
                                      nullptr, nullptr);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    std::vector<int32_t> h = ids.download();
    for (int j = 0; j < geo.local_heads; ++j) {
      const int head = geo.head_offset + j;
      std::copy(h.begin() + static_cast<int64_t>(j) * n * sel.topk,
                h.begin() + static_cast<int64_t>(j + 1) * n * sel.topk,
                all.begin() + static_cast<int64_t>(head) * n * sel.topk);
    }
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return all;
}

// CPU reference ids [T][n][K].
inline std::vector<int32_t> cpu_decode(const DecodeData& d, const cpidx::Selection& sel) {
  cpidx_test::IdsBuffer ids(d.total_heads, d.rows(), sel.topk);
  int32_t err = 0;
  cpidx::Status st = cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, &err);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return ids.ids;
}

using CompareResult = cpidx::ref::IdsComparison;

// GPU ids vs CPU ids ([T][n][K] each) by the contract's rule (cpidx::ref::compare_ids).
inline CompareResult compare_ids(const DecodeData& d, const cpidx::Selection& sel,
                                 const std::vector<int32_t>& gpu, const std::vector<int32_t>& cpu) {
  const int64_t n = d.rows();
  const cpidx::TopkOutput got{const_cast<int32_t*>(gpu.data()), n * sel.topk, sel.topk};
  const cpidx::TopkOutput want{const_cast<int32_t*>(cpu.data()), n * sel.topk, sel.topk};
  return cpidx::ref::compare_ids(d.all_heads(), sel, got, want);
}

// Both GPU paths (the Decoder as the Use* scopes set it up) against one CPU reference, every
// output written, and against each other bit for bit; `what` names the case in a failure.
inline void expect_matches_reference(const DecodeData& d, const cpidx::Selection& sel,
                                     const std::string& what) {
  const std::vector<int32_t> cpu = cpu_decode(d, sel);
  std::vector<int32_t> fused;
  for (Path path : kBothPaths) {
    UsePath use(path);
    SCOPED_TRACE(path_name(path));
    const std::vector<int32_t> gpu = gpu_decode(d, sel);
    ASSERT_EQ(gpu.size(), cpu.size());
    for (int32_t v : gpu) ASSERT_NE(v, cpidx_test::kPoison) << what << ": unwritten output";
    const CompareResult r = compare_ids(d, sel, gpu, cpu);
    EXPECT_EQ(r.bad_rows, 0) << what << ": " << r.first_bad;
    // Near ties are rare on random data; a systematic error would show up as many of them.
    EXPECT_LE(r.near_tie_rows, std::max<int64_t>(2, (r.exact_rows + r.near_tie_rows) / 50))
        << what;
    if (path == Path::kFused) fused = gpu;
    else EXPECT_EQ(gpu, fused) << what << ": the two paths differ";
  }
}

// Both GPU paths equal to the CPU reference id for id, in order: for inputs whose dot products
// are exact (small integers, Values::kTies), where the contract fixes every tie's order.
inline void expect_exact_on_both_paths(const DecodeData& d, const cpidx::Selection& sel,
                                       const std::string& what) {
  const std::vector<int32_t> want = cpu_decode(d, sel);
  for (Path path : kBothPaths) {
    UsePath use(path);
    EXPECT_EQ(gpu_decode(d, sel), want) << what << " " << path_name(path);
  }
}

// A communicator that runs no collective: all_gather only counts its calls, and check_agree
// records what this rank offers and answers as its peers would: ok, or, when they are scripted
// to offer `peer_offers`, kCommError unless this rank offered the same. `channel`, when set, is
// offered as its device channel (its pointers are never valid: script the peers so that no
// kernel runs).
class ScriptedComm final : public cpidx::Communicator {
 public:
  ScriptedComm(int rank, int world, cpidx::MemorySpace space = cpidx::MemorySpace::kDevice,
               std::optional<long long> peer_offers = std::nullopt)
      : rank_(rank), world_(world), space_(space), peer_offers_(peer_offers) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  cpidx::MemorySpace memory_space() const override { return space_; }
  cpidx::Status all_gather(const void*, void* recv, size_t bytes, cudaStream_t stream) override {
    ++gathers;
    if (gather_writes) {  // a stream-ordered write, as a real gather's: its failure returned
      const cudaError_t e = cudaMemsetAsync(recv, 0, bytes, stream);
      if (e != cudaSuccess) {
        return cpidx::Status(cpidx::StatusCode::kCommError,
                             std::string("all_gather: ") + cudaGetErrorName(e));
      }
    }
    return cpidx::Status::ok();
  }
  cpidx::Status check_agree(long long value, const char* what) override {
    offered.push_back(value);
    labels.emplace_back(what != nullptr ? what : "");
    if (!peer_offers_ || value == *peer_offers_) return cpidx::Status::ok();
    return cpidx::Status(cpidx::StatusCode::kCommError, "the ranks disagree");
  }
  // The settings round: recorded; refused naming the first value unlike peer_settings' (when
  // set), as a host channel would.
  cpidx::Status check_agree_all(const long long* values, const char* const* names,
                                int count) override {
    settings.assign(values, values + count);
    setting_names.assign(names, names + count);
    for (int i = 0; peer_settings && i < count; ++i) {
      if (values[i] != (*peer_settings)[static_cast<size_t>(i)]) {
        return cpidx::Status(cpidx::StatusCode::kCommError,
                             std::string("ranks disagree on ") + names[i]);
      }
    }
    return cpidx::Status::ok();
  }
  cpidx::Status barrier() override { return cpidx::Status::ok(); }
  const cpidx::DeviceChannel* device_channel() const override {
    return channel ? &*channel : nullptr;
  }
  size_t max_bytes_per_rank() const override { return max_bytes; }
  int device() const override { return gpu_device; }
  int gathers = 0;
  std::vector<long long> offered;
  std::vector<std::string> labels;
  std::vector<long long> settings;
  std::vector<std::string> setting_names;
  std::optional<std::vector<long long>> peer_settings;
  std::optional<cpidx::DeviceChannel> channel;
  size_t max_bytes = SIZE_MAX;
  bool gather_writes = false;  // all_gather zeroes recv on the stream (see all_gather)
  int gpu_device = -1;         // the device it says it gathers on (-1: it does not say)

 private:
  int rank_, world_;
  cpidx::MemorySpace space_;
  std::optional<long long> peer_offers_;
};

// Runs `call` (one entry point, on `stream`) while the stream's capture is invalidated, so that
// the call's first launch or stream-ordered copy fails. The call must return kCudaError (or a
// gather's kCommError) naming the capture's error and leave no CUDA error pending: otherwise
// the caller's next error check (torch's after its next kernel) reports it again, against that
// kernel. The premise is checked
// first: a plain copy refused on that stream does leave its error pending.
inline void expect_failed_launch_leaves_nothing_pending(
    cudaStream_t stream, const std::function<cpidx::Status()>& call) {
  int* scratch = nullptr;
  CUDA_OK(cudaMalloc(&scratch, sizeof(int)));
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  EXPECT_NE(cudaStreamSynchronize(stream), cudaSuccess);  // refused; invalidates the capture
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaStreamIsCapturing(stream, &capture), cudaSuccess);
  EXPECT_EQ(capture, cudaStreamCaptureStatusInvalidated);
  cudaGetLastError();
  EXPECT_NE(cudaMemsetAsync(scratch, 0, sizeof(int), stream), cudaSuccess);
  EXPECT_NE(cudaPeekAtLastError(), cudaSuccess) << "a refused copy left no error: no premise";
  cudaGetLastError();
  const cpidx::Status st = call();
  const cudaError_t left = cudaPeekAtLastError();
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream, &graph);  // refused: the capture is invalid
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
  EXPECT_TRUE(st.code() == cpidx::StatusCode::kCudaError ||
              st.code() == cpidx::StatusCode::kCommError)
      << st.to_string();
  EXPECT_NE(st.message().find("cudaErrorStreamCapture"), std::string::npos) << st.to_string();
  EXPECT_EQ(left, cudaSuccess) << "left pending: " << cudaGetErrorName(left);
  CUDA_OK(cudaFree(scratch));
}

}  // namespace cpidx_gpu_test
