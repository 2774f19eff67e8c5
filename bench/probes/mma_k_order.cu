// bench/probes/mma_k_order.cu: does the fp32 result of a bf16 tensor-core dot product depend on
// the order of the products inside one k16 step, or only on which 16 products share a step?
// A question for CONTRACT.md section 4 (the GPU paths bit for bit): when it was written the
// decode kernel and the mma.sync prefill kernel gave k-step (j, half) of a 128-dim dot product
// the dims {32 j + 8 c + 4 half + e : c, e in 0..3} in their own slot order, the wgmma prefill
// kernel the dims [16 s, 16 s + 16) in order. If only the grouping counts, a wgmma page laid
// out in 8-byte pieces (the decode's groups) gives the decode's sums; if the order counts too,
// it needs the decode's slot order, in 4-byte pieces. (Every kernel now shares one grouping,
// src/cuda/k_steps.h.)
//
// Each warp does one trial: rows A [16][32] and columns B [32][8] of random bf16 values (random
// signs, exponents over +-8 octaves, random mantissas), summed over 32 dims in two
// mma.sync.m16n8k16 steps (fp32 accumulate) three ways:
//   natural:  step 0 takes dims 0..15, step 1 dims 16..31, each in slot order;
//   shuffled: the same two groups, each step's 16 dims in another (fixed, random) slot order;
//   regroup:  the decode's grouping then: step 0 dims {8 c + e : c, e in 0..3}, step 1 the rest.
// Printed (JSON): trials, and how many of the 128 results of a trial differ in their bits from
// natural's, in all, for shuffled and for regroup. Reading it: shuffled 0 and regroup > 0 says
// the grouping alone counts. Build: nvcc -O3 -arch=sm_90a -o probe mma_k_order.cu
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>

#include "probe_check.h"

__device__ uint32_t hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// A random bf16 bit pattern: sign, exponent 127 +- 8, 7 mantissa bits.
__device__ uint16_t random_bf16(uint64_t key) {
  const uint32_t h = hash(key);
  const uint32_t exp = 119 + (h >> 8) % 17;
  return static_cast<uint16_t>(((h & 1u) << 15) | (exp << 7) | ((h >> 1) & 0x7F));
}

__device__ uint32_t pack(uint16_t lo, uint16_t hi) {
  return lo | (static_cast<uint32_t>(hi) << 16);
}

__device__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Slot k (0..15) of step `step` -> the dim (0..31) it carries, for each way.
__device__ int dim_of(int way, int step, int k, const int* perm) {
  if (way == 0) return 16 * step + k;
  if (way == 1) return 16 * step + perm[k];
  // The decode's grouping when this was written: slot 2c + e <- dim 8c + 4 step + e, slot
  // 8 + 2c + e <- dim 8c + 4 step + 2 + e.
  const int c = (k & 7) >> 1, e = k & 1;
  return 8 * c + 4 * step + (k >= 8 ? 2 : 0) + e;
}

__global__ void probe(uint64_t seed, int trials, const int* perm, unsigned long long* differ) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= trials) return;
  const int g = lane >> 2, c4 = lane & 3;
  auto A = [&](int row, int dim) {
    return random_bf16(seed + (uint64_t(warp) << 20) + row * 32 + dim);
  };
  auto B = [&](int dim, int col) {
    return random_bf16(seed + (uint64_t(warp) << 20) + (1 << 12) + dim * 8 + col);
  };
  uint32_t out[3][4];
  for (int way = 0; way < 3; ++way) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int step = 0; step < 2; ++step) {
      const int k0 = dim_of(way, step, 2 * c4, perm), k1 = dim_of(way, step, 2 * c4 + 1, perm);
      const int k8 = dim_of(way, step, 2 * c4 + 8, perm), k9 = dim_of(way, step, 2 * c4 + 9, perm);
      const uint32_t a[4] = {pack(A(g, k0), A(g, k1)), pack(A(g + 8, k0), A(g + 8, k1)),
                             pack(A(g, k8), A(g, k9)), pack(A(g + 8, k8), A(g + 8, k9))};
      const uint32_t b[2] = {pack(B(k0, g), B(k1, g)), pack(B(k8, g), B(k9, g))};
      mma(d, a, b);
    }
    for (int i = 0; i < 4; ++i) out[way][i] = __float_as_uint(d[i]);
  }
  int shuffled = 0, regroup = 0;
  for (int i = 0; i < 4; ++i) {
    shuffled += out[1][i] != out[0][i];
    regroup += out[2][i] != out[0][i];
  }
  atomicAdd(&differ[0], static_cast<unsigned long long>(shuffled));
  atomicAdd(&differ[1], static_cast<unsigned long long>(regroup));
}

int main() {
  const int trials = 1 << 18;
  const int perm_host[16] = {5, 12, 0, 9, 14, 3, 7, 10, 1, 15, 4, 8, 13, 2, 11, 6};
  int* perm = nullptr;
  unsigned long long* differ = nullptr;
  CHECK(cudaMalloc(&perm, sizeof(perm_host)));
  CHECK(cudaMemcpy(perm, perm_host, sizeof(perm_host), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&differ, 2 * sizeof(unsigned long long)));
  CHECK(cudaMemset(differ, 0, 2 * sizeof(unsigned long long)));
  probe<<<trials / 8, 256>>>(0x5eed, trials, perm, differ);
  CHECK(cudaGetLastError());
  unsigned long long h[2];
  CHECK(cudaMemcpy(h, differ, sizeof(h), cudaMemcpyDeviceToHost));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"device\": \"%s\", \"trials\": %d, \"results\": %llu, \"shuffled_differ\": %llu, "
              "\"regroup_differ\": %llu}\n",
              prop.name, trials, 128ull * trials, h[0], h[1]);
  return 0;
}
