// src/cuda/decoder.cc: the Decoder object: host-side validation (before any kernel runs), the
// one-time plan and workspace, and the decode steps as short launch sequences on the caller's
// stream. No allocation, synchronisation or device query happens after create().
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cpidx/comm.h"
#include "cpidx/device_channel.h"
#include "cpidx/indexer.h"
#include "cpidx/reference.h"
#include "cpidx/workspace.h"
#include "graph_holds.h"
#include "host_util.h"
#include "kernels.h"
#include "reference/internal.h"

namespace cpidx {
namespace {

using cuda_host::align_up;

}  // namespace

DecodeWorkspaceLayout decode_workspace_layout(const DecodeConfig& c, int grid) {
  DecodeWorkspaceLayout w;
  Geometry geo;
  if (!make_geometry(c.total_heads, c.world_size, c.rank, &geo).is_ok()) return w;
  const size_t K = static_cast<size_t>(c.sel.topk), T = c.total_heads, P = c.world_size;
  const size_t n = static_cast<size_t>(c.max_tokens), L = geo.local_heads;
  size_t o = 0;
  auto take = [&](size_t bytes) {
    o = align_up(o, 256);
    size_t at = o;
    o += bytes;
    return at;
  };
  // A call lays out its H x Q columns grid + num_reqs slots apart (partial_slots); with
  // H <= T, Q <= max_query_len and Q x num_reqs <= max_tokens, no call needs more than this.
  w.partial = take(T * (static_cast<size_t>(c.max_query_len) * grid + n) * K * sizeof(Key));
  w.error_flag = take(sizeof(int32_t));
  const bool cp = P > 1 && c.exchange_buffers;
  w.q_send = take(cp ? n * L * kHeadDim * 2 : 0);
  w.q_recv = take(cp ? P * n * L * kHeadDim * 2 : 0);
  w.keys_send = take(cp ? T * n * K * sizeof(Key) : 0);
  w.keys_recv = take(cp ? P * T * n * K * sizeof(Key) : 0);
  const size_t cols = cuda::padded_columns(c.total_heads * c.max_query_len);
  // No step owns more pages than max_tokens requests of max_seq_len tokens (plain decode scores
  // every block of them; a rank's shard holds fewer): the limits stop there, so a small Decoder
  // sizes no keys its steps cannot write. Every step takes the path it would without the cap.
  const int64_t reachable =
      std::max<int64_t>(0, int64_t{c.max_tokens} * cdiv(c.max_seq_len, kBlockSize));
  if (c.split_max_pages == DecodeConfig::kAutoSplit) {
    const int64_t fits =
        static_cast<int64_t>(DecodeConfig::kSplitBufferBytes / (cols * sizeof(Key)));
    w.split_any_pages = std::min(DecodeConfig::kDefaultSplitPages, reachable);
    w.split_max_pages = std::min(
        reachable, std::max(DecodeConfig::kDefaultSplitPages,
                            std::min(DecodeConfig::large_split_pages(c.cache_dtype), fits)));
    w.split_longest_pages = DecodeConfig::split_longest_pages(c.cache_dtype);
  } else {
    w.split_max_pages = w.split_any_pages = w.split_longest_pages =
        std::min(c.split_max_pages, reachable);
  }
  w.split_keys = take(static_cast<size_t>(w.split_max_pages) * cols * sizeof(Key));
  w.steal_words =
      take(w.split_max_pages > 0 ? (static_cast<size_t>(grid) + 1) * sizeof(uint64_t) : 0);
  w.total = align_up(o, 256);
  return w;
}

struct Decoder::Impl {
  DecodeConfig cfg;
  Geometry geo;
  DecodePlan plan;
  cuda::ScoreTopkLaunch launch;
  DecodeWorkspaceLayout layout;
  int device = 0;
  uint8_t* workspace = nullptr;
  // Calls held by live CUDA graphs, whose replays use the workspace (launches_in_live_graphs):
  // each public call that launches counts itself once, after its checks, before its first launch.
  cuda_host::GraphHolds holds;

  template <typename T>
  T* at(size_t offset) const { return reinterpret_cast<T*>(workspace + offset); }

  Status check_device() const { return cuda_host::check_current_device(device, "Decoder"); }

