"""The host path (numpy -> C++ reference) against the golden cases, an independent numpy oracle,
and the context-parallel halves; every bad argument raises an error naming it. Needs no GPU and
no torch."""
from __future__ import annotations

import copy

import numpy as np
from numpy.lib.stride_tricks import as_strided
import pytest

import cpidx
from cpidx import _C
from helpers import golden_cases, golden_decode, golden_inputs, oracle_decode, random_decode, \
    splitmix_values


def run_decode(b, topk, init, local, heads=None, **kw):
    q = b.query if heads is None else b.query[:, heads, :]
    out = np.full((q.shape[1], b.rows, topk), 12345, dtype=np.int32)
    res = cpidx.decode_topk(q, b.cache, b.block_table, b.seq_lens, b.query_len, out,
                            scale=b.scale, topk=topk, init_blocks=init, local_blocks=local,
                            max_seq_len=b.max_seq_len, **kw)
    assert res is out
    return out


def test_golden_stream_first_value():
    assert splitmix_values(0, 1)[0] == 6


def test_bf16_round_trip():
    x = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, np.inf, 1 + 2 ** -8, 1 + 3 * 2 ** -8],
                 dtype=np.float32)
    bits = cpidx.bf16_bits(x)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(cpidx.bf16_to_float32(bits)[:6], x[:6])
    assert cpidx.bf16_to_float32(bits)[6] == 1.0  # tie rounds to even
    assert cpidx.bf16_to_float32(bits)[7] == 1 + 2 ** -6 - 2 ** -7 + 2 ** -7  # 1.015625
    assert np.isnan(cpidx.bf16_to_float32(cpidx.bf16_bits(np.float32("nan"))))


@pytest.mark.parametrize("case", golden_cases("decode"), ids=lambda c: f"seed{c['seed']}")
def test_golden_decode(case):
    b = golden_decode(case)
    out = run_decode(b, case["K"], case["init"], case["local"])
    np.testing.assert_array_equal(out, np.array(case["ids"], dtype=np.int32))


@pytest.mark.parametrize("case", golden_cases("decode")[:4], ids=lambda c: f"seed{c['seed']}")
def test_golden_decode_float32_inputs(case):
    """float32 host arrays are rounded to bf16 by the wrapper (exact for the golden values)."""
    b = golden_decode(case)
    b.query = cpidx.bf16_to_float32(b.query)
    b.cache = cpidx.bf16_to_float32(b.cache)
    out = run_decode(b, case["K"], case["init"], case["local"])
    np.testing.assert_array_equal(out, np.array(case["ids"], dtype=np.int32))


@pytest.mark.parametrize("case", golden_cases("prefill"), ids=lambda c: f"seed{c['seed']}")
def test_golden_prefill(case):
    q_lens = case["q_lens"]
    rows = sum(q_lens)
    query, cache, bt, max_seq_len = golden_inputs(case["seed"], case["T"], rows,
                                                  case["seq_lens"])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = np.full((case["T"], rows, case["K"]), 7, dtype=np.int32)
    res = cpidx.prefill_topk(query, cache, bt, cu, np.array(case["context_lens"], np.int32),
                             np.array(case["seq_lens"], np.int32), out, scale=case["scale"],
                             topk=case["K"], init_blocks=case["init"],
                             local_blocks=case["local"], max_seq_len=max_seq_len)
    assert res is out
    np.testing.assert_array_equal(out, np.array(case["ids"], dtype=np.int32))


@pytest.mark.parametrize("case", golden_cases("sparse_table"),
                         ids=lambda c: f"seed{c['from_seed']}-stride{c['block_page_stride']}")
def test_golden_sparse_table(case):
    src = next(c for c in golden_cases("decode") if c["seed"] == case["from_seed"])
    b = golden_decode(src)
    K, G = case["K"], b.block_table.shape[1]
    attn = np.array([[1000 + 37 * req + blk for blk in range(G)]
                     for req in range(len(b.seq_lens))], dtype=np.int32)
    table = np.full((b.rows, K * 8), -5, dtype=np.int32)
    ctx = np.full((b.rows,), -5, dtype=np.int32)
    out = run_decode(b, K, src["init"], src["local"], heads=slice(case["head"], case["head"] + 1),
                     attention_block_table=attn, sparse_block_table_out=table,
                     sparse_context_lens_out=ctx, block_page_stride=case["block_page_stride"])
    np.testing.assert_array_equal(out[0], np.array(src["ids"][case["head"]], dtype=np.int32))
    np.testing.assert_array_equal(table, np.array(case["table"], dtype=np.int32))
    np.testing.assert_array_equal(ctx, np.array(case["context_lens"], dtype=np.int32))


@pytest.mark.parametrize("T,Q,seq_lens,K,init,local", [
    (4, 1, [1, 128, 129, 0, 700], 8, 0, 1),
    (2, 3, [300, 3, 1025], 4, 1, 2),
    (1, 2, [2000], 16, 2, 0),
    (8, 1, [513, 260], 6, 0, 1),
])
def test_reference_matches_numpy_oracle(T, Q, seq_lens, K, init, local):
    rng = np.random.default_rng(sum(seq_lens) + T)
    b = random_decode(rng, T, Q, seq_lens, max_seq_len=2048)
    np.testing.assert_array_equal(run_decode(b, K, init, local), oracle_decode(b, K, init, local))


def test_strided_query_and_output():
    """Row/head strides are free (last dim contiguous): a head slice and a strided out view."""
    rng = np.random.default_rng(3)
    b = random_decode(rng, 4, 2, [900, 40, 300], max_seq_len=1024)
    full = run_decode(b, 8, 0, 1)
    row_major = np.full((b.rows, 3, 8), -9, dtype=np.int32)  # out[h, row] = row_major[row, h]
    cpidx.decode_topk(b.query[:, 1:3, :], b.cache, b.block_table, b.seq_lens, b.query_len,
                      row_major[:, :2, :].transpose(1, 0, 2), scale=b.scale, topk=8,
                      init_blocks=0, local_blocks=1, max_seq_len=b.max_seq_len)
    np.testing.assert_array_equal(row_major[:, :2, :].transpose(1, 0, 2), full[1:3])
    assert (row_major[:, 2] == -9).all()


