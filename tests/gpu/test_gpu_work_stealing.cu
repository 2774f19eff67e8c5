// The split path's run-time share (page_producer.cuh, v15, v19): a CTA done with its pages takes the
// last unclaimed pages of other CTAs' ranges within reach, of any request, starting the range of
// a CTA that has not run yet. The ids must not depend on who scored a page: here they are
// compared, bit for bit, with the static ranges' (DecodeConfig::work_stealing = false) and with
// the CPU reference, with the CTAs starting together, and with half of the SMs held by another
// kernel so that half of the CTAs start late: after the others are done (whose pages the early
// ones take, across requests), or while they take them (the late owners then claim beside the
// takers, v47). Consecutive calls and graph replays on one Decoder alternate two batches, so
// a call that lost a page would show the key the previous call left at its place, and ranges not
// reset between calls would lose pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "gpu_util.h"

namespace {

using namespace cpidx_gpu_test;
using cpidx_test::random_decode;
using cpidx::DType;
using cpidx_test::sel_of;

// One CTA per SM (all of its shared memory) spinning for `ns`; CTA 0 raises *started first.
__global__ void hold_sms(unsigned long long ns, volatile int* started) {
  extern __shared__ int held[];
  unsigned long long t0 = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) {
    held[0] = 1;
    if (blockIdx.x == 0) *started = 1;
  }
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - t0 < ns);
}

// Holds `sms` SMs for `ns` on its own stream, returning once the holder runs.
class SmHolder {
 public:
  SmHolder() {
    void* flag = nullptr;
    cudaHostAlloc(&flag, sizeof(int), cudaHostAllocMapped);
    started_ = static_cast<volatile int*>(flag);
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&smem_, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cudaFuncSetAttribute(hold_sms, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_);
  }
  ~SmHolder() {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaFreeHost(const_cast<int*>(started_));
  }
  bool hold(int sms, unsigned long long ns) {
    *started_ = 0;
    int* dev_started = nullptr;
    cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_started), const_cast<int*>(started_),
                             0);
    hold_sms<<<sms, 32, static_cast<size_t>(smem_), stream_>>>(ns, dev_started);
    if (cudaGetLastError() != cudaSuccess) return false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (*started_ == 0) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::yield();
    }
    return true;
  }

 private:
  volatile int* started_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int smem_ = 0;
};

// Two batches of one shape (same Decoder maxima) whose split steps give every scoring CTA
// >= 16 pages (two CTAs on each of up to 132 SMs), most inside requests shared by many CTAs.
std::vector<DecodeData> two_batches(int T, int Q, uint64_t seed) {
  const int32_t max_len = 200000;
  std::vector<DecodeData> out;
  out.push_back(random_decode(seed, T, Q, {200000, 1, 170001, 130000 + 17, 3000, 90000, 0},
                              max_len));
  out.push_back(random_decode(seed + 1, T, Q, {190000, 199999, 5, 100 * 128, 0, 160000, 33},
                              max_len));
  return out;
}

struct StealRun {
  std::vector<int32_t> ids;
  cpidx::Status status;
};

// Decodes `batches` in turn on one Decoder (split path forced), `rounds` times over, the first
// batch of each round with `held_sms` SMs held for `hold_ns` when > 0; returns every call's ids.
std::vector<StealRun> decode_in_turn(const std::vector<DecodeData>& batches,
                                     const cpidx::Selection& sel, bool steal, int held_sms,
                                     int rounds, unsigned long long hold_ns = 2000000ull) {
  UsePath use(Path::kSplit);
  int64_t rows = 1;  // the batches may differ in Q: the Decoder is planned for the most rows
  for (const DecodeData& d : batches) rows = std::max(rows, d.rows());
  cpidx::DecodeConfig cfg = config_for(batches[0], sel, 1, 0, static_cast<int>(rows));
  cfg.work_stealing = steal;
  std::unique_ptr<cpidx::Decoder> dec;
  std::vector<StealRun> runs;
  cpidx::Status st = cpidx::Decoder::create(cfg, 0, &dec);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (!st.is_ok()) return runs;
  SmHolder holder;
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < batches.size(); ++i) {
      const DecodeData& d = batches[i];
      DeviceBatch b(d);
      const int64_t n = d.rows();
      DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * sel.topk));
      ids.poison();
      cudaDeviceSynchronize();
      if (held_sms > 0 && i == 0) EXPECT_TRUE(holder.hold(held_sms, hold_ns));
      StealRun run;
      run.status = dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk},
                               nullptr, stream);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      run.ids = ids.download();
      runs.push_back(std::move(run));
    }
  }
  int32_t err = -1;
  cudaMemcpy(&err, dec->error_flag(), 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(err, 0);
  cudaStreamDestroy(stream);
  return runs;
}

