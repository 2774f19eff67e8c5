// cpidx/indexer.h: the GPU decode indexer. One Decoder per (device, geometry) holds every buffer
// a decode step needs, sized at construction from maxima; a step allocates nothing, never
// synchronises with the host, and can be captured in a CUDA graph (collectives included when
// the communicator is stream-ordered). One Decoder serves every layer of a model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/params.h"
#include "cpidx/status.h"

namespace cpidx {

struct DecodeConfig {
  int total_heads = 4;               // T: index heads of the model
  int world_size = 1;                // P
  int rank = 0;                      // r
  // Bounds. max_tokens and max_query_len also size the scoring kernel's shared memory (8 bytes
  // per row, and T x max_query_len columns), which the page pipeline shares. Large bounds keep
  // two CTAs per SM by keeping fewer request offsets (plan().offset_stride), which costs steps
  // of more than max_tokens / offset_stride requests a few us: pass the real bounds (README,
  // "Sizing").
  int max_tokens = 0;                // bound on decode rows per call (requests x Q), at most
                                     // kMaxTokens
  // The largest max_tokens accepted: every request and row index the kernels form in 32 bits
  // (a request count plus a grid, say) stays far from INT_MAX.
  static constexpr int kMaxTokens = 1 << 30;
  int32_t max_seq_len = 0;           // bound on tokens per request (pass max_model_len)
  int max_query_len = kMaxQueryLen;  // bound on Q
  Selection sel;                     // K, init, local
  DType cache_dtype = DType::kBF16;
  int head_dim = kHeadDim;
  // cp_decode asks the communicator's check_agree for equal batch sizes on every rank before
  // its first collective, then check_agree_all for equal settings (query_len, scale, topk,
  // init and local blocks, max_seq_len, total_heads, cache dtype): two host rounds on every
  // call, eager or captured, and none in a captured graph's replays (host side only: the graph
  // holds no extra node). NCCL communicators check only when they have a host channel
  // (comm_nccl.h).
  bool check_agreement = true;
  // Launch kernels with programmatic dependent launch: a step's kernels start while the
  // previous kernel in the stream drains, and wait for its results before reading anything.
  // The scoring grid is the GPU's resident capacity; launched behind a kernel whose CTAs still
  // run, some of its CTAs were placed only when the others exited (plain 64 x 256K fp8 Q = 4:
  // 5 of 11 traced launches, 70-90 us longer each) until every decode kernel asked for the
  // largest shared-memory carveout (0 of 6; docs/perf/README.md, v41-slow and v42). Behind a
  // kernel of the caller's that triggers its dependents early, most steps cost 2-4 us less than
  // back to back, whatever that kernel's carveout (v43-neighbour).
  bool programmatic_launch = true;
  // Steps up to a size take the split path: the scoring kernel writes one key per (column,
  // page) to an L2-resident buffer and a second kernel selects each row's top K (cheaper than
  // the fused path's per-CTA lists and merge unless a request's list is very long). Chosen on
  // the device, per step, from this rank's page counts, so one captured graph serves both.
  // kAutoSplit, the library's rule: steps of <= kDefaultSplitPages pages split; larger ones, up
  // to the buffer (large_split_pages(dtype), fewer when padded(T * max_query_len) * 8 * that
  // would pass kSplitBufferBytes), split when no request owns more than
  // split_longest_pages(dtype) pages (a longer list costs the selection more than the fused
  // path's merge saves). fp8 pages stream twice as fast, so the fused path's per-CTA lists and
  // merge weigh more against them and the split path pays off further out, while its keys stay
  // within 16 MiB (docs/perf/README.md, v36, v37). N > 0: every step of <= N pages splits.
  // 0: always the fused path. The buffer costs split_max_pages * 8 * padded(T * max_query_len)
  // bytes. Either way the limits stop at the pages a step can own, max_tokens *
  // cdiv(max_seq_len, 128) (a small Decoder reserves no more keys than its steps write).
  // Decoder::plan() (Python: Decoder.split_*_pages) gives the limits a Decoder took.
  static constexpr int64_t kAutoSplit = -1;
  static constexpr int64_t kDefaultSplitPages = 16384;  // 2M tokens of context on this rank
  static constexpr size_t kSplitBufferBytes = size_t{16} << 20;
  // Steps of up to this many pages may split: 8M tokens (bf16), 32M (fp8; the 16 MiB buffer
  // holds that many pages' keys at up to 8 columns, 16M tokens' at 16).
  static constexpr int64_t large_split_pages(DType dtype) {
    return dtype == DType::kFP8E4M3 ? 262144 : 65536;
  }
  // ... while no request owns more than this many: 1M tokens (bf16), 4M (fp8).
  static constexpr int64_t split_longest_pages(DType dtype) {
    return dtype == DType::kFP8E4M3 ? 32768 : 8192;
  }
  int64_t split_max_pages = kAutoSplit;
  // Persistent scoring CTAs per SM: 0 lets the library choose (four or three where the
  // registers allow it, today fp8 caches with heads x query length <= 8 or <= 16, else two;
  // each with the deepest page pipeline that fits them all); 1-4 force it (Decoder::create
  // fails where it does not fit).
  // For tuning and benchmarks.
  int scoring_ctas_per_sm = 0;
  // Split-path steps whose CTAs hold >= 16 pages each balance at run time: a CTA done with its
  // pages takes the last unclaimed pages of another CTA's range, of any request (two at a time,
  // one compare-and-swap each). Ids are the same either way. false: static ranges.
  bool work_stealing = true;
  // cp_decode with a communicator that offers a device channel (the peer communicator): the
  // selection kernel stores the shard's keys straight into every rank's channel and the merge
  // polls them, so the key gather runs no kernel of its own. false: all_gather, then merge (the
  // only route for other communicators, or payloads above the channel's capacity).
  bool fused_exchange = true;
  // The workspace holds cp_decode's gather buffers (this rank's queries packed, every rank's
  // queries, the shard's keys and every rank's keys): (P + 1) * max_tokens * (L * 256 + T * K *
  // 8) bytes at P > 1, 0.3 GB a rank at T = P = 8, K = 64, max_tokens 8192. false: for a caller
  // that runs the exchange itself (shard_keys, its own gather, merge) with buffers of its own;
  // such a Decoder's cp_decode refuses.
  bool exchange_buffers = true;
};

// Launch facts chosen at construction (for reports and benchmarks).
struct DecodePlan {
  // The scoring kernel's plan for a step of the bound's columns (T x max_query_len, padded):
  // a step of fewer columns launches its own instance's plan, which may hold more CTAs per SM
  // (fp8: four at 8 columns, three at 16).
  int grid = 0;             // persistent CTAs of the scoring kernel
  int stages = 0;           // key pages in flight per CTA
  // Requests per request offset the scoring kernel keeps in shared memory: 1 (every one) unless
  // max_tokens is large enough that keeping them all would cost the second CTA per SM (README,
  // "Sizing"); the offsets between kept ones are summed again from seq_lens (L2) when needed.
  // Steps of at most max_tokens / offset_stride requests keep every offset all the same.
  int offset_stride = 1;
  size_t smem_bytes = 0;    // dynamic shared memory per CTA
  int64_t split_max_pages = 0;  // the split path's capacity: steps with more pages are fused
  int64_t split_any_pages = 0;  // steps with at most this many pages split whatever their lengths
  // Steps between split_any_pages and split_max_pages pages split when no request owns more than
  // this many pages (DecodeConfig::split_longest_pages; equal to split_max_pages when forced).
  int64_t split_longest_pages = 0;
  size_t workspace_bytes = 0;
  // The largest scoring grid over the widths a step may launch (a narrower step's instance may
  // hold more CTAs per SM than the bound's `grid`): the workspace's per-CTA lists and
  // work-stealing words are sized for it, decode_workspace_layout(config, max_grid).
  int max_grid = 0;
};

// What cp_decode agrees on with its peers (Communicator::check_agree) before its first
// collective: this rank's decode rows, plus kCpFusedRouteTag when its keys go through the
// communicator's device channel (fused_exchange; a rank configured otherwise would wait in
// another collective until the channel's timeout), or -1 when its own arguments failed. A rank
// that skips a step's cp_decode for a reason of its own offers -1 (no decode rows at all: 0)
// under this name, so that its peers' cp_decode fails instead of waiting for it in a collective.
// Once the rows agree, cp_decode agrees on its settings too (check_agree_all, DecodeConfig::
// check_agreement); a rank that skipped its step was refused at the rows and never gets there.
inline constexpr const char* kCpRowsAgreement =
    "decode rows (num_reqs * query_len; + 2^40 when the keys go through the fused exchange)";
inline constexpr long long kCpFusedRouteTag = 1LL << 40;

// A Decoder's workspace is scratch for one step at a time: steps (of any layer) must run in
// order on one stream, as a model's layers do. Use one Decoder per stream otherwise. Every call
// that touches the device needs the device the Decoder was created on current (cudaSetDevice),
// and refuses another (kInvalidArgument) before anything runs.
class Decoder {
 public:
  // Checks the configuration (geometry, K, D, dtype, maxima), plans the kernels for `device` and
  // allocates the workspace there. Nothing else allocates afterwards.
  static Status create(const DecodeConfig& config, int device, std::unique_ptr<Decoder>* out);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  const DecodeConfig& config() const;
  const Geometry& geometry() const;
  const DecodePlan& plan() const;
  // The scoring plan a step of `num_heads` heads x `query_len` query tokens launches: plan()'s
  // for the bound's columns, its own instance's for fewer (grid, stages, offset_stride and
  // smem_bytes may differ; the rest is plan()'s). A query only: a product past the bound reads
  // as the bound's plan, one below a column as the narrowest instance's.
  DecodePlan step_plan(int num_heads, int query_len) const;

