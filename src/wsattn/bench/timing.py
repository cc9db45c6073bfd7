"""GPU timing: medians with spread, warm-up first, L2 flushed before every repetition.

``triton.testing.do_bench`` runs the function once (compiles, warms up), estimates its
time, warms up for ``warmup_ms``, then times each repetition with CUDA events after
overwriting a 256 MB buffer, so every repetition starts with a cold L2 (50 MB on H200).
That is what "rotating the inputs" would buy for shapes that fit in L2, without the extra
memory; inputs larger than L2 are unaffected by it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ms: float
    q20_ms: float
    q80_ms: float
    reps: int


def summarize(times_ms) -> Timing:
    """Median and the 20th/80th percentiles (linear interpolation) of a list of times."""
    times = sorted(float(t) for t in times_ms)
    if not times:
        raise ValueError("no timings to summarize")

    def quantile(q):
        pos = q * (len(times) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(times) - 1)
        return times[lo] + (times[hi] - times[lo]) * (pos - lo)

    return Timing(statistics.median(times), quantile(0.2), quantile(0.8), len(times))


def cuda_timer(warmup_ms: float = 25, rep_ms: float = 100):
    """A timer(fn) -> Timing for CUDA work, built on triton.testing.do_bench."""
    from triton.testing import do_bench

    def timer(fn) -> Timing:
        return summarize(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))

    return timer
