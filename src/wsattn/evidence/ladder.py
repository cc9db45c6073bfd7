"""Climb the gates for one (kernel, target) and say no more than the gates reached.

Gates, in order (a kernel stops at the first one it fails; "not run" also stops the
climb, and is never a pass):

0. target path  1. compile  2. structure  3. launch  4. numerics  5. stress
6. sanitizer  7. profile

The sanitizer gate comes after stress and before profile: it is the slowest correctness
gate (four instrumented child processes), so a kernel that already gives wrong numbers or
moving results stops before paying for it, and what it adds (a memory error or a
shared-memory hazard in launches that looked right) is what stress cannot see; a speed
claim comes only after every correctness gate.

``highest_gate`` is the last gate passed with every gate below it passed too. On a
machine without a device of the target's compute capability, the numerics gate can run
through the Triton interpreter instead (small sizes, fp16/fp32, once per kernel since the
interpreter has no target): it is reported as extra evidence beside the ladder and does
not raise ``highest_gate`` past 2.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, field

from . import structure as st_mod
from .compile_gate import compile_kernel, expected_path, parse_target_name

GATES = ("target path", "compile", "structure", "launch", "numerics", "stress", "sanitizer",
         "profile")
PASS, FAIL, NOT_RUN = "pass", "FAIL", "not run"


@dataclass
class GateResult:
    gate: int
    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)


@dataclass
class Config:
    max_gate: int = len(GATES) - 1
    numerics_shapes: int = 32          # per dtype, on the GPU
    interpreter_numerics: bool = True  # gate 4 through the interpreter where no device
    interpreter_shapes: int = 3
    interpreter_timeout: float = 600.0
    stress_launches: int = 2000
    stress_timeout: float = 600.0
    sanitizer_tools: tuple = ("memcheck", "racecheck", "synccheck", "initcheck")
    sanitizer_timeout: float = 300.0   # per tool
    profile_repeats: int = 7
    strict_ws: bool = False            # WS requested but not formed fails gate 2
    seed: int = 0


@dataclass
class LadderResult:
    kernel: str
    target: str
    gates: list
    highest_gate: int
    verdict: str
    extra: list = field(default_factory=list)
    description: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["highest_gate_name"] = GATES[self.highest_gate] if self.highest_gate >= 0 else None
        return d


def _gate(i, status, detail, **data):
    return GateResult(i, GATES[i], status, detail, data)


def _structure_line(s) -> str:
    return st_mod.summary(s)


def climb(spec, target: str, config: Config | None = None, cache: dict | None = None) -> LadderResult:
    """Run the gates for ``spec`` on ``target``; never raises."""
    config = config or Config()
    cache = {} if cache is None else cache
    gates, extra = [], []
    try:
        _climb(spec, target, config, cache, gates, extra)
    except Exception as e:  # a bug in a gate must not take the other kernels down
        last = len(gates)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        gates.append(_gate(min(last, len(GATES) - 1), FAIL, f"internal error in the ladder: {type(e).__name__}: {e} "
                                                f"({tb.filename.split('/')[-1]}:{tb.lineno})"))
    highest = -1
    for g in gates:
        if g.status != PASS:
            break
        highest = g.gate
    return LadderResult(spec.name, target, gates, highest, verdict(gates, extra, target), extra,
                        spec.description)


def _other_builds_dispatch(spec, cc, cs, default_warps) -> list:
    """dispatch_bytes of the builds the sanitizer's shapes run besides the compiled one:
    those RunSpec.sanitizer_builds names, else one per other head dim of the shapes (a
    library kernel's compile_spec takes head_dim=); a build that cannot be compiled here
    gives an entry with "error", so its hazards are never waived."""
    from . import sanitizer
    shapes = sanitizer.sanitizer_shapes(spec)
    builds = getattr(spec.run, "sanitizer_builds", None)
    if builds is not None:
        overrides, seen = [], set()
        for sh in shapes:
            for o in builds(sh):
                key = tuple(sorted(o.items()))
                if key not in seen:
                    seen.add(key)
                    overrides.append(o)
    else:
        have = (cs.get("constexprs") or {}).get("HEAD_DIM") or \
            (cs.get("constexprs") or {}).get("D")
        dims = sorted({sh.get("D") for sh in shapes} - {None, have})
        overrides = [{"head_dim": D} for D in dims]
    out = []
    for o in overrides:
        try:
            cs2 = spec.compile_spec(cc, **o)
            comp2 = compile_kernel(cs2["fn"], cs2["signature"], dict(cs2.get("constexprs") or {}),
                                   dict(cs2.get("options") or {}), cc, cs2.get("attrs"))
            out.append(sanitizer.dispatch_bytes(comp2.stages.get("ptx") or "",
                                                comp2.metadata.get("shared"),
                                                comp2.metadata.get("num_warps"), default_warps))
        except Exception as e:  # noqa: BLE001 - any failure only withholds the waiver
            what = ", ".join(f"{k}={v}" for k, v in o.items())
            out.append({"error": f"{what} build: {type(e).__name__}: {e}"})
    return out


def _climb(spec, target, config, cache, gates, extra):
    # gate 0: the target
    try:
        cc = parse_target_name(target)
    except ValueError as e:
        gates.append(_gate(0, FAIL, str(e)))
        return
    path = expected_path(cc)
    if spec.unavailable or spec.compile_spec is None:
        gates.append(_gate(0, PASS, f"{target}: expected {path['mma_expected']}, WS pass {path['ws_pass']}",
                           **path))
        gates.append(_gate(1, FAIL, spec.unavailable or "the spec gives no compile_spec"))
        return
    try:
        cs = spec.compile_spec(cc)
    except Exception as e:
        gates.append(_gate(0, PASS, f"{target}: expected {path['mma_expected']}, WS pass {path['ws_pass']}",
                           **path))
        msg = str(e).splitlines()[0] if str(e) else ""
        if type(e).__name__ in ("UnsupportedTarget", "UnsupportedTargetError"):
            # the kernel says it has no code path here: nothing was tried, nothing failed
            gates.append(_gate(1, NOT_RUN, f"not run: {msg}"))
        else:
            gates.append(_gate(1, FAIL, f"{type(e).__name__}: {msg}"))
        return
    missing = [k for k in ("fn", "signature") if k not in (cs or {})]
    if missing:
        gates.append(_gate(0, PASS, f"{target}: expected {path['mma_expected']}", **path))
        gates.append(_gate(1, FAIL, f"compile_spec returned no {' or '.join(missing)}"))
        return
    options = dict(cs.get("options") or {})
    comp = compile_kernel(cs["fn"], cs["signature"], dict(cs.get("constexprs") or {}), options, cc,
                          cs.get("attrs"))
    ptx = comp.stages.get("ptx")
    if comp.language == "gluon":
        path = dict(path, ws_pass="explicit (gl.warp_specialize)")
    if ptx is not None:
        mma, tma = st_mod.mma_family(ptx), st_mod.uses_tma(ptx)
        gates.append(_gate(0, PASS, f"{target}: {mma}{', TMA' if tma else ', no TMA'}, "
                                    f"WS pass {path['ws_pass']}", mma=mma, tma=tma, **path))
    else:
        gates.append(_gate(0, PASS, f"{target}: expected {path['mma_expected']} (no PTX to read), "
                                    f"WS pass {path['ws_pass']}", **path))
    # gate 1: compile
    if not comp.ok:
        detail = (f"the spec does not match the kernel: {comp.error}" if comp.failed_stage == "arguments"
                  else f"compile failed at the {comp.failed_stage} stage: {comp.error}")
        hints = st_mod.known_decline_reasons(cc, cs["fn"], cs["signature"], options,
                                             comp.stages.get("ttir")) \
            if comp.failed_stage not in ("arguments", "setup", "source") and (
                "tt.warp_specialize" in comp.stages.get("ttir", "")) else []
        if hints:
            detail += f" (warp specialization requested; known sm_90 trouble here: {'; '.join(hints)})"
        gates.append(_gate(1, FAIL, detail, stage=comp.failed_stage))
        return
    gates.append(_gate(1, PASS, f"compiles ({comp.language}, {comp.seconds:.1f} s, "
                                f"num_warps {comp.metadata.get('num_warps')})", seconds=comp.seconds))
    if config.max_gate < 2:
        return
    # gate 2: structure
    s = st_mod.analyse(comp, cs["fn"], cs["signature"], options)
    declined = s.ws_requested and not s.ws_formed
    gates.append(_gate(2, FAIL if declined and config.strict_ws else PASS, _structure_line(s),
                       **s.to_dict()))
    if gates[-1].status != PASS or config.max_gate < 3:
        _maybe_interpreter(spec, cc, config, cache, extra)
        return
    # gate 3: launch
    from .launch import not_here, run_launch
    why = not_here(cc)
    if spec.run is None:
        gates.append(_gate(3, NOT_RUN, "not run: the spec gives no runner (inputs, run, reference)"))
        return
    if why:
        gates.append(_gate(3, NOT_RUN, f"not run: {why}"))
        _maybe_interpreter(spec, cc, config, cache, extra)
        return
    r = run_launch(spec, config.seed)
    gates.append(_gate(3, PASS if r["ok"] else FAIL, f"launched at {r['shape']}" if r["ok"] else r["error"], **r))
    if not r["ok"] or config.max_gate < 4:
        return
    # gate 4: numerics
    from .numerics import run_numerics
    r = run_numerics(spec, "cuda", config.numerics_shapes, small=False, seed=config.seed)
    if r["ok"] and not r.get("checked"):
        gates.append(_gate(4, NOT_RUN, "not run: no shape was checked", **r))
        return
    gates.append(_gate(4, PASS if r["ok"] else FAIL, _numerics_line(r), **r))
    if not r["ok"] or config.max_gate < 5:
        return
    # gate 5: stress
    from .stress import run_stress
    r = run_stress(spec, "cuda", launches=config.stress_launches, timeout=config.stress_timeout,
                   seed=config.seed)
    if r.get("kind") == "not_run":
        gates.append(_gate(5, NOT_RUN, f"not run: {r['error']}", **r))
        return
    line = (f"{r['launches']} launches over {r['distinct_shapes']} shapes, each input twice: "
            "no hang, bit-identical" if r["ok"] else r["error"])
    gates.append(_gate(5, PASS if r["ok"] else FAIL, line, **r))
    if not r["ok"] or config.max_gate < 6:
        return
    # gate 6: sanitizer
    from . import sanitizer
    ws = None
    if comp.language == "gluon" and s.ws_formed:
        # the only kernels whose dispatch-byte hazard may be waived (notes/sanitizer.md);
        # the sanitizer's shapes may run other builds (another head dim), each with its own
        # dispatch bytes
        default = next((p.warps for p in s.partitions if p.name == "default"), None)
        ws = [sanitizer.dispatch_bytes(ptx or "", comp.metadata.get("shared"),
                                       comp.metadata.get("num_warps"), default)]
        ws += _other_builds_dispatch(spec, cc, cs, default)
    r = sanitizer.run_sanitizer(spec, tuple(config.sanitizer_tools), config.sanitizer_timeout,
                                config.seed, ws_dispatch=ws, probe=lambda: _probe(cache))
    if ws is not None:
        r["ws_dispatch"] = ws
    status = NOT_RUN if r.get("not_run") else PASS if r["ok"] else FAIL
    line = sanitizer.summary(r)
    missing = [t for t in sanitizer.TOOLS if t not in config.sanitizer_tools]
    if status == PASS and missing:
        # clean under the tools that ran, but the gate is all four: not reached
        status = NOT_RUN
        line = f"not reached: {', '.join(missing)} not run ({line})"
    gates.append(_gate(6, status, line, **r))
    if status != PASS or config.max_gate < 7:
        return
    # gate 7: profile
    from .profile import run_profile
    r = run_profile(spec, config.profile_repeats, config.seed)
    if r.get("not_run"):
        gates.append(_gate(7, NOT_RUN, f"not run: {r['error']}"))
    elif not r["ok"]:
        gates.append(_gate(7, FAIL, r["error"], **r))
    else:
        parts = [f"{row['verdict']} than {r['baseline']}".replace("no clear difference than",
                                                                  "no clear difference from")
                 + f" at {row['shape']} ({row['kernel_ms']:.3f} ms +-{row['kernel_spread_ms']:.3f} vs "
                   f"{row['baseline_ms']:.3f} ms +-{row['baseline_spread_ms']:.3f}, x{row['speedup']:.2f}"
                   + _eager_note(row.get("timing")) + ")"
                 for row in r["rows"]]
        gates.append(_gate(7, PASS, "; ".join(parts), **r))


def _eager_note(timing) -> str:
    """', kernel timed eagerly' where a side could not be replayed from a CUDA graph."""
    eager = [who for who, how in (timing or {}).items() if how != "graph"]
    return f", {' and '.join(eager)} timed eagerly (not capturable)" if eager else ""


def _probe(cache):
    """The barrier control under racecheck, once per ladder run (shared by every kernel)."""
    if "sanitizer_probe" not in cache:
        from .sanitizer_probe import run
        cache["sanitizer_probe"] = run()
    return cache["sanitizer_probe"]


def _numerics_line(r) -> str:
    if not r["ok"]:
        return r["error"]
    w = r["worst"]
    return (f"correct on {r['checked']} random shapes ({', '.join(r['dtypes'])}); worst relative error "
            f"{w['err']:.2e} (tol {w['tol']:.0e}) at {w['shape']}")


def _numerics_key(spec):
    """The interpreter-numerics cache key: a spec's origin and name (two files may each
    define a kernel of one name; one must not take the other's result)."""
    return ("interpreter-numerics", str(spec.origin), spec.name)


def _maybe_interpreter(spec, cc, config, cache, extra):
    """Numerics through the interpreter, once per kernel, where no device can run them."""
    if not config.interpreter_numerics or config.max_gate < 4 or spec.run is None:
        return
    from .launch import device_cc
    if device_cc() is not None:
        return  # a GPU machine runs the real gate for its own target
    if not spec.run.interpreter:
        extra.append(_gate(4, NOT_RUN, "interpreter numerics: not run (the kernel cannot run "
                                       "in the Triton interpreter)"))
        return
    key = _numerics_key(spec)
    if key not in cache:
        from .stress import run_interpreter_numerics
        cache[key] = run_interpreter_numerics(spec, config.interpreter_shapes,
                                              config.interpreter_timeout, config.seed)
    r = cache[key]
    if hasattr(r, "result"):  # started in the background by prefetch_interpreter
        r = cache[key] = r.result()
    if r.get("ok") and not r.get("checked"):
        extra.append(_gate(4, NOT_RUN, "interpreter numerics: not run (no shape was checked)",
                           interpreter=True, **r))
        return
    line = "interpreter (CPU, small sizes, not this target): " + (
        _numerics_line(r) if "checked" in r and (r["ok"] or "error" in r) else r.get("error", "failed"))
    extra.append(_gate(4, PASS if r["ok"] else FAIL, line, interpreter=True, **r))


def verdict(gates, extra, target) -> str:
    """One honest line: what each passed gate supports, then where the climb stopped."""
    words = []
    for g in gates:
        if g.status == PASS:
            if g.gate == 0:
                if g.data.get("mma"):
                    words.append(f"{target} path {g.data['mma']}" + (" + TMA" if g.data.get("tma") else ""))
                else:
                    words.append(f"{target} path (expected {g.data.get('mma_expected')})")
            elif g.gate == 1:
                words.append("compiles")
            elif g.gate == 2:
                if g.data.get("ws_formed"):
                    words.append(f"warp-specialized ({len(g.data['partitions'])} partitions)")
                elif g.data.get("ws_requested"):
                    words.append(f"WARP SPECIALIZATION NOT FORMED ({g.data.get('decline_reason')})")
                else:
                    words.append("not warp-specialized")
            elif g.gate == 3:
                words.append("launches")
            elif g.gate == 4:
                words.append(f"correct on {g.data.get('checked')} shapes")
            elif g.gate == 5:
                words.append(f"no hang or race in {g.data.get('launches')} launches")
            elif g.gate == 6:
                tools = f"{', '.join(t['tool'] for t in g.data.get('tools', []))} on {len(g.data.get('shapes', []))} shapes"
                if g.data.get("waivers"):  # never to be read as a clean run
                    words.append(f"sanitizer passes WITH A WAIVER ({tools}; {'; '.join(g.data['waivers'])})")
                else:
                    words.append(f"sanitizer-clean ({tools})")
            elif g.gate == 7:
                rows = g.data.get("rows", [])
                words.append("; ".join(f"{r['verdict']} vs {g.data.get('baseline')} (x{r['speedup']:.2f})"
                                       for r in rows))
        elif g.status == NOT_RUN:
            why = g.detail[len("not run: "):] if g.detail.startswith("not run: ") else g.detail
            words.append({1: "not compiled", 3: "not launched"}.get(g.gate, g.name + " not run")
                         + f": {why}")
            break
        else:
            words.append(f"FAILS {g.name}: {g.detail}")
            break
    for g in extra:
        if g.status == PASS:
            words.append(f"interpreter numerics pass ({g.data.get('checked')} small shapes)")
        elif g.status == FAIL:
            words.append(f"interpreter numerics FAIL: {g.data.get('error', g.detail)}")
    return ", ".join(words)


def prefetch_interpreter(specs, config: Config, cache: dict):
    """Start the interpreter numerics of every kernel in one background worker, so the
    child processes use a second core while the compiles run; returns the executor (shut
    it down after the climb). Nothing starts on a machine with a GPU."""
    from concurrent.futures import ThreadPoolExecutor

    from .launch import device_cc
    from .stress import run_interpreter_numerics
    todo = [s for s in specs if s.run is not None and s.run.interpreter and not s.unavailable
            and s.compile_spec is not None and _numerics_key(s) not in cache]
    if not config.interpreter_numerics or config.max_gate < 4 or not todo or device_cc() is not None:
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interpreter-numerics")
    for s in todo:
        cache[_numerics_key(s)] = pool.submit(run_interpreter_numerics, s, config.interpreter_shapes,
                                    config.interpreter_timeout, config.seed)
    return pool
