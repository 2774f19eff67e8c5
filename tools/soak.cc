// tools/soak.cc: `cpidx soak`, the long-run check of the context-parallel step on 2 GPUs (one
// host thread per GPU). Decoder::cp_decode is captured once per (batch-size bucket, Q) in CUDA
// graphs and replayed N times; between replays new seq_lens (with padding rows), block tables and
// queries are copied in (cudaMemcpyAsync from pinned sets prepared ahead, a few KiB per step).
// Every --check-every steps both ranks compare their owned heads with the plain decode on their
// own GPU, bitwise, and read the error words; device memory is recorded at start and end, and a
// watchdog reports a hang instead of waiting for ever. Summary as JSON (--json).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "args.h"
#include "subcommands.h"

#if defined(CPIDX_WITH_CUDA) && defined(CPIDX_WITH_NCCL) && defined(CPIDX_WITH_PEER)
#include <cuda_runtime.h>

#include <barrier>
#include <mutex>

#include "cpidx/comm_nccl.h"
#include "cpidx/comm_peer.h"
#include "cpidx/indexer.h"
#include "random_bits.h"
#define CPIDX_SOAK 1
#endif

namespace cpidx::tools {

#if !defined(CPIDX_SOAK)

int run_soak(int argc, char** argv) {
  Flags flags("cpidx soak [flags]",
              "2-GPU soak of the context-parallel step; needs CUDA, NCCL "
              "and the peer communicator.");
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  std::fprintf(stderr, "cpidx soak: this build has no CUDA + NCCL + peer communicator\n");
  return kExitFailed;
}

#else

namespace {

constexpr int kWorld = 2, kHeads = 4, kTopk = 16;
constexpr int kSeqSets = 509, kTableSets = 61, kQuerySets = 59;  // coprime: many combinations
constexpr int32_t kPad = 0x7B7B7B7B;

#define SOAK_CUDA(expr)                                                             \
  do {                                                                              \
    const cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) return std::string(#expr ": ") + cudaGetErrorString(e_); \
  } while (0)
#define SOAK_OK(expr)                                                 \
  do {                                                                \
    const Status s_ = (expr);                                         \
    if (!s_.is_ok()) return std::string(#expr ": ") + s_.to_string(); \
  } while (0)

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
      continue;
    }
    out += c;
  }
  return out;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Options {
  int64_t steps = 100000, check_every = 1000, max_reqs = 8, max_qlen = 2, max_context = 16384;
  int64_t seed = 1, pool_mb = 64;
  double stall_seconds = 60, peer_timeout = 5;
  std::string exchange = "peer", json;
};

// Inputs prepared ahead in pinned host memory (read-only once the loop starts, so a copy still
// queued never sees them change). Seq sets fix the batch: b real requests, bucket B >= b.
struct HostSets {
  int G = 0;                    // block-table columns
  std::vector<int> buckets;     // ascending batch-size buckets
  int32_t* seq = nullptr;       // [kSeqSets][max_reqs]
  std::vector<int> seq_bucket;  // [kSeqSets]: index into buckets
  int32_t* tables = nullptr;    // [kTableSets][max_reqs * G]
  uint16_t* queries = nullptr;  // [kQuerySets][max_rows * T * D]
  std::vector<uint16_t> pool;   // the cache pages, the same on both GPUs
  int64_t pool_pages = 0;
  size_t query_elems = 0;
};

// Both ranks derive each step's choices from the step number alone.
struct StepPlan {
  int seq, table, query, qlen;
};
StepPlan plan_of(const Options& o, int64_t step) {
  const uint64_t h =
      mix(static_cast<uint64_t>(o.seed) * 0x100000001B3ull + static_cast<uint64_t>(step));
  StepPlan p;
  p.seq = static_cast<int>(h % kSeqSets);
  p.table = static_cast<int>((h >> 16) % kTableSets);
  p.query = static_cast<int>((h >> 32) % kQuerySets);
  p.qlen = 1 + static_cast<int>((h >> 48) % static_cast<uint64_t>(o.max_qlen));
  return p;
}

// Counters and verdicts the two rank threads and the watchdog share.
struct Shared {
  std::barrier<> sync{kWorld};
  std::array<std::atomic<double>, kWorld> heartbeat{};  // now_s() of each thread's last progress
  std::array<std::atomic<int64_t>, kWorld> done{};      // steps known complete on each rank
  std::array<std::array<std::atomic<bool>, 2>, kWorld> bad{};  // per check parity
  std::mutex mutex;
  std::string first_failure;                      // guarded by mutex
  std::atomic<int64_t> checks{0}, mismatches{0};  // counted by rank 0
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex);
    if (first_failure.empty()) first_failure = why;
  }
};

