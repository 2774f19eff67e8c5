// tools/main.cc: the `cpidx` command. Dispatches `cpidx <subcommand> [flags]` through one table;
// `cpidx --help` lists the subcommands, `cpidx <subcommand> --help` lists its flags, `cpidx
// --version` prints the library's version. A subcommand whose buffers, allocated on its main
// thread, do not fit in host memory exits 2 (a bad command line for this host), saying so;
// under mpirun it ends as an uncaught exception does.
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>

#include "cpidx/version.h"
#include "mpi_session.h"
#include "subcommands.h"

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

constexpr Subcommand kSubcommands[] = {
    {"demo", "one synthetic decode step: context-parallel vs plain selection, per-rank report",
     cpidx::tools::run_demo},
    {"bench", "GPU benchmark sweep (needs a CUDA build and a GPU)", cpidx::tools::run_bench},
    {"soak", "2-GPU soak: the context-parallel step replayed in CUDA graphs, checked as it runs",
     cpidx::tools::run_soak},
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: cpidx <command> [flags]   (or --help, --version)\n\n"
               "cpidx " CPIDX_VERSION
               ": the decode-time indexer of block-sparse attention (MiniMax-M3), with\n"
               "context parallelism across tensor-parallel ranks.\n\ncommands:\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(out, "  %-8s %s\n", s.name, s.summary);
  std::fprintf(out,
               "\n`cpidx <command> --help` lists a command's flags. Under MPI each process is one "
               "rank (one per GPU for the GPU step):\n  mpirun -np 2 cpidx demo\n"
               "  mpirun -np 2 cpidx bench --modes step2\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(stderr);
    return cpidx::tools::kExitUsage;
  }
  if (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    print_usage(stdout);
    return cpidx::tools::kExitOk;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("cpidx %s\n", CPIDX_VERSION);
    return cpidx::tools::kExitOk;
  }
  for (const Subcommand& s : kSubcommands) {
    if (std::strcmp(argv[1], s.name) != 0) continue;
    // Under mpirun an exception ends the process as before (std::terminate): mpirun then ends
    // the job, where a rank returning would leave its peers in a collective.
    const bool alone = !cpidx::tools::launched_by_mpi();
    try {
      return s.run(argc, argv);
    } catch (const std::bad_alloc&) {  // sizes within the flags' ranges, past this host's memory
      if (!alone) throw;
      std::fprintf(stderr, "cpidx %s: out of host memory for the sizes these flags ask for "
                   "(see --help)\n", s.name);
    } catch (const std::length_error&) {
      if (!alone) throw;
      std::fprintf(stderr, "cpidx %s: the sizes these flags ask for exceed what one buffer "
                   "holds (see --help)\n", s.name);
    }
    return cpidx::tools::kExitUsage;
  }
  std::fprintf(stderr, "cpidx: unknown command '%s'\n\n", argv[1]);
  print_usage(stderr);
  return cpidx::tools::kExitUsage;
}
