"""Reports of ladder results: a terminal table, JSON, and Markdown with a profile chart.

Symbols in the gate columns: ``+`` passed, ``X`` failed, ``-`` not run (no device, no
runner), blank: not reached. An ``i`` under gate 4 marks numerics that passed through
the interpreter only (``I`` where they failed there).
"""

from __future__ import annotations

import datetime
import json
import os
import platform

from .ladder import FAIL, GATES, NOT_RUN, PASS

_SYM = {PASS: "+", FAIL: "X", NOT_RUN: "-"}


def _marks(r) -> list:
    marks = [" "] * len(GATES)
    for g in r.gates:
        marks[g.gate] = _SYM.get(g.status, "?")
    for g in r.extra:
        if marks[4] == " " and g.status in (PASS, FAIL):
            marks[4] = "i" if g.status == PASS else "I"
    return marks


def reached(r) -> str:
    return f"{r.highest_gate} {GATES[r.highest_gate]}" if r.highest_gate >= 0 else "none"


def table(results) -> str:
    """The terminal table: one row per (kernel, target), verdict last."""
    kw = max([len("kernel")] + [len(r.kernel) for r in results])
    tw = max([len("target")] + [len(r.target) for r in results])
    nums = " ".join(str(i) for i in range(len(GATES)))
    head = f"{'kernel':<{kw}}  {'target':<{tw}}  {nums}  {'reached':<13}  verdict"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.kernel:<{kw}}  {r.target:<{tw}}  {' '.join(_marks(r))}  {reached(r):<13}  {r.verdict}")
    return "\n".join(lines)


def environment() -> dict:
    """Versions and machine, stamped on every JSON report."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cc"] = "sm_%d%d" % torch.cuda.get_device_capability(0)
            env["cuda"] = torch.version.cuda
    except Exception:
        pass
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        pass
    from ..bench.env import git_commit  # one reading of the commit (WSATTN_COMMIT wins)
    env["git_commit"] = git_commit()
    return env


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def to_json(results, path, extra: dict | None = None, env: dict | None = None) -> dict:
    """The results as JSON, stamped with env (default: this machine now; a run passes the
    one it read once, so its JSON and Markdown name the same date)."""
    doc = {"environment": env or environment(), "gate_names": list(GATES), **(extra or {}),
           "results": [_jsonable(r.to_dict()) for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return doc


def from_json(path) -> tuple[list, dict]:
    """(LadderResults, the document) back from ``to_json``'s file, e.g. to render the
    Markdown report on a CPU machine from a device run's JSON (complete or not)."""
    from .ladder import GateResult, LadderResult
    with open(path) as f:
        doc = json.load(f)
    results = []
    for d in doc["results"]:
        d = {k: v for k, v in d.items() if k != "highest_gate_name"}
        # numbered by name: a run from before the sanitizer gate has profile as gate 6
        d["gates"] = [GateResult(**_renumbered(g)) for g in d["gates"]]
        d["extra"] = [GateResult(**_renumbered(g)) for g in d.get("extra", [])]
        highest = -1  # passed with no gap below it: an old run never climbed gate 6
        for g in sorted(d["gates"], key=lambda g: g.gate):
            if g.status != PASS or g.gate != highest + 1:
                break
            highest = g.gate
        d["highest_gate"] = highest
        results.append(LadderResult(**d))
    return results, doc


