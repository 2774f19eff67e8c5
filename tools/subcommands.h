// tools/subcommands.h: the `cpidx` subcommands. Each one is a function in its own file taking
// the whole argv (argv[1] is its name, its flags start at argv[2]) and returning the exit code;
// adding one is a declaration here and a row of kSubcommands in main.cc.
#pragma once

#include "args.h"

namespace cpidx::tools {

int run_demo(int argc, char** argv);   // demo.cc
int run_bench(int argc, char** argv);  // bench.cc
int run_prefill_bench(int argc, char** argv);  // bench_prefill.cc: `cpidx bench --prefill`
int run_soak(int argc, char** argv);   // soak.cc

// HOOK(GPU path): true when this build has the CUDA kernels and a usable GPU (gpu.cc).
bool gpu_available();

// Exit codes shared by the subcommands.
constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;  // ran, but a check failed or the library returned an error
constexpr int kExitUsage = 2;   // bad command line

// Parses a subcommand's flags (argv[2] on): true to go on, else false with *exit_code the code
// to return (kExitOk after --help, kExitUsage after a bad flag; either is already printed).
inline bool parse_flags(Flags& flags, int argc, char** argv, int* exit_code) {
  switch (flags.parse(argc, argv, 2)) {
    case Flags::Parse::kOk: return true;
    case Flags::Parse::kHelp: *exit_code = kExitOk; return false;
    case Flags::Parse::kError: break;
  }
  *exit_code = kExitUsage;
  return false;
}

}  // namespace cpidx::tools
