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

One waiver, narrow and stated (notes/sanitizer.md): on a ``gl.warp_specialize`` kernel,
a racecheck RAW hazard on the dispatch bytes the lowering keeps at the end of shared
memory (one byte per worker warp, written by the default warps, read by that worker, each
pair ordered by a whole-CTA ``barrier.sync 1``), with a value the dispatch stores there,
is waived only when the barrier control (``sanitizer_probe``) run on this machine shows
racecheck flags a barrier-1-ordered handoff, with no feature the kernel lacks, and not the
same one under ``bar.sync 0``. Addresses are compared after the shared offset the probe
measured (racecheck's addresses sit past the kernel's offsets by it).
Every other hazard, and every other tool's error, fails. See :func:`waive`.

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

# initcheck does not count the tensormap.cp_fenceproxy copy that puts a device-side TMA
# descriptor into Triton's scratch as a write, so every TMA use of such a descriptor reads
# "uninitialised" memory (measured on the H200: torch.empty scratch 1,536 more reports, at
# make_tensor_descriptor, than torch.zeros scratch, which has none in the kernel). Under initcheck the
# child's scratch is zero-filled; the descriptor bytes themselves are the kernel's.
ZERO_SCRATCH_NOTE = ("device-side TMA descriptor scratch zero-filled: initcheck does not see "
                     "tensormap.cp_fenceproxy writes (notes/sanitizer.md)")

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
# racecheck --racecheck-report all: each hazard, then the analysis ("Race reported") lines
_HAZARD = re.compile(r"^(Error|Warning): Potential (\w+) hazard detected at __shared__ (0x[0-9a-fA-F]+|\d+)"
                     r"(?: in block \(([^)]*)\))?")
_ACCESS = re.compile(r"^(Write|Read) Thread \((\d+),\s*(\d+),\s*(\d+)\) at (\S+)")
_VALUE = re.compile(r"Current Value\s*:\s*(\d+)(?:,\s*Incoming Value\s*:\s*(\d+))?")
_RACE = re.compile(r"^(Error|Warning): Race reported between (\w+) access at (\S+)")
_RACE_2ND = re.compile(r"^and (\w+) access at (\S+)")


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


# Findings a tool's log prints before it stops printing (its totals still count them all).
# racecheck prints more: the waiver must read every hazard, and a warp-specialized kernel
# run over a few shapes and builds reports one per worker warp and launch (119 for the
# MoE Gluon kernel where the default limit of 100 left 19 unread).
PRINT_LIMIT = {"racecheck": 10000}
DEFAULT_PRINT_LIMIT = 100


def command(tool: str, log_file: str, exe: str = "compute-sanitizer") -> list:
    """The compute-sanitizer prefix for one tool (the child command follows it)."""
    if tool not in _TOOL_ARGS:
        raise ValueError(f"unknown sanitizer tool {tool!r}: expected one of {', '.join(TOOLS)}")
    return [exe, *_TOOL_ARGS[tool], "--error-exitcode", str(ERROR_EXITCODE),
            "--print-limit", str(PRINT_LIMIT.get(tool, DEFAULT_PRINT_LIMIT)),
            "--log-file", log_file]


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


def racecheck_findings(text: str) -> tuple[list, list]:
    """(hazards, race reports) of a racecheck log. A hazard: ``{"level", "kind", "addr",
    "block", "accesses": [(op, thread x, y, z, pc)], "values": [current, incoming?]}``; a race
    report: ``{"level", "accesses": [(op, pc), (op, pc)]}``."""
    hazards, races, cur = [], [], None
    for line in _lines(text):
        s = line.strip()
        m, r = _HAZARD.match(s), _RACE.match(s)
        if m:
            cur = {"level": m.group(1), "kind": m.group(2), "addr": int(m.group(3), 0),
                   "block": m.group(4), "accesses": [], "values": []}
            hazards.append(cur)
        elif r:
            cur = {"level": r.group(1), "accesses": [(r.group(2), r.group(3))]}
            races.append(cur)
        elif _FINDING.match(s) or not line.startswith((" ", "\t")):
            cur = None
        elif cur is not None and "kind" in cur:
            a, v = _ACCESS.match(s), _VALUE.search(s)
            if a:
                cur["accesses"].append((a.group(1), int(a.group(2)), int(a.group(3)), int(a.group(4)),
                                        a.group(5)))
            elif v:
                cur["values"] = [int(x) for x in v.groups() if x is not None]
        elif cur is not None:
            a = _RACE_2ND.match(s)
            if a:
                cur["accesses"].append((a.group(1), a.group(2)))
    return hazards, races


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
        r["findings"], r["races"] = racecheck_findings(text)
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


