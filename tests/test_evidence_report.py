"""Specs from files, verdicts that never overclaim, reports, and the two subcommands."""

from __future__ import annotations

import json
import sys

import pytest

from wsattn.cli import main
from wsattn.evidence import demo, ladder, profile, report, spec
from wsattn.evidence.ladder import GateResult, LadderResult


# --------------------------------------------------------------------------- specs

TOML = """
[kernel.tma_matmul]
function = "wsattn.evidence.demo:matmul_ws_kernel"
signature = { a_ptr = "*fp16", b_ptr = "*fp16", c_ptr = "*fp16", M = "i32", N = "i32", K = "i32" }
constexprs = { BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 64, WARP_SPECIALIZE = true }
options = { num_warps = 4, num_stages = 3 }

[kernel.missing]
function = "wsattn.evidence.demo:no_such_kernel"
"""


# Python 3.10 has no tomllib: there a TOML spec is refused with a clear error by design, so
# this test of the TOML path has nothing to run (CI and the GPU machine are 3.11 / 3.12).
@pytest.mark.skipif(sys.version_info < (3, 11), reason="TOML specs need tomllib (Python 3.11+)")
def test_toml_spec_compiles_and_a_bad_entry_is_one_line(tmp_path):
    path = tmp_path / "kernels.toml"
    path.write_text(TOML)
    good, bad = spec.load_file(str(path))
    assert bad.unavailable == "module 'wsattn.evidence.demo' has no function 'no_such_kernel'"
    r = ladder.climb(good, "sm_90", ladder.Config(max_gate=2))
    assert r.highest_gate == 2 and r.gates[2].data["ws_formed"]
    r = ladder.climb(bad, "sm_90", ladder.Config())
    assert r.gates[1].status == "FAIL" and "no_such_kernel" in r.verdict


def test_python_spec_file(tmp_path):
    path = tmp_path / "myspecs.py"
    path.write_text("from wsattn.evidence import demo\nSPECS = [demo.broken_spec()]\n")
    (s,) = spec.load_file(str(path))
    assert s.name == "demo_broken" and s.compile_spec is not None


@pytest.mark.parametrize("ref, expected", [
    pytest.param("wsattn.evidence.nope:f", "cannot import module 'wsattn.evidence.nope'", id="no-module"),
    pytest.param("wsattn.evidence.demo:nope", "has no function 'nope'", id="no-function"),
    pytest.param("wsattn.evidence.demo:matmul_ws_kernel", "is a jit function", id="bare-jit"),
])
def test_module_function_errors(ref, expected):
    (s,) = spec.load_ref(ref)
    assert s.unavailable and expected in s.unavailable


def test_missing_library_module_is_not_available_not_a_crash(monkeypatch):
    from wsattn.evidence import library
    monkeypatch.setattr(library, "ENTRIES", library.ENTRIES + (
        ("future", "wsattn.kernels.not_written_yet", "compile_spec", {}, None, "", None),))
    s = library.get("future")
    assert s.unavailable.startswith("not available: cannot import wsattn.kernels.not_written_yet")
    r = ladder.climb(s, "sm_90")
    assert [g.status for g in r.gates] == ["pass", "FAIL"]


# --------------------------------------------------------------------------- verdicts

def _result(gates, extra=()):
    rs = [GateResult(*g) for g in gates]
    ex = [GateResult(*g) for g in extra]
    highest = -1
    for g in rs:
        if g.status != "pass":
            break
        highest = g.gate
    return LadderResult("k", "sm_90", rs, highest, ladder.verdict(rs, ex, "sm_90"), ex)


def test_verdict_stops_at_the_highest_gate():
    r = _result([(0, "target path", "pass", "", {"mma": "wgmma", "tma": True}),
                 (1, "compile", "pass", ""),
                 (2, "structure", "pass", "", {"ws_formed": True, "ws_requested": True, "partitions": [1, 2, 3]}),
                 (3, "launch", "not run", "not run: no sm_90 device here")],
                [(4, "numerics", "pass", "", {"checked": 3})])
    assert r.highest_gate == 2
    assert r.verdict.startswith("sm_90 path wgmma + TMA, compiles, warp-specialized (3 partitions), "
                                "not launched: no sm_90 device here")
    assert "correct" not in r.verdict and "faster" not in r.verdict


