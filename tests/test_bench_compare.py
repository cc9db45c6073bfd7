"""wsattn.bench.compare (before / after rows over several processes) and the rounds of
`scripts/device.sh bench` with BENCH_BASE / BENCH_ROUNDS that feed it (run here with
stand-ins for the GPU commands: the order of the processes and the files they leave)."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from wsattn.bench import compare as cmp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _row(case, impl, ms, status="ok", commit="c0", **extra):
    return {"op": "chunked", "case": case, "impl": impl, "median_ms": ms, "status": status,
            "commit": commit, **extra}


def test_verdicts_by_ranges_over_the_processes():
    ceiling = {"op": "ceiling", "case": "matmul", "impl": "torch", "median_ms": 1.0,
               "status": "ok", "commit": "c0"}
    base = [[ceiling, _row("a", "x", 1.00), _row("b", "x", 2.00), _row("c", "x", 3.0),
             _row("d", "x", 1.0), _row("e", "x", 1.0)],
            [_row("a", "x", 1.02), _row("b", "x", 2.10), _row("c", "x", 3.3),
             _row("d", "x", None, status="error: boom"), _row("e", "x", 1.0)]]
    new = [[_row("a", "x", 0.95, commit="c1"), _row("b", "x", 2.20, commit="c1"),
            _row("c", "x", 3.1, commit="c1"), _row("d", "x", 0.9, commit="c1"),
            _row("f", "x", 1.0, commit="c1")],
           [_row("a", "x", 0.97, commit="c1"), _row("b", "x", 2.30, commit="c1"),
            _row("c", "x", 3.2, commit="c1"), _row("d", "x", 0.9, commit="c1")]]
    res = cmp.compare(base, new)
    rows = {r["case"]: r for r in res["rows"]}
    assert res["base_commits"] == ["c0"] and res["new_commits"] == ["c1"]
    assert "matmul" not in rows  # ceilings are not compared
    assert rows["a"]["verdict"] == "faster" and rows["a"]["ratio"] == pytest.approx(0.96 / 1.01)
    assert rows["b"]["verdict"] == "slower" and rows["b"]["base"] == [2.0, 2.1]
    assert rows["c"]["verdict"] == "within spread"  # 3.1-3.2 inside 3.0-3.3
    # a failed row is listed, not ranged: one base value is left against the new two
    assert rows["d"]["base"] == [1.0] and rows["d"]["base_failed"] == ["error: boom"]
    assert rows["d"]["verdict"] == "faster"
    assert rows["e"]["verdict"] == "only in base" and rows["e"]["ratio"] is None
    assert rows["f"]["verdict"] == "only in new"
    # the chance of such a verdict with no change: 2 / C(2 + 2, 2); d has 1 + 2 values
    assert rows["a"]["chance"] == pytest.approx(2 / 6) and rows["d"]["chance"] == pytest.approx(2 / 3)
    assert rows["e"]["chance"] is None
    table = cmp.format_table(res)
    assert "base failed: error: boom" in table and "within spread" in table
    assert " 0.333  faster" in table


def test_chance_of_disjoint_ranges_without_a_change():
    """2 / C(nb + nn, nb), checked against counting the orders of 2n exchangeable values."""
    import itertools
    import math
    for nb, nn in ((1, 1), (2, 2), (3, 3), (4, 4), (2, 3)):
        labels = [0] * nb + [1] * nn
        orders = set(itertools.permutations(labels))
        disjoint = sum(1 for o in orders if list(o) == sorted(o) or list(o) == sorted(o)[::-1])
        assert cmp.chance_if_no_change(nb, nn) == pytest.approx(min(1.0, disjoint / len(orders)))
    assert cmp.chance_if_no_change(3, 3) == pytest.approx(0.1)
    assert cmp.chance_if_no_change(5, 5) == pytest.approx(2 / math.comb(10, 5))


def test_a_ratio_metric_reads_higher_and_lower():
    base = [[_row("a", "x", 1.0, ratio_contiguous=r)] for r in (0.94, 0.93)]
    new = [[_row("a", "x", 1.0, ratio_contiguous=r)] for r in (0.96, 0.97)]
    (row,) = cmp.compare(base, new, "ratio_contiguous")["rows"]
    assert row["verdict"] == "higher" and row["new_median"] == pytest.approx(0.965)
    (row,) = cmp.compare(new, base, "ratio_contiguous")["rows"]
    assert row["verdict"] == "lower"


def test_main_reads_files_and_writes_json(tmp_path, capsys):
    paths = {}
    sides = {"b1": [_row("a", "x", 1.0)], "n1": {"rows": [_row("a", "x", 0.5)]}}
    for name, rows in sides.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(rows))
    out = tmp_path / "cmp.json"
    assert cmp.main(["--base", str(paths["b1"]), "--new", str(paths["n1"]),
                     "--json", str(out)]) == 0
    assert "faster" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["ratio"] == pytest.approx(0.5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"environment": {}}))
    with pytest.raises(ValueError, match="bad.json: not a `wsattn bench --json` file"):
        cmp.load_rows(bad)


FAKE_PYTHON = r"""#!/usr/bin/env bash
# `python3 -m wsattn.cli bench --json F [--plot P | --no-plot] ...`: one row, slower when
# PYTHONPATH holds the base's src/; anything else: the real interpreter
if [ "$1 $2 $3" = "-m wsattn.cli bench" ]; then
  shift 3; json=""; plot=""
  while [ $# -gt 0 ]; do
    case "$1" in --json) json=$2; shift ;; --plot) plot=$2; shift ;; esac; shift
  done
  ms=1.0; case "$PYTHONPATH" in *"$FAKE_BASE"*) ms=2.0 ;; esac
  printf '[{"op": "x", "case": "c", "impl": "i", "median_ms": %s, "status": "ok", ' "$ms" > "$json"
  printf '"ratio_contiguous": 0.95, "commit": "%s"}]\n' "$WSATTN_COMMIT" >> "$json"
  [ -z "$plot" ] || touch "$plot"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_device_bench_rounds_alternate_and_compare(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    stand_ins = {"python3": FAKE_PYTHON, "nvidia-smi": "#!/usr/bin/env bash\necho gpu\n"}
    for name, text in stand_ins.items():
        (shims / name).write_text(text)
        (shims / name).chmod(stat.S_IRWXU)
    base = tmp_path / "base"
    (base / "src" / "wsattn").mkdir(parents=True)
    (base / "COMMIT").write_text("c0\n")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "OUT": str(out),
           "REAL_PYTHON": sys.executable, "FAKE_BASE": str(base), "BENCH_BASE": str(base),
           "BENCH_ROUNDS": "2", "BENCH_ARGS": "chunked --quick", "WSATTN_COMMIT": "c1",
           "BENCH_COMPARE_METRICS": "ratio_contiguous"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "bench"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (out / "device.log").read_text()
    order = [line.split("(limit")[0].split("== ")[1].strip()
             for line in log.splitlines() if line.startswith("device: == ")]
    assert order == ["bench chunked (base_r1)", "bench chunked_r1", "bench chunked (base_r2)",
                     "bench chunked_r2", "compare chunked", "compare chunked ratio_contiguous"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["device.log", "bench_base_r1.json", "bench_r1.json", "bench_base_r2.json",
         "bench_r2.json", "bench.png", "bench_compare.json",
         "bench_compare_ratio_contiguous.json"])
    doc = json.loads((out / "bench_compare.json").read_text())
    assert doc["base_commits"] == ["c0"] and doc["new_commits"] == ["c1"]
    (row,) = doc["rows"]
    assert row["base"] == [2.0, 2.0] and row["new"] == [1.0, 1.0] and row["verdict"] == "faster"
    # the extra metric, normalised within each process: the same 0.95 on both sides
    doc = json.loads((out / "bench_compare_ratio_contiguous.json").read_text())
    (row,) = doc["rows"]
    assert doc["metric"] == "ratio_contiguous" and row["verdict"] == "within spread"


FAKE_SMI = r"""#!/usr/bin/env bash
# nvidia-smi: a clock log line every 50 ms under -lms (until killed); the newer reason
# field is known; anything else prints one line
case "$*" in
  *-lms*) echo "timestamp, index, clocks.sm [MHz]"
          while true; do echo "2026/01/01 00:00:00.000, 0, 1980"; sleep 0.05; done ;;
  *clocks_event_reasons.active*noheader*) exit 0 ;;
  *) echo gpu ;;
esac
"""


def test_device_clock_log_runs_beside_the_parts_and_stops(tmp_path):
    """CLOCKS=1: nvidia-smi logs into clocks.csv while the parts run and is stopped when
    they end (the log stops growing once the script has returned); the results packed
    while it runs (more than the tool's 8 files) leave the log out, which is still being
    written."""
    import time
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in {"python3": FAKE_PYTHON, "nvidia-smi": FAKE_SMI}.items():
        (shims / name).write_text(text)
        (shims / name).chmod(stat.S_IRWXU)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "OUT": str(out),
           "REAL_PYTHON": sys.executable, "FAKE_BASE": str(tmp_path / "none"),
           "BENCH_ARGS": "chunked; chunked; chunked; chunked", "WSATTN_COMMIT": "c1",
           "CLOCKS": "1", "CLOCKS_MS": "50"}
    env.pop("BENCH_BASE", None)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "bench"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "logging clocks every 50 ms" in (out / "device.log").read_text()
    log = out / "clocks.csv"
    lines = log.read_text().splitlines()
    assert lines[0].startswith("timestamp") and len(lines) >= 2
    size = log.stat().st_size
    time.sleep(0.3)
    assert log.stat().st_size == size, "the clock logger outlived the script"
    import tarfile
    with tarfile.open(out / "results.tar.gz") as tar:  # the 8 bench files, packed mid-run
        names = tar.getnames()
    assert len(names) == 8 and not any("clocks" in n for n in names), names


