"""An engine-shaped indexer layer on cpidx: a mixed batch's decode rows go through the
context-parallel decode (IndexerCPDecode, shared by every layer), its prefill rows through the
plain prefill, with the seed's fallbacks; then the decode rows again under torch.compile (the
step as one op). Checks every rank against the single-GPU result.

    torchrun --nproc_per_node=2 examples/indexer_layer.py      # one GPU per rank: the peer
                                                               # exchange, else NCCL; also
                                                               # captures the decode in a CUDA
                                                               # graph and replays new lengths
    torchrun --nproc_per_node=2 examples/indexer_layer.py --exchange nccl   # (or peer, torch)
    python examples/indexer_layer.py                           # one process (CPU smoke run
                                                               # without a GPU)
    torchrun --nproc_per_node=2 examples/indexer_layer.py --device cpu   # gloo, C++ reference

Exit code 0 when every comparison holds. The shared IndexerCPDecode is closed at the end (every
rank together, before the process group goes).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import cpidx

BS = cpidx.BLOCK_SIZE


@dataclass
class DecodeMeta:
    block_table: torch.Tensor  # [num_decodes, >= G] int32
    seq_lens: torch.Tensor  # [num_decodes] int32
    query_len: int
    max_seq_len: int  # longest request of this batch (0: nothing to score)


@dataclass
class PrefillMeta:
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    context_lens: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class IndexerMeta:
    num_decode_tokens: int
    num_prefill_tokens: int
    decode: Optional[DecodeMeta]
    prefill: Optional[PrefillMeta]


class IndexerLayer:
    """One sparse layer's indexer: this rank's index heads, top-K block ids for a mixed batch."""

    def __init__(self, *, total_heads, rank, world_size, group, device, max_tokens,
                 max_batched_tokens, max_model_len, topk=16, init_blocks=0, local_blocks=1,
                 scale=128 ** -0.5, exchange="auto"):
        self.topk, self.init_blocks, self.local_blocks = topk, init_blocks, local_blocks
        self.scale, self.max_model_len = scale, max_model_len
        # One instance per rank and geometry, shared by every layer (the seed's design).
        self.cp_decode = cpidx.get_shared_cp_decode(
            total_heads=total_heads, rank=rank, world_size=world_size, max_tokens=max_tokens,
            max_seq_len=max_model_len, topk=topk, init_blocks=init_blocks,
            local_blocks=local_blocks, group=group, device=device, exchange=exchange)
        self.num_index_heads = self.cp_decode.local_heads
        # The model's shared top-K buffer [L, max_batched_tokens, K]: decode rows first, then
        # prefill tokens (max_tokens bounds the decode rows only).
        self.topk_indices_buffer = torch.empty((self.num_index_heads, max_batched_tokens, topk),
                                               dtype=torch.int32, device=device)
        # Bad lengths or block-table entries are clamped on the device, never read out of
        # bounds; every call of this layer ORs its bits in here (stream-ordered, captured with
        # the graph): one flag per layer. Read it when convenient (a sync).
        self.device_errors = torch.zeros(1, dtype=torch.int32, device=device)

    def _sel(self):
        return dict(scale=self.scale, topk=self.topk, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks, max_seq_len=self.max_model_len)

    def read_device_errors(self) -> int:
        """cpidx.ERR_* bits of every step since the last call (a blocking read), then clears."""
        bits = int(self.device_errors.item())
        self.device_errors.zero_()
        return bits

    def forward(self, index_query, kv, md: IndexerMeta):
        nd, npf = md.num_decode_tokens, md.num_prefill_tokens
        iq = index_query[: nd + npf].view(-1, self.num_index_heads, cpidx.HEAD_DIM)
        buf = self.topk_indices_buffer
        decode_topk = prefill_topk = None
        if nd > 0:
            d = md.decode
            decode_topk = buf[:, :nd]
            # The seed's fallbacks: with nothing to score, or with no usable cache, run the plain
            # (per-rank) decode. Under torch.compile the step is one op the compiler keeps whole
            # (the seed falls back to the plain decode there: its collective cannot be traced).
            if d.max_seq_len == 0 or kv.ndim != 3 or kv.numel() == 0:
                cpidx.decode_topk(iq[:nd], kv, d.block_table, d.seq_lens, d.query_len,
                                  decode_topk, error_flag=self.device_errors, **self._sel())
            elif torch.compiler.is_compiling():
                torch.ops.cpidx.cp_decode(self.cp_decode.handle, iq[:nd], kv, d.block_table,
                                          d.seq_lens, decode_topk, d.query_len, self.scale, None,
                                          None, None, None, self.device_errors)
            else:
                self.cp_decode(iq[:nd], kv, d.block_table, d.seq_lens, d.query_len, decode_topk,
                               scale=self.scale, error_flag=self.device_errors)
        if npf > 0:
            p = md.prefill
            prefill_topk = buf[:, nd: nd + npf]
            cpidx.prefill_topk(iq[nd:], kv, p.block_table, p.cu_seqlens_q, p.context_lens,
                               p.seq_lens, prefill_topk, error_flag=self.device_errors,
                               **self._sel())
        return decode_topk, prefill_topk


def synthetic_batch(gen, device, *, total_heads, decode_lens, query_len, prefill_q, prefill_ctx,
                    max_model_len):
    """The same batch on every rank (same generator seed): all heads' queries, a shared cache."""
    G = -(-max_model_len // BS)
    reqs = len(decode_lens) + len(prefill_q)
    pages = reqs * G + 1
    cache = torch.randn((pages, BS, cpidx.HEAD_DIM), generator=gen).to(torch.bfloat16)
    bt = torch.randperm(pages, generator=gen)[: reqs * G].view(reqs, G).int()
    nd, npf = len(decode_lens) * query_len, sum(prefill_q)
    q = torch.randn((nd + npf, total_heads, cpidx.HEAD_DIM), generator=gen).to(torch.bfloat16)
    to = lambda t: t.to(device)  # noqa: E731
    k = len(decode_lens)
    decode = DecodeMeta(to(bt[:k]), to(torch.tensor(decode_lens, dtype=torch.int32)), query_len,
                        max(decode_lens))
    cu = torch.tensor([0] + list(torch.tensor(prefill_q).cumsum(0)), dtype=torch.int32)
    prefill = PrefillMeta(to(bt[k:]), to(cu), to(torch.tensor(prefill_ctx, dtype=torch.int32)),
                          to(torch.tensor([c + n for c, n in zip(prefill_ctx, prefill_q)],
                                          dtype=torch.int32)))
    return to(q), to(cache), IndexerMeta(nd, npf, decode, prefill)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exchange", choices=("auto", "peer", "nccl", "torch"), default="auto",
                    help="the context-parallel step's all-gathers (auto: peer, else NCCL, else "
                         "torch)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of step 2 (default: inductor on CUDA, eager on "
                         "the CPU, which needs no C++ toolchain)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = args.device == "cuda"
    if args.compile_backend is None:
        args.compile_backend = "inductor" if cuda else "eager"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                device_id=device if cuda else None)
        group = dist.group.WORLD

    T, Q, K, msl = args.heads, 2, 16, args.max_model_len
    max_tokens = 64
    layer = IndexerLayer(total_heads=T, rank=rank, world_size=world, group=group, device=device,
                         max_tokens=max_tokens, max_batched_tokens=1024, max_model_len=msl,
                         topk=K, exchange=args.exchange)
    cp = layer.cp_decode
    if rank == 0:
        why = f" (peer unavailable: {cp.peer_unavailable_reason})" \
            if cp.peer_unavailable_reason else ""
        print(f"exchange: {cp.exchange} (asked: {args.exchange}){why}", flush=True)
    L, off = layer.num_index_heads, layer.cp_decode.head_offset
    gen = torch.Generator().manual_seed(args.seed)
    q_all, kv, md = synthetic_batch(gen, device, total_heads=T,
                                    decode_lens=[msl - 7, 129, 1, 0, 40000, 3000], query_len=Q,
                                    prefill_q=[300, 5], prefill_ctx=[1024, 0], max_model_len=msl)
    sel = dict(scale=layer.scale, topk=K, init_blocks=0, local_blocks=1, max_seq_len=msl)
    ok = True

    # 1. The mixed batch through the layer (this rank's heads) vs the single-GPU result.
    dec, pre = layer.forward(q_all[:, off: off + L].contiguous(), kv, md)
    nd, npf = md.num_decode_tokens, md.num_prefill_tokens
    want_d = torch.zeros((T, nd, K), dtype=torch.int32, device=device)
    cpidx.decode_topk(q_all[:nd], kv, md.decode.block_table, md.decode.seq_lens, Q, want_d, **sel)
    p = md.prefill
    want_p = torch.zeros((T, npf, K), dtype=torch.int32, device=device)
    cpidx.prefill_topk(q_all[nd:], kv, p.block_table, p.cu_seqlens_q, p.context_lens,
                       p.seq_lens, want_p, **sel)
    same_d = torch.equal(dec, want_d[off: off + L])
    same_p = torch.equal(pre, want_p[off: off + L])
    ok &= same_d and same_p
    print(f"rank {rank}/{world} heads {off}-{off + L - 1} exchange={layer.cp_decode.exchange}: "
          f"decode {nd} rows {'==' if same_d else '!='} single-GPU, prefill {npf} tokens "
          f"{'==' if same_p else '!='} single-GPU", flush=True)

    # 2. The layer under torch.compile, decode rows only: its context-parallel step is one op
    # (torch.ops.cpidx.cp_decode), kept whole by the compiler, collectives inside.
    decode_only = IndexerMeta(nd, 0, md.decode, None)
    compiled = torch.compile(layer.forward, backend=args.compile_backend)
    layer.topk_indices_buffer.fill_(-7)  # step 1's ids gone: only this call may write them
    got, _ = compiled(q_all[:nd, off: off + L].contiguous(), kv, decode_only)
    same_c = torch.equal(got, want_d[off: off + L])
    ok &= same_c
    print(f"rank {rank}: compiled ({args.compile_backend}) decode "
          f"{'==' if same_c else '!='} single-GPU", flush=True)

    # 3. CUDA graph of the decode part, replayed with new lengths, block tables and queries.
    if cuda:
        d = md.decode
        static_q = q_all[:nd, off: off + L].contiguous()
        decode_md = IndexerMeta(nd, 0, d, None)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer.forward(static_q, kv, decode_md)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out, _ = layer.forward(static_q, kv, decode_md)
        for step in range(3):
            lens = torch.randint(0, msl + 1, (len(d.seq_lens),), generator=gen, dtype=torch.int32)
            lens[step] = 0  # a padding request
            d.seq_lens.copy_(lens)
            d.block_table.copy_(torch.randint(0, kv.shape[0], d.block_table.shape, generator=gen,
                                              dtype=torch.int32))
            new_q = torch.randn((nd, T, cpidx.HEAD_DIM), generator=gen).to(torch.bfloat16)
            static_q.copy_(new_q[:, off: off + L])
            graph.replay()
            want = torch.zeros((T, nd, K), dtype=torch.int32, device=device)
            cpidx.decode_topk(new_q.to(device), kv, d.block_table, d.seq_lens, Q, want, **sel)
            same = torch.equal(graph_out, want[off: off + L])
            ok &= same
            print(f"rank {rank}: graph replay {step} (seq_lens {lens.tolist()}) "
                  f"{'==' if same else '!='} single-GPU", flush=True)

    # The batches were valid: no value was clamped on the device (a blocking read).
    errors = layer.read_device_errors()
    if errors:
        print(f"rank {rank}: device error bits {errors} (cpidx.ERR_*): bad lengths or block "
              f"tables were clamped", flush=True)
        ok = False
    # A peer exchange raises PEER_ERROR_TIMEOUT here once a rank gave up waiting for a peer (a
    # blocking read: after the replays, never inside a capture); NCCL and torch report None.
    bits = cp.exchange_error_flag()
    if bits:
        print(f"rank {rank}: exchange error bits {bits}: recreate every rank's instance",
              flush=True)
        ok = False
    if world > 1:
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    # Collective (every rank gets here): the peer communicator, then the NCCL one. Graphs that
    # captured the step go first: NCCL's communicator destroy waits for every live graph that
    # holds one of its kernels (with exchange=nccl it would never return).
    if cuda:
        del graph, graph_out
        torch.cuda.synchronize()
    cp.close()
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        print("indexer_layer: OK" if ok else "indexer_layer: MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
