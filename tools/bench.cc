// tools/bench.cc: `cpidx bench`, the GPU decode benchmark over the grid of TARGETS.md: requests x
// context x query length for the plain decode (h heads) and the context-parallel rank work
// (all heads on a 1/P shard + merge; P ranks simulated on one GPU). Each shape's calls over
// several input sets (rotated past the L2) are captured in one CUDA graph; the median replay
// over the call count is the time. A correctness column checks set 0 against the CPU reference.
// Under mpirun (`mpirun -np P cpidx bench --modes stepP`) each process is one rank of the real
// step on its own GPU, and rank 0 prints.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "args.h"
#include "bench_step.h"
#include "cpidx/indexer.h"
#include "cpidx/reference.h"
#include "cpidx/version.h"
#include "mpi_session.h"
#include "random_bits.h"
#include "subcommands.h"

#if defined(CPIDX_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/score_trace.cuh"
#include "graph_timing.h"
#include "neighbour_kernel.h"
#endif

namespace cpidx::tools {
namespace {

// `--prefill` or `--prefill=true` (or =1) anywhere: the prefill benchmark, which has its own
// flags. `--prefill=false` stays with the decode benchmark, whose parser takes it.
bool prefill_asked(int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--prefill" || arg == "--prefill=true" || arg == "--prefill=1") return true;
  }
  return false;
}

}  // namespace

#if !defined(CPIDX_WITH_CUDA)
int run_bench(int argc, char** argv) {
  if (prefill_asked(argc, argv)) return run_prefill_bench(argc, argv);
  bool prefill = false;
  Flags flags("cpidx bench [flags]", "GPU decode benchmark; needs a CUDA build.");
  flags.add("prefill", &prefill, "run the prefill benchmark instead (its own flags)");
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  std::fprintf(stderr, "cpidx bench: this build has no CUDA; `cpidx demo` runs on the CPU.\n");
  return kExitFailed;
}
#else
namespace {

#define BENCH_CUDA(expr)                                                              \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,               \
                   cudaGetErrorString(e_));                                           \
      std::exit(kExitFailed);                                                         \
    }                                                                                 \
  } while (0)

constexpr int64_t kPageBytesBf16 = 128 * 128 * 2;

struct Shape {
  std::string mode;  // "plain" or "cp"
  int heads = 4;     // heads scored by the plain decode (cp always scores all T = 4)
  int world = 1;
  int reqs = 1;
  int64_t context = 8192;
  int qlen = 1;
};

struct InputSet {  // one batch: device queries, block table, seq_lens
  int16_t* query = nullptr;
  int32_t* block_table = nullptr;
  int32_t* seq_lens = nullptr;
  std::vector<int32_t> h_block_table, h_seq_lens;
  std::vector<uint16_t> h_query;
};

struct Result {
  Shape shape;
  double us = 0, gbps = 0, cache_mb = 0, floor_us = 0;
  double gpu_us = 0;  // the same replays with the stream held until they are queued
  double max_us = 0;  // the slowest replay / calls (a mode some replays take shows here)
  int max_at = 0;     // which timed replay it was (0: the first after the warm-up ones)
  double neighbour_us = 0;  // the neighbour kernels alone, per call (subtracted from us, max_us)
  int sets = 0, calls = 0, grid = 0, stages = 0, offset_stride = 1;
  std::string check;
};

// What the trace build's buffers (score_trace.cuh) held after one launch: the scoring kernel's
// per-CTA slots and page landings, the selection's stamps.
struct TraceSnapshot {
  int grid = 0, select_ctas = 0;  // the scoring CTAs, the selection's CTAs with an item
  std::vector<long long> score, pages, select;
  bool has_pages = false, has_select = false;
  // Reads them (cudaErrorNotSupported: the library was built without -DCPIDX_TRACE).
  cudaError_t read(int scoring_grid, int select_items);
};
void print_trace(const TraceSnapshot& snap, double page_bytes);

class Bench {
 public:
  Bench(int64_t pool_mb, const std::string& dtype, bool pdl) : dtype_(dtype), pdl_(pdl) {
    const int64_t page_bytes = dtype == "fp8" ? kPageBytesBf16 / 2 : kPageBytesBf16;
    pool_pages_ = pool_mb * (1 << 20) / page_bytes;
    std::vector<uint16_t> h(static_cast<size_t>(pool_pages_ * page_bytes / 2));
    fill_random_bf16(h, 1234);
    if (dtype == "fp8") {
      for (auto& v : h) {  // two e4m3 bytes per element, NaN codes (x111_1111) avoided
        uint8_t* b = reinterpret_cast<uint8_t*>(&v);
        for (int i = 0; i < 2; ++i) if ((b[i] & 0x7F) == 0x7F) b[i] ^= 0x01;
      }
    }
    h_pool_ = std::move(h);
    BENCH_CUDA(cudaMalloc(&pool_, h_pool_.size() * 2));
    BENCH_CUDA(cudaMemcpy(pool_, h_pool_.data(), h_pool_.size() * 2, cudaMemcpyHostToDevice));
    page_bytes_ = page_bytes;
  }
  ~Bench() { cudaFree(pool_); }

  Result run(const Shape& sh, int replays);
  // DecodeConfig::split_max_pages of every Decoder (-1: the library's choice, 0: fused only).
  void set_split_pages(int64_t pages) { split_pages_ = pages; }
  void set_ctas_per_sm(int ctas) { ctas_per_sm_ = ctas; }
  void set_max_tokens(int64_t rows) { max_tokens_ = rows; }
  void set_max_query_len(int64_t q) { max_query_len_ = q; }
  void set_work_stealing(bool on) { work_stealing_ = on; }
  // Calls per graph replay at least this (the sets repeated in turn); 0: the peer's method.
  void set_min_calls(int calls) { min_calls_ = calls; }
  // Print the fused kernel's per-CTA timeline of each shape's last timed call, then that of
  // the slowest timed replay's last call.
  void set_trace(bool trace) { trace_ = trace; }
  // A kernel before every decode call in the graph (us > 0), timed alone and subtracted.
  void set_neighbour(const Neighbour& n) { neighbour_ = n; }

