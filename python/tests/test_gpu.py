"""GPU path: torch CUDA tensors through the ops == the C++ Decoder called directly (bitwise) ==
the golden ids; the context-parallel halves on one GPU; CUDA-graph capture and replay with
changing lengths; torch.compile; the peer communicator's Python life cycle (close, bootstrap
held, finalizer, graphs holding its gathers); with 2+ GPUs, IndexerCPDecode over two processes
with each exchange. Skips without torch, a CUDA build or a GPU."""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cpidx  # noqa: E402
from helpers import (golden_cases, golden_decode, process_group, random_decode,  # noqa: E402
                     run_ranks)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cpidx.cuda_built and cpidx.gpu_available()),
    reason="needs a CUDA build of cpidx and a GPU")

DEV = "cuda"


def to_dev(b):
    q = torch.from_numpy(b.query.view(np.int16)).view(torch.bfloat16).to(DEV)
    k = torch.from_numpy(b.cache.view(np.int16)).view(torch.bfloat16).to(DEV)
    return q, k, torch.from_numpy(b.block_table).to(DEV), torch.from_numpy(b.seq_lens).to(DEV)


def host_ids(b, topk, init, local, heads=None):
    q = b.query if heads is None else b.query[:, heads]
    out = np.zeros((q.shape[1], b.rows, topk), np.int32)
    cpidx.decode_topk(q, b.cache, b.block_table, b.seq_lens, b.query_len, out, scale=b.scale,
                      topk=topk, init_blocks=init, local_blocks=local, max_seq_len=b.max_seq_len)
    return out


@pytest.mark.parametrize("case", golden_cases("decode"), ids=lambda c: f"seed{c['seed']}")
def test_golden_decode_gpu(case):
    b = golden_decode(case)
    q, k, bt, sl = to_dev(b)
    out = torch.full((case["T"], b.rows, case["K"]), 3, dtype=torch.int32, device=DEV)
    cpidx.decode_topk(q, k, bt, sl, b.query_len, out, scale=b.scale, topk=case["K"],
                      init_blocks=case["init"], local_blocks=case["local"],
                      max_seq_len=b.max_seq_len)
    assert out.cpu().tolist() == case["ids"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_a_device_that_is_not_current():
    # Kernels go to the tensors' device's stream, whatever device is current.
    b = random_decode(np.random.default_rng(77), 4, 2, [3000, 129], max_seq_len=4096)
    want = host_ids(b, 16, 0, 1)
    q, k, bt, sl = (t.to("cuda:1") for t in to_dev(b))
    out = torch.full((4, b.rows, 16), 5, dtype=torch.int32, device="cuda:1")
    with torch.cuda.device(0):
        cpidx.decode_topk(q, k, bt, sl, 2, out, scale=b.scale, topk=16, init_blocks=0,
                          local_blocks=1, max_seq_len=4096)
    torch.cuda.synchronize("cuda:1")
    assert np.array_equal(out.cpu().numpy(), want)


@pytest.mark.parametrize("T,Q,K,init,local", [(4, 1, 16, 0, 1), (2, 4, 8, 1, 2), (8, 2, 64, 0, 1)])
def test_op_equals_decoder_and_reference(T, Q, K, init, local):
    rng = np.random.default_rng(T * 100 + Q)
    b = random_decode(rng, T, Q, [3000, 1, 0, 129, 2049], max_seq_len=4096)
    q, k, bt, sl = to_dev(b)
    via_op = torch.full((T, b.rows, K), 1, dtype=torch.int32, device=DEV)
    cpidx.decode_topk(q, k, bt, sl, Q, via_op, scale=b.scale, topk=K, init_blocks=init,
                      local_blocks=local, max_seq_len=4096)
    dec = cpidx.Decoder(total_heads=T, world_size=1, rank=0, max_tokens=b.rows, max_seq_len=4096,
                        topk=K, init_blocks=init, local_blocks=local, device=0)
    direct = torch.full_like(via_op, 2)
    dec.decode(q, k, bt, sl, Q, direct, scale=b.scale,
               stream=torch.cuda.current_stream().cuda_stream)
    again = torch.full_like(via_op, 4)
    cpidx.decode_topk(q, k, bt, sl, Q, again, scale=b.scale, topk=K, init_blocks=init,
                      local_blocks=local, max_seq_len=4096)
    torch.cuda.synchronize()
    assert torch.equal(via_op, direct) and torch.equal(via_op, again)
    np.testing.assert_array_equal(via_op.cpu().numpy(), host_ids(b, K, init, local))
    assert int(dec.error_flag().item()) == 0


def test_large_max_tokens_keep_two_ctas_per_sm():
    # A Decoder planned for far more tokens than its batch keeps every N-th request offset
    # (offset_stride) instead of leaving one scoring CTA per SM; the ids do not change, for a
    # small step (every offset kept in the same bytes) nor for one of more than max_tokens / N
    # requests (the others summed again from the lengths).
    rng = np.random.default_rng(5)
    b = random_decode(rng, 4, 1, [3000, 1, 0, 129, 2049], max_seq_len=4096)
    q, k, bt, sl = to_dev(b)
    kw = dict(total_heads=4, world_size=1, rank=0, max_seq_len=4096, topk=16, init_blocks=0,
              local_blocks=1, device=0)
    small, large = cpidx.Decoder(max_tokens=b.rows, **kw), cpidx.Decoder(max_tokens=16384, **kw)
    assert small.offset_stride == 1 and large.offset_stride > 1
    assert large.grid == small.grid == 2 * torch.cuda.get_device_properties(0).multi_processor_count
    for dec in (small, large):
        out = torch.full((4, b.rows, 16), -7, dtype=torch.int32, device=DEV)
        dec.decode(q, k, bt, sl, 1, out, scale=b.scale,
                   stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), host_ids(b, 16, 0, 1))
    reqs = 16384 // large.offset_stride + 37
    lens = rng.integers(0, 257, size=reqs)
    lens[40:60] = 0  # a run of padding across kept offsets
    # Pages for 256 tokens a request; the Decoder's max_seq_len is 4096, so the table rows are 32
    # entries wide (garbage past 2).
    many = random_decode(rng, 4, 1, lens.tolist(), max_seq_len=256, spare_pages=0, bound=4096)
    q, k, bt, sl = to_dev(many)
    out = torch.full((4, reqs, 16), -7, dtype=torch.int32, device=DEV)
    large.decode(q, k, bt, sl, 1, out, scale=many.scale,
                 stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), host_ids(many, 16, 0, 1))
    assert int(large.error_flag().item()) == 0


