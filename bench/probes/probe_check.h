// bench/probes/probe_check.h: the probes' CUDA error check (each probe is one file built by one
// nvcc command; this header sits beside them).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

// Returns 1 from the calling function (main) after printing where and what, on a CUDA error.
#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)
