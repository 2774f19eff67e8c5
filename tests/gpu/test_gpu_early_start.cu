// The decode's scoring kernel may start (programmatic dependent launch) while the kernel before
// it in the stream still runs, and it computes its page prefix sum before its wait from the
// request lengths as they read then, checking them after the wait. Here the kernel before it
// lets its dependents start at once, waits, and only then rewrites the lengths and the block
// table in place: the ids must be those of the new inputs, on both paths, whether the page
// counts changed (the prefix must be recomputed), only the lengths inside a page did, or only
// the table did; and old table entries outside the cache raise no error (only the values read
// after the wait count). The producers copy their first pages as soon as the wait returns, from
// the lengths and table as read before it (checked after it): the last rounds are large enough
// for the split path's work stealing, whose CTAs claim their ranges after the wait.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "gpu_util.h"

namespace {

using namespace cpidx_gpu_test;
using cpidx_test::random_decode;
using cpidx_test::sel_of;

// Lets the next kernel in the stream launch, then after `delay_ns` copies the new lengths and
// block table over the ones the decode will read.
__global__ void late_writer(const int32_t* new_lens, int32_t* lens, int num_lens,
                            const int32_t* new_table, int32_t* table, int64_t table_size,
                            unsigned long long delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < delay_ns);
  for (int i = threadIdx.x; i < num_lens; i += blockDim.x) lens[i] = new_lens[i];
  for (int64_t i = threadIdx.x; i < table_size; i += blockDim.x) table[i] = new_table[i];
}

// Decodes `d` after the late writer replaced `old_lens` / `old_table` (in the buffers the decode
// reads) by d's own lengths and table.
std::vector<int32_t> decode_after_late_write(const DecodeData& d, const cpidx::Selection& sel,
                                             const std::vector<int32_t>& old_lens,
                                             const std::vector<int32_t>& old_table,
                                             int32_t* error_flag) {
  DeviceBatch b(d);
  DeviceVec<int32_t> new_lens(d.seq_lens), new_table(d.block_table);
  b.seq_lens.upload(old_lens);
  b.block_table.upload(old_table);
  std::unique_ptr<cpidx::Decoder> dec;
  cpidx::Status st = cpidx::Decoder::create(config_for(d, sel), 0, &dec);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  if (!st.is_ok()) return {};
  EXPECT_TRUE(dec->config().programmatic_launch);
  const int64_t n = d.rows();
  DeviceVec<int32_t> ids(static_cast<size_t>(d.total_heads * n * sel.topk));
  ids.poison();
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  late_writer<<<1, 256, 0, stream>>>(new_lens.ptr, b.seq_lens.ptr, d.num_reqs(), new_table.ptr,
                                     b.block_table.ptr,
                                     static_cast<int64_t>(d.block_table.size()), 50000);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  st = dec->decode(b.all_heads(), cpidx::TopkOutput{ids.ptr, n * sel.topk, sel.topk}, nullptr,
                   stream);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  cudaMemcpy(error_flag, dec->error_flag(), 4, cudaMemcpyDeviceToHost);
  return ids.download();
}

TEST(GpuEarlyStart, LengthsAndTableWrittenAfterTheLaunchAreTheOnesUsed) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(4242);
  const cpidx::Selection sel = sel_of(16);
  for (int round = 0; round < 6; ++round) {
    const int T = round % 2 ? 4 : 1, Q = round < 2 || round >= 4 ? 1 : 2;
    // Rounds 4 and 5: 7 requests of >= 1,172 pages, past 16 pages a scoring CTA (stealing).
    const bool stealing = round >= 4;
    const int32_t max_len = stealing ? 262144 : 40000;
    std::vector<int32_t> lens = cpidx_test::lengths(rng, stealing ? 8 : 7, max_len, true);
    for (int32_t& len : lens) {
      if (stealing && len != 0) len = 150000 + len % (max_len - 150000 + 1);
    }
    DecodeData d = random_decode(900 + round, T, Q, lens, max_len);
    const std::vector<int32_t> want = cpu_decode(d, sel);
    // Old lengths with other page counts, or the same page counts (lengths moved inside their
    // last page), or the same lengths; the old table is the new one shuffled, or every entry
    // outside the cache.
    std::vector<int32_t> other_counts(d.seq_lens.size()), same_counts(d.seq_lens.size());
    for (size_t r = 0; r < d.seq_lens.size(); ++r) {
      other_counts[r] = static_cast<int32_t>(rng() % (max_len + 1));
      const int32_t len = d.seq_lens[r];
      same_counts[r] = len == 0 ? 0 : std::max(1, (len - 1) / 128 * 128 + 1 +
                                                      static_cast<int32_t>(rng() % 128));
      same_counts[r] = std::min(same_counts[r], max_len);
    }
    std::vector<int32_t> shuffled = d.block_table;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    std::vector<int32_t> outside(d.block_table.size(), 0x7fffffff);
    for (Path path : kBothPaths) {
      UsePath use(path);
      for (const auto* old_lens : {&other_counts, &same_counts, &d.seq_lens}) {
        for (const auto* old_table : {&shuffled, &outside}) {
          SCOPED_TRACE(std::string(path_name(path)) + (stealing ? " (stealing size)" : "") +
                       " T=" + std::to_string(T) + " Q=" +
                       std::to_string(Q) +
                       (old_lens == &other_counts  ? " other page counts"
                        : old_lens == &same_counts ? " same page counts"
                                                   : " same lengths") +
                       (old_table == &shuffled ? ", table shuffled" : ", table outside"));
          int32_t err = -1;
          const std::vector<int32_t> got =
              decode_after_late_write(d, sel, *old_lens, *old_table, &err);
          ASSERT_EQ(got.size(), want.size());
          EXPECT_EQ(err, 0);
          const CompareResult c = compare_ids(d, sel, got, want);
          EXPECT_EQ(c.bad_rows, 0) << c.first_bad;
        }
      }
    }
  }
}

}  // namespace