# --------------------------------------------------------------------------- the one waiver

_WS_READ = re.compile(r"ld\.shared\.b8\s+%r\d+, \[%r\d+\+(\d+)\];")
_WS_STORE = re.compile(r"st\.shared(?:\.v(\d))?\.b(8|16|32|64)\s+\[global_smem\+(\d+)\],\s*"
                       r"(\{[^}]*\}|[^;]+);")
WAIVER_NOTE = "notes/sanitizer.md"


def dispatch_bytes(ptx: str, shared: int, num_warps: int, default_warps: int) -> dict:
    """Where a ``gl.warp_specialize`` kernel keeps its per-worker-warp dispatch codes, from
    the compiled kernel (Triton 3.6 lowering, notes/sanitizer.md): one byte per worker warp
    ``[lo, lo + workers)`` (at or near the end of shared memory), workers = every warp past
    the default group; worker warp w reads byte ``read_base + w``, lo = read_base + the
    default group's warps (read from the worker's ``ld.shared.b8``); the default group
    writes them with immediate stores. Returns ``{"lo", "hi", "read_base", "workers",
    "default_warps", "values": {addr: [codes stored there]}}``, or ``{"error"}`` when the
    PTX does not show exactly that (then nothing can be waived)."""
    if not (ptx and shared and num_warps and default_warps) or num_warps <= default_warps:
        return {"error": f"no worker warps or no metadata (shared {shared}, num_warps {num_warps}, "
                         f"default warps {default_warps})"}
    workers = num_warps - default_warps
    # where the worker warps read their byte (``ld.shared.b8 [base + warp]``): at the end of
    # shared memory in some builds, before padding in others (D=64 keeps 36 bytes after it)
    bases = {int(x) for x in _WS_READ.findall(ptx)}
    bases = {b for b in bases if b + default_warps + workers <= shared}
    if len(bases) != 1:
        return {"error": f"not one worker ld.shared.b8 [base + warp] in the PTX (found "
                         f"{sorted(bases) or 'none'})"}
    read_base = bases.pop()
    lo = read_base + default_warps
    hi = lo + workers
    values = {a: set() for a in range(lo, hi)}
    for vec, bits, at, vals in _WS_STORE.findall(ptx):
        width, n, at = int(bits) // 8, int(vec or 1), int(at)
        if at + width * n <= lo or at >= hi:
            continue
        if at < lo or at + width * n > hi:
            return {"error": f"a store at +{at} straddles the dispatch bytes [{lo}, {hi})"}
        try:
            words = [int(v, 0) for v in vals.strip("{} ").split(",")]
        except ValueError:  # a register, not an immediate: its codes cannot be read here
            return {"error": f"a store of {vals.strip()} to the dispatch bytes is not immediate"}
        for k, w in enumerate(words):
            for b in range(width):
                values[at + k * width + b].add((w >> (8 * b)) & 0xFF)
    if not all(values.values()):
        return {"error": f"no immediate store covers every dispatch byte [{lo}, {hi})"}
    # nothing else may name these bytes directly
    others = [ln.strip() for ln in ptx.splitlines()
              if re.search(r"global_smem\+(\d+)\b", ln) and not _WS_STORE.search(ln)
              and lo <= int(re.search(r"global_smem\+(\d+)\b", ln).group(1)) < hi]
    if others:
        return {"error": f"other instructions touch the dispatch bytes: {others[0]}"}
    unordered = _unordered_dispatch(ptx, read_base, lo, hi, 32 * num_warps)
    if unordered:
        return {"error": unordered}
    return {"lo": lo, "hi": hi, "read_base": read_base, "workers": workers,
            "default_warps": default_warps,
            "values": {str(a): sorted(v) for a, v in values.items()},
            "features": kernel_features(ptx, lo, hi)}