struct RankReport {
  size_t free_start = 0, free_end = 0, total = 0;
  int32_t decoder_error = -1, plain_error = -1, peer_error = -1;
  double seconds = 0;
  std::string error;  // set-up failure
};

class Rank {
 public:
  Rank(const Options& o, const HostSets& h, Shared& shared, int rank)
      : o_(o), h_(h), shared_(shared), rank_(rank) {}

  ~Rank() {
    cudaSetDevice(rank_);
    for (auto& row : execs_)
      for (cudaGraphExec_t e : row)
        if (e != nullptr) cudaGraphExecDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    for (void* p : allocations_) cudaFree(p);
    dec_.reset();
    plain_.reset();
  }

  // Collective (both ranks, each from its own thread): decoders, buffers, warm-up, capture.
  std::string set_up(Communicator& comm) {
    comm_ = &comm;
    SOAK_CUDA(cudaSetDevice(rank_));
    const int64_t max_rows = o_.max_reqs * o_.max_qlen;
    SOAK_CUDA(alloc(&pool_, h_.pool.size() * 2));
    SOAK_CUDA(cudaMemcpy(pool_, h_.pool.data(), h_.pool.size() * 2, cudaMemcpyHostToDevice));
    SOAK_CUDA(alloc(&seq_, static_cast<size_t>(o_.max_reqs) * 4));
    SOAK_CUDA(alloc(&table_, static_cast<size_t>(o_.max_reqs) * h_.G * 4));
    SOAK_CUDA(alloc(&query_, h_.query_elems * 2));
    SOAK_CUDA(alloc(&ids_, static_cast<size_t>(kHeads) * max_rows * kTopk * 4));
    SOAK_CUDA(alloc(&plain_ids_, static_cast<size_t>(kHeads) * max_rows * kTopk * 4));
    // Valid inputs for the warm-up: set 0's table and queries, every request 1000 tokens.
    std::vector<int32_t> warm(static_cast<size_t>(o_.max_reqs), 1000);
    SOAK_CUDA(cudaMemcpy(seq_, warm.data(), warm.size() * 4, cudaMemcpyHostToDevice));
    SOAK_CUDA(cudaMemcpy(table_, h_.tables, static_cast<size_t>(o_.max_reqs) * h_.G * 4,
                         cudaMemcpyHostToDevice));
    SOAK_CUDA(cudaMemcpy(query_, h_.queries, h_.query_elems * 2, cudaMemcpyHostToDevice));
    SOAK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

    SOAK_OK(Decoder::create(config(kWorld, rank_), rank_, &dec_));
    SOAK_OK(Decoder::create(config(1, 0), rank_, &plain_));
    geo_ = dec_->geometry();
    SOAK_OK(dec_->clear_error_flag(stream_));
    SOAK_OK(plain_->clear_error_flag(stream_));

    // One eager step per graph first (NCCL connects outside any capture), then the captures in
    // the same order on both ranks.
    execs_.assign(h_.buckets.size(),
                  std::vector<cudaGraphExec_t>(static_cast<size_t>(o_.max_qlen), nullptr));
    for (size_t b = 0; b < h_.buckets.size(); ++b) {
      for (int q = 1; q <= o_.max_qlen; ++q) SOAK_OK(step(h_.buckets[b], q));
    }
    SOAK_CUDA(cudaStreamSynchronize(stream_));
    for (size_t b = 0; b < h_.buckets.size(); ++b) {
      for (int q = 1; q <= o_.max_qlen; ++q) {
        cudaGraph_t graph = nullptr;
        SOAK_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        const Status st = step(h_.buckets[b], q);
        const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
        SOAK_OK(st);
        SOAK_CUDA(end);
        cudaGraphExec_t& exec = execs_[b][static_cast<size_t>(q - 1)];
        const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
        cudaGraphDestroy(graph);
        SOAK_CUDA(inst);
        // Uploaded now, so the first replay allocates nothing inside the measured loop.
        SOAK_CUDA(cudaGraphUpload(exec, stream_));
      }
    }
    // The checks' plain decodes too, once per shape (their kernels are loaded before the loop).
    for (int B : h_.buckets) {
      for (int q = 1; q <= o_.max_qlen; ++q) {
        const int64_t n = static_cast<int64_t>(B) * q;
        SOAK_OK(plain_->decode(inputs(B, q, 0, kHeads), TopkOutput{plain_ids_, n * kTopk, kTopk},
                               nullptr, stream_));
      }
    }
    SOAK_CUDA(cudaDeviceSynchronize());
    return {};
  }

