#!/usr/bin/env python3
"""Summarise a `scripts/device_ab.sh` run: the tree ("base") against each patched tree ("new",
or each patch's name when the run had several).

  ab_summary.py ab.json
      one table a patched build (under a "base vs NAME" line when there are several), one line
      per (config, shape): every run's microseconds of each build, each build's slowest replay
      over its runs (`max_us`, where the rows have it) and, run by run, how far each run's
      slowest replay lies above its median, the change of the means, and `*` where the two
      builds' runs do not overlap (a move beyond the runs' spread). Runs whose `check` is not
      "ok" or "ok(N tie)" (an error, wrong ids) are left out of the times and named in the last
      column.
  ab_summary.py --trace trace_base.txt trace_new.txt
      one line per shape and build from `cpidx bench --trace`: the medians over the CTAs of the
      scoring grid's milestones (PDL wait, first copy issued, first page landed, last copy issued,
      last page landed), the selection's phases counted from its own wait, and the CTAs placed
      late (entry more than 50 us after the median: v41-slow).
  ab_summary.py --configs configs.json [NAME=trace.txt ...]
      the same tree under several bench configs (`scripts/device_configs.sh`): one line per
      (shape, config) with every run's median and slowest replay (us), then the traces' lines,
      one per traced run, named by their config.
  ab_summary.py --collect out.json BUILD|REP|CONFIG|bench.json ...
      gathers the scripts' bench JSONs into the runs file the summaries read (a missing file is
      a run without results).
Standard library only; runs on the GPU machine and here.
"""
import collections
import json
import os
import re
import sys

SHAPE_KEYS = ("mode", "heads", "world", "reqs", "context", "qlen")


def shape_name(key):
    config, mode, heads, world, reqs, context, qlen = key
    where = f"{mode} h{heads}" + (f" P={world}" if mode != "plain" else "")
    ctx = f"{context // 1024}K" if context % 1024 == 0 else str(context)
    return f"{where} {reqs} x {ctx} Q={qlen}" + (f" [{config}]" if config else "")


def summarise_ab(path):
    runs = json.load(open(path))["runs"]
    builds = [b for b in dict.fromkeys(run["build"] for run in runs) if b != "base"]
    tables = [_ab_table(runs, build) for build in builds]
    if len(tables) == 1:
        return tables[0]
    return "\n\n".join(f"base vs {build}:\n{table}" for build, table in zip(builds, tables))


def _ab_table(runs, build):
    table = collections.OrderedDict()
    for run in runs:
        if run["build"] not in ("base", build):
            continue
        which = "base" if run["build"] == "base" else "new"
        for row in run["results"] or []:
            key = (run["config"],) + tuple(row.get(k) for k in SHAPE_KEYS)
            by = table.setdefault(key, {"base": [], "new": [], "base_max": [], "new_max": [],
                                        "base_over": [], "new_over": [], "failed": []})
            check = row.get("check", "ok")
            if check != "ok" and not check.startswith("ok("):  # an error or wrong ids (not
                # "ok(N tie)", swaps inside near ties the contract allows): no time to average
                by["failed"].append(f"{which}: {row.get('check')}")
                continue
            by[which].append(row["us"])
            if "max_us" in row:
                by[which + "_max"].append(row["max_us"])
                by[which + "_over"].append(row["max_us"] - row["us"])
    lines = [f"| shape | base us | {build} us | slowest base / {build} | slowest over median, "
             f"each run: base / {build} | change (means) | |",
             "|---|---|---|---|---|---|---|"]
    for key, by in table.items():
        base, new = by["base"], by["new"]
        failed = "; ".join(dict.fromkeys(by["failed"]))  # runs left out, by build and check
        if not base or not new:
            why = f"check failed ({failed})" if failed else "missing runs"
            lines.append(f"| {shape_name(key)} | {base} | {new} | - | - | - | {why} |")
            continue
        change = sum(new) / len(new) - sum(base) / len(base)
        apart = max(new) < min(base) or min(new) > max(base)
        fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
        slow = lambda xs: f"{max(xs):.2f}" if xs else "-"
        over = lambda xs: ", ".join(f"+{x:.2f}" for x in xs) if xs else "-"
        lines.append(f"| {shape_name(key)} | {fmt(base)} | {fmt(new)} | "
                     f"{slow(by['base_max'])} / {slow(by['new_max'])} | "
                     f"{over(by['base_over'])} / {over(by['new_over'])} | {change:+.2f} "
                     f"({100 * change / (sum(base) / len(base)):+.1f}%) | "
                     f"{'*' if apart else ''}{f' check failed ({failed})' if failed else ''} |")
    return "\n".join(lines)