_BARRIER = re.compile(r"^(bar|barrier)\.")
_BARRIER_1 = re.compile(r"^(bar|barrier)\.(sync|arrive|red)\S*\s+1\s*(?:,\s*(\d+))?\s*[;,]")


def _unordered_dispatch(ptx: str, read_base: int, lo: int, hi: int,
                        threads: int) -> str | None:
    """Why the dispatch handoff is not the ordered one the waiver stands on, or None: each
    worker read must come right after a whole-CTA ``barrier.sync 1`` (no thread count, or
    all ``threads`` of the CTA) and each store of the bytes must reach one before any other
    named barrier; barrier 1 must never count fewer threads or be arrived on without
    waiting (notes/sanitizer.md). Without that order racecheck's hazard on these bytes
    may be a real race."""
    lines = [ln.strip() for ln in ptx.splitlines()]

    def whole_cta_wait(ln):
        m = _BARRIER_1.match(ln)
        return bool(m) and m.group(2) == "sync" and m.group(3) in (None, str(threads))
    for ln in lines:
        if _BARRIER_1.match(ln) and not whole_cta_wait(ln):
            return (f"barrier 1 is used with a thread count below the CTA's {threads} or an "
                    f"arrive ({ln!r}): not a whole-CTA wait")
    read = re.compile(rf"ld\.shared\.b8\s+%r\d+, \[%r\d+\+{read_base}\];")
    for i, ln in enumerate(lines):
        if read.match(ln):
            prev = next((x for x in reversed(lines[:i]) if _BARRIER.match(x)), None)
            if prev is None or not whole_cta_wait(prev):
                return (f"a worker's dispatch read is not right after a whole-CTA "
                        f"barrier.sync 1 (the barrier before it: {prev!r})")
        m = _WS_STORE.search(ln)
        if m and lo <= int(m.group(3)) < hi:
            nxt = next((x for x in lines[i + 1:] if _BARRIER.match(x)), None)
            if nxt is None or not whole_cta_wait(nxt):
                return (f"a store of the dispatch bytes is not followed by a whole-CTA "
                        f"barrier.sync 1 (the next barrier: {nxt!r})")
    return None


