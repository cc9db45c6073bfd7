"""Throughput against sequence length per implementation, as a PNG.

Prefill: one panel per (D, causal), TFLOP/s against N, the matmul ceiling as a dashed
line. Decode: one panel per layout, TB/s against L (B falls as L grows), the copy ceiling
dashed. matplotlib is optional: without it nothing is drawn and the reason is returned.
"""

from __future__ import annotations

from pathlib import Path

MISSING = "matplotlib is not installed; no plot drawn (pip install matplotlib, or the [plot] extra)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, axes, used: int, title: str, path) -> tuple[Path, str]:
    """The end every bench figure shares: hide the panels past the first ``used``, title,
    lay out, write the PNG (making its folder) and close the figure."""
    import matplotlib.pyplot as plt
    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, f"plot written to {path}"


def _panels(rows):
    panels = {}
    for r in rows:
        if r.get("status") != "ok" or r["op"] not in ("prefill", "decode"):
            continue
        if r["op"] == "prefill":
            title = f"prefill D={r['D']} {'causal' if r['causal'] else 'non-causal'} {r['dtype']}"
            x, y = r["Sq"], r["tflops"]
        else:
            # B in the title: --step-shapes gives several batches at one length, which one
            # line would join as if one case
            title = (f"decode B={r['B']} Hq{r['Hq']}/Hkv{r['Hkv']} D={r['D']} {r['layout']} "
                     f"{r['dtype']}")
            x, y = r["L"], r["tbps"]
        panels.setdefault((r["op"], title), {}).setdefault(r["impl"], []).append((x, y))
    return dict(sorted(panels.items(), key=lambda kv: (kv[0][0] != "prefill", kv[0][1])))


def plot_rows(rows: list[dict], path) -> tuple[Path | None, str]:
    """Draw the plot; returns (path or None, message)."""
    plt = pyplot()
    if plt is None:
        return None, MISSING
    panels = _panels(rows)
    if not panels:
        return None, "no timed rows to plot"
    ceilings = {r["impl"]: r for r in rows if r["op"] == "ceiling"}
    n = len(panels)
    cols = min(n, 4)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, ((op, title), series) in zip(axes.flat, panels.items()):
        for impl, points in sorted(series.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=impl)
        ceil = ceilings.get("matmul" if op == "prefill" else "copy")
        if ceil is not None:
            value = ceil["tflops"] if op == "prefill" else ceil["tbps"]
            ax.axhline(value, linestyle="--", color="grey", linewidth=1,
                       label=f"{ceil['impl']} ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("N (tokens)" if op == "prefill" else "L (cached keys)")
        ax.set_ylabel("TFLOP/s" if op == "prefill" else "TB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    stamp = rows[0]
    return save(fig, axes, n, f"wsattn bench - {stamp.get('gpu')} - torch {stamp.get('torch')} "
                f"triton {stamp.get('triton')} - {stamp.get('commit')} - {stamp.get('date')}", path)