def merge_json(paths, out_path) -> dict:
    """One ladder document from several runs' ``to_json`` files (e.g. one library ladder
    climbed in several device calls): each (kernel, target) row from the last file that
    holds it, in the order rows first appear; refused (ValueError) when the runs' configs
    differ, since their verdicts would not mean the same. The environment is the last
    run's, its git_commit every run's commit joined by " + "; "runs" lists each file's
    commit, date and kernels (a file that is itself a merge brings its own runs, so a
    library ladder can be extended one rerun at a time), "complete" holds when every run
    was. Written to out_path and returned (from_json reads it back)."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append((str(path), json.load(f)))
    first_path, first = docs[0]
    rows, runs = {}, []
    config = first.get("config", {})
    for path, doc in docs:
        if doc.get("config", {}) != config:
            mine = doc.get("config", {})
            diff = sorted(k for k in mine.keys() | config.keys() if mine.get(k) != config.get(k))
            raise ValueError(f"{path}: its ladder config differs from {first_path}'s in "
                             f"{', '.join(diff)}; runs with different settings are not merged")
        env = doc.get("environment", {})
        if doc.get("runs"):  # an earlier merge: its own runs, not one run of all its rows
            runs.extend(doc["runs"])
        else:
            runs.append({"file": os.path.basename(path), "commit": env.get("git_commit"),
                         "date": env.get("date"),
                         "kernels": [f"{r['kernel']} {r['target']}" for r in doc["results"]]})
        for r in doc["results"]:
            rows[(r["kernel"], r["target"])] = r
    commits = list(dict.fromkeys(str(r["commit"]) for r in runs))
    merged = {"environment": {**docs[-1][1].get("environment", {}),
                              "git_commit": " + ".join(commits)},
              "gate_names": first.get("gate_names", list(GATES)),
              "targets": list(dict.fromkeys(t for _, d in docs for t in d.get("targets", []))),
              "config": config,
              "complete": all(d.get("complete", True) for _, d in docs),
              "runs": runs, "results": list(rows.values())}
    with open(out_path, "w") as f:
        json.dump(merged, f, indent=2)
    return merged


def _renumbered(g: dict) -> dict:
    return {**g, "gate": GATES.index(g["name"])} if g.get("name") in GATES else g


# --------------------------------------------------------------------------- markdown

def _profile_rows(results):
    rows = []
    for r in results:
        for g in r.gates:
            if g.name == "profile" and g.status == PASS:
                for row in g.data.get("rows", []):
                    rows.append((f"{r.kernel} {r.target}", g.data.get("baseline"), row))
    return rows


def _png_chart(rows, png_path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    labels = [f"{k}\n{row['shape']}" for k, _, row in rows]
    ys = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.9 * len(rows)))
    ax.barh([y + 0.2 for y in ys], [row["kernel_ms"] for _, _, row in rows], 0.4,
            xerr=[row["kernel_spread_ms"] for _, _, row in rows], label="kernel")
    ax.barh([y - 0.2 for y in ys], [row["baseline_ms"] for _, _, row in rows], 0.4,
            xerr=[row["baseline_spread_ms"] for _, _, row in rows], label="baseline")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.set_xlabel("median time per call, ms (error bar: max - min over repeats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return True


def _text_chart(rows) -> list:
    top = max(max(row["kernel_ms"], row["baseline_ms"]) for _, _, row in rows) or 1.0
    out = ["```"]
    for k, base, row in rows:
        out.append(f"{k} @ {row['shape']}")
        for name, ms, sp in (("kernel", row["kernel_ms"], row["kernel_spread_ms"]),
                             (base or "baseline", row["baseline_ms"], row["baseline_spread_ms"])):
            out.append(f"  {name[:28]:<28} {'#' * max(1, round(40 * ms / top)):<40} {ms:.3f} ms +-{sp:.3f}")
    out.append("```")
    return out


def structure_details(d: dict) -> str:
    """The numbers behind gate 2, in one line."""
    sass = ", ".join(f"{k} {v}" for k, v in (d.get("sass") or {}).items() if v) or \
        (d.get("sass_error") or "no SASS census")
    return (f"setmaxnreg [{', '.join(d.get('setmaxnreg') or []) or 'none'}]; "
            f"requested registers {d.get('requested_registers') or 'none'}; "
            f"mbarrier.init {d.get('mbarriers')}; warps {d.get('num_warps_total')}; "
            f"registers {d.get('regs_per_thread')}/thread, {d.get('regs_per_cta')}/CTA; "
            f"shared {d.get('shared_bytes')} B/CTA; local {d.get('local_bytes')} B/thread; SASS: {sass}")


def sanitizer_details(d: dict) -> list:
    """One line per compute-sanitizer tool: errors, racecheck's hazards, first finding."""
    out = []
    for t in d.get("tools") or []:
        line = f"{t['tool']}: " + ("no summary" if t.get("errors") is None else f"{t['errors']} errors")
        if "hazards" in t:
            line += f", {t['hazards']} hazards ({t['race_errors']} errors, {t['warnings']} warnings)"
        if t.get("seconds") is not None:
            line += f", {t['seconds']:.0f} s"
        if t.get("first"):
            line += ": `" + " | ".join(t["first"]).replace("`", "'") + "`"
        if t.get("waiver"):
            line += f"; WAIVED: {t['waiver']}"
        elif t.get("not_waived") and t.get("hazards"):
            line += f"; not waived: {t['not_waived']}"
        if t.get("setup"):
            line += f" ({t['setup']})"
        out.append(line)
    return out