@pytest.mark.parametrize("T,P", [(4, 1), (4, 2), (4, 4), (4, 8), (2, 8), (1, 2)])
def test_context_parallel_halves_equal_plain(T, P):
    """Every rank's shard keys, gathered in Python and merged, give the plain ids (CONTRACT 5)."""
    rng = np.random.default_rng(T * 10 + P)
    b = random_decode(rng, T, 2, [1500, 129, 0, 640], max_seq_len=1536)
    K, init, local = 6, 1, 1
    plain = run_decode(b, K, init, local)
    sel = dict(topk=K, init_blocks=init, local_blocks=local, max_seq_len=b.max_seq_len)
    gathered = np.zeros((P, T, b.rows, K), dtype=np.int64)
    for r in range(P):
        _C.ref_shard_topk_keys(b.query, b.cache, b.block_table, b.seq_lens, b.query_len,
                               gathered[r], scale=b.scale, world_size=P, rank=r, **sel)
    L, R = (T // P, 1) if T >= P else (1, P // T)
    for r in range(P):
        off = (r // R) * L
        out = np.full((L, b.rows, K), 99, dtype=np.int32)
        _C.ref_merge_topk_keys(gathered, b.seq_lens, b.query_len, out, head_offset=off, **sel)
        np.testing.assert_array_equal(out, plain[off: off + L])


def test_fp8_cache_as_uint8_bits():
    rng = np.random.default_rng(5)
    b = random_decode(rng, 2, 1, [700, 300], max_seq_len=768)
    # e4m3 bits of -1, 0, +1 (exact in bf16 too): same ids as the bf16 cache.
    vals = cpidx.bf16_to_float32(b.cache)
    signs = np.clip(vals, -1, 1).astype(np.int64)
    b.cache = cpidx.bf16_bits(signs.astype(np.float32))
    want = run_decode(b, 8, 0, 1)
    b.cache = np.choose(signs + 1, [np.uint8(0xB8), np.uint8(0x00), np.uint8(0x38)]).astype(
        np.uint8)
    np.testing.assert_array_equal(run_decode(b, 8, 0, 1), want)


# ---- bad arguments: each raises ValueError / TypeError naming the argument ------------------
def _valid():
    rng = np.random.default_rng(11)
    b = random_decode(rng, 2, 2, [300, 5], max_seq_len=512)
    K = 4
    return dict(
        index_query=b.query, index_cache=b.cache, block_table=b.block_table,
        seq_lens=b.seq_lens, query_len=2, out=np.zeros((2, b.rows, K), np.int32), scale=0.5,
        topk=K, init_blocks=0, local_blocks=1, max_seq_len=512)


def _table(kw, width_minus=0, ctx_len=None, stride=8):
    rows = kw["index_query"].shape[0]
    kw["index_query"] = kw["index_query"][:, :1, :]
    kw["out"] = kw["out"][:1]
    kw["attention_block_table"] = np.zeros((2, 4), np.int32)
    kw["sparse_block_table_out"] = np.zeros((rows, kw["topk"] * 8 - width_minus), np.int32)
    kw["sparse_context_lens_out"] = np.zeros((ctx_len or rows,), np.int32)
    kw["block_page_stride"] = stride
    return kw


def _out_on(kw, name, out="out"):
    """Puts kw[out] in one buffer with kw[name], its first element on name's last."""
    src, dst = kw[name], kw[out]
    buf = np.zeros(src.size + dst.size, np.int32)
    buf[:src.size] = src.ravel()
    kw[name] = buf[:src.size].reshape(src.shape)
    kw[out] = buf[src.size - 1:src.size - 1 + dst.size].reshape(dst.shape)
    return kw


BAD = {
    "seq_lens_int64": (lambda k: k.update(seq_lens=k["seq_lens"].astype(np.int64)), TypeError,
                       "seq_lens: expected int32, got int64"),
    "seq_lens_2d": (lambda k: k.update(seq_lens=k["seq_lens"][None]), ValueError, "seq_lens"),
    "seq_lens_strided": (lambda k: k.update(seq_lens=np.repeat(k["seq_lens"], 2)[::2]),
                         ValueError, "seq_lens"),
    "block_table_int64": (lambda k: k.update(block_table=k["block_table"].astype(np.int64)),
                          TypeError, "block_table: expected int32"),
    "block_table_narrow": (lambda k: k.update(block_table=k["block_table"][:, :3]), ValueError,
                           "block_table"),
    "block_table_fortran": (lambda k: k.update(block_table=np.asfortranarray(k["block_table"])),
                            ValueError, "block_table"),
    "block_table_rows": (lambda k: k.update(block_table=k["block_table"][:1]), ValueError,
                         "block_table"),
    "index_query_int32": (lambda k: k.update(index_query=k["index_query"].astype(np.int32)),
                          TypeError, "index_query: expected bfloat16"),
    "index_query_head_dim": (lambda k: k.update(index_query=k["index_query"][:, :, :64]),
                             ValueError, "index_query"),
    "index_query_rows": (lambda k: k.update(index_query=k["index_query"][:3]), ValueError,
                         "index_query, seq_lens: index_query has 3 rows"),
    "seq_lens_short": (lambda k: k.update(seq_lens=k["seq_lens"][:1]), ValueError,
                       "index_query, seq_lens: index_query has 4 rows (shape "),
    "index_query_2d": (lambda k: k.update(index_query=k["index_query"][:, 0, :]), ValueError,
                       "index_query"),
    "index_query_strided_dim": (
        lambda k: k.update(index_query=np.repeat(k["index_query"], 2, axis=2)[:, :, ::2]),
        ValueError, "index_query"),
    "index_query_too_many_heads": (
        lambda k: k.update(index_query=np.repeat(k["index_query"], 5, axis=1),
                           out=np.zeros((10, 4, 4), np.int32)), ValueError, "index_query"),
    "index_cache_int32": (lambda k: k.update(index_cache=k["index_cache"].astype(np.int32)),
                          TypeError, "index_cache"),
    "index_cache_shape": (lambda k: k.update(index_cache=k["index_cache"][:, :64, :]), ValueError,
                          "index_cache"),
    "index_cache_strided": (
        lambda k: k.update(index_cache=np.repeat(k["index_cache"], 2, axis=0)[::2]), ValueError,
        "index_cache"),
    "out_int64": (lambda k: k.update(out=k["out"].astype(np.int64)), TypeError,
                  "out: expected int32"),
    "out_shape": (lambda k: k.update(out=k["out"][:, :, :3]), ValueError, "out: expected shape"),
    "out_heads": (lambda k: k.update(out=k["out"][:1]), ValueError, "out"),
    "out_strided_last": (lambda k: k.update(out=np.zeros((2, 4, 8), np.int32)[:, :, ::2]),
                         ValueError, "out"),
    "query_len_0": (lambda k: k.update(query_len=0), ValueError, "query_len"),
    "query_len_9": (lambda k: k.update(query_len=9), ValueError, "query_len"),
    "scale_0": (lambda k: k.update(scale=0.0), ValueError, "scale"),
    "scale_nan": (lambda k: k.update(scale=float("nan")), ValueError, "scale"),
    "topk_0": (lambda k: k.update(topk=0), ValueError, "topk"),
    "topk_65": (lambda k: k.update(topk=65), ValueError, "topk"),
    "init_negative": (lambda k: k.update(init_blocks=-1), ValueError, "init_blocks"),
    "local_negative": (lambda k: k.update(local_blocks=-1), ValueError, "local_blocks"),
    "max_seq_len_0": (lambda k: k.update(max_seq_len=0), ValueError, "max_seq_len"),
    "table_partial": (lambda k: (_table(k), k.pop("block_page_stride"),
                                 k.pop("sparse_context_lens_out")), ValueError,
                      "missing sparse_context_lens_out, block_page_stride"),
    "table_page_stride": (lambda k: _table(k, stride=4), ValueError, "block_page_stride"),
    "table_narrow": (lambda k: _table(k, width_minus=1), ValueError, "sparse_block_table_out"),
    "table_ctx_len": (lambda k: _table(k, ctx_len=3), ValueError, "sparse_context_lens_out"),
    "table_two_heads": (lambda k: (_table(k), k.update(index_query=k["index_query"].repeat(2, 1),
                                                       out=np.zeros((2, 4, 4), np.int32))),
                        ValueError, "one index head"),
    "out_on_seq_lens": (lambda k: _out_on(k, "seq_lens"), ValueError,
                        "ids output (out) and seq_lens share memory"),
    "table_on_attention_block_table": (
        lambda k: _out_on(_table(k), "attention_block_table", "sparse_block_table_out"),
        ValueError,
        "sparse table (sparse_block_table_out) and attention_block_table share memory"),
    "out_read_only": (lambda k: k["out"].setflags(write=False), ValueError,
                      "out: expected a writeable array, got a read-only one"),
    "table_read_only": (lambda k: _table(k)["sparse_context_lens_out"].setflags(write=False),
                        ValueError, "sparse_context_lens_out: expected a writeable array"),
    "table_block_read_only": (
        lambda k: _table(k)["sparse_block_table_out"].setflags(write=False), ValueError,
        "sparse_block_table_out: expected a writeable array"),
    "seq_lens_big_endian": (lambda k: k.update(seq_lens=k["seq_lens"].astype(">i4")), TypeError,
                            "seq_lens: expected the machine's byte order, got dtype >i4"),
    "table_attn_int64": (
        lambda k: (_table(k), k.update(
            attention_block_table=k["attention_block_table"].astype(np.int64))),
        TypeError, "attention_block_table"),
}


def test_valid_arguments_pass():
    kw = _valid()
    want = cpidx.decode_topk(**kw).copy()
    kw = _table(_valid())
    cpidx.decode_topk(**kw)
    # Only the outputs must be writeable: read-only inputs are accepted.
    kw = _valid()
    for name in ("index_query", "index_cache", "block_table", "seq_lens"):
        kw[name].setflags(write=False)
    np.testing.assert_array_equal(cpidx.decode_topk(**kw), want)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_argument_is_named(name):
    mutate, exc, text = BAD[name]
    kw = _valid()
    mutate(kw)
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)")):
        cpidx.decode_topk(**kw)


def _strided(a, strides):
    """A view of ``a`` (same shape) with the given strides in elements."""
    return as_strided(a, a.shape, [s * a.itemsize for s in strides])


# Each message in full, its argument named first: a check that lets a bad argument through to a
# later check (or to the library's own, which names its fields instead) changes it.
NAMED = {
    "seq_lens_2d": (lambda k: k.update(seq_lens=k["seq_lens"][None]), ValueError,
                    r"^seq_lens: expected 1 dims \[num_reqs\], got shape \[1, 2\]$"),
    "seq_lens_empty": (
        lambda k: k.update(seq_lens=k["seq_lens"][:0], index_query=k["index_query"][:0],
                           out=k["out"][:, :0]), ValueError,
        r"^seq_lens: expected 1 to INT_MAX requests, got shape \[0\]$"),
    "seq_lens_past_int_max": (  # 2^31 requests claimed over the real two: named, never read
        lambda k: k.update(seq_lens=as_strided(k["seq_lens"], (2**31,), (4,))), ValueError,
        r"^seq_lens: expected 1 to INT_MAX requests, got shape \[2147483648\]$"),
    "out_4d": (lambda k: k.update(out=k["out"][..., None]), ValueError,
               r"^out: expected 3 dims \[heads, tokens, topk\], got shape \[2, 4, 4, 1\]$"),
    "out_wider_than_topk": (lambda k: k.update(out=np.zeros((2, 4, 5), np.int32)), ValueError,
                            r"^out: expected shape \[2, 4, 4\], got \[2, 4, 5\]$"),
    "seq_lens_uint32": (lambda k: k.update(seq_lens=k["seq_lens"].astype(np.uint32)), TypeError,
                        "^seq_lens: expected int32, got uint32$"),
    "out_float32": (lambda k: k.update(out=k["out"].astype(np.float32)), TypeError,
                    "^out: expected int32, got float32$"),
    "index_query_int16": (
        lambda k: k.update(index_query=k["index_query"].view(np.int16)), TypeError,
        r"^index_query: expected bfloat16 \(or uint16 holding bf16 bits\), got int16$"),
    "index_query_head_dim_256": (
        lambda k: k.update(index_query=np.repeat(k["index_query"], 2, axis=2)), ValueError,
        r"^index_query: expected head dim 128 \(shape \[tokens, heads, 128\]\), got shape "
        r"\[4, 2, 256\]$"),
    "index_query_heads_overlap": (
        lambda k: k.update(index_query=_strided(k["index_query"], (256, 64, 1))), ValueError,
        "^index_query: rows and heads must not overlap: expected strides >= 128, got row "
        "stride 256 and head stride 64$"),
    "index_query_rows_overlap": (
        lambda k: k.update(index_query=_strided(k["index_query"], (64, 256, 1))), ValueError,
        "^index_query: rows and heads must not overlap: expected strides >= 128, got row "
        "stride 64 and head stride 256$"),
    "out_rows_stride_0": (lambda k: k.update(out=_strided(k["out"], (16, 0, 1))), ValueError,
                          "^out: expected a positive stride in dim 1, got 0$"),
    "out_rows_reversed": (lambda k: k.update(out=k["out"][:, ::-1]), ValueError,
                          "^out: expected a positive stride in dim 1, got -4$"),
    "block_table_rows_overlap": (  # 4 columns are read (512 tokens); rows 3 apart
        lambda k: k.update(block_table=_strided(k["block_table"], (3, 1))), ValueError,
        "^block_table: rows must not overlap: expected a row stride >= 4, got 3$"),
    "out_heads_over_rows": (  # [2, 4, 4] with heads 8 apart: head 1 starts at row 2 of head 0
        lambda k: k.update(out=_strided(k["out"], (8, 4, 1))), ValueError,
        r"^out: heads and tokens must not overlap: expected a row stride >= topk and a head "
        r"stride >= tokens \* row stride \(or a head stride >= topk and a row stride >= heads "
        r"\* head stride\), got strides \[8, 4, 1\]$"),
    "out_rows_over_lists": (
        lambda k: k.update(out=_strided(k["out"], (16, 3, 1))), ValueError,
        r"^out: heads and tokens must not overlap: .*, got strides \[16, 3, 1\]$"),
    "block_table_rows_reversed": (
        lambda k: k.update(block_table=k["block_table"][::-1]), ValueError,
        "^block_table: expected a positive stride in dim 0, got -6$"),
    "index_cache_no_pages": (
        lambda k: k.update(index_cache=k["index_cache"][:0]), ValueError,
        r"^index_cache: expected shape \[pages >= 1, 128, 128\], got \[0, 128, 128\]$"),
    "index_cache_head_dim_64": (
        lambda k: k.update(index_cache=k["index_cache"][:, :, :64]), ValueError,
        r"^index_cache: expected shape \[pages >= 1, 128, 128\], got \[11, 128, 64\]$"),
    "index_cache_strided_last": (  # 5 pages' view: stays within the 11 pages' buffer
        lambda k: k.update(index_cache=_strided(k["index_cache"][:5], (16384, 128, 2))),
        ValueError, r"^index_cache: expected a contiguous cache, got strides \[16384, 128, 2\]$"),
    "index_cache_two_pages_apart": (
        lambda k: k.update(index_cache=_strided(k["index_cache"][:2], (32768, 128, 1))),
        ValueError, r"^index_cache: expected a contiguous cache, got strides \[32768, 128, 1\]$"),
    "index_cache_rows_overlap": (
        lambda k: k.update(index_cache=_strided(k["index_cache"][:5], (16384, 64, 1))),
        ValueError, r"^index_cache: expected a contiguous cache, got strides \[16384, 64, 1\]$"),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_bad_argument_message_is_exact(name):
    mutate, exc, pattern = NAMED[name]
    kw = _valid()
    mutate(kw)
    kw["out"].fill(-5)  # poison: a call that ran would overwrite it
    with pytest.raises(exc, match=pattern):
        cpidx.decode_topk(**kw)
    assert (kw["out"] == -5).all()


@pytest.mark.parametrize("name, value, text", [
    ("query_len", 0, "1 to 8, got 0"), ("query_len", 9, "1 to 8, got 9"),
    ("scale", 0.0, "a finite value > 0 in float32, got 0"),
    ("scale", -1.5, "a finite value > 0 in float32, got -1.5"),
    ("scale", float("inf"), "a finite value > 0 in float32, got inf"),
    ("scale", float("nan"), "a finite value > 0 in float32, got nan"),
    # Judged as the float32 the library takes: 0 and infinity there.
    ("scale", 1e-50, "a finite value > 0 in float32, got 1e-50"),
    ("scale", 1e39, "a finite value > 0 in float32, got 1e\\+39"),
    ("max_seq_len", 0, "1 to 2147483647, got 0"),
    ("max_seq_len", 2**31, "1 to 2147483647, got 2147483648"),
    ("topk", 0, "1 to 64, got 0"), ("topk", 65, "1 to 64, got 65"),
    ("init_blocks", -1, ">= 0, got -1"), ("local_blocks", -1, ">= 0, got -1"),
])
def test_bad_scalar_message_is_exact(name, value, text):
    # The binding's words, not the library's (which would name the same field otherwise).
    kw = _valid()
    kw[name] = value
    with pytest.raises(ValueError, match=f"^{name}: expected {text}$"):
        cpidx.decode_topk(**kw)


def test_bad_sparse_table_argument_messages_are_exact():
    # One head, 4 rows of 2 requests, topk 4, max_seq_len 512 (4 blocks).
    attn = r"expected at least 2 rows and 4 columns \(num_reqs x cdiv\(max_seq_len, 128\)\), got"
    for change, pattern in (
            (dict(attention_block_table=None),
             "^the sparse table arguments go together: missing attention_block_table$"),
            (dict(attention_block_table=np.zeros((2, 3), np.int32)),
             rf"^attention_block_table: {attn} shape \[2, 3\]$"),
            (dict(attention_block_table=np.zeros((1, 4), np.int32)),
             rf"^attention_block_table: {attn} shape \[1, 4\]$"),
            (dict(sparse_block_table_out=np.zeros((4, 16), np.int32)),
             r"^sparse_block_table_out: expected at least 4 rows and 32 columns \(tokens x "
             r"topk \* 8\), got shape \[4, 16\]$"),
            (dict(sparse_block_table_out=np.zeros((5, 32), np.int32)),
             r"^sparse_block_table_out: expected 4 rows, got shape \[5, 32\]$"),
            (dict(attention_block_table=_strided(np.zeros((2, 4), np.int32), (3, 1))),
             "^attention_block_table: rows must not overlap: expected a row stride >= 4, got 3$"),
            (dict(sparse_block_table_out=_strided(np.zeros((4, 32), np.int32), (31, 1))),
             "^sparse_block_table_out: rows must not overlap: expected a row stride >= 32, "
             "got 31$"),
            (dict(sparse_context_lens_out=np.zeros(5, np.int32)),
             r"^sparse_context_lens_out: expected shape \[4\], got \[5\]$")):
        kw = _table(_valid())
        kw.update(change)
        kw["out"].fill(-5)
        with pytest.raises(ValueError, match=pattern):
            cpidx.decode_topk(**kw)
        assert (kw["out"] == -5).all()


def test_a_dim_of_one_element_takes_any_stride():
    # Its stride is never used: a one-head query or output made by adding an axis (stride 0)
    # gives the ids of a contiguous one.
    kw = _valid()
    want = cpidx.decode_topk(**dict(kw, index_query=kw["index_query"][:, :1].copy(),
                                    out=kw["out"][:1].copy()))
    query, out = kw["index_query"][:, 0][:, None], np.full((4, 4), -5, np.int32)[None]
    assert query.strides[1] == 0 and out.strides[0] == 0
    np.testing.assert_array_equal(cpidx.decode_topk(**dict(kw, index_query=query, out=out)),
                                  want)


def _on_device(a, device_type, device_id=0):
    """``a``'s DLPack capsule with its device rewritten (the memory stays ``a``'s host memory):
    how an array of another device reaches the binding, here without that device."""
    import ctypes

    capsule = a.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"dltensor") + ctypes.sizeof(ctypes.c_void_p)  # DLTensor.device
    device = (ctypes.c_int32 * 2).from_address(address)
    device[0], device[1] = device_type, device_id
    return capsule


def test_host_calls_name_an_array_on_another_device():
    # DLPack device types: 2 CUDA, 13 CUDA managed memory, 7 Vulkan are refused by name; 3 (CUDA
    # pinned host memory) is host memory, which the reference reads.
    kw = _valid()
    want = cpidx.decode_topk(**kw).copy()
    names = ("index_query", "index_cache", "block_table", "seq_lens", "query_len", "out")
    sel = {n: kw[n] for n in ("scale", "topk", "init_blocks", "local_blocks", "max_seq_len")}
    for name, device_type, where in (("index_cache", 2, "cuda:1"), ("out", 2, "cuda:1"),
                                     ("seq_lens", 13, "cuda managed memory"),
                                     ("block_table", 7, "device type 7")):
        out = np.full_like(kw["out"], -5)
        call = dict(kw, out=out)
        call[name] = _on_device(call[name], device_type, 1)
        with pytest.raises(ValueError, match=rf"^{name}: expected a host array \(numpy or a CPU "
                                             rf"tensor\), got {where}$"):
            _C.ref_decode_topk(*(call[n] for n in names), **sel)
        assert (out == -5).all()
    out = np.full_like(kw["out"], -5)
    call = dict(kw, index_query=_on_device(kw["index_query"], 3), out=_on_device(out, 3))
    _C.ref_decode_topk(*(call[n] for n in names), **sel)
    np.testing.assert_array_equal(out, want)


def _golden_prefill_inputs():
    """The first golden prefill case's inputs: case, query, cache, block_table, cu_seqlens_q,
    context_lens, seq_lens, max_seq_len."""
    case = golden_cases("prefill")[0]
    q_lens = case["q_lens"]
    query, cache, bt, msl = golden_inputs(case["seed"], case["T"], sum(q_lens), case["seq_lens"])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ctx = np.array(case["context_lens"], np.int32)
    sl = np.array(case["seq_lens"], np.int32)
    return case, query, cache, bt, cu, ctx, sl, msl


def test_bad_prefill_arguments_are_named():
    case, query, cache, bt, cu, ctx, sl, msl = _golden_prefill_inputs()
    q_lens = case["q_lens"]
    out = np.zeros((case["T"], sum(q_lens), case["K"]), np.int32)
    common = dict(scale=1.0, topk=case["K"], max_seq_len=msl)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cpidx.prefill_topk(query, cache, bt, cu[:-1], ctx, sl, out, **common)
    with pytest.raises(TypeError, match="context_lens: expected int32"):
        cpidx.prefill_topk(query, cache, bt, cu, ctx.astype(np.int64), sl, out, **common)
    with pytest.raises(ValueError, match="out: expected shape"):
        cpidx.prefill_topk(query, cache, bt, cu, ctx, sl, out[:, 1:], **common)
    kw = _out_on(dict(cu_seqlens_q=cu, out=out), "cu_seqlens_q")
    with pytest.raises(ValueError, match=r"ids output \(out\) and cu_seqlens_q share memory"):
        cpidx.prefill_topk(query, cache, bt, kw["cu_seqlens_q"], ctx, sl, kw["out"], **common)
    # More requests than an int holds (arrays claiming 2^31 of them over the real few): refused
    # by name before anything reads them, not narrowed to a smaller batch.
    big = 2**31
    with pytest.raises(ValueError, match="seq_lens: expected 1 to INT_MAX requests"):
        _C.ref_prefill_topk(query, cache, as_strided(bt, (big, bt.shape[1]), bt.strides),
                            as_strided(cu, (big + 1,), (4,)), as_strided(ctx, (big,), (4,)),
                            as_strided(sl, (big,), (4,)), out, scale=1.0, topk=case["K"],
                            init_blocks=0, local_blocks=1, max_seq_len=msl)
    read_only = out.copy()
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="^out: expected a writeable array, got a read-only one"):
        cpidx.prefill_topk(query, cache, bt, cu, ctx, sl, read_only, **common)
    # A 0-dim query is named, not taken for "no tokens".
    with pytest.raises(ValueError, match="^index_query"):
        cpidx.prefill_topk(np.zeros((), np.uint16), cache, bt, cu, ctx, sl, out, **common)
    # No tokens: nothing to check or write, as on the GPU path.
    empty = np.full((case["T"], 0, case["K"]), 9, np.int32)
    assert cpidx.prefill_topk(query[:0], cache, bt, cu, ctx, sl, empty, **common) is empty


