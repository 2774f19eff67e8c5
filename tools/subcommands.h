// tools/subcommands.h: the `cpidx` subcommands. Each one is a function in its own file taking
// the whole argv (argv[1] is its name, its flags start at argv[2]) and returning the exit code;
// adding one is a declaration here and a row of kSubcommands in main.cc.
#pragma once

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

}  // namespace cpidx::tools