TEST(GpuWorkStealing, IdsEqualStaticRangesAndReferenceWhateverTheStartOrder) {
  SKIP_WITHOUT_GPU();
  int dev = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const cpidx::Selection sel = sel_of(16);
  for (int Q : {1, 4}) {
    const std::vector<DecodeData> batches = two_batches(4, Q, 7100 + Q);
    std::vector<std::vector<int32_t>> want;
    for (const DecodeData& d : batches) want.push_back(cpu_decode(d, sel));
    const std::vector<StealRun> fixed = decode_in_turn(batches, sel, false, 0, 1);
    ASSERT_EQ(fixed.size(), batches.size());
    // Held 2 ms: the late CTAs start after the step's others are done. 40 and 80 us: about
    // when the early CTAs, done with their own ~18 pages, take from the late CTAs' ranges.
    struct Hold {
      int sms;
      unsigned long long ns;
    };
    for (const Hold h : {Hold{0, 0}, Hold{sms / 2, 2000000}, Hold{sms / 2, 40000},
                         Hold{sms / 2, 80000}}) {
      SCOPED_TRACE("Q=" + std::to_string(Q) + ", SMs held: " + std::to_string(h.sms) + " for " +
                   std::to_string(h.ns / 1000) + " us");
      const std::vector<StealRun> runs = decode_in_turn(batches, sel, true, h.sms, 3, h.ns);
      ASSERT_EQ(runs.size(), 3 * batches.size());
      for (size_t k = 0; k < runs.size(); ++k) {
        const size_t i = k % batches.size();
        SCOPED_TRACE("call " + std::to_string(k));
        ASSERT_TRUE(runs[k].status.is_ok()) << runs[k].status.to_string();
        EXPECT_EQ(runs[k].ids, fixed[i].ids) << "ids differ from the static ranges'";
        const CompareResult r = compare_ids(batches[i], sel, runs[k].ids, want[i]);
        EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
      }
    }
  }
}

// Steps of different column counts on one Decoder (planned for the library's default
// max_query_len, 8: 32 columns) launch their own instances' plans: fp8 pages at Q = 1, 4 and 2
// run four, three and four scoring CTAs per SM, so consecutive calls' grids differ and share
// the steal words (their count sits after every instance's words). The ids equal the static
// ranges' and the reference's, call after call.
TEST(GpuWorkStealing, StepsOfDifferentColumnCountsShareTheWords) {
  SKIP_WITHOUT_GPU();
  const cpidx::Selection sel = sel_of(16);
  const int32_t max_len = 600000;  // >= 16 pages for each of 4 x 132 CTAs: the ranges shared
  std::vector<DecodeData> batches;
  for (int Q : {1, 4, 2}) {
    batches.push_back(random_decode(7500 + Q, 4, Q, {600000, 1, 510003, 390000 + 17, 9000,
                                                     270000, 0},
                                    max_len, DType::kFP8E4M3));
  }
  std::vector<std::vector<int32_t>> want;
  for (const DecodeData& d : batches) want.push_back(cpu_decode(d, sel));
  const std::vector<StealRun> fixed = decode_in_turn(batches, sel, false, 0, 1);
  ASSERT_EQ(fixed.size(), batches.size());
  const std::vector<StealRun> runs = decode_in_turn(batches, sel, true, 0, 3);
  ASSERT_EQ(runs.size(), 3 * batches.size());
  for (size_t k = 0; k < runs.size(); ++k) {
    const size_t i = k % batches.size();
    SCOPED_TRACE("call " + std::to_string(k) + ", Q=" + std::to_string(batches[i].query_len));
    ASSERT_TRUE(runs[k].status.is_ok()) << runs[k].status.to_string();
    EXPECT_EQ(runs[k].ids, fixed[i].ids) << "ids differ from the static ranges'";
    const CompareResult r = compare_ids(batches[i], sel, runs[k].ids, want[i]);
    EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
  }
}

// A graph captured once, replayed while the batch alternates in place (lengths and tables
// change; the page counts cross the stealing threshold both ways).
TEST(GpuWorkStealing, GraphReplaysAlternateBatchesAcrossTheThreshold) {
  SKIP_WITHOUT_GPU();
  UsePath use(Path::kSplit);
  const cpidx::Selection sel = sel_of(16);
  std::vector<DecodeData> batches = two_batches(4, 1, 7300);
  DecodeData small = batches[0];  // the same buffers, few pages: static ranges
  small.seq_lens = {3000, 1, 700, 0, 5, 9000, 0};
  batches.push_back(small);
  std::vector<std::vector<int32_t>> want;
  for (const DecodeData& d : batches) want.push_back(cpu_decode(d, sel));
  DecodeData d = batches[0];
  DeviceBatch b(d);
  std::unique_ptr<cpidx::Decoder> dec;
  cpidx::Status st = cpidx::Decoder::create(config_for(d, sel), 0, &dec);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_TRUE(dec->config().work_stealing);
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * d.rows() * sel.topk));
  const std::unique_ptr<CapturedGraph> graph = capture_decode(*dec, b, ids, sel.topk);
  ASSERT_TRUE(graph->status().is_ok()) << graph->status().to_string();
  for (int k = 0; k < 12; ++k) {
    const size_t i = static_cast<size_t>(k) % batches.size();
    SCOPED_TRACE("replay " + std::to_string(k));
    b.query.upload(batches[i].query);
    b.seq_lens.upload(batches[i].seq_lens);
    b.block_table.upload(batches[i].block_table);
    ASSERT_EQ(batches[i].cache_bf16.size(), d.cache_bf16.size());
    b.cache16->upload(batches[i].cache_bf16);
    ids.poison();
    CUDA_OK(graph->replay());
    const CompareResult r = compare_ids(batches[i], sel, ids.download(), want[i]);
    EXPECT_EQ(r.bad_rows, 0) << r.first_bad;
  }
}

}  // namespace