def test_bad_prefill_argument_messages_are_exact():
    # Three requests, 434 tokens, max_seq_len 1152 (9 blocks).
    case, query, cache, bt, cu, ctx, sl, msl = _golden_prefill_inputs()
    out = np.full((case["T"], sum(case["q_lens"]), case["K"]), -5, np.int32)
    args = dict(index_query=query, index_cache=cache, block_table=bt, cu_seqlens_q=cu,
                context_lens=ctx, seq_lens=sl, out=out, scale=1.0, topk=case["K"],
                max_seq_len=msl)
    too_small = r"expected at least 3 rows and 9 columns \(num_reqs x cdiv\(max_seq_len, 128\)\)"
    for change, pattern in (
            (dict(context_lens=np.append(ctx, 0).astype(np.int32)),
             r"^context_lens: expected shape \[3\], got \[4\]$"),
            (dict(context_lens=ctx[:-1]), r"^context_lens: expected shape \[3\], got \[2\]$"),
            (dict(cu_seqlens_q=cu[:-1]), r"^cu_seqlens_q: expected shape \[4\], got \[3\]$"),
            (dict(block_table=bt[:-1]), rf"^block_table: {too_small}, got shape \[2, 9\]$"),
            (dict(block_table=bt[:, :-1]), rf"^block_table: {too_small}, got shape \[3, 8\]$"),
            (dict(seq_lens=sl[:0], context_lens=ctx[:0], cu_seqlens_q=cu[:1]),
             r"^seq_lens: expected 1 to INT_MAX requests, got shape \[0\]$")):
        with pytest.raises(ValueError, match=pattern):
            cpidx.prefill_topk(**dict(args, **change))
    assert (out == -5).all()
    # No tokens: prefill_topk returns at once, the binding names it.
    with pytest.raises(ValueError, match="^index_query: expected at least one token, got none$"):
        _C.ref_prefill_topk(query[:0], cache, bt, cu, ctx, sl, out[:, :0], scale=1.0,
                            topk=case["K"], init_blocks=0, local_blocks=1, max_seq_len=msl)


