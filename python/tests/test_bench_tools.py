"""The bench and script tools, without a GPU or cpidx: bench/ab_summary.py (the A/B summary that
scripts/device_ab.sh prints) and device_ab.sh --check, compare_peer.py, ncu_sass.py,
scripts/sass.sh."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "ab_summary", os.path.join(_ROOT, "bench", "ab_summary.py"))
ab_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_summary)


def _row(us, reqs=8, context=262144, mode="plain", world=1, max_us=None):
    row = {"mode": mode, "heads": 4, "world": world, "reqs": reqs, "context": context,
           "qlen": 1, "us": us, "check": "ok"}
    if max_us is not None:
        row["max_us"] = max_us
    return row


def test_ab_summary_groups_runs_and_marks_moves_beyond_the_spread(tmp_path):
    runs = []
    times = [(130.0, 128.0, 20.0, 20.5), (131.0, 128.5, 21.0, 19.9)]  # (base, new) x 2 shapes
    for rep, (b1, n1, b2, n2) in enumerate(times):
        runs.append({"build": "base", "rep": rep + 1, "config": "",
                     "results": [_row(b1, max_us=b1 + 30 * rep),
                                 _row(b2, reqs=1, context=8192, mode="cp", world=2)]})
        runs.append({"build": "new", "rep": rep + 1, "config": "",
                     "results": [_row(n1, max_us=n1 + 1),
                                 _row(n2, reqs=1, context=8192, mode="cp", world=2)]})
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"runs": runs}))
    lines = ab_summary.summarise_ab(str(path)).splitlines()
    assert len(lines) == 4  # header, rule, two shapes
    plain = next(l for l in lines if l.startswith("| plain h4 8 x 256K Q=1 "))
    assert "130.00, 131.00" in plain and "128.00, 128.50" in plain
    assert "-2.25 (-1.7%)" in plain and plain.rstrip().endswith("| * |")  # the runs do not overlap
    assert "| 161.00 / 129.50 |" in plain  # each build's slowest replay over its runs
    assert "| +0.00, +30.00 / +1.00, +1.00 |" in plain  # each run's slowest over its median
    cp = next(l for l in lines if l.startswith("| cp h4 P=2 1 x 8K Q=1 "))
    assert "-0.30" in cp and cp.rstrip().endswith("|  |")  # 19.9-20.5 overlaps 20.0-21.0
    assert "| - / - | - / - |" in cp  # rows without max_us


def test_ab_summary_reports_a_build_without_runs(tmp_path):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"runs": [
        {"build": "base", "rep": 1, "config": "--pdl 0", "results": [_row(10.0)]},
        {"build": "new", "rep": 1, "config": "--pdl 0", "results": None}]}))
    lines = ab_summary.summarise_ab(str(path)).splitlines()
    assert "missing runs" in lines[2] and "[--pdl 0]" in lines[2]


def test_ab_summary_one_table_a_patched_build(tmp_path):
    runs = []
    for rep in (1, 2):
        for build, us in (("base", 20.0), ("v1", 18.0), ("v1+v2", 21.0)):
            runs.append({"build": build, "rep": rep, "config": "",
                         "results": [_row(us + 0.1 * rep)]})
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"runs": runs}))
    text = ab_summary.summarise_ab(str(path))
    v1, v12 = text.split("\n\n")
    assert v1.startswith("base vs v1:\n| shape | base us | v1 us |")
    assert "| 20.10, 20.20 | 18.10, 18.20 |" in v1 and "-2.00 (-9.9%)" in v1
    assert v12.startswith("base vs v1+v2:\n") and "+1.00 (+5.0%)" in v12
    assert "18.10" not in v12  # each table holds base and its own build only


def _patch_creating(tmp_path, name, path):
    patch = tmp_path / f"{name}.patch"
    patch.write_text(f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n"
                     f"+++ b/{path}\n@@ -0,0 +1 @@\n+{name}\n")
    return str(patch)


def test_device_ab_check_applies_each_patch_and_stack_without_a_gpu(tmp_path):
    """scripts/device_ab.sh --check: every PATCH (A+B: B on top of A) applied to a copy of the
    tree, nothing built; exit 1 naming the patch that does not apply, 2 for a missing file."""
    a = _patch_creating(tmp_path, "a", "ab_check_probe_a.txt")
    b = _patch_creating(tmp_path, "b", "ab_check_probe_b.txt")
    clash = _patch_creating(tmp_path, "clash", "ab_check_probe_a.txt")
    script = os.path.join(_ROOT, "scripts", "device_ab.sh")
    run = lambda *args: subprocess.run([script, "--check", *args], cwd=_ROOT, capture_output=True,
                                       text=True, timeout=120)
    done = run(a, f"{a}+{b}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"a = the tree + {a}: applies",
                                        f"a+b = the tree + {a}+{b}: applies"]
    done = run(a)
    assert done.returncode == 0 and done.stdout.startswith("new = the tree + "), done.stderr
    done = run(f"{a}+{clash}")
    assert done.returncode == 1 and f"{clash} does not apply" in done.stdout + done.stderr
    done = run(str(tmp_path / "missing.patch"))
    assert done.returncode == 2 and "no patch file" in done.stderr
    assert not os.path.exists(os.path.join(_ROOT, "ab_check_probe_a.txt"))  # the tree untouched


_peer_spec = importlib.util.spec_from_file_location(
    "compare_peer", os.path.join(_ROOT, "bench", "compare_peer.py"))
compare_peer = importlib.util.module_from_spec(_peer_spec)
_peer_spec.loader.exec_module(compare_peer)


def test_ab_summary_leaves_out_runs_whose_check_failed(tmp_path):
    # An errored run reports 0 us and a wrong one a time for wrong ids: neither is averaged.
    runs = [{"build": "base", "rep": 1, "config": "", "results": [_row(8.4), _row(9.0, reqs=1)]},
            {"build": "new", "rep": 1, "config": "",
             "results": [dict(_row(0.0), check="create: cudaErrorInvalidConfiguration"),
                         dict(_row(8.1, reqs=1), check="FAIL(12)")]},
            {"build": "base", "rep": 2, "config": "", "results": [_row(8.5), _row(9.1, reqs=1)]},
            {"build": "new", "rep": 2, "config": "", "results": [_row(8.3), _row(8.9, reqs=1)]}]
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"runs": runs}))
    lines = ab_summary.summarise_ab(str(path)).splitlines()
    big = next(l for l in lines if l.startswith("| plain h4 8 x 256K Q=1 "))
    assert "| 8.40, 8.50 | 8.30 |" in big and "-0.15 (-1.8%)" in big
    assert big.rstrip().endswith("check failed (new: create: cudaErrorInvalidConfiguration) |")
    one = next(l for l in lines if l.startswith("| plain h4 1 x 256K Q=1 "))
    assert "| 9.00, 9.10 | 8.90 |" in one and "check failed (new: FAIL(12))" in one
    only_failed = [{"build": "base", "rep": 1, "config": "",
                    "results": [dict(_row(0.0), check="create: out of memory")]},
                   {"build": "new", "rep": 1, "config": "", "results": [_row(8.0)]}]
    path.write_text(json.dumps({"runs": only_failed}))
    line = ab_summary.summarise_ab(str(path)).splitlines()[2]  # no division by zero
    assert "check failed (base: create: out of memory)" in line


def test_ab_summary_averages_near_tie_runs(tmp_path):
    # "ok(N tie)": ids equal to the reference's but for swaps inside near ties, a passed check.
    runs = [{"build": "base", "rep": 1, "config": "", "results": [_row(8.4)]},
            {"build": "new", "rep": 1, "config": "",
             "results": [dict(_row(8.2), check="ok(2 tie)")]}]
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"runs": runs}))
    line = ab_summary.summarise_ab(str(path)).splitlines()[2]
    assert "| 8.40 | 8.20 |" in line and "check failed" not in line


def test_compare_peer_never_judges_a_failed_or_off_method_row(capsys):
    small = dict(_row(0.0, reqs=1, context=8192), check="create: cudaErrorInvalidConfiguration",
                 gbps=0.0)
    wrong = dict(_row(5.0, reqs=1, context=8192), check="FAIL(12)", gbps=420.0)
    in_l2 = dict(_row(4.0, reqs=1, context=8192), rotated_mb=16.0, gbps=520.0)
    fine = dict(_row(5.0, reqs=1, context=8192), rotated_mb=512.0, gbps=420.0)
    compare_peer.report({"results": [small, wrong, in_l2, fine], "replays": 10})
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[0].endswith("| <= 0.6x peer | check: create: cudaErrorInvalidConfiguration |")
    assert lines[1].endswith("| check: FAIL(12) |")
    assert lines[2].endswith("| off-method: 16 MiB rotated |")
    assert lines[3].endswith("| <= 0.6x peer | met |")  # 5.0 us against the peer's 8.9
    compare_peer.report({"results": [fine], "replays": 3})
    assert capsys.readouterr().out.splitlines()[2].endswith("| off-method: 3 replays |")


def test_compare_peer_judges_only_runs_on_the_targets_card(capsys, tmp_path, monkeypatch):
    # TARGETS.md's numbers and the peer's are the H200's: an H100 run's rows are shown, not
    # judged, in the peer table and in fp8 against bf16; a JSON without `device` (older) is.
    fine = dict(_row(5.0, reqs=1, context=8192), rotated_mb=512.0, gbps=420.0)
    compare_peer.report({"results": [fine], "replays": 10, "device": "NVIDIA H100 80GB HBM3"})
    assert capsys.readouterr().out.splitlines()[2].endswith(
        "| off-method: NVIDIA H100 80GB HBM3, not an H200 |")
    for device in ("NVIDIA H200", None):
        run = {"results": [fine], "replays": 10}
        if device:
            run["device"] = device
        compare_peer.report(run)
        assert capsys.readouterr().out.splitlines()[2].endswith("| <= 0.6x peer | met |")
    paths = []
    for dtype, us in (("bf16", 130.0), ("fp8", 70.0)):
        run = {"dtype": dtype, "replays": 10, "device": "NVIDIA H100 80GB HBM3",
               "results": [dict(_row(us), gbps=3800.0, rotated_mb=537.0)]}
        paths.append(tmp_path / f"{dtype}.json")
        paths[-1].write_text(json.dumps(run))
    monkeypatch.setattr(sys, "argv", ["compare_peer.py"] + [str(p) for p in paths])
    compare_peer.main()
    out = capsys.readouterr().out.splitlines()
    # fp8 against bf16 of the same card: the ratio shown, not judged
    assert out[4].endswith("| 70.0 | 130.0 | 1.86 | 3800 | >= 1.8x bf16 | off-method: NVIDIA "
                           "H100 80GB HBM3, not an H200 |"), out[4]
    # a bf16 row of another card is no partner
    h200 = [dict(_row(130.0), gbps=3800.0, rotated_mb=537.0, replays=10, device="NVIDIA H200")]
    h100 = dict(h200[0], us=70.0, device="NVIDIA H100 80GB HBM3")
    assert compare_peer.fp8_table([h100], h200)[2].endswith("| no bf16 row |")
    assert compare_peer.fp8_table([dict(h100, device="NVIDIA H200")], h200)[2].endswith(
        "| 1.86 | 3800 | >= 1.8x bf16 | met |")
    # a row without `device` (an older JSON) pairs with any, and a GH200 is not an H200
    older = {k: v for k, v in h100.items() if k != "device"}
    assert compare_peer.fp8_table([older], h200)[2].endswith("| 1.86 | 3800 | >= 1.8x bf16 | met |")
    assert compare_peer.off_card(h100, {"device": "NVIDIA GH200 480GB"}) is not None
    assert compare_peer.off_card(h100, {"device": "NVIDIA H200 NVL"}) is None


def test_fp8_rows_are_judged_against_the_same_bf16_shapes():
    bf16 = [_row(130.0), _row(8.0, reqs=1, context=8192), _row(40.0, reqs=8, context=65536)]
    fp8 = [dict(_row(70.0), gbps=3800.0), dict(_row(8.5, reqs=1, context=8192), gbps=120.0),
           dict(_row(100.0, reqs=64, context=262144), gbps=2900.0),
           dict(_row(30.0, reqs=8, context=65536), gbps=2200.0, check="ids differ")]
    lines = compare_peer.fp8_table(fp8, bf16)
    assert len(lines) == 2 + len(fp8)
    assert lines[2] == ("| plain | 4 | 1 | 8 | 256K | 1 | 70.0 | 130.0 | 1.86 | 3800 | "
                        ">= 1.8x bf16 | met |")  # 2M tokens: item 5 applies
    assert lines[3].endswith("| 8.5 | 8.0 | 0.94 | 120 | - |  |")  # small: no target
    assert lines[4].endswith("| - | - | 2900 | >= 1.8x bf16 | no bf16 row |")
    assert lines[5].endswith("| check: ids differ |")
    slow = compare_peer.fp8_table([dict(_row(80.0), gbps=3300.0)], bf16)
    assert slow[2].endswith("| 1.62 | 3300 | >= 1.8x bf16 | missed |")


def test_compare_peer_judges_each_row_by_the_target_that_covers_it(capsys):
    # TARGETS.md item 1 is Q=1 (any heads), item 2 Q=4 with 4 heads: a 1-head Q=4 row at 2M
    # tokens has no target (it was judged by item 2 before); a 4-head Q=4 row has item 2's.
    one_head = dict(_row(131.0), heads=1, qlen=4, gbps=4096.0, rotated_mb=537.0)
    four_heads = dict(_row(132.4), qlen=4, gbps=4052.0, rotated_mb=537.0)
    cp = dict(_row(261.4, context=1048576, mode="cp", world=2), qlen=4, gbps=4108.0,
              rotated_mb=1073.0)
    q1 = dict(_row(130.5), heads=1, gbps=4400.0, rotated_mb=537.0)
    compare_peer.report({"results": [one_head, four_heads, cp, q1], "replays": 10})
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[0].endswith("| 4096 | - |  |")
    assert lines[1].endswith("| >= 4.2 TB/s | missed |")
    assert lines[2].endswith("| >= 4.2 TB/s | missed |")  # a CP rank scores all 4 heads
    assert lines[3].endswith("| >= 4.3 TB/s | met |")


def test_compare_peer_names_an_item_3_bound_under_the_datasheet_floor(capsys):
    # Plain 1 head, 8 x 64K: 134 MB at 4.8 TB/s take 27.9 us, over 0.6x the peer's 40.5 us.
    under = dict(_row(41.2, context=65536), heads=1, gbps=3258.0, floor_us=29.79,
                 rotated_mb=537.0)
    # 1 x 256K: 67 MB take 14.0 us, under 0.6x the peer's 26.3: an ordinary miss.
    above = dict(_row(24.6, reqs=1), heads=1, gbps=2722.0, floor_us=14.92, rotated_mb=537.0)
    fast = dict(above, us=15.0)
    compare_peer.report({"results": [under, above, fast], "replays": 10})
    lines = capsys.readouterr().out.splitlines()[2:]
    assert lines[0].endswith("| missed (0.6x peer 24.3 us < 27.9 us at 4.8 TB/s) |")
    assert lines[1].endswith("| <= 0.6x peer | missed |")
    assert lines[2].endswith("| <= 0.6x peer | met |")


def test_compare_peer_judges_near_tie_rows_and_keeps_the_method_for_fp8_and_steps(
        capsys, tmp_path):
    # "ok(N tie)": ids equal to the reference's but for swaps inside near ties, a pass.
    tie = dict(_row(5.0, reqs=1, context=8192), check="ok(3 tie)", rotated_mb=512.0, gbps=420.0)
    compare_peer.report({"results": [tie], "replays": 10})
    assert capsys.readouterr().out.splitlines()[2].endswith("| <= 0.6x peer | met |")
    # fp8 rows carry their run's replays (main()): an off-method fp8 row is not judged, and an
    # off-method bf16 row is no partner.
    bf16 = [dict(_row(130.0), replays=10), dict(_row(480.0, context=1048576), replays=3)]
    fp8 = [dict(_row(70.0), gbps=3800.0, replays=3),
           dict(_row(250.0, context=1048576), gbps=4300.0, replays=10),
           dict(_row(71.0, reqs=8), gbps=3790.0, check="ok(1 tie)", replays=10)]
    lines = compare_peer.fp8_table(fp8, bf16)
    assert lines[2].endswith("| off-method: 3 replays |")
    assert lines[3].endswith("| no bf16 row |")
    assert lines[4].endswith("| 1.83 | 3790 | >= 1.8x bf16 | met |")
    # From the files (main()): each fp8 row takes its run's replays.
    for name, dtype, replays, rows in (("b.json", "bf16", 10, [dict(_row(130.0), gbps=4130.0)]),
                                       ("f.json", "fp8", 3, [dict(_row(70.0), gbps=3800.0)])):
        (tmp_path / name).write_text(json.dumps({"dtype": dtype, "replays": replays,
                                                 "results": rows}))
    argv = sys.argv
    try:
        sys.argv = ["compare_peer.py", str(tmp_path / "b.json"), str(tmp_path / "f.json")]
        compare_peer.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out.splitlines()
    assert out[4].endswith("| off-method: 3 replays |")
    # Step rows are judged by their run's replays too.
    step = {"exchange": "peer", "world": 2, "reqs": 1, "context": 8192, "qlen": 1, "us": 11.5,
            "floor_us": 1.0, "exchange_us": 4.5, "check": "ok"}
    compare_peer.print_steps([step], "one process per GPU", {"replays": 3})
    assert capsys.readouterr().out.splitlines()[-1].endswith("| <= 14 us | off-method: 3 replays |")
    compare_peer.print_steps([step], "one process per GPU", {"replays": 10})
    assert capsys.readouterr().out.splitlines()[-1].endswith("| <= 14 us | met |")


_TRACE = """# trace over 264 CTAs: min / median / p90 / max (us; n_*: counts)
#   pdl_waited           4.54      {wait:.2f}      7.23      7.55
#   first_issue          6.56      6.91     10.88     13.06
#   last_page          112.38    127.39    129.79    131.30
#   select_waited       132.54    132.54    132.54    132.54  (32 CTAs)
#   select_ranked       135.01    135.14    135.39    135.62  (32 CTAs)
#   select_exit         135.71    {exit:.2f}    136.13    136.26  (32 CTAs)
#   late CTAs (entry > median + 50 us; cta:sm:entry us:pages):{late}
plain4      4    8   262144   1     1/2         536.7     137.4      3907     137.1     119.3   264/3    ok
"""


def test_trace_summary_puts_both_builds_of_a_shape_together(tmp_path):
    base, new = tmp_path / "base.txt", tmp_path / "new.txt"
    base.write_text(_TRACE.format(wait=4.54, exit=135.94, late=" none")
                    + _TRACE.format(wait=3.0, exit=100.0, late=" 17:40:515.2:64 301:7:516.0:70"))
    new.write_text(_TRACE.format(wait=4.00, exit=134.94, late=" none"))
    lines = ab_summary.summarise_traces([("base", str(base)), ("new", str(new))]).splitlines()
    assert [l.split("|")[2].strip() for l in lines[2:]] == ["base", "new", "base"]
    cells = [c.strip() for c in lines[3].split("|")]
    assert cells[1] == "plain4 8 x 262144 Q=1 (137.4 us)"
    assert cells[3] == "4.00"  # the PDL wait's median
    assert cells[-3] == "2.40"  # select_exit - select_waited
    assert cells[-2] == "0"  # no CTA placed late
    assert [c.strip() for c in lines[4].split("|")][-2] == "2"  # two placed late
    assert "-" in cells  # milestones the trace did not print


def test_trace_summary_gives_the_slowest_replay_its_own_row(tmp_path):
    # The bench prints the last call's trace, then the slowest replay's, then the row.
    last, slow = _TRACE.split("plain4")[0], _TRACE.format(wait=9.5, exit=170.0, late=" none")
    path = tmp_path / "trace.txt"
    path.write_text(last.format(wait=4.54, exit=135.94, late=" none")
                    + "# slowest replay: 42 of 100, 171.25 us a call (median 137.40); its last call:\n"
                    + slow + _TRACE.format(wait=4.0, exit=134.0, late=" none"))
    rows = ab_summary.trace_rows(str(path))
    assert [label for label, _ in rows] == [
        "plain4 8 x 262144 Q=1 (137.4 us)",
        "plain4 8 x 262144 Q=1 (137.4 us) slowest #42, 171.25 us",
        "plain4 8 x 262144 Q=1 (137.4 us)"]  # a row without a slowest block, as before
    assert rows[0][1]["pdl_waited"] == 4.54 and rows[0][1]["select_exit"] == 135.94
    assert rows[1][1]["pdl_waited"] == 9.5 and rows[1][1]["select_exit"] == 170.0
    assert rows[2][1]["pdl_waited"] == 4.0


def test_configs_summary_lists_each_configs_runs_and_slowest_replays(tmp_path, capsys):
    runs = []
    for rep in (1, 2):
        runs.append({"build": "base", "rep": rep, "config": "",
                     "results": [dict(_row(512.0 + rep), max_us=540.0 + rep, max_at=7 * rep)]})
        runs.append({"build": "base", "rep": rep, "config": "--neighbour-us 20",
                     "results": [dict(_row(508.0 + rep), max_us=510.0 + rep, max_at=rep)]})
    runs.append({"build": "base", "rep": 3, "config": "", "results": [_row(511.5)]})  # older
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"runs": runs}))
    lines = ab_summary.summarise_configs(str(path)).splitlines()
    assert len(lines) == 4  # header, rule, one shape under two configs
    assert lines[2] == ("| plain h4 8 x 256K Q=1 | (none) | 513.00, 514.00, 511.50 | "
                        "541.00 @7, 542.00 @14, - |")
    assert lines[3] == ("| plain h4 8 x 256K Q=1 | --neighbour-us 20 | 509.00, 510.00 | "
                        "511.00 @1, 512.00 @2 |")
    trace = tmp_path / "c0.txt"
    trace.write_text(_TRACE.format(wait=4.54, exit=135.94, late=" none"))
    assert ab_summary.main(["ab_summary.py", "--configs", str(path), f"c0={trace}"]) == 0
    out = capsys.readouterr().out
    assert "| plain4 8 x 262144 Q=1 (137.4 us) | c0 |" in out


def test_collect_gathers_bench_jsons_into_runs(tmp_path):
    bench = tmp_path / "run_0.json"
    bench.write_text(json.dumps({"device": "H200", "results": [_row(77.0)]}))
    out = tmp_path / "runs.json"
    assert ab_summary.main(["ab_summary.py", "--collect", str(out),
                            f"base|1|--neighbour-us 20|{bench}",
                            f"new|2||{tmp_path / 'cut_by_its_time_limit.json'}"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs == [{"build": "base", "rep": 1, "config": "--neighbour-us 20",
                     "results": [_row(77.0)]},
                    {"build": "new", "rep": 2, "config": "", "results": None}]


def test_ab_summary_usage_on_bad_arguments(capsys):
    assert ab_summary.main(["ab_summary.py"]) == 2
    assert "device_ab.sh" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code, stream", [(["compare_peer.py", "--help"], 0, "out"),
                                                 (["compare_peer.py"], 2, "err")])
def test_compare_peer_prints_its_usage(monkeypatch, capsys, argv, code, stream):
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        compare_peer.main()
    assert done.value.code == code
    out, err = capsys.readouterr()
    shown, other = (out, err) if stream == "out" else (err, out)
    assert "Usage: compare_peer.py bench.json" in shown
    assert "Usage" not in other


_sass_spec = importlib.util.spec_from_file_location(
    "ncu_sass", os.path.join(_ROOT, "bench", "ncu_sass.py"))
ncu_sass = importlib.util.module_from_spec(_sass_spec)
_sass_spec.loader.exec_module(ncu_sass)


def _sass_csv(tmp_path, instructions):
    """A file shaped as `ncu --page source --csv --print-source sass` writes it, gzipped."""
    import csv
    import gzip
    names = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
             "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal",
             "L1 Wavefronts Shared Excessive"]
    path = tmp_path / "ncu_1_sass.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "score_topk_kernel"])
        w.writerow(names)
        for row in instructions:
            w.writerow(row)
    return str(path)


def test_ncu_sass_sums_by_opcode_region_and_shared_wavefronts(tmp_path):
    path = _sass_csv(tmp_path, [
        ["0x7f0000a0100", "      LDS.64 R38, [R11]", "40", "200000", "1600000", "400000",
         "1200000"],
        ["0x7f0000a0110", "      F2FP.F16.E4M3.UNPACK_B R68, R38", "50", "400000", "0", "0", "0"],
        ["0x7f0000a0200", "@!P2  STS [R13+0x1180], R14", "10", "100", "100", "100", "0"],
        ["0x7f0000a0210", "      F2FP.F16.E4M3.UNPACK_B R70, R38.H1", "0", "400000", "0", "0",
         "0"],
    ])
    rows = ncu_sass.read(path)
    assert len(rows) == 4
    ops = ncu_sass.by_opcode(rows, 1000)
    assert ops[0].split()[:3] == ["F2FP", "800.0", "50"]  # both widenings, the predicate dropped
    assert any(l.split()[:2] == ["STS", "0.1"] for l in ops)
    regions = ncu_sass.by_region(rows, 1000, [(0xa0110, "score"), (0xa0200, "maxima")])
    assert [l.split()[:3] for l in regions] == [
        ["before", "200.0", "40"], ["score", "400.0", "50"], ["maxima", "400.1", "10"]]
    shared = ncu_sass.shared_accesses(rows)
    assert shared[1].startswith("a0100 200000 1600000 400000 1200000 LDS.64")
    assert len(shared) == 3 and shared[-1] == "# totals: 200100 1600100 400100 1200000"
    assert [l.split()[0] for l in ncu_sass.listing(rows, 1000, 0.3)] == ["a0100", "a0110", "a0210"]


_NVCC = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")


def _sass(tmp_path, *args):
    """scripts/sass.sh with ARGS, its output under tmp_path, as on CI (no cuobjdump on PATH)."""
    return subprocess.run(
        [os.path.join(_ROOT, "scripts", "sass.sh"), *args],
        env=dict(os.environ, OUT=str(tmp_path), CPIDX_CUDA_TOOLS="", PATH="/usr/bin:/bin"),
        capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not os.access(_NVCC, os.X_OK), reason="no nvcc")
def test_sass_script_prints_each_kernels_registers_and_spills(tmp_path):
    """scripts/sass.sh on a small source: one registers row per matching kernel, and one
    instructions row where cuobjdump + nvdisasm are in /usr/local/cuda/bin (the GPU machine)."""
    done = _sass(tmp_path, os.path.join(_ROOT, "src", "cuda", "merge.cu"), "merge_topk")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "merge_topk_kernel" in line]
    rows = [line for line in lines if "bytes stack frame" in line]
    assert len(rows) == 1, done.stdout
    assert re.match(r"^\d+ +\d+ bytes stack frame, \d+ bytes spill stores, \d+ bytes spill loads",
                    rows[0]), rows[0]
    sass = [line for line in lines if line not in rows]
    assert len(sass) <= 1, done.stdout
    assert all(re.match(r"^ *\d+ instructions +\d+ LDS ", l) for l in sass), done.stdout
    assert "pack_queries" not in done.stdout  # the regex picks the kernels


_SPILL_SOURCE = r"""
__global__ void __launch_bounds__(1024, 2) spilling_kernel(const float4* in, float4* out) {
  float4 v[24];  // 96 live floats under a 32-register bound
#pragma unroll
  for (int i = 0; i < 24; ++i) v[i] = in[threadIdx.x + i * 1024];
#pragma unroll
  for (int i = 0; i < 24; ++i) out[threadIdx.x + i * 1024] = v[23 - i];
}
__global__ void quiet_kernel(const float* in, float* out) {
  out[threadIdx.x] = 2.f * in[threadIdx.x];
}
"""


@pytest.mark.skipif(not os.access(_NVCC, os.X_OK), reason="no nvcc")
def test_sass_script_no_spills_fails_on_a_spilling_kernel_or_no_match(tmp_path):
    """scripts/sass.sh --no-spills (the check ctest runs on select_topk and score_topk): exit 0
    when every matching kernel is free of spills, 1 naming the ones that spill, 1 when none
    matches."""
    source = tmp_path / "spills.cu"
    source.write_text(_SPILL_SOURCE)
    quiet = _sass(tmp_path, "--no-spills", str(source), "quiet_kernel")
    assert quiet.returncode == 0, quiet.stderr
    assert "no spills in 1 kernel(s)" in quiet.stdout
    spilling = _sass(tmp_path, "--no-spills", str(source), "kernel")
    assert spilling.returncode == 1, spilling.stdout
    assert "spilling_kernel" in spilling.stderr and "quiet_kernel" not in spilling.stderr
    none = _sass(tmp_path, "--no-spills", str(source), "no_such_kernel")
    assert none.returncode == 1 and "no kernel matches" in none.stderr
