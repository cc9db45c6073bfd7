"""Gate 6 without a GPU: reading compute-sanitizer's reports (clean, a memcheck error, a
racecheck hazard), "not run" where the tool is absent, the verdict, the child-process
plumbing through a stand-in sanitizer, and what the two subcommands refuse and write."""

from __future__ import annotations

import builtins
import os
import sys
from pathlib import Path

import pytest

from wsattn.cli import main
from wsattn.evidence import demo, ladder, report, sanitizer

REPO = Path(__file__).resolve().parents[1]

MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_OOB = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _attn_fwd+0x1c30 in /work/main/src/wsattn/kernels/prefill_triton.py:120
=========     by thread (96,0,0) in block (3,0,0)
=========     Address 0x7f3a2c000400 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3a2c000000 of size 1023 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: launch [0x16a3] in __triton_launcher.cpython-311-x86_64-linux-gnu.so
=========
========= ERROR SUMMARY: 1 error
"""

# --racecheck-report all: each hazard, then the analysis lines, then the summary. As on the
# H200 (tests/data/racecheck_gluon_h200.log): the race report names the Read access first and
# one "and Write access" line per write site, and racecheck counts the report line as an
# error too, so 1 hazard + 1 race report = "2 hazards displayed (2 errors, ...)".
RACECHECK_RAW = """\
========= COMPUTE-SANITIZER
========= Error: Potential RAW hazard detected at __shared__ 0x3815d in block (0,0,0) :
=========     Write Thread (31,0,0) at attn_fwd_kernel+0xf3e0 in prefill_gluon_parts.py:615
=========     Read Thread (288,0,0) at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615
=========     Current Value : 2
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: launch [0x16a3] in __triton_launcher.cpython-311-x86_64-linux-gnu.so
=========
========= Error: Race reported between Read access at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615
=========     and Write access at attn_fwd_kernel+0xf3e0 in prefill_gluon_parts.py:615 [1 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""

RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

RACECHECK_WARNING_ONLY = """\
========= COMPUTE-SANITIZER
========= Warning: Potential WAW hazard detected at __shared__ 0x404 in block (0,0,0) :
=========     Write Thread (23,0,0) at kernel+0x1a0 in kernel.ttgir:32
=========     Write Thread (24,0,0) at kernel+0x1a0 in kernel.ttgir:32
=========     Current Value : 2, Incoming Value : 2
=========
========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)
"""

INITCHECK_UNINIT = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at _decode_kernel+0x7a0 in decode_triton.py:88
=========     by thread (0,0,0) in block (1,0,0)
=========     Address 0x7f00c0000100
=========
========= ERROR SUMMARY: 1 error
"""


# --------------------------------------------------------------------------- parsing

def test_clean_reports_pass():
    assert sanitizer.parse("memcheck", MEMCHECK_CLEAN, 0)["ok"]
    r = sanitizer.parse("racecheck", RACECHECK_CLEAN, 0)
    assert r["ok"] and (r["hazards"], r["race_errors"], r["warnings"]) == (0, 0, 0)


def test_memcheck_error_names_the_tool_and_quotes_the_first_lines():
    r = sanitizer.parse("memcheck", MEMCHECK_OOB, sanitizer.ERROR_EXITCODE)
    assert not r["ok"] and r["errors"] == 1
    assert r["error"].startswith("memcheck: 1 error: Invalid __global__ read of size 2 bytes")
    assert "prefill_triton.py:120" in r["error"] and "by thread (96,0,0)" in r["error"]
    assert "Host Frame" not in r["error"]


def test_racecheck_hazard_fails_with_addresses_threads_and_value():
    r = sanitizer.parse("racecheck", RACECHECK_RAW, sanitizer.ERROR_EXITCODE)
    # racecheck's counts: the hazard and its race-report line
    assert not r["ok"] and r["errors"] == 2 and r["hazards"] == 2
    assert len(r["findings"]) == 1 and r["races"] == [
        {"level": "Error", "accesses": [("Read", "attn_fwd_kernel+0x180"), ("Write", "attn_fwd_kernel+0xf3e0")]}]
    assert r["first"] == [
        "Error: Potential RAW hazard detected at __shared__ 0x3815d in block (0,0,0) :",
        "Write Thread (31,0,0) at attn_fwd_kernel+0xf3e0 in prefill_gluon_parts.py:615",
        "Read Thread (288,0,0) at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615",
        "Current Value : 2"]
    assert r["error"].startswith("racecheck: 2 errors, 2 hazards (2 errors, 0 warnings): Error: Potential RAW")


def test_racecheck_warnings_alone_do_not_fail():
    r = sanitizer.parse("racecheck", RACECHECK_WARNING_ONLY, 0)
    assert r["ok"] and r["warnings"] == 1 and r["first"][0].startswith("Warning: Potential WAW")


def test_initcheck_error_and_a_log_without_summary():
    r = sanitizer.parse("initcheck", INITCHECK_UNINIT, sanitizer.ERROR_EXITCODE)
    assert not r["ok"] and "Uninitialized __global__ memory read" in r["error"]
    r = sanitizer.parse("synccheck", "========= COMPUTE-SANITIZER\n", -9)
    assert not r["ok"] and "no ERROR SUMMARY" in r["error"]


def test_error_exit_code_alone_is_not_clean():
    r = sanitizer.parse("memcheck", MEMCHECK_CLEAN, sanitizer.ERROR_EXITCODE)
    assert not r["ok"] and "exit code" in r["error"]


def test_command_line_per_tool():
    cmd = sanitizer.command("racecheck", "/tmp/x.log", "cs")
    assert cmd[:5] == ["cs", "--tool", "racecheck", "--racecheck-report", "all"]
    assert cmd[cmd.index("--error-exitcode") + 1] == str(sanitizer.ERROR_EXITCODE)
    assert cmd[cmd.index("--log-file") + 1] == "/tmp/x.log"
    with pytest.raises(ValueError, match="memcheck"):
        sanitizer.command("leakcheck", "/tmp/x.log")


# --------------------------------------------------------------------------- not run

def test_absent_tool_is_not_run_with_the_reason(tmp_path, monkeypatch):
    # hide the fixed install places too, so the test means the same on a machine that has
    # a CUDA toolkit (it skipped there before, testing nothing)
    real_access = sanitizer.os.access
    monkeypatch.setattr(sanitizer.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(sanitizer.os, "access", lambda p, mode: not str(p).startswith(
        "/usr/local/cuda") and real_access(p, mode))
    exe, why = sanitizer.find_tool({"PATH": str(tmp_path)})
    assert exe is None
    assert "compute-sanitizer not found" in why
    exe, why = sanitizer.find_tool({"PATH": "", "WSATTN_COMPUTE_SANITIZER": str(tmp_path / "nope")})
    assert exe is None and "not an executable" in why


def _stand_ins(monkeypatch):
    from wsattn.evidence import launch, numerics, profile, stress
    monkeypatch.setattr(launch, "not_here", lambda cc: None)
    monkeypatch.setattr(launch, "run_launch", lambda s, seed=0: {"ok": True, "shape": "M17 fp16"})
    monkeypatch.setattr(numerics, "run_numerics", lambda *a, **k: {
        "ok": True, "checked": 64, "dtypes": ["fp16"],
        "worst": {"err": 1e-3, "tol": 4e-3, "shape": "M300 fp16", "dtype": "fp16"}})
    monkeypatch.setattr(stress, "run_stress", lambda *a, **k: {"ok": True, "launches": 2000,
                                                               "distinct_shapes": 16})
    row = {"shape": "M4096 fp16", **profile.compare([1.0, 1.01], [1.3, 1.31])}
    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: {"ok": True, "baseline": "torch.matmul",
                                                                 "rows": [row]})


def test_without_the_tool_the_verdict_stays_at_stress(monkeypatch):
    _stand_ins(monkeypatch)
    monkeypatch.setattr(sanitizer, "find_tool", lambda env=None: (None, "compute-sanitizer not found"))
    r = ladder.climb(demo.matmul_ws_4w(), "sm_90", ladder.Config())
    assert r.highest_gate == 5 and r.gates[-1].gate == 6 and r.gates[-1].status == "not run"
    assert r.verdict.endswith("no hang or race in 2000 launches, sanitizer not run: "
                              "compute-sanitizer not found")
    assert "faster" not in r.verdict and len(r.gates) == 7


def test_a_hazard_stops_the_climb_before_profile(monkeypatch):
    _stand_ins(monkeypatch)
    bad = sanitizer.parse("racecheck", RACECHECK_RAW, sanitizer.ERROR_EXITCODE)
    monkeypatch.setattr(sanitizer, "run_sanitizer", lambda *a, **k: {
        "ok": False, "tools": [dict(sanitizer.parse("memcheck", MEMCHECK_CLEAN, 0), tool="memcheck"), bad],
        "shapes": ["M17 fp16"], "dtype": "fp16", "error": bad["error"], "failed_tools": ["racecheck"]})
    r = ladder.climb(demo.matmul_ws_4w(), "sm_90", ladder.Config())
    assert r.highest_gate == 5 and r.gates[-1].status == "FAIL"
    assert "FAILS sanitizer: racecheck: 2 errors" in r.verdict and "__shared__ 0x3815d" in r.verdict
    assert "faster" not in r.verdict
    text = report.to_markdown([r], os.devnull)
    assert "  - racecheck: 2 errors, 2 hazards (2 errors, 0 warnings)" in text
    assert "  - memcheck: 0 errors" in text


def test_clean_sanitizer_then_profile(monkeypatch):
    _stand_ins(monkeypatch)
    tools = [dict(sanitizer.parse(t, RACECHECK_CLEAN if t == "racecheck" else MEMCHECK_CLEAN, 0))
             for t in sanitizer.TOOLS]
    monkeypatch.setattr(sanitizer, "run_sanitizer", lambda *a, **k: {
        "ok": True, "tools": tools, "shapes": ["M17 fp16", "M1 fp16"], "dtype": "fp16"})
    r = ladder.climb(demo.matmul_ws_4w(), "sm_90", ladder.Config())
    assert r.highest_gate == 7, r.verdict
    assert ("no hang or race in 2000 launches, sanitizer-clean (memcheck, racecheck, synccheck, "
            "initcheck on 2 shapes), faster vs torch.matmul (x1.30)") in r.verdict
    assert r.gates[6].detail.startswith("memcheck 0 errors, racecheck 0 errors (0 hazards, 0 warnings)")


# --------------------------------------------------------------------------- the child, wrapped

FAKE = """\
import os, subprocess, sys
args, opts = sys.argv[1:], {}
while args and args[0].startswith("--"):
    opts[args[0]], args = args[1], args[2:]
rc = subprocess.call(args)
text = open(os.path.join(os.environ["FAKE_SANITIZER_LOGS"], opts["--tool"] + ".log")).read()
with open(opts["--log-file"], "w") as f:
    f.write(text)
clean = "ERROR SUMMARY: 0 errors" in text or "(0 errors" in text
sys.exit(rc if clean else int(opts["--error-exitcode"]))
"""


def test_each_tool_wraps_the_child_process(tmp_path, monkeypatch):
    """The real plumbing: compute-sanitizer (a stand-in that runs the child command and
    writes a canned report to --log-file) around ``python -m wsattn.evidence.child``."""
    exe = tmp_path / "compute-sanitizer"
    exe.write_text(f"#!{sys.executable}\n" + FAKE)
    exe.chmod(0o755)
    (tmp_path / "memcheck.log").write_text(MEMCHECK_CLEAN)
    (tmp_path / "racecheck.log").write_text(RACECHECK_RAW)
    monkeypatch.setenv("FAKE_SANITIZER_LOGS", str(tmp_path))
    monkeypatch.setenv("WSATTN_COMPUTE_SANITIZER", str(exe))
    assert sanitizer.find_tool()[0] == str(exe)
    r = sanitizer.run_sanitizer(demo.steady_spec(), ("memcheck", "racecheck"), timeout=120,
                                exe=str(exe), device="cpu")
    assert not r["ok"] and r["failed_tools"] == ["racecheck"], r
    mem, race = r["tools"]
    assert mem["ok"] and mem["returncode"] == 0 and len(mem["launched"]) == 2
    assert race["returncode"] == sanitizer.ERROR_EXITCODE and "0x3815d" in r["error"]


def test_initcheck_child_gets_a_zero_filled_descriptor_scratch(monkeypatch):
    """initcheck alone runs the child with zero-filled TMA-descriptor scratch (it does not
    see tensormap.cp_fenceproxy writes), and the tool's result and report line say so."""
    from wsattn.evidence import report, stress
    seen = {}

    def fake_child(task, args, timeout, env, prefix):
        seen[prefix[prefix.index("--tool") + 1]] = args["zero_scratch"]
        return {"ok": True, "returncode": 0, "launched": ["x"], "seconds": 0.1}

    monkeypatch.setattr(stress, "run_child", fake_child)
    monkeypatch.setattr(sanitizer, "parse", lambda tool, text, rc: {"tool": tool, "ok": True,
                                                                    "errors": 0})
    results = {t: sanitizer.run_tool(demo.steady_spec(), t, "cs", [{}], "float32", 10)
               for t in sanitizer.TOOLS}
    assert seen == {"memcheck": False, "racecheck": False, "synccheck": False, "initcheck": True}
    assert results["initcheck"]["setup"] == sanitizer.ZERO_SCRATCH_NOTE
    assert all("setup" not in r for t, r in results.items() if t != "initcheck")
    lines = report.sanitizer_details({"tools": list(results.values())})
    assert "zero-filled" in lines[-1] and not any("zero-filled" in x for x in lines[:-1])


# --------------------------------------------------------------------------- the subcommands

@pytest.mark.parametrize("cmd", ["targets", "ladder"])
def test_unknown_kernel_exits_nonzero_listing_the_known_ones(cmd, capsys):
    assert main([cmd, "NO_SUCH_KERNEL", "--target", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert "unknown kernel 'NO_SUCH_KERNEL'" in err and "prefill_gluon" in err and "merge_states" in err


def test_targets_exits_nonzero_for_a_module_function_that_does_not_load(capsys):
    assert main(["targets", "wsattn.evidence.demo:nope", "--target", "sm_90"]) == 1
    assert "has no function 'nope'" in capsys.readouterr().err


def test_subcommands_write_nothing_unless_asked(tmp_path, monkeypatch):
    """Run from the repository root, ladder and targets open no file in the tree for
    writing; --json / --markdown write exactly where they are told."""
    written = []
    real_open = builtins.open

    def watching_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and isinstance(file, (str, os.PathLike)):
            written.append(Path(file).resolve())
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watching_open)
    monkeypatch.chdir(REPO)
    assert main(["targets", "merge_states", "--target", "sm_90"]) == 0
    assert main(["ladder", "merge_states", "--target", "sm_90", "--max-gate", "2",
                 "--no-interpreter"]) == 0
    inside = [p for p in written if REPO in p.parents and "__pycache__" not in p.parts]
    assert inside == []
    out = tmp_path / "l.json"
    assert main(["ladder", "merge_states", "--target", "sm_90", "--max-gate", "2",
                 "--no-interpreter", "--json", str(out)]) == 0
    assert out.exists() and all(REPO not in p.parents for p in written)


# --------------------------------------------------------------------------- the dispatch-byte waiver

# the dispatch as Triton 3.6 lowers gl.warp_specialize (notes/sanitizer.md): 12 warps, 4 default
WS_PTX = """\
\tst.shared.v2.b32 \t[global_smem+229720], {0, 50397698};
\tbarrier.sync \t1;
\tld.shared.b8 \t%r95, [%r96+229716];
\tst.shared.v2.b32 \t[global_smem+229720], {67372036, 67372036};
\tbarrier.sync \t1;
"""
WS = sanitizer.dispatch_bytes(WS_PTX, 229728, 12, 4)


def _probe(bar0=0, bar1=1, kinds1=("RAW",), ran=True):
    def mode(i, n, kinds):
        return {"returncode": 86 if n else 0, "hazards": n, "race_errors": n, "warnings": 0,
                "kinds": list(kinds) if n else [], "ran": ran, "stdout": f"mode {i}: no error"}
    return {"modes": {"bar0": mode(0, bar0, ("RAW",)), "bar1": mode(1, bar1, kinds1),
                      "bar1_384": mode(2, bar1, kinds1), "none": mode(3, 1, ("RAW",))}}


SUPPORTING = _probe()


def _race(log, probe=SUPPORTING, ws=WS, child_ok=True):
    r = sanitizer.parse("racecheck", log, sanitizer.ERROR_EXITCODE)
    r["child_ok"] = child_ok
    return sanitizer.waive(r, ws, lambda: probe)


def test_dispatch_bytes_and_codes_from_the_kernel():
    assert (WS["lo"], WS["hi"], WS["read_base"], WS["workers"]) == (0x38158, 0x38160, 0x38154, 8)
    assert WS["values"][str(0x3815d)] == [2, 4] and WS["values"][str(0x3815e)] == [1, 4]
    # bytes found from the worker's read, not from the end of shared memory: padding after
    # them (the D=64 build keeps 36 bytes) leaves them where the read says
    padded = sanitizer.dispatch_bytes(WS_PTX, 229728 + 36, 12, 4)
    assert (padded["lo"], padded["hi"], padded["values"]) == (WS["lo"], WS["hi"], WS["values"])
    # a store from a register, no worker read, a read whose bytes would run past the end of
    # shared memory, two reads, or no worker warps: no dispatch bytes, no waiver
    assert "error" in sanitizer.dispatch_bytes(WS_PTX.replace("{0, 50397698}", "{%r1, %r2}"), 229728, 12, 4)
    assert "error" in sanitizer.dispatch_bytes(WS_PTX.replace("ld.shared.b8", "ld.shared.b16"), 229728, 12, 4)
    assert "error" in sanitizer.dispatch_bytes(WS_PTX, 229727, 12, 4)
    assert "error" in sanitizer.dispatch_bytes(WS_PTX + "\tld.shared.b8 \t%r7, [%r8+229700];\n", 229728, 12, 4)
    assert "error" in sanitizer.dispatch_bytes(WS_PTX, 229728, 4, 4)
    # the read names the bytes: a store that does not line up with them is refused
    assert "error" in sanitizer.dispatch_bytes(WS_PTX.replace("+229716]", "+229712]"), 229728, 12, 4)


def test_the_waiver_needs_the_handoff_ordered_by_a_whole_cta_barrier_1():
    """The waiver stands on every dispatch store reaching a whole-CTA barrier.sync 1 before
    any other barrier, and every worker read coming right after one: without that order
    the hazard may be a real race, so no dispatch bytes (no waiver)."""
    def error(ptx):
        return sanitizer.dispatch_bytes(ptx, 229728, 12, 4).get("error", "")
    assert "not followed by a whole-CTA barrier.sync 1" in error(
        WS_PTX.replace("barrier.sync \t1;", "barrier.sync \t2;"))
    first_gone = WS_PTX.replace("barrier.sync \t1;\n\tld.shared.b8", "\tld.shared.b8", 1)
    assert "not right after a whole-CTA barrier.sync 1" in error(first_gone)
    assert "thread count" in error(WS_PTX + "\tbar.sync \t1, 128;\n")
    assert "thread count" in error(WS_PTX + "\tbarrier.arrive \t1, 384;\n")
    assert "error" not in WS


def test_dispatch_hazard_with_a_supporting_probe_is_waived_and_said_so():
    r = _race(RACECHECK_RAW)
    assert r["ok"] and r["waived"] == 1 and "error" not in r
    assert r["waiver"].startswith("racecheck: 1 hazard waived: warp-specialize dispatch bytes "
                                  "[0x38158, 0x38160), ordered by barrier.sync 1 (notes/sanitizer.md); "
                                  "probe: bar0 0 hazard(s), bar1 1 hazard(s) RAW")
    assert r["errors"] == 2 and r["hazards"] == 2  # the counts stay what racecheck said


def test_same_hazard_without_a_supporting_probe_fails():
    for probe in (_probe(bar1=0), _probe(bar0=1), _probe(ran=False), _probe(kinds1=("WAR",)),
                  {"error": "nvcc not found"}, None):
        r = _race(RACECHECK_RAW, probe)
        assert not r["ok"] and "waived" not in r and "racecheck: 2 errors" in r["error"], probe
        assert r["not_waived"].startswith("probe:"), r["not_waived"]


def test_hazard_outside_the_dispatch_bytes_fails():
    for addr in ("0x38157", "0x38160", "0x404"):
        r = _race(RACECHECK_RAW.replace("0x3815d", addr))
        assert not r["ok"] and "outside the dispatch bytes [0x38158, 0x38160)" in r["not_waived"]


def test_war_waw_or_other_values_fail():
    for kind in ("WAR", "WAW"):
        r = _race(RACECHECK_RAW.replace("RAW", kind))
        assert not r["ok"] and r["not_waived"].endswith(f"{kind} hazard")
    r = _race(RACECHECK_RAW.replace("Current Value : 2", "Current Value : 7"))
    assert not r["ok"] and "not among the dispatch codes [2, 4]" in r["not_waived"]
    # value 1 is warp 10's code, not warp 9's (whose byte 0x3815d is)
    r = _race(RACECHECK_RAW.replace("Current Value : 2", "Current Value : 1"))
    assert not r["ok"]
    # read by a warp other than the byte's owner, or written by a worker
    assert not _race(RACECHECK_RAW.replace("Read Thread (288,", "Read Thread (320,"))["ok"]
    assert not _race(RACECHECK_RAW.replace("Write Thread (31,", "Write Thread (200,"))["ok"]


def test_no_waiver_off_a_warp_specialize_kernel_or_with_anything_else_in_the_log():
    assert not _race(RACECHECK_RAW, ws=None)["ok"]
    assert not _race(RACECHECK_RAW, child_ok=False)["ok"]
    # a second hazard elsewhere (with its own race report, as racecheck prints it), or a
    # summary counting more than the log shows
    two = RACECHECK_RAW.replace("========= Error: Race reported", """\
========= Error: Potential RAW hazard detected at __shared__ 0x100 in block (0,0,0) :
=========     Write Thread (0,0,0) at attn_fwd_kernel+0x900 in prefill_gluon_parts.py:300
=========     Read Thread (300,0,0) at attn_fwd_kernel+0x980 in prefill_gluon_parts.py:310
=========     Current Value : 0
=========
========= Error: Race reported""").replace("2 hazards displayed (2 errors", "4 hazards displayed (4 errors")
    two = two.replace("========= RACECHECK SUMMARY", """\
========= Error: Race reported between Read access at attn_fwd_kernel+0x980 in prefill_gluon_parts.py:310
=========     and Write access at attn_fwd_kernel+0x900 in prefill_gluon_parts.py:300 [1 hazards]
=========
========= RACECHECK SUMMARY""")
    assert sanitizer.parse("racecheck", two, 86)["errors"] == 4
    r = _race(two)
    assert not r["ok"] and "0x100" in r["not_waived"]
    r = _race(RACECHECK_RAW.replace("(2 errors, 0 warnings)", "(3 errors, 0 warnings)"))
    assert not r["ok"] and "read from the log for 3 racecheck errors" in r["not_waived"]
    # the old miscount (the race report line not counted) does not add up either
    r = _race(RACECHECK_RAW.replace("2 hazards displayed (2 errors", "1 hazard displayed (1 error"))
    assert not r["ok"] and "read from the log for 1 racecheck errors" in r["not_waived"]
    # a race report between other code offsets: its read, or one of its writes
    r = _race(RACECHECK_RAW.replace("Race reported between Read access at attn_fwd_kernel+0x180",
                                    "Race reported between Read access at attn_fwd_kernel+0x200"))
    assert not r["ok"] and "race report" in r["not_waived"]
    r = _race(RACECHECK_RAW.replace("[1 hazards]\n", "[1 hazards]\n=========     and Write access at "
                                    "attn_fwd_kernel+0x1bdf0 in prefill_gluon_parts.py:615 [1 hazards]\n"))
    assert not r["ok"] and "attn_fwd_kernel+0x1bdf0" in r["not_waived"]
    # other tools are never waived
    r = sanitizer.parse("memcheck", MEMCHECK_OOB, sanitizer.ERROR_EXITCODE)
    assert not sanitizer.waive(r, WS, lambda: SUPPORTING)["ok"]


# the first write and the exit write of the dispatch both racing one worker read, in one race
# report with two "and Write access" lines (the H200 log's shape)
RACECHECK_TWO_WRITES = RACECHECK_RAW.replace("========= Error: Race reported", """\
========= Error: Potential RAW hazard detected at __shared__ 0x3815e in block (1,0,0) :
=========     Write Thread (127,0,0) at attn_fwd_kernel+0x1bdf0 in prefill_gluon_parts.py:640
=========     Read Thread (320,0,0) at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615
=========     Current Value : 4
=========
========= Error: Race reported""").replace("[1 hazards]\n", """[1 hazards]
=========     and Write access at attn_fwd_kernel+0x1bdf0 in prefill_gluon_parts.py:640 [1 hazards]
""").replace("2 hazards displayed (2 errors", "3 hazards displayed (3 errors")


def test_a_race_report_with_several_write_sites_pairs_each_with_a_hazard():
    r = sanitizer.parse("racecheck", RACECHECK_TWO_WRITES, 86)
    assert r["errors"] == 3 and len(r["findings"]) == 2 and len(r["races"]) == 1
    assert [a[0] for a in r["races"][0]["accesses"]] == ["Read", "Write", "Write"]
    r = _race(RACECHECK_TWO_WRITES)
    assert r["ok"] and r["waived"] == 2 and r["waiver"].startswith("racecheck: 2 hazards waived")
    # one of the two writes with no hazard of its own pair: not waived
    r = _race(RACECHECK_TWO_WRITES.replace("and Write access at attn_fwd_kernel+0x1bdf0",
                                           "and Write access at attn_fwd_kernel+0x1be00"))
    assert not r["ok"] and "attn_fwd_kernel+0x1be00" in r["not_waived"]


def test_the_probe_runs_only_when_a_hazard_could_be_waived():
    calls = []
    r = sanitizer.parse("racecheck", RACECHECK_RAW.replace("RAW", "WAW"), sanitizer.ERROR_EXITCODE)
    sanitizer.waive(r, WS, lambda: calls.append(1) or SUPPORTING)
    assert calls == [] and not r["ok"]


def test_a_waived_run_is_never_called_clean(monkeypatch):
    _stand_ins(monkeypatch)
    race = _race(RACECHECK_RAW)
    tools = [sanitizer.parse("memcheck", MEMCHECK_CLEAN, 0), race]
    monkeypatch.setattr(sanitizer, "run_sanitizer", lambda *a, **k: {
        "ok": True, "tools": tools, "shapes": ["M17 fp16"], "dtype": "fp16", "waivers": [race["waiver"]]})
    r = ladder.climb(demo.matmul_ws_4w(), "sm_90", ladder.Config())
    assert r.highest_gate == 7 and "sanitizer-clean" not in r.verdict
    assert ("sanitizer passes WITH A WAIVER (memcheck, racecheck on 1 shapes; racecheck: 1 hazard waived: "
            "warp-specialize dispatch bytes [0x38158, 0x38160), ordered by barrier.sync 1 "
            "(notes/sanitizer.md); probe: ") in r.verdict
    text = report.to_markdown([r], os.devnull)
    assert "; WAIVED: racecheck: 1 hazard waived: warp-specialize dispatch bytes [0x38158, 0x38160)" in text
    assert "[racecheck: 1 hazard waived" in r.gates[6].detail


def test_run_sanitizer_waives_through_the_wrapped_child(tmp_path, monkeypatch):
    exe = tmp_path / "compute-sanitizer"
    exe.write_text(f"#!{sys.executable}\n" + FAKE)
    exe.chmod(0o755)
    (tmp_path / "racecheck.log").write_text(RACECHECK_RAW)
    monkeypatch.setenv("FAKE_SANITIZER_LOGS", str(tmp_path))
    r = sanitizer.run_sanitizer(demo.steady_spec(), ("racecheck",), timeout=120, exe=str(exe),
                                device="cpu", ws_dispatch=WS, probe=lambda: SUPPORTING)
    assert r["ok"] and r["waivers"][0].startswith("racecheck: 1 hazard waived") and r["tools"][0]["child_ok"]
    r = sanitizer.run_sanitizer(demo.steady_spec(), ("racecheck",), timeout=120, exe=str(exe),
                                device="cpu", ws_dispatch=WS, probe=lambda: _probe(bar1=0))
    assert not r["ok"] and r["failed_tools"] == ["racecheck"] and "waivers" not in r


# --------------------------------------------------------------------------- the kernel-shaped probe variants

from wsattn.evidence import sanitizer_probe  # noqa: E402


def _mode(at=(), races=None, ran=True, name="0"):
    """A probe variant as mode_result records it: racecheck's hazard count is the hazards
    read (``at``) plus its race-report lines (one per racing read site; 1 unless given)."""
    races = (1 if at else 0) if races is None else races
    n = len(at) + races
    return {"returncode": 86 if n else 0, "hazards": n, "race_errors": n, "warnings": 0,
            "kinds": sorted({h["kind"] for h in at}), "ran": ran,
            "stdout": f"mode {name}: no error", "at": list(at), "race_reports": races}


def _at(byte, off=0x400, kind="RAW", read=None):
    return {"addr": off + byte, "kind": kind, "level": "Error",
            "read_warps": [byte + 4 if read is None else read], "write_warps": [3]}


def _probe_v(**hazardous):
    """bar0 clean, none racing on all 8 bytes at +0x400, the named variants with one RAW each."""
    modes = {k: _mode() for k in sanitizer_probe.VARIANTS}
    modes["none"] = _mode([_at(b) for b in range(8)])
    for k, at in hazardous.items():
        modes[k.replace("__", "+")] = _mode(at)
    return {"modes": modes}


def test_shared_offset_is_learned_from_the_positive_control_only():
    assert sanitizer_probe.shared_offset(_probe_v()) == 0x400
    p = _probe_v()
    p["modes"]["none"]["at"][3]["addr"] += 1  # disagreeing hazards: nothing learned
    assert sanitizer_probe.shared_offset(p) is None
    assert sanitizer_probe.shared_offset(SUPPORTING) is None and sanitizer_probe.shared_offset(None) is None


def test_a_variant_supports_only_with_features_the_kernel_has_and_on_its_own_bytes():
    sw = sanitizer_probe.supports_waiver
    p = _probe_v(ws__setmaxnreg=[_at(5)])
    assert not sw(p)[0] and sw(p, {"setmaxnreg"})[0] and "(ws+setmaxnreg)" in sw(p, {"setmaxnreg"})[1]
    assert not sw(_probe_v(ws_all=[_at(5)]), {"setmaxnreg", "brx"})[0]
    assert sw(_probe_v(ws_all=[_at(5)]), set(sanitizer_probe.FEATURES))[0]
    assert sw(_probe_v(ws=[_at(5)]))[0]  # no feature: supports any kernel
    # a hazard off the probe's bytes, read by the wrong warp, or WAR: no support
    assert not sw(_probe_v(ws=[_at(9)]))[0]
    assert not sw(_probe_v(ws=[_at(5, read=6)]))[0]
    assert not sw(_probe_v(ws=[_at(5, kind="WAR")]))[0]
    p = _probe_v(ws=[_at(5)])
    p["modes"]["bar0"] = _mode([_at(5)])
    assert not sw(p)[0]
    # every hazard racecheck counted must be read: a count the hazards and race reports do
    # not add up to, or a record without its race-report count, is no support
    p = _probe_v(ws=[_at(5)])
    p["modes"]["ws"]["hazards"] += 1
    assert not sw(p)[0]
    p = _probe_v(ws=[_at(5)])
    del p["modes"]["ws"]["race_reports"]
    assert not sw(p)[0]


def test_kernel_features_from_the_ptx():
    ptx = WS_PTX + "\tsetmaxnreg.dec.sync.aligned.u32 \t240;\n\tbar.sync \t0, 128;\n\tbar.sync \t2, 128;\n\tbrx.idx %r95, $L_brx_0;\n"
    assert sanitizer.dispatch_bytes(ptx, 229728, 12, 4)["features"] == sorted(sanitizer_probe.FEATURES)
    assert WS["features"] == ["exit", "loop"]
    assert sanitizer.dispatch_bytes(WS_PTX.replace("barrier.sync \t1;", "barrier.sync 1, 384;"),
                                    229728, 12, 4)["features"] == ["exit", "loop"]


def test_the_waiver_uses_the_measured_offset():
    log = RACECHECK_RAW.replace("0x3815d", "0x3855d")
    # without a measured offset the racecheck address is outside the kernel's bytes
    assert "outside the dispatch bytes" in _race(log)["not_waived"]
    r = _race(log, _probe_v(ws__exit=[_at(5)]))
    assert r["ok"] and r["waived"] == 1 and "racecheck shared offset 0x400" in r["waiver"]
    # the offset moves the range, it does not widen it
    r = _race(RACECHECK_RAW, _probe_v(ws__exit=[_at(5)]))
    assert not r["ok"] and "[0x38558, 0x38560) (kernel offsets + 0x400)" in r["not_waived"]
    # only variants with features the kernel has (WS: loop, exit) count
    r = _race(log, _probe_v(ws__setmaxnreg=[_at(5)]))
    assert not r["ok"] and r["not_waived"].startswith("probe:")


def test_probe_mode_result_reads_a_racecheck_log():
    x = sanitizer_probe.mode_result("ws+brx", RACECHECK_RAW, 86, "mode ws+brx: no error; state at shared 0x400;")
    assert x["ran"] and x["hazards"] == 2 and x["race_reports"] == 1 and x["features"] == ["brx"]
    assert x["at"] == [{"addr": 0x3815d, "kind": "RAW", "level": "Error", "read_warps": [9], "write_warps": [0]}]


def test_probe_source_has_every_variant_and_compiles_for_sm_90a(tmp_path):
    import shutil
    import subprocess
    src = sanitizer_probe.source()
    for name in sanitizer_probe.WS_VARIANTS:
        assert f'{{"{name}", ws<' in src
    assert sanitizer_probe.build_command("nvcc", "a.cu", "a")[1] == "-gencode=arch=compute_90a,code=sm_90a"
    nvcc = sanitizer_probe.find_nvcc()
    if nvcc is None or shutil.which("ptxas", path=os.path.dirname(nvcc)) is None:
        # a tool gate, not a hidden failure: the source checks above ran; compiling the
        # probe needs a CUDA toolkit, which the device and this project's machines have
        pytest.skip("no nvcc here")
    (tmp_path / "d.cu").write_text(src)
    cmd = sanitizer_probe.build_command(nvcc, str(tmp_path / "d.cu"), str(tmp_path / "d"))
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    ptx = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-ptx", "-o", "-",
                          str(tmp_path / "d.cu")], check=True, capture_output=True, text=True).stdout
    import re
    bodies = dict(re.findall(r"\.entry _Z2wsILi(\d+)E.*?\n(.*?)\n}\n", ptx, re.S))
    for name in sanitizer_probe.WS_VARIANTS:
        body, feats = bodies[str(sanitizer_probe._flags(name))], sanitizer_probe.variant_features(name)
        assert ("setmaxnreg" in body) == ("setmaxnreg" in feats), name
        assert ("bar.sync 0, 128" in body) == ("bar0_128" in feats), name
        assert ("bar.sync 2, 128" in body) == ("bar2_128" in feats), name
        assert ("brx.idx" in body) == ("brx" in feats), name
        assert body.count("st.shared.v2.b32") == 2 and "barrier.sync 1" in body, name