  // Plain decode (no context parallelism) of every head in `in` (in.num_heads <= T):
  // ids [in.num_heads, n, K] into `out`; optional sparse table when in.num_heads == 1.
  Status decode(const DecodeInputs& in, const TopkOutput& out, const SparseTableOutput* table,
                cudaStream_t stream);

  // Context-parallel rank work, exchanges left to the caller (simulated ranks, custom
  // transports). shard_keys: `in` holds all T heads' queries; writes this rank's ordered shard
  // top-K keys [T, n, K] (contiguous, device memory). merge: `gathered` is [P, T, n, K] (rank
  // major); writes ids [L, n, K] of the owned heads. `batch` supplies seq_lens, Q and n.
  Status shard_keys(const DecodeInputs& in, Key* keys, cudaStream_t stream);
  Status merge(const Key* gathered, const DecodeInputs& batch, const TopkOutput& out,
               const SparseTableOutput* table, cudaStream_t stream);

  // The whole context-parallel step over a device communicator: gather the local queries
  // `local` ([n, L, D]), score all heads on this rank's shard, gather the keys, merge the owned
  // heads into `out` ([L, n, K]). Every rank must call it with the same batch shape. With a
  // communicator's device channel (fused_exchange) the key gather runs inside the selection and
  // merge kernels; a rank whose peer never sends its keys then gives up after the channel's
  // timeout, raising the communicator's error word.
  Status cp_decode(Communicator& comm, const DecodeInputs& local, const TopkOutput& out,
                   const SparseTableOutput* table, cudaStream_t stream);
  // A world of one (world_size 1) needs no communicator: the same checks and the same plain
  // decode of every head as cp_decode with a communicator of one rank, for a front end whose
  // tensor-parallel size may be 1 and that has no group then. kInvalidArgument at world_size > 1.
  Status cp_decode(const DecodeInputs& local, const TopkOutput& out,
                   const SparseTableOutput* table, cudaStream_t stream);