  // The soak loop; returns "" or why this rank stopped. Both ranks stop at the same check.
  std::string run(RankReport* report) {
    SOAK_CUDA(cudaSetDevice(rank_));
    SOAK_CUDA(cudaDeviceSynchronize());
    SOAK_CUDA(cudaMemGetInfo(&report->free_start, &report->total));
    shared_.sync.arrive_and_wait();
    const double t0 = now_s();
    std::string stop;
    int64_t check_index = 0;
    for (int64_t s = 0; s < o_.steps && stop.empty(); ++s) {
      const StepPlan p = plan_of(o_, s);
      const int bucket = h_.seq_bucket[static_cast<size_t>(p.seq)];
      const int B = h_.buckets[static_cast<size_t>(bucket)];
      const int64_t n = static_cast<int64_t>(B) * p.qlen;
      SOAK_CUDA(cudaMemcpyAsync(seq_, h_.seq + static_cast<size_t>(p.seq) * o_.max_reqs,
                                static_cast<size_t>(B) * 4, cudaMemcpyHostToDevice, stream_));
      SOAK_CUDA(
          cudaMemcpyAsync(table_, h_.tables + static_cast<size_t>(p.table) * o_.max_reqs * h_.G,
                          static_cast<size_t>(B) * h_.G * 4, cudaMemcpyHostToDevice, stream_));
      SOAK_CUDA(cudaMemcpyAsync(query_, h_.queries + static_cast<size_t>(p.query) * h_.query_elems,
                                static_cast<size_t>(n) * kHeads * kHeadDim * 2,
                                cudaMemcpyHostToDevice, stream_));
      const bool check = (s + 1) % o_.check_every == 0 || s + 1 == o_.steps;
      if (check) {
        SOAK_CUDA(cudaMemsetAsync(ids_, 0x7B, static_cast<size_t>(geo_.local_heads) * n * kTopk * 4,
                                  stream_));
      }
      SOAK_CUDA(cudaGraphLaunch(
          execs_[static_cast<size_t>(bucket)][static_cast<size_t>(p.qlen - 1)], stream_));
      if (!check) continue;
      const std::string why = check_step(B, p.qlen);
      shared_.done[static_cast<size_t>(rank_)] = s + 1;
      shared_.heartbeat[static_cast<size_t>(rank_)] = now_s();
      // Both ranks decide together whether to go on (a rank that stops alone would leave its
      // peer waiting in the next exchange).
      const size_t parity = static_cast<size_t>(check_index++ % 2);
      shared_.bad[static_cast<size_t>(rank_)][parity] = !why.empty();
      if (!why.empty())
        shared_.fail("rank " + std::to_string(rank_) + ", step " + std::to_string(s) + ": " + why);
      shared_.sync.arrive_and_wait();
      bool any_bad = false;
      for (int r = 0; r < kWorld; ++r)
        any_bad = any_bad || shared_.bad[static_cast<size_t>(r)][parity];
      if (rank_ == 0) {
        ++shared_.checks;
        if (any_bad) ++shared_.mismatches;
      }
      if (any_bad) stop = why.empty() ? "the peer rank failed a check" : why;
    }
    SOAK_CUDA(cudaStreamSynchronize(stream_));
    report->seconds = now_s() - t0;
    SOAK_CUDA(cudaMemGetInfo(&report->free_end, &report->total));
    read_flags(report);
    return stop;
  }

