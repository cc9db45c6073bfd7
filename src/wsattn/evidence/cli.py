"""``wsattn ladder`` and ``wsattn targets``: registered by ``add_parser(subparsers)``."""

from __future__ import annotations

import argparse
import sys

from ..target import KNOWN_CCS


def _default_targets() -> list:
    from .launch import device_cc
    cc = device_cc()
    if cc is not None and f"sm_{cc}" in KNOWN_CCS:
        return [f"sm_{cc}"]
    return list(KNOWN_CCS)


class UnknownKernel(Exception):
    """A KERNEL argument that is neither a library name nor module:function."""


def _specs(kernels, spec_files) -> list:
    """Specs to climb; raises UnknownKernel (listing the library's names) for a bare name
    the library does not hold, before anything is compiled."""
    from . import library
    from .spec import load_file, load_ref
    unknown = [n for n in kernels or [] if ":" not in n and n not in library.NAMES]
    if unknown:
        raise UnknownKernel(
            f"unknown kernel{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
            f"known kernels are {', '.join(library.NAMES)}; or give module:function "
            "(e.g. wsattn.evidence.demo:matmul_ws_4w) or --spec FILE")
    specs = []
    for path in spec_files or []:
        specs += load_file(path)
    for name in kernels or []:
        specs += load_ref(name) if ":" in name else [library.get(name)]
    if not kernels and not spec_files:
        specs = library.all_specs()
    return specs


def _targets(requested) -> tuple[list, list]:
    targets = requested or _default_targets()
    good = [t for t in dict.fromkeys(targets) if t in KNOWN_CCS]
    bad = [t for t in dict.fromkeys(targets) if t not in KNOWN_CCS]
    return good, bad


def _progress(total, desc):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="kernel-target", file=sys.stderr, leave=False)
    except Exception:
        class _Null:
            def update(self, n=1): pass
            def set_postfix_str(self, s): pass
            def close(self): pass
        return _Null()


def _climb_all(specs, targets, config, desc, on_result=None):
    """Climb every (kernel, target); on_result(results so far) after each one, so a run
    stopped by a time limit still leaves what it reached (the device calls have one)."""
    from .ladder import climb, prefetch_interpreter
    results, cache = [], {}
    bar = _progress(len(specs) * len(targets), desc)
    pool = prefetch_interpreter(specs, config, cache) if targets else None
    try:
        for spec in specs:
            for t in targets:
                bar.set_postfix_str(f"{spec.name} {t}")
                results.append(climb(spec, t, config, cache))
                bar.update(1)
                if on_result is not None:
                    on_result(results)
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def _usage_error(e) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def run_ladder(args) -> int:
    """Climb the evidence ladder for kernels x targets and report. Nothing is written
    unless asked: --json and --markdown (which puts its PNG chart beside it) name files."""
    from . import report
    from .ladder import FAIL, Config
    if args.from_json:  # report only: no kernel is built or run
        source = args.from_json[0]
        if len(args.from_json) > 1:  # several runs: one document, written where --json says
            if not args.json:
                return _usage_error("--from-json with several files merges them: name the "
                                    "merged file with --json PATH")
            try:
                report.merge_json(args.from_json, args.json)
            except ValueError as e:
                return _usage_error(e)
            print(f"wrote {args.json}")
            source = args.json
        results, doc = report.from_json(source)
        print(report.table(results))
        if not doc.get("complete", True):
            print(f"note: {source} is (or merges) a partial run (stopped before its last "
                  "kernel)")
        if args.markdown:
            report.to_markdown(results, args.markdown, env=doc.get("environment"))
            print(f"wrote {args.markdown}")
        return 0
    try:
        specs = _specs(args.kernels, args.spec)
        tools = _sanitizer_tools(args.sanitizer)
    except (UnknownKernel, ValueError) as e:
        return _usage_error(e)
    targets, bad = _targets(args.target)
    for t in bad:
        print(f"error: unknown target {t!r}: expected one of {', '.join(KNOWN_CCS)} (skipped)",
              file=sys.stderr)
    for s in specs:
        if s.unavailable:
            print(f"error: {s.name}: {s.unavailable}", file=sys.stderr)
    config = Config(max_gate=args.max_gate, numerics_shapes=args.numerics_shapes,
                    interpreter_numerics=not args.no_interpreter, interpreter_shapes=args.interpreter_shapes,
                    stress_launches=args.stress_launches, stress_timeout=args.stress_timeout,
                    sanitizer_tools=tools, sanitizer_timeout=args.sanitizer_timeout,
                    profile_repeats=args.profile_repeats, strict_ws=args.strict_ws, seed=args.seed)
    meta = {"targets": targets, "config": vars(config)}

    def partial(results):  # rewritten after each kernel, marked incomplete until the end
        r = results[-1]
        print(f"{r.kernel} {r.target}: gate {report.reached(r)}", flush=True)
        if args.json:
            report.to_json(results, args.json, {**meta, "complete": False})

    results = _climb_all(specs, targets, config, "ladder", on_result=partial)
    print(report.table(results))
    env = report.environment()  # one reading for both files: the same date in each
    if args.json:
        report.to_json(results, args.json, {**meta, "complete": True}, env=env)
        print(f"wrote {args.json}")
    if args.markdown:
        report.to_markdown(results, args.markdown, env=env)
        print(f"wrote {args.markdown}")
    failed = bool(bad) or any(g.status == FAIL for r in results for g in list(r.gates) + list(r.extra))
    return 1 if failed else 0


