"""Host time of one eager decode call from Python, by route, against the GPU time of the step.

Engines that run the indexer outside a CUDA graph (vLLM's piecewise graphs leave attention ops
eager, prefill is eager) pay the host side of every call: on a small step (1 x 8K: ~8 us of GPU
time) a call whose host side takes longer makes the step host-bound. Routes timed, each on the
same inputs and output:

* ``functional``: ``cpidx.decode_topk`` (the documented entry; eager, it calls the implementation
  directly);
* ``torch_op``: ``torch.ops.cpidx.decode_topk`` called directly (what a compiled graph calls);
* ``decoder``: ``Decoder.decode`` of an explicit ``cpidx.Decoder`` (the binding's method, its
  tensors handed over as DLPack capsules);
* ``graph_replay``: ``torch.cuda.CUDAGraph.replay`` of one captured functional call;
* ``cp_one_rank``: one step of a one-rank ``cpidx.IndexerCPDecode`` (no group: the context-
  parallel class's host side around the same plain decode);
* ``torch_zero_``: ``out.zero_()``, one torch kernel launch, for scale;
* ``piece: ...``: parts of the functional route's host side (and cheaper candidates), alone.

Host us a call: the wall time of N calls issued back to back without a sync, divided by N (N is
small enough that the launch queue never fills, so no call waits for the GPU). GPU us a step:
CUDA events around N graph replays. Median of REPS rounds. JSON to ``--json``.

Run on a GPU machine with the package importable (scripts/device_python.sh installs it):
``python3 bench/host_overhead.py --json out.json``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Optional

import torch

import cpidx

HEADS, TOPK, PAGE = 4, 16, 128


def make_inputs(reqs: int, seq_len: int, gen: torch.Generator) -> dict:
    blocks = (seq_len + PAGE - 1) // PAGE
    pages = reqs * blocks
    dev = "cuda"
    return dict(
        q=torch.randn(reqs, HEADS, 128, generator=gen, device=dev).to(torch.bfloat16),
        k=torch.randn(pages, PAGE, 128, generator=gen, device=dev).to(torch.bfloat16),
        bt=torch.randperm(pages, generator=gen, device=dev).to(torch.int32).view(reqs, blocks),
        sl=torch.full((reqs,), seq_len, dtype=torch.int32, device=dev),
        out=torch.empty(HEADS, reqs, TOPK, dtype=torch.int32, device=dev),
        max_seq_len=seq_len,
    )


def host_us(call, n: int, reps: int) -> float:
    """Median host us a call over `reps` rounds of `n` calls (synchronized between rounds)."""
    per_call = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        per_call.append((time.perf_counter() - t0) * 1e6 / n)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def gpu_us(graph: torch.cuda.CUDAGraph, n: int, reps: int) -> float:
    """Median GPU us a replay (events around n replays)."""
    per_call = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(per_call)


def measure(reqs: int, seq_len: int, n: int, reps: int, profile: Optional[list]) -> list:
    x = make_inputs(reqs, seq_len, torch.Generator(device="cuda").manual_seed(reqs * 7 + seq_len))
    q, k, bt, sl, out, msl = x["q"], x["k"], x["bt"], x["sl"], x["out"], x["max_seq_len"]
    scale = 128 ** -0.5

    def functional():
        cpidx.decode_topk(q, k, bt, sl, 1, out, scale=scale, topk=TOPK, max_seq_len=msl)

    def torch_op():
        torch.ops.cpidx.decode_topk(q, k, bt, sl, out, 1, scale, TOPK, 0, 1, msl, 0, None)

    dec = cpidx.Decoder(total_heads=HEADS, world_size=1, rank=0, max_tokens=reqs,
                        max_seq_len=msl, topk=TOPK, init_blocks=0, local_blocks=1, device=0)
    stream = torch.cuda.current_stream().cuda_stream

    def decoder():
        dec.decode(q, k, bt, sl, 1, out, scale=scale, stream=stream)

    def zero():
        out.zero_()

    cp = cpidx.IndexerCPDecode(total_heads=HEADS, rank=0, world_size=1, max_tokens=reqs,
                               max_seq_len=msl, topk=TOPK, init_blocks=0, local_blocks=1,
                               group=None, device=q.device)

    def cp_one_rank():
        cp(q, k, bt, sl, 1, out, scale=scale)

    # The pieces of the functional route's host side, each alone.
    from cpidx import _api

    dev = q.device

    def device_guard():
        with torch.cuda.device(dev):
            pass

    def current_stream():
        torch.cuda.current_stream(dev).cuda_stream

    def check_inputs():
        _api._check_gpu_inputs(q, k)

    def registry_lookup():
        cpidx.registry.decoder(device=0, heads=HEADS, max_tokens=64, max_seq_len=msl, topk=TOPK,
                               init_blocks=0, local_blocks=1)

    def is_compiling():
        torch.compiler.is_compiling()

    def current_device():
        torch.cuda.current_device()

    def raw_stream():
        torch._C._cuda_getCurrentRawStream(0)

    def one_device():
        _api._check_one_device(q, index_cache=k, block_table=bt, seq_lens=sl, out=out,
                               attention_block_table=None, sparse_block_table_out=None,
                               sparse_context_lens_out=None)

    def op_takes():
        _api._op_takes(None, q, k, bt, sl, out, None, None, None)

    def bump_versions():
        _api._bump_versions(out, None, None, None)

    def decode_now():  # the eager implementation alone: registry, device, stream, binding
        _api._decode_now(q, k, bt, sl, 1, out, scale=scale, topk=TOPK, init_blocks=0,
                         local_blocks=1, max_seq_len=msl)

    # Every route gives the same ids (the check that the timed calls compute the step).
    functional()
    want = out.clone()
    for route in (torch_op, decoder, cp_one_rank):
        out.fill_(-7)
        route()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"{route.__name__} differs from the functional call"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        functional()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        functional()
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), "the replay differs from the eager call"

    rows = []
    shape = f"{reqs} x {seq_len // 1024}K"
    if profile is not None:  # where the routes' host time goes, by function
        for routine in (functional, cp_one_rank):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20 * n):
                routine()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            profile.append(f"== {shape}: {20 * n} {routine.__name__} calls, by own time\n"
                           f"{text.getvalue()}")
    step_gpu = gpu_us(graph, n, reps)
    for name, call in (("functional", functional), ("torch_op", torch_op), ("decoder", decoder),
                       ("graph_replay", graph.replay), ("torch_zero_", zero),
                       ("piece: torch.cuda.device", device_guard),
                       ("piece: current_stream", current_stream),
                       ("piece: _check_gpu_inputs", check_inputs),
                       ("piece: registry.decoder", registry_lookup),
                       ("piece: is_compiling", is_compiling),
                       ("piece: current_device", current_device),
                       ("piece: raw stream", raw_stream),
                       ("piece: _check_one_device", one_device),
                       ("piece: _op_takes", op_takes),
                       ("piece: _bump_versions", bump_versions),
                       ("piece: _decode_now", decode_now), ("cp_one_rank", cp_one_rank)):
        for _ in range(3):
            call()  # warm
        rows.append(dict(shape=shape, route=name, host_us=round(host_us(call, n, reps), 2),
                         step_gpu_us=round(step_gpu, 2)))
    cp.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--calls", type=int, default=200, help="calls a round (default 200)")
    ap.add_argument("--reps", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--profile", help="write a cProfile of the functional and cp_one_rank routes "
                    "here (their calls run under the profiler, apart from the timed rounds)")
    args = ap.parse_args()
    rows = []
    profile = [] if args.profile else None
    for reqs, seq_len in ((1, 8192), (8, 65536)):
        rows += measure(reqs, seq_len, args.calls, args.reps, profile)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write("\n".join(profile))
    print(f"{'shape':>10} {'route':>26} {'host us':>8} {'GPU us':>7}")
    for r in rows:
        print(f"{r['shape']:>10} {r['route']:>26} {r['host_us']:8.2f} {r['step_gpu_us']:7.2f}")
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               cpidx_version=cpidx.__version__, calls=args.calls, reps=args.reps, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