MILESTONES = ("pdl_waited", "first_issue", "handed_over", "ring_issue", "first_page", "last_issue",
              "last_page", "exit")
SELECT = ("select_loaded", "select_maxima", "select_bound", "select_gathered", "select_ranked",
          "select_exit")
ROW = re.compile(r"^(plain\d*|cp\d+|step\d+)\s")
STAT = re.compile(r"^#\s+(\w+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)")
LATE = re.compile(r"^#\s+late CTAs \([^)]*\):(.*)$")
SLOWEST = re.compile(r"^# slowest replay: (\d+) of \d+, ([-\d.]+) us a call")


def trace_rows(path):
    """(row label, {stat: median}) for each bench row of a `cpidx bench --trace` output, and
    for the slowest replay's trace where the row has one (its label says which replay)."""
    rows, stats, last, slowest = [], {}, None, None
    for line in open(path):
        m = STAT.match(line)
        late = LATE.match(line)
        slow = SLOWEST.match(line)
        if slow:  # the row's last call's trace is done; the slowest replay's follows
            last, stats = stats, {}
            slowest = f"slowest #{slow.group(1)}, {float(slow.group(2)):.2f} us"
        elif m:
            stats[m.group(1)] = float(m.group(3))  # min / median / p90 / max: the median
        elif late:
            entries = late.group(1).split()
            stats["late"] = 0 if entries == ["none"] else len(entries)
        elif ROW.match(line):
            f = line.split()
            label = f"{f[0]} {f[2]} x {f[3]} Q={f[4]} ({f[7]} us)"
            if slowest is None:
                rows.append((label, stats))
            else:
                rows += [(label, last), (f"{label} {slowest}", stats)]
            stats, last, slowest = {}, None, None
    return rows


def summarise_configs(path):
    runs = json.load(open(path))["runs"]
    table = collections.OrderedDict()
    for run in runs:
        for row in run["results"] or []:
            key = ("",) + tuple(row.get(k) for k in SHAPE_KEYS)
            slowest = (f"{row['max_us']:.2f} @{row.get('max_at', '?')}" if "max_us" in row
                       else "-")
            table.setdefault((key, run["config"]), []).append((f"{row['us']:.2f}", slowest))
    lines = ["| shape | config | us | max_us @replay |", "|---|---|---|---|"]
    for (key, config), samples in sorted(table.items(), key=lambda kv: kv[0][0]):
        lines.append(f"| {shape_name(key)} | {config or '(none)'} | "
                     f"{', '.join(u for u, _ in samples)} | {', '.join(m for _, m in samples)} |")
    return "\n".join(lines)


def summarise_traces(named):
    """`named`: (build or config name, trace file) pairs, their rows of a shape together."""
    head = (["shape", "build"] + list(MILESTONES) + [s.replace("select_", "sel:") for s in SELECT]
            + ["late CTAs"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    files = [(name, trace_rows(path)) for name, path in named]
    for i in range(max(len(rows) for _, rows in files)):  # the files' rows of a shape together
        for build, rows in files:
            if i >= len(rows):
                continue
            label, st = rows[i]
            cells = [f"{st[k]:.2f}" if k in st else "-" for k in MILESTONES]
            waited = st.get("select_waited")
            cells += [f"{st[k] - waited:.2f}" if k in st and waited is not None else "-"
                      for k in SELECT]
            cells.append(str(st["late"]) if "late" in st else "-")
            lines.append(f"| {label} | {build} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def collect(out_path, specs):
    runs = []
    for spec in specs:
        build, rep, config, path = spec.split("|", 3)
        results = json.load(open(path))["results"] if os.path.exists(path) else None
        runs.append({"build": build, "rep": int(rep), "config": config, "results": results})
    json.dump({"runs": runs}, open(out_path, "w"), indent=1)


def main(argv):
    if len(argv) == 2 and not argv[1].startswith("-"):
        print(summarise_ab(argv[1]))
    elif len(argv) == 4 and argv[1] == "--trace":
        print(summarise_traces([("base", argv[2]), ("new", argv[3])]))
    elif len(argv) >= 3 and argv[1] == "--collect":
        collect(argv[2], argv[3:])
    elif len(argv) >= 3 and argv[1] == "--configs":
        print(summarise_configs(argv[2]))
        named = [tuple(a.split("=", 1)) for a in argv[3:]]
        if named:
            print()
            print(summarise_traces(named))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