def test_step_plan_names_the_instance_a_step_launches():
    kw = dict(total_heads=4, world_size=1, rank=0, max_tokens=64, max_seq_len=1 << 20, topk=16,
              init_blocks=0, local_blocks=1, device=0)
    bf16 = cpidx.Decoder(**kw)
    bound = bf16.step_plan(4, bf16.max_query_len)
    assert (bound["grid"], bound["stages"], bound["offset_stride"]) == (
        bf16.grid, bf16.stages, bf16.offset_stride)
    assert bound["smem_bytes"] > 0
    # fp8 at 8 columns (4 heads, Q=1) runs four CTAs per SM, more than the default bound's
    # 32-column instance (the properties above).
    fp8 = cpidx.Decoder(cache_dtype="fp8_e4m3", **kw)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert fp8.step_plan(4, 1)["grid"] == 4 * sms > fp8.grid
    assert fp8.step_plan(1, 2) == fp8.step_plan(4, 1)  # same padded width
    # The path rule by cache dtype (DecodeConfig::split_*_pages): the 16 MiB key buffer holds
    # 2^16 pages at the default bound's 32 columns, for either dtype; a request may own 8192
    # pages (bf16) or 32768 (fp8) in a split step above 16384 pages.
    assert (bf16.split_any_pages, bf16.split_max_pages, bf16.split_longest_pages) == (
        16384, 65536, 8192)
    assert (fp8.split_any_pages, fp8.split_max_pages, fp8.split_longest_pages) == (
        16384, 65536, 32768)
    narrow = cpidx.Decoder(cache_dtype="fp8_e4m3", max_query_len=1, **kw)
    assert narrow.split_max_pages == 262144  # 8 columns
    # The limits stop at the pages a step can own: 64 requests of 32 pages.
    small = cpidx.Decoder(**dict(kw, max_seq_len=4096))
    assert (small.split_any_pages, small.split_max_pages) == (2048, 2048)
    assert bf16.workspace_bytes - small.workspace_bytes == (65536 - 2048) * 32 * 8  # keys
    with pytest.raises(ValueError, match="num_heads"):
        bf16.step_plan(5, 1)
    with pytest.raises(ValueError, match="query_len"):
        bf16.step_plan(4, 0)
    with pytest.raises(ValueError, match="query_len"):
        bf16.step_plan(4, bf16.max_query_len + 1)


def test_fp8_cache_gpu():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    rng = np.random.default_rng(9)
    b = random_decode(rng, 4, 1, [1000, 300], max_seq_len=1024, lo=-1, hi=2)
    q, k, bt, sl = to_dev(b)
    k8 = k.float().to(torch.float8_e4m3fn)
    out = torch.zeros((4, b.rows, 16), dtype=torch.int32, device=DEV)
    cpidx.decode_topk(q, k8, bt, sl, 1, out, scale=b.scale, topk=16, max_seq_len=1024)
    b.cache = k8.view(torch.uint8).cpu().numpy()
    np.testing.assert_array_equal(out.cpu().numpy(), host_ids(b, 16, 0, 1))


def test_sparse_table_gpu_matches_reference():
    rng = np.random.default_rng(4)
    b = random_decode(rng, 1, 2, [2100, 4, 0, 3000], max_seq_len=3072)
    q, k, bt, sl = to_dev(b)
    G = bt.shape[1]
    attn = (1000 + 37 * torch.arange(4)[:, None] + torch.arange(G)[None]).int().to(DEV)
    table = torch.full((b.rows, 128), -1, dtype=torch.int32, device=DEV)
    ctx = torch.full((b.rows,), -1, dtype=torch.int32, device=DEV)
    out = torch.zeros((1, b.rows, 16), dtype=torch.int32, device=DEV)
    cpidx.decode_topk(q, k, bt, sl, 2, out, scale=b.scale, topk=16, max_seq_len=3072,
                      attention_block_table=attn, sparse_block_table_out=table,
                      sparse_context_lens_out=ctx, block_page_stride=8)
    h_table = np.full((b.rows, 128), -1, np.int32)
    h_ctx = np.full((b.rows,), -1, np.int32)
    h_out = np.zeros((1, b.rows, 16), np.int32)
    cpidx.decode_topk(b.query, b.cache, b.block_table, b.seq_lens, 2, h_out, scale=b.scale,
                      topk=16, max_seq_len=3072, attention_block_table=attn.cpu().numpy(),
                      sparse_block_table_out=h_table, sparse_context_lens_out=h_ctx,
                      block_page_stride=8)
    np.testing.assert_array_equal(out.cpu().numpy(), h_out)
    np.testing.assert_array_equal(table.cpu().numpy(), h_table)
    np.testing.assert_array_equal(ctx.cpu().numpy(), h_ctx)


@pytest.mark.parametrize("T,P", [(4, 2), (4, 4), (4, 8), (2, 4)])
def test_cp_halves_on_one_gpu_equal_plain(T, P):
    rng = np.random.default_rng(T + 10 * P)
    b = random_decode(rng, T, 2, [5000, 129, 0, 1300], max_seq_len=5120)
    q, k, bt, sl = to_dev(b)
    K = 16
    plain = torch.zeros((T, b.rows, K), dtype=torch.int32, device=DEV)
    cpidx.decode_topk(q, k, bt, sl, 2, plain, scale=b.scale, topk=K, max_seq_len=5120)
    decs = [cpidx.Decoder(total_heads=T, world_size=P, rank=r, max_tokens=b.rows,
                          max_seq_len=5120, topk=K, init_blocks=0, local_blocks=1, device=0)
            for r in range(P)]
    gathered = torch.zeros((P, T, b.rows, K), dtype=torch.int64, device=DEV)
    s = torch.cuda.current_stream().cuda_stream
    for r, d in enumerate(decs):
        d.shard_keys(q, k, bt, sl, 2, gathered[r], scale=b.scale, stream=s)
    for d in decs:
        out = torch.full((d.local_heads, b.rows, K), 9, dtype=torch.int32, device=DEV)
        d.merge(gathered, sl, 2, out, stream=s)
        assert torch.equal(out, plain[d.head_offset: d.head_offset + d.local_heads])


def test_cuda_graph_replay_with_changing_lengths():
    T, Q, K, reqs, msl = 4, 2, 16, 6, 8192
    rng = np.random.default_rng(12)
    first = random_decode(rng, T, Q, [msl] * reqs, max_seq_len=msl)
    q, k, bt, sl = to_dev(first)
    out = torch.zeros((T, first.rows, K), dtype=torch.int32, device=DEV)
    cp = cpidx.IndexerCPDecode(total_heads=T, rank=0, world_size=1, max_tokens=first.rows,
                               max_seq_len=msl, topk=K, init_blocks=0, local_blocks=1,
                               group=None, device=DEV)

    def step():
        cpidx.decode_topk(q, k, bt, sl, Q, out, scale=0.5, topk=K, max_seq_len=msl,
                          max_tokens=first.rows)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up creates the registry's decoder outside capture
        cp(q, k, bt, sl, Q, out, scale=0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    cp_out = torch.zeros_like(out)
    cp_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cp_graph):
        cp(q, k, bt, sl, Q, cp_out, scale=0.5)
    for lens in ([1, 129, 0, 8000, 300, 4097], [8192, 2, 2, 0, 0, 128], [5] * reqs):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(torch.randint(0, k.shape[0], bt.shape, dtype=torch.int32))
        q.copy_(torch.randint(-3, 4, q.shape).to(torch.bfloat16))
        graph.replay()
        cp_graph.replay()
        eager = torch.zeros_like(out)
        cpidx.decode_topk(q, k, bt, sl, Q, eager, scale=0.5, topk=K, max_seq_len=msl)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), lens
        assert torch.equal(cp_out, eager), lens


