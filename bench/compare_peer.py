#!/usr/bin/env python3
"""Compare a `cpidx bench --json` result with the peer (vLLM's Triton indexer on one H200).

Peer figures: graph-replay microseconds from ../shared/perf/PEER_H200.md (measured 2026-11-29,
run 2): plain decode by (heads, Q, B, L) and context-parallel rank work (score + local top-k +
merge, no exchange) by (P, Q, B, L). Prints a markdown table with our time, the ratio to the
peer, GB/s on the rank's cache bytes and the target each row is judged by (TARGETS.md; a missed
item 3 bound that lies under the rank's bytes read at the datasheet's 4.8 TB/s says so); then,
for `--modes stepP` rows, the whole step on real GPUs against TARGETS.md item 4 (at most the
shard floor + 10 us at B*L >= 2M tokens, at most 14 us at B=1, L=8K).
With an fp8 run (`cpidx bench --dtype fp8 --json`), the peer has nothing to compare (it has no
fp8 cache on this GPU): its rows are set against the same shapes of a bf16 run instead, for
TARGETS.md item 5 (fp8 at least 1.8x faster than bf16 at B*L >= 2M tokens).
A row whose check failed, or measured off the method (on another card than the H200: the JSON's
`device`; fewer than 10 replays; inputs not rotated past the L2), is shown but not judged.
Usage: compare_peer.py bench.json [fp8.json]   (or the fp8 run alone, or the two in any order)
"""
import json
import re
import sys

K8, K64, K256, M1 = 8192, 65536, 262144, 1048576
L = [K8, K64, K256, M1]
# (heads, Q, B) -> [8K, 64K, 256K, 1M] graph us, PEER_H200.md decode table.
PEER_DECODE = {
    (1, 1, 1): [8.6, 13.0, 26.3, 84.8], (1, 1, 8): [12.8, 40.5, 135.2, 518.1],
    (1, 1, 64): [39.8, 266.3, 1045.1, 4198.8],
    (1, 4, 1): [8.9, 13.9, 27.3, 81.8], (1, 4, 8): [11.6, 43.0, 150.5, 586.2],
    (1, 4, 64): [42.0, 277.1, 1083.5, 4364.0],
    (4, 1, 1): [8.9, 14.1, 27.3, 82.1], (4, 1, 8): [11.6, 43.2, 152.0, 582.2],
    (4, 1, 64): [39.6, 277.0, 1035.3, 4328.6],
    (4, 4, 1): [7.4, 14.2, 35.6, 116.4], (4, 4, 8): [11.9, 56.2, 208.0, 783.9],
    (4, 4, 64): [48.2, 335.1, 1313.2, 5236.6],
}
# (P, Q, B) -> rank total us (score + AMD local + AMD merge), PEER_H200.md CP table.
PEER_CP = {
    (2, 1, 1): [11.2, 12.8, 19.4, 57.3], (2, 1, 8): [12.3, 26.7, 75.8, 267.2],
    (2, 1, 64): [26.9, 133.0, 496.6, 1945.9],
    (2, 4, 1): [11.4, 13.0, 19.6, 58.1], (2, 4, 8): [12.6, 27.4, 77.3, 272.7],
    (2, 4, 64): [29.9, 140.4, 521.7, 2049.1],
    (4, 1, 1): [11.2, 12.1, 14.9, 34.0], (4, 1, 8): [11.9, 17.1, 42.6, 139.5],
    (4, 1, 64): [17.2, 73.8, 254.6, 981.2],
    (4, 4, 1): [11.4, 12.4, 15.0, 34.5], (4, 4, 8): [12.2, 17.4, 43.6, 142.4],
    (4, 4, 64): [19.1, 78.2, 266.4, 1030.7],
}


def peer_us(r):
    if r["context"] not in L:
        return None
    i = L.index(r["context"])
    if r["mode"] == "plain":
        row = PEER_DECODE.get((r["heads"], r["qlen"], r["reqs"]))
    else:
        row = PEER_CP.get((r["world"], r["qlen"], r["reqs"]))
    return row[i] if row else None


