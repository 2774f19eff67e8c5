"""Probe: do the GPU prefill and the GPU decode give the same ids, bit for bit, for the same
scores (CONTRACT.md section 4: "Between the GPU paths this holds bit for bit")?

Each prefill token at position ``p`` of a request is also decoded as a one-token request of
length ``p + 1`` over the same block-table row and the same query: the contract's block scores
are the same for both, so the ids must be. Random normal bf16 values (not small integers, whose
dot products are exact in any order), so that where the two kernels sum the 128 products in
another grouping a near tie can come out in another order. Prints, per cache dtype, the share of
(head, token) rows whose ids differ and whether every difference is within the contract's
near-tie rule of the CPU reference (a GPU path against the reference may swap such blocks).
Writes JSON to ``--json``. Run on a GPU machine with the package importable.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import cpidx


def probe(dtype: str, heads: int, topk: int, contexts: list, q_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda", 0)
    msl = max(contexts) + q_len
    reqs = len(contexts)
    blocks = -(-msl // 128)
    pages = reqs * blocks + 3
    cache = torch.randn(pages, 128, 128, generator=torch.Generator().manual_seed(seed))
    cache = cache.to(torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn).to(dev)
    table = torch.from_numpy(rng.permutation(pages)[: reqs * blocks].reshape(reqs, blocks)
                             .astype(np.int32)).to(dev)
    tokens = reqs * q_len
    query = torch.randn(tokens, heads, 128).to(torch.bfloat16).to(dev)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=dev)
    seq = ctx + q_len
    cu = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device=dev)
    scale = 128 ** -0.5
    pre = torch.full((heads, tokens, topk), -7, dtype=torch.int32, device=dev)
    cpidx.prefill_topk(query, cache, table, cu, ctx, seq, pre, scale=scale, topk=topk,
                       init_blocks=1, local_blocks=2, max_seq_len=msl, max_tokens=tokens)
    # The same rows as decode requests of one token: request r's token i at p = ctx[r] + i.
    rows_req = torch.arange(tokens, device=dev) // q_len
    dec_seq = (ctx[rows_req] + torch.arange(tokens, device=dev) % q_len + 1).to(torch.int32)
    dec_table = table[rows_req].contiguous()
    dec = torch.full_like(pre, -9)
    cpidx.decode_topk(query, cache, dec_table, dec_seq, 1, dec, scale=scale, topk=topk,
                      init_blocks=1, local_blocks=2, max_seq_len=msl, max_tokens=tokens)
    torch.cuda.synchronize()
    differ = (pre != dec).any(dim=2)
    # Up to 64 of the differing rows' tokens against the CPU reference of decode (one-token
    # requests are independent), so that each path's own agreement with it shows.
    within = None
    toks = differ.any(dim=0).nonzero().flatten()[:64]  # a sample: the reference is slow
    if toks.numel() > 0:
        bits = (torch.int16, np.uint16) if dtype == "bf16" else (torch.uint8, np.uint8)
        ref = np.zeros((heads, toks.numel(), topk), np.int32)
        host_q = query[toks].contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
        host_cache = cache.view(bits[0]).cpu().numpy().view(bits[1])
        cpidx.decode_topk(host_q, host_cache, dec_table[toks].cpu().numpy(),
                          dec_seq[toks].cpu().numpy(), 1, ref, scale=scale, topk=topk,
                          init_blocks=1, local_blocks=2, max_seq_len=msl)
        ref = torch.from_numpy(ref).to(dev)
        sub = differ[:, toks]

        def equal(ids: torch.Tensor) -> int:
            return int(((ref == ids[:, toks]).all(dim=2) & sub).sum())

        within = dict(differing_rows=int(sub.sum()), prefill_equals_reference=equal(pre),
                      decode_equals_reference=equal(dec))
    return dict(dtype=dtype, heads=heads, topk=topk, contexts=contexts, q_len=q_len,
                rows=heads * tokens, rows_differing=int(differ.sum()),
                sets_differing=int((pre.sort(dim=2).values != dec.sort(dim=2).values)
                                   .any(dim=2).sum()),
                reference=within)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    out = []
    for dtype in ("bf16", "fp8"):
        for seed, contexts in ((1, [16000, 40000, 3000, 64000]), (2, [120000, 9000])):
            r = probe(dtype, 4, 16, contexts, 512, seed)
            print(json.dumps(r))
            out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