def test_registry_clear_under_a_live_graph_keeps_the_workspace_and_warns():
    # The functional call's decoder, dropped by clear() while a graph that captured a call lives:
    # its workspace stays for the graph's replays (which still give the eager ids), with a
    # warning; once the graph is gone nothing counts it.
    T, Q, K, msl = 4, 1, 16, 8192
    rng = np.random.default_rng(33)
    b = random_decode(rng, T, Q, [msl, 3000, 1], max_seq_len=msl)
    q, k, bt, sl = to_dev(b)
    reg = cpidx.Registry()
    out = torch.zeros((T, b.rows, K), dtype=torch.int32, device=DEV)

    def step(o):
        cpidx.decode_topk(q, k, bt, sl, Q, o, scale=0.5, topk=K, max_seq_len=msl,
                          max_tokens=b.rows, registry=reg)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(out)  # creates the registry's decoder outside capture
    torch.cuda.current_stream().wait_stream(side)
    (dec,) = reg._decoders.values()
    assert dec.launches_in_live_graphs() == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out)
    assert dec.launches_in_live_graphs() == 1
    del dec
    with pytest.warns(RuntimeWarning, match=r"1 decoder\(s\) / prefiller\(s\) dropped while "
                                            r"CUDA graphs .* kept until the process exits"):
        reg.clear()
    assert len(reg) == 0
    want = torch.zeros_like(out)
    cpidx.decode_topk(q, k, bt, sl, Q, want, scale=0.5, topk=K, max_seq_len=msl)
    for _ in range(2):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    del graph
    reg.clear()  # nothing left, nothing to warn about


def test_launches_in_live_graphs_counts_each_captured_call_once():
    # Each public call captured counts once while its graph lives, and nothing once its graph is
    # gone: decode, shard_keys, merge and (with a peer communicator) cp_decode of a one-rank
    # Decoder, one graph each. (At one rank cp_decode is the plain decode; at two, a step's query
    # pack, scoring and merge count once: test_peer_gathers_in_live_graphs_are_counted_...)
    rng = np.random.default_rng(35)
    b = random_decode(rng, 4, 1, [4000, 700, 1], max_seq_len=4096)
    q, k, bt, sl = to_dev(b)
    dec = cpidx.Decoder(total_heads=4, world_size=1, rank=0, max_tokens=b.rows, max_seq_len=4096,
                        topk=16, init_blocks=0, local_blocks=1, device=0)
    out = torch.zeros((4, b.rows, 16), dtype=torch.int32, device=DEV)
    keys = torch.zeros((1, 4, b.rows, 16), dtype=torch.int64, device=DEV)
    calls = [lambda s: dec.decode(q, k, bt, sl, 1, out, scale=b.scale, stream=s),
             lambda s: dec.shard_keys(q, k, bt, sl, 1, keys[0], scale=b.scale, stream=s),
             lambda s: dec.merge(keys, sl, 1, out, stream=s)]
    peer = boot = None
    if cpidx.has_peer:
        (boot,) = cpidx._C._thread_communicators(1)
        peer = cpidx._C.make_peer_communicator(boot, 0, 1 << 20)
        calls.append(lambda s: dec.cp_decode(peer, q, k, bt, sl, 1, out, scale=b.scale,
                                             stream=s))
    try:  # the communicators closed whatever happens
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:  # eager: nothing counted
                call(side.cuda_stream)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert dec.launches_in_live_graphs() == 0
        graphs = []
        for i, call in enumerate(calls):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(torch.cuda.current_stream().cuda_stream)
            graphs.append(graph)
            assert dec.launches_in_live_graphs() == i + 1, f"call {i}"
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        del graph, graphs
        assert dec.launches_in_live_graphs(5.0) == 0
    finally:
        if peer is not None:
            peer.close()
            boot.close()


