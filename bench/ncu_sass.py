#!/usr/bin/env python3
"""Read the per-instruction CSV of `scripts/device_ncu.sh --sass` (ncu_<N>_sass.csv.gz).

Counts are per unit of work: pass --per N (e.g. the step's pages) and every instruction count
is divided by it.

  ncu_sass.py FILE --per N ops
      executions and stall samples by opcode (predicates and modifiers dropped), largest first.
  ncu_sass.py FILE --per N list [--min X]
      every instruction executed at least X times a unit (default 0.3): address (low 5 hex
      digits), executions a unit, stall samples, the SASS.
  ncu_sass.py FILE --per N regions ADDR:NAME [ADDR:NAME ...]
      executions a unit and stall samples summed from each address (low 5 hex digits, as
      `list` prints them) to the next; what lies before the first is "before".
  ncu_sass.py FILE shared
      each shared-memory load or store executed over 1e5 times: executions, wavefronts, ideal
      wavefronts, excessive wavefronts (bank conflicts), and the totals.
Standard library only; runs on the GPU machine and here.
"""
import argparse
import collections
import csv
import gzip
import re
import signal
import sys


def read(path):
    with gzip.open(path, "rt") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) == len(names) and r[0].startswith("0x"):
            out.append(dict(zip(names, r)))
    if not out:
        sys.exit(f"{path}: no SASS rows")
    return out


def num(row, key):
    v = row.get(key, "") or "0"
    return float(v.replace(",", ""))


def opcode(sass):
    s = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return s.split()[0].split(".")[0] if s else "?"


EXEC, STALLS = "Instructions Executed", "Warp Stall Sampling (All Samples)"
SHARED = ("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "L1 Wavefronts Shared Excessive")


def header(rows, per):
    total = sum(num(r, EXEC) for r in rows)
    stalls = sum(num(r, STALLS) for r in rows)
    return (f"# {len(rows)} instructions, {total / per:.1f} executions a unit, "
            f"{stalls:.0f} stall samples")


def _share(s, total):
    return f"{s:7.0f} ({100 * s / (total or 1.0):4.1f}%)"


def by_opcode(rows, per):
    """Lines of opcode, executions a unit and stall samples, the most executed first."""
    e, s = collections.Counter(), collections.Counter()
    for r in rows:
        op = opcode(r["Source"])
        e[op] += num(r, EXEC) / per
        s[op] += num(r, STALLS)
    total = sum(s.values())
    return [f"{op:<14} {v:9.1f} {_share(s[op], total)}" for op, v in e.most_common()]


def by_region(rows, per, bounds):
    """bounds: [(address, name)]; each region runs from its address to the next one's."""
    bounds = sorted(bounds)
    agg = collections.OrderedDict((n, [0.0, 0.0]) for n in ["before"] + [n for _, n in bounds])
    for r in rows:
        at, name = int(r["Address"][-5:], 16), "before"
        for b, n in bounds:
            if at >= b:
                name = n
        agg[name][0] += num(r, EXEC) / per
        agg[name][1] += num(r, STALLS)
    total = sum(v[1] for v in agg.values())
    return [f"{n:<16} {e:9.1f} {_share(s, total)}" for n, (e, s) in agg.items()]


def listing(rows, per, least):
    return [f"{r['Address'][-5:]} {num(r, EXEC) / per:7.2f} {num(r, STALLS):6.0f} "
            f"{r['Source'].strip()}" for r in rows if num(r, EXEC) / per >= least]


def shared_accesses(rows, least=1e5):
    """Shared loads and stores executed over `least` times, then the totals over all of them."""
    out = ["# address, executions, wavefronts, ideal, excessive, SASS"]
    tot = [0.0] * (1 + len(SHARED))
    for r in rows:
        if not re.search(r"\b(LDS|STS|LDSM)\b", r["Source"]):
            continue
        v = [num(r, EXEC)] + [num(r, k) for k in SHARED]
        tot = [t + x for t, x in zip(tot, v)]
        if v[0] > least:
            out.append(r["Address"][-5:] + " " + " ".join(f"{x:.0f}" for x in v) + " " +
                       r["Source"].strip())
    out.append("# totals: " + " ".join(f"{x:.0f}" for x in tot))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("mode", choices=["ops", "list", "regions", "shared"])
    ap.add_argument("bounds", nargs="*", help="regions: ADDR:NAME ...")
    ap.add_argument("--per", type=float, default=1.0, help="units of work (e.g. pages)")
    ap.add_argument("--min", type=float, default=0.3, help="list: executions a unit at least")
    a = ap.parse_intermixed_args()
    rows = read(a.file)
    print(header(rows, a.per))
    if a.mode == "ops":
        lines = by_opcode(rows, a.per)
    elif a.mode == "list":
        lines = listing(rows, a.per, a.min)
    elif a.mode == "regions":
        lines = by_region(rows, a.per, [(int(b.split(":", 1)[0], 16), b.split(":", 1)[1])
                                        for b in a.bounds])
    else:
        lines = shared_accesses(rows)
    print("\n".join(lines))


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    main()
