"""Each implementation alone for a few seconds: its SM clock, power draw and energy a call.

`wsattn bench` times a case's columns interleaved, one sample of each a round, so that
every column sees the same stretch of the GPU's clock. On the H200 the prefill bench runs
under the software power cap (clock-event reason 0x4 active in 95-100 % of its samples
at N >= 4k, SM clock 1,650-1,870 MHz against a 1,980 MHz top), so that clock is set by the
mix of columns, and a 20 ms clock log cannot say which column draws the power. Here each
column runs alone, graph replays back to back for ``--seconds``, while ``nvidia-smi`` logs
every ``--log-ms`` ms; a window's first ``--settle`` seconds are dropped (clock and power
take a while to settle after a change of load), and the columns run in ``--rounds``
rounds, the order reversed every other round, so a drift in temperature does not favour
one of them. Per column and round: ms a call, the median SM clock and power draw over the
window, the share of log entries with the power cap active, energy a call (W x s) and
TFLOP/s; then, per case, each column's medians over the rounds.

What it answers (notes/prefill_gluon.md, "Under the power cap"): under the cap, a kernel
that needs more energy for the same work runs at a lower clock. If two
kernels run at the same clock and power, the faster one does more work a clock; if the
slower one also runs at a lower clock, part of its gap is energy a call.

    python -m wsattn.bench.power --impl wsattn fa4 sdpa-cudnn triton \\
        --prefill-seqlens 16384 --prefill-dims 128 [--causal both] [--json OUT.json]

Every column's output is checked against the float64 reference first (the bench's check);
a column that fails it, or cannot run here, is reported and not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from .cases import PREFILL_DIMS, PREFILL_LENGTHS, prefill_cases, tflops
from .clocks import POWER_CAP, cell, open_log, parse_clock_log

LOG_FIELDS = ("timestamp,index,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,"
              "clocks_event_reasons.active")


def window_stats(log: list[dict], start: float, end: float, settle: float,
                 samples: list[tuple[float, float]]) -> dict:
    """One column's window [start, end] (Unix seconds), its first ``settle`` seconds
    dropped: the median ms a call of the samples (ms, end time) that ended after the
    settling, and over the log entries inside it the median SM clock and power draw, the
    share with the power cap active and their count. Raises ValueError when the window
    is not longer than ``settle`` or no sample or log entry falls in what is left: a
    figure from nothing would be a wrong figure."""
    if end - start <= settle:
        raise ValueError(f"window of {end - start:.2f} s is not longer than settle={settle} s")
    lo = start + settle
    kept = [ms for ms, t in samples if t >= lo]
    entries = [e for e in log if lo <= e["t"] <= end]
    if not kept:
        raise ValueError("no sample ended after the settling time")
    if not entries:
        raise ValueError(f"no clock-log entry in [{lo:.3f}, {end:.3f}]")
    clocks = [e["sm_mhz"] for e in entries if e["sm_mhz"] is not None]
    power = [e["power_w"] for e in entries if e["power_w"] is not None]
    reasons = [e["reasons"] for e in entries if e["reasons"] is not None]
    ms = statistics.median(kept)
    watts = statistics.median(power) if power else None
    return {"ms": ms, "samples": len(kept), "log_entries": len(entries),
            "sm_mhz": statistics.median(clocks) if clocks else None,
            "power_w": watts,
            "power_cap_share": (sum(bool(r & POWER_CAP) for r in reasons) / len(reasons)
                                if reasons else None),
            "energy_mj": watts * ms if watts is not None else None}  # W x ms = mJ


def summarize(rows: list[dict]) -> list[dict]:
    """Per (case, impl): the medians over its rounds of ms, clock, power and energy."""
    groups: dict = {}
    for r in rows:
        if r.get("status") == "ok":
            groups.setdefault((r["case"], r["impl"]), []).append(r)
    out = []
    for (case, impl), rs in groups.items():
        def med(key):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        out.append({"case": case, "impl": impl, "rounds": len(rs), "ms": med("ms"),
                    "tflops": med("tflops"), "sm_mhz": med("sm_mhz"),
                    "power_w": med("power_w"), "power_cap_share": med("power_cap_share"),
                    "energy_mj": med("energy_mj")})
    return out


def format_summary(summary: list[dict]) -> str:
    head = (f"{'case':<42} {'impl':<12} {'ms':>8} {'TFLOP/s':>8} {'MHz':>6} {'W':>6} "
            f"{'capped':>6} {'mJ/call':>8} {'rounds':>6}")
    lines = [head, "-" * len(head)]
    f = cell
    for s in summary:
        lines.append(f"{s['case'][:42]:<42} {s['impl'][:12]:<12} {f(s['ms'], '.4f'):>8} "
                     f"{f(s['tflops'], '.0f'):>8} {f(s['sm_mhz'], '.0f'):>6} "
                     f"{f(s['power_w'], '.0f'):>6} {f(s['power_cap_share'], '.2f'):>6} "
                     f"{f(s['energy_mj'], '.1f'):>8} {s['rounds']:>6}")
    return "\n".join(lines)


def _start_log(out, interval_ms: int):
    """nvidia-smi logging into the open file ``out`` every interval_ms ms until stopped."""
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={LOG_FIELDS}", "--format=csv",
                             "-lms", str(interval_ms)], stdout=out, stderr=subprocess.STDOUT)


def run(args) -> list[dict]:
    from .env import stamp as make_stamp
    from .runners import all_runners, make_inputs
    from .suite import Pending, check_one
    from .timing import cuda_timer, release

    device = "cuda"
    stamp = make_stamp(device)
    names = {r.name: r for r in all_runners()}
    runners = [names[n] for n in args.impl]
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    cases = [c for c in prefill_cases(lengths=args.prefill_seqlens, head_dims=args.prefill_dims)
             if c.causal in causal]
    # a sample of ~20 ms between syncs: the window is a stream of replays, not of launches
    timer = cuda_timer(rep_ms=20.0 * 20, samples=20)
    log_path = args.log
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="power_clocks_", suffix=".csv")
        os.close(fd)  # nvidia-smi writes it through the file opened below
    log_out = open(log_path, "w")
    logger = _start_log(log_out, args.log_ms)
    rows, windows = [], []
    try:
        time.sleep(0.5)
        for case in cases:
            inputs = make_inputs(case, device)
            # every column checked before any is captured, as the bench does (a capture
            # between two checks faulted a replay on the H200)
            slots = {r.name: check_one(case, r, inputs, stamp, device) for r in runners}
            ready = {}
            for name, slot in slots.items():
                if isinstance(slot, Pending):
                    ready[name] = timer.prepare(slot.fn)
                else:
                    print(f"{case.id} {name}: {slot.get('status')}: {slot.get('reason')}",
                          file=sys.stderr)
                    rows.append({**stamp, "case": case.id, "impl": name,
                                 "status": slot.get("status"), "reason": slot.get("reason")})
            order = list(ready)
            for rnd in range(args.rounds):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    time.sleep(args.idle)  # each window starts from the same idle state
                    sampler = ready[name]
                    samples = []
                    start = time.time()
                    while time.time() - start < args.seconds:
                        samples.append((sampler(), time.time()))
                    windows.append((case, name, rnd, start, time.time(), samples))
            del inputs, ready, slots
            release(device)
        time.sleep(0.2)
    finally:
        logger.terminate()
        logger.wait()
        log_out.close()
    with open_log(log_path) as fh:
        log = parse_clock_log(fh)
    for case, name, rnd, start, end, samples in windows:
        row = {**stamp, "case": case.id, "impl": name, "round": rnd, "status": "ok",
               "seconds": end - start, "settle_s": args.settle}
        try:
            row.update(window_stats(log, start, end, args.settle, samples))
            row["tflops"] = tflops(case.flops(), row["ms"])
        except ValueError as e:
            row.update(status="error", reason=str(e))
        rows.append(row)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m wsattn.bench.power",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", nargs="+", default=["wsattn", "fa4", "sdpa-cudnn"],
                   help="bench columns (names as in `wsattn bench --impl`)")
    p.add_argument("--prefill-seqlens", nargs="+", type=int, default=[16384],
                   help=f"lengths (16k tokens a batch; bench's: {PREFILL_LENGTHS})")
    p.add_argument("--prefill-dims", nargs="+", type=int, default=[128],
                   help=f"head dims (bench's: {PREFILL_DIMS})")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--seconds", type=float, default=3.0, help="a column's window")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds dropped at the start of each window")
    p.add_argument("--idle", type=float, default=0.5, help="idle seconds before each window")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--log-ms", type=int, default=20, help="nvidia-smi's logging interval")
    p.add_argument("--log", help="where the clock log goes (default: a temporary file)")
    p.add_argument("--json", help="rows and per-column summary as JSON")
    args = p.parse_args(argv)
    from .runners import RUNNER_NAMES
    for name in args.impl:
        if name not in RUNNER_NAMES:
            p.error(f"--impl: {name!r} is not a bench column; one of {RUNNER_NAMES}")
    if args.seconds <= args.settle:
        p.error(f"--seconds ({args.seconds}) must exceed --settle ({args.settle})")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.log_ms < 1:
        p.error(f"--log-ms must be at least 1, got {args.log_ms}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    summary = summarize(rows)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "summary": summary}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
