"""`wsattn bench`: ceilings, wsattn kernels and peers measured in one run on this GPU.

    wsattn bench [prefill|decode|all|sp|step|gemv|moe|chunked|varlen] [--quick] [--dtype bf16]
                 [--impl ...] [--step-shapes] [--decode-settings SPEC ...]
                 [--json PATH] [--plot PATH | --no-plot]

Each output is checked against the float64 reference (on a slice) before it is timed; a
failed check is recorded, not timed. Prints a table; writes nothing unless asked: JSON rows
with --json PATH (a directory there gets the conventional name
bench_<gpu>_<date>_<commit>.json), a PNG plot with --plot PATH, or beside the JSON unless
--no-plot. Exit status: 0, 1 if a wsattn kernel failed its check or raised, 2 without a
CUDA GPU. `wsattn bench sp` runs the sequence-parallel benchmark (wsattn.sp.bench) under
torchrun, one process per GPU. `wsattn bench gemv` times every GEMV of a decode step at
model shapes against cuBLAS and the copy ceiling (wsattn.bench.gemv); `wsattn bench step`
a whole decode step against transformers and the memory floor (wsattn.bench.step; it
rewrites its JSON after every case, so a run stopped by a time limit keeps the cases that
finished);
`wsattn bench moe` one MoE layer (Qwen3-30B-A3B, Mixtral-8x7B, OLMoE, dots.llm1 shapes) against
transformers' MoE block, torch._grouped_mm and the touched-weight floor (wsattn.bench.moe);
`wsattn bench chunked` chunked prefill (a chunk of 2048 queries over a paged prefix of
0-32k, pages 16 and 64) against the same attention with contiguous keys and the matmul
ceiling (wsattn.bench.chunked); `wsattn bench varlen` packed variable-length prefill (16k
tokens of lengths drawn from 64-8192, fixed seed) against equal-length batches of the same
work and torch's FlashAttention-2 varlen (wsattn.bench.varlen).

`wsattn bench decode --step-shapes` runs the decode step's attention shapes instead of the
long contexts (Llama-3.2-1B, Llama-3.1-8B and Qwen3-30B-A3B heads, B 1-64, L 1k-32k,
contiguous and the engine's pages of 64); `--decode-settings SPEC ...` adds a column
`triton[SPEC]` per SPEC = BLOCK_N,num_warps,num_stages,num_splits[,bt_preload]: the Triton
decode kernel launched with exactly those settings (num_splits 0: the count the default
rule picks for the case at that BLOCK_N), checked then timed like `triton`, whose rows
note the settings the defaults chose. A decode case whose K/V fits in L2 several times
over is timed over copies of its inputs, so that it reads HBM as the decode step does.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

WHAT = ("prefill", "decode", "all", "sp", "step", "gemv", "moe", "chunked", "varlen")
SP_MODULE = "wsattn.sp.bench"  # provides main(args) -> int, optionally add_arguments(parser)


def _sp_module():
    """(the SP benchmark module, None) or (None, why it cannot be used)."""
    try:
        return importlib.import_module(SP_MODULE), None
    except ModuleNotFoundError as e:
        if e.name and (SP_MODULE.startswith(e.name) or e.name.startswith(SP_MODULE)):
            return None, f"not built yet ({SP_MODULE} is missing)"
        return None, f"{SP_MODULE} failed to import: {type(e).__name__}: {e}"
    except Exception as e:  # a broken SP module must not take `wsattn bench` down with it
        return None, f"{SP_MODULE} failed to import: {type(e).__name__}: {e}"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from .runners import BUILD_RUNNERS, DEFAULT_RUNNERS, RUNNER_NAMES
    from .timing import METHODS

    p = subparsers.add_parser(
        "bench", help="measure ceilings, wsattn kernels and peers on this GPU",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=WHAT, default="all",
                   help="which benchmark (default: all = prefill and decode)")
    p.add_argument("--quick", action="store_true", help="a small subset of the shapes")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--impl", nargs="+", choices=RUNNER_NAMES, default=list(DEFAULT_RUNNERS),
                   metavar="IMPL",
                   help=f"implementations to run (default: {' '.join(DEFAULT_RUNNERS)}; "
                        f"by name only, one Gluon build each whatever the length rule "
                        f"picks: {' '.join(BUILD_RUNNERS)})")
    p.add_argument("--json", metavar="PATH",
                   help="write the JSON rows there (an existing directory: "
                        "bench_<gpu>_<date>_<commit>.json inside it); default: no file")
    p.add_argument("--plot", metavar="PATH",
                   help="draw the PNG there (default: beside the JSON when --json is given)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument("--timing", choices=METHODS, default="graph",
                   help="graph: kernels replayed from a CUDA graph (no host overhead; the "
                        "default); eager: launched from Python")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per measurement (ms)")
    p.add_argument("--rep-ms", type=float, default=100.0,
                   help="time spent in timed samples per measurement (ms, 20 samples)")
    from .cases import PREFILL_DIMS, PREFILL_LENGTHS
    prefill_group = p.add_argument_group("prefill (fixed-length attention, 16k tokens a batch)")
    prefill_group.add_argument("--prefill-seqlens", nargs="+", type=int, default=None,
                               metavar="N", help="prefill: sequence lengths, B = 16384 / N "
                                                 "(default "
                                                 f"{' '.join(map(str, PREFILL_LENGTHS))})")
    prefill_group.add_argument("--prefill-dims", nargs="+", type=int, default=None,
                               metavar="D", help="prefill: head dims, H = 2048 / D (default "
                                                 f"{' '.join(map(str, PREFILL_DIMS))})")
    prefill_group.add_argument("--gluon-settings", nargs="+", type=_gluon_settings_arg,
                               default=None, metavar="SPEC",
                               help="prefill: extra columns gluon[SPEC], the Gluon kernel's "
                                    "fixed-length build that prefill_gluon.settings_for makes "
                                    "with these overrides whatever the length rule picks; "
                                    "SPEC = FIELD=VALUE[,FIELD=VALUE...] over GluonSettings' "
                                    "fields (bools 0/1), e.g. CONSUMERS=2,persistent=1")
    decode_group = p.add_argument_group("decode (the attention kernel alone)")
    decode_group.add_argument("--step-shapes", action="store_true",
                              help="decode: the decode step's shapes (Llama-3.2-1B, "
                                   "Llama-3.1-8B and Qwen3-30B-A3B heads; (B, L) in (1, 1k), "
                                   "(1, 4k), (8, 4k), (32, 4k), (64, 1k), (1, 32k); contiguous "
                                   "and the engine's pages of 64) instead of the long-context "
                                   "cases")
    decode_group.add_argument("--decode-settings", nargs="+", type=_settings_arg, default=None,
                              metavar="SPEC",
                              help="decode: extra columns triton[SPEC], the Triton decode "
                                   "kernel with these settings; SPEC = BLOCK_N,num_warps,"
                                   "num_stages,num_splits[,bt_preload] (num_splits 0: "
                                   "the default rule's count; bt_preload 0/1, default 0), "
                                   "e.g. 64,4,4,16")
    from . import chunked as chunked_mod, gemv as gemv_mod, moe as moe_mod, step as step_mod
    from . import varlen as varlen_mod
    model_group = p.add_argument_group("step and gemv (decode-step model shapes)")
    gemv_mod.add_arguments(model_group)
    step_mod.add_arguments(model_group)
    moe_mod.add_arguments(p.add_argument_group("moe (one MoE layer of a decode step)"))
    chunked_mod.add_arguments(p.add_argument_group(
        "chunked (chunked prefill over a paged prefix)"))
    varlen_mod.add_arguments(p.add_argument_group(
        "varlen (packed variable-length prefill against equal-length batches)"))
    sp, _ = _sp_module()
    if sp is not None and hasattr(sp, "add_arguments"):
        sp.add_arguments(p.add_argument_group("sp (sequence parallelism)"))
    p.set_defaults(func=run)
    return p


def _gluon_settings_arg(spec: str) -> str:
    """argparse type of --gluon-settings: a bad SPEC exits 2 naming the option; the
    column is named by the SPEC as given."""
    from .runners import parse_gluon_settings

    try:
        parse_gluon_settings(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def _settings_arg(spec: str):
    """argparse type of --decode-settings: a bad SPEC exits 2 naming the option."""
    from .runners import parse_decode_settings

    try:
        return parse_decode_settings(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefill_args_error(args) -> str | None:
    """Why --prefill-seqlens / --prefill-dims / --gluon-settings cannot run with the rest
    of args, or None."""
    from .cases import prefill_lengths_error

    what = getattr(args, "what", "all")
    seqlens, dims = getattr(args, "prefill_seqlens", None), getattr(args, "prefill_dims", None)
    if (seqlens or dims) and what not in ("prefill", "all"):
        return (f"--prefill-seqlens / --prefill-dims apply to `wsattn bench prefill` (or all), "
                f"not `{what}`")
    if getattr(args, "gluon_settings", None) and what not in ("prefill", "all"):
        return f"--gluon-settings applies to `wsattn bench prefill` (or all), not `{what}`"
    return prefill_lengths_error(seqlens, dims)


def decode_args_error(args) -> str | None:
    """Why --step-shapes / --decode-settings cannot run with the rest of args, or None."""
    from .runners import format_decode_settings

    what = getattr(args, "what", "all")
    if getattr(args, "step_shapes", False) and what != "decode":
        return f"--step-shapes applies to `wsattn bench decode`, not `{what}`"
    settings = getattr(args, "decode_settings", None) or []
    if settings and what not in ("decode", "all"):
        return f"--decode-settings applies to `wsattn bench decode` (or all), not `{what}`"
    specs = [format_decode_settings(s) for s in settings]
    twice = sorted({s for s in specs if specs.count(s) > 1})
    if twice:
        return f"--decode-settings: {', '.join(twice)} given more than once"
    return None


NO_GPU = ("wsattn bench needs a CUDA GPU, and this machine has none visible to torch "
          "(torch {torch}, CUDA build: {cuda}). Run it on a GPU machine; here, `wsattn ladder` "
          "or `python -m wsattn.bench.smoke` runs the kernels through the Triton interpreter.")
NO_GPUS_SP = ("wsattn bench sp needs CUDA GPUs (one process per GPU: torchrun --nproc-per-node N "
              "-m wsattn.cli bench sp), and this machine has none visible to torch (torch {torch}, "
              "CUDA build: {cuda}). The CPU tests run its plumbing on gloo (tests/test_sp_gloo.py).")


def run(args) -> int:
    import torch

    why = prefill_args_error(args) or decode_args_error(args)
    if why:
        print(f"wsattn bench: {why}", file=sys.stderr)
        return 2
    if args.what == "varlen":  # bad options are named before any GPU is looked for
        from .varlen import args_error
        why = args_error(args)
        if why:
            print(f"wsattn bench varlen: {why}", file=sys.stderr)
            return 2
    if args.what == "sp":
        if not torch.cuda.is_available():
            print(NO_GPUS_SP.format(torch=torch.__version__, cuda=torch.version.cuda),
                  file=sys.stderr)
            return 2
        sp, why = _sp_module()
        if sp is None:
            print(f"wsattn bench sp: the sequence-parallel benchmark is unavailable: {why}",
                  file=sys.stderr)
            return 2
        return int(sp.main(args) or 0)
    if not torch.cuda.is_available():
        print(NO_GPU.format(torch=torch.__version__, cuda=torch.version.cuda), file=sys.stderr)
        return 2
    from wsattn.target import interpreting
    if interpreting():
        print("wsattn bench: TRITON_INTERPRET=1 is set, which would time the CPU interpreter; "
              "unset it", file=sys.stderr)
        return 2
    if args.what in ("step", "gemv", "moe", "chunked", "varlen"):
        module = importlib.import_module(f"wsattn.bench.{args.what}")
        return int(module.main(args) or 0)
    return _bench(args, torch)


def _bench(args, torch) -> int:
    from tqdm import tqdm

    from . import ceilings as ceil_mod
    from .cases import decode_cases, prefill_cases, step_decode_cases
    from .env import stamp as make_stamp
    from .report import add_ratios, ceiling_row, format_table
    from .runners import (DecodeSettingsRunner, GluonBuildRunner, Rotated, all_runners,
                          parse_gluon_settings, settings_build)
    from .suite import run_cases
    from .timing import cuda_timer

    device = torch.device("cuda", torch.cuda.current_device())
    stamp = make_stamp(device)
    timer = cuda_timer(args.warmup_ms, args.rep_ms, args.timing)
    cases = []
    if args.what in ("prefill", "all"):
        cases += prefill_cases(args.quick, args.dtype, args.prefill_seqlens, args.prefill_dims)
    if args.what in ("decode", "all"):
        pick = step_decode_cases if args.step_shapes else decode_cases
        cases += pick(args.quick, args.dtype)
    runners = [r for r in all_runners() if r.name in args.impl]
    runners += [DecodeSettingsRunner(s) for s in args.decode_settings or ()]
    runners += [GluonBuildRunner(f"gluon[{spec}]", settings_build(parse_gluon_settings(spec)))
                for spec in args.gluon_settings or ()]
    # a no-op on every default case (their caches exceed L2 many times over)
    runners = [Rotated(r) for r in runners]
    total = 2 + sum(r.applies(c) for c in cases for r in runners)
    print(f"wsattn bench on {stamp['gpu']} ({stamp['cc']}, driver {stamp['driver']}), torch "
          f"{stamp['torch']}, triton {stamp['triton']}, cuDNN {stamp['cudnn']}, commit "
          f"{stamp['commit']}", file=sys.stderr)
    rows, ceilings = [], {}
    with tqdm(total=total, desc="wsattn bench", file=sys.stderr, dynamic_ncols=True) as bar:
        for measure in (ceil_mod.copy_bandwidth, ceil_mod.matmul_rate):
            bar.set_postfix_str(measure.__name__, refresh=True)
            try:
                c = measure(timer, device)
                ceilings[c.name] = c
                rows.append(ceiling_row(stamp, c))
            except Exception as e:  # ratios to this ceiling stay empty
                tqdm.write(f"ceiling {measure.__name__} failed: {type(e).__name__}: {e}")
            bar.update(1)
        rows += run_cases(cases, runners, timer, stamp, device, progress=bar)
    add_ratios(rows, ceilings)
    print(format_table(rows))
    write_outputs(rows, stamp, args)
    # an explicit setting may not fit the GPU (an 'error' row, part of a sweep), but a
    # wrong answer from one is a kernel bug like any other
    broken = [r for r in rows
              if (r["impl"] in ("wsattn", "triton", "gluon") and r["status"] in ("failed", "error"))
              or (r["impl"].startswith(("triton[", "gluon")) and r["status"] == "failed")]
    for r in broken:
        print(f"wsattn {r['impl']} {r['status']} on {r['case']}: {r['reason']}", file=sys.stderr)
    return 1 if broken else 0


def write_outputs(rows, stamp, args) -> list[Path]:
    """Write the JSON rows and the plot where args.json / args.plot say, and nowhere else:
    a command run in a checkout must not leave files in it unasked."""
    from .env import json_name
    from .plot import plot_rows
    from .report import write_json

    written, path = [], None
    if args.json:
        path = Path(args.json)
        path = write_json(rows, path / json_name(stamp) if path.is_dir() else path)
        written.append(path)
        print(f"\nJSON rows written to {path}")
    plot_path = args.plot or (path.with_suffix(".png") if path else None)
    if plot_path and not args.no_plot:
        drawn, message = plot_rows(rows, plot_path)
        written += [drawn] if drawn else []
        print(message)
    return written
