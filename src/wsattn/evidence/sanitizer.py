"""Gate 6: the kernel's small odd shapes under compute-sanitizer, one child process per tool.

memcheck (out-of-bounds and misaligned accesses), racecheck (shared-memory hazards),
synccheck (illegal barrier use) and initcheck (reads of uninitialized global memory)
each wrap ``python -m wsattn.evidence.child sanitize ...``, the child the numerics and
stress gates already use, so a kernel's shapes, inputs and runner are found the same way.
The tool's own report goes to a log file (``--log-file``), apart from what the child
prints, and is read back: ``ERROR SUMMARY: N errors`` for every tool, ``RACECHECK SUMMARY:
H hazards displayed (E errors, W warnings)`` for racecheck, and the first hazard's lines.

A tool passes when its summary says 0 errors, the process did not exit with the error
exit code, and the child finished its launches. Racecheck warnings (hazards the tool
itself ranks below an error) are quoted but do not fail. Where no compute-sanitizer can
be found the gate is "not run" with that reason, never a pass.

Sizes: sanitizers slow kernels 10-100x and instrument every module loaded, so each kernel
runs a few small shapes in one dtype (``RunSpec.sanitizer_shapes``, else drawn small).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")

# Distinct from 1 (a Python traceback) so the parent can tell "the tool found errors"
# from "the child failed".
ERROR_EXITCODE = 86

_TOOL_ARGS = {
    "memcheck": ["--tool", "memcheck"],
    # "all": each hazard with its addresses, threads and values, then the analysis lines
    "racecheck": ["--tool", "racecheck", "--racecheck-report", "all"],
    "synccheck": ["--tool", "synccheck"],
    "initcheck": ["--tool", "initcheck"],
}

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*"
                           r"\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
# The first line of a finding, per tool: memcheck "Invalid __global__ read of size 4
# bytes", racecheck "Error: Potential RAW hazard detected at __shared__ 0x..." or
# "Error: Race reported between ...", synccheck "Barrier error detected. ...", initcheck
# "Uninitialized __global__ memory read of size 4 bytes"; and "Program hit ..." errors.
_FINDING = re.compile(r"^(Invalid |Error:|Warning:|Barrier error|Uninitialized |Program hit |"
                      r"Misaligned |Malformed |Out-of-range |Cuda API error|Unspecified launch)")
_PREFIX = re.compile(r"^=+\s?")


def find_tool(env: dict | None = None) -> tuple[str | None, str]:
    """(path of compute-sanitizer, how it was found) or (None, why not)."""
    env = os.environ if env is None else env
    given = env.get("WSATTN_COMPUTE_SANITIZER")
    if given:
        if os.access(given, os.X_OK):
            return given, "WSATTN_COMPUTE_SANITIZER"
        return None, f"WSATTN_COMPUTE_SANITIZER={given} is not an executable"
    path = shutil.which("compute-sanitizer", path=env.get("PATH"))
    if path:
        return path, "PATH"
    cands = ["/usr/local/cuda/bin/compute-sanitizer",
             *sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)]
    cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if cuda_home:
        cands.insert(0, os.path.join(cuda_home, "bin", "compute-sanitizer"))
    for c in cands:
        if os.access(c, os.X_OK):
            return c, c
    return None, "compute-sanitizer not found (not on PATH, not in CUDA_HOME or /usr/local/cuda*)"


def command(tool: str, log_file: str, exe: str = "compute-sanitizer") -> list:
    """The compute-sanitizer prefix for one tool (the child command follows it)."""
    if tool not in _TOOL_ARGS:
        raise ValueError(f"unknown sanitizer tool {tool!r}: expected one of {', '.join(TOOLS)}")
    return [exe, *_TOOL_ARGS[tool], "--error-exitcode", str(ERROR_EXITCODE),
            "--print-limit", "100", "--log-file", log_file]


def _lines(text: str) -> list:
    """The tool's lines without its '========= ' prefix, blank ones dropped."""
    out = []
    for line in text.splitlines():
        body = _PREFIX.sub("", line).rstrip()
        if body.strip():
            out.append(body)
    return out


def first_finding(text: str, max_lines: int = 4) -> list:
    """The first finding's lines (its head and the indented lines under it, stack frames
    and host backtraces left out), or []."""
    lines = _lines(text)
    for i, line in enumerate(lines):
        if _FINDING.match(line.strip()) and "SUMMARY" not in line:
            block = [line.strip()]
            for nxt in lines[i + 1:]:
                if not nxt.startswith((" ", "\t")) or _FINDING.match(nxt.strip()):
                    break
                s = nxt.strip()
                if s.startswith(("Saved host backtrace", "Host Frame", "Device Frame")):
                    break
                block.append(s)
                if len(block) >= max_lines:
                    break
            return block
    return []


