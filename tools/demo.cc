// tools/demo.cc: `cpidx demo`: one synthetic decode step through the context-parallel decode
// (ranks as threads, or one MPI process per rank) and through the plain decode, checked to select
// identical ids in identical order, with a per-rank report of cache bytes read and stage times.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "args.h"
#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/reference.h"
#include "demo_gpu.h"
#include "mpi_session.h"
#include "subcommands.h"
#include "synthetic.h"

namespace cpidx::tools {
namespace {

struct DemoOptions {
  int64_t heads = 4;
  int64_t ranks = 4;
  int64_t requests = 8;
  int64_t context = 65536;
  int64_t query_len = 1;
  int64_t topk = 16;
  int64_t init = 0;
  int64_t local = 1;
  int64_t seed = 1;
  std::string dtype = "bf16";
  int64_t rows_shown = 3;
  int64_t threads = 0;
  bool mpi = false;
  bool gpu = true;    // also run the GPU path when a GPU is present
  bool gpus = false;  // the context-parallel step on P real GPUs through NCCL
  std::string exchange = "nccl";  // the GPU step's exchange under MPI: nccl or peer
  bool ranks_given = false;  // --ranks was on the command line
};

// One rank's numbers, gathered to the printing rank as raw bytes (same binary on every rank).
struct RankReport {
  int32_t rank = 0;
  int32_t head_offset = 0;
  int32_t local_heads = 0;
  int32_t status_code = 0;    // StatusCode of cp_decode
  int32_t device_errors = 0;  // DeviceError bits
  int32_t unused = 0;
  int64_t cache_bytes = 0;    // index cache read by this rank (its block shard)
  double gather_queries_ms = 0, score_topk_ms = 0, gather_keys_ms = 0, merge_ms = 0;
  double total_ms = 0;
};

struct RankRun {
  RankReport report;
  std::vector<int32_t> ids;  // [L][n][K]
};

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Progress notes go to stderr, and only when it is a terminal (stdout stays a clean report).
void progress(bool printer, const char* what) {
  if (printer && isatty(STDERR_FILENO)) std::fprintf(stderr, "cpidx demo: %s...\n", what);
}

// This rank's share of the context-parallel decode.
RankRun run_rank(Communicator& comm, const SyntheticStep& step, const Selection& sel) {
  RankRun run;
  RankReport& rep = run.report;
  rep.rank = comm.rank();
  Geometry geo;
  Status status = make_geometry(step.config.total_heads, comm.world_size(), comm.rank(), &geo);
  if (status.is_ok()) {
    rep.head_offset = geo.head_offset;
    rep.local_heads = geo.local_heads;
    const int64_t n = step.num_rows();
    run.ids.assign(static_cast<size_t>(geo.local_heads * n * sel.topk), -2);
    const TopkOutput out{run.ids.data(), n * sel.topk, sel.topk};
    ref::CpStageTimes times;
    const Clock::time_point start = Clock::now();
    status = ref::cp_decode(comm, geo, step.for_heads(geo.head_offset, geo.local_heads), sel, out,
                            nullptr, &rep.device_errors, &times);
    rep.total_ms = ms_since(start);
    rep.gather_queries_ms = times.gather_queries_ms;
    rep.score_topk_ms = times.score_topk_ms;
    rep.gather_keys_ms = times.gather_keys_ms;
    rep.merge_ms = times.merge_ms;
    rep.cache_bytes = ref::shard_cache_bytes(step.for_heads(0, step.config.total_heads),
                                             comm.world_size(), comm.rank());
  }
  rep.status_code = static_cast<int32_t>(status.code());
  if (!status.is_ok()) {
    std::fprintf(stderr, "cpidx demo: rank %d: %s\n", comm.rank(), status.to_string().c_str());
  }
  return run;
}

std::string head_range(int first, int count) {
  return count == 1 ? std::to_string(first)
                    : std::to_string(first) + "-" + std::to_string(first + count - 1);
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

void print_config(const DemoOptions& o, const SyntheticStep& step, const Geometry& geo0,
                  const char* mode) {
  const SyntheticConfig& c = step.config;
  int32_t shortest = c.context, longest = 0;
  for (int32_t s : step.seq_lens) {
    shortest = std::min(shortest, s);
    longest = std::max(longest, s);
  }
  const int64_t page_bytes = int64_t{kBlockSize} * kHeadDim * dtype_bytes(c.cache_dtype);
  std::printf("# cpidx demo: one decode step of the MiniMax-M3 indexer, context-parallel vs plain "
              "(CPU reference)\n");
  std::printf("# %s\n#\n", mode);
  std::printf("# heads T=%d, ranks P=%d: local heads L=%d, replicas R=%d\n", c.total_heads,
              geo0.world_size, geo0.local_heads, geo0.replicas);
  std::printf("# requests %d x query_len Q=%d = %lld rows; seq_lens %d..%d (max_seq_len %d, %lld "
              "blocks of %d tokens)\n",
              c.num_reqs, c.query_len, static_cast<long long>(step.num_rows()), shortest, longest,
              c.context, static_cast<long long>(step.max_blocks), kBlockSize);
  std::printf("# topk K=%lld, init %lld, local %lld, scale 1/sqrt(%d) = %.7g, seed %lld\n",
              static_cast<long long>(o.topk), static_cast<long long>(o.init),
              static_cast<long long>(o.local), kHeadDim, static_cast<double>(step.scale),
              static_cast<long long>(o.seed));
  std::printf("# index cache %s: %lld pages x %d tokens x %d dims = %.2f MiB, block table "
              "shuffled\n#\n",
              to_string(c.cache_dtype), static_cast<long long>(step.num_pages), kBlockSize,
              kHeadDim, mib(step.num_pages * page_bytes));
  std::fflush(stdout);
}

// First difference between each rank's ids and the plain ids of the same global head; empty when
// every rank matches.
std::string first_mismatch(const std::vector<RankRun>& runs, const std::vector<int32_t>& plain,
                           int64_t n, int topk) {
  for (const RankRun& run : runs) {
    const RankReport& rep = run.report;
    for (int h = 0; h < rep.local_heads; ++h) {
      for (int64_t row = 0; row < n; ++row) {
        const int32_t* got = run.ids.data() + (h * n + row) * topk;
        const int32_t* want = plain.data() + ((rep.head_offset + h) * n + row) * topk;
        for (int k = 0; k < topk; ++k) {
          if (got[k] == want[k]) continue;
          char text[256];
          std::snprintf(text, sizeof(text),
                        "rank %d, head %d, row %lld, slot %d: context-parallel id %d, plain id %d",
                        rep.rank, rep.head_offset + h, static_cast<long long>(row), k, got[k],
                        want[k]);
          return text;
        }
      }
    }
  }
  return {};
}

// Prints the per-rank table, the verdict and a few selected rows; returns the exit code.
int print_report(const DemoOptions& o, const SyntheticStep& step, const Selection& sel,
                 const std::vector<RankRun>& runs, const std::vector<int32_t>& plain,
                 int64_t plain_bytes, double plain_ms, int32_t plain_errors,
                 const Status& plain_status) {
  const int T = step.config.total_heads;
  const int64_t n = step.num_rows();
  std::printf("#                    cache read      ------------------ time (ms) -----------------"
              "-\n");
  std::printf("#  rank  heads      MiB  of plain   gather q  score+top-k  gather keys     merge"
              "      total\n");
  for (const RankRun& run : runs) {
    const RankReport& r = run.report;
    std::printf("%7d  %5s  %7.2f  %7.1f%%  %9.2f  %11.2f  %11.2f  %8.2f  %9.2f\n", r.rank,
                head_range(r.head_offset, r.local_heads).c_str(), mib(r.cache_bytes),
                plain_bytes ? 100.0 * static_cast<double>(r.cache_bytes) / plain_bytes : 0.0,
                r.gather_queries_ms, r.score_topk_ms, r.gather_keys_ms, r.merge_ms, r.total_ms);
  }
  std::printf("%7s  %5s  %7.2f  %7.1f%%  %9s  %11.2f  %11s  %8s  %9.2f\n", "plain",
              head_range(0, T).c_str(), mib(plain_bytes), 100.0, "-", plain_ms, "-", "-",
              plain_ms);
  std::printf("# (the gathers include waiting for the slowest rank; ranks may share cores)\n#\n");

  // Verdict: library errors first, then the device-side flags, then the ids.
  std::string failure;
  for (const RankRun& run : runs) {
    if (run.report.status_code != 0 && failure.empty()) {
      failure = "rank " + std::to_string(run.report.rank) + ": cp_decode returned " +
                to_string(static_cast<StatusCode>(run.report.status_code)) + " (see stderr)";
    }
    if (run.report.device_errors != 0 && failure.empty()) {
      failure = "rank " + std::to_string(run.report.rank) + ": device error flag " +
                std::to_string(run.report.device_errors) + " on valid inputs";
    }
  }
  if (failure.empty() && !plain_status.is_ok()) {
    failure = "plain decode: " + plain_status.to_string();
  }
  if (failure.empty() && plain_errors != 0) {
    failure = "plain decode: device error flag " + std::to_string(plain_errors);
  }
  if (failure.empty()) failure = first_mismatch(runs, plain, n, sel.topk);
  if (failure.empty()) {
    std::printf("selection: context-parallel == plain on every rank (%lld rows x %d heads, "
                "identical ids in identical order)\n",
                static_cast<long long>(n), T);
  } else {
    std::printf("selection: FAILED: %s\n", failure.c_str());
  }

  // A few rows of head 0, as the owning rank (rank 0) selected them.
  const int64_t shown = std::min<int64_t>(o.rows_shown, n);
  if (shown > 0 && !runs.empty() && !runs[0].ids.empty()) {
    std::printf("#\n# selected blocks of head 0, first %lld rows (selection order, -1 = none):\n",
                static_cast<long long>(shown));
    for (int64_t row = 0; row < shown; ++row) {
      const int req = static_cast<int>(row / step.config.query_len);
      const int64_t pos = step.seq_lens[static_cast<size_t>(req)] - step.config.query_len +
                          row % step.config.query_len;
      std::printf("#   row %lld (req %d, pos %lld, %lld blocks visible):",
                  static_cast<long long>(row), req, static_cast<long long>(pos),
                  static_cast<long long>(visible_blocks(pos)));
      for (int k = 0; k < sel.topk; ++k) {
        std::printf(" %d", runs[0].ids[static_cast<size_t>(row * sel.topk + k)]);
      }
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  return failure.empty() ? kExitOk : kExitFailed;
}

// The plain (non-context-parallel) decode of all T heads, timed.
Status run_plain(const SyntheticStep& step, const Selection& sel, std::vector<int32_t>* ids,
                 double* ms, int32_t* errors) {
  const int T = step.config.total_heads;
  const int64_t n = step.num_rows();
  ids->assign(static_cast<size_t>(T * n * sel.topk), -2);
  const TopkOutput out{ids->data(), n * sel.topk, sel.topk};
  const Clock::time_point start = Clock::now();
  Status status = ref::decode_topk(step.for_heads(0, T), sel, out, nullptr, errors);
  *ms = ms_since(start);
  return status;
}

int run_threads(const DemoOptions& o, const SyntheticConfig& config, const Selection& sel) {
  const int P = static_cast<int>(o.ranks);
  Geometry geo0;
  if (Status s = make_geometry(config.total_heads, P, 0, &geo0); !s.is_ok()) {
    std::fprintf(stderr, "cpidx demo: --heads/--ranks: %s\n", s.to_string().c_str());
    return kExitUsage;
  }
  progress(true, "building the inputs");
  const SyntheticStep step = build_synthetic_step(config);
  char mode[160];
  std::snprintf(mode, sizeof(mode),
                "%d ranks as threads of one process on %u cores (mpirun -np P cpidx demo: one "
                "process per rank)",
                P, std::thread::hardware_concurrency());
  print_config(o, step, geo0, mode);

  progress(true, "context-parallel decode");
  std::vector<std::unique_ptr<Communicator>> comms = make_thread_communicators(P);
  std::vector<RankRun> runs(static_cast<size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] { runs[static_cast<size_t>(r)] = run_rank(*comms[r], step, sel); });
  }
  for (std::thread& t : threads) t.join();

  progress(true, "plain decode");
  std::vector<int32_t> plain;
  double plain_ms = 0;
  int32_t plain_errors = 0;
  Status plain_status = run_plain(step, sel, &plain, &plain_ms, &plain_errors);
  const int64_t plain_bytes =
      ref::shard_cache_bytes(step.for_heads(0, step.config.total_heads), 1, 0);
  const int code =
      print_report(o, step, sel, runs, plain, plain_bytes, plain_ms, plain_errors, plain_status);
  if (!o.gpu || !gpu_available()) return code;
  if (P > kMaxWorldSize) {  // the CPU reference takes any P, the GPU decode up to 8
    std::printf("# GPU step skipped: %d ranks, and the GPU decode takes at most %d\n", P,
                kMaxWorldSize);
    return code;
  }
  // Real GPUs when asked (--gpus) or when P equals the GPU count; else P ranks on GPU 0.
  const bool real = o.gpus || (P >= 2 && gpu_count() == P && built_with_nccl());
  progress(true, real ? "GPU decode and context-parallel step on real GPUs"
                      : "GPU decode and simulated context-parallel ranks");
  return std::max(code, run_demo_gpu(step, sel, P, real, plain));
}

// One MPI process per rank: every rank builds the same step, runs its share, and rank 0 checks
// the gathered ids against its own plain decode. Every rank returns rank 0's verdict.
int run_mpi(const DemoOptions& o, int* argc, char*** argv, const SyntheticConfig& config,
            const Selection& sel) {
  MpiSession session;
  std::unique_ptr<Communicator> comm;
  if (Status s = session.start(argc, argv, &comm); !s.is_ok()) {
    std::fprintf(stderr, "cpidx demo: %s\n", s.to_string().c_str());
    return kExitUsage;
  }
  const int P = comm->world_size(), rank = comm->rank();
  const bool printer = rank == 0;
  if (o.ranks_given && o.ranks != P && printer) {
    std::fprintf(stderr, "cpidx demo: --ranks=%lld ignored under MPI: the ranks are the %d MPI "
                 "processes\n", static_cast<long long>(o.ranks), P);
  }
  Geometry geo0;
  if (Status s = make_geometry(config.total_heads, P, 0, &geo0); !s.is_ok()) {
    if (printer) {
      std::fprintf(stderr, "cpidx demo: --heads vs MPI world size: %s\n", s.to_string().c_str());
    }
    return kExitUsage;  // same verdict on every rank, before any collective
  }
  progress(printer, "building the inputs");
  const SyntheticStep step = build_synthetic_step(config);
  if (printer) {
    char mode[128];
    std::snprintf(mode, sizeof(mode), "%d ranks as MPI processes (this is rank 0)", P);
    print_config(o, step, geo0, mode);
  }

  progress(printer, "context-parallel decode");
  // Start the ranks together, so a rank's times do not include another's input building.
  if (Status s = comm->barrier(); !s.is_ok()) {
    std::fprintf(stderr, "cpidx demo: rank %d: %s\n", rank, s.to_string().c_str());
    return kExitFailed;
  }
  RankRun mine = run_rank(*comm, step, sel);
  std::vector<int32_t> plain;
  double plain_ms = 0;
  int32_t plain_errors = 0;
  Status plain_status;
  if (printer) {
    progress(printer, "plain decode");
    plain_status = run_plain(step, sel, &plain, &plain_ms, &plain_errors);
  }

  // Gather every rank's report and ids (same size on every rank: L * n * K) to every rank.
  std::vector<RankReport> reports(static_cast<size_t>(P));
  const size_t id_count = static_cast<size_t>(geo0.local_heads * step.num_rows() * sel.topk);
  mine.ids.resize(id_count, -2);  // a failed rank still takes part with the same byte count
  std::vector<int32_t> all_ids(id_count * static_cast<size_t>(P));
  Status s = comm->all_gather(&mine.report, reports.data(), sizeof(RankReport), nullptr);
  if (s.is_ok()) {
    s = comm->all_gather(mine.ids.data(), all_ids.data(), id_count * sizeof(int32_t), nullptr);
  }
  if (!s.is_ok()) {
    std::fprintf(stderr, "cpidx demo: rank %d: %s\n", rank, s.to_string().c_str());
    return kExitFailed;
  }
  int32_t verdict = kExitOk;
  if (printer) {
    std::vector<RankRun> runs(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      runs[r].report = reports[r];
      runs[r].ids.assign(all_ids.begin() + static_cast<int64_t>(id_count) * r,
                         all_ids.begin() + static_cast<int64_t>(id_count) * (r + 1));
    }
    const int64_t plain_bytes = ref::shard_cache_bytes(step.for_heads(0, config.total_heads), 1, 0);
    verdict = print_report(o, step, sel, runs, plain, plain_bytes, plain_ms, plain_errors,
                           plain_status);
  }
  std::vector<int32_t> verdicts(static_cast<size_t>(P));
  s = comm->all_gather(&verdict, verdicts.data(), sizeof(int32_t), nullptr);
  if (!s.is_ok() || !o.gpu) return s.is_ok() ? verdicts[0] : kExitFailed;

  // The GPU step is collective: every rank takes it or none, so the ranks agree on the fewest
  // GPUs any of them sees (0 in a CPU build or without a GPU).
  const int32_t gpus = gpu_available() ? gpu_count() : 0;
  std::vector<int32_t> counts(static_cast<size_t>(P));
  if (Status g = comm->all_gather(&gpus, counts.data(), sizeof(int32_t), nullptr); !g.is_ok()) {
    std::fprintf(stderr, "cpidx demo: rank %d: %s\n", rank, g.to_string().c_str());
    return kExitFailed;
  }
  const int fewest = *std::min_element(counts.begin(), counts.end());
  if (fewest == 0 && !built_with_cuda()) return verdicts[0];  // the CPU report is the demo
  const bool built = o.exchange == "peer" ? built_with_peer() : built_with_nccl();
  if (fewest < P || !built || P > kMaxWorldSize) {
    if (printer && P > kMaxWorldSize) {
      std::printf("# GPU step skipped: %d MPI processes, and the GPU decode takes at most %d\n",
                  P, kMaxWorldSize);
    } else if (printer && fewest < P) {
      std::printf("# GPU step skipped: %d GPU%s on this host for %d MPI processes (it needs one "
                  "GPU per process)\n", fewest, fewest == 1 ? "" : "s", P);
    } else if (printer) {
      std::printf("# GPU step skipped: --exchange %s, but this cpidx was built without %s\n",
                  o.exchange.c_str(), o.exchange == "peer" ? "the peer communicator" : "NCCL");
    }
    std::fflush(stdout);
    return verdicts[0];
  }
  progress(printer, "GPU decode and context-parallel step, one process per GPU");
  return std::max<int>(verdicts[0], run_demo_gpu_mpi(*comm, step, sel, o.exchange, plain));
}

}  // namespace

int run_demo(int argc, char** argv) {
  DemoOptions o;
  Flags flags("cpidx demo [flags]",
              "Builds one synthetic decode step (random-normal bf16 queries, a bf16 index cache or\n"
              "with --dtype=fp8 an fp8 e4m3 one, shuffled block table, seq_lens uniform in\n"
              "(context-128, context]) and selects its top-K blocks twice: context-parallel over\n"
              "--ranks ranks (threads, or one MPI process per rank under mpirun) and plain on all\n"
              "heads. Checks that both select identical ids in identical order and reports, per\n"
              "rank, the index-cache bytes read and the time of each stage. With a GPU (CUDA build)\n"
              "it then runs the plain GPU decode and the context-parallel step (threads: P real\n"
              "GPUs through NCCL, or P ranks simulated on GPU 0; under mpirun: one process per GPU\n"
              "through --exchange, skipped with fewer GPUs than processes) with CUDA-event stage\n"
              "times, and checks GPU ids against the CPU reference (near-ties within 1e-3 allowed)\n"
              "and context-parallel against plain GPU (bitwise). Exit code 0 when everything\n"
              "agrees, 1 when not, 2 on bad flags.");
  // Integers are range-checked by the parser, which names the flag.
  flags.add("heads", &o.heads, "index heads T", 1, kMaxHeads)
      .add("ranks", &o.ranks, "tensor-parallel ranks P, run as threads (under MPI: the processes)",
           1, 1024)
      .add("requests", &o.requests, "decode requests in the batch", 1, 1 << 20)
      .add("context", &o.context, "tokens per request L; seq_lens are uniform in (L-128, L]", 1,
           INT32_MAX)
      .add("query-len", &o.query_len, "decode query tokens per request Q (1 + speculative)", 1,
           kMaxQueryLen)
      .add("topk", &o.topk, "blocks selected per (head, row) K", 1, kMaxTopK)
      .add("init", &o.init, "forced leading blocks", 0, INT32_MAX)
      .add("local", &o.local, "forced trailing blocks", 0, INT32_MAX)
      .add("seed", &o.seed, "seed of the synthetic inputs (identical on every rank)")
      .add("dtype", &o.dtype, "index cache dtype", {"bf16", "fp8"})
      .add("rows-shown", &o.rows_shown, "rows of head 0 whose selected blocks are printed", 0,
           1 << 20)
      .add("threads", &o.threads, "threads that build the inputs (0: all cores)", 0, 1024)
      .add("mpi", &o.mpi, "one MPI process per rank (automatic under mpirun with -np > 1)")
      .add("gpu", &o.gpu, "also decode on the GPU when one is present (plain + context-parallel)")
      .add("gpus", &o.gpus,
           "run the GPU context-parallel step on P real GPUs through NCCL, one thread per GPU; "
           "without it, real GPUs only when P equals the GPU count, else P ranks simulated on "
           "GPU 0 (threads only: under MPI each process always runs on its own GPU)")
      .add("exchange", &o.exchange,
           "the GPU step's exchange under MPI (threads use NCCL): NCCL, or the peer "
           "communicator (one host, peer access)",
           {"nccl", "peer"});
  if (int code = 0; !parse_flags(flags, argc, argv, &code)) return code;
  o.ranks_given = flags.is_set("ranks");
  SyntheticConfig config;
  config.total_heads = static_cast<int>(o.heads);
  config.num_reqs = static_cast<int>(o.requests);
  config.context = static_cast<int32_t>(o.context);
  config.query_len = static_cast<int>(o.query_len);
  config.cache_dtype = o.dtype == "fp8" ? DType::kFP8E4M3 : DType::kBF16;
  config.seed = static_cast<uint64_t>(o.seed);
  config.threads = static_cast<int>(o.threads);
  Selection sel;
  sel.topk = static_cast<int>(o.topk);
  sel.init_blocks = static_cast<int>(o.init);
  sel.local_blocks = static_cast<int>(o.local);

  const bool under_mpi = launched_by_mpi();
  if (o.mpi || under_mpi) {
    if (!built_with_mpi()) {
      std::fprintf(stderr, "cpidx demo: %s\n",
                   under_mpi ? "started by mpirun, but this cpidx was built without MPI "
                               "(install libopenmpi-dev and reconfigure)"
                             : "--mpi needs a build with MPI (install libopenmpi-dev and "
                               "reconfigure)");
      return kExitUsage;
    }
    return run_mpi(o, &argc, &argv, config, sel);
  }
  if (o.gpus && (!built_with_nccl() || o.ranks < 2 || gpu_count() < o.ranks || !o.gpu)) {
    std::fprintf(stderr, "cpidx demo: --gpus needs a build with NCCL, --ranks >= 2, --gpu and "
                 "at least --ranks GPUs (NCCL %s, --ranks=%lld, %d GPUs)\n",
                 built_with_nccl() ? "built" : "not built", static_cast<long long>(o.ranks),
                 gpu_count());
    return kExitUsage;
  }
  if (o.exchange != "nccl") {
    std::fprintf(stderr, "cpidx demo: --exchange=%s works under mpirun only (one process per "
                 "GPU); with ranks as threads the GPU step exchanges through NCCL\n",
                 o.exchange.c_str());
    return kExitUsage;
  }
  return run_threads(o, config, sel);
}

}  // namespace cpidx::tools