def target(r):
    tokens = r["reqs"] * r["context"]
    if tokens <= 512 * 1024:
        return "<= 0.6x peer"
    if tokens >= 2 * 1024 * 1024:
        if r["qlen"] == 1:  # item 1: any path, Q=1
            return ">= 4.3 TB/s"
        if r["qlen"] == 4 and r["heads"] == 4:  # item 2: Q=4 with 4 heads (CP rows score all 4)
            return ">= 4.2 TB/s"
    return "-"


L2_ROTATION_MB = 8 * 60  # TARGETS.md: the inputs a replay reads exceed the 60 MiB L2 8 times


def passed(r):
    """Whether a row's ids passed the bench's check: "ok", or "ok(N tie)" (N rows whose ids
    differ from the reference only by swaps within a near tie, which the contract allows)."""
    check = r.get("check", "ok")
    return check == "ok" or check.startswith("ok(")


TARGET_CARD = "H200"  # the card of TARGETS.md's numbers and of PEER_H200.md's


def off_card(r, data):
    """Why a row's card is not the targets' (None when it is, or when the JSON predates the
    field): another card than the H200 (the JSON's `device`: an H100's times say nothing of the
    H200's targets nor of the peer's times there). The device is the run's (`data`), or the
    row's own where main() copied it in."""
    device = data.get("device", r.get("device"))
    if device is not None and not re.search(rf"\b{TARGET_CARD}\b", device):  # not a GH200
        return f"off-method: {device}, not an {TARGET_CARD}"
    return None


def off_method(r, data, card=True):
    """Why a row was not measured as TARGETS.md says (None when it was, or when the JSON
    predates the fields that tell): on another card than the H200 (off_card; not asked with
    card=False), fewer than 10 replays, or inputs that a replay's calls rotate through the L2
    fewer than 8 times (a small --pool-mb: pages read from the L2). The replays are the run's
    (`data`), or the row's own where main() copied them in."""
    why = off_card(r, data) if card else None
    if why:
        return why
    replays = data.get("replays", r.get("replays"))
    if replays is not None and replays < 10:
        return f"off-method: {replays} replays"
    rotated = r.get("rotated_mb")
    if rotated is not None and rotated < L2_ROTATION_MB:
        return f"off-method: {rotated:.0f} MiB rotated"
    return None


# The H200's datasheet HBM3e bandwidth (TARGETS.md's ceilings) and the rate a row's floor_us is
# computed at (`cpidx bench`: the rank's cache bytes at 4.5 TB/s).
DATASHEET_TBPS, BENCH_FLOOR_TBPS = 4.8, 4.5


def datasheet_floor_us(r):
    """The rank's cache bytes read at the datasheet's peak: no kernel runs the row faster."""
    floor = r.get("floor_us")
    return floor * BENCH_FLOOR_TBPS / DATASHEET_TBPS if floor else None


def verdict(r, peer, data=None):
    if not passed(r):  # an error or wrong ids: its time says nothing
        return f"check: {r.get('check')}"
    why = off_method(r, data or {})
    if why:
        return why
    t = target(r)
    if t.startswith("<="):
        if peer and r["us"] <= 0.6 * peer:
            return "met"
        floor = datasheet_floor_us(r)
        if peer and floor and 0.6 * peer < floor:  # the bound asks for more than the HBM gives
            return (f"missed (0.6x peer {0.6 * peer:.1f} us < {floor:.1f} us at "
                    f"{DATASHEET_TBPS} TB/s)")
        return "missed"
    if t.startswith(">="):
        need = 4300 if r["qlen"] == 1 else 4200
        return "met" if r["gbps"] >= need else "missed"
    return ""


def context_text(context):
    return f"{context // 1024}K" if context < M1 else f"{context // M1}M"


def step_target(r):
    """TARGETS.md item 4 for a whole-step row: (text, bound in us) or ("-", None)."""
    if r["reqs"] == 1 and r["context"] == K8:
        return "<= 14 us", 14.0
    if r["reqs"] * r["context"] >= 2 * M1:
        return "<= floor + 10", r["floor_us"] + 10
    return "-", None