def run_targets(args) -> int:
    """The card ledger: every library kernel against every target, compiled with no GPU.
    Nothing is written unless --json names a file."""
    import json

    from . import report
    from .ladder import Config
    try:
        specs = _specs(args.kernels, args.spec)
    except UnknownKernel as e:
        return _usage_error(e)
    targets, bad = _targets(args.target or list(KNOWN_CCS))
    for t in bad:
        print(f"error: unknown target {t!r}: expected one of {', '.join(KNOWN_CCS)} (skipped)",
              file=sys.stderr)
    for s in specs:
        if s.unavailable:
            print(f"error: {s.name}: {s.unavailable}", file=sys.stderr)
    results = _climb_all(specs, targets, Config(max_gate=2, interpreter_numerics=False), "targets")
    rows = [report.ledger_row(r) for r in results]
    print(report.ledger_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": report.environment(), "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if bad or any(s.unavailable for s in specs) else 0


def _sanitizer_tools(text) -> tuple:
    """'memcheck,racecheck' -> the tools, in the order given; 'none' -> ()."""
    from .sanitizer import TOOLS
    if text is None:
        return TOOLS
    if text.strip().lower() == "none":
        return ()
    tools = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise ValueError(f"unknown sanitizer tool {bad[0]!r}: expected some of {', '.join(TOOLS)} "
                         "(comma-separated) or none")
    return tools


def _at_least(low: int):
    """An argparse type: an int >= low, or a usage error naming the bound."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
        return value
    return parse


def add_parser(subparsers):
    """Register ``ladder`` and ``targets``; returns the ladder parser."""
    p = subparsers.add_parser(
        "ladder", help="climb the evidence ladder (compile -> structure -> launch -> numerics -> "
                       "stress -> sanitizer -> profile) for kernels and targets",
        description=run_ladder.__doc__ + "\n\nGates: 0 target path, 1 compile, 2 structure, 3 launch, "
        "4 numerics, 5 stress, 6 sanitizer, 7 profile. A kernel stops at the first gate it fails; the verdict "
        "never claims more than the highest gate reached. Without a GPU the default climbs gates "
        "0-2 for all targets and runs numerics through the Triton interpreter at small sizes; on "
        "a GPU it climbs all gates for that GPU's target.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", metavar="KERNEL",
                   help="library kernel name, or module:function giving a KernelSpec "
                        "(default: every library kernel)")
    p.add_argument("--target", action="append", metavar="sm_XX",
                   help=f"target, repeatable: {', '.join(KNOWN_CCS)} (default: this GPU's, "
                        "or all without a GPU)")
    p.add_argument("--spec", action="append", metavar="FILE", help="a .py or .toml kernel spec file")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a Markdown report (+ a PNG chart)")
    p.add_argument("--from-json", metavar="PATH", nargs="+",
                   help="climb nothing: report (table, --markdown) from an earlier run's --json; "
                        "several files are merged into the one --json names, each kernel's "
                        "row from the last file that holds it (runs of one config only)")
    p.add_argument("--max-gate", type=int, default=7, choices=range(8), help="stop after this gate")
    p.add_argument("--numerics-shapes", type=_at_least(1), default=32,
                   help="random shapes per dtype (GPU)")
    p.add_argument("--interpreter-shapes", type=_at_least(1), default=3,
                   help="random small shapes for the interpreter numerics (no GPU)")
    p.add_argument("--no-interpreter", action="store_true", help="skip the interpreter numerics")
    p.add_argument("--stress-launches", type=_at_least(2), default=2000,
                   help="launches of gate 5, each input run twice (>= 2)")
    p.add_argument("--stress-timeout", type=float, default=600.0, help="watchdog seconds")
    p.add_argument("--sanitizer", metavar="TOOLS", default=None,
                   help="compute-sanitizer tools for gate 6, comma-separated (default: memcheck,"
                        "racecheck,synccheck,initcheck; 'none' leaves the gate not run)")
    p.add_argument("--sanitizer-timeout", type=float, default=300.0,
                   help="watchdog seconds per sanitizer tool and kernel")
    p.add_argument("--profile-repeats", type=_at_least(3), default=7,
                   help="timed repeats a side for gate 7's verdict (>= 3: a spread)")
    p.add_argument("--strict-ws", action="store_true",
                   help="fail gate 2 when warp specialization is requested but does not form")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_ladder)

    t = subparsers.add_parser(
        "targets", help="the card ledger: each library kernel's MMA path, TMA, warp "
                        "specialization, registers and shared memory on every target",
        description=run_targets.__doc__)
    t.add_argument("kernels", nargs="*", metavar="KERNEL", help="default: every library kernel")
    t.add_argument("--target", action="append", metavar="sm_XX", help="default: all known targets")
    t.add_argument("--spec", action="append", metavar="FILE", help="a .py or .toml kernel spec file")
    t.add_argument("--json", metavar="PATH", help="write the ledger as JSON")
    t.set_defaults(func=run_targets)
    return p