  // The plan of the scoring instance a step of `ncols` padded columns launches (<= the bound's),
  // the split path's and the workspace's figures as in `plan`.
  DecodePlan step_plan(int ncols) const {
    const cuda::ScoreTopkInstance& in = launch.instance(ncols);
    DecodePlan s = plan;
    s.grid = in.grid;
    s.stages = in.stages;
    s.offset_stride = 1 << in.prefix_shift;
    s.smem_bytes = in.smem_bytes;
    return s;
  }

  Status check_inputs(const DecodeInputs& in, int expected_heads) const {
    CPIDX_RETURN_IF_ERROR(check_device());
    CPIDX_RETURN_IF_ERROR(ref::validate(in, cfg.sel, cfg.max_tokens));
    CPIDX_CHECK(in.num_heads == expected_heads,
                "query heads (num_heads) must be " << expected_heads << ", got " << in.num_heads);
    CPIDX_RETURN_IF_ERROR(cuda_host::check_kernel_inputs(
        in.query, in.q_row_stride, in.q_head_stride, in.cache, in.max_seq_len, cfg.max_seq_len,
        cfg.cache_dtype, in.error_flag, "Decoder"));
    CPIDX_CHECK(in.query_len <= cfg.max_query_len,
                "query_len must be <= max_query_len " << cfg.max_query_len << ", got "
                                                      << in.query_len);
    return Status::ok();
  }

  // Outputs of a step with `heads` heads over `n` rows: ids strides that do not overlap, and
  // every sparse-table argument (all or none, strides, widths) before any kernel runs; then
  // no output sharing memory with another or with an input. A merge (`gathered`: its keys)
  // reads only those keys, and seq_lens for a sparse table, and raises no error bit.
  Status check_outputs(const TopkOutput& out, int heads, const DecodeInputs& batch,
                       const SparseTableOutput* table, const Key* gathered = nullptr) const {
    CPIDX_RETURN_IF_ERROR(ref::detail::check_ids(out, heads, batch.num_rows(), cfg.sel.topk));
    if (table != nullptr) {
      CPIDX_RETURN_IF_ERROR(ref::validate(*table, heads));
      if (table->enabled()) {
        CPIDX_RETURN_IF_ERROR(ref::detail::check_table_args(
            *table, batch.num_reqs, batch.query_len, cfg.max_seq_len, cfg.sel.topk));
      }
    }
    if (gathered != nullptr) {  // over the Decoder's max_seq_len: a merge's batch may omit it
      return ref::detail::check_no_aliasing(ref::detail::merge_spans(
          gathered, cfg.world_size, cfg.total_heads, batch.num_rows(), cfg.sel.topk,
          batch.seq_lens, batch.num_reqs, batch.query_len, cfg.max_seq_len, out, heads, table));
    }
    // batch.max_seq_len equals the Decoder's here (check_inputs required it).
    ref::detail::CallSpans spans =
        ref::detail::decode_spans(batch, out, heads, cfg.sel.topk, table);
    spans.flag("error_flag", batch.error_flag);
    return ref::detail::check_no_aliasing(spans);
  }

  cuda::ScoreTopkParams score_params(const DecodeInputs& in, int world, int rank) const {
    cuda::ScoreTopkParams p;
    cuda_host::set_common_params(p, in, cfg.sel);
    for (int h = 0; h < in.num_heads; ++h) {
      p.q_head[h] = reinterpret_cast<const __nv_bfloat16*>(in.query) + h * in.q_head_stride;
    }
    p.query_len = in.query_len;
    p.max_blocks = in.max_blocks();
    p.world = world;
    p.rank = rank;
    p.partial = at<Key>(layout.partial);
    // The step's own instance (its columns), whose grid may be below the plan's largest.
    const int grid = launch.step_instance(in.num_heads, in.query_len).grid;
    p.num_slots = cuda::partial_slots(grid, in.num_reqs);
    p.fused_grid = grid;
    p.error_flag = in.error_flag != nullptr ? in.error_flag : at<int32_t>(layout.error_flag);
    if (layout.split_max_pages > 0) {
      p.split_keys = at<Key>(layout.split_keys);
      p.split_max_pages = layout.split_max_pages;
      p.split_any_pages = layout.split_any_pages;
      p.split_longest_pages = layout.split_longest_pages;
      if (cfg.work_stealing) {
        p.steal_words = at<unsigned long long>(layout.steal_words);
        p.steal_count_at = launch.grid;  // after every instance's words
      }
    }
    p.pdl = cfg.programmatic_launch;
    return p;
  }