# --------------------------------------------------------------------------- real data from the H200

DATA = Path(__file__).resolve().parent / "data"
# the simple controls run with their MODES index as the program's argument
_PROBE_ARGS = {m: str(i) for i, m in enumerate(sanitizer_probe.MODES)}


def _h200_probe(clean=()):
    """The H200 probe result built from its racecheck logs (tests/data/probe_h200, host
    backtrace frames trimmed) through mode_result; the variants in ``clean`` read the
    clean ``ws`` log instead of their own."""
    import json
    runs = json.loads((DATA / "probe_h200" / "runs.json").read_text())
    modes = {}
    for mode, run in runs.items():
        log = DATA / "probe_h200" / f"racecheck_{'ws' if mode in clean else mode}.log"
        arg = _PROBE_ARGS.get(mode, mode)
        stdout = run["stdout"].replace("mode ws:", f"mode {arg}:") if mode in clean else run["stdout"]
        modes[mode] = sanitizer_probe.mode_result(arg, log.read_text(), run["returncode"], stdout)
    return {"modes": modes}


@pytest.fixture(scope="module")
def gluon_builds():
    """dispatch_bytes of the Gluon prefill builds the sanitizer shapes run on sm_90
    (D=128 and D=64, bf16, non-causal), compiled here on the CPU."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from wsattn.kernels import prefill_gluon as pg
    out = {}
    for d in (128, 64):
        spec = pg.compile_spec(90, d, "bf16", False)
        k = triton.compile(GluonASTSource(spec["fn"], spec["signature"], spec["constexprs"]),
                           target=GPUTarget("cuda", 90, 32), options=spec["options"])
        out[d] = sanitizer.dispatch_bytes(k.asm["ptx"], k.metadata.shared, k.metadata.num_warps, 4)
        assert "error" not in out[d], (d, out[d])
    return out


def _h200_race():
    r = sanitizer.parse("racecheck", (DATA / "racecheck_gluon_h200.log").read_text(), sanitizer.ERROR_EXITCODE)
    r["child_ok"] = True
    return r


def test_h200_racecheck_log_parses_to_50_hazards_and_2_race_reports():
    r = _h200_race()
    assert not r["ok"] and r["errors"] == 52 and (r["hazards"], r["race_errors"], r["warnings"]) == (52, 52, 0)
    assert len(r["findings"]) == 50 and len(r["races"]) == 2
    assert all(h["level"] == "Error" and h["kind"] == "RAW" for h in r["findings"])
    # one read site and several write sites per report (2 and 4 of them)
    assert [[a[0] for a in x["accesses"]] for x in r["races"]] == [
        ["Read", "Write", "Write"], ["Read", "Write", "Write", "Write", "Write"]]


def test_h200_probe_logs_give_the_offset_and_support_for_every_kernel_feature():
    p = _h200_probe()
    assert sanitizer_probe.shared_offset(p) == 0x400
    m = p["modes"]
    assert [k for k in sanitizer_probe.VARIANTS if m[k]["hazards"]] == ["none", "ws+bar0_128", "ws_all"]
    assert (m["ws+bar0_128"]["hazards"], m["ws+bar0_128"]["race_reports"], len(m["ws+bar0_128"]["at"])) == (21, 2, 19)
    ok, line = sanitizer_probe.supports_waiver(p, frozenset(sanitizer_probe.FEATURES))
    assert ok and "(ws+bar0_128, ws_all)" in line, line


def test_h200_gluon_report_is_waived_with_both_builds_and_the_h200_probe(gluon_builds):
    assert (gluon_builds[128]["lo"], gluon_builds[128]["hi"]) == (0x38158, 0x38160)
    # D=64: the bytes sit before padding, not at the end of shared memory
    assert (gluon_builds[64]["lo"], gluon_builds[64]["hi"]) == (0x26178, 0x26184)
    r = sanitizer.waive(_h200_race(), [gluon_builds[128], gluon_builds[64]], _h200_probe())
    assert r["ok"] and r["waived"] == 50 and "error" not in r, r.get("not_waived")
    assert r["waiver"].startswith("racecheck: 50 hazards waived: warp-specialize dispatch bytes "
                                  "[0x38158, 0x38160), [0x26178, 0x26184), ordered by barrier.sync 1")
    assert "racecheck shared offset 0x400" in r["waiver"] and "(ws+bar0_128, ws_all)" in r["waiver"]
    assert r["errors"] == 52  # the counts stay what racecheck said


def test_h200_gluon_report_fails_with_the_d128_build_alone(gluon_builds):
    r = sanitizer.waive(_h200_race(), [gluon_builds[128]], _h200_probe())
    assert not r["ok"] and "waived" not in r
    assert "outside the dispatch bytes [0x38558, 0x38560) (kernel offsets + 0x400)" in r["not_waived"], r["not_waived"]
    # the address named is one of the D=64 build's bytes (+ the offset)
    addr = int(r["not_waived"].split("hazard at ")[1].split(":")[0], 16)
    assert 0x26178 + 0x400 <= addr < 0x26184 + 0x400


def test_h200_gluon_report_fails_without_the_probe_variants_that_flag_it(gluon_builds):
    builds = [gluon_builds[128], gluon_builds[64]]
    p = _h200_probe(clean=("ws+bar0_128", "ws_all"))
    assert p["modes"]["ws_all"]["ran"] and p["modes"]["ws_all"]["hazards"] == 0
    r = sanitizer.waive(_h200_race(), builds, p)
    assert not r["ok"] and "waived" not in r
    assert r["not_waived"].startswith("probe:") and "nothing waived" in r["not_waived"], r["not_waived"]
    # only one of them gone: the other still supports it
    assert sanitizer.waive(_h200_race(), builds, _h200_probe(clean=("ws+bar0_128",)))["ok"]


def test_racecheck_prints_every_hazard_the_waiver_must_read():
    """racecheck's log limit is far above the default 100 (which left 19 of the MoE Gluon
    kernel's 119 errors unprinted); the other tools keep 100."""
    cmd = sanitizer.command("racecheck", "/tmp/x.log", "cs")
    assert cmd[cmd.index("--print-limit") + 1] == "10000"
    cmd = sanitizer.command("memcheck", "/tmp/x.log", "cs")
    assert cmd[cmd.index("--print-limit") + 1] == "100"


