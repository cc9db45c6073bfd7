"""Benchmark rows: one dict per (case, impl), stamped, with ratios; the table and the JSON.

Every row has the same keys (None where a field does not apply), so the JSON loads as one
table. Ratios are throughput ratios (> 1 is faster than the row compared with).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .cases import tbps, tflops

STATUSES = ("ok", "failed", "not available", "error")
RESULT_FIELDS = ("median_ms", "q20_ms", "q80_ms", "reps", "calls", "timing", "samples_ms",
                 "samples_t", "tflops", "tbps", "ratio_cudnn", "ratio_triton", "ratio_fa4",
                 "ratio_matmul", "frac_copy", "ratio_contiguous")


def timing_fields(timing, samples=None, stamps=None) -> dict:
    """A timed row's timing fields, the same in every benchmark's rows: the Timing's
    summary, and the samples in round order (``samples_ms``) with the host time at the end
    of each (``samples_t``, Unix seconds), where the rows were timed in rounds."""
    return dict(median_ms=timing.median_ms, q20_ms=timing.q20_ms, q80_ms=timing.q80_ms,
                reps=timing.reps, calls=timing.calls, timing=timing.method,
                samples_ms=None if samples is None else [float(t) for t in samples],
                samples_t=None if stamps is None else [round(t, 4) for t in stamps])


def make_row(stamp: dict, case, impl: str, status: str, *, reason=None, check=None,
             timing=None, note=None, samples=None, stamps=None) -> dict:
    """A row for one (case, impl). Throughput is filled only for a timed ('ok') row;
    samples: the timing's samples in round order (``samples_ms``; the rows of one case are
    timed in one interleaved loop, so sample i of two rows comes from the same round);
    stamps: the host time at the end of each (``samples_t``, Unix seconds)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if status == "ok" and (timing is None or check is None or not check.passed):
        raise ValueError("an 'ok' row needs a passed check and a timing")
    row = dict(stamp)
    row.update(op=case.op, impl=impl, case=case.id, dtype=case.dtype, causal=case.causal,
               layout=getattr(case, "layout", "contiguous"), **case.shape_fields(),
               status=status, reason=reason, note=note,
               rel_err=None if check is None else check.rel_err,
               tol=None if check is None else check.tol,
               check_passed=None if check is None else check.passed,
               check_slice=None if check is None else check.where)
    row.update({k: None for k in RESULT_FIELDS})
    if timing is not None:
        row.update(timing_fields(timing, samples, stamps))
        if case.op == "prefill":
            row["tflops"] = tflops(case.flops(), timing.median_ms)
        else:
            row["tbps"] = tbps(case.bytes_moved(), timing.median_ms)
    return row


def ceiling_row(stamp: dict, ceiling) -> dict:
    row = dict(stamp)
    row.update(op="ceiling", impl=ceiling.name, case=ceiling.what, status="ok",
               median_ms=ceiling.timing.median_ms, q20_ms=ceiling.timing.q20_ms,
               q80_ms=ceiling.timing.q80_ms, reps=ceiling.timing.reps,
               calls=ceiling.timing.calls, timing=ceiling.timing.method,
               tflops=ceiling.value if ceiling.unit == "TFLOP/s" else None,
               tbps=ceiling.value if ceiling.unit == "TB/s" else None)
    return row


def _key(row, **override):
    k = {f: row.get(f) for f in ("op", "B", "Sq", "Sk", "Hq", "Hkv", "D", "causal", "dtype",
                                 "page_size", "impl")}
    k.update(override)
    return tuple(sorted(k.items()))


def paired_ratio(ref: dict, row: dict) -> float:
    """ref's time / row's: where both rows were timed in one interleaved loop
    (``timing.time_interleaved``: sample i of each from round i; told by their samples'
    host times, ``samples_t``, whose spans overlap only then, and equal counts), the median
    over the rounds of that round's two samples, so drift slower than a round cancels;
    else (e.g. a paged decode case against its contiguous case, two loops one after the
    other) the ratio of the medians."""
    a, b = ref.get("samples_ms"), row.get("samples_ms")
    ta, tb = ref.get("samples_t"), row.get("samples_t")
    one_loop = bool(ta and tb) and max(ta[0], tb[0]) < min(ta[-1], tb[-1])
    if one_loop and a and b and len(a) == len(b):
        return statistics.median(x / y for x, y in zip(a, b))
    return ref["median_ms"] / row["median_ms"]


def throughput_ratio(row: dict, peer: dict, metric: str) -> float:
    """row's throughput (``metric``: tflops, tbps) over peer's: the ratio of the two rows'
    work (equal for one prefill shape; not for a pack against its equal-length batch, or a
    paged decode row against its contiguous peer) times their time ratio, paired by round
    (:func:`paired_ratio`)."""
    work = (row[metric] * row["median_ms"]) / (peer[metric] * peer["median_ms"])
    return work * paired_ratio(peer, row)


