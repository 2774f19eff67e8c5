"""torch.library registration of the cpidx ops (imported by cpidx when torch is importable).

Destination passing: each op writes into its ``out`` tensors (``mutates_args``) and returns
nothing, so it is allocation-free on the decode path, works inside ``torch.cuda.graph`` (after a
warm-up call has created the decoder) and under ``torch.compile`` (the fake implementations
below describe that nothing new is returned, and check that the tensors share one device).

Every argument is positional and required, ``error_flag`` last (``None``: no flag): torch 2.11
drops a trailing optional argument left at its default before its in-place bookkeeping, which
then fails on a mutable one.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._api import _decode_now, _prefill_now
from ._cp import _by_handle

Tensor = torch.Tensor


def _fake_one_device(op: str, first: str, **tensors: Optional[Tensor]) -> None:
    """The fakes' one check: every tensor on the first one's device. torch runs the fake
    instead of the op when one tensor is a meta tensor, so without it a meta ``out`` among CPU
    tensors, passed to ``torch.ops.cpidx.*`` directly, would write nothing and raise nothing.
    Under torch.compile the fake tensors carry the real devices: a valid call passes."""
    want = tensors[first].device
    for name, t in tensors.items():
        if t is not None and t.device != want:
            raise ValueError(f"{op}: {name} is on {t.device}, {first} on {want}: every tensor "
                             "of a call must be on one device")


@torch.library.custom_op("cpidx::decode_topk", mutates_args=("out", "error_flag"))
def decode_topk(index_query: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                out: Tensor, query_len: int, scale: float, topk: int, init_blocks: int,
                local_blocks: int, max_seq_len: int, max_tokens: int,
                error_flag: Optional[Tensor]) -> None:
    """ids [heads, n, topk] into out (see cpidx.decode_topk); max_tokens 0: automatic."""
    _decode_now(index_query, index_cache, block_table, seq_lens, query_len, out, scale=scale,
                topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                max_seq_len=max_seq_len, max_tokens=max_tokens or None, error_flag=error_flag)


@decode_topk.register_fake
def _decode_topk_fake(index_query, index_cache, block_table, seq_lens, out, query_len, scale,
                      topk, init_blocks, local_blocks, max_seq_len, max_tokens,
                      error_flag) -> None:
    _fake_one_device("cpidx::decode_topk", "index_query", index_query=index_query,
                     index_cache=index_cache, block_table=block_table, seq_lens=seq_lens,
                     out=out, error_flag=error_flag)


@torch.library.custom_op(
    "cpidx::decode_topk_sparse_table",
    mutates_args=("out", "sparse_block_table_out", "sparse_context_lens_out", "error_flag"))
def decode_topk_sparse_table(index_query: Tensor, index_cache: Tensor, block_table: Tensor,
                             seq_lens: Tensor, out: Tensor, query_len: int, scale: float,
                             topk: int, init_blocks: int, local_blocks: int, max_seq_len: int,
                             max_tokens: int, attention_block_table: Tensor,
                             sparse_block_table_out: Tensor, sparse_context_lens_out: Tensor,
                             block_page_stride: int, error_flag: Optional[Tensor]) -> None:
    """decode_topk plus the fused page-16 sparse table (one head; CONTRACT.md section 6)."""
    _decode_now(index_query, index_cache, block_table, seq_lens, query_len, out, scale=scale,
                topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                max_seq_len=max_seq_len, max_tokens=max_tokens or None,
                attention_block_table=attention_block_table,
                sparse_block_table_out=sparse_block_table_out,
                sparse_context_lens_out=sparse_context_lens_out,
                block_page_stride=block_page_stride, error_flag=error_flag)


@decode_topk_sparse_table.register_fake
def _decode_topk_sparse_table_fake(index_query, index_cache, block_table, seq_lens, out,
                                   query_len, scale, topk, init_blocks, local_blocks, max_seq_len,
                                   max_tokens, attention_block_table, sparse_block_table_out,
                                   sparse_context_lens_out, block_page_stride,
                                   error_flag) -> None:
    _fake_one_device("cpidx::decode_topk_sparse_table", "index_query", index_query=index_query,
                     index_cache=index_cache, block_table=block_table, seq_lens=seq_lens,
                     out=out, attention_block_table=attention_block_table,
                     sparse_block_table_out=sparse_block_table_out,
                     sparse_context_lens_out=sparse_context_lens_out, error_flag=error_flag)


@torch.library.custom_op("cpidx::prefill_topk", mutates_args=("out", "error_flag"))
def prefill_topk(index_query: Tensor, index_cache: Tensor, block_table: Tensor,
                 cu_seqlens_q: Tensor, context_lens: Tensor, seq_lens: Tensor, out: Tensor,
                 scale: float, topk: int, init_blocks: int, local_blocks: int, max_seq_len: int,
                 max_tokens: int, error_flag: Optional[Tensor]) -> None:
    """ids [heads, tokens, topk] into out (see cpidx.prefill_topk)."""
    _prefill_now(index_query, index_cache, block_table, cu_seqlens_q, context_lens, seq_lens, out,
                 scale=scale, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                 max_seq_len=max_seq_len, max_tokens=max_tokens or None, error_flag=error_flag)


@prefill_topk.register_fake
def _prefill_topk_fake(index_query, index_cache, block_table, cu_seqlens_q, context_lens,
                       seq_lens, out, scale, topk, init_blocks, local_blocks, max_seq_len,
                       max_tokens, error_flag) -> None:
    _fake_one_device("cpidx::prefill_topk", "index_query", index_query=index_query,
                     index_cache=index_cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                     context_lens=context_lens, seq_lens=seq_lens, out=out, error_flag=error_flag)


@torch.library.custom_op(
    "cpidx::cp_decode",
    mutates_args=("out", "sparse_block_table_out", "sparse_context_lens_out", "error_flag"))
def cp_decode(handle: int, local_q: Tensor, kv_cache: Tensor, block_table: Tensor,
              seq_lens: Tensor, out: Tensor, query_len: int, scale: float,
              attention_block_table: Optional[Tensor], sparse_block_table_out: Optional[Tensor],
              sparse_context_lens_out: Optional[Tensor], block_page_stride: Optional[int],
              error_flag: Optional[Tensor]) -> None:
    """An IndexerCPDecode's step, ``cp(local_q, ...)``, by its ``handle`` (``cp.handle``): one
    op that torch.compile keeps whole (its collectives and its agreement run inside it), so a
    compiled model keeps the context-parallel path instead of falling back to the plain decode
    as the seed does under compile. Every rank's compiled graph calls it in the same order, also
    where nothing reads what it wrote (marked side-effecting below)."""
    _by_handle(handle)(local_q, kv_cache, block_table, seq_lens, query_len, out, scale=scale,
                       attention_block_table=attention_block_table,
                       sparse_block_table_out=sparse_block_table_out,
                       sparse_context_lens_out=sparse_context_lens_out,
                       block_page_stride=block_page_stride, error_flag=error_flag)


@cp_decode.register_fake
def _cp_decode_fake(handle, local_q, kv_cache, block_table, seq_lens, out, query_len, scale,
                    attention_block_table, sparse_block_table_out, sparse_context_lens_out,
                    block_page_stride, error_flag) -> None:
    _fake_one_device("cpidx::cp_decode", "local_q", local_q=local_q, kv_cache=kv_cache,
                     block_table=block_table, seq_lens=seq_lens, out=out,
                     attention_block_table=attention_block_table,
                     sparse_block_table_out=sparse_block_table_out,
                     sparse_context_lens_out=sparse_context_lens_out, error_flag=error_flag)


# The step's collectives (and its agreement) are a side effect the schema does not show: a graph
# that never reads the op's outputs (a rank that discards its ids, say) would otherwise drop the
# op as dead code (AOT autograd and Inductor do), so that rank skips the collectives the others
# wait in. The set is what torch.fx's is_impure reads, for the op wrapped in auto_functionalized
# too (torch.library's effect tokens did not keep it under aot_eager, torch 2.11).
torch.fx.node.has_side_effect(torch.ops.cpidx.cp_decode.default)
