"""Before / after one change from `wsattn bench` JSON files: each (case, impl) row's metric
in every base file against every new file, e.g. the rounds `scripts/device.sh bench` runs
with BENCH_BASE and BENCH_ROUNDS (the previous commit's src/ and this tree's, alternating
processes on one GPU).

A single pair of processes cannot tell a change of a few percent from the spread between
processes (a column with no code change moved 6 % between two processes of one device
call), so the verdict is by ranges: a row is "faster" / "slower" (for times; "higher" /
"lower" for another metric) only when every new value lies beyond every base value, else
"within spread". Rows that failed their check (status other than ok) or have no value
are left out of the ranges and listed as such; ceilings are skipped.

Ranges can part by chance: with nb base and nn new values of a row whose code did not
change (every order of the processes equally likely), a verdict other than "within
spread" comes with probability 2 / C(nb + nn, nb): 10 % at three rounds a side, 2.9 % at
four, 0.8 % at five. Each row carries it ("chance"), and the table prints it: at three
rounds, a table of 12 rows shows about one such verdict on unchanged code (one A/B here
called an unchanged contiguous column "slower"). A metric normalised within each process
(e.g. ratio_contiguous, the row's time against its peer column's in the same process)
cancels the drift between processes that moves whole runs.

    python3 -m wsattn.bench.compare --base base_r1.json base_r2.json \\
        --new new_r1.json new_r2.json [--metric median_ms] [--json compare.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

TIME_METRICS = ("median_ms", "q20_ms", "q80_ms", "ms_per_token")


def load_rows(path) -> list[dict]:
    """The rows of one `wsattn bench --json` file (a list of rows, or {"rows": [...]})."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise ValueError(f"{path}: not a `wsattn bench --json` file (no list of rows)")
    return rows


def _values(files: list[list[dict]], metric: str) -> tuple[dict, dict, set, dict]:
    """(values per (case, impl): one per file where the row passed; failures per key: the
    statuses of rows that did not; the commits the rows name; per key, the (GPU, timing)
    each value came from). A row's case is its case id and, where it has one, its layout
    (the varlen bench's packed and equal-length rows share an id)."""
    values, failed, commits, env = {}, {}, set(), {}
    for rows in files:
        for r in rows:
            if r.get("op") == "ceiling" or "case" not in r or "impl" not in r:
                continue
            case = r["case"] + (f" [{r['layout']}]" if r.get("layout") else "")
            key = (case, r["impl"])
            commits.add(str(r.get("commit", "unknown")))
            # the step bench's time is ms per token (it has no median_ms)
            field = "ms_per_token" if metric == "median_ms" and r.get("op") == "step" else metric
            v = r.get(field)
            if r.get("status", "ok") != "ok" or not isinstance(v, (int, float)):
                failed.setdefault(key, []).append(str(r.get("status", f"no {metric}")))
                continue
            values.setdefault(key, []).append(float(v))
            env.setdefault(key, set()).add((str(r.get("gpu")), str(r.get("timing", ""))))
    return values, failed, commits, env


def compare(base: list[list[dict]], new: list[list[dict]], metric: str = "median_ms") -> dict:
    """{"metric", "base_commits", "new_commits", "rows"}: one row per (case, impl) in either
    side, in the order first seen, with both sides' values, their medians, new / base of the
    medians and the verdict (see the module docstring)."""
    b_vals, b_fail, b_commits, b_env = _values(base, metric)
    n_vals, n_fail, n_commits, n_env = _values(new, metric)
    lower_better = metric in TIME_METRICS
    keys = list(dict.fromkeys([*b_vals, *b_fail, *n_vals, *n_fail]))
    rows = []
    for case, impl in keys:
        b, n = b_vals.get((case, impl), []), n_vals.get((case, impl), [])
        row = {"case": case, "impl": impl, "base": b, "new": n,
               "base_failed": b_fail.get((case, impl), []),
               "new_failed": n_fail.get((case, impl), []),
               "base_median": statistics.median(b) if b else None,
               "new_median": statistics.median(n) if n else None, "ratio": None,
               "chance": None}
        envs = b_env.get((case, impl), set()) | n_env.get((case, impl), set())
        if not b or not n:
            row["verdict"] = "only in new" if n else "only in base" if b else "failed"
        elif len(envs) > 1:  # another GPU or another timing method: not a like-for-like pair
            row["ratio"] = row["new_median"] / row["base_median"]
            row["verdict"] = "not comparable: " + ", ".join(
                f"{g} ({t or 'timing not recorded'})" for g, t in sorted(envs))
        else:
            row["ratio"] = row["new_median"] / row["base_median"]
            row["chance"] = chance_if_no_change(len(b), len(n))
            if min(n) > max(b):
                row["verdict"] = "slower" if lower_better else "higher"
            elif max(n) < min(b):
                row["verdict"] = "faster" if lower_better else "lower"
            else:
                row["verdict"] = "within spread"
        rows.append(row)
    return {"metric": metric, "base_commits": sorted(b_commits),
            "new_commits": sorted(n_commits), "rows": rows}


def chance_if_no_change(n_base: int, n_new: int) -> float:
    """The probability that nb and nn values of one distribution (no ties) have disjoint
    ranges, i.e. that compare's verdict is not "within spread" although nothing changed:
    2 / C(nb + nn, nb) (all new above all base, or all below)."""
    return min(1.0, 2 / math.comb(n_base + n_new, n_base))


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.4g}" if len(values) == 1 else f"{min(values):.4g}-{max(values):.4g}"


def format_table(result: dict) -> str:
    rows = result["rows"]
    width = max([len(r["case"]) for r in rows] + [4])
    head = (f"{'case':<{width}} {'impl':<18} {'base':>15} {'new':>15} {'new/base':>8} "
            f"{'chance':>6}  verdict "
            f"({result['metric']}; base {', '.join(result['base_commits'])}, new "
            f"{', '.join(result['new_commits'])})")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        chance = "-" if r.get("chance") is None else f"{r['chance']:.3f}"
        extra = "".join(f"; {side} failed: {', '.join(r[side + '_failed'])}"
                        for side in ("base", "new") if r[side + "_failed"])
        lines.append(f"{r['case']:<{width}} {r['impl']:<18} {_span(r['base']):>15} "
                     f"{_span(r['new']):>15} {ratio:>8} {chance:>6}  {r['verdict']}{extra}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m wsattn.bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", nargs="+", required=True, metavar="JSON",
                   help="the base side's `wsattn bench --json` files (one a process)")
    p.add_argument("--new", nargs="+", required=True, metavar="JSON",
                   help="the new side's files")
    p.add_argument("--metric", default="median_ms",
                   help="the row field compared (default median_ms; e.g. ratio_contiguous)")
    p.add_argument("--json", metavar="PATH", help="also write the comparison as JSON")
    args = p.parse_args(argv)
    result = compare([load_rows(f) for f in args.base], [load_rows(f) for f in args.new],
                     args.metric)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