 private:
  InputSet make_set(const Shape& sh, int T, int64_t G, std::mt19937_64& rng, int64_t& next_page);
  std::string check(const Shape& sh, const InputSet& set, int64_t G, const std::vector<int32_t>& ids,
                    int heads_begin, int heads);
  DecodeInputs inputs(const Shape& sh, const InputSet& s, int T, int64_t G) const {
    DecodeInputs in;
    in.query = reinterpret_cast<const uint16_t*>(s.query);
    in.q_row_stride = static_cast<int64_t>(T) * kHeadDim;
    in.q_head_stride = kHeadDim;
    in.num_heads = T;
    in.cache.data = pool_;
    in.cache.dtype = dtype_ == "fp8" ? DType::kFP8E4M3 : DType::kBF16;
    in.cache.num_pages = pool_pages_;
    in.block_table = s.block_table;
    in.bt_row_stride = G;
    in.seq_lens = s.seq_lens;
    in.num_reqs = sh.reqs;
    in.query_len = sh.qlen;
    in.max_seq_len = static_cast<int32_t>(sh.context);
    in.scale = 0.08838834764831845f;
    return in;
  }

  std::string dtype_;
  bool pdl_ = true;
  int64_t split_pages_ = DecodeConfig::kAutoSplit;
  int ctas_per_sm_ = 0;
  int64_t max_tokens_ = 0;  // DecodeConfig::max_tokens at least this (0: the shape's rows)
  int64_t max_query_len_ = 0;  // DecodeConfig::max_query_len at least this (0: the shape's Q)
  bool work_stealing_ = true;
  int min_calls_ = 0;
  bool trace_ = false;
  Neighbour neighbour_;
  void* pool_ = nullptr;
  std::vector<uint16_t> h_pool_;
  int64_t pool_pages_ = 0, page_bytes_ = 0;
};