def test_objects_collected_inside_a_capture_leave_it_valid():
    # An engine may drop objects while it captures (the collector runs inside torch.cuda.graph,
    # whose capture mode is global): their teardown must not invalidate the capture.
    T, Q, K, msl = 4, 1, 16, 8192
    rng = np.random.default_rng(31)
    b = random_decode(rng, T, Q, [5000, 300, 8192], max_seq_len=msl)
    q, k, bt, sl = to_dev(b)
    out = torch.zeros((T, b.rows, K), dtype=torch.int32, device=DEV)
    cp = cpidx.IndexerCPDecode(total_heads=T, rank=0, world_size=1, max_tokens=b.rows,
                               max_seq_len=msl, topk=K, init_blocks=0, local_blocks=1,
                               group=None, device=DEV)
    doomed = [cpidx.Decoder(total_heads=T, world_size=1, rank=0, max_tokens=4096,
                            max_seq_len=1 << 20, topk=K, init_blocks=0, local_blocks=1, device=0),
              cpidx.Prefiller(num_heads=T, max_tokens=4096, max_seq_len=1 << 20, topk=K,
                              init_blocks=0, local_blocks=1, device=0)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cp(q, k, bt, sl, Q, out, scale=0.5)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cp(q, k, bt, sl, Q, out, scale=0.5)
        doomed.clear()
        gc.collect()
    out.fill_(-5)
    graph.replay()
    eager = torch.zeros_like(out)
    cpidx.decode_topk(q, k, bt, sl, Q, eager, scale=0.5, topk=K, max_seq_len=msl)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_error_flag_of_the_functional_calls_eager_and_captured():
    # Bad device values through decode_topk / prefill_topk on CUDA tensors: the flag gets the
    # bits the host reference returns and the ids are the host's, eager and in a replayed graph
    # (the kernels OR into the flag on the stream, no sync).
    rng = np.random.default_rng(41)
    b = random_decode(rng, 4, 2, [4096] * 3, max_seq_len=4096)  # every page of every request
    b.seq_lens[:] = [3000, 129, 4096]
    pages = b.cache.shape[0]
    q, k, bt, sl = to_dev(b)
    kw = dict(scale=b.scale, topk=16, max_seq_len=4096)

    def host(seq_lens, table):
        out, flag = np.zeros((4, b.rows, 16), np.int32), np.zeros(1, np.int32)
        cpidx.decode_topk(b.query, b.cache, table, np.array(seq_lens, np.int32), 2, out,
                          error_flag=flag, **kw)
        return out, int(flag[0])

    bad_table = b.block_table.copy()
    bad_table[0, 5], bad_table[2, 0] = pages + 4, -1
    cases = [([3000, 129, 4096], b.block_table, 0),
             ([3000, 5000, -3], b.block_table, cpidx.ERR_SEQ_LEN_OUT_OF_RANGE),
             ([3000, 129, 4096], bad_table, cpidx.ERR_PAGE_OUT_OF_RANGE),
             ([9999, 129, 4096], bad_table,
              cpidx.ERR_SEQ_LEN_OUT_OF_RANGE | cpidx.ERR_PAGE_OUT_OF_RANGE)]
    out = torch.full((4, b.rows, 16), -5, dtype=torch.int32, device=DEV)
    flag = torch.full((1,), 0x40, dtype=torch.int32, device=DEV)
    for lens, table, bits in cases:  # eager; the flag keeps its earlier bits
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(torch.from_numpy(table))
        out.fill_(-5)
        flag.fill_(0x40)
        cpidx.decode_topk(q, k, bt, sl, 2, out, error_flag=flag, **kw)
        want, want_bits = host(lens, table)
        assert want_bits == bits
        np.testing.assert_array_equal(out.cpu().numpy(), want, err_msg=str(lens))
        assert int(flag.item()) == 0x40 | bits
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            cpidx.decode_topk(q, k, bt, sl, 2, out, error_flag=flag, **kw)
    torch.cuda.current_stream().wait_stream(side)
    for lens, table, bits in cases[::-1]:
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(torch.from_numpy(table))
        out.fill_(-5)
        flag.zero_()
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), host(lens, table)[0], err_msg=str(lens))
        assert int(flag.item()) == bits
    with pytest.raises(ValueError, match="^error_flag: .*the inputs' device"):
        cpidx.decode_topk(q, k, bt, sl, 2, out, error_flag=torch.zeros(1, dtype=torch.int32),
                          **kw)

    hp, dp, tokens = random_prefill(rng, 2, [64, 3], [1000, 20], 2048)
    hp["block_table"][0, 2] = 1 << 20
    dp["block_table"][0, 2] = 1 << 20
    want, want_flag = np.zeros((2, tokens, 16), np.int32), np.zeros(1, np.int32)
    cpidx.prefill_topk(**hp, out=want, error_flag=want_flag, scale=0.5, topk=16,
                       max_seq_len=2048)
    got = torch.full((2, tokens, 16), -5, dtype=torch.int32, device=DEV)
    pflag = torch.zeros(1, dtype=torch.int32, device=DEV)
    cpidx.prefill_topk(**dp, out=got, error_flag=pflag, scale=0.5, topk=16, max_seq_len=2048)
    torch.cuda.synchronize()
    assert int(want_flag[0]) == int(pflag.item()) == cpidx.ERR_PAGE_OUT_OF_RANGE
    np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_decoder_error_flag_argument_takes_the_bits_and_leaves_its_own_flag():
    # Decoder.decode(error_flag=...), an IndexerCPDecode step and Decoder.cp_decode: the kernels
    # OR into the caller's tensor (any shape of one element); the object's own flag stays clear;
    # a wrong flag is named before any kernel.
    rng = np.random.default_rng(43)
    b = random_decode(rng, 4, 1, [3000, 700], max_seq_len=4096)
    b.seq_lens[:] = [3000, 5000]
    q, k, bt, sl = to_dev(b)
    host_flag = np.zeros(1, np.int32)  # the reference's bits (the clamped request reads garbage)
    cpidx.decode_topk(b.query, b.cache, b.block_table, b.seq_lens, 1,
                      np.zeros((4, b.rows, 16), np.int32), scale=b.scale, topk=16, init_blocks=1,
                      local_blocks=2, max_seq_len=4096, error_flag=host_flag)
    bits = int(host_flag[0])
    assert bits & cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
    dec = cpidx.Decoder(total_heads=4, world_size=1, rank=0, max_tokens=b.rows, max_seq_len=4096,
                        topk=16, init_blocks=1, local_blocks=2, device=0)
    stream = torch.cuda.current_stream().cuda_stream
    dec.clear_error_flag(stream=stream)
    flag = torch.full((), 0x40, dtype=torch.int32, device=DEV)
    out = torch.full((4, b.rows, 16), -5, dtype=torch.int32, device=DEV)
    dec.decode(q, k, bt, sl, 1, out, scale=b.scale, error_flag=flag, stream=stream)
    torch.cuda.synchronize()
    assert int(flag.item()) == 0x40 | bits
    assert int(dec.error_flag().item()) == 0
    plain = torch.full_like(out, -5)
    dec.decode(q, k, bt, sl, 1, plain, scale=b.scale, stream=stream)
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
    assert int(dec.error_flag().item()) == bits
    for bad, err, match in [(torch.zeros(2, dtype=torch.int32, device=DEV), ValueError,
                             "^error_flag: expected one element"),
                            (torch.zeros(1, dtype=torch.int64, device=DEV), TypeError,
                             "^error_flag: expected int32"),
                            (torch.zeros(1, dtype=torch.int32), ValueError,
                             "^error_flag: expected a CUDA tensor")]:
        before = out.clone()
        with pytest.raises(err, match=match):
            dec.decode(q, k, bt, sl, 1, out, scale=b.scale, error_flag=bad, stream=stream)
        torch.cuda.synchronize()
        assert torch.equal(out, before) and int(bad.reshape(-1)[0]) == 0  # no kernel ran
    cp = cpidx.IndexerCPDecode(total_heads=4, rank=0, world_size=1, max_tokens=b.rows,
                               max_seq_len=4096, topk=16, init_blocks=1, local_blocks=2,
                               group=None, device=DEV)
    cp.clear_error_flag()
    flag.fill_(0x40)  # an instance's step: the same, its own flag left clear
    via_instance = torch.full_like(out, -5)
    cp(q, k, bt, sl, 1, via_instance, scale=b.scale, error_flag=flag)
    torch.cuda.synchronize()
    assert int(flag.item()) == 0x40 | bits and int(cp.error_flag().item()) == 0
    assert torch.equal(via_instance, plain)
    cp.close()
    if not cpidx.has_peer:
        return
    (boot,) = cpidx._C._thread_communicators(1)  # cp_decode on one rank: its flag too
    peer = cpidx._C.make_peer_communicator(boot, 0, 1 << 20)
    dec.clear_error_flag(stream=stream)
    flag.zero_()
    via_cp = torch.full_like(out, -5)
    dec.cp_decode(peer, q, k, bt, sl, 1, via_cp, scale=b.scale, error_flag=flag, stream=stream)
    torch.cuda.synchronize()
    assert int(flag.item()) == bits
    assert int(dec.error_flag().item()) == 0
    assert torch.equal(via_cp, plain)
    peer.close()
    boot.close()


def test_torch_compile_calls_ops():
    rng = np.random.default_rng(13)
    b = random_decode(rng, 4, 1, [1000, 3000], max_seq_len=4096)
    q, k, bt, sl = to_dev(b)
    want = torch.zeros((4, b.rows, 16), dtype=torch.int32, device=DEV)
    cpidx.decode_topk(q, k, bt, sl, 1, want, scale=b.scale, topk=16, max_seq_len=4096)

    def f(q, k, bt, sl):
        out = torch.empty((4, q.shape[0], 16), dtype=torch.int32, device=q.device)
        torch.ops.cpidx.decode_topk(q, k, bt, sl, out, 1, 0.5, 16, 0, 1, 4096, 0, None)
        return out.long() + 1

    got = torch.compile(f, fullgraph=True)(q, k, bt, sl)
    assert torch.equal(got, want.long() + 1)

    def g(q, k, bt, sl, out):
        cpidx.decode_topk(q, k, bt, sl, 1, out, scale=0.5, topk=16, max_seq_len=4096)
        return out

    assert torch.equal(torch.compile(g)(q, k, bt, sl, torch.zeros_like(want)), want)