def add_ratios(rows: list[dict], ceilings: dict | None = None) -> list[dict]:
    """Fill ratio_cudnn, ratio_triton, ratio_fa4 and ratio_matmul (prefill), frac_copy and
    ratio_contiguous (decode) on the timed rows, in place. A ratio to a peer row is the
    throughput ratio, its time part paired by round (``paired_ratio``)."""
    ok = {_key(r): r for r in rows if r.get("status") == "ok" and r["op"] in ("prefill", "decode")}
    ceilings = ceilings or {}
    for r in ok.values():
        metric = "tflops" if r["op"] == "prefill" else "tbps"

        def ratio(**other):
            peer = ok.get(_key(r, **other))
            if not (peer and peer is not r and peer[metric]):
                return None
            return throughput_ratio(r, peer, metric)

        # cuDNN has no paged form: a paged row is set against it on the contiguous cache
        # of the same keys (ratio_contiguous likewise); the Triton default has one, so a
        # paged row pairs with the Triton row of its own case, page size and loop
        r["ratio_cudnn"] = ratio(impl="sdpa-cudnn", page_size=None)
        r["ratio_triton"] = ratio(impl="triton")
        if r["op"] == "prefill":
            r["ratio_fa4"] = ratio(impl="fa4")
            if "matmul" in ceilings:
                r["ratio_matmul"] = r["tflops"] / ceilings["matmul"].value
        if r["op"] == "decode":
            if "copy" in ceilings:
                r["frac_copy"] = r["tbps"] / ceilings["copy"].value
            if r["page_size"] is not None:
                r["ratio_contiguous"] = ratio(page_size=None)
    return rows


def fmt(x, spec) -> str:
    """A table cell: x formatted with spec, "-" where the row has no value."""
    return "-" if x is None else format(x, spec)


def _fmt(x, spec):
    return "-" if isinstance(x, float) and math.isnan(x) else fmt(x, spec)


def status_text(r: dict) -> str:
    """A row's status with its reason, as the tables print it."""
    return r["status"] + (f": {r['reason']}" if r["reason"] else "")


def target_text(goal, met, spec: str = ".2f") -> str:
    """A target cell: the goal and, once decided, 'met' / 'missed'; "-" without a goal."""
    if goal is None:
        return "-"
    return format(goal, spec) + (f" {met}" if met else "")


def format_table(rows: list[dict]) -> str:
    """Prefill: TFLOP/s, x cuDNN, x triton, x FA4, x matmul ceiling. Decode: time, TB/s,
    x cuDNN, x triton, of copy."""
    lines = []
    for r in (r for r in rows if r["op"] == "ceiling"):
        value = f"{r['tbps']:.2f} TB/s" if r["tbps"] is not None else f"{r['tflops']:.0f} TFLOP/s"
        lines.append(f"ceiling {r['impl']:<7} {value:>14}   ({r['case']}, median "
                     f"{r['median_ms']:.3f} ms, timing {r['timing']})")
    for op, unit in (("prefill", "TFLOP/s"), ("decode", "TB/s")):
        sel = [r for r in rows if r["op"] == op]
        if not sel:
            continue
        last = "x matmul" if op == "prefill" else "of copy"
        head = (f"{'case':<48} {'impl':<20} {'median ms':>10} {'q20-q80 ms':>17} {unit:>8} "
                f"{'x cuDNN':>8} {'x triton':>8} {'x FA4':>8} {last:>8} {'rel err':>8}  status")
        lines += ["", head, "-" * len(head)]
        for r in sel:
            thr = r["tflops"] if op == "prefill" else r["tbps"]
            frac = r["ratio_matmul"] if op == "prefill" else r["frac_copy"]
            spread = (f"{r['q20_ms']:.3f}-{r['q80_ms']:.3f}" if r["q20_ms"] is not None else "-")
            status = status_text(r)
            if r.get("ratio_contiguous") is not None:
                status += f" (x contiguous {r['ratio_contiguous']:.3f})"
            if r.get("timing") not in (None, "graph"):
                status += f" [timing: {r['timing']}]"
            lines.append(f"{r['case']:<48} {r['impl']:<20} {_fmt(r['median_ms'], '.3f'):>10} "
                         f"{spread:>17} {_fmt(thr, '.1f' if op == 'prefill' else '.2f'):>8} "
                         f"{_fmt(r['ratio_cudnn'], '.3f'):>8} {_fmt(r['ratio_triton'], '.3f'):>8} "
                         f"{_fmt(r['ratio_fa4'], '.3f'):>8} {_fmt(frac, '.3f'):>8} "
                         f"{_fmt(r['rel_err'], '.1e'):>8}  {status[:160]}")
    return "\n".join(lines)


def write_json(rows: list[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) and k != "rel_err" else v)
              for k, v in r.items()} for r in rows]
    # rel_err may be inf (NaN in the output); JSON has no inf, so it is written as a string
    for r in clean:
        if isinstance(r.get("rel_err"), float) and not math.isfinite(r["rel_err"]):
            r["rel_err"] = str(r["rel_err"])
    path.write_text(json.dumps(clean, indent=1) + "\n")
    return path


def exit_status(rows: list[dict], ours, what: str | None = None) -> int:
    """A decode-step benchmark's exit status: 1 when one of our columns (``ours(impl)``)
    failed its check or raised, each such row named on stderr ("wsattn <what or impl>
    <status> on <case>: <reason>"), else 0."""
    import sys
    broken = [r for r in rows if ours(r["impl"]) and r["status"] in ("failed", "error")]
    for r in broken:
        print(f"wsattn {what or r['impl']} {r['status']} on {r['case']}: {r['reason']}",
              file=sys.stderr)
    return 1 if broken else 0