InputSet Bench::make_set(const Shape& sh, int T, int64_t G, std::mt19937_64& rng,
                         int64_t& next_page) {
  InputSet s;
  const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
  s.h_seq_lens.resize(static_cast<size_t>(sh.reqs));
  for (auto& l : s.h_seq_lens) l = static_cast<int32_t>(sh.context - static_cast<int64_t>(rng() % 128));
  s.h_block_table.resize(static_cast<size_t>(sh.reqs * G));
  for (auto& b : s.h_block_table) {  // distinct pages while the pool lasts, then random
    b = static_cast<int32_t>(next_page < pool_pages_ ? next_page++ : rng() % pool_pages_);
  }
  std::shuffle(s.h_block_table.begin(), s.h_block_table.end(), rng);
  s.h_query.resize(static_cast<size_t>(n * T * kHeadDim));
  fill_random_bf16(s.h_query, rng());
  BENCH_CUDA(cudaMalloc(&s.query, s.h_query.size() * 2));
  BENCH_CUDA(cudaMalloc(&s.block_table, s.h_block_table.size() * 4));
  BENCH_CUDA(cudaMalloc(&s.seq_lens, s.h_seq_lens.size() * 4));
  BENCH_CUDA(cudaMemcpy(s.query, s.h_query.data(), s.h_query.size() * 2, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(s.block_table, s.h_block_table.data(), s.h_block_table.size() * 4,
                        cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(s.seq_lens, s.h_seq_lens.data(), s.h_seq_lens.size() * 4,
                        cudaMemcpyHostToDevice));
  return s;
}

// Set 0, first request(s): GPU ids vs the CPU reference on the same pages.
std::string Bench::check(const Shape& sh, const InputSet& set, int64_t G,
                         const std::vector<int32_t>& ids, int heads_begin, int heads) {
  const int reqs = std::min(sh.reqs, 2), T = sh.mode == "cp" ? 4 : sh.heads, K = 16;
  const int64_t n_all = static_cast<int64_t>(sh.reqs) * sh.qlen, n = int64_t{reqs} * sh.qlen;
  // Compact host cache of the pages these requests use.
  std::vector<uint16_t> cache(static_cast<size_t>(reqs * G * page_bytes_ / 2));
  std::vector<int32_t> table(static_cast<size_t>(reqs * G));
  for (int64_t i = 0; i < reqs * G; ++i) {
    const int64_t page = set.h_block_table[static_cast<size_t>(i)];
    std::copy(h_pool_.begin() + page * page_bytes_ / 2, h_pool_.begin() + (page + 1) * page_bytes_ / 2,
              cache.begin() + i * page_bytes_ / 2);
    table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  }
  Shape sub = sh;
  sub.reqs = reqs;
  DecodeInputs in = inputs(sub, set, T, G);
  in.query = set.h_query.data() + static_cast<int64_t>(heads_begin) * kHeadDim;
  in.num_heads = heads;
  in.cache.data = cache.data();
  in.cache.num_pages = reqs * G;
  in.block_table = table.data();
  in.seq_lens = set.h_seq_lens.data();
  std::vector<int32_t> want(static_cast<size_t>(heads * n * K));
  Selection sel;
  int32_t err = 0;
  Status st = ref::decode_topk(in, sel, TopkOutput{want.data(), n * K, K}, nullptr, &err);
  if (!st.is_ok()) return "ref-error";
  const ref::IdsComparison cmp = ref::compare_ids(
      in, sel, TopkOutput{const_cast<int32_t*>(ids.data()), n_all * K, K},
      TopkOutput{want.data(), n * K, K});
  const int64_t near = cmp.near_tie_rows, bad = cmp.bad_rows;
  char buf[64];
  if (bad) std::snprintf(buf, sizeof(buf), "FAIL(%lld)", static_cast<long long>(bad));
  else std::snprintf(buf, sizeof(buf), near ? "ok(%lld tie)" : "ok", static_cast<long long>(near));
  return buf;
}

Result Bench::run(const Shape& sh, int replays) {
  const int T = sh.mode == "cp" ? 4 : sh.heads;
  const int64_t G = cpidx::cdiv(sh.context, kBlockSize);
  const int64_t n = static_cast<int64_t>(sh.reqs) * sh.qlen;
  const int K = 16;
  Result res;
  res.shape = sh;
  const double cache_bytes = static_cast<double>(sh.reqs) * (sh.context - 64) * page_bytes_ / 128;
  const double shard_bytes = cache_bytes / sh.world;
  res.cache_mb = cache_bytes / 1e6;
  res.floor_us = shard_bytes / 4.5e12 * 1e6;
  // Enough sets that one graph replay touches >= 480 MiB.
  const int sets = static_cast<int>(std::max<double>(1, std::ceil(480.0 * (1 << 20) / shard_bytes)));
  // The peer's method: one call per set, or two on the one set; --min-calls repeats the sets.
  const int calls = std::max(sets == 1 ? 2 : sets, min_calls_);
  res.sets = sets;
  res.calls = calls;
  std::mt19937_64 rng(42 + sh.reqs * 131 + sh.context + sh.qlen * 7 + sh.world * 3);
  int64_t next_page = 0;
  std::vector<InputSet> in_sets;
  for (int i = 0; i < sets; ++i) in_sets.push_back(make_set(sh, T, G, rng, next_page));

  DecodeConfig cfg;
  cfg.total_heads = T;
  cfg.world_size = sh.world;
  cfg.max_tokens = static_cast<int>(std::max<int64_t>(n, max_tokens_));
  cfg.max_seq_len = static_cast<int32_t>(sh.context);
  cfg.max_query_len = static_cast<int>(std::max<int64_t>(sh.qlen, max_query_len_));
  cfg.cache_dtype = dtype_ == "fp8" ? DType::kFP8E4M3 : DType::kBF16;
  cfg.programmatic_launch = pdl_;
  cfg.split_max_pages = split_pages_;
  cfg.scoring_ctas_per_sm = ctas_per_sm_;
  cfg.work_stealing = work_stealing_;
  std::vector<std::unique_ptr<Decoder>> decs(static_cast<size_t>(sh.world));
  for (int r = 0; r < sh.world; ++r) {
    cfg.rank = r;
    Status st = Decoder::create(cfg, 0, &decs[r]);
    if (!st.is_ok()) { res.check = "create: " + st.message(); return res; }
  }
  const int L = decs[0]->geometry().local_heads;
  // The instance this shape's steps launch (a bound above Q plans its own: plan() is the bound's).
  const cpidx::DecodePlan launched = decs[0]->step_plan(T, static_cast<int>(sh.qlen));
  res.grid = launched.grid;
  res.stages = launched.stages;
  res.offset_stride = launched.offset_stride;
  int32_t* ids = nullptr;
  Key* gathered = nullptr;
  BENCH_CUDA(cudaMalloc(&ids, static_cast<size_t>(T * n * K) * 4));
  BENCH_CUDA(cudaMalloc(&gathered, static_cast<size_t>(sh.world * T * n * K) * sizeof(Key)));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  auto one_call = [&](const InputSet& s) -> Status {
    DecodeInputs in = inputs(sh, s, T, G);
    if (sh.mode == "plain") return decs[0]->decode(in, TopkOutput{ids, n * K, K}, nullptr, stream);
    CPIDX_RETURN_IF_ERROR(decs[0]->shard_keys(in, gathered, stream));
    return decs[0]->merge(gathered, in, TopkOutput{ids, n * K, K}, nullptr, stream);
  };

  // Correctness on set 0 (eager): plain ids, or the full simulated context-parallel step.
  const size_t id_count = static_cast<size_t>((sh.mode == "plain" ? T : L) * n * K);
  {
    Status st = Status::ok();
    DecodeInputs in = inputs(sh, in_sets[0], T, G);
    if (sh.mode == "plain") {
      st = one_call(in_sets[0]);
    } else {
      const size_t per_rank = static_cast<size_t>(T * n * K);
      for (int r = 0; r < sh.world && st.is_ok(); ++r) st = decs[r]->shard_keys(in, gathered + per_rank * r, stream);
      if (st.is_ok()) st = decs[0]->merge(gathered, in, TopkOutput{ids, n * K, K}, nullptr, stream);
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    if (!st.is_ok()) { res.check = "run: " + st.message(); return res; }
    std::vector<int32_t> h(id_count);
    BENCH_CUDA(cudaMemcpy(h.data(), ids, id_count * 4, cudaMemcpyDeviceToHost));
    res.check = check(sh, in_sets[0], G, h, 0, sh.mode == "plain" ? T : L);
  }

  // With a neighbour, the same graph with the neighbours alone is timed first and its median
  // subtracted: us is what the decode calls add behind them.
  const bool neighbour = neighbour_.us > 0;
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (neighbour) BENCH_CUDA(prepare_neighbour(neighbour_));
  auto capture = [&](bool decode, cudaGraphExec_t* exec) {
    cudaGraph_t graph;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < calls; ++c) {
      if (neighbour) BENCH_CUDA(launch_neighbour(neighbour_, sms, stream));
      if (decode) one_call(in_sets[c % sets]);
    }
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    BENCH_CUDA(cudaGraphInstantiate(exec, graph, 0));
    BENCH_CUDA(cudaGraphDestroy(graph));
  };
  float neighbour_ms = 0, neighbour_gpu_ms = 0;
  if (neighbour) {
    cudaGraphExec_t alone;
    capture(false, &alone);
    BENCH_CUDA(median_graph_ms(alone, stream, 3, replays, &neighbour_ms));
    BENCH_CUDA(median_graph_ms(alone, stream, 1, replays, &neighbour_gpu_ms, true));
    cudaGraphExecDestroy(alone);
  }
  cudaGraphExec_t exec;
  capture(true, &exec);
  float median_ms = 0, gpu_ms = 0, max_ms = 0;
  // With the trace, the buffers are read after each replay slower than those before it (a
  // copy between replays, which the timing already separates): the slowest one's stays.
  const int select_items = static_cast<int>(sh.reqs) * T * static_cast<int>(sh.qlen);
  TraceSnapshot slowest;
  float slowest_ms = -1;
  int slowest_at = -1;
  std::function<cudaError_t(int, float)> keep_slowest;
  if (trace_) {
    keep_slowest = [&](int i, float ms) {
      if (ms <= slowest_ms) return cudaSuccess;
      slowest_ms = ms;
      slowest_at = i;
      const cudaError_t e = slowest.read(res.grid, select_items);
      return e == cudaErrorNotSupported ? cudaSuccess : e;  // no trace build: said below
    };
  }
  BENCH_CUDA(median_graph_ms(exec, stream, 3, replays, &median_ms, false, &max_ms, &res.max_at,
                             keep_slowest));
  BENCH_CUDA(median_graph_ms(exec, stream, 1, replays, &gpu_ms, /*hold_stream=*/true));
  if (trace_) {
    TraceSnapshot last;
    const cudaError_t e = last.read(res.grid, select_items);
    if (e == cudaErrorNotSupported) {
      std::printf("# trace: the library was built without -DCPIDX_TRACE\n");
    } else {
      BENCH_CUDA(e);
      print_trace(last, static_cast<double>(page_bytes_));
      std::printf("# slowest replay: %d of %d, %.2f us a call (median %.2f); its last call:\n",
                  slowest_at, replays, slowest_ms * 1e3 / calls, median_ms * 1e3 / calls);
      print_trace(slowest, static_cast<double>(page_bytes_));
    }
  }
  // The timed calls run back to back, each overlapping the one before (PDL), where the check
  // above ran one call alone: the last timed call's ids, read back after the replays, must be
  // the same set's ids from an eager call, bit for bit ("ok(N tie)" rows too: a near tie
  // allows the reference's order to differ, not two runs of the same kernels).
  if (res.check.rfind("ok", 0) == 0) {
    std::vector<int32_t> replayed(id_count), eager(id_count);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    BENCH_CUDA(cudaMemcpy(replayed.data(), ids, id_count * 4, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemset(ids, 0x7B, id_count * 4));
    const Status st = one_call(in_sets[(calls - 1) % sets]);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    BENCH_CUDA(cudaMemcpy(eager.data(), ids, id_count * 4, cudaMemcpyDeviceToHost));
    if (!st.is_ok()) {
      res.check = "eager rerun: " + st.message();
    } else if (replayed != eager) {
      res.check = "replayed != eager (last call)";
    }
  }
  res.neighbour_us = neighbour_ms * 1e3 / calls;
  res.us = (median_ms - neighbour_ms) * 1e3 / calls;
  res.max_us = (max_ms - neighbour_ms) * 1e3 / calls;
  res.gpu_us = (gpu_ms - neighbour_gpu_ms) * 1e3 / calls;
  res.gbps = shard_bytes / (res.us * 1e-6) / 1e9;
  cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  cudaFree(ids);
  cudaFree(gathered);
  for (auto& s : in_sets) { cudaFree(s.query); cudaFree(s.block_table); cudaFree(s.seq_lens); }
  return res;
}

// One timeline row: min / median / p90 / max of `v` (sorted here), and an optional note.
void print_quantiles(const char* name, std::vector<double> v, const std::string& note = "") {
  std::sort(v.begin(), v.end());
  std::printf("#   %-15s %9.2f %9.2f %9.2f %9.2f%s\n", name, v.front(), v[v.size() / 2],
              v[v.size() * 9 / 10], v.back(), note.c_str());
}

// The SMs' clock over a phase, per CTA with a stamp: clock64 cycles over %globaltimer ns between
// the slots `from` and `to` of `v` (rows of `slots` values, the CTAs in `ctas`).
void print_clock(const char* name, const std::vector<long long>& v, int slots,
                 const std::vector<int>& ctas, int ns_from, int ns_to, int clk_from, int clk_to) {
  std::vector<double> mhz;
  for (int c : ctas) {
    const long long* x = &v[static_cast<size_t>(c) * slots];
    const long long ns = x[ns_to] - x[ns_from], cycles = x[clk_to] - x[clk_from];
    if (x[ns_from] != 0 && ns > 0 && cycles > 0) mhz.push_back(cycles * 1e3 / ns);
  }
  if (!mhz.empty()) print_quantiles(name, std::move(mhz));
}

// CTAs placed long after the grid's start (v41-slow: one of 396 entered ~500 us late, when the
// others began to exit), and how many CTAs each SM held from the start: an SM holding fewer than
// the others is where a late CTA's slot was kept (by another kernel's CTAs, or its split).
void print_late_ctas(const std::vector<long long>& t, const std::vector<int>& ctas, long long t0) {
  using namespace cpidx::cuda;
  const auto at = [&](int c, int slot) { return t[static_cast<size_t>(c) * kTraceSlots + slot]; };
  std::vector<double> entry;
  for (int c : ctas) entry.push_back((at(c, kTEntry) - t0) * 1e-3);
  std::vector<double> sorted = entry;
  std::sort(sorted.begin(), sorted.end());
  const double late_us = sorted[sorted.size() / 2] + 50;
  std::map<long long, int> on_time;  // SM id -> CTAs entered before late_us
  std::string late;
  for (size_t i = 0; i < ctas.size(); ++i) {
    const int c = ctas[i];
    if (entry[i] < late_us) {
      ++on_time[at(c, kTSmid)];
    } else {
      char buf[96];
      std::snprintf(buf, sizeof buf, " %d:%lld:%.1f:%lld", c, at(c, kTSmid), entry[i],
                    at(c, kTPages));
      late += buf;
    }
  }
  std::map<int, std::vector<long long>> sms_by_count;  // CTAs held from the start -> SM ids
  for (const auto& [sm, n] : on_time) sms_by_count[n].push_back(sm);
  std::printf("#   CTAs an SM held from the start:");
  for (const auto& [n, sms] : sms_by_count) {
    std::printf(" %d on %zu SMs", n, sms.size());
    if (sms.size() <= 8) {
      std::printf(" (");
      for (size_t i = 0; i < sms.size(); ++i) std::printf("%s%lld", i ? "," : "", sms[i]);
      std::printf(")");
    }
    std::printf(";");
  }
  std::printf("\n#   late CTAs (entry > median + 50 us; cta:sm:entry us:pages):%s\n",
              late.empty() ? " none" : late.c_str());
}

cudaError_t TraceSnapshot::read(int scoring_grid, int select_items) {
  using namespace cpidx::cuda;
  grid = scoring_grid;
  select_ctas = std::min(select_items, kTraceCtas);
  score.resize(static_cast<size_t>(grid) * kTraceSlots);
  if (cudaError_t e = read_score_trace(score.data(), grid); e != cudaSuccess) return e;
  pages.resize(static_cast<size_t>(grid) * kTracePages);
  has_pages = read_page_trace(pages.data(), grid) == cudaSuccess;
  select.resize(static_cast<size_t>(select_ctas) * kSelectSlots);
  has_select = select_ctas > 0 && read_select_trace(select.data(), select_ctas) == cudaSuccess;
  return cudaSuccess;
}

// The timeline of one launch of the fused kernel (score_trace.cuh), over the CTAs that scored
// pages: stamps in us after the earliest entry, cycle sums in us at the SM's rated clock.
void print_trace(const TraceSnapshot& snap, double page_bytes) {
  using namespace cpidx::cuda;
  const std::vector<long long>& t = snap.score;
  const int grid = snap.grid;
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  long long t0 = -1;
  std::vector<int> ctas;
  for (int c = 0; c < grid; ++c) {
    const long long* v = &t[static_cast<size_t>(c) * kTraceSlots];
    if (v[kTPages] == 0) continue;
    ctas.push_back(c);
    if (t0 < 0 || v[kTEntry] < t0) t0 = v[kTEntry];
  }
  if (ctas.empty()) { std::printf("# trace: no CTA scored a page (split path?)\n"); return; }
  // kind: 0 a stamp, 1 a cycle sum, 2 a count, 3 a stamp that only some CTAs set.
  const struct { int slot; const char* name; int kind; } rows[] = {
      {kTEntry, "entry", 0},        {kTWaited, "pdl_waited", 0},  {kTPrefix, "prefix", 0},
      {kTFirstPage, "first_page", 0}, {kTLastPage, "last_page", 0}, {kTExit, "exit", 0},
      {kTFullWait, "wait_full", 1},   {kTEmptyWait, "wait_empty", 1}, {kTSegEnd, "seg_ends", 1},
      {kTQueries, "queries", 1},      {kTPages, "n_pages", 2},      {kTSegments, "n_segments", 2},
      {kTStolen, "n_stolen", 2},      {kTFirstIssue, "first_issue", 0},
      {kTLastIssue, "last_issue", 0}, {kTHandedOver, "handed_over", 3},
      {kTFirstMma, "first_mma", 3},   {kTFirstMax, "first_max", 3},
      {kTRingIssue, "ring_issue", 3}};
  std::printf("# trace over %zu CTAs: min / median / p90 / max (us; n_*: counts)\n", ctas.size());
  for (const auto& row : rows) {
    std::vector<double> v;
    for (int c : ctas) {
      const long long x = t[static_cast<size_t>(c) * kTraceSlots + row.slot];
      if (row.kind == 3 && x == 0) continue;
      v.push_back(row.kind == 0 || row.kind == 3 ? (x - t0) * 1e-3
                  : row.kind == 1                ? x * 1e3 / khz
                                                 : x);
    }
    if (!v.empty()) print_quantiles(row.name, std::move(v));
  }
  // Where the spread of last pages comes from: between the CTAs of one SM, or between SMs.
  std::vector<std::vector<double>> by_sm(1024);
  for (int c : ctas) {
    const long long* v = &t[static_cast<size_t>(c) * kTraceSlots];
    if (v[kTSmid] >= 0 && v[kTSmid] < 1024) by_sm[v[kTSmid]].push_back((v[kTLastPage] - t0) * 1e-3);
  }
  std::vector<double> within, sm_last;
  std::vector<std::pair<double, int>> sm_order;  // (SM's last page, SM id)
  for (size_t sm = 0; sm < by_sm.size(); ++sm) {
    auto& v = by_sm[sm];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    within.push_back(v.back() - v.front());
    sm_last.push_back(v.back());
    sm_order.emplace_back(v.back(), static_cast<int>(sm));
  }
  std::sort(within.begin(), within.end());
  std::sort(sm_last.begin(), sm_last.end());
  std::printf("#   last page, spread within an SM: median %.2f p90 %.2f max %.2f; SM's last: min %.2f "
              "median %.2f max %.2f (%zu SMs)\n",
              within[within.size() / 2], within[within.size() * 9 / 10], within.back(),
              sm_last.front(), sm_last[sm_last.size() / 2], sm_last.back(), sm_last.size());
  // Which SMs: compare these lists across shapes and runs to tell a placement effect (the same
  // SMs slow every time) from chance. Every SM's last page, by SM id, for scripts.
  std::printf("#   sm_last_page_us:");
  for (const auto& [us, sm] : sm_order) std::printf(" %d:%.2f", sm, us);
  std::printf("\n");
  print_clock("sm_clock_mhz", t, kTraceSlots, ctas, kTEntry, kTExit, kTEntryClock, kTExitClock);
  print_late_ctas(t, ctas, t0);
  // The rate at which pages landed (every CTA's first kTracePages, as full pages), per 2 us.
  const std::vector<long long>& pt = snap.pages;
  if (snap.has_pages) {
    std::vector<double> at;
    long long stale = 0;  // stamps older than this launch (none since v41-slow's fix): a guard
    for (int c : ctas) {
      const long long n = std::min<long long>(t[static_cast<size_t>(c) * kTraceSlots + kTPages],
                                              kTracePages);
      const long long* v = &pt[static_cast<size_t>(c) * kTracePages];
      for (long long i = 0; i < n; ++i) {
        if (v[i] < t0) {
          ++stale;
        } else {
          at.push_back((v[i] - t0) * 1e-3);
        }
      }
    }
    if (stale > 0) {
      std::printf("#   landed: %lld page stamps older than the launch, left out\n", stale);
    }
    std::sort(at.begin(), at.end());
    if (!at.empty()) {
      const double bin = 2.0;
      std::vector<int> hist(static_cast<size_t>(at.back() / bin) + 1);
      for (double x : at) ++hist[static_cast<size_t>(x / bin)];
      std::printf("#   landed TB/s per %.0f us (bin start:rate):", bin);
      for (size_t b = 0; b < hist.size(); ++b) {
        std::printf(" %.0f:%.2f", b * bin, hist[b] * page_bytes / (bin * 1e-6) / 1e12);
      }
      const auto q = [&](double f) { return at[static_cast<size_t>(f * (at.size() - 1))]; };
      const double span_us = q(0.9) - q(0.1);  // 0 when every page landed in one stamp
      std::printf("\n#   landed: 1%% %.2f 10%% %.2f 50%% %.2f 90%% %.2f 99%% %.2f 100%% %.2f us; "
                  "10-90%% at %.2f TB/s\n", q(0.01), q(0.1), q(0.5), q(0.9), q(0.99), at.back(),
                  span_us > 0 ? 0.8 * at.size() * page_bytes / (span_us * 1e-6) / 1e12 : 0.0);
    }
  }
  // select_topk after the grid (its CTAs with an item), on the same clock.
  const int sel_ctas = snap.select_ctas;
  const std::vector<long long>& st = snap.select;
  if (snap.has_select) {
    for (int slot : {kSEntry, kSWaited, kSLoaded, kSMaxima, kSBound, kSGathered, kSRanked, kSExit}) {
      std::vector<double> v;
      for (int c = 0; c < sel_ctas; ++c) {
        const long long x = st[static_cast<size_t>(c) * kSelectSlots + slot];
        if (x != 0) v.push_back((x - t0) * 1e-3);  // 0: the phase did not run (another path)
      }
      static const char* const names[] = {"select_entry",  "select_waited",   "select_bound",
                                          "select_gathered", "select_ranked", "select_exit",
                                          "select_loaded", "select_maxima"};
      const std::string ctas_note = "  (" + std::to_string(sel_ctas) + " CTAs)";
      if (!v.empty()) print_quantiles(names[slot], std::move(v), ctas_note);
    }
    std::vector<int> sel(static_cast<size_t>(sel_ctas));
    for (int c = 0; c < sel_ctas; ++c) sel[static_cast<size_t>(c)] = c;
    print_clock("select_clock_mhz", st, kSelectSlots, sel, kSWaited, kSExit, kSWaitedClock,
                kSExitClock);
  }
  std::sort(sm_order.begin(), sm_order.end());
  const size_t show = std::min<size_t>(8, sm_order.size());
  for (int slow = 1; slow >= 0; --slow) {
    std::printf("#   %s SMs (id:last page us):", slow ? "slowest" : "fastest");
    for (size_t i = 0; i < show; ++i) {
      const auto& [us, sm] = slow ? sm_order[sm_order.size() - 1 - i] : sm_order[i];
      std::printf(" %d:%.1f", sm, us);
    }
    std::printf("\n");
  }
}

}  // namespace

int run_bench(int argc, char** argv) {
  if (prefill_asked(argc, argv)) return run_prefill_bench(argc, argv);
  std::vector<std::string> modes = {"plain1", "plain4", "cp2", "cp4"};
  std::vector<int64_t> reqs = {1, 8, 64}, contexts = {8 << 10, 64 << 10, 256 << 10, 1 << 20},
                       qlens = {1, 4};
  std::string json, dtype = "bf16", exchange = "both";
  int64_t replays = 10, pool_mb = 4096, split_pages = DecodeConfig::kAutoSplit, ctas_per_sm = 0,
          min_calls = 0, max_tokens = 0, max_query_len = 0;
  bool pdl = true, trace = false, steal = true, prefill = false;
  double late_cta_us = 0;
  Neighbour neighbour;
  int64_t neighbour_smem_kb = neighbour.smem_kb, neighbour_ctas = neighbour.ctas_per_sm;
  Flags flags("cpidx bench [flags]",
              "GPU decode benchmark (TARGETS.md grid). Modes: plainH = plain decode of H heads;\n"
              "cpP = context-parallel rank work at P ranks (all 4 heads on a 1/P shard + merge);\n"
              "stepP = the whole context-parallel step on P real GPUs (one CUDA graph per GPU, both\n"
              "exchanges included; one thread per GPU, or one process per GPU under\n"
              "`mpirun -np P`, where only stepP modes run), with the two exchanges alone\n"
              "(xchg_us) and the shard floor (cache bytes / P / 4.5 TB/s) beside it; --exchange\n"
              "picks NCCL, the peer communicator (one-shot LL stores over peer access; the keys\n"
              "through its device channel, or by its all_gather with peer-gather) or several (one\n"
              "row each).\n"
              "Each shape: calls over input sets rotated past the L2, captured in one CUDA graph;\n"
              "median replay / calls (us: timed from the first event as PEER_H200.md does, so the\n"
              "host's graph launch latency is in it; gpu_us: the stream held until the replay is\n"
              "queued, the GPU's time alone). GB/s counts index-cache bytes read by the rank\n"
              "(its 1/P shard in cpP modes, as floor_us does); cache_MB is the whole batch's.\n"
              "`cpidx bench --prefill --help`: the prefill benchmark.");
  flags.add("modes", &modes, "plainH (H 1-8) / cpP / stepP (P 2, 4 or 8)")
      .add("reqs", &reqs, "batch sizes (requests)", 1, 1 << 20)
      .add("contexts", &contexts, "context lengths", 1, 1 << 30)
      .add("qlens", &qlens, "query lengths", 1, kMaxQueryLen)
      .add("dtype", &dtype, "index cache dtype", {"bf16", "fp8"})
      .add("replays", &replays, "timed graph replays per shape", 1, 1 << 20)
      .add("pool-mb", &pool_mb, "MiB of random key pages to draw from", 1, int64_t{1} << 20)
      .add("pdl", &pdl, "launch with programmatic dependent launch")
      .add("exchange", &exchange,
           "stepP exchanges: NCCL, peer stores (keys through the device channel), peer-gather "
           "(keys by a peer all_gather, then the merge), both (nccl + peer) or all",
           {"nccl", "peer", "peer-gather", "both", "all"})
      .add("split-pages", &split_pages,
           "steps with at most this many pages per rank take the split path (-1: automatic, "
           "0: fused path only)")
      .add("ctas-per-sm", &ctas_per_sm, "scoring CTAs per SM (0: automatic)", 0, 4)
      .add("max-tokens", &max_tokens,
           "the Decoders' max_tokens at least this (0: each shape's rows); the scoring kernel's "
           "shared memory grows with it (grid/stg shows the plan it gets)", 0, int64_t{1} << 24)
      .add("max-query-len", &max_query_len,
           "the Decoders' max_query_len at least this (0: each shape's Q; the library's default "
           "is 8): the scoring kernel's plan is sized for max heads x max_query_len columns", 0,
           kMaxQueryLen)
      .add("steal", &steal,
           "split-path CTAs take unclaimed pages from others' ranges (DecodeConfig::work_stealing)")
      .add("min-calls", &min_calls,
           "decode calls per graph replay at least this (0: one per input set, as the peer)")
      .add("trace", &trace,
           "print the fused kernel's per-CTA timeline and the rate its pages landed at, for the "
           "last call and for the slowest timed replay's last call (a library built with "
           "-DCPIDX_TRACE)")
      .add("late-cta-us", &late_cta_us,
           "plainH / cpP modes: the scoring kernel's last CTA waits this long at entry in every "
           "call (0: none), as one the SMs had no room for until others exited (a library built "
           "with -DCPIDX_TRACE)")
      .add("neighbour-us", &neighbour.us,
           "before every decode call (plainH / cpP modes), a kernel standing for the engine's "
           "previous one, each CTA spinning this long (0: none); timed alone and subtracted (us, "
           "max_us, gpu_us)")
      .add("neighbour-smem-kb", &neighbour_smem_kb,
           "KiB of shared memory a neighbour CTA holds (its carveout is the driver's choice, "
           "where the decode kernels ask for the largest)", 1, 227)
      .add("neighbour-ctas-per-sm", &neighbour_ctas, "neighbour CTAs launched per SM", 1, 32)
      .add("neighbour-early", &neighbour.early_launch,
           "the neighbour lets the decode call launch at its start (PDL's trigger)")
      .add("prefill", &prefill, "run the prefill benchmark instead (its own flags)")
      .add("json", &json, "write the results as JSON to this file");
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  neighbour.smem_kb = static_cast<int>(neighbour_smem_kb);
  neighbour.ctas_per_sm = static_cast<int>(neighbour_ctas);
  if (neighbour.us < 0) {
    std::fprintf(stderr, "cpidx bench: --neighbour-us must be >= 0\n");
    return kExitUsage;
  }
  if (late_cta_us < 0) {
    std::fprintf(stderr, "cpidx bench: --late-cta-us must be >= 0\n");
    return kExitUsage;
  }
  // Each mode is a kind and a number: plainH (heads 1..8), cpP / stepP (ranks 2, 4 or 8: the
  // world sizes of their 4 heads).
  struct Mode {
    std::string name, kind;
    int x = 0;
  };
  std::vector<Mode> mode_list;
  for (const std::string& m : modes) {
    Mode md{m, "", 0};
    for (const char* kind : {"plain", "cp", "step"}) {
      const size_t n = std::strlen(kind);
      if (m.size() == n + 1 && m.compare(0, n, kind) == 0 && m[n] >= '1' && m[n] <= '8') {
        md.kind = kind;
        md.x = m[n] - '0';
      }
    }
    if (md.kind.empty() || (md.kind != "plain" && md.x != 2 && md.x != 4 && md.x != 8)) {
      std::fprintf(stderr, "cpidx bench: bad mode '%s' in --modes (plain1..plain8, cp2, cp4, "
                   "cp8, step2, step4, step8)\n", m.c_str());
      return kExitUsage;
    }
    mode_list.push_back(md);
  }
  // Under mpirun: one rank per process, stepP modes only (the same verdict on every rank).
  const bool under_mpi = launched_by_mpi();
  for (const Mode& md : mode_list) {
    if (under_mpi && md.kind != "step") {
      std::fprintf(stderr, "cpidx bench: under mpirun only stepP modes run (one process per "
                   "GPU); '%s' is a single-process mode\n", md.name.c_str());
      return kExitUsage;
    }
  }
  if (!gpu_available()) {
    std::fprintf(stderr, "cpidx bench: no usable GPU\n");
    return kExitFailed;
  }
  // The delay is a symbol of the current GPU's copy of the library: the single-GPU modes only.
  if (late_cta_us > 0) {
    for (const Mode& md : mode_list) {
      if (md.kind == "step") {
        std::fprintf(stderr, "cpidx bench: --late-cta-us applies to plainH / cpP modes, not "
                     "'%s'\n", md.name.c_str());
        return kExitUsage;
      }
    }
    const long long ns = static_cast<long long>(late_cta_us * 1e3);
    if (const cudaError_t e = cuda::set_score_trace_late(ns); e != cudaSuccess) {
      std::fprintf(stderr, "cpidx bench: --late-cta-us: %s\n",
                   e == cudaErrorNotSupported ? "the library was built without -DCPIDX_TRACE"
                                              : cudaGetErrorString(e));
      return kExitUsage;
    }
    std::printf("# the scoring kernel's last CTA waits %.1f us at entry in every call\n",
                late_cta_us);
  }
  MpiSession session;
  std::unique_ptr<Communicator> processes;
  if (under_mpi) {
    if (Status s = session.start(&argc, &argv, &processes); !s.is_ok()) {
      std::fprintf(stderr, "cpidx bench: %s\n", s.to_string().c_str());
      return kExitUsage;
    }
  }
  const bool printer = processes == nullptr || processes->rank() == 0;
  std::unique_ptr<Bench> bench;          // created for the first plain / cp shape
  std::unique_ptr<StepBench> step_bench;  // created for the first step shape
  std::vector<Result> results;
  std::vector<std::pair<StepShape, StepResult>> step_results;
  // The JSON file is written before the first row and rewritten after every row (to a
  // temporary, then renamed), so a run stopped by a time limit leaves the rows it finished.
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const std::string environment = StepBench::environment();
  auto write_json = [&]() -> bool {
    if (json.empty() || !printer) return true;
    const std::string tmp = json + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (!f) { std::fprintf(stderr, "cannot write %s\n", tmp.c_str()); return false; }
    std::fprintf(f,
                 "{\"cpidx_version\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", "
                 "\"split_pages\": %lld, "
                 "\"ctas_per_sm\": %lld, \"work_stealing\": %s, \"max_tokens\": %lld, "
                 "\"max_query_len\": %lld, \"neighbour\": {\"us\": %.3f, \"smem_kb\": %d, "
                 "\"ctas_per_sm\": %d, \"early_launch\": %s}, \"late_cta_us\": %.3f, "
                 "\"pool_mb\": %lld, \"replays\": %lld, \"pdl\": %s, \"min_calls\": %lld, "
                 "\"results\": [\n",
                 CPIDX_VERSION, prop.name, dtype.c_str(), static_cast<long long>(split_pages),
                 static_cast<long long>(ctas_per_sm), steal ? "true" : "false",
                 static_cast<long long>(max_tokens), static_cast<long long>(max_query_len),
                 neighbour.us, neighbour.smem_kb, neighbour.ctas_per_sm,
                 neighbour.early_launch ? "true" : "false", late_cta_us,
                 static_cast<long long>(pool_mb), static_cast<long long>(replays),
                 pdl ? "true" : "false", static_cast<long long>(min_calls));
    // The distinct input bytes a replay's calls rotate through: each set's pages of the rank's
    // shard, as far as the pool holds them (past it, pages repeat). TARGETS.md asks for 8 x the
    // 60 MiB L2; compare_peer.py marks rows below it.
    auto rotated_mb = [&](int sets, double cache_mb) {
      return std::min(sets * cache_mb * 1e6 / (1 << 20), static_cast<double>(pool_mb));
    };
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "  {\"mode\": \"%s\", \"heads\": %d, \"world\": %d, \"reqs\": %d, \"context\": %lld, "
                   "\"qlen\": %d, \"sets\": %d, \"calls\": %d, \"cache_mb\": %.3f, \"us\": %.3f, "
                   "\"gbps\": %.1f, \"gpu_us\": %.3f, \"max_us\": %.3f, \"max_at\": %d, \"neighbour_us\": %.3f, "
                   "\"floor_us\": %.3f, \"grid\": %d, \"stages\": %d, \"offset_stride\": %d, "
                   "\"rotated_mb\": %.1f, \"check\": \"%s\"}%s\n",
                   r.shape.mode.c_str(), r.shape.heads, r.shape.world, r.shape.reqs,
                   static_cast<long long>(r.shape.context), r.shape.qlen, r.sets, r.calls, r.cache_mb,
                   r.us, r.gbps, r.gpu_us, r.max_us, r.max_at, r.neighbour_us, r.floor_us, r.grid, r.stages, r.offset_stride,
                   rotated_mb(r.sets, r.cache_mb / r.shape.world), r.check.c_str(),
                   i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "], \"step_results\": [\n");
    for (size_t i = 0; i < step_results.size(); ++i) {
      const auto& [ss, r] = step_results[i];
      std::fprintf(f,
                   "  {\"mode\": \"step\", \"exchange\": \"%s\", \"world\": %d, \"reqs\": %d, \"context\": %lld, "
                   "\"qlen\": %d, \"sets\": %d, \"calls\": %d, \"cache_mb\": %.3f, "
                   "\"us\": %.3f, \"floor_us\": %.3f, \"exchange_us\": %.3f, \"gbps\": %.1f, "
                   "\"q_bytes\": %lld, \"k_bytes\": %lld, \"rotated_mb\": %.1f, "
                   "\"check\": \"%s\"}%s\n",
                   ss.exchange.c_str(), ss.world, ss.reqs, static_cast<long long>(ss.context), ss.qlen, r.sets,
                   r.calls, r.cache_mb, r.us, r.floor_us, r.exchange_us, r.gbps,
                   static_cast<long long>(r.q_bytes), static_cast<long long>(r.k_bytes),
                   rotated_mb(r.sets, r.cache_mb / ss.world), r.check.c_str(),
                   i + 1 < step_results.size() ? "," : "");
    }
    std::fprintf(f, "], \"environment\": \"%s\", \"step_processes\": \"%s\"}\n",
                 environment.c_str(), processes ? "mpi" : "threads");
    const bool written = std::fclose(f) == 0 && std::rename(tmp.c_str(), json.c_str()) == 0;
    if (!written) std::fprintf(stderr, "cannot write %s\n", json.c_str());
    return written;
  };
  write_json();  // from the start: a set stopped before its first row leaves an empty list
  bool all_ok = true;
  for (const Mode& md : mode_list) {
    const std::string& m = md.name;
    for (int64_t q : qlens) {
      for (int64_t b : reqs) {
        for (int64_t c : contexts) {
          if (md.kind == "step") {
            for (const std::string ex : {"nccl", "peer", "peer-gather"}) {
              const bool on = exchange == ex || exchange == "all" ||
                              (exchange == "both" && ex != "peer-gather");
              if (!on) continue;
              StepShape ss;
              ss.world = md.x;
              ss.reqs = static_cast<int>(b);
              ss.context = c;
              ss.qlen = static_cast<int>(q);
              ss.exchange = ex;
              ss.work_stealing = steal;
              if (!step_bench) {
                step_bench = std::make_unique<StepBench>(pool_mb, dtype, pdl, processes.get());
              }
              if (printer && step_results.empty()) {
                std::printf("# %s: whole step on %d GPUs (us) vs the shard floor; xchg_us = the two "
                            "all_gathers of its payloads alone; exch = NCCL, peer (keys through "
                            "the device channel) or peer-gather\n# %s; %s\n",
                            m.c_str(), ss.world, StepBench::environment().c_str(),
                            processes ? "one process per GPU (mpirun): the slowest rank's median "
                                        "of back-to-back replays"
                                      : "one process, a thread per GPU: GPU 0's events after "
                                        "every GPU's replay");
                std::printf("%-7s %11s %4s %4s %8s %3s %6s %10s %9s %9s %9s %9s %9s  %s\n", "mode",
                            "exch", "ranks", "reqs", "context", "Q", "calls", "cache_MB", "us",
                            "floor_us", "floor+10", "xchg_us", "GB/s", "check");
              }
              StepResult r = step_bench->run(ss, static_cast<int>(replays));
              all_ok = all_ok && r.check == "ok";
              if (printer) {
                std::printf(
                    "%-7s %11s %4d %4d %8lld %3d %6d %10.1f %9.1f %9.1f %9.1f %9.2f %9.0f  %s\n",
                    m.c_str(), ex.c_str(), ss.world, ss.reqs, static_cast<long long>(ss.context),
                    ss.qlen, r.calls, r.cache_mb, r.us, r.floor_us, r.floor_us + 10,
                    r.exchange_us, r.gbps, r.check.c_str());
                std::fflush(stdout);
              }
              step_results.emplace_back(ss, r);
              write_json();  // failures reported here, decided at the end (no rank left behind)
            }
            continue;
          }
          if (!bench) {
            bench = std::make_unique<Bench>(pool_mb, dtype, pdl);
            bench->set_split_pages(split_pages);
            bench->set_ctas_per_sm(static_cast<int>(ctas_per_sm));
            bench->set_max_tokens(max_tokens);
            bench->set_max_query_len(max_query_len);
            bench->set_work_stealing(steal);
            bench->set_min_calls(static_cast<int>(min_calls));
            bench->set_trace(trace);
            bench->set_neighbour(neighbour);
            if (neighbour.us > 0) {
              std::printf("# before every call a neighbour kernel: %d CTA(s) an SM of %d KiB shared "
                          "memory (the driver's carveout), %.1f us each, %s; us, max_us and "
                          "gpu_us less the neighbours alone (nb_us)\n",
                          neighbour.ctas_per_sm, neighbour.smem_kb, neighbour.us,
                          neighbour.early_launch ? "the call launched at its start (PDL)"
                                                 : "no early launch");
            }
            std::printf("%-7s %5s %4s %8s %3s %9s %10s %9s %9s %9s %9s %9s %9s%s  %s\n", "mode",
                        "heads", "reqs", "context", "Q", "sets/calls", "cache_MB", "us", "max_us",
                        "GB/s", "gpu_us", "floor_us", "grid/stg",
                        neighbour.us > 0 ? "     nb_us" : "", "check");
          }
          Shape sh;
          sh.mode = md.kind;
          if (sh.mode == "cp") { sh.world = md.x; sh.heads = 4; } else { sh.heads = md.x; }
          sh.reqs = static_cast<int>(b);
          sh.context = c;
          sh.qlen = static_cast<int>(q);
          Result r = bench->run(sh, static_cast<int>(replays));
          all_ok = all_ok && r.check.rfind("ok", 0) == 0;
          // stg: pages in flight, then "s<N>" when the kernel keeps every N-th request offset.
          std::string stg = std::to_string(r.stages);
          if (r.offset_stride > 1) stg += "s" + std::to_string(r.offset_stride);
          char nb[16] = "";
          if (neighbour.us > 0) std::snprintf(nb, sizeof nb, " %9.1f", r.neighbour_us);
          std::printf("%-7s %5d %4d %8lld %3d %5d/%-4d %10.1f %9.1f %9.1f %9.0f %9.1f %9.1f %5d/%-3s%s  %s\n",
                      m.c_str(), sh.heads, sh.reqs, static_cast<long long>(sh.context), sh.qlen,
                      r.sets, r.calls, r.cache_mb, r.us, r.max_us, r.gbps, r.gpu_us, r.floor_us,
                      r.grid, stg.c_str(), nb, r.check.c_str());
          std::fflush(stdout);
          results.push_back(r);
          write_json();
        }
      }
    }
  }
  if (!write_json()) return kExitFailed;
  return all_ok ? kExitOk : kExitFailed;
}
#endif

}  // namespace cpidx::tools