  // Scoring and selection: the scoring kernel, then select_topk (the split path's selection, or
  // the fused path's merge of requests that span CTAs).
  Status launch_scoring(const cuda::ScoreTopkParams& p, DType dtype, cudaStream_t stream) const {
    CPIDX_LAUNCH_TRY(cuda::launch_score_topk(p, dtype, launch, stream));
    CPIDX_LAUNCH_TRY(cuda::launch_select_topk(p, launch, stream));
    return Status::ok();
  }

  // The plain decode's launches alone (every head in `in` to ids); callers have validated.
  Status launch_plain(const DecodeInputs& in, const TopkOutput& out,
                      const SparseTableOutput* table, cudaStream_t stream) const {
    cuda::ScoreTopkParams p = score_params(in, 1, 0);
    cuda_host::set_ids_output(p, out);
    p.table = table_args(table);
    return launch_scoring(p, in.cache.dtype, stream);
  }

  // The merge launch alone; callers have validated its arguments.
  Status launch_merge(const Key* gathered, const DeviceChannel* channel, const DecodeInputs& batch,
                      const TopkOutput& out, const SparseTableOutput* table,
                      cudaStream_t stream) const {
    cuda::MergeParams m;
    m.gathered = gathered;
    if (channel != nullptr) m.channel = *channel;
    m.world = cfg.world_size;
    m.total_heads = cfg.total_heads;
    m.n = batch.num_rows();
    m.topk = cfg.sel.topk;
    m.head_offset = geo.head_offset;
    m.local_heads = geo.local_heads;
    cuda_host::set_ids_output(m, out);
    m.table = table_args(table);
    m.seq_lens = batch.seq_lens;
    m.num_reqs = batch.num_reqs;
    m.query_len = batch.query_len;
    m.max_seq_len = cfg.max_seq_len;
    m.pdl = cfg.programmatic_launch;
    CPIDX_LAUNCH_TRY(cuda::launch_merge_topk(m, stream));
    return Status::ok();
  }