def test_moe_gluon_h200_hazards_are_the_dispatch_handoff_of_its_builds():
    """The MoE Gluon entry names the builds its sanitizer shapes launch (gate/up and down);
    every hazard the H200 racecheck log printed (98 of its 119 errors, the log's limit
    was 100) lies on one of their dispatch bytes (+ the probe's 0x400), read by the worker
    whose byte it is, with a dispatch code; the waiver still refuses, naming the counts,
    because 19 errors were never printed."""
    import json
    from wsattn.evidence import ladder, library
    spec = library.get("moe_gluon")
    ws = ladder._other_builds_dispatch(spec, 90, spec.compile_spec(90), 4)
    assert ws and all("error" not in w for w in ws), ws
    assert {(w["lo"], w["hi"]) for w in ws} == {(0x29858, 0x2985c), (0x19860, 0x19864)}
    r = json.loads((DATA / "racecheck_moe_gluon_h200.json").read_text())
    errs = [h for h in r["findings"] if h["level"] == "Error"]
    assert (len(errs), len(r["races"]), r["race_errors"]) == (98, 2, 119)
    for h in errs:
        assert any(sanitizer._dispatch_hazard(h, w, 0x400) is None for w in ws), h
    out = sanitizer.waive(dict(r), ws, _h200_probe())
    assert not out["ok"] and "read from the log for 119 racecheck errors" in out["not_waived"]


