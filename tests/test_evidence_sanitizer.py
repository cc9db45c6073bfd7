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

# --racecheck-report all: each hazard, then the analysis lines, then the summary
RACECHECK_RAW = """\
========= COMPUTE-SANITIZER
========= Error: Potential RAW hazard detected at __shared__ 0x3815d in block (0,0,0) :
=========     Write Thread (31,0,0) at attn_fwd_kernel+0xf3e0 in prefill_gluon_parts.py:615
=========     Read Thread (288,0,0) at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615
=========     Current Value : 2
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: launch [0x16a3] in __triton_launcher.cpython-311-x86_64-linux-gnu.so
=========
========= Error: Race reported between Write access at attn_fwd_kernel+0xf3e0 in prefill_gluon_parts.py:615
=========     and Read access at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615 [2 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
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
    assert not r["ok"] and r["errors"] == 1 and r["hazards"] == 1
    assert r["first"] == [
        "Error: Potential RAW hazard detected at __shared__ 0x3815d in block (0,0,0) :",
        "Write Thread (31,0,0) at attn_fwd_kernel+0xf3e0 in prefill_gluon_parts.py:615",
        "Read Thread (288,0,0) at attn_fwd_kernel+0x180 in prefill_gluon_parts.py:615",
        "Current Value : 2"]
    assert r["error"].startswith("racecheck: 1 error, 1 hazards (1 errors, 0 warnings): Error: Potential RAW")


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

def test_absent_tool_is_not_run_with_the_reason(tmp_path):
    exe, why = sanitizer.find_tool({"PATH": str(tmp_path)})
    if exe is not None:
        pytest.skip(f"this machine has compute-sanitizer at {exe}")
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
    assert "FAILS sanitizer: racecheck: 1 error" in r.verdict and "__shared__ 0x3815d" in r.verdict
    assert "faster" not in r.verdict
    text = report.to_markdown([r], os.devnull)
    assert "  - racecheck: 1 errors, 1 hazards (1 errors, 0 warnings)" in text
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