def to_markdown(results, path, env: dict | None = None) -> str:
    """Markdown: the gate table, each verdict, and a bar chart of the profile gate.

    env: the environment the results were measured in (a report rendered from a device
    run's JSON must name that machine, not the one rendering it); default: this one."""
    env = env or environment()
    lines = ["# Evidence ladder", "",
             "Gates: " + ", ".join(f"{i} {g}" for i, g in enumerate(GATES)) +
             ". `+` passed, `X` failed, `-` not run, blank not reached, `i` numerics passed in the "
             "interpreter only.", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "| kernel | target | " + " | ".join(str(i) for i in range(len(GATES))) + " | reached | verdict |",
             "|---|---|" + "---|" * len(GATES) + "---|---|"]
    for r in results:
        lines.append(f"| {r.kernel} | {r.target} | " + " | ".join(m if m != " " else "" for m in _marks(r))
                     + f" | {reached(r)} | {r.verdict.replace('|', '/')} |")
    lines += ["", "## Gate details", ""]
    for r in results:
        lines.append(f"### {r.kernel} on {r.target}")
        for g in list(r.gates) + list(r.extra):
            detail = g.detail[len("not run: "):] if g.detail.startswith("not run: ") else g.detail
            lines.append(f"- gate {g.gate} {g.name}: **{g.status}**: {detail}")
            if g.gate == 2 and g.status == PASS:
                lines.append(f"  - {structure_details(g.data)}")
            if g.name == "sanitizer":
                lines += [f"  - {line}" for line in sanitizer_details(g.data)]
        lines.append("")
    rows = _profile_rows(results)
    lines += ["## Profile", ""]
    if not rows:
        lines.append("The profile gate ran for no kernel here (it needs a device of the target's "
                     "compute capability).")
    else:
        png = os.path.splitext(path)[0] + ".png"
        if _png_chart(rows, png):
            lines.append(f"![profile]({os.path.basename(png)})")
        else:
            lines += _text_chart(rows)
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


# --------------------------------------------------------------------------- the card ledger

def ledger_row(r) -> dict:
    """One row of ``wsattn targets`` from a ladder result climbed to gate 2."""
    by = {g.gate: g for g in r.gates}
    row = {"kernel": r.kernel, "target": r.target, "mma": "", "tma": "", "ws": "", "regs": "",
           "shared": "", "note": ""}
    g0, g1, g2 = by.get(0), by.get(1), by.get(2)
    if g0 and g0.status == PASS:
        row["mma"] = g0.data.get("mma") or f"({g0.data.get('mma_expected')}?)"
        row["tma"] = "yes" if g0.data.get("tma") else ("no" if "mma" in g0.data else "")
    if g0 and g0.status != PASS:
        row["note"] = g0.detail
    elif g1 and g1.status == NOT_RUN:
        row["note"] = g1.detail[len("not run: "):] if g1.detail.startswith("not run: ") else g1.detail
    elif g1 and g1.status != PASS:
        row["note"] = "does not compile: " + g1.detail
    if g2:
        d = g2.data
        if d.get("ws_formed"):
            row["ws"] = "formed: " + "/".join(f"{p['warps']}w" for p in d["partitions"])
        elif d.get("ws_requested"):
            row["ws"] = "DECLINED"
            row["note"] = d.get("decline_reason") or ""
        else:
            row["ws"] = "not requested"
        row["regs"] = d.get("regs_per_thread") if d.get("regs_per_thread") is not None else ""
        row["shared"] = f"{d['shared_bytes'] / 1024:.0f} KiB" if d.get("shared_bytes") is not None else ""
        if d.get("spills"):
            row["note"] = (row["note"] + "; " if row["note"] else "") + \
                f"local memory {d.get('local_bytes') or '?'} B/thread (spills or stack)"
        if d.get("sass_error"):
            row["note"] = (row["note"] + "; " if row["note"] else "") + "no SASS census (nvdisasm)"
    return row


def ledger_table(rows) -> str:
    cols = [("kernel", "kernel"), ("target", "target"), ("mma", "MMA"), ("tma", "TMA"),
            ("ws", "warp specialization"), ("regs", "regs/thread"), ("shared", "smem/CTA"), ("note", "note")]
    widths = {k: max(len(h), *(len(str(r[k])) for r in rows)) if rows else len(h) for k, h in cols}
    head = "  ".join(f"{h:<{widths[k]}}" for k, h in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append("  ".join(f"{str(r[k]):<{widths[k]}}" for k, _ in cols).rstrip())
    return "\n".join(lines)