def _gluon_dispatch_of(cs):
    """dispatch_bytes of a Gluon build's compile spec for sm_90 (4-warp default partition)."""
    from wsattn.evidence.compile_gate import compile_kernel
    comp = compile_kernel(cs["fn"], cs["signature"], dict(cs["constexprs"]),
                          dict(cs["options"]), 90, cs.get("attrs"))
    return sanitizer.dispatch_bytes(comp.stages["ptx"], comp.metadata["shared"],
                                    comp.metadata["num_warps"], 4)


def test_prefill_gluon_sanitizer_builds_are_the_launched_ones():
    """The fixed-length Gluon prefill's sanitizer shapes: the short ones (Sq 17 at D128,
    Sq 1 at D64, not causal) launch the one-consumer builds (ONE_CONSUMER_UP_TO), each
    specialized on its lengths, whose shared-memory layouts and so dispatch bytes differ
    from the default builds'; the longer ones launch D128's two-consumer default, D64's
    persistent schedule and D64's three-consumer default, each with its own bytes. Every
    hazard of the H200 racecheck run of the short shapes
    (tests/data/racecheck_prefill_gluon_h200.json, 9 printed hazards + 2 race reports =
    its 11 errors) lies on the dispatch bytes of the two one-consumer builds, and with the
    H200 probe the waiver holds; with the builds the entry launched before (D128's
    default and D64's persistent schedule) alone it does not."""
    import json
    from wsattn.evidence import ladder, library
    from wsattn.kernels import prefill_gluon as pg
    spec = library.get("prefill_gluon")
    cs = spec.compile_spec(90)
    primary = _gluon_dispatch_of(cs)
    others = ladder._other_builds_dispatch(spec, 90, cs, 4)
    assert (primary["lo"], primary["hi"]) == (0x38158, 0x38160)
    assert {(w["lo"], w["hi"]) for w in others} == {
        (0x1C128, 0x1C12C), (0xE128, 0xE12C),  # the one-consumer builds, D128 and D64
        (0x38158, 0x38160),  # D128's default (the primary build's bytes)
        (0x26188, 0x26194), (0x26178, 0x26184)}  # D64's persistent build and its default
    r = json.loads((DATA / "racecheck_prefill_gluon_h200.json").read_text())
    out = sanitizer.waive(dict(r), [primary] + others, _h200_probe())
    assert out["ok"], out.get("not_waived")
    persistent = _gluon_dispatch_of(spec.compile_spec(
        90, head_dim=64, settings=pg.settings_for(64, False, persistent=True)))
    out = sanitizer.waive(dict(r), [primary, persistent], _h200_probe())
    assert not out["ok"] and "outside the dispatch bytes" in out["not_waived"]