def parse(tool: str, text: str, returncode: int | None) -> dict:
    """Read one tool's log: errors, racecheck's hazards and warnings, the first finding.

    ``ok`` needs a summary that says 0 errors: a log with no summary (the tool or the
    child died first) is never clean."""
    m = _ERROR_SUMMARY.findall(text)
    errors = int(m[-1]) if m else None
    r = {"tool": tool, "errors": errors, "returncode": returncode, "first": first_finding(text)}
    if tool == "racecheck":
        rm = _RACE_SUMMARY.findall(text)
        if rm:
            hazards, race_errors, warnings = (int(x) for x in rm[-1])
            r.update(hazards=hazards, race_errors=race_errors, warnings=warnings)
            # the racecheck summary counts what the ERROR SUMMARY may leave out
            errors = race_errors if errors is None else max(errors, race_errors)
            r["errors"] = errors
    if errors is None:
        r["ok"] = False
        r["error"] = f"{tool}: no ERROR SUMMARY in its output" + (
            f" (exit {returncode})" if returncode not in (None, 0) else "")
    else:
        r["ok"] = errors == 0 and returncode != ERROR_EXITCODE
        if not r["ok"]:
            what = f"{errors} error{'s' if errors != 1 else ''}" if errors else \
                f"exit code {returncode} (the tool's error exit code)"
            if tool == "racecheck" and "hazards" in r:
                what += f", {r['hazards']} hazards ({r['race_errors']} errors, {r['warnings']} warnings)"
            r["error"] = f"{tool}: {what}" + (": " + " | ".join(r["first"]) if r["first"] else "")
    return r


def run_tool(spec, tool: str, exe: str, shapes: list, dtype: str, timeout: float,
             seed: int = 0, device: str = "cuda") -> dict:
    """One tool over the shapes in one child process; never raises. (device "cpu" is for
    the tests, which wrap CPU runners in a stand-in sanitizer.)"""
    from .stress import run_child
    fd, log = tempfile.mkstemp(prefix=f"wsattn-{tool}-", suffix=".log")
    os.close(fd)
    try:
        args = {"origin": spec.origin, "name": spec.name, "device": device, "shapes": shapes,
                "dtype": dtype, "seed": seed}
        env = {"TRITON_INTERPRET": "1" if device == "cpu" else "0", "WSATTN_POISON": "1"}
        child = run_child("sanitize", args, timeout, env, prefix=command(tool, log, exe))
        with open(log, errors="replace") as f:
            text = f.read()
    finally:
        os.remove(log)
    r = parse(tool, text, child.get("returncode"))
    r["seconds"] = child.get("seconds")
    if child.get("kind") == "hang":
        r["ok"] = False
        r["error"] = f"{tool}: {child['error']}"
    elif not child.get("ok") and r["ok"]:
        # the tool found nothing, but the launches did not all run: not a clean result
        r["ok"] = False
        r["error"] = f"{tool}: the child did not finish: {child.get('error')}"
    r["launched"] = child.get("launched", [])
    return r


def sanitizer_shapes(spec, n: int = 2, seed: int = 0) -> list:
    import random
    run = spec.run
    if run.sanitizer_shapes:
        return [dict(s) for s in run.sanitizer_shapes]
    rng = random.Random(seed)
    return [run.draw_shape(rng, True) for _ in range(n)]


def run_sanitizer(spec, tools=TOOLS, timeout: float = 300.0, seed: int = 0,
                  exe: str | None = None, device: str = "cuda") -> dict:
    """Gate 6 for ``spec`` on this machine's GPU. Returns ``{"not_run": True, "error"}``
    where no compute-sanitizer is found, else ``ok``, per-tool results and, when a tool
    fails, ``error`` naming it with its first finding."""
    if exe is None:
        exe, how = find_tool()
        if exe is None:
            return {"ok": False, "not_run": True, "error": how}
    if not tools:
        return {"ok": False, "not_run": True, "error": "no sanitizer tool requested (--sanitizer none)"}
    shapes = sanitizer_shapes(spec, seed=seed)
    dtype = (spec.run.interpreter_dtypes if device == "cpu" else spec.run.dtypes)[0]
    results = [run_tool(spec, t, exe, shapes, dtype, timeout, seed, device) for t in tools]
    failed = [r for r in results if not r["ok"]]
    labels = next((r["launched"] for r in results if r.get("launched")), [])
    out = {"ok": not failed, "tools": results, "shapes": labels or [str(s) for s in shapes],
           "dtype": dtype, "exe": exe}
    if failed:
        out["error"] = "; ".join(r["error"] for r in failed)
        out["failed_tools"] = [r["tool"] for r in failed]
    return out


def summary(r: dict) -> str:
    """The gate's one-line detail."""
    if r.get("not_run"):
        return f"not run: {r['error']}"
    if not r["ok"]:
        return r["error"]
    parts = []
    for t in r["tools"]:
        s = f"{t['tool']} 0 errors"
        if t["tool"] == "racecheck" and "hazards" in t:
            s += f" ({t['hazards']} hazards, {t['warnings']} warnings)"
        parts.append(s)
    return (f"{', '.join(parts)} on {len(r['shapes'])} small shapes ({r['dtype']}): "
            + ", ".join(r["shapes"]))