def test_layouts_step_rows_and_devices_are_kept_apart():
    """The varlen bench's packed and equal-length rows share a case id: compared apart.
    Step rows compare ms_per_token. Rows from another GPU or another timing method are
    not comparable, whatever their values."""
    from wsattn.bench.compare import compare

    def row(case, ms, layout=None, gpu="H200", timing="graph", op="prefill"):
        r = {"case": case, "impl": "wsattn", "status": "ok", "op": op, "gpu": gpu,
             "timing": timing, "commit": "a"}
        r["ms_per_token" if op == "step" else "median_ms"] = ms
        if layout:
            r["layout"] = layout
        return r
    base = [[row("v", 1.0, "varlen"), row("v", 2.0, "equal")]]
    new = [[row("v", 1.2, "varlen"), row("v", 0.95, "equal")]]
    got = {r["case"]: r for r in compare(base, new)["rows"]}
    assert got["v [varlen]"]["verdict"] == "slower" and got["v [equal]"]["verdict"] == "faster"
    step = compare([[row("s", 2.6, op="step")]], [[row("s", 2.5, op="step")]])["rows"]
    assert [r["verdict"] for r in step] == ["faster"], step
    for other in (dict(gpu="H100"), dict(timing="eager")):
        (r,) = compare([[row("c", 1.0)]], [[row("c", 0.8, **other)]])["rows"]
        assert r["verdict"].startswith("not comparable"), r