def test_shard_and_merge_bad_arguments_are_named():
    kw = _valid()
    sel = dict(topk=4, init_blocks=0, local_blocks=1, max_seq_len=512)
    keys = np.zeros((2, 4, 4), np.int64)
    args = (kw["index_query"], kw["index_cache"], kw["block_table"], kw["seq_lens"], 2)
    with pytest.raises(TypeError, match="keys_out: expected int64"):
        _C.ref_shard_topk_keys(*args, keys.astype(np.int32), scale=1.0, world_size=2, rank=0,
                               **sel)
    with pytest.raises(ValueError, match="keys_out"):
        _C.ref_shard_topk_keys(*args, keys[:, :3], scale=1.0, world_size=2, rank=0, **sel)
    with pytest.raises(ValueError, match="rank"):
        _C.ref_shard_topk_keys(*args, keys, scale=1.0, world_size=2, rank=2, **sel)
    with pytest.raises(ValueError, match="gathered"):
        _C.ref_merge_topk_keys(keys, kw["seq_lens"], 2, np.zeros((1, 4, 4), np.int32),
                               head_offset=0, **sel)


def test_shard_and_merge_key_buffers_are_checked_exactly():
    kw = _valid()
    sel = dict(topk=4, init_blocks=0, local_blocks=1, max_seq_len=512)
    args = (kw["index_query"], kw["index_cache"], kw["block_table"], kw["seq_lens"], 2)
    want = cpidx.decode_topk(**kw).copy()
    shape = r"expected a contiguous int64 array of shape \[2, 4, 4\], got shape"
    for keys, exc, pattern in (
            (np.zeros((2, 4, 4), np.float64), TypeError,
             r"^keys_out: expected int64 \(ordered keys\), got float64$"),
            (np.zeros((2, 4, 4, 1), np.int64), ValueError, rf"^keys_out: {shape} \[2, 4, 4, 1\]$"),
            (np.zeros((2, 4, 8), np.int64)[:, :, :4], ValueError,  # padded rows
             rf"^keys_out: {shape} \[2, 4, 4\] with strides \[32, 8, 1\]$")):
        with pytest.raises(exc, match=pattern):
            _C.ref_shard_topk_keys(*args, keys, scale=0.5, world_size=1, rank=0, **sel)
    with pytest.raises(ValueError, match="^world_size: expected >= 1, got 0$"):
        _C.ref_shard_topk_keys(*args, np.zeros((2, 4, 4), np.int64), scale=0.5, world_size=0,
                               rank=0, **sel)
    for world_size, rank in ((2, 2), (2, -1)):
        with pytest.raises(ValueError, match=f"^rank: expected 0 <= rank < world_size = "
                                             f"{world_size}, got {rank}$"):
            _C.ref_shard_topk_keys(*args, np.zeros((2, 4, 4), np.int64), scale=0.5,
                                   world_size=world_size, rank=rank, **sel)
    keys = np.zeros((2, 4, 4), np.int64)
    _C.ref_shard_topk_keys(*args, keys, scale=0.5, world_size=1, rank=0, **sel)
    # One rank's keys as [1, heads, n, topk] (an added axis: stride 0) merge to the plain ids.
    out = np.full((2, 4, 4), -5, np.int32)
    _C.ref_merge_topk_keys(keys[None], kw["seq_lens"], 2, out, head_offset=0, **sel)
    np.testing.assert_array_equal(out, want)
    # 0-dim arrays are named before any dim is read.
    with pytest.raises(ValueError, match=r"^gathered: expected 4 dims \[world_size, total_heads, "
                                         r"tokens, topk\]$"):
        _C.ref_merge_topk_keys(np.zeros((), np.int64), kw["seq_lens"], 2, out, head_offset=0,
                               **sel)
    with pytest.raises(ValueError, match=r"^out: expected 3 dims \[heads, tokens, topk\]"):
        _C.ref_merge_topk_keys(keys[None], kw["seq_lens"], 2, np.zeros((), np.int32),
                               head_offset=0, **sel)