def test_cp_decode_op_compiled_and_in_a_cuda_graph():
    """torch.ops.cpidx.cp_decode (an instance's step by its handle) under torch.compile's default
    backend and captured in a CUDA graph, replayed with new lengths: the plain decode's ids."""
    rng = np.random.default_rng(17)
    b = random_decode(rng, 4, 2, [1000, 3000, 129], max_seq_len=4096)
    q, k, bt, sl = to_dev(b)
    cp = cpidx.IndexerCPDecode(total_heads=4, rank=0, world_size=1, max_tokens=b.rows,
                               max_seq_len=4096, topk=16, init_blocks=0, local_blocks=1,
                               group=None, device=DEV)

    def want(lens):
        out = torch.zeros((4, b.rows, 16), dtype=torch.int32, device=DEV)
        cpidx.decode_topk(q, k, bt, lens, 2, out, scale=b.scale, topk=16, max_seq_len=4096)
        return out

    def f(q, k, bt, sl, out):
        torch.ops.cpidx.cp_decode(cp.handle, q, k, bt, sl, out, 2, b.scale, None, None, None,
                                  None, None)
        return out.long() + 1

    out = torch.full((4, b.rows, 16), 77, dtype=torch.int32, device=DEV)
    got = torch.compile(f, fullgraph=True)(q, k, bt, sl, out)
    assert torch.equal(got, want(sl).long() + 1)
    lens = sl.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.cpidx.cp_decode(cp.handle, q, k, bt, lens, out, 2, b.scale, None, None, None,
                                  None, None)
    for new in ([3000, 1000, 4096], [1, 129, 2000]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(-5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want(lens)), new
    del graph
    cp.close()


def test_prefill_gpu_matches_golden():
    from helpers import golden_inputs

    for case in golden_cases("prefill"):
        q_lens = case["q_lens"]
        query, cache, bt, msl = golden_inputs(case["seed"], case["T"], sum(q_lens),
                                              case["seq_lens"])
        cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device=DEV)
        out = torch.zeros((case["T"], sum(q_lens), case["K"]), dtype=torch.int32, device=DEV)
        qt = torch.from_numpy(query.view(np.int16)).view(torch.bfloat16).to(DEV)
        kt = torch.from_numpy(cache.view(np.int16)).view(torch.bfloat16).to(DEV)
        cpidx.prefill_topk(qt, kt, torch.from_numpy(bt).to(DEV), cu,
                           torch.tensor(case["context_lens"], dtype=torch.int32, device=DEV),
                           torch.tensor(case["seq_lens"], dtype=torch.int32, device=DEV), out,
                           scale=case["scale"], topk=case["K"], init_blocks=case["init"],
                           local_blocks=case["local"], max_seq_len=msl)
        assert out.cpu().tolist() == case["ids"]


def test_bad_device_is_named():
    rng = np.random.default_rng(14)
    b = random_decode(rng, 2, 1, [300], max_seq_len=512)
    q, k, bt, sl = to_dev(b)
    out = torch.zeros((2, 1, 4), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="seq_lens: expected a CUDA tensor"):
        cpidx.decode_topk(q, k, bt, sl.cpu(), 1, out, scale=1.0, topk=4, max_seq_len=512)
    with pytest.raises(TypeError, match="seq_lens: expected int32, got int64"):
        cpidx.decode_topk(q, k, bt, sl.long(), 1, out, scale=1.0, topk=4, max_seq_len=512)


def test_bad_query_is_named_whether_the_registry_has_its_decoder_or_not():
    # The registry checks the query and cache it sizes a decoder from on a miss only (an
    # existing decoder's call checks them itself): either way the message names the argument.
    rng = np.random.default_rng(15)
    b = random_decode(rng, 3, 1, [300], max_seq_len=640)
    q, k, bt, sl = to_dev(b)
    out = torch.zeros((3, 1, 4), dtype=torch.int32, device=DEV)
    kw = dict(scale=1.0, topk=4, max_seq_len=640)
    reg = cpidx.Registry()
    for flat in (q.reshape(1, -1), q[0, 0], q[0, 0, 0]):  # 2, 1, 0 dims: no decoder made
        with pytest.raises(ValueError, match="^index_query: expected 3 dims"):
            cpidx.decode_topk(flat, k, bt, sl, 1, out, registry=reg, **kw)
    assert len(reg) == 0
    for made in (False, True):  # a miss (the registry's check), then a hit (the decoder's)
        with pytest.raises(TypeError, match="^index_query: expected bfloat16"):
            cpidx.decode_topk(q.float(), k, bt, sl, 1, out, registry=reg, **kw)
        cpidx.decode_topk(q, k, bt, sl, 1, out, registry=reg, **kw)
        assert len(reg) == 1
    with pytest.raises(TypeError, match="^index_cache: "):
        cpidx.decode_topk(q, k.view(torch.int16), bt, sl, 1, out, registry=reg, **kw)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), host_ids(b, 4, 0, 1))


def test_the_registry_and_indexer_cp_decode_make_the_public_classes():
    # What they make is a cpidx.Decoder / Prefiller, whose methods hand tensors over as
    # capsules; and such a decoder, given to decode_topk, gives the registry's ids.
    reg = cpidx.Registry()
    kw = dict(device=0, heads=2, max_tokens=8, max_seq_len=1024, topk=4, init_blocks=0,
              local_blocks=1)
    dec = reg.decoder(**kw)
    assert type(dec) is cpidx.Decoder and type(reg.prefiller(**kw)) is cpidx.Prefiller
    cp = cpidx.IndexerCPDecode(total_heads=2, rank=0, world_size=1, max_tokens=8,
                               max_seq_len=1024, topk=4, init_blocks=0, local_blocks=1,
                               group=None, device=DEV)
    assert type(cp._decoder) is cpidx.Decoder
    b = random_decode(np.random.default_rng(16), 2, 1, [700, 1], max_seq_len=1024)
    q, k, bt, sl = to_dev(b)
    outs = [torch.full((2, b.rows, 4), -5, dtype=torch.int32, device=DEV) for _ in range(3)]
    cpidx.decode_topk(q, k, bt, sl, 1, outs[0], scale=b.scale, topk=4, max_seq_len=1024,
                      decoder=dec)
    dec.decode(q, k, bt, sl, 1, outs[1], scale=b.scale,
               stream=torch.cuda.current_stream().cuda_stream)
    cp(q, k, bt, sl, 1, outs[2], scale=b.scale)
    torch.cuda.synchronize()
    for out in outs:
        np.testing.assert_array_equal(out.cpu().numpy(), host_ids(b, 4, 0, 1))
    cp.close()
    reg.clear()


def test_one_rank_step_goes_to_the_library_in_one_call_and_names_its_arguments(monkeypatch):
    # A world of one on the GPU goes to the library in one call (Decoder.cp_decode without a
    # communicator: the plain decode, checked as cp_decode checks; no check_cp_decode call
    # before it): its own arguments' names, no kernel for a refused step, the plain decode's ids
    # for a good one.
    def no_separate_check(*args, **kwargs):
        raise AssertionError("check_cp_decode called: the step converted its arguments twice")

    monkeypatch.setattr(cpidx.Decoder, "check_cp_decode", no_separate_check)
    b = random_decode(np.random.default_rng(18), 4, 2, [300, 900, 1], max_seq_len=1024)
    q, k, bt, sl = to_dev(b)
    cp = cpidx.IndexerCPDecode(total_heads=4, rank=0, world_size=1, max_tokens=8,
                               max_seq_len=1024, topk=16, init_blocks=1, local_blocks=1,
                               group=None, device=DEV)
    out = torch.full((4, b.rows, 16), -7, dtype=torch.int32, device=DEV)
    for args, err, match in [((q.float(), k, bt, sl), TypeError, "^local_q: "),
                             ((q[:, :2], k, bt, sl), ValueError, "^local_q: expected shape"),
                             ((q, k[:, :64], bt, sl), ValueError, "^kv_cache: "),
                             ((q, k.float(), bt, sl), TypeError, "^kv_cache: "),
                             ((q, k, bt.long(), sl), TypeError, "^block_table: expected int32"),
                             ((q, k, bt, sl.long()), TypeError, "^seq_lens: expected int32"),
                             ((q, k, bt, sl[:2]), ValueError,
                              "^local_q, seq_lens: local_q has 6 rows")]:
        with pytest.raises(err, match=match):
            cp(*args, 2, out, scale=b.scale)
    with pytest.raises(ValueError, match="^out: "):
        cp(q, k, bt, sl, 2, out[:2], scale=b.scale)
    torch.cuda.synchronize()
    assert bool((out == -7).all())  # no kernel ran
    cp(q, k, bt, sl, 2, out, scale=b.scale)
    want = torch.full_like(out, -9)
    cpidx.decode_topk(q, k, bt, sl, 2, want, scale=b.scale, topk=16, init_blocks=1,
                      local_blocks=1, max_seq_len=1024)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    np.testing.assert_array_equal(out.cpu().numpy(), host_ids(b, 16, 1, 1))
    cp.close()
    # The Decoder's call without a communicator: a world of one only.
    two = cpidx.Decoder(total_heads=4, world_size=2, rank=0, max_tokens=8, max_seq_len=1024,
                        topk=16, init_blocks=1, local_blocks=1, device=0)
    half = torch.full((2, b.rows, 16), -7, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="^comm: required for a world of 2 ranks"):
        two.cp_decode(None, q[:, :2].contiguous(), k, bt, sl, 2, half, scale=b.scale)
    torch.cuda.synchronize()
    assert bool((half == -7).all())
    # Without cp_decode's gather buffers (the torch exchange's Decoder): a smaller workspace.
    lean = cpidx.Decoder(total_heads=4, world_size=2, rank=0, max_tokens=8, max_seq_len=1024,
                         topk=16, init_blocks=1, local_blocks=1, device=0,
                         exchange_buffers=False)
    assert two.exchange_buffers and not lean.exchange_buffers
    assert lean.workspace_bytes < two.workspace_bytes


