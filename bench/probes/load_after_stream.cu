// bench/probes/load_after_stream.cu: how long one dependent load takes right after a kernel that
// streamed random 32 KB pages, by where it streamed them from. A question for the selection
// kernel: its first key loads land ~1 us after its launch wait (docs/perf/README.md, v42-run
// trace), where an L2 hit should take ~0.2 us. Is it the address translation (the stream walked
// a 4 GiB pool, one 2 MiB translation a page) or the line itself?
//
// The probe (one thread) loads a chain of words of a 16 MiB buffer written just before the
// stream (so its lines are in L2: the stream's loads carry the evict-first hint): each load's
// address depends on the last one's value, and clock64 brackets each load. Cases, each after the
// same streamed bytes:
//   pool_4g:   pages drawn at random from a 4 GiB pool (the bench's);
//   pool_64m:  pages drawn at random from a 64 MiB pool (32 translations);
//   no_stream: no stream kernel at all, the buffer warm;
//   pool_4g_pdl: as pool_4g, the probe launched early and waiting as select_topk does;
//   pool_4g_pdl_touch: as pool_4g_pdl, the chain's lines prefetched to L2 before the wait;
//   empty_pdl: the probe waiting behind a grid that streams nothing (the loads just after a wait
//              with nothing streamed: the wait's own effect on them).
// Reading it: pool_4g >> pool_64m ~ no_stream says translations; pool_4g_pdl >> pool_4g with
// empty_pdl ~ pool_4g_pdl says the wait; loads 3-5 are the L2 hit's own latency.
// Within a chain: load 0 hits a 2 MiB region not touched since the buffer was written, load 1
// the next line of that region, load 2 a line of another region; loads 3-5 repeat the chain.
// Run once (one H100, docs/perf/README.md v57-run): load 0 464-474 cycles in the unwaited cases,
// ~300 behind a wait, loads 2-5 276-299 in all: no translation cost. Printed: cycles and ns per
// load, medians over repetitions, as JSON lines. Build: nvcc -O3 -arch=sm_90a -o probe this.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "probe_check.h"

constexpr size_t kPage = 32 << 10;
constexpr int kLoads = 3;  // a chain; the probe runs it twice

// Each CTA reads its pages (ids from `order`) with streaming 16-byte loads and folds them into
// one word, so no load is dead.
__global__ void stream_pages(const uint4* pool, const int* order, int pages_per_cta,
                             unsigned* sink) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the PDL cases' probe
  unsigned acc = 0;
  for (int i = 0; i < pages_per_cta; ++i) {
    const uint4* page = pool + static_cast<size_t>(order[blockIdx.x * pages_per_cta + i]) *
                                   (kPage / sizeof(uint4));
    for (int j = threadIdx.x; j < static_cast<int>(kPage / sizeof(uint4)); j += blockDim.x) {
      const uint4 v = __ldcs(page + j);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // practically never: keeps the loads
}

// Writes next-hop offsets: word w of the chain points at the offset of the following load.
__global__ void write_buffer(unsigned long long* buf, size_t words, unsigned long long a,
                             unsigned long long b, unsigned long long c) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    buf[i] = i == a ? b : i == b ? c : 0;
  }
}

// The chain twice: loads 0-2 as they come after the stream, loads 3-5 the same words again
// (L2 hits with every translation warm: the baseline).
// kPdl: launched behind the stream by programmatic dependent launch, it waits for the stream's
// end (griddepcontrol.wait) as select_topk does; kTouch: before that wait, it asks L2 for the
// chain's two regions (prefetch.global.L2), whose translations the wait then finds warm if the
// stream's last pages have not evicted them. wait_ns: %globaltimer before and after the wait
// (with PDL, about the stream's length when the probe really launched early; 0 without).
// Each load's value is stored to a volatile shared word before the clock is read again: the
// store cannot issue before the load lands, so the clock brackets that load alone (without it
// ptxas moved the consuming adds and each bracket held another load's latency).
template <bool kPdl, bool kTouch>
__global__ void probe(const unsigned long long* buf, unsigned long long start,
                      unsigned long long other, long long* cycles, unsigned long long* ns,
                      unsigned long long* wait_ns) {
  __shared__ volatile unsigned long long landed;
  if (kTouch) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(buf + start) : "memory");
    asm volatile("prefetch.global.L2 [%0];" ::"l"(buf + other) : "memory");
  }
  unsigned long long w0, w1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(w0)::"memory");
  if (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(w1)::"memory");
  *wait_ns = w1 - w0;
  unsigned long long at = start;
  for (int i = 0; i < 2 * kLoads; ++i) {
    if (i == kLoads) at = start;
    unsigned long long next, t0, t1;
    const long long c0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0)::"memory");
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(next) : "l"(buf + at) : "memory");
    landed = next;  // waits for the load: the clock below reads after it landed
    const long long c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)::"memory");
    cycles[i] = c1 - c0;
    ns[i] = t1 - t0;
    at = next;
  }
}