  static cuda::SparseTableArgs table_args(const SparseTableOutput* t) {
    cuda::SparseTableArgs a;
    if (t && t->enabled()) {
      a.attention_block_table = t->attention_block_table;
      a.attn_bt_row_stride = t->attn_bt_row_stride;
      a.table = t->table;
      a.table_row_stride = t->table_row_stride;
      a.context_lens = t->context_lens;
      a.block_page_stride = t->block_page_stride;
    }
    return a;
  }
};

Decoder::Decoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Decoder::~Decoder() {
  // Not under a live graph that still uses it: left to the process instead (after a short
  // grace for graphs destroyed just before).
  if (impl_ && impl_->holds.wait_on_destroy() == 0) {
    cuda_host::free_relaxed(impl_->workspace);
  }
}

long long Decoder::launches_in_live_graphs(double wait_seconds) const {
  return impl_->holds.wait_for_release(wait_seconds);
}

Status Decoder::create(const DecodeConfig& c, int device, std::unique_ptr<Decoder>* out) {
  CPIDX_CHECK(out != nullptr, "out must not be null");
  CPIDX_RETURN_IF_ERROR(cuda_host::check_cache_dtype(c.cache_dtype));
  if (c.head_dim != kHeadDim) {
    return unsupported("head_dim must be " + std::to_string(kHeadDim) + ", got " +
                       std::to_string(c.head_dim));
  }
  if (c.sel.topk > kMaxTopK) {
    return unsupported("topk must be in [1, " + std::to_string(kMaxTopK) + "], got " +
                       std::to_string(c.sel.topk));
  }
  auto impl = std::make_unique<Impl>();
  impl->cfg = c;
  CPIDX_RETURN_IF_ERROR(make_geometry(c.total_heads, c.world_size, c.rank, &impl->geo));
  CPIDX_CHECK(c.sel.topk >= 1 && c.sel.topk <= kMaxTopK,
              "topk must be in [1, " << kMaxTopK << "], got " << c.sel.topk);
  CPIDX_CHECK(c.sel.init_blocks >= 0 && c.sel.local_blocks >= 0,
              "init_blocks and local_blocks must be >= 0, got " << c.sel.init_blocks << " and "
                                                               << c.sel.local_blocks);
  CPIDX_CHECK(c.max_tokens >= 1 && c.max_tokens <= DecodeConfig::kMaxTokens,
              "max_tokens must be in [1, " << DecodeConfig::kMaxTokens << "], got "
                                           << c.max_tokens);
  CPIDX_CHECK(c.max_seq_len >= 1, "max_seq_len must be >= 1, got " << c.max_seq_len);
  CPIDX_CHECK(c.max_query_len >= 1 && c.max_query_len <= kMaxQueryLen,
              "max_query_len must be in [1, " << kMaxQueryLen << "], got " << c.max_query_len);
  CPIDX_CHECK(c.world_size <= kMaxWorldSize,
              "world_size must be <= " << kMaxWorldSize << ", got " << c.world_size);
  CPIDX_CHECK(c.scoring_ctas_per_sm >= 0 && c.scoring_ctas_per_sm <= 4,
              "scoring_ctas_per_sm must be 0 (automatic), 1, 2, 3 or 4, got "
                  << c.scoring_ctas_per_sm);
  CPIDX_CHECK(c.split_max_pages >= DecodeConfig::kAutoSplit && c.split_max_pages <= (1 << 24),
              "split_max_pages must be -1 (automatic), 0 (never) or a page count <= 2^24, got "
                  << c.split_max_pages);
  impl->device = device;
  const Status st = cuda_host::on_device(device, [&]() -> Status {
    const cudaError_t planned = cuda::plan_score_topk(c.total_heads * c.max_query_len,
                                                      c.sel.topk, c.cache_dtype, c.max_tokens,
                                                      device, c.scoring_ctas_per_sm, &impl->launch);
    CPIDX_CHECK(planned != cudaErrorInvalidConfiguration || c.scoring_ctas_per_sm == 0,
                "scoring_ctas_per_sm = " << c.scoring_ctas_per_sm << " does not fit this device "
                "for " << c.total_heads * c.max_query_len << " columns (total_heads x "
                "max_query_len) of " << to_string(c.cache_dtype) << " pages; 0 chooses");
    CPIDX_RETURN_IF_ERROR(cuda_host::cuda_status(planned, "cuda::plan_score_topk"));
    CPIDX_CUDA_TRY(cuda::plan_select_topk(device, &impl->launch));
    CPIDX_CUDA_TRY(cuda::plan_merge_topk());
    impl->layout = decode_workspace_layout(c, impl->launch.grid);
    CPIDX_CUDA_TRY(cudaMalloc(&impl->workspace, impl->layout.total));
    CPIDX_CUDA_TRY(cudaMemset(impl->workspace, 0, impl->layout.total));
    if (impl->layout.split_max_pages > 0) {  // every range not started (page_producer.cuh, v15)
      CPIDX_CUDA_TRY(cudaMemset(impl->workspace + impl->layout.steal_words, 0xff,
                                static_cast<size_t>(impl->launch.grid) * sizeof(uint64_t)));
    }
    CPIDX_CUDA_TRY(cudaDeviceSynchronize());
    return Status::ok();
  });
  if (!st.is_ok()) {
    cuda_host::free_relaxed(impl->workspace);
    return st;
  }
  impl->plan = impl->step_plan(impl->launch.ncols_pad);
  impl->plan.split_max_pages = impl->layout.split_max_pages;
  impl->plan.split_any_pages = impl->layout.split_any_pages;
  impl->plan.split_longest_pages = impl->layout.split_longest_pages;
  impl->plan.workspace_bytes = impl->layout.total;
  impl->plan.max_grid = impl->launch.grid;
  out->reset(new Decoder(std::move(impl)));
  return Status::ok();
}

const DecodeConfig& Decoder::config() const { return impl_->cfg; }
const Geometry& Decoder::geometry() const { return impl_->geo; }
const DecodePlan& Decoder::plan() const { return impl_->plan; }
DecodePlan Decoder::step_plan(int num_heads, int query_len) const {
  // In 64 bits and clamped to the bound before padding: any int arguments read as documented.
  const int64_t columns = static_cast<int64_t>(num_heads) * query_len;
  const int bound = impl_->launch.ncols_pad;
  if (columns >= bound) return impl_->step_plan(bound);
  return impl_->step_plan(cuda::padded_columns(static_cast<int>(columns < 1 ? 1 : columns)));
}
int32_t* Decoder::error_flag() const { return impl_->at<int32_t>(impl_->layout.error_flag); }
void* Decoder::exchange_buffer() const { return impl_->workspace + impl_->layout.q_send; }
size_t Decoder::exchange_buffer_bytes() const {
  // The gather buffers only: the split path's keys and the stealing words follow them.
  return impl_->layout.split_keys - impl_->layout.q_send;
}

Status Decoder::clear_error_flag(cudaStream_t stream) {
  CPIDX_RETURN_IF_ERROR(impl_->check_device());
  CPIDX_RETURN_IF_ERROR(impl_->holds.count_if_captured(stream));
  CPIDX_LAUNCH_TRY(cudaMemsetAsync(error_flag(), 0, sizeof(int32_t), stream));
  return Status::ok();
}

Status Decoder::decode(const DecodeInputs& in, const TopkOutput& out,
                       const SparseTableOutput* table, cudaStream_t stream) {
  CPIDX_CHECK(in.num_heads >= 1 && in.num_heads <= impl_->cfg.total_heads,
              "query heads (num_heads) must be in [1, " << impl_->cfg.total_heads << "], got "
                                                        << in.num_heads);
  CPIDX_RETURN_IF_ERROR(impl_->check_inputs(in, in.num_heads));
  CPIDX_RETURN_IF_ERROR(impl_->check_outputs(out, in.num_heads, in, table));
  CPIDX_RETURN_IF_ERROR(impl_->holds.count_if_captured(stream));
  return impl_->launch_plain(in, out, table, stream);
}

Status Decoder::shard_keys(const DecodeInputs& in, Key* keys, cudaStream_t stream) {
  CPIDX_RETURN_IF_ERROR(impl_->check_inputs(in, impl_->cfg.total_heads));
  CPIDX_CHECK(keys != nullptr, "keys must not be null");
  CPIDX_CHECK(ref::detail::aligned(keys, alignof(Key)),
              "keys must be 8-byte aligned, got address " << keys);
  ref::detail::CallSpans spans;
  spans.decode_inputs(in);
  spans.output(ref::detail::CallSpans::keys("keys", keys, in.num_heads * in.num_rows(),
                                            impl_->cfg.sel.topk));
  spans.flag("error_flag", in.error_flag);
  CPIDX_RETURN_IF_ERROR(ref::detail::check_no_aliasing(spans));
  cuda::ScoreTopkParams p =
      impl_->score_params(in, impl_->cfg.world_size, impl_->cfg.rank);
  p.keys = keys;
  CPIDX_RETURN_IF_ERROR(impl_->holds.count_if_captured(stream));
  return impl_->launch_scoring(p, in.cache.dtype, stream);
}

Status Decoder::merge(const Key* gathered, const DecodeInputs& batch, const TopkOutput& out,
                      const SparseTableOutput* table, cudaStream_t stream) {
  CPIDX_RETURN_IF_ERROR(impl_->check_device());
  CPIDX_CHECK(gathered != nullptr, "gathered keys must not be null");
  CPIDX_CHECK(ref::detail::aligned(gathered, alignof(Key)),
              "gathered keys must be 8-byte aligned, got address " << gathered);
  CPIDX_CHECK(batch.seq_lens != nullptr, "seq_lens must not be null");
  CPIDX_CHECK(ref::detail::aligned(batch.seq_lens, alignof(int32_t)),
              "seq_lens must be 4-byte aligned (int32), got address " << batch.seq_lens);
  CPIDX_CHECK(batch.num_reqs >= 1, "num_reqs must be >= 1, got " << batch.num_reqs);
  CPIDX_CHECK(batch.query_len >= 1 && batch.query_len <= impl_->cfg.max_query_len,
              "query_len must be in [1, max_query_len = " << impl_->cfg.max_query_len
                                                          << "], got " << batch.query_len);
  CPIDX_CHECK(batch.num_rows() <= impl_->cfg.max_tokens,
              "num_reqs * query_len (" << batch.num_rows() << ") exceeds max_tokens ("
                                       << impl_->cfg.max_tokens << ")");
  CPIDX_RETURN_IF_ERROR(
      impl_->check_outputs(out, impl_->geo.local_heads, batch, table, gathered));
  CPIDX_RETURN_IF_ERROR(impl_->holds.count_if_captured(stream));
  return impl_->launch_merge(gathered, nullptr, batch, out, table, stream);
}

Status Decoder::check_cp_decode(const DecodeInputs& local, const TopkOutput& out,
                                const SparseTableOutput* table) const {
  const int L = impl_->geo.local_heads;
  CPIDX_RETURN_IF_ERROR(impl_->check_inputs(local, L));
  return impl_->check_outputs(out, L, local, table);
}

Status Decoder::cp_decode(const DecodeInputs& local, const TopkOutput& out,
                          const SparseTableOutput* table, cudaStream_t stream) {
  const Impl& im = *impl_;
  CPIDX_CHECK(im.cfg.world_size == 1,
              "cp_decode without a communicator runs a world of one; this Decoder is rank "
                  << im.cfg.rank << " of " << im.cfg.world_size);
  CPIDX_RETURN_IF_ERROR(check_cp_decode(local, out, table));
  CPIDX_RETURN_IF_ERROR(im.holds.count_if_captured(stream));  // before its first launch
  return im.launch_plain(local, out, table, stream);  // L == T: every head
}

Status Decoder::cp_decode(Communicator& comm, const DecodeInputs& local, const TopkOutput& out,
                          const SparseTableOutput* table, cudaStream_t stream) {
  const Impl& im = *impl_;
  const int P = im.cfg.world_size, T = im.cfg.total_heads, L = im.geo.local_heads;
  const int64_t n = local.num_rows();
  // The key gather's route: the communicator's device channel (select_topk stores, merge_topk
  // polls: no gather kernel) when it has one that fits, else all_gather.
  const CpGatherBytes gather = cp_gather_bytes(im.geo, n, im.cfg.sel.topk);
  const int64_t k_lines = static_cast<int64_t>(gather.keys / sizeof(Key));
  const DeviceChannel* channel = im.cfg.fused_exchange ? comm.device_channel() : nullptr;
  if (channel != nullptr && (channel->world != P || channel->rank != im.cfg.rank ||
                             k_lines > channel->capacity)) {
    channel = nullptr;
  }
  const Status valid = [&]() -> Status {
    CPIDX_CHECK(P == 1 || im.cfg.exchange_buffers,
                "cp_decode needs the Decoder's gather buffers: this one was created with "
                "exchange_buffers = false (for shard_keys and merge alone)");
    CPIDX_CHECK(comm.world_size() == P && comm.rank() == im.cfg.rank,
                "communicator (rank " << comm.rank() << " of " << comm.world_size()
                                      << ") does not match the Decoder (rank " << im.cfg.rank
                                      << " of " << P << ")");
    CPIDX_CHECK(comm.memory_space() == MemorySpace::kDevice,
                "communicator must exchange device memory for the GPU decode");
    CPIDX_CHECK(comm.device() < 0 || comm.device() == im.device,
                "communicator gathers on device " << comm.device()
                    << ", the Decoder runs on device " << im.device
                    << ": make both for one device");
    CPIDX_RETURN_IF_ERROR(check_cp_decode(local, out, table));  // n is valid from here
    // Each gather within the communicator's bound (the peer communicator's, fixed at its
    // creation): refused here, before any kernel runs, not by the gather after the scoring.
    const size_t cap = comm.max_bytes_per_rank();
    CPIDX_CHECK(P == 1 || (gather.queries <= cap && (channel != nullptr || gather.keys <= cap)),
                "the step's gathers (" << gather.queries << " query bytes and " << gather.keys
                    << " key bytes a rank, for " << n << " rows) exceed the communicator's "
                    << "max_bytes_per_rank (" << cap << "): create it for cp_gather_bytes("
                    << "geometry, max_tokens, topk), or use NCCL");
    return Status::ok();
  }();
  // 0. Every rank must gather the same byte counts by the same route, or the collectives below
  // hang or read past the buffers: agree on the batch rows and the route first (host side only;
  // nothing is captured). A rank whose own checks failed offers -1, so its peers fail here too
  // instead of waiting for it.
  // Then the settings that make the ranks' lists mergeable (query_len, scale, topk, ...: a
  // rank with another query_len or scale gathers as many bytes and would merge silently wrong
  // ids), asked only once the rows agree, so that a rank that skips its step (offering -1
  // above) leaves no peer in this second round.
  if (P > 1 && im.cfg.check_agreement) {
    const long long rows = valid.is_ok() ? n + (channel != nullptr ? kCpFusedRouteTag : 0) : -1;
    const Status agree = comm.check_agree(rows, kCpRowsAgreement);
    CPIDX_RETURN_IF_ERROR(valid);
    CPIDX_RETURN_IF_ERROR(agree);
    CPIDX_RETURN_IF_ERROR(ref::detail::agree_on_settings(comm, T, local, im.cfg.sel));
  }
  CPIDX_RETURN_IF_ERROR(valid);
  CPIDX_RETURN_IF_ERROR(im.holds.count_if_captured(stream));  // before its first launch
  if (P == 1) return im.launch_plain(local, out, table, stream);  // validated above (L == T)

  // 1. Gather the local queries [n, L, D] of every rank: straight from the caller's tensor when
  // it is already laid out so (an engine's per-rank query usually is), else packed first.
  const auto* query = reinterpret_cast<const __nv_bfloat16*>(local.query);
  const __nv_bfloat16* q_send = query;
  auto* q_recv = im.at<__nv_bfloat16>(im.layout.q_recv);
  const bool contiguous = local.q_row_stride == static_cast<int64_t>(L) * kHeadDim &&
                          (L == 1 || local.q_head_stride == kHeadDim);
  if (!contiguous) {
    auto* packed = im.at<__nv_bfloat16>(im.layout.q_send);
    CPIDX_LAUNCH_TRY(cuda::launch_pack_queries(query, local.q_row_stride, local.q_head_stride, n, L,
                                             packed, stream));
    q_send = packed;
  }
  // A gather that failed (a capture invalidated under it, say) may leave the CUDA error it met
  // pending: cleared as the launches' are (launch_status), its Status says what it was. Only an
  // error the gather left: one pending before it (the caller's) stays.
  auto gathered = [](auto&& gather) {
    const bool clean = cudaPeekAtLastError() == cudaSuccess;
    const Status st = gather();
    if (!st.is_ok() && clean) cudaGetLastError();
    return st;
  };
  CPIDX_RETURN_IF_ERROR(
      gathered([&] { return comm.all_gather(q_send, q_recv, gather.queries, stream); }));

  // 2-3. Score all T heads on this rank's shard; keep ordered top-K keys. Global head h comes
  // from the lowest rank of its replica group: rank (h / L) * R, local head h % L.
  DecodeInputs all = local;
  all.num_heads = T;
  cuda::ScoreTopkParams p = im.score_params(all, P, im.cfg.rank);
  for (int h = 0; h < T; ++h) {
    const int src_rank = (h / L) * im.geo.replicas;
    p.q_head[h] = q_recv + static_cast<int64_t>(src_rank) * n * L * kHeadDim + (h % L) * kHeadDim;
  }
  p.q_row_stride = static_cast<int64_t>(L) * kHeadDim;
  Key* keys_send = im.at<Key>(im.layout.keys_send);
  Key* keys_recv = im.at<Key>(im.layout.keys_recv);
  p.keys = keys_send;

  // 4. Gather the keys (by the route agreed above); 5. merge the owned heads.
  if (channel != nullptr) p.channel = *channel;
  CPIDX_RETURN_IF_ERROR(im.launch_scoring(p, local.cache.dtype, stream));
  if (channel == nullptr) {
    CPIDX_RETURN_IF_ERROR(
        gathered([&] { return comm.all_gather(keys_send, keys_recv, gather.keys, stream); }));
  }
  return im.launch_merge(channel == nullptr ? keys_recv : nullptr, channel, local, out, table,
                         stream);  // validated above
}

bool gpu_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace cpidx