def test_methods_without_a_stream_run_on_the_current_one_and_are_captured():
    # Decoder.decode and Prefiller.prefill called without stream= inside torch.cuda.graph are
    # captured (they run on the capture's stream, not on the legacy stream 0 at once), and a
    # replay writes the eager ids again.
    rng = np.random.default_rng(19)
    b = random_decode(rng, 4, 1, [3000, 700], max_seq_len=4096)
    q, k, bt, sl = to_dev(b)
    dec = cpidx.Decoder(total_heads=4, world_size=1, rank=0, max_tokens=b.rows, max_seq_len=4096,
                        topk=16, init_blocks=0, local_blocks=1, device=0)
    host, dev, tokens = random_prefill(rng, 2, [64, 64], [500, 2000], 4096)
    pre = cpidx.Prefiller(num_heads=2, max_tokens=tokens, max_seq_len=4096, topk=16,
                          init_blocks=0, local_blocks=1, device=0)
    args = [dev[k] for k in ("index_query", "index_cache", "block_table", "cu_seqlens_q",
                             "context_lens", "seq_lens")]
    out = torch.full((4, b.rows, 16), -7, dtype=torch.int32, device=DEV)
    pre_out = torch.full((2, tokens, 16), -7, dtype=torch.int32, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, eager on a side stream
        dec.decode(q, k, bt, sl, 1, out, scale=b.scale)
        pre.prefill(*args, pre_out, scale=0.5)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    want, pre_want = out.clone(), pre_out.clone()
    np.testing.assert_array_equal(want.cpu().numpy(), host_ids(b, 16, 0, 1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.decode(q, k, bt, sl, 1, out, scale=b.scale)
        pre.prefill(*args, pre_out, scale=0.5)
    assert dec.launches_in_live_graphs() == 1 and pre.launches_in_live_graphs() == 1
    out.fill_(-7)
    pre_out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(pre_out, pre_want)
    del graph


def random_prefill(rng, heads, q_lens, context_lens, max_seq_len):
    """A packed prefill batch of small-integer values (exact dots, many ties) over a shuffled
    paged cache; returns host arrays and their CUDA copies."""
    b = random_decode(rng, heads, 1, [c + q for c, q in zip(context_lens, q_lens)],
                      max_seq_len=max_seq_len)
    tokens = sum(q_lens)
    query = cpidx.bf16_bits(rng.integers(-3, 4, size=(tokens, heads, 128)).astype(np.float32))
    host = dict(index_query=query, index_cache=b.cache, block_table=b.block_table,
                cu_seqlens_q=np.array([0] + list(np.cumsum(q_lens)), dtype=np.int32),
                context_lens=np.array(context_lens, dtype=np.int32),
                seq_lens=b.seq_lens)
    dev = {k: torch.from_numpy(v.view(np.int16) if v.dtype == np.uint16 else v).to(DEV)
           for k, v in host.items()}
    for k in ("index_query", "index_cache"):
        dev[k] = dev[k].view(torch.bfloat16)
    return host, dev, tokens


def test_prefill_gpu_equals_reference_on_ties():
    rng = np.random.default_rng(21)
    # A chunk after a cached prefix that is not a multiple of 128, a first chunk, one token.
    host, dev, tokens = random_prefill(rng, 4, [300, 129, 1], [1000, 0, 4095], 4224)
    for K, init, local in ((16, 0, 1), (6, 1, 2), (64, 0, 1)):
        want = np.full((4, tokens, K), 7, dtype=np.int32)
        cpidx.prefill_topk(**host, out=want, scale=0.5, topk=K, init_blocks=init,
                           local_blocks=local, max_seq_len=4224)
        got = torch.full((4, tokens, K), 9, dtype=torch.int32, device=DEV)
        cpidx.prefill_topk(**dev, out=got, scale=0.5, topk=K, init_blocks=init,
                           local_blocks=local, max_seq_len=4224)
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_prefiller_in_a_cuda_graph_follows_new_contexts():
    rng = np.random.default_rng(22)
    host, dev, tokens = random_prefill(rng, 2, [64, 64], [500, 2000], 4096)
    # Every block-table entry valid, so longer contexts below stay inside the cache.
    pages = host["index_cache"].shape[0]
    host["block_table"] = rng.permutation(pages)[:2 * 32].reshape(2, 32).astype(np.int32)
    dev["block_table"] = torch.from_numpy(host["block_table"]).to(DEV)
    pre = cpidx.Prefiller(num_heads=2, max_tokens=tokens, max_seq_len=4096, topk=16,
                          init_blocks=0, local_blocks=1, device=0)
    out = torch.zeros((2, tokens, 16), dtype=torch.int32, device=DEV)
    args = [dev[k] for k in ("index_query", "index_cache", "block_table", "cu_seqlens_q",
                             "context_lens", "seq_lens")]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        pre.prefill(*args, out, scale=0.5, stream=side.cuda_stream)  # warm-up outside capture
        with torch.cuda.graph(graph, stream=side):
            pre.prefill(*args, out, scale=0.5, stream=side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    for ctx in ([0, 0], [3000, 7], [4032, 4032]):
        host["context_lens"] = np.array(ctx, dtype=np.int32)
        host["seq_lens"] = host["context_lens"] + 64
        dev["context_lens"].copy_(torch.from_numpy(host["context_lens"]))
        dev["seq_lens"].copy_(torch.from_numpy(host["seq_lens"]))
        out.fill_(-5)
        graph.replay()
        torch.cuda.synchronize()
        want = np.zeros((2, tokens, 16), dtype=np.int32)
        cpidx.prefill_topk(**host, out=want, scale=0.5, topk=16, max_seq_len=4096)
        np.testing.assert_array_equal(out.cpu().numpy(), want, err_msg=str(ctx))
    assert int(pre.error_flag().item()) == 0


def test_prefiller_names_bad_arguments():
    rng = np.random.default_rng(23)
    host, dev, tokens = random_prefill(rng, 2, [10], [100], 512)
    pre = cpidx.Prefiller(num_heads=2, max_tokens=16, max_seq_len=512, topk=4, init_blocks=0,
                          local_blocks=1, device=0)
    out = torch.zeros((2, tokens, 4), dtype=torch.int32, device=DEV)
    args = dict(dev)
    args["cu_seqlens_q"] = dev["cu_seqlens_q"].long()
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        pre.prefill(*args.values(), out, scale=1.0)
    args = dict(dev)
    args["context_lens"] = dev["context_lens"].cpu()
    with pytest.raises(ValueError, match="context_lens"):
        pre.prefill(*args.values(), out, scale=1.0)
    with pytest.raises(ValueError, match=r"^index_query: 64 tokens exceed the Prefiller's "
                                         r"max_tokens \(16\)$"):
        big = torch.zeros((2, 64, 4), dtype=torch.int32, device=DEV)
        q = torch.zeros((64, 2, 128), dtype=torch.bfloat16, device=DEV)
        cu = torch.tensor([0, 64], dtype=torch.int32, device=DEV)
        pre.prefill(q, dev["index_cache"], dev["block_table"], cu, dev["context_lens"],
                    dev["seq_lens"], big, scale=1.0)


needs_peer = pytest.mark.skipif(not cpidx.has_peer, reason="the peer communicator is not built")


@needs_peer
def test_peer_communicator_holds_its_bootstrap_until_closed():
    (boot,) = cpidx._C._thread_communicators(1)
    peer = cpidx._C.make_peer_communicator(boot, 0, 4096)
    assert (peer.kind, peer.rank, peer.world_size, peer.device_memory, peer.device) == \
        ("peer", 0, 1, True, 0)
    assert peer.read_error_flag() == 0
    peer.clear_error_flag(stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert peer.read_error_flag() == 0
    # What close() would raise, without closing (the close agreement of IndexerCPDecode asks
    # it with the peer about to close first, so the bootstrap is no blocker there).
    assert "bootstrap of 1 open peer communicator" in boot._close_blocker()
    assert boot._close_blocker(ignore_dependents=True) is None and peer._close_blocker() is None
    with pytest.raises(RuntimeError, match="bootstrap of 1 open peer communicator"):
        boot.close()
    assert not boot.closed
    peer.close()
    assert boot._close_blocker() is None
    peer.close()
    for use in (lambda: peer.rank, peer.read_error_flag):
        with pytest.raises(RuntimeError, match=r"Communicator\(peer, rank 0 of 1\) is closed"):
            use()
    boot.close()


@needs_peer
def test_dropped_peer_communicator_lets_go_of_its_bootstrap():
    (boot,) = cpidx._C._thread_communicators(1)
    peer = cpidx._C.make_peer_communicator(boot, 0, 4096)
    del peer  # the finalizer: abandoned, no collective
    gc.collect()
    boot.close()  # refused while a peer communicator built over it is open
    assert boot.closed


@needs_peer
def test_peer_communicator_names_bad_arguments():
    (boot,) = cpidx._C._thread_communicators(1)
    with pytest.raises(ValueError, match="max_bytes_per_rank"):
        cpidx._C.make_peer_communicator(boot, 0, 0)
    with pytest.raises(ValueError, match="max_bytes_per_rank"):
        cpidx._C.make_peer_communicator(boot, 0, (16 << 20) + 1)
    with pytest.raises(ValueError, match="device"):
        cpidx._C.make_peer_communicator(boot, 999, 4096)
    with pytest.raises(ValueError, match="timeout_seconds"):
        cpidx._C.make_peer_communicator(boot, 0, 4096, timeout_seconds=0.0)
    boot.close()


needs_nccl = pytest.mark.skipif(not cpidx.has_nccl, reason="the NCCL communicator is not built")


@needs_nccl
def test_nccl_init_of_a_rank_whose_peer_never_joins_raises_after_its_timeout():
    uid = cpidx._C.nccl_unique_id()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="init_timeout_seconds must be > 0"):
            cpidx._C.make_nccl_communicator(uid, 1, 0, 0, init_timeout_seconds=bad)
    raised = []

    def init_alone():  # rank 0 of 2; rank 1 never calls
        try:
            cpidx._C.make_nccl_communicator(uid, 2, 0, 0, init_timeout_seconds=0.5)
        except RuntimeError as e:
            raised.append(str(e))

    t0 = time.monotonic()
    caller = threading.Thread(target=init_alone, daemon=True)  # a broken deadline fails, not hangs
    caller.start()
    caller.join(timeout=120)
    assert not caller.is_alive(), "the init outlived its deadline by 2 minutes"
    assert len(raised) == 1 and "a rank never joined" in raised[0], raised
    assert time.monotonic() - t0 >= 0.5  # the deadline ended it, not an early failure
    # A world of one on the same device afterwards: the init left on its thread is no obstacle.
    comm = cpidx._C.make_nccl_communicator(cpidx._C.nccl_unique_id(), 1, 0, 0)
    assert (comm.kind, comm.rank, comm.world_size) == ("nccl", 0, 1)
    comm.close()
    assert cpidx._cp.NCCL_INIT_TIMEOUT.total_seconds() == cpidx._C.nccl_init_timeout_seconds


@needs_peer
def test_cp_decode_through_a_closed_communicator_is_named():
    rng = np.random.default_rng(31)
    b = random_decode(rng, 2, 1, [700, 3], max_seq_len=1024)
    q, k, bt, sl = to_dev(b)
    dec = cpidx.Decoder(total_heads=2, world_size=1, rank=0, max_tokens=b.rows, max_seq_len=1024,
                        topk=4, init_blocks=0, local_blocks=1, device=0)
    (boot,) = cpidx._C._thread_communicators(1)
    peer = cpidx._C.make_peer_communicator(boot, 0, 4096)
    out = torch.full((2, b.rows, 4), 5, dtype=torch.int32, device=DEV)
    s = torch.cuda.current_stream().cuda_stream
    dec.cp_decode(peer, q, k, bt, sl, 1, out, scale=b.scale, stream=s)
    want = torch.zeros_like(out)
    cpidx.decode_topk(q, k, bt, sl, 1, want, scale=b.scale, topk=4, max_seq_len=1024)
    assert torch.equal(out, want)
    peer.close()
    with pytest.raises(RuntimeError, match="comm: .*peer, rank 0 of 1.* is closed"):
        dec.cp_decode(peer, q, k, bt, sl, 1, out, scale=b.scale, stream=s)
    boot.close()


@needs_peer
def test_peer_gathers_in_live_graphs_are_counted_and_close_keeps_their_buffers():
    """Two ranks on one GPU, a thread each (refused unless allowed), each capturing a
    context-parallel step: the graphs hold the steps' gathers, counted for both ranks together
    (a replay of either stores into both buffers). A caller that agrees across ranks before
    closing (IndexerCPDecode) is told so (peer_graphs); close() itself does not refuse (one rank
    refusing would leave the others in its collective destructor) and keeps the buffers."""
    rng = np.random.default_rng(41)
    b = random_decode(rng, 2, 1, [900, 40, 300], max_seq_len=1024)
    q, k, bt, sl = to_dev(b)
    boots = cpidx._C._thread_communicators(2)
    peers, graphs, errors, counts = [None, None], [None, None], [], [None, None]
    ready = threading.Barrier(2)

    def rank(r):
        try:
            with pytest.raises(ValueError, match="ranks 0 and 1 share GPU"):
                cpidx._C.make_peer_communicator(boots[r], 0, 1 << 20)  # every rank refuses
            peers[r] = cpidx._C.make_peer_communicator(boots[r], 0, 1 << 20,
                                                       allow_shared_gpu=True)
            dec = cpidx.Decoder(total_heads=2, world_size=2, rank=r, max_tokens=b.rows,
                                max_seq_len=1024, topk=4, init_blocks=0, local_blocks=1, device=0)
            local = q[:, r:r + 1].contiguous()
            out = torch.full((1, b.rows, 4), -5, dtype=torch.int32, device=DEV)
            stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
            ready.wait(timeout=60)  # both set up (a Decoder's creation synchronises the device)
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                dec.cp_decode(peers[r], local, k, bt, sl, 1, out, scale=b.scale,
                              stream=stream.cuda_stream)
                graph.capture_end()
            graphs[r] = (graph, dec, out)
            counts[r] = dec.launches_in_live_graphs()  # the step's pack, scoring, merge: one call
        except BaseException as e:  # noqa: BLE001 - reported below (pytest's Failed included)
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert counts == [1, 1]  # each rank's Decoder: its one captured cp_decode call
    for r in range(2):
        assert peers[r]._gathers_in_live_graphs() == 2  # one query gather a step, both ranks'
        assert "2 of its gathers are in CUDA graphs that are still alive" in \
            peers[r]._close_blocker(peer_graphs=True)
        assert peers[r]._close_blocker() is None
    assert boots[0]._gathers_in_live_graphs() == -1  # a thread communicator: no count
    for r in range(2):
        peers[r].close()  # ranks of one process: no collective; the buffers are kept
        assert peers[r].closed and peers[r]._gathers_in_live_graphs() == -1
    graphs.clear()
    gc.collect()
    for boot in boots:
        boot.close()


def _two_gpu_rank(rank, world, port, results):
    """One process per GPU (gloo only hands out the NCCL id): each exchange's step equals the
    plain decode, close() is idempotent and a later call raises; a with-block left by an
    exception lets go without a collective."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    log = {}
    with process_group(rank, world, port, "gloo"):
        T, Q, K = 4, 2, 16
        rng = np.random.default_rng(11)
        b = random_decode(rng, T, Q, [3000, 129, 0, 2049], max_seq_len=4096)
        q, k, bt, sl = to_dev(b)
        plain = torch.zeros((T, b.rows, K), dtype=torch.int32, device=DEV)
        cpidx.decode_topk(q, k, bt, sl, Q, plain, scale=b.scale, topk=K, max_seq_len=4096)
        kw = dict(total_heads=T, rank=rank, world_size=world, max_tokens=16, max_seq_len=4096,
                  topk=K, init_blocks=0, local_blocks=1, group=dist.group.WORLD,
                  device=torch.device("cuda", rank))
        for exchange in ("auto", "peer", "nccl"):
            try:
                cp = cpidx.IndexerCPDecode(exchange=exchange, **kw)
            except NotImplementedError:  # no P2P between these GPUs: every rank alike
                log[exchange] = "unsupported"
                continue
            L, off = cp.local_heads, cp.head_offset
            local_q = q[:, off: off + L].contiguous()
            out = torch.full((L, b.rows, K), 77, dtype=torch.int32, device=DEV)
            cp(local_q, k, bt, sl, Q, out, scale=b.scale)
            torch.cuda.synchronize()
            same = bool(torch.equal(out, plain[off: off + L]))
            # No rank timed out: 0 through the peer exchange, None (no error word) through NCCL.
            same = same and cp.exchange_error_flag() == (0 if cp.exchange == "peer" else None)
            cp.clear_exchange_error_flag()
            if cp.exchange == "nccl":  # a live graph holding NCCL gathers: close() refuses
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    cp(local_q, k, bt, sl, Q, out, scale=b.scale)
                out.fill_(-5)  # the eager step wrote the same ids: only the replay may now
                graph.replay()
                torch.cuda.synchronize()
                same = same and bool(torch.equal(out, plain[off: off + L]))
                try:
                    cp.close()
                    log["nccl_graph"] = "closed under a live graph"
                except RuntimeError as e:
                    log["nccl_graph"] = "still alive" in str(e) and not cp.closed
                del graph
            cp.close()
            cp.close()
            try:
                cp(local_q, k, bt, sl, Q, out, scale=b.scale)
                refused = False
            except RuntimeError as e:
                refused = "is closed" in str(e)
            log[exchange] = (cp.exchange, same, refused, cp.peer_unavailable_reason)
            log["agreement"] = cp.check_agreement  # the gloo world group: while capturing
        try:
            with cpidx.IndexerCPDecode(**kw) as cp:
                raise KeyError("leave without a collective")
        except KeyError:
            log["abandoned"] = cp.closed
        results[rank] = log


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_indexer_cp_decode_two_processes_each_exchange():
    results = run_ranks(_two_gpu_rank, timeout=240)
    for r in range(2):
        log = results[r]
        chosen, same, refused, reason = log["auto"]
        assert same and refused, log
        if log["peer"] == "unsupported":
            assert chosen == "nccl" and reason, log
        else:
            assert log["peer"][:3] == ("peer", True, True), log
            assert (chosen, reason) == ("peer", None), log
        assert log["nccl"][:3] == ("nccl", True, True), log
        assert log["nccl_graph"] is True, log  # its capture ran the agreement too
        assert log["agreement"] == "captures", log
        assert log["abandoned"], log


def _two_gpu_nccl_group_rank(rank, world, port, results):
    """Over an NCCL-only process group the instance makes its own host group: a step the ranks
    disagree on raises on both, a good one equals the plain decode, close() agrees through it."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    log = {}
    with process_group(rank, world, port, "nccl", device_id=dev):
        T, Q, K = 4, 2, 16
        b = random_decode(np.random.default_rng(31), T, Q, [3000, 129, 0, 2049], max_seq_len=4096)
        q, k, bt, sl = to_dev(b)
        plain = torch.zeros((T, b.rows, K), dtype=torch.int32, device=DEV)
        cpidx.decode_topk(q, k, bt, sl, Q, plain, scale=b.scale, topk=K, max_seq_len=4096)
        cp = cpidx.IndexerCPDecode(total_heads=T, rank=rank, world_size=world, max_tokens=16,
                                   max_seq_len=4096, topk=K, init_blocks=0, local_blocks=1,
                                   group=dist.group.WORLD, device=dev, check_agreement=True)
        log["host"] = (cp.check_agreement, type(cp._host).__name__)
        L, off = cp.local_heads, cp.head_offset
        reqs = 2 if rank == 0 else 3
        out = torch.full((L, reqs * Q, K), 77, dtype=torch.int32, device=DEV)
        try:
            cp(q[:reqs * Q, off: off + L].contiguous(), k, bt[:reqs], sl[:reqs], Q, out,
               scale=b.scale)
            log["rows differ"] = None
        except ValueError as e:
            log["rows differ"] = str(e)
        out = torch.full((L, b.rows, K), 77, dtype=torch.int32, device=DEV)
        cp(q[:, off: off + L].contiguous(), k, bt, sl, Q, out, scale=b.scale)
        torch.cuda.synchronize()
        log["good step"] = bool(torch.equal(out, plain[off: off + L]))
        cp.close()
        log["closed"] = (cp.closed, cp._host)
        results[rank] = log


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_indexer_cp_decode_over_an_nccl_only_group_agrees_through_its_own_host_group():
    results = run_ranks(_two_gpu_nccl_group_rank, timeout=240)
    for r in range(2):
        log = results[r]
        assert log["host"] == ("every step", "ProcessGroupGloo"), log
        assert "the ranks have 4 to 6" in (log["rows differ"] or ""), log
        assert log["good step"] and log["closed"] == (True, None), log
