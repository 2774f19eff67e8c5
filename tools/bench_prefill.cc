// tools/bench_prefill.cc: `cpidx bench --prefill`, the GPU prefill indexer benchmark: one request
// whose chunk of `chunk` new tokens follows `context` cached tokens (chunked prefill), for every
// chunk x context of the sweep. Each shape's calls are captured in one CUDA graph; the median
// replay over the call count is the time. TFLOP/s counts the useful work, 2 * heads * 128 *
// sum over the chunk's tokens of (pos + 1) (the causal part included); GB/s counts the unique
// bytes (cache pages of the request, queries, ids). `--kernel` picks the score kernel (mma.sync,
// Hopper wgmma, or both: one row per kernel and shape). The smallest shape is checked against
// the CPU reference, for every kernel.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "cpidx/prefill.h"
#include "cpidx/reference.h"
#include "cpidx/version.h"
#include "random_bits.h"
#include "subcommands.h"

#if defined(CPIDX_WITH_CUDA)
#include <cuda_runtime.h>

#include "graph_timing.h"
#endif

namespace cpidx::tools {

#if !defined(CPIDX_WITH_CUDA)
int run_prefill_bench(int argc, char** argv) {
  bool prefill = true;
  Flags flags("cpidx bench --prefill [flags]", "GPU prefill benchmark; needs a CUDA build.");
  flags.add("prefill", &prefill, "run the prefill benchmark");
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  std::fprintf(stderr, "cpidx bench --prefill: this build has no CUDA.\n");
  return kExitFailed;
}
#else
namespace {

constexpr double kHbmBytesPerSec = 4.27e12;   // measured H200 copy bandwidth (ANCHORS.md)
constexpr double kTensorFlopPerSec = 790e12;  // measured dense bf16 tensor rate (ANCHORS.md)

#define PREFILL_CUDA(expr)                                                                   \
  do {                                                                                       \
    const cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      return false;                                                                          \
    }                                                                                        \
  } while (0)

struct Shape {
  int64_t chunk = 0, context = 0;
  double flop() const {  // useful work: every token scores positions 0..pos
    const double c = static_cast<double>(chunk), x = static_cast<double>(context);
    return 2.0 * kHeadDim * (c * x + c * (c + 1) / 2);
  }
};

struct Result {
  Shape shape;
  std::string kernel;
  int stages = 0;
  double us = 0, tflops = 0, gbps = 0, mem_floor_us = 0, tc_floor_us = 0;
  int calls = 0;
  std::string check = "-";
};

// Device buffers sized for the largest shape; one Prefiller per score kernel serves every shape.
class PrefillBench {
 public:
  PrefillBench(int heads, int topk, DType dtype, int64_t max_chunk, int64_t max_context,
               std::vector<PrefillKernel> kernels)
      : kernels_(std::move(kernels)), heads_(heads), topk_(topk), dtype_(dtype), max_chunk_(max_chunk),
        max_seq_len_(static_cast<int32_t>(max_context + max_chunk)) {}
  ~PrefillBench() {
    for (void* p : {static_cast<void*>(cache_), static_cast<void*>(query_),
                    static_cast<void*>(table_), static_cast<void*>(lens_),
                    static_cast<void*>(ids_)}) {
      if (p) cudaFree(p);
    }
  }

  bool init();
  // Shape `sh` on the Prefiller of kernels()[k].
  bool run(const Shape& sh, size_t k, int replays, bool check, Result* r);
  size_t kernels() const { return pres_.size(); }
  const PrefillPlan& plan(size_t k) const { return pres_[k]->plan(); }

 private:
  PrefillInputs inputs(bool host) const;
  std::string check_against_reference(const Shape& sh, const Prefiller& pre);