def test_faster_only_when_the_gap_exceeds_both_spreads():
    assert profile.compare([1.0, 1.1, 1.05], [2.0, 2.1, 2.05])["verdict"] == "faster"
    assert profile.compare([1.0, 1.6, 1.3], [1.5, 1.9, 1.7])["verdict"] == "no clear difference"
    assert profile.compare([2.0, 2.02], [1.0, 1.01])["verdict"] == "slower"


def test_markdown_has_a_profile_chart(tmp_path, monkeypatch):
    row = {"shape": "M4096 fp16", "kernel_ms": 1.0, "kernel_spread_ms": 0.01, "baseline_ms": 1.5,
           "baseline_spread_ms": 0.02, "speedup": 1.5, "verdict": "faster"}
    gates = [(i, ladder.GATES[i], "pass", "", {}) for i in range(7)]
    gates.append((7, "profile", "pass", "", {"baseline": "torch.matmul", "rows": [row]}))
    r = _result(gates)
    md = tmp_path / "r.md"
    text = report.to_markdown([r], str(md))
    assert "## Profile" in text and ("![profile](r.png)" in text) == (tmp_path / "r.png").exists()
    monkeypatch.setattr(report, "_png_chart", lambda rows, path: False)
    text = report.to_markdown([r], str(md))
    assert "#" * 26 in text and "torch.matmul" in text  # the text bar chart


# --------------------------------------------------------------------------- the subcommands