def kernel_features(ptx: str, lo: int, hi: int) -> list:
    """Which of the barrier probe's features (``sanitizer_probe.FEATURES``) the kernel has:
    a probe variant with no more than these may stand in for it (``supports_waiver``).
    The dispatch loop and its exit are counted only when the bytes are stored more than
    once (a second round, which is the exit code)."""
    f = set()
    if "setmaxnreg." in ptx:
        f.add("setmaxnreg")
    if re.search(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0,\s*\d+", ptx):
        f.add("bar0_128")
    if re.search(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+(?:[2-9]|1\d),\s*\d+", ptx):
        f.add("bar2_128")
    if "brx.idx" in ptx:
        f.add("brx")
    stores = [m for m in _WS_STORE.findall(ptx) if lo <= int(m[2]) < hi]
    if len(stores) > 1:
        f.update(("loop", "exit"))
    return sorted(f)


def _dispatch_hazard(h: dict, ws: dict, offset: int = 0) -> str | None:
    """Why hazard ``h`` is not the dispatch handoff, or None when it is. ``offset``: what
    racecheck adds to the kernel's shared offsets on this machine (learned by the probe)."""
    if h["kind"] != "RAW":
        return f"{h['kind']} hazard"
    lo, hi = ws["lo"] + offset, ws["hi"] + offset
    if not lo <= h["addr"] < hi:
        return f"address {h['addr']:#x} outside the dispatch bytes [{lo:#x}, {hi:#x})" + (
            f" (kernel offsets + {offset:#x})" if offset else "")
    writes = [a for a in h["accesses"] if a[0] == "Write"]
    reads = [a for a in h["accesses"] if a[0] == "Read"]
    if len(writes) != 1 or len(reads) != 1:
        return "not one write and one read"
    (_, wx, wy, wz, _), (_, rx, ry, rz, _) = writes[0], reads[0]
    if wy or wz or ry or rz:
        return "a thread index outside a 1-D block"
    if wx // 32 >= ws["default_warps"]:
        return f"written by warp {wx // 32}, not the default group"
    if rx // 32 != h["addr"] - offset - ws["read_base"]:
        return f"read by warp {rx // 32}, not the worker whose byte {h['addr']:#x} is"
    allowed = ws["values"].get(str(h["addr"] - offset), [])
    if not h["values"] or any(v not in allowed for v in h["values"]):
        return f"value(s) {h['values']} not among the dispatch codes {allowed} stored there"
    return None


def waive(r: dict, ws, probe=None) -> dict:
    """Apply the one waiver to a failing racecheck result ``r`` in place (see the module
    docstring): every Error hazard must be the dispatch handoff of one of the kernel's
    builds that the shapes ran (``ws``: a :func:`dispatch_bytes` result or a list of them,
    one per build; only given for a gl.warp_specialize kernel), every pair a race report
    names must pair the code offsets of such a hazard, the counts must add up (racecheck
    counts each "Race reported" line as an error too), the child must have finished, and
    ``probe()`` (the barrier control's result) must support it. Anything else leaves ``r``
    failing, with ``not_waived`` saying why."""
    from .sanitizer_probe import shared_offset, supports_waiver
    if r.get("tool") != "racecheck" or r.get("ok") or "hazards" not in r:
        return r

    def no(why):
        r["not_waived"] = why
        return r

    builds = ws if isinstance(ws, list) else [ws] if ws else []
    bad = [w.get("error") for w in builds if w.get("error")]
    if bad:  # a build the shapes ran whose bytes are unknown: its hazards could land on
        # another build's addresses and be waived against that build's codes
        return no(f"a build the sanitizer shapes ran has no known dispatch bytes ({bad[0]})")
    if not builds:
        return no("not a gl.warp_specialize kernel with known dispatch bytes")
    if r.get("child_ok") is False:
        return no("the child did not finish its launches")
    errs = [h for h in r.get("findings", []) if h["level"] == "Error"]
    race_errs = [x for x in r.get("races", []) if x["level"] == "Error"]
    if not errs or len(errs) + len(race_errs) != r["race_errors"] or r["errors"] != r["race_errors"]:
        printed = len(errs) + len(race_errs) + len(
            [h for h in r.get("findings", []) if h["level"] != "Error"])
        capped = (f"; the log stopped at its print limit of {PRINT_LIMIT['racecheck']}"
                  if printed >= PRINT_LIMIT["racecheck"] else "")
        return no(f"{len(errs)} hazard(s) and {len(race_errs)} race report(s) read from the log for "
                  f"{r['race_errors']} racecheck errors and {r['errors']} in all{capped}")
    # the checks that need no address first, so the probe runs only when one could pass
    for h in errs:
        if h["kind"] != "RAW":
            return no(f"hazard at {h['addr']:#x}: {h['kind']} hazard")
    pairs = {tuple(sorted((a[0], a[4]) for a in h["accesses"])) for h in errs}
    for race in race_errs:
        # tuples: a result read back from JSON holds its pairs as lists
        acc = [tuple(a) for a in race["accesses"]]
        first, rest = acc[0], acc[1:]
        for other in rest or [None]:
            if other is None or tuple(sorted((first, other))) not in pairs:
                return no(f"a race report between {first} and {other} is not the dispatch handoff")
    p = probe() if callable(probe) else probe
    # racecheck's shared addresses sit past the kernel's offsets by what the probe measured
    # (its own bytes as racecheck reports them); unmeasured, none is assumed
    offset = shared_offset(p) or 0
    used = []
    for h in errs:
        whys = [_dispatch_hazard(h, w, offset) for w in builds]
        if all(whys):
            return no(f"hazard at {h['addr']:#x}: {whys[0]}")
        w = builds[whys.index(None)]
        if w not in used:
            used.append(w)
    # the control must share no feature the kernel builds that ran lack
    features = frozenset.intersection(*(frozenset(w.get("features", ())) for w in used))
    ok, line = supports_waiver(p, features)
    r["probe"] = line
    if not ok:
        return no(line)
    n = len(errs)
    spans = ", ".join(f"[{w['lo']:#x}, {w['hi']:#x})" for w in used)
    r["waived"] = n
    r["waiver"] = (f"racecheck: {n} hazard{'' if n == 1 else 's'} waived: warp-specialize dispatch bytes "
                   f"{spans}, ordered by barrier.sync 1 ({WAIVER_NOTE}); {line}")
    r["ok"] = True
    r.pop("error", None)
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
                "dtype": dtype, "seed": seed, "zero_scratch": tool == "initcheck"}
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
    if tool == "initcheck":
        r["setup"] = ZERO_SCRATCH_NOTE
    r["launched"] = child.get("launched", [])
    r["child_ok"] = bool(child.get("ok"))
    return r


def sanitizer_shapes(spec, n: int = 2, seed: int = 0) -> list:
    import random
    run = spec.run
    if run.sanitizer_shapes:
        return [dict(s) for s in run.sanitizer_shapes]
    rng = random.Random(seed)
    return [run.draw_shape(rng, True) for _ in range(n)]


def run_sanitizer(spec, tools=TOOLS, timeout: float = 300.0, seed: int = 0,
                  exe: str | None = None, device: str = "cuda", ws_dispatch: dict | None = None,
                  probe=None) -> dict:
    """Gate 6 for ``spec`` on this machine's GPU. Returns ``{"not_run": True, "error"}``
    where no compute-sanitizer is found, else ``ok``, per-tool results and, when a tool
    fails, ``error`` naming it with its first finding. ``ws_dispatch`` (a gl.warp_specialize
    kernel's :func:`dispatch_bytes`) and ``probe`` (a callable returning the barrier
    control's result, run only if a hazard could be waived) enable :func:`waive`."""
    if exe is None:
        exe, how = find_tool()
        if exe is None:
            return {"ok": False, "not_run": True, "error": how}
    if not tools:
        return {"ok": False, "not_run": True, "error": "no sanitizer tool requested (--sanitizer none)"}
    shapes = sanitizer_shapes(spec, seed=seed)
    dtype = (spec.run.interpreter_dtypes if device == "cpu" else spec.run.dtypes)[0]
    results = [run_tool(spec, t, exe, shapes, dtype, timeout, seed, device) for t in tools]
    for r in results:
        if r["tool"] == "racecheck" and not r["ok"]:
            waive(r, ws_dispatch, probe)
    failed = [r for r in results if not r["ok"]]
    labels = next((r["launched"] for r in results if r.get("launched")), [])
    out = {"ok": not failed, "tools": results, "shapes": labels or [str(s) for s in shapes],
           "dtype": dtype, "exe": exe}
    if failed:
        out["error"] = "; ".join(r["error"] for r in failed)
        out["failed_tools"] = [r["tool"] for r in failed]
    waivers = [r["waiver"] for r in results if r.get("waiver")]
    if waivers:
        out["waivers"] = waivers
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
            s = f"{t['tool']} {t['errors']} errors" if t.get("waiver") else s
            s += f" ({t['hazards']} hazards, {t['warnings']} warnings)"
            if t.get("waiver"):
                s += f" [{t['waiver']}]"
        parts.append(s)
    return (f"{', '.join(parts)} on {len(r['shapes'])} small shapes ({r['dtype']}): "
            + ", ".join(r["shapes"]))
