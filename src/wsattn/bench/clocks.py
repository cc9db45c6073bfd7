"""Line up a bench run's samples with the GPU clock log beside it.

``CLOCKS=1 scripts/device.sh bench`` writes ``clocks.csv`` (nvidia-smi every CLOCKS_MS ms:
timestamp, SM and memory clock, power draw and limit, temperature, active clock-event
reasons) while the bench rows record the host time at the end of each sample
(``samples_t``, Unix seconds) and its length (``samples_ms`` x ``calls``). This reads both
and gives, per timed row, the mean SM clock and power over each sample's window, and
whether the row's slow samples are its low-clock ones: the question the bimodal samples
raise (notes/prefill_gluon.md, "The samples behind those medians").

    python -m wsattn.bench.clocks BENCH.json CLOCKS.csv [--json OUT.json]

nvidia-smi writes its timestamps in the host's local time without a zone; the device
machines run in UTC, which is the default here (``--utc-offset-h`` otherwise).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys

from .compare import load_rows


# nvidia-smi's clocks_event_reasons bit for the software power cap: the board at its power
# limit, the clock lowered to stay there (the prefill bench runs under it on the H200)
POWER_CAP = 0x4


def _number(text: str) -> float | None:
    """'1980 MHz' -> 1980.0, '512.34 W' -> 512.34, '[N/A]' -> None."""
    word = text.strip().split(" ")[0]
    try:
        return float(word)
    except ValueError:
        return None


def parse_clock_log(lines, utc_offset_h: float = 0.0) -> list[dict]:
    """Entries of an nvidia-smi CSV log (the header, if any, and lines that do not parse
    are skipped), each {"t": Unix seconds, sm_mhz, mem_mhz, power_w, power_limit_w,
    temp_c, reasons (an int bit mask, 0 when none is active)}, in time order."""
    out = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 8:
            continue
        try:
            stamp = dt.datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f")
        except ValueError:
            continue  # the header, or an error line
        t = stamp.replace(tzinfo=dt.timezone.utc).timestamp() - utc_offset_h * 3600
        reasons = cells[7]
        try:
            mask = int(reasons, 16)
        except ValueError:
            mask = None
        out.append({"t": t, "sm_mhz": _number(cells[2]), "mem_mhz": _number(cells[3]),
                    "power_w": _number(cells[4]), "power_limit_w": _number(cells[5]),
                    "temp_c": _number(cells[6]), "reasons": mask})
    out.sort(key=lambda e: e["t"])
    return out


def open_log(path: str):
    """A clock log for reading as text, gzip-compressed where the name ends in .gz (the
    committed logs are: a 20 ms log of a few minutes is about a megabyte)."""
    if path.endswith(".gz"):
        import gzip
        return gzip.open(path, "rt")
    return open(path)


def _window(log: list[dict], start: float, end: float) -> list[dict]:
    """The log entries inside [start, end], or, when none is, the one nearest its middle
    if it lies within the log's own spacing of the window (a sample shorter than the
    logging interval); nothing when the log does not cover the sample at all."""
    inside = [e for e in log if start <= e["t"] <= end]
    if inside or not log:
        return inside
    mid = (start + end) / 2
    near = min(log, key=lambda e: abs(e["t"] - mid))
    gaps = [b["t"] - a["t"] for a, b in zip(log, log[1:]) if b["t"] > a["t"]]
    reach = statistics.median(gaps) if gaps else 0.0
    return [near] if abs(near["t"] - mid) <= reach + (end - start) / 2 else []


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _pearson(xs, ys) -> float | None:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    mx = statistics.fmean(p[0] for p in pairs)
    my = statistics.fmean(p[1] for p in pairs)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    syy = sum((y - my) ** 2 for _, y in pairs)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def row_clocks(row: dict, log: list[dict]) -> dict | None:
    """Per sample of a timed row: its time, the mean SM clock and power draw over its
    window, whether any clock-event reason was active and whether the power cap was; then
    the correlation of sample time with SM clock (negative: the slow samples are the
    low-clock ones), and
    the median time of the samples at the row's highest clock against the rest. None for
    a row without samples."""
    times, stamps = row.get("samples_ms"), row.get("samples_t")
    if not times or not stamps or len(times) != len(stamps):
        return None
    calls = row.get("calls") or 1
    samples = []
    for ms, end in zip(times, stamps):
        entries = _window(log, end - ms * calls / 1000.0, end)
        samples.append({"ms": ms, "sm_mhz": _mean(e["sm_mhz"] for e in entries),
                        "power_w": _mean(e["power_w"] for e in entries),
                        "reasons": any(e["reasons"] for e in entries),
                        "power_capped": any((e["reasons"] or 0) & POWER_CAP for e in entries),
                        "log_entries": len(entries)})
    clocks = [s["sm_mhz"] for s in samples if s["sm_mhz"] is not None]
    top = max(clocks) if clocks else None
    at_top = [s["ms"] for s in samples if top is not None and s["sm_mhz"] is not None
              and s["sm_mhz"] >= top - 1.0]
    below = [s["ms"] for s in samples if top is not None and s["sm_mhz"] is not None
             and s["sm_mhz"] < top - 1.0]
    return {"case": row.get("case"), "impl": row.get("impl"), "layout": row.get("layout"),
            "page_size": row.get("page_size"), "median_ms": row.get("median_ms"),
            "corr_ms_vs_sm_mhz": _pearson([s["ms"] for s in samples],
                                          [s["sm_mhz"] for s in samples]),
            "sm_mhz_min": min(clocks) if clocks else None, "sm_mhz_max": top,
            "median_ms_at_top_clock": statistics.median(at_top) if at_top else None,
            "median_ms_below_top_clock": statistics.median(below) if below else None,
            "samples_with_reasons": sum(s["reasons"] for s in samples),
            "samples_power_capped": sum(s["power_capped"] for s in samples),
            "samples": samples}


def summarize_run(rows: list[dict], log: list[dict]) -> list[dict]:
    """row_clocks for every timed row that carries samples."""
    return [c for c in (row_clocks(r, log) for r in rows if r.get("status") == "ok")
            if c is not None]


def cell(x, spec: str) -> str:
    """A table cell: x formatted by spec, '-' where there is no value."""
    return "-" if x is None else format(x, spec)


def format_summary(result: list[dict]) -> str:
    head = (f"{'case':<58} {'impl':<22} {'median':>8} {'r(ms,MHz)':>9} {'MHz min-max':>11} "
            f"{'ms @top':>8} {'ms below':>8} {'reasons':>7} {'capped':>6}")
    lines = [head, "-" * len(head)]
    f = cell
    for c in result:
        clocks = f"{f(c['sm_mhz_min'], '.0f')}-{f(c['sm_mhz_max'], '.0f')}"
        lines.append(f"{str(c['case'])[:58]:<58} {str(c['impl'])[:22]:<22} "
                     f"{f(c['median_ms'], '.3f'):>8} {f(c['corr_ms_vs_sm_mhz'], '.2f'):>9} "
                     f"{clocks:>11} {f(c['median_ms_at_top_clock'], '.3f'):>8} "
                     f"{f(c['median_ms_below_top_clock'], '.3f'):>8} "
                     f"{c['samples_with_reasons']:>7} {c['samples_power_capped']:>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m wsattn.bench.clocks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json", help="rows of a wsattn bench run (with samples_t)")
    p.add_argument("clocks_csv", help="the clocks.csv that CLOCKS=1 wrote beside it")
    p.add_argument("--utc-offset-h", type=float, default=0.0,
                   help="the device host's offset from UTC, hours (default 0)")
    p.add_argument("--json", help="write the per-row, per-sample result here")
    args = p.parse_args(argv)
    rows = load_rows(args.bench_json)
    with open_log(args.clocks_csv) as fh:
        log = parse_clock_log(fh, args.utc_offset_h)
    if not log:
        print(f"{args.clocks_csv}: no clock entries", file=sys.stderr)
        return 1
    result = summarize_run(rows, log)
    if not result:
        print(f"{args.bench_json}: no timed row carries samples_t", file=sys.stderr)
        return 1
    print(format_summary(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