  std::vector<PrefillKernel> kernels_;
  int heads_, topk_;
  DType dtype_;
  int64_t max_chunk_;
  int32_t max_seq_len_;
  int64_t num_pages_ = 0, page_bytes_ = 0;
  std::vector<std::unique_ptr<Prefiller>> pres_;
  std::vector<uint16_t> h_cache_, h_query_;  // the cache as raw 16-bit words (fp8: 2 per word)
  std::vector<int32_t> h_table_, h_lens_;     // h_lens_: cu_seqlens_q[2], context, seq_len
  void* cache_ = nullptr;
  uint16_t* query_ = nullptr;
  int32_t* table_ = nullptr;
  int32_t* lens_ = nullptr;
  int32_t* ids_ = nullptr;
};

bool PrefillBench::init() {
  PrefillConfig cfg;
  cfg.num_heads = heads_;
  cfg.max_tokens = static_cast<int>(max_chunk_);
  cfg.max_seq_len = max_seq_len_;
  cfg.sel.topk = topk_;
  cfg.cache_dtype = dtype_;
  for (const PrefillKernel k : kernels_) {
    cfg.kernel = k;
    std::unique_ptr<Prefiller> pre;
    const Status st = Prefiller::create(cfg, 0, &pre);
    if (!st.is_ok()) {
      std::fprintf(stderr, "Prefiller::create (kernel %s): %s\n", to_string(k), st.to_string().c_str());
      return false;
    }
    pres_.push_back(std::move(pre));
  }
  page_bytes_ = int64_t{kBlockSize} * kHeadDim * dtype_bytes(dtype_);
  num_pages_ = cdiv(max_seq_len_, kBlockSize);
  h_cache_.resize(static_cast<size_t>(num_pages_ * page_bytes_ / 2));
  fill_random_bf16(h_cache_, 1234);
  if (dtype_ == DType::kFP8E4M3) {
    for (auto& v : h_cache_) {  // two e4m3 bytes per word; NaN codes (x111_1111) avoided
      uint8_t* b = reinterpret_cast<uint8_t*>(&v);
      for (int i = 0; i < 2; ++i) if ((b[i] & 0x7F) == 0x7F) b[i] ^= 0x01;
    }
  }
  h_query_.resize(static_cast<size_t>(max_chunk_ * heads_ * kHeadDim));
  fill_random_bf16(h_query_, 99);
  h_table_.resize(static_cast<size_t>(num_pages_));
  std::iota(h_table_.begin(), h_table_.end(), 0);
  std::shuffle(h_table_.begin(), h_table_.end(), std::mt19937_64(7));
  PREFILL_CUDA(cudaMalloc(&cache_, h_cache_.size() * 2));
  PREFILL_CUDA(cudaMalloc(&query_, h_query_.size() * 2));
  PREFILL_CUDA(cudaMalloc(&table_, h_table_.size() * 4));
  PREFILL_CUDA(cudaMalloc(&lens_, 4 * 4));
  PREFILL_CUDA(cudaMalloc(&ids_, static_cast<size_t>(heads_ * max_chunk_ * topk_) * 4));
  PREFILL_CUDA(cudaMemcpy(cache_, h_cache_.data(), h_cache_.size() * 2, cudaMemcpyHostToDevice));
  PREFILL_CUDA(cudaMemcpy(query_, h_query_.data(), h_query_.size() * 2, cudaMemcpyHostToDevice));
  PREFILL_CUDA(cudaMemcpy(table_, h_table_.data(), h_table_.size() * 4, cudaMemcpyHostToDevice));
  return true;
}

// The current shape's inputs (h_lens_ set by run), on the device or as host copies.
PrefillInputs PrefillBench::inputs(bool host) const {
  PrefillInputs in;
  in.query = host ? h_query_.data() : query_;
  in.q_row_stride = int64_t{heads_} * kHeadDim;
  in.q_head_stride = kHeadDim;
  in.num_heads = heads_;
  in.cache.data = host ? static_cast<const void*>(h_cache_.data()) : cache_;
  in.cache.dtype = dtype_;
  in.cache.num_pages = num_pages_;
  in.block_table = host ? h_table_.data() : table_;
  in.bt_row_stride = num_pages_;
  const int32_t* lens = host ? h_lens_.data() : lens_;
  in.cu_seqlens_q = lens;
  in.context_lens = lens + 2;
  in.seq_lens = lens + 3;
  in.num_reqs = 1;
  in.num_tokens = h_lens_[1];
  in.max_seq_len = max_seq_len_;
  in.scale = 0.08838834764831845f;
  return in;
}

std::string PrefillBench::check_against_reference(const Shape& sh, const Prefiller& pre) {
  const int64_t n = sh.chunk, K = topk_;
  std::vector<int32_t> got(static_cast<size_t>(heads_ * n * K)), want(got.size());
  if (cudaMemcpy(got.data(), ids_, got.size() * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return "copy-error";
  }
  const PrefillInputs in = inputs(true);
  const Selection sel = pre.config().sel;
  int32_t err = 0;
  if (!ref::prefill_topk(in, sel, TopkOutput{want.data(), n * K, K}, &err).is_ok()) return "ref-error";
  const ref::IdsComparison cmp =
      ref::compare_ids(in, sel, TopkOutput{got.data(), n * K, K}, TopkOutput{want.data(), n * K, K});
  char buf[64];
  if (cmp.bad_rows) {
    std::snprintf(buf, sizeof(buf), "FAIL(%lld)", static_cast<long long>(cmp.bad_rows));
  } else {
    std::snprintf(buf, sizeof(buf), cmp.near_tie_rows ? "ok(%lld tie)" : "ok",
                  static_cast<long long>(cmp.near_tie_rows));
  }
  return buf;
}

bool PrefillBench::run(const Shape& sh, size_t k, int replays, bool check, Result* r) {
  Prefiller& pre = *pres_[k];
  r->shape = sh;
  r->kernel = to_string(pre.plan().kernel);
  r->stages = pre.plan().stages;
  h_lens_ = {0, static_cast<int32_t>(sh.chunk), static_cast<int32_t>(sh.context),
             static_cast<int32_t>(sh.context + sh.chunk)};
  PREFILL_CUDA(cudaMemcpy(lens_, h_lens_.data(), 16, cudaMemcpyHostToDevice));
  const PrefillInputs in = inputs(false);
  const TopkOutput out{ids_, sh.chunk * topk_, topk_};
  cudaStream_t stream;
  PREFILL_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Status st = pre.prefill(in, out, stream);  // eager: the checked run
  PREFILL_CUDA(cudaStreamSynchronize(stream));
  if (!st.is_ok()) {
    r->check = "run: " + st.message();
    cudaStreamDestroy(stream);
    return true;
  }
  if (check) r->check = check_against_reference(sh, pre);

  const double flop = sh.flop() * heads_;
  r->calls = static_cast<int>(std::clamp(std::ceil(2e11 / flop), 1.0, 32.0));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  PREFILL_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < r->calls && st.is_ok(); ++c) st = pre.prefill(in, out, stream);
  PREFILL_CUDA(cudaStreamEndCapture(stream, &graph));
  PREFILL_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  float median_ms = 0;
  PREFILL_CUDA(median_graph_ms(exec, stream, 2, replays, &median_ms));  // two warm-up replays
  r->us = median_ms * 1e3 / r->calls;
  const double bytes = static_cast<double>(cdiv(sh.context + sh.chunk, kBlockSize)) * page_bytes_ +
                       static_cast<double>(sh.chunk) * heads_ * kHeadDim * 2 +
                       static_cast<double>(sh.chunk) * heads_ * topk_ * 4;
  r->tflops = flop / (r->us * 1e-6) / 1e12;
  r->gbps = bytes / (r->us * 1e-6) / 1e9;
  r->mem_floor_us = bytes / kHbmBytesPerSec * 1e6;
  r->tc_floor_us = flop / kTensorFlopPerSec * 1e6;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  if (!st.is_ok()) r->check = "capture: " + st.message();
  return true;
}

bool write_json(const std::string& path, const std::vector<Result>& results, int heads, int topk,
                const std::string& dtype, const PrefillPlan& plan) {  // plan: the first kernel's
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::fprintf(f,
               "{\"cpidx_version\": \"%s\", \"device\": \"%s\", \"op\": \"prefill\", "
               "\"dtype\": \"%s\", \"heads\": %d, \"topk\": %d, \"stages\": %d, "
               "\"max_splits\": %d, \"results\": [\n",
               CPIDX_VERSION, prop.name, dtype.c_str(), heads, topk, plan.stages, plan.max_splits);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::fprintf(f,
                 "  {\"chunk\": %lld, \"context\": %lld, \"kernel\": \"%s\", \"stages\": %d, "
                 "\"calls\": %d, \"us\": %.3f, \"tflops\": %.2f, \"gbps\": %.1f, "
                 "\"mem_floor_us\": %.3f, \"tc_floor_us\": %.3f, \"check\": \"%s\"}%s\n",
                 static_cast<long long>(r.shape.chunk), static_cast<long long>(r.shape.context),
                 r.kernel.c_str(), r.stages, r.calls, r.us, r.tflops, r.gbps, r.mem_floor_us, r.tc_floor_us, r.check.c_str(),
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return true;
}

}  // namespace

int run_prefill_bench(int argc, char** argv) {
  bool prefill = true, check = true;
  std::vector<int64_t> chunk_list = {1 << 10, 4 << 10, 16 << 10}, context_list = {8 << 10, 128 << 10, 1 << 20};
  std::string json, dtype = "bf16", kernel = "both";
  int64_t heads = 4, topk = 16, replays = 10;
  Flags flags("cpidx bench --prefill [flags]",
              "GPU prefill benchmark: one request, `chunk` new tokens after `context` cached\n"
              "ones, for every chunk x context. Each shape's calls run in one CUDA graph; median\n"
              "replay / calls. TFLOP/s counts 2 * heads * 128 * sum(pos + 1) (causal part\n"
              "included); tc_floor_us is that work at 790 TFLOP/s, mem_floor_us the unique bytes\n"
              "at 4.27 TB/s. The smallest shape is checked against the CPU reference.");
  flags.add("prefill", &prefill, "run the prefill benchmark (this mode)")
      .add("chunks", &chunk_list, "chunk lengths (new tokens)", 1, 1 << 24)
      .add("contexts", &context_list, "cached context lengths", 0, 1 << 24)
      .add("heads", &heads, "index heads scored", 1, kMaxHeads)
      .add("topk", &topk, "K", 1, kMaxTopK)
      .add("dtype", &dtype, "index cache dtype", {"bf16", "fp8"})
      .add("kernel", &kernel, "score kernel: mma (mma.sync), wgmma (Hopper), or both (one row each)",
           {"mma", "wgmma", "both"})
      .add("replays", &replays, "timed graph replays per shape (at least 10)")
      .add("check", &check, "check the smallest shape against the CPU reference")
      .add("json", &json, "write the results as JSON to this file");
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  if (!gpu_available()) {
    std::fprintf(stderr, "cpidx bench --prefill: no usable GPU\n");
    return kExitFailed;
  }
  std::vector<Shape> shapes;
  for (int64_t c : chunk_list)
    for (int64_t x : context_list) shapes.push_back({c, x});
  const auto smallest = std::min_element(shapes.begin(), shapes.end(), [](const Shape& a, const Shape& b) {
    return a.flop() < b.flop();
  });
  const int64_t max_chunk = *std::max_element(chunk_list.begin(), chunk_list.end());
  const int64_t max_context = *std::max_element(context_list.begin(), context_list.end());
  std::vector<PrefillKernel> kernels;
  if (kernel != "wgmma") kernels.push_back(PrefillKernel::kMmaSync);
  if (kernel != "mma") kernels.push_back(PrefillKernel::kWgmma);
  PrefillBench bench(static_cast<int>(heads), static_cast<int>(topk),
                     dtype == "fp8" ? DType::kFP8E4M3 : DType::kBF16, max_chunk, max_context,
                     kernels);
  if (!bench.init()) return kExitFailed;
  std::printf("# prefill: %lld heads, K=%lld, %s cache, up to %d splits;",
              static_cast<long long>(heads), static_cast<long long>(topk), dtype.c_str(),
              bench.plan(0).max_splits);
  for (size_t k = 0; k < bench.kernels(); ++k) {
    std::printf(" %s: %d stages, %zu B smem%s", to_string(bench.plan(k).kernel),
                bench.plan(k).stages, bench.plan(k).smem_bytes, k + 1 < bench.kernels() ? "," : "\n");
  }
  std::printf("%7s %8s %6s %6s %10s %9s %9s %12s %11s  %s\n", "chunk", "context", "kernel",
              "calls", "us", "TFLOP/s", "GB/s", "mem_floor_us", "tc_floor_us", "check");
  std::vector<Result> results;
  bool all_ok = true;
  for (const Shape& sh : shapes) {
    for (size_t k = 0; k < bench.kernels(); ++k) {
      Result r;
      if (!bench.run(sh, k, static_cast<int>(std::max<int64_t>(replays, 10)),
                     check && &sh == &*smallest, &r)) {
        return kExitFailed;
      }
      all_ok = all_ok && (r.check == "-" || r.check.rfind("ok", 0) == 0);
      std::printf("%7lld %8lld %6s %6d %10.1f %9.1f %9.0f %12.1f %11.1f  %s\n",
                  static_cast<long long>(sh.chunk), static_cast<long long>(sh.context),
                  r.kernel.c_str(), r.calls, r.us, r.tflops, r.gbps, r.mem_floor_us,
                  r.tc_floor_us, r.check.c_str());
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  if (!json.empty() && !write_json(json, results, static_cast<int>(heads), static_cast<int>(topk),
                                   dtype, bench.plan(0))) {
    std::fprintf(stderr, "cannot write %s\n", json.c_str());
    return kExitFailed;
  }
  return all_ok ? kExitOk : kExitFailed;
}
#endif

}  // namespace cpidx::tools