def test_prefill_gluon_causal_sanitizer_builds_are_specialized_as_launched():
    """The causal entry's short sanitizer shapes (Sq 17 at D128, Sq 1 at D64) launch the
    one-consumer builds, and at Sq = 1 Triton's launcher makes Sq a constant, which moves
    the D64 build's dispatch bytes 16 bytes down from its build for other lengths; its
    longer ones (Sq 1100 at D128, 2100 at D64) the two- and three-consumer defaults. Every
    hazard of the H200 racecheck run of the short shapes
    (tests/data/racecheck_prefill_gluon_causal_h200.json, 17 printed hazards + 2 race
    reports = its 19 errors) lies on the specialized builds' bytes and the waiver holds;
    with the D64 build compiled for generic lengths (what the ladder compiled before
    compile_spec took seqlens, and failed with) it does not."""
    import json
    from wsattn.evidence import ladder, library
    from wsattn.kernels import prefill_gluon as pg
    spec = library.get("prefill_gluon_causal")
    cs = spec.compile_spec(90)
    primary = _gluon_dispatch_of(cs)
    others = ladder._other_builds_dispatch(spec, 90, cs, 4)
    assert {(w["lo"], w["hi"]) for w in others} == {
        (0x1C138, 0x1C13C), (0xE128, 0xE12C),  # the one-consumer builds, D128 and D64
        (0x38158, 0x38160), (0x26150, 0x2615C)}  # the two- and three-consumer defaults
    r = json.loads((DATA / "racecheck_prefill_gluon_causal_h200.json").read_text())
    out = sanitizer.waive(dict(r), [primary] + others, _h200_probe())
    assert out["ok"], out.get("not_waived")
    generic = _gluon_dispatch_of(spec.compile_spec(90, head_dim=64, causal=True,
                                                   settings=pg.call_settings(64, True, 1)))
    assert (generic["lo"], generic["hi"]) == (0xE138, 0xE13C)
    d128 = [w for w in others if w["lo"] == 0x1C138]
    out = sanitizer.waive(dict(r), [primary, generic] + d128, _h200_probe())
    assert not out["ok"] and "outside the dispatch bytes" in out["not_waived"]


def test_no_waiver_when_any_build_the_shapes_ran_has_unknown_bytes():
    """One build's dispatch bytes known, another's not (it did not compile here): its
    hazards could land on the known build's addresses, so nothing is waived."""
    r = sanitizer.parse("racecheck", RACECHECK_RAW, sanitizer.ERROR_EXITCODE)
    r["child_ok"] = True
    sanitizer.waive(r, [WS, {"error": "head_dim=64 build: RuntimeError: boom"}],
                    lambda: SUPPORTING)
    assert not r["ok"] and "has no known dispatch bytes (head_dim=64 build" in r["not_waived"]