def test_gpu_decoder_without_gpu_raises_cleanly():
    if cpidx.gpu_available():
        pytest.skip("a GPU is visible")
    with pytest.raises((NotImplementedError, RuntimeError)):
        cpidx.Decoder(total_heads=4, world_size=1, rank=0, max_tokens=8, max_seq_len=1024,
                      topk=16, init_blocks=0, local_blocks=1, device=0)


def test_gpu_prefiller_without_gpu_raises_cleanly():
    if cpidx.gpu_available():
        pytest.skip("a GPU is visible")
    with pytest.raises((NotImplementedError, RuntimeError)):
        cpidx.Prefiller(num_heads=4, max_tokens=8, max_seq_len=1024, topk=16, init_blocks=0,
                        local_blocks=1, device=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        cpidx.Prefiller(num_heads=4, max_tokens=8, max_seq_len=0, topk=16, init_blocks=0,
                        local_blocks=1, device=0)


def test_gpu_constructors_name_bad_settings_before_the_device():
    # Checked on the host before any device is asked for (a GPU or not): each in full.
    decoder = dict(total_heads=4, world_size=1, rank=0, max_tokens=8, max_seq_len=1024,
                   topk=16, init_blocks=0, local_blocks=1, device=0)
    prefiller = dict(num_heads=4, max_tokens=8, max_seq_len=1024, topk=16, init_blocks=0,
                     local_blocks=1, device=0)
    for cls, base in ((cpidx.Decoder, decoder), (cpidx.Prefiller, prefiller)):
        for change, pattern in (
                (dict(max_seq_len=0), r"^max_seq_len: expected 1 to 2\^31-1, got 0$"),
                (dict(max_seq_len=2**31), r"^max_seq_len: expected 1 to 2\^31-1, got 2147483648$"),
                (dict(init_blocks=-1), "^init_blocks: expected >= 0, got -1$"),
                (dict(local_blocks=-1), "^local_blocks: expected >= 0, got -1$"),
                (dict(topk=65), "^topk: expected 1 to 64, got 65$"),
                (dict(cache_dtype="fp16"),
                 "^cache_dtype: expected 'bf16' or 'fp8_e4m3', got 'fp16'$")):
            with pytest.raises(ValueError, match=pattern):
                cls(**dict(base, **change))
        for spelled in ("bf16", "bfloat16", "fp8_e4m3", "float8_e4m3fn"):  # all reach the device
            try:
                cls(**dict(base, cache_dtype=spelled))
            except (NotImplementedError, RuntimeError):
                assert not cpidx.gpu_available()


def test_peer_binding_follows_has_peer():
    assert isinstance(cpidx.has_peer, bool) and isinstance(cpidx.has_nccl, bool)
    assert hasattr(_C, "make_peer_communicator") == cpidx.has_peer
    assert hasattr(_C, "make_nccl_communicator") == cpidx.has_nccl
    if not cpidx.cuda_built:  # both communicators are device ones
        assert not cpidx.has_peer and not cpidx.has_nccl


def test_cp_gather_bytes_is_the_larger_gather():
    # T=4 over 2 ranks, 256 rows, K=16: queries 256 * 2 * 128 * 2 B, keys 4 * 256 * 16 * 8 B.
    assert cpidx.cp_gather_bytes(total_heads=4, world_size=2, max_tokens=256, topk=16) == 131072
    # Over 4 ranks one head each: the keys are larger (4 * 8 * 64 * 8 B against 8 * 256 B).
    assert cpidx.cp_gather_bytes(total_heads=4, world_size=4, rank=3, max_tokens=8,
                                 topk=64) == 16384
    # One index head replicated on 8 ranks, K=4: the queries are larger (1 * 256 against 32).
    assert cpidx.cp_gather_bytes(total_heads=1, world_size=8, max_tokens=1, topk=4) == 256


@pytest.mark.parametrize("kw,name", [
    (dict(total_heads=6, world_size=4), "total_heads"),
    (dict(total_heads=4, world_size=2, rank=2), "rank"),
    (dict(total_heads=4, world_size=2, max_tokens=0), "max_tokens"),
    (dict(total_heads=4, world_size=2, topk=0), "topk"),
])
def test_cp_gather_bytes_names_bad_arguments(kw, name):
    args = dict(max_tokens=8, topk=16)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        cpidx.cp_gather_bytes(**args)


def test_communicator_close_is_idempotent_and_use_after_close_is_named():
    a, b = _C._thread_communicators(2)
    assert (a.rank, a.world_size, a.kind, a.device_memory, a.device, a.closed) == \
        (0, 2, "threads", False, -1, False)
    assert a.read_error_flag() is None  # only peer communicators have an error word
    a.clear_error_flag()  # nothing to clear
    assert cpidx.PEER_ERROR_TIMEOUT == 1
    assert a._close_blocker() is None  # nothing keeps it open (closes nothing)
    assert not a.closed
    a.close()
    a.close()
    assert a._close_blocker() is None  # closed: nothing to refuse
    assert a.closed and not b.closed and b.rank == 1
    assert "closed" in repr(a)
    for use in (lambda: a.rank, lambda: a.world_size, lambda: a.device_memory, lambda: a.device,
                a.read_error_flag, a.clear_error_flag):
        with pytest.raises(RuntimeError, match=r"Communicator\(threads, rank 0 of 2\) is closed"):
            use()
    with pytest.raises(ValueError, match="world_size"):
        _C._thread_communicators(0)


@pytest.mark.skipif(not cpidx.has_peer, reason="the peer communicator is not built")
def test_peer_communicator_refuses_a_closed_bootstrap_by_name():
    (boot,) = _C._thread_communicators(1)
    boot.close()
    with pytest.raises(RuntimeError, match="bootstrap: .* is closed"):
        _C.make_peer_communicator(boot, 0, 4096)


@pytest.mark.skipif(not cpidx.has_peer or cpidx.gpu_available(),
                    reason="needs the peer communicator built and no GPU")
def test_peer_communicator_without_gpu_raises_cleanly():
    (boot,) = _C._thread_communicators(1)
    with pytest.raises((RuntimeError, ValueError), match="peer communicator unavailable"):
        _C.make_peer_communicator(boot, 0, 4096)
    boot.close()  # nothing depends on it after the failure


def test_communicator_leaked_at_exit_is_closed_without_a_destroy():
    a, b = _C._thread_communicators(2)
    a._leak_at_exit()
    a._leak_at_exit()
    assert a.closed and not b.closed
    with pytest.raises(RuntimeError, match=r"Communicator\(threads, rank 0 of 2\) is closed"):
        a.rank
    a.close()  # a no-op once let go
    b.close()


class _CollectiveInstance:
    """A shared IndexerCPDecode stand-in whose close() is collective."""

    closed = False
    closes = 0

    def _closes_collectively(self):
        return True

    def close(self):
        from cpidx._api import _refuse_during_capture

        _refuse_during_capture("the stand-in's close()")  # as IndexerCPDecode.close() does
        self.closes += 1
        self.closed = True


def test_registry_refuses_creation_and_collective_clear_during_a_capture(monkeypatch):
    # Creating a Decoder or Prefiller allocates and synchronises, which a capture forbids (and
    # CUDA's refusal would also invalidate the capture): the registry refuses first, naming the
    # shape, and keeps nothing; clear() refuses while it holds instances whose close is
    # collective, and drops nothing.
    import sys
    import types

    from cpidx._api import Registry

    # A stand-in torch whose current stream is capturing (CI has no GPU, maybe no torch): what
    # the package's capture check reads of it.
    capturing = [True]
    fake = types.SimpleNamespace(
        Tensor=type("Tensor", (), {}),
        cuda=types.SimpleNamespace(is_available=lambda: True,
                                   is_current_stream_capturing=lambda: capturing[0]))
    monkeypatch.setitem(sys.modules, "torch", fake)
    reg = Registry()
    shape = dict(device=0, heads=4, max_tokens=64, max_seq_len=1024, topk=16, init_blocks=0,
                 local_blocks=1)
    with pytest.raises(RuntimeError, match=r"creating a Decoder \(max_tokens=64, max_seq_len=1024, "
                                           r"4 heads\) \(the first call of this shape\): a CUDA "
                                           r"graph is being captured.*capture is still valid"):
        reg.decoder(**shape)
    with pytest.raises(RuntimeError, match=r"creating a Prefiller \(max_tokens=64"):
        reg.prefiller(**shape)
    assert len(reg) == 0

    def bad_query():  # a miss checks the call's arguments first: those are named even here
        raise ValueError("index_query: expected 3 dims")

    with pytest.raises(ValueError, match="^index_query: expected 3 dims"):
        reg.decoder(**shape, _check=bad_query)
    assert len(reg) == 0
    shared = _CollectiveInstance()
    reg._cp[("key",)] = shared
    with pytest.raises(RuntimeError, match=r"Registry\.clear\(\) \(it closes the shared"):
        reg.clear()
    assert shared.closes == 0 and len(reg) == 1
    capturing[0] = False
    reg.clear()
    assert shared.closes == 1 and len(reg) == 0


class _StuckInstance(_CollectiveInstance):
    """A shared instance whose first close raises (a live graph holds its NCCL kernels, say)."""

    message = "a CUDA graph still holds 1 gather"

    def close(self) -> None:
        if self.closes == 0:
            self.closes += 1
            raise RuntimeError(self.message)
        super().close()


class _LocalInstance(_CollectiveInstance):
    """A shared instance whose close() is not collective (one rank, say)."""

    def _closes_collectively(self):
        return False


def test_registry_clear_keeps_an_instance_that_could_not_close():
    # It is still open: forgetting it would leave it open for good, and the next cp_decode of
    # its key would build a second one (another NCCL bootstrap and workspace).
    from cpidx._api import Registry

    reg = Registry()
    stuck, fine = _StuckInstance(), _CollectiveInstance()
    reg._cp[("stuck",)] = stuck
    reg._cp[("fine",)] = fine
    with pytest.raises(RuntimeError, match="still holds 1 gather"):
        reg.clear()
    assert fine.closes == 1 and not stuck.closed
    assert list(reg._cp.values()) == [stuck]
    reg.clear()  # tries it again
    assert stuck.closed and len(reg) == 0


def test_registry_clear_raises_the_first_error_and_drops_nothing_else_after_a_failed_close():
    # Every collective close is tried, the first error raised; the decoders and the instances
    # whose close is not collective stay (no rank drops more than a rank that could not close).
    from cpidx._api import Registry

    reg = Registry()
    first, second, local = _StuckInstance(), _StuckInstance(), _LocalInstance()
    second.message = "the second error"
    reg._cp[("first",)], reg._cp[("second",)], reg._cp[("local",)] = first, second, local
    reg._decoders[("decoder",)] = object()
    with pytest.raises(RuntimeError, match="^a CUDA graph still holds 1 gather$"):
        reg.clear()
    assert first.closes == second.closes == 1 and local.closes == 0
    assert len(reg._decoders) == 1 and len(reg) == 4


def test_registry_keys_decoders_and_prefillers_on_every_setting(monkeypatch):
    # One GPU object per shape and selection: another cache dtype or init / local block count
    # makes another (faked constructors: no GPU here).
    import types

    import cpidx._api as api

    monkeypatch.setattr(api, "Decoder", lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setattr(api, "Prefiller", lambda **kw: types.SimpleNamespace(**kw))
    reg = api.Registry()
    shape = dict(device=0, heads=2, max_tokens=64, max_seq_len=1024, topk=8, init_blocks=0,
                 local_blocks=1)
    for make in (reg.decoder, reg.prefiller):
        made = make(**shape)
        assert make(**shape) is made
        for other in (dict(cache_dtype="fp8_e4m3"), dict(init_blocks=1), dict(local_blocks=2)):
            assert make(**dict(shape, **other)) is not made, (make, other)
    assert len(reg) == 8


def test_registry_makes_a_decoder_apart_from_other_shapes_and_once_per_shape(monkeypatch):
    # A new shape's decoder is made outside the registry's lock: another thread's call of an
    # existing shape goes on meanwhile (creation synchronises a device), and threads wanting the
    # same new shape get one object, made once; a creation that fails leaves nothing behind.
    import threading
    import time
    import types

    import cpidx._api as api

    made, started = [], threading.Event()

    def slow_decoder(**kw):
        made.append(kw["max_tokens"])
        if kw["max_tokens"] == 128:
            started.set()
            time.sleep(0.5)
        if kw["max_tokens"] == 256:
            raise RuntimeError("cudaMalloc: out of memory")
        return types.SimpleNamespace(**kw)

    monkeypatch.setattr(api, "Decoder", slow_decoder)
    reg = api.Registry()
    shape = dict(device=0, heads=2, max_seq_len=1024, topk=8, init_blocks=0, local_blocks=1)
    old = reg.decoder(max_tokens=64, **shape)
    got = {}

    def make_new(i):
        got[i] = reg.decoder(max_tokens=128, **shape)

    threads = [threading.Thread(target=make_new, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    assert started.wait(5)
    t0 = time.monotonic()
    assert reg.decoder(max_tokens=64, **shape) is old  # not behind the creation
    assert time.monotonic() - t0 < 0.25
    for t in threads:
        t.join(5)
    assert got[0] is got[1] is got[2] and made.count(128) == 1
    for _ in range(2):  # a failed creation leaves no entry and no pending mark: tried again
        with pytest.raises(RuntimeError, match="out of memory"):
            reg.decoder(max_tokens=256, **shape)
    assert made.count(256) == 2 and len(reg) == 2


def test_registry_clear_warns_for_objects_under_live_graphs_after_closing_everything():
    # A decoder a live graph still uses is dropped with a warning, raised last: under
    # warnings-as-errors every shared instance is closed before it (a rank that stopped short
    # would leave its peers in their close's agreement).
    import warnings

    import cpidx._api as api

    class Held:
        def launches_in_live_graphs(self, wait_seconds=0.0):
            return 1

    class Instance:
        closed = False

        def _closes_collectively(self):
            return False

        def close(self):
            self.closed = True

    reg = api.Registry()
    reg._decoders["a decoder in a graph"] = Held()
    reg._decoders["a stand-in without a count"] = object()
    cp = reg._cp["an instance"] = Instance()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match=r"^Registry.clear\(\): 1 decoder\(s\) / "
                                                 r"prefiller\(s\) dropped while CUDA graphs"):
            reg.clear()
    assert cp.closed and len(reg) == 0


def test_registry_clear_gives_its_held_objects_one_grace_in_all():
    # The grace for graphs deleted just before clear() is one deadline shared by every dropped
    # object, not 0.1 s each: each object is asked to wait what is left of it (the stand-ins
    # sleep what they are asked, as a count that never falls would), so the waits asked for add
    # up to at most one grace however many objects live graphs hold.
    import time
    import warnings

    import cpidx._api as api

    asked = []

    class Held:
        def launches_in_live_graphs(self, wait_seconds=0.0):
            asked.append(wait_seconds)
            time.sleep(wait_seconds)
            return 1

    reg = api.Registry()
    for i in range(5):
        reg._decoders[f"decoder {i}"] = Held()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match=r"^Registry.clear\(\): 5 decoder\(s\) / "):
            reg.clear()
    assert len(asked) == 5 and asked[0] <= 0.1
    assert all(w >= 0 for w in asked) and sum(asked) <= 0.1 + 1e-9, asked


def test_an_explicit_decoder_must_match_the_call():
    # decode_topk(..., decoder=D) runs D's selection and bound: a call asking for others raises,
    # naming the argument, instead of returning ids for D's.
    from types import SimpleNamespace

    from cpidx._api import _check_decoder_matches

    dec = SimpleNamespace(topk=16, init_blocks=0, local_blocks=1, max_seq_len=65536)
    same = dict(topk=16, init_blocks=0, local_blocks=1, max_seq_len=65536)
    _check_decoder_matches(dec, **same)
    for name, value in (("topk", 8), ("init_blocks", 4), ("local_blocks", 0),
                        ("max_seq_len", 1024)):
        with pytest.raises(ValueError, match=rf"^{name}: {value} differs from the decoder's "
                                             rf"\({name}="):
            _check_decoder_matches(dec, **dict(same, **{name: value}))
    # A Decoder runs on the GPU: host arrays are refused, naming it.
    with pytest.raises(ValueError, match="^decoder: a GPU Decoder needs CUDA tensors, got host"):
        cpidx.decode_topk(**_valid(), decoder=object())


def test_host_error_flag_overlap_is_judged_by_each_arguments_byte_span():
    # The memory an argument covers, from its lowest to its highest byte: a flag right after out
    # is accepted, one at the lowest address of a reversed (negative-stride) query is named, and
    # an empty argument covers nothing (the binding names it, not an overlap with the flag).
    kw = _valid()
    want = cpidx.decode_topk(**kw).copy()
    buf = np.zeros(kw["out"].size + 1, np.int32)
    kw["out"], flag = buf[:-1].reshape(kw["out"].shape), buf[-1:]
    cpidx.decode_topk(**kw, error_flag=flag)
    np.testing.assert_array_equal(kw["out"], want)
    assert flag[0] == 0
    kw = _valid()
    query = kw["index_query"].copy()
    kw["index_query"] = query[::-1]
    with pytest.raises(ValueError, match="^error_flag and index_query share memory"):
        cpidx.decode_topk(**kw, error_flag=query.reshape(-1).view(np.int32)[:1])
    kw = _valid()
    buf = np.zeros((2, 8), np.int32)
    kw["block_table"] = buf[:, :0]
    with pytest.raises(ValueError, match="^block_table: expected at least 2 rows"):
        cpidx.decode_topk(**kw, error_flag=buf[0, 1:2])


def test_host_error_flag_on_an_argument_is_refused_and_float_inputs_take_any_byte_order():
    kw = _valid()
    want = cpidx.decode_topk(**kw).copy()
    # The flag is ORed by Python after a host call: it must not share memory with any argument.
    for name in ("out", "seq_lens", "block_table"):
        kw = _valid()
        before = kw[name].copy()
        flag = kw[name].reshape(-1)[1:2]
        with pytest.raises(ValueError, match=f"^error_flag and {name} share memory"):
            cpidx.decode_topk(**kw, error_flag=flag)
        np.testing.assert_array_equal(kw[name], before)
    case, query, cache, bt, cu, ctx, sl, msl = _golden_prefill_inputs()
    out = np.zeros((case["T"], sum(case["q_lens"]), case["K"]), np.int32)
    with pytest.raises(ValueError, match="^error_flag and context_lens share memory"):
        cpidx.prefill_topk(query, cache, bt, cu, ctx, sl, out, scale=1.0, topk=case["K"],
                           max_seq_len=msl, error_flag=ctx[:1])
    # Float queries and caches are rounded to bf16 whatever their byte order.
    kw = _valid()
    kw["index_query"] = cpidx.bf16_to_float32(kw["index_query"]).astype(">f4")
    kw["index_cache"] = cpidx.bf16_to_float32(kw["index_cache"]).astype(">f4")
    np.testing.assert_array_equal(cpidx.decode_topk(**kw), want)


def test_a_context_parallel_step_check_refuses_an_output_on_an_input():
    # What a CPU IndexerCPDecode rank checks before its collectives (and agrees on): an output
    # over an input too, as the reference cp_decode, the GPU and the one-rank path refuse it.
    kw = _valid()
    args = dict(scale=0.5, topk=4, init_blocks=0, local_blocks=1, max_seq_len=512,
                local_heads=2, max_tokens=16, max_query_len=2)
    names = ("index_query", "index_cache", "block_table", "seq_lens", "query_len", "out")

    def check(kw):
        _C.ref_check_cp_decode(*(kw[n] for n in names), **args)

    check(kw)
    kw = _out_on(_valid(), "seq_lens")
    with pytest.raises(ValueError, match=r"^ids output \(out\) and seq_lens share memory"):
        check(kw)


def test_a_context_parallel_step_check_names_its_own_arguments():
    # The binding's checks of a CPU rank's step (IndexerCPDecode checks the heads itself first),
    # in the step's names: local_q, kv_cache, this rank's local_heads and max_query_len.
    kw = _valid()
    q = kw["index_query"]
    names = ("index_query", "index_cache", "block_table", "seq_lens", "query_len", "out")
    args = dict(scale=0.5, topk=4, init_blocks=0, local_blocks=1, max_seq_len=512,
                local_heads=2, max_tokens=16, max_query_len=2)
    for change, exc, pattern in (
            (dict(index_query=_strided(q, (256, 64, 1))), ValueError,
             "^local_q: rows and heads must not overlap: expected strides >= 128, got row "
             "stride 256 and head stride 64$"),
            (dict(index_query=q.view(np.int16)), TypeError, "^local_q: expected bfloat16"),
            (dict(index_cache=kw["index_cache"][:0]), ValueError, r"^kv_cache: expected shape "),
            (dict(index_query=q[:, :1], out=kw["out"][:1]), ValueError,
             r"^local_q: expected this rank's 2 heads \(local_heads\), got 1$"),
            (dict(query_len=3), ValueError, "^query_len: expected 1 to max_query_len 2, got 3$")):
        with pytest.raises(exc, match=pattern):
            _C.ref_check_cp_decode(*(dict(kw, **change)[n] for n in names), **args)
    # The sparse table needs one index head: this rank's two are refused before any collective.
    one = _table(_valid())
    table = {n: one.pop(n) for n in ("attention_block_table", "sparse_block_table_out",
                                     "sparse_context_lens_out", "block_page_stride")}
    _C.ref_check_cp_decode(*(one[n] for n in names), **dict(args, local_heads=1), **table)
    with pytest.raises(ValueError, match="^the sparse table needs exactly one index head"):
        _C.ref_check_cp_decode(*(kw[n] for n in names), **args, **table)


def test_error_flag_reports_clamped_values_and_ids_follow_the_clamp():
    """Bad device-side values are clamped (CONTRACT.md section 8): the call ORs their bits into
    error_flag, and its ids are those of the clamped inputs."""
    rng = np.random.default_rng(71)
    b = random_decode(rng, 2, 2, [300, 768, 129], max_seq_len=768)  # request 1: every page
    b.seq_lens[1] = 500
    pages = b.cache.shape[0]
    sel = (6, 1, 1)

    def ids_and_bits(batch, preset=0, sel=sel):
        flag = np.full(1, preset, np.int32)
        return run_decode(batch, *sel, error_flag=flag), int(flag[0])

    clean, bits = ids_and_bits(b)
    assert bits == 0

    def with_(seq_lens=None, table=None):
        c = copy.copy(b)
        c.seq_lens = b.seq_lens.copy() if seq_lens is None else np.array(seq_lens, np.int32)
        c.block_table = b.block_table.copy() if table is None else table
        return c

    # A seq_len past max_seq_len reads as max_seq_len, a negative one as 0.
    ids, bits = ids_and_bits(with_(seq_lens=[300, 768 + 5, 129]))
    assert bits == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
    np.testing.assert_array_equal(ids, run_decode(with_(seq_lens=[300, 768, 129]), *sel))
    assert not np.array_equal(ids, clean)
    ids, bits = ids_and_bits(with_(seq_lens=[-4, 500, 129]))
    assert bits == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
    np.testing.assert_array_equal(ids, run_decode(with_(seq_lens=[0, 500, 129]), *sel))
    assert not np.array_equal(ids, clean)
    # A block-table entry past the cache reads as its last page, a negative one as page 0; the
    # flag's earlier bits stay. Two blocks chosen by score alone, so the pages read decide them.
    by_score = (2, 0, 0)
    table, clamped = b.block_table.copy(), b.block_table.copy()
    table[0, 1], clamped[0, 1] = pages + 10, pages - 1
    table[1, 3], clamped[1, 3] = -2, 0
    ids, bits = ids_and_bits(with_(table=table), preset=0x100, sel=by_score)
    assert bits == 0x100 | cpidx.ERR_PAGE_OUT_OF_RANGE
    np.testing.assert_array_equal(ids, run_decode(with_(table=clamped), *by_score))
    assert not np.array_equal(ids, run_decode(b, *by_score))
    swapped = b.block_table.copy()  # each bad entry clamped to the other end of the cache
    swapped[0, 1], swapped[1, 3] = 0, pages - 1
    assert not np.array_equal(ids, run_decode(with_(table=swapped), *by_score))
    ids, bits = ids_and_bits(with_(seq_lens=[300, 900, 129], table=table))
    assert bits == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE | cpidx.ERR_PAGE_OUT_OF_RANGE


def test_prefill_error_flag_reports_clamped_pages():
    case, query, cache, bt, cu, ctx, sl, msl = _golden_prefill_inputs()
    q_lens = case["q_lens"]
    common = dict(scale=case["scale"], topk=case["K"], init_blocks=case["init"],
                  local_blocks=case["local"], max_seq_len=msl)

    def run(table):
        out = np.full((case["T"], sum(q_lens), case["K"]), 9, np.int32)
        flag = np.zeros(1, np.int32)
        cpidx.prefill_topk(query, cache, table, cu, ctx, sl, out, error_flag=flag, **common)
        return out, int(flag[0])

    ids, bits = run(bt)
    assert bits == 0
    np.testing.assert_array_equal(ids, np.array(case["ids"], dtype=np.int32))
    bad, clamped = bt.copy(), bt.copy()
    bad[0, 0], clamped[0, 0] = cache.shape[0] + 3, cache.shape[0] - 1
    ids, bits = run(bad)
    assert bits == cpidx.ERR_PAGE_OUT_OF_RANGE
    np.testing.assert_array_equal(ids, run(clamped)[0])


@pytest.mark.parametrize("flag, exc, text", [
    (np.zeros(1, np.int64), TypeError, "int64 array of 1 elements"),
    (np.zeros(2, np.int32), ValueError, "int32 array of 2 elements"),
    (np.zeros(1, np.int32).view(), ValueError, "read-only"),
    ([0], TypeError, "got list"),
])
def test_bad_error_flag_is_named(flag, exc, text):
    if text == "read-only":
        flag.flags.writeable = False
    kw = _valid()
    kw["out"].fill(-5)  # poison: a call that ran would overwrite it
    before = kw["out"].copy()
    with pytest.raises(exc, match=f"^error_flag: .*{text}"):
        cpidx.decode_topk(**kw, error_flag=flag)
    np.testing.assert_array_equal(kw["out"], before)  # refused before anything ran


def test_version_is_the_one_in_version_h_and_pyproject():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    header = (root / "include" / "cpidx" / "version.h").read_text()
    assert f'#define CPIDX_VERSION "{cpidx.__version__}"\n' in header
    pyproject = (root / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(cpidx.__version__)}"$', pyproject, re.M)


@pytest.mark.parametrize("name, value, exc, text", [
    ("topk", 2**31, ValueError, "expected an int from -2147483648 to 2147483647, got 2147483648"),
    ("init_blocks", -2**31 - 1, ValueError, "expected an int from -2147483648 to 2147483647"),
    ("topk", None, TypeError, "expected int, got None"),
    ("topk", 1.5, TypeError, "expected an int, got float"),
    ("query_len", "2", TypeError, "expected an int, got str"),
    ("scale", "0.5", TypeError, "expected a number, got str"),
    ("max_seq_len", 2**63, ValueError, "expected an int from"),
    ("topk", np.int64(2**40), ValueError, "expected an int from"),  # numpy ints convert
])
def test_a_scalar_the_binding_cannot_convert_is_named(name, value, exc, text):
    # nanobind's own TypeError lists the signature and names no argument.
    kw = _valid()
    kw[name] = value
    kw["out"].fill(-5)
    with pytest.raises(exc, match=f"^{name}: {text}"):
        cpidx.decode_topk(**kw)
    assert (kw["out"] == -5).all()


def test_class_and_bound_scalars_are_named():
    kw = dict(total_heads=4, world_size=1, rank=0, max_tokens=64, max_seq_len=1024, topk=16,
              init_blocks=0, local_blocks=1, device=0)
    with pytest.raises(ValueError, match="^total_heads: expected an int from"):
        cpidx.Decoder(**dict(kw, total_heads=2**31))
    with pytest.raises(TypeError, match="^cache_dtype: expected str, got int"):
        cpidx.Decoder(**dict(kw, cache_dtype=8))
    with pytest.raises(TypeError, match="^max_tokens: expected an int, got float"):
        cpidx.Prefiller(num_heads=4, max_tokens=64.0, max_seq_len=1024, topk=16, init_blocks=0,
                        local_blocks=1, device=0)
    # cp_gather_bytes: its int64 max_tokens bounded as a Decoder's, so no size wraps around.
    assert cpidx.cp_gather_bytes(total_heads=8, world_size=2, max_tokens=2, topk=16) == 2048
    with pytest.raises(ValueError, match=f"^max_tokens: expected 1 to {cpidx.MAX_TOKENS}, got "
                                         f"{2**55}$"):
        cpidx.cp_gather_bytes(total_heads=8, world_size=2, max_tokens=2**55, topk=64)
    with pytest.raises(TypeError, match="^topk: expected int, got None"):
        cpidx.cp_gather_bytes(total_heads=8, world_size=2, max_tokens=2, topk=None)
    # Types are judged before ranges: an int64 max_tokens past a C int does not take the blame.
    with pytest.raises(TypeError, match="^topk: expected int, got None"):
        cpidx.cp_gather_bytes(total_heads=8, world_size=2, max_tokens=2**40, topk=None)
    assert cpidx.Decoder.__init__.__doc__ == cpidx._C.Decoder.__init__.__doc__


def test_host_calls_keep_the_gpu_paths_max_tokens():
    # On CUDA tensors max_tokens sizes the registry's Decoder or Prefiller, which refuses a bad
    # bound or a call past it: the reference refuses the same calls.
    kw = _valid()  # 4 rows
    want = cpidx.decode_topk(**kw).copy()
    for bound in (None, 0, 4, 64):
        np.testing.assert_array_equal(cpidx.decode_topk(**kw, max_tokens=bound), want)
    with pytest.raises(ValueError, match=r"^index_query: 4 rows \(num_reqs \* query_len\) exceed "
                                         r"max_tokens \(3\)$"):
        cpidx.decode_topk(**kw, max_tokens=3)
    for bound, exc in ((-7, ValueError), (cpidx.MAX_TOKENS + 1, ValueError), (4.0, TypeError)):
        with pytest.raises(exc, match="^max_tokens: expected"):
            cpidx.decode_topk(**kw, max_tokens=bound)
    case, query, cache, bt, cu, ctx, sl, msl = _golden_prefill_inputs()
    tokens = sum(case["q_lens"])
    out = np.zeros((case["T"], tokens, case["K"]), np.int32)
    common = dict(scale=1.0, topk=case["K"], max_seq_len=msl)
    cpidx.prefill_topk(query, cache, bt, cu, ctx, sl, out, **common, max_tokens=tokens)
    with pytest.raises(ValueError, match=f"^index_query: {tokens} tokens exceed max_tokens "
                                         rf"\({tokens - 1}\)$"):
        cpidx.prefill_topk(query, cache, bt, cu, ctx, sl, out, **common, max_tokens=tokens - 1)
    for bound in (-7, 2**31):  # a Prefiller's max_tokens is a C int
        with pytest.raises(ValueError, match="^max_tokens: expected 1 to 2147483647 "):
            cpidx.prefill_topk(query, cache, bt, cu, ctx, sl, out, **common, max_tokens=bound)


def test_host_error_flag_is_judged_against_the_block_table_columns_read():
    # The library spans a block table as its requests' rows of cdiv(max_seq_len, 128) columns
    # (4 here), on every path: a flag in a column past them is no overlap.
    kw = _valid()
    want = cpidx.decode_topk(**kw).copy()
    wide = np.zeros((2, 6), np.int32)
    wide[:, :4] = kw["block_table"][:, :4]
    kw["block_table"] = wide
    flag = wide[1, 5:6]
    cpidx.decode_topk(**kw, error_flag=flag)
    np.testing.assert_array_equal(kw["out"], want)
    assert flag[0] == 0
    with pytest.raises(ValueError, match="^error_flag and block_table share memory"):
        cpidx.decode_topk(**kw, error_flag=wide[1, 3:4])


def test_bf16_to_float32_takes_uint16_bits_only():
    bits = cpidx.bf16_bits(np.array([1.5, -3.0], np.float32))
    np.testing.assert_array_equal(cpidx.bf16_to_float32(bits), [1.5, -3.0])
    np.testing.assert_array_equal(cpidx.bf16_to_float32(bits.astype(">u2")), [1.5, -3.0])
    for bad in (np.array([1.5, 3.0]), np.array([-1, 70000]), [16320]):
        with pytest.raises(TypeError, match="^bits: expected uint16 bf16 bit patterns, got dtype"):
            cpidx.bf16_to_float32(bad)
