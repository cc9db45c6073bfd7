"""Gate 7: time the kernel against a named baseline, medians over repeated runs.

Each repeat times a batch of calls with CUDA events (the batch sized to about 20 ms),
kernel and baseline interleaved so clock and thermal drift hit both alike. The batch is
captured in a CUDA graph and replayed, so a microsecond kernel is timed on the GPU and
not through its Python launch path (back-to-back eager calls measured the launcher: the
decode-step GEMV and qkv kernels read "x0.29 slower than torch" that way while their
graph-replayed bench figures were 1.5-3x faster than the same eager torch); a side that
cannot be captured (a host read, say) is timed eagerly and its row says so. The same
inputs are reused, so a working set smaller than L2 is served from it on both sides: a
relative figure, not a bandwidth one. The spread of each side is max - min over the
repeats; the kernel is called faster (or slower) only when the gap between the medians
exceeds both spreads added, otherwise "no clear difference". Every timed shape's output
is checked against the reference first; what is timed is ``RunSpec.timed`` when the spec
gives one (a run that also checks side effects on the host), else ``RunSpec.run``.
"""

from __future__ import annotations

import statistics


GRAPH_MAX_CALLS = 200  # calls one captured batch holds (outputs allocated per call stay)


def _events(torch, work, n=1):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _timer(fn, target_ms=20.0, graph=True):
    """(measure, "graph" or "eager"): measure() -> ms per call of fn, over a batch sized to
    about target_ms, replayed from one CUDA graph captured here, or called eagerly where
    graph is False or the capture fails. Capture once, replay per repeat."""
    import torch
    fn()
    torch.cuda.synchronize()
    one = max(_events(torch, fn), 1e-3)
    if graph:
        from ..bench.timing import capture
        n = max(1, min(GRAPH_MAX_CALLS, int(target_ms / one)))
        g, _ = capture(fn, n)  # None: a host read or sync inside, timed eagerly below
        if g is not None:
            g.replay()
            torch.cuda.synchronize()
            return (lambda: _events(torch, g.replay) / n), "graph"
    n = max(1, min(1000, int(target_ms / one)))
    return (lambda: _events(torch, fn, n) / n), "eager"


def _time_ms(fn, target_ms=20.0, graph=True):
    """(ms per call, "graph" or "eager") of one batch (see _timer)."""
    measure, how = _timer(fn, target_ms, graph)
    return measure(), how


MIN_REPEATS = 3


def compare(kernel_ms: list, base_ms: list) -> dict:
    """Medians, spreads and the verdict for two lists of repeat timings."""
    km, bm = statistics.median(kernel_ms), statistics.median(base_ms)
    ks, bs = max(kernel_ms) - min(kernel_ms), max(base_ms) - min(base_ms)
    gap = bm - km
    if gap > ks + bs:
        verdict = "faster"
    elif -gap > ks + bs:
        verdict = "slower"
    else:
        verdict = "no clear difference"
    return {"kernel_ms": km, "kernel_spread_ms": ks, "baseline_ms": bm, "baseline_spread_ms": bs,
            "speedup": bm / km if km > 0 else None, "verdict": verdict}


def run_profile(spec, repeats: int = 7, seed: int = 0) -> dict:
    """Gate 7 on CUDA; never raises."""
    import random

    import torch

    from .numerics import copy_inputs, within
    run = spec.run
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        return {"ok": False, "not_run": True,
                "error": f"a timing verdict needs >= {MIN_REPEATS} repeats (one gives no "
                         f"spread to compare the gap with), got {repeats!r}"}
    if run.baseline is None:
        return {"ok": False, "not_run": True, "error": "the spec names no baseline to time against"}
    rng = random.Random(seed)
    shapes = list(run.profile_shapes) or [run.draw_shape(rng, False)]
    dtype = run.dtypes[0]
    rows = []
    try:
        for shape in shapes:
            label = f"{run.describe(shape)} {dtype}"
            inputs = run.build(shape, dtype, "cuda", torch.Generator().manual_seed(seed))
            ref = run.reference(copy_inputs(inputs))  # before the kernel writes any input
            ok, why, _ = within(run.run(inputs), ref, dtype, run.lse_outputs)
            if not ok:
                return {"ok": False, "error": f"{label}: wrong before timing ({why})"}
            timed = run.timed or run.run
            k_measure, k_how = _timer(lambda: timed(inputs))
            b_measure, b_how = _timer(lambda: run.baseline(inputs))
            k_ms, b_ms = [], []
            for _ in range(repeats):  # interleaved, so drift hits both sides alike
                k_ms.append(k_measure())
                b_ms.append(b_measure())
            timing = {"kernel": k_how, "baseline": b_how}
            rows.append({"shape": label, **compare(k_ms, b_ms), "kernel_runs_ms": k_ms,
                         "baseline_runs_ms": b_ms, "timing": timing})
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    return {"ok": True, "baseline": run.baseline_name, "rows": rows}