  void read_flags(RankReport* report) {
    cudaSetDevice(rank_);
    cudaMemcpy(&report->decoder_error, dec_->error_flag(), 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(&report->plain_error, plain_->error_flag(), 4, cudaMemcpyDeviceToHost);
    report->peer_error = 0;  // NCCL: no word
    if (peer_error_flag(*comm_) != nullptr &&
        !read_peer_error_flag(*comm_, &report->peer_error).is_ok()) {
      report->peer_error = -1;  // unreadable: reported as set
    }
  }

 private:
  DecodeConfig config(int world, int rank) const {
    DecodeConfig c;
    c.total_heads = kHeads;
    c.world_size = world;
    c.rank = rank;
    c.max_tokens = static_cast<int>(o_.max_reqs * o_.max_qlen);
    c.max_seq_len = static_cast<int32_t>(o_.max_context);
    c.max_query_len = static_cast<int>(o_.max_qlen);
    c.cache_dtype = DType::kBF16;
    return c;
  }

  DecodeInputs inputs(int reqs, int qlen, int head_offset, int heads) const {
    DecodeInputs in;
    in.query = query_ + static_cast<int64_t>(head_offset) * kHeadDim;
    in.q_row_stride = static_cast<int64_t>(kHeads) * kHeadDim;
    in.q_head_stride = kHeadDim;
    in.num_heads = heads;
    in.cache.data = pool_;
    in.cache.dtype = DType::kBF16;
    in.cache.num_pages = h_.pool_pages;
    in.block_table = table_;
    in.bt_row_stride = h_.G;
    in.seq_lens = seq_;
    in.num_reqs = reqs;
    in.query_len = qlen;
    in.max_seq_len = static_cast<int32_t>(o_.max_context);
    in.scale = 0.08838834764831845f;
    return in;
  }

  Status step(int reqs, int qlen) {
    const int64_t n = static_cast<int64_t>(reqs) * qlen;
    return dec_->cp_decode(*comm_, inputs(reqs, qlen, geo_.head_offset, geo_.local_heads),
                           TopkOutput{ids_, n * kTopk, kTopk}, nullptr, stream_);
  }

  // After the step's graph: the plain decode of all heads on this GPU (same stream, same
  // inputs), then the owned heads compared bitwise and the error words read.
  std::string check_step(int reqs, int qlen) {
    const int64_t n = static_cast<int64_t>(reqs) * qlen;
    SOAK_OK(plain_->decode(inputs(reqs, qlen, 0, kHeads), TopkOutput{plain_ids_, n * kTopk, kTopk},
                           nullptr, stream_));
    SOAK_CUDA(cudaStreamSynchronize(stream_));
    const size_t per_head = static_cast<size_t>(n) * kTopk;
    std::vector<int32_t> got(per_head * geo_.local_heads), want(per_head * kHeads);
    SOAK_CUDA(cudaMemcpy(got.data(), ids_, got.size() * 4, cudaMemcpyDeviceToHost));
    SOAK_CUDA(cudaMemcpy(want.data(), plain_ids_, want.size() * 4, cudaMemcpyDeviceToHost));
    for (int j = 0; j < geo_.local_heads; ++j) {
      for (size_t i = 0; i < per_head; ++i) {
        const int32_t g = got[per_head * j + i];
        const int32_t w = want[per_head * (geo_.head_offset + j) + i];
        if (g == w) continue;
        return "head " + std::to_string(geo_.head_offset + j) + ", row " +
               std::to_string(i / kTopk) + ", slot " + std::to_string(i % kTopk) +
               ": context-parallel id " + std::to_string(g) +
               (g == kPad ? " (never written)" : "") + ", plain id " + std::to_string(w) +
               " (B=" + std::to_string(reqs) + ", Q=" + std::to_string(qlen) + ")";
      }
    }
    RankReport flags;
    read_flags(&flags);
    if (flags.decoder_error != 0 || flags.plain_error != 0 || flags.peer_error != 0) {
      return "error words: decoder " + std::to_string(flags.decoder_error) + ", plain " +
             std::to_string(flags.plain_error) + ", peer " + std::to_string(flags.peer_error);
    }
    return {};
  }

  template <typename T>
  cudaError_t alloc(T** p, size_t bytes) {
    void* raw = nullptr;
    const cudaError_t e = cudaMalloc(&raw, std::max<size_t>(bytes, 1));
    if (e == cudaSuccess) allocations_.push_back(raw);
    *p = static_cast<T*>(raw);
    return e;
  }

  const Options& o_;
  const HostSets& h_;
  Shared& shared_;
  int rank_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<Decoder> dec_, plain_;
  Geometry geo_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
  uint16_t* pool_ = nullptr;
  int32_t *seq_ = nullptr, *table_ = nullptr, *ids_ = nullptr, *plain_ids_ = nullptr;
  uint16_t* query_ = nullptr;
  std::vector<std::vector<cudaGraphExec_t> > execs_;  // [bucket][Q - 1]
};

std::string prepare(const Options& o, HostSets* h) {
  h->G = static_cast<int>(cdiv(o.max_context, kBlockSize));
  for (int b = 1; b < o.max_reqs; b *= 2) h->buckets.push_back(b);
  h->buckets.push_back(static_cast<int>(o.max_reqs));
  const int64_t page_elems = static_cast<int64_t>(kBlockSize) * kHeadDim;
  h->pool_pages = std::max<int64_t>(o.pool_mb * (1 << 20) / (page_elems * 2), 1);
  h->pool.resize(static_cast<size_t>(h->pool_pages * page_elems));
  fill_random_bf16(h->pool, static_cast<uint64_t>(o.seed) * 7 + 1);
  const size_t R = static_cast<size_t>(o.max_reqs), G = static_cast<size_t>(h->G);
  h->query_elems = R * static_cast<size_t>(o.max_qlen) * kHeads * kHeadDim;
  SOAK_CUDA(cudaMallocHost(&h->seq, kSeqSets * R * 4));
  SOAK_CUDA(cudaMallocHost(&h->tables, kTableSets * R * G * 4));
  SOAK_CUDA(cudaMallocHost(&h->queries, kQuerySets * h->query_elems * 2));
  uint64_t x = static_cast<uint64_t>(o.seed) * 31 + 5;
  auto draw = [&](uint64_t bound) { return (x = mix(x)) % bound; };
  for (int s = 0; s < kSeqSets; ++s) {
    int32_t* lens = h->seq + static_cast<size_t>(s) * R;
    const int b = 1 + static_cast<int>(draw(R));
    size_t bucket = 0;
    while (h->buckets[bucket] < b) ++bucket;
    h->seq_bucket.push_back(static_cast<int>(bucket));
    const bool all_padding = draw(64) == 0;
    for (size_t i = 0; i < R; ++i) {
      int32_t len = 0;
      const uint64_t kind = draw(8);
      if (static_cast<int>(i) >= b || all_padding || kind == 0) {
        len = 0;  // a padding row
      } else if (kind <= 2) {
        len = 1 + static_cast<int32_t>(draw(300));  // short: one rank owns no block
      } else {
        len = 1 + static_cast<int32_t>(draw(static_cast<uint64_t>(o.max_context)));
      }
      lens[i] = len;
    }
  }
  for (size_t i = 0; i < kTableSets * R * G; ++i) {
    h->tables[i] = static_cast<int32_t>(draw(static_cast<uint64_t>(h->pool_pages)));
  }
  std::vector<uint16_t> q(h->query_elems);
  for (int s = 0; s < kQuerySets; ++s) {
    fill_random_bf16(q, static_cast<uint64_t>(o.seed) * 1000 + static_cast<uint64_t>(s));
    std::copy(q.begin(), q.end(), h->queries + static_cast<size_t>(s) * h->query_elems);
  }
  return {};
}

void write_json(const Options& o, const std::string& status, int64_t steps_done, int64_t checks,
                int64_t mismatches, size_t graphs, const std::vector<RankReport>& ranks,
                double seconds) {
  std::FILE* f = o.json.empty() ? nullptr : std::fopen(o.json.c_str(), "w");
  std::FILE* outs[2] = {stdout, f};
  for (std::FILE* out : outs) {
    if (out == nullptr) continue;
    std::fprintf(out,
                 "{\"tool\": \"cpidx soak\", \"exchange\": \"%s\", \"status\": \"%s\", "
                 "\"steps_requested\": %lld, \"steps_done\": %lld, \"checks\": %lld, "
                 "\"failed_checks\": %lld, \"seconds\": %.3f, \"us_per_step\": %.3f, "
                 "\"graphs_per_gpu\": %zu,\n \"shape\": {\"heads\": %d, \"topk\": %d, "
                 "\"max_reqs\": %lld, \"max_qlen\": %lld, \"max_context\": %lld, "
                 "\"check_every\": %lld, \"seed\": %lld},\n \"ranks\": [",
                 o.exchange.c_str(), json_escape(status).c_str(), static_cast<long long>(o.steps),
                 static_cast<long long>(steps_done), static_cast<long long>(checks),
                 static_cast<long long>(mismatches), seconds,
                 steps_done > 0 ? seconds * 1e6 / static_cast<double>(steps_done) : 0.0, graphs,
                 kHeads, kTopk, static_cast<long long>(o.max_reqs),
                 static_cast<long long>(o.max_qlen), static_cast<long long>(o.max_context),
                 static_cast<long long>(o.check_every), static_cast<long long>(o.seed));
    for (size_t r = 0; r < ranks.size(); ++r) {
      const RankReport& x = ranks[r];
      std::fprintf(out,
                   "%s\n  {\"device\": %zu, \"mem_free_start\": %zu, \"mem_free_end\": %zu, "
                   "\"mem_delta_bytes\": %lld, \"decoder_error_flag\": %d, \"plain_error_flag\": "
                   "%d, \"peer_error_flag\": %d, \"loop_seconds\": %.3f}",
                   r ? "," : "", r, x.free_start, x.free_end,
                   static_cast<long long>(x.free_start) - static_cast<long long>(x.free_end),
                   x.decoder_error, x.plain_error, x.peer_error, x.seconds);
    }
    std::fprintf(out, "]}\n");
    std::fflush(out);
  }
  if (f != nullptr) std::fclose(f);
}

}  // namespace