def print_steps(rows, processes, data):
    print(f"\nwhole step on real GPUs ({processes}):\n")
    print("| exchange | P | B | L | Q | us | floor + 10 | two gathers alone | target | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        text, bound = step_target(r)
        if not passed(r):
            mark = f"check: {r['check']}"
        elif bound is None:
            mark = ""
        else:
            mark = off_method(r, data) or ("met" if r["us"] <= bound else
                                           f"missed by {r['us'] - bound:.1f}")
        print(f"| {r['exchange']} | {r['world']} | {r['reqs']} | {context_text(r['context'])} | "
              f"{r['qlen']} | {r['us']:.1f} | {r['floor_us'] + 10:.1f} | {r['exchange_us']:.2f} | "
              f"{text} | {mark} |")


def shape_key(r):
    return (r["mode"], r["heads"], r["world"], r["reqs"], r["context"], r["qlen"])


def fp8_table(fp8_rows, bf16_rows):
    """fp8 rows against the bf16 rows of the same shapes (TARGETS.md item 5), as lines. A bf16
    row that failed its check or was measured off the method is no partner; such an fp8 row is
    not judged (rows carry their run's `replays` and `device`, main()). Rows of another card
    than the H200 are set against bf16 rows of the same card (a row without `device`, from an
    older JSON, pairs with any): the ratio is shown, not judged."""
    bf16 = {}
    for r in bf16_rows:
        if passed(r) and off_method(r, {}, card=False) is None:
            bf16.setdefault(shape_key(r), []).append(r)

    def partner(r):
        device = r.get("device")
        return next((b for b in bf16.get(shape_key(r), [])
                     if device is None or b.get("device") in (None, device)), None)

    lines = ["| mode | heads | P | B | L | Q | fp8 us | bf16 us | bf16 / fp8 | fp8 GB/s | target "
             "| |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in fp8_rows:
        other = partner(r)
        large = r["reqs"] * r["context"] >= 2 * M1
        why = off_method(r, {}, card=False)
        if not passed(r):
            speedup, mark = "-", f"check: {r.get('check')}"
        elif why:
            speedup, mark = "-", why
        elif other is None:
            speedup, mark = "-", "no bf16 row"
        else:
            speedup = f"{other['us'] / r['us']:.2f}"
            mark = ("met" if other["us"] >= 1.8 * r["us"] else "missed") if large else ""
            mark = off_card(r, {}) or mark
        bf16_us = f"{other['us']:.1f}" if other else "-"
        lines.append(f"| {r['mode']} | {r['heads']} | {r['world']} | {r['reqs']} | "
                     f"{context_text(r['context'])} | {r['qlen']} | {r['us']:.1f} | "
                     f"{bf16_us} | {speedup} | {r['gbps']:.0f} | "
                     f"{'>= 1.8x bf16' if large else '-'} | {mark} |")
    return lines


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        asked = len(sys.argv) > 1  # --help: usage on stdout; no file: a usage error on stderr
        print(__doc__.strip(), file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    runs = [json.load(open(path)) for path in sys.argv[1:]]
    fp8 = [d for d in runs if d.get("dtype") == "fp8"]
    bf16 = [d for d in runs if d.get("dtype", "bf16") != "fp8"]
    if fp8:
        def rows(runs):  # each row with its run's replays and device, for off_method
            return [dict(r, **{k: d[k] for k in ("replays", "device") if k in d})
                    for d in runs for r in d.get("results", [])]
        print("fp8 against bf16 (TARGETS.md item 5):\n")
        for line in fp8_table(rows(fp8), rows(bf16)):
            print(line)
        if bf16:
            print()
    for data in bf16:
        report(data)


def report(data):
    results = data.get("results", [])
    if results:
        print("| mode | heads | P | B | L | Q | us | peer us | ratio | GB/s | target | |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        peer = peer_us(r)
        ratio = f"{r['us'] / peer:.2f}" if peer else "-"
        print(f"| {r['mode']} | {r['heads']} | {r['world']} | {r['reqs']} | "
              f"{context_text(r['context'])} | {r['qlen']} | "
              f"{r['us']:.1f} | {peer if peer else '-'} | {ratio} | {r['gbps']:.0f} | "
              f"{target(r)} | {verdict(r, peer, data)} |")
    steps = data.get("step_results", [])
    if steps:
        processes = {"mpi": "one process per GPU", "threads": "one process, a thread per GPU"}
        print_steps(steps, processes.get(data.get("step_processes"), "one process, a thread "
                                         "per GPU (a JSON from before v9)"), data)


if __name__ == "__main__":
    main()
