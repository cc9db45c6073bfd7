"""Gate 6: time the kernel against a named baseline, medians over repeated runs.

Each repeat times a batch of calls with CUDA events (the batch sized to about 20 ms),
kernel and baseline interleaved so clock and thermal drift hit both alike. The spread of
each side is max - min over the repeats; the kernel is called faster (or slower) only when
the gap between the medians exceeds both spreads added, otherwise "no clear difference".
Every timed shape's output is checked against the reference first.
"""

from __future__ import annotations

import statistics


def _time_ms(fn, target_ms=20.0):
    import torch
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    n = max(1, min(1000, int(target_ms / one)))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


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
    """Gate 6 on CUDA; never raises."""
    import random

    import torch

    from .numerics import TOL, compare as numerics_compare
    run = spec.run
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
            err, _ = numerics_compare(run.run(inputs), run.reference(inputs))
            if not err <= TOL.get(dtype, 2e-2):
                return {"ok": False, "error": f"{label}: wrong before timing (relative error {err:.3e})"}
            k_ms, b_ms = [], []
            for _ in range(repeats):
                k_ms.append(_time_ms(lambda: run.run(inputs)))
                b_ms.append(_time_ms(lambda: run.baseline(inputs)))
            rows.append({"shape": label, **compare(k_ms, b_ms), "kernel_runs_ms": k_ms,
                         "baseline_runs_ms": b_ms})
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    return {"ok": True, "baseline": run.baseline_name, "rows": rows}