def test_ladder_cli_reports_bad_input_and_goes_on(tmp_path, capsys):
    out = tmp_path / "ladder.json"
    rc = main(["ladder", "wsattn.evidence.demo:broken_spec", "wsattn.evidence.demo:nope",
               "--target", "sm_90", "--target", "sm_99", "--max-gate", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    assert "unknown target 'sm_99'" in captured.err and "has no function 'nope'" in captured.err
    doc = json.loads(out.read_text())
    assert [(r["kernel"], r["target"], r["highest_gate"]) for r in doc["results"]] == [
        ("demo_broken", "sm_90", 0), ("wsattn.evidence.demo:nope", "sm_90", 0)]
    assert "triton" in doc["environment"]


def test_ladder_json_is_written_after_each_kernel(tmp_path, monkeypatch, capsys):
    """A run stopped by a time limit keeps what it reached: the JSON is rewritten after
    every (kernel, target), marked complete only at the end."""
    out = tmp_path / "ladder.json"
    seen = []
    real_climb = ladder.climb

    def climb_and_look(*args, **kwargs):
        if out.exists():  # what an interrupted run would have left so far
            doc = json.loads(out.read_text())
            seen.append((doc["complete"], len(doc["results"])))
        return real_climb(*args, **kwargs)

    monkeypatch.setattr(ladder, "climb", climb_and_look)
    main(["ladder", "wsattn.evidence.demo:broken_spec", "wsattn.evidence.demo:broken_spec",
          "--target", "sm_90", "--max-gate", "2", "--json", str(out)])
    assert seen == [(False, 1)]
    assert json.loads(out.read_text())["complete"] is True
    assert "demo_broken sm_90: gate" in capsys.readouterr().out


def test_markdown_from_an_earlier_json(tmp_path, capsys):
    """--from-json rebuilds the results (a device run's JSON, rendered on the CPU): the same
    table and Markdown as the run that wrote it."""
    out, md1, md2 = tmp_path / "l.json", tmp_path / "a.md", tmp_path / "b.md"
    main(["ladder", "merge_states", "--target", "sm_90", "--max-gate", "2", "--no-interpreter",
          "--json", str(out), "--markdown", str(md1)])
    first = capsys.readouterr().out
    assert main(["ladder", "--from-json", str(out), "--markdown", str(md2)]) == 0
    again = capsys.readouterr().out
    table = [line for line in first.splitlines() if line.startswith("merge_states")]
    assert table and table[-1] in again
    assert md1.read_text() == md2.read_text()
    # the report names the machine of the run, not the one rendering it
    doc = json.loads(out.read_text())
    doc["environment"] = {**doc["environment"], "gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}
    out.write_text(json.dumps(doc))
    assert main(["ladder", "--from-json", str(out), "--markdown", str(md2)]) == 0
    env_line = [ln for ln in md2.read_text().splitlines() if ln.startswith("Environment:")][0]
    assert "gpu NVIDIA H200" in env_line and "torch 2.11.0+cu130" in env_line


def test_from_json_merges_several_runs(tmp_path, capsys):
    """Several runs' JSON (one ladder climbed in several calls): each kernel's row from the
    last file holding it, the runs listed with their commits; the Markdown of the merge
    equals that of its rows; runs of different settings, or no --json, are refused."""
    a, b, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    for path, kernel, commit in ((a, "merge_states", "c0"), (b, "argmax", "c1")):
        main(["ladder", kernel, "--target", "sm_90", "--max-gate", "2", "--no-interpreter",
              "--json", str(path)])
        doc = json.loads(path.read_text())
        doc["environment"]["git_commit"] = commit
        path.write_text(json.dumps(doc))
    # b also holds a later merge_states row, which must win
    doc_b = json.loads(b.read_text())
    later = json.loads(a.read_text())["results"][0]
    later["verdict"] = "the later run's verdict"
    doc_b["results"].append(later)
    b.write_text(json.dumps(doc_b))
    capsys.readouterr()
    md = tmp_path / "m.md"
    assert main(["ladder", "--from-json", str(a), str(b), "--json", str(merged),
                 "--markdown", str(md)]) == 0
    doc = json.loads(merged.read_text())
    assert [r["kernel"] for r in doc["results"]] == ["merge_states", "argmax"]
    assert doc["results"][0]["verdict"] == "the later run's verdict"
    assert doc["environment"]["git_commit"] == "c0 + c1" and doc["complete"] is True
    assert [(r["file"], r["commit"]) for r in doc["runs"]] == [("a.json", "c0"), ("b.json", "c1")]
    assert doc["runs"][1]["kernels"] == ["argmax sm_90", "merge_states sm_90"]
    out = capsys.readouterr().out
    assert f"wrote {merged}" in out and "argmax" in out
    md2 = tmp_path / "m2.md"
    assert main(["ladder", "--from-json", str(merged), "--markdown", str(md2)]) == 0
    assert md.read_text() == md2.read_text()
    # a merge merged again with a rerun keeps its runs apart, and the rerun's row wins
    c, again = tmp_path / "c.json", tmp_path / "again.json"
    doc_c = json.loads(a.read_text())
    doc_c["environment"]["git_commit"] = "c2"
    doc_c["results"][0]["verdict"] = "the rerun's verdict"
    c.write_text(json.dumps(doc_c))
    assert main(["ladder", "--from-json", str(merged), str(c), "--json", str(again)]) == 0
    doc2 = json.loads(again.read_text())
    assert [(r["file"], r["commit"]) for r in doc2["runs"]] == \
        [("a.json", "c0"), ("b.json", "c1"), ("c.json", "c2")]
    assert doc2["environment"]["git_commit"] == "c0 + c1 + c2"
    assert doc2["results"][0]["verdict"] == "the rerun's verdict"
    # refusals
    assert main(["ladder", "--from-json", str(a), str(b)]) == 2
    assert "name the merged file with --json" in capsys.readouterr().err
    doc_b["config"]["stress_launches"] = 7
    b.write_text(json.dumps(doc_b))
    assert main(["ladder", "--from-json", str(a), str(b), "--json", str(merged)]) == 2
    err = capsys.readouterr().err
    assert "b.json: its ladder config differs from" in err and "stress_launches" in err


def test_targets_cli_ledger(tmp_path, capsys):
    out = tmp_path / "targets.json"
    rc = main(["targets", "wsattn.evidence.demo:matmul_ws_8w", "--target", "sm_90", "--target",
               "sm_100", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target"], r["mma"], r["ws"]) for r in rows] == [
        ("sm_90", "wgmma", "DECLINED"), ("sm_100", "tcgen05", "formed: 8w/1w/2w")]
    assert "num_warps=8" in rows[0]["note"] and "DECLINED" in text


@pytest.mark.gpu
def test_full_ladder_on_this_gpu(tmp_path):
    """Every gate for the demo matmul on the machine's own target (the sanitizer gate
    with memcheck only, and "not run" where compute-sanitizer is absent)."""
    from wsattn.evidence import sanitizer
    from wsattn.evidence.launch import device_cc
    cc = device_cc()
    cfg = ladder.Config(numerics_shapes=8, stress_launches=200, stress_timeout=300, profile_repeats=3,
                        sanitizer_tools=("memcheck",))
    r = ladder.climb(demo.matmul_ws_4w(), f"sm_{cc}", cfg)
    assert r.gates[3].status == "pass", r.verdict
    assert r.gates[4].status == "pass" and r.gates[5].status == "pass", r.verdict
    if sanitizer.find_tool()[0] is None:
        assert r.highest_gate == 5 and r.gates[6].status == "not run", r.verdict
    else:
        assert r.highest_gate == 7 and r.gates[7].data["rows"], r.verdict


def test_toml_without_tomllib_says_what_to_do(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: a TOML spec is one clear line, not an ImportError."""
    monkeypatch.setitem(sys.modules, "tomllib", None)
    path = tmp_path / "kernels.toml"
    path.write_text(TOML)
    (s,) = spec.load_file(str(path))
    assert "Python 3.11+" in s.unavailable and "SPECS" in s.unavailable


def test_gates_3_to_7_orchestration_with_stand_in_measurements(monkeypatch):
    """The climb past gate 2 and its verdict, with each GPU measurement replaced by a
    stand-in result (the real ones run in test_full_ladder_on_this_gpu)."""
    from wsattn.evidence import launch, numerics, sanitizer, stress
    monkeypatch.setattr(sanitizer, "run_sanitizer", lambda *a, **k: {
        "ok": True, "shapes": ["M17 fp16"], "dtype": "fp16",
        "tools": [{"tool": "memcheck", "ok": True, "errors": 0}]})
    monkeypatch.setattr(launch, "not_here", lambda cc: None)
    monkeypatch.setattr(launch, "run_launch", lambda s, seed=0: {"ok": True, "shape": "M17 fp16"})
    monkeypatch.setattr(numerics, "run_numerics", lambda *a, **k: {
        "ok": True, "checked": 64, "dtypes": ["fp16", "bf16"],
        "worst": {"err": 1e-3, "tol": 4e-3, "shape": "M300 fp16", "dtype": "fp16"}})
    monkeypatch.setattr(stress, "run_stress", lambda *a, **k: {"ok": True, "launches": 2000,
                                                               "distinct_shapes": 16})
    row = {"shape": "M4096 fp16", **profile.compare([1.0, 1.01], [1.3, 1.31])}
    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: {"ok": True, "baseline": "torch.matmul",
                                                                 "rows": [row]})
    r = ladder.climb(demo.matmul_ws_4w(), "sm_90", ladder.Config())
    assert r.highest_gate == 7, r.verdict
    assert r.verdict.endswith("launches, correct on 64 shapes, no hang or race in 2000 launches, "
                              "sanitizer-clean (memcheck on 1 shapes), faster vs torch.matmul (x1.30)")
    assert "faster than torch.matmul at M4096 fp16" in r.gates[7].detail

    monkeypatch.setattr(stress, "run_stress", lambda *a, **k: {
        "ok": False, "kind": "hang", "shape": "M127 fp16", "error": "hang: no result after 600 s, "
        "last launch at M127 fp16"})
    r = ladder.climb(demo.matmul_ws_4w(), "sm_90", ladder.Config())
    assert r.highest_gate == 4 and [g.status for g in r.gates][-1] == "FAIL" and len(r.gates) == 6
    assert "FAILS stress: hang" in r.verdict and "faster" not in r.verdict


def test_profile_detail_names_an_eagerly_timed_side():
    """Gate 7 replays both sides from CUDA graphs; a side that could not be captured is
    named in the verdict, so a launch-path time is never read as a kernel time."""
    from wsattn.evidence.ladder import _eager_note
    assert _eager_note({"kernel": "graph", "baseline": "graph"}) == ""
    assert _eager_note(None) == ""
    assert _eager_note({"kernel": "eager", "baseline": "graph"}) == \
        ", kernel timed eagerly (not capturable)"
    assert "kernel and baseline" in _eager_note({"kernel": "eager", "baseline": "eager+graph"})


@pytest.mark.gpu
def test_profile_times_graph_replays_and_falls_back_to_eager():
    """A capturable call is timed from a CUDA graph; one with a host read inside is timed
    eagerly and says so, with the process as it was before the failed capture."""
    import torch
    from wsattn.evidence.profile import _time_ms
    x = torch.randn(1 << 20, device="cuda")
    ms, how = _time_ms(lambda: x.mul(2.0))
    assert how == "graph" and 0 < ms < 1.0
    stream = torch.cuda.current_stream()
    ms, how = _time_ms(lambda: float(x.sum()))
    assert how == "eager" and ms > 0
    # the failed capture left nothing behind: the same current stream, and the generator
    # usable (a failed torch.cuda.graph leaves it marked as capturing, and every later
    # torch.randn on the device then failed: every GPU test after this one, once)
    assert torch.cuda.current_stream() == stream
    assert torch.randn(4, device="cuda").isfinite().all()