int run_soak(int argc, char** argv) {
  Options o;
  Flags flags("cpidx soak [flags]",
              "Soak of the context-parallel step on GPUs 0 and 1 (one thread each): cp_decode\n"
              "captured per (batch bucket, Q) in CUDA graphs and replayed --steps times with new\n"
              "seq_lens (padding rows included), block tables and queries between replays; every\n"
              "--check-every steps each rank's owned heads are compared bitwise with the plain\n"
              "decode on its GPU and the error words are read; device memory must not change.\n"
              "Exit code 0 when every check passes, 1 on a mismatch or an error, 2 on bad flags,\n"
              "3 when the ranks make no progress for --stall-seconds (a hang).");
  constexpr int64_t kMost = int64_t{1} << 40;  // "1..1048576M": past any soak's steps
  flags.add("steps", &o.steps, "graph replays (steps)", 1, kMost)
      .add("exchange", &o.exchange, "the step's exchanges", {"peer", "nccl"})
      .add("check-every", &o.check_every, "steps between checks against the plain decode", 1,
           kMost)
      .add("max-reqs", &o.max_reqs, "largest batch (requests); buckets are powers of two", 1,
           1 << 20)
      .add("max-qlen", &o.max_qlen, "largest Q (each Q in 1..max has its graphs)", 1,
           kMaxQueryLen)
      .add("max-context", &o.max_context, "longest request (tokens)", 1, 1 << 24)
      .add("pool-mb", &o.pool_mb, "MiB of random cache pages per GPU", 1, int64_t{1} << 20)
      .add("seed", &o.seed, "seed of the inputs and of the step schedule")
      .add("stall-seconds", &o.stall_seconds, "report a hang after this long without progress")
      .add("peer-timeout", &o.peer_timeout,
           "seconds a peer gather waits before raising its error word")
      .add("json", &o.json, "write the summary as JSON to this file");
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  const auto positive = [](const char* name, double seconds) {
    if (seconds > 0) return true;
    std::fprintf(stderr, "cpidx soak: --%s must be > 0, got %g\n", name, seconds);
    return false;
  };
  if (!positive("stall-seconds", o.stall_seconds) || !positive("peer-timeout", o.peer_timeout)) {
    return kExitUsage;
  }
  // Load every kernel when CUDA starts (unless the caller chose otherwise): with lazy loading, a
  // kernel first used inside the loop would allocate device memory and spoil the flat-memory check.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < kWorld) {
    std::fprintf(stderr, "cpidx soak: needs %d GPUs, found %d\n", kWorld, count);
    return kExitFailed;
  }
  std::fprintf(stderr,
               "cpidx soak: %lld steps, %s exchange, up to %lld requests x %lld tokens, "
               "Q 1..%lld\n",
               static_cast<long long>(o.steps), o.exchange.c_str(),
               static_cast<long long>(o.max_reqs), static_cast<long long>(o.max_context),
               static_cast<long long>(o.max_qlen));

  HostSets h;
  std::vector<RankReport> reports(kWorld);
  if (std::string why = prepare(o, &h); !why.empty()) {
    write_json(o, "FAIL: " + why, 0, 0, 0, 0, reports, 0);
    return kExitFailed;
  }
  Shared shared;
  for (int r = 0; r < kWorld; ++r) {
    shared.heartbeat[static_cast<size_t>(r)] = now_s();
    shared.done[static_cast<size_t>(r)] = 0;
  }

  // Communicators: NCCL (one process, both GPUs); the peer one over thread communicators.
  std::vector<std::unique_ptr<Communicator> > hosts = make_thread_communicators(kWorld), nccl,
                                              peers(kWorld);
  if (o.exchange == "nccl") {
    Status st;
    nccl = make_nccl_communicators_single_process({0, 1}, &st);
    if (!st.is_ok()) {
      write_json(o, "FAIL: NCCL: " + st.to_string(), 0, 0, 0, 0, reports, 0);
      return kExitFailed;
    }
  }
  Geometry geo;
  make_geometry(kHeads, kWorld, 0, &geo);  // constants the tool was built with
  const size_t peer_bytes = cp_gather_bytes(geo, o.max_reqs * o.max_qlen, kTopk).larger();

  std::vector<std::unique_ptr<Rank> > ranks;
  for (int r = 0; r < kWorld; ++r) ranks.push_back(std::make_unique<Rank>(o, h, shared, r));
  std::vector<std::string> errors(kWorld);
  std::atomic<int> finished{0};
  const double t0 = now_s();
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      const size_t i = static_cast<size_t>(r);
      cudaSetDevice(r);
      Communicator* comm = nullptr;
      std::string& err = errors[i];
      if (o.exchange == "peer") {
        Status st;
        peers[i] = make_peer_communicator(*hosts[i], r, peer_bytes, &st, o.peer_timeout);
        if (!st.is_ok()) err = "peer communicator: " + st.to_string();
        comm = peers[i].get();
      } else {
        comm = nccl[i].get();
      }
      // Set-up failures are agreed on, so no rank goes on alone.
      if (err.empty()) err = ranks[i]->set_up(*comm);
      shared.heartbeat[i] = now_s();
      const Status agree = hosts[i]->check_agree(err.empty() ? 1 : 0, "soak set-up succeeded");
      if (err.empty() && !agree.is_ok()) err = "the peer rank's set-up failed";
      if (err.empty())
        err = ranks[i]->run(&reports[i]);
      else
        ranks[i]->read_flags(&reports[i]);
      ++finished;
    });
  }

  // Watchdog: a rank without progress for --stall-seconds is a hang (an NCCL exchange whose peer
  // never arrives would otherwise wait for ever); report it and leave without joining.
  while (finished.load() < kWorld) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    double oldest = now_s();
    for (int r = 0; r < kWorld; ++r)
      oldest = std::min<double>(oldest, shared.heartbeat[static_cast<size_t>(r)]);
    if (finished.load() < kWorld && now_s() - oldest > o.stall_seconds) {
      const int64_t done = std::min<int64_t>(shared.done[0], shared.done[1]);
      std::fprintf(stderr, "cpidx soak: no progress for %.0f s after step %lld: hang\n",
                   o.stall_seconds, static_cast<long long>(done));
      write_json(o,
                 "hang: no progress for " + std::to_string(static_cast<int>(o.stall_seconds)) +
                     " s after step " + std::to_string(done),
                 done, shared.checks, shared.mismatches, 0, reports, now_s() - t0);
      std::fflush(nullptr);
      std::_Exit(3);
    }
  }
  for (std::thread& t : threads) t.join();

  std::string status = "ok";
  for (int r = 0; r < kWorld && status == "ok"; ++r) {
    if (!errors[static_cast<size_t>(r)].empty())
      status = "FAIL: rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)];
  }
  {
    std::lock_guard<std::mutex> lock(shared.mutex);
    if (status == "ok" && !shared.first_failure.empty()) status = "FAIL: " + shared.first_failure;
  }
  for (int r = 0; r < kWorld && status == "ok"; ++r) {
    const RankReport& x = reports[static_cast<size_t>(r)];
    if (x.free_start != x.free_end) {
      status = "FAIL: device memory of GPU " + std::to_string(r) + " changed by " +
               std::to_string(static_cast<long long>(x.free_start) -
                              static_cast<long long>(x.free_end)) +
               " bytes";
    } else if (x.decoder_error != 0 || x.plain_error != 0 || x.peer_error != 0) {
      status = "FAIL: error words on GPU " + std::to_string(r);
    }
  }
  const int64_t done = std::min<int64_t>(shared.done[0], shared.done[1]);
  const double seconds = std::max(reports[0].seconds, reports[1].seconds);
  write_json(o, status, done, shared.checks, shared.mismatches,
             h.buckets.size() * static_cast<size_t>(o.max_qlen), reports, seconds);
  ranks.clear();
  peers.clear();
  nccl.clear();
  cudaFreeHost(h.seq);
  cudaFreeHost(h.tables);
  cudaFreeHost(h.queries);
  return status == "ok" ? kExitOk : kExitFailed;
}

#endif

}  // namespace cpidx::tools