int main() {
  const size_t pool_bytes = size_t{4} << 30, small_bytes = size_t{64} << 20;
  const size_t buf_bytes = size_t{16} << 20, words = buf_bytes / 8;
  const int ctas = 264, pages_per_cta = 32;  // 8448 pages, 277 MB: about a plain 8 x 128K step
  const int reps = 15;
  uint4* pool;
  unsigned long long* buf;
  int *order_big, *order_small;
  unsigned* sink;
  long long* cycles;
  unsigned long long *ns, *wait_ns;
  CHECK(cudaMalloc(&pool, pool_bytes));
  CHECK(cudaMalloc(&buf, buf_bytes));
  CHECK(cudaMalloc(&order_big, sizeof(int) * ctas * pages_per_cta));
  CHECK(cudaMalloc(&order_small, sizeof(int) * ctas * pages_per_cta));
  CHECK(cudaMalloc(&sink, sizeof(unsigned) * ctas));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * 2 * kLoads));
  CHECK(cudaMalloc(&ns, sizeof(unsigned long long) * 2 * kLoads));
  CHECK(cudaMalloc(&wait_ns, sizeof(unsigned long long)));
  CHECK(cudaMemset(pool, 0x5a, pool_bytes));
  std::mt19937 rng(7);
  std::vector<int> big(ctas * pages_per_cta), small(ctas * pages_per_cta);
  for (auto& v : big) v = static_cast<int>(rng() % (pool_bytes / kPage));
  for (auto& v : small) v = static_cast<int>(rng() % (small_bytes / kPage));
  CHECK(cudaMemcpy(order_big, big.data(), big.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(order_small, small.data(), small.size() * sizeof(int),
                   cudaMemcpyHostToDevice));
  int dev = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  const char* names[] = {"pool_4g", "pool_64m", "no_stream", "pool_4g_pdl", "pool_4g_pdl_touch",
                         "empty_pdl"};
  // The chain: region 3's first line, its next line, region 6's line (2 MiB = 262144 words).
  const unsigned long long a = 3 * 262144ull, b = a + 16, c = 6 * 262144ull + 40;
  for (int kind = 0; kind < 6; ++kind) {
    std::vector<long long> cyc[2 * kLoads];
    std::vector<unsigned long long> tns[2 * kLoads], waits;
    for (int r = 0; r < reps + 2; ++r) {
      write_buffer<<<264, 256>>>(buf, words, a, b, c);
      if (kind != 2) {
        stream_pages<<<ctas, 256>>>(pool, kind == 1 ? order_small : order_big,
                                    kind == 5 ? 0 : pages_per_cta, sink);
      }
      if (kind < 3) {
        probe<false, false><<<1, 1>>>(buf, a, c, cycles, ns, wait_ns);
      } else {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.gridDim = dim3(1);
        cfg.blockDim = dim3(1);
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        CHECK(kind == 4
                  ? cudaLaunchKernelEx(&cfg, probe<true, true>, buf, a, c, cycles, ns, wait_ns)
                  : cudaLaunchKernelEx(&cfg, probe<true, false>, buf, a, c, cycles, ns, wait_ns));
      }
      CHECK(cudaDeviceSynchronize());
      long long hc[2 * kLoads];
      unsigned long long hn[2 * kLoads], hw = 0;
      CHECK(cudaMemcpy(hc, cycles, sizeof(hc), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(hn, ns, sizeof(hn), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(&hw, wait_ns, sizeof(hw), cudaMemcpyDeviceToHost));
      if (r < 2) continue;  // warm-up
      waits.push_back(hw);
      for (int i = 0; i < 2 * kLoads; ++i) {
        cyc[i].push_back(hc[i]);
        tns[i].push_back(hn[i]);
      }
    }
    std::sort(waits.begin(), waits.end());
    std::printf("{\"case\": \"%s\", \"sm_clock_khz_attr\": %d, \"wait_ns_median\": %llu",
                names[kind], clock_khz, waits[reps / 2]);
    for (int i = 0; i < 2 * kLoads; ++i) {
      std::sort(cyc[i].begin(), cyc[i].end());
      std::sort(tns[i].begin(), tns[i].end());
      std::printf(", \"load%d_cycles_median\": %lld, \"load%d_cycles_min\": %lld, "
                  "\"load%d_cycles_max\": %lld, \"load%d_ns_median\": %llu",
                  i, cyc[i][reps / 2], i, cyc[i].front(), i, cyc[i].back(), i, tns[i][reps / 2]);
    }
    std::printf("}\n");
  }
  return 0;
}