  // The checks cp_decode runs on this rank's arguments before its first collective (the current
  // device, inputs of L = local heads, outputs [L, n, K], the sparse table; the communicator's
  // rank, memory space, device and max_bytes_per_rank are cp_decode's own), host side only. For
  // front ends that agree with their peers themselves before calling cp_decode (the Python
  // binding does, through a host group), so that a rank with bad arguments fails together with
  // the others instead of leaving them in a collective.
  Status check_cp_decode(const DecodeInputs& local, const TopkOutput& out,
                         const SparseTableOutput* table) const;

  // Device int32: OR of DeviceError bits raised by bad device-side values since the last clear,
  // by the steps whose inputs name no flag of their own (DecodeInputs::error_flag). The library
  // never reads it back itself.
  int32_t* error_flag() const;
  Status clear_error_flag(cudaStream_t stream);

  // Device buffers of the exchange, for communicators that need registered memory: the query and
  // key gathers' send and receive buffers, 0 bytes where the Decoder has none (world_size 1, or
  // exchange_buffers off). A query given packed ([n, L, 128] contiguous) is gathered from where
  // it lies, not from its send buffer here: a communicator that gathers from registered memory
  // only needs the query given otherwise (a strided view) or registered too. The workspace past
  // them (the split path's keys, the work-stealing words) is the kernels' own between calls.
  void* exchange_buffer() const;
  size_t exchange_buffer_bytes() const;

  // How many of its launches sit in CUDA graphs that are still alive, one per captured call
  // (decode, shard_keys, merge, cp_decode, clear_error_flag), after waiting up to wait_seconds
  // for graphs just destroyed (CUDA releases them on an internal thread; host polling only).
  // While it is above 0 the destructor keeps the workspace, which the graphs' replays use, until
  // the process exits (a leak, never a free under a graph): destroy the graphs first. The
  // destructor's own wait is 0.1 s, and 0.01 s within 0.1 s of another wait that ran out with
  // launches held (a destructor's of any Decoder, Prefiller or communicator, or this call's
  // with wait_seconds > 0): objects that live graphs hold at interpreter exit cost one grace
  // and 0.01 s each, not one grace each.
  long long launches_in_live_graphs(double wait_seconds = 0) const;

 private:
  struct Impl;
  explicit Decoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True when the library was built with CUDA and a device is visible.
bool gpu_available();

}  // namespace cpidx
