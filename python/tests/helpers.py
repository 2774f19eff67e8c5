"""Test inputs: the golden cases (spec/golden/README.md: SplitMix64, value = int(z >> 60) - 8,
queries then cache, block_table[req][b] = b * B + req) and an independent numpy oracle of
CONTRACT.md sections 3-4."""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

import cpidx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "data", "golden_cases.json")
BS = cpidx.BLOCK_SIZE
D = cpidx.HEAD_DIM


def golden_cases(kind: str) -> list:
    with open(GOLDEN) as f:
        return [c for c in json.load(f)["cases"] if c["kind"] == kind]


def splitmix_values(seed: int, count: int) -> np.ndarray:
    """Draws 1..count of the golden stream as int(z >> 60) - 8."""
    i = np.arange(1, count + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(60)).astype(np.int64) - 8


@dataclass
class Batch:
    """Host arrays of one batch; query is [rows, T, D] bf16 bits, cache [pages, BS, D]."""
    query: np.ndarray
    cache: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    max_seq_len: int
    query_len: int = 1
    scale: float = 1.0
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.query.shape[0]


def golden_inputs(seed: int, T: int, rows: int, seq_lens: list) -> tuple:
    B = len(seq_lens)
    G = max(1, math.ceil(max(seq_lens) / BS))
    pages = B * G
    nq, nc = rows * T * D, pages * BS * D
    v = splitmix_values(seed, nq + nc).astype(np.float32)
    query = cpidx.bf16_bits(v[:nq].reshape(rows, T, D))
    cache = cpidx.bf16_bits(v[nq:].reshape(pages, BS, D))
    bt = np.array([[b * B + req for b in range(G)] for req in range(B)], dtype=np.int32)
    return query, cache, bt, G * BS


def golden_decode(case: dict) -> Batch:
    Q, seq_lens = case["Q"], case["seq_lens"]
    query, cache, bt, max_seq_len = golden_inputs(case["seed"], case["T"], len(seq_lens) * Q,
                                                  seq_lens)
    return Batch(query, cache, bt, np.array(seq_lens, dtype=np.int32), max_seq_len, Q,
                 case["scale"])


def random_decode(rng: np.random.Generator, T: int, Q: int, seq_lens: list, max_seq_len: int,
                  lo: int = -3, hi: int = 4, spare_pages: int = 3, bound: int = 0) -> Batch:
    """Small-integer values (exact dot products, many ties), shuffled pages, garbage in the
    block-table columns past each request's length. Pages are made for max_seq_len tokens a
    request; bound (if larger) is the batch's max_seq_len and sizes its table rows, as for a
    Decoder planned for longer requests than these."""
    B = len(seq_lens)
    G = math.ceil(max_seq_len / BS)
    pages = B * G + spare_pages
    query = cpidx.bf16_bits(rng.integers(lo, hi, size=(B * Q, T, D)).astype(np.float32))
    cache = cpidx.bf16_bits(rng.integers(lo, hi, size=(pages, BS, D)).astype(np.float32))
    perm = rng.permutation(pages).astype(np.int32)
    bound = max(bound, max_seq_len)
    bt = np.full((B, max(G + 2, math.ceil(bound / BS))), -7, dtype=np.int32)
    for req, s in enumerate(seq_lens):
        used = min(G, math.ceil(max(s, 0) / BS))
        bt[req, :used] = perm[req * G: req * G + used]
    return Batch(query, cache, bt, np.array(seq_lens, dtype=np.int32), bound, Q, 0.5)


def oracle_decode(b: Batch, topk: int, init: int, local: int) -> np.ndarray:
    """CONTRACT.md sections 3-4 in plain numpy: ids [T, rows, topk]."""
    q = cpidx.bf16_to_float32(b.query).astype(np.float64)
    k = cpidx.bf16_to_float32(b.cache).astype(np.float64)
    T = q.shape[1]
    out = np.full((T, b.rows, topk), -1, dtype=np.int32)
    for row in range(b.rows):
        req, t = divmod(row, b.query_len)
        pos = int(b.seq_lens[req]) - b.query_len + t
        V = pos // BS + 1 if pos >= 0 else 0
        if V == 0:
            continue
        pages = b.block_table[req, :V]
        keys = k[pages].reshape(V * BS, D)[: pos + 1]
        for h in range(T):
            dots = (keys @ q[row, h]).astype(np.float32) * np.float32(b.scale)
            padded = np.full(V * BS, -np.inf, dtype=np.float32)
            padded[: pos + 1] = dots
            s = padded.reshape(V, BS).max(axis=1)
            blocks = np.arange(V)
            s[blocks < init] = 1e30
            s[blocks >= max(0, V - local)] = 1e29
            order = sorted(range(V), key=lambda i: (-float(s[i]), -i))
            sel = order[: min(topk, V)]
            out[h, row, : len(sel)] = sel
    return out


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int, backend: str, **kwargs):
    """The default process group of one of run_ranks' processes (its port, on this host),
    destroyed on the way out, whatever the body raised."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(target, *extra, world: int = 2, timeout: float = 120) -> dict:
    """Runs ``target(rank, world, port, *extra, results)`` in ``world`` spawned processes (a free
    local port for their process group) and returns ``{rank: what it stored in results}``. A
    rank still running after ``timeout`` seconds (left waiting in a collective) is killed and
    fails the caller's test instead of hanging the suite; so does a rank that exited with an
    error. Needs torch."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=target, args=(r, world, port, *extra, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung (left waiting in a collective)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(results)
