"""GPU timing with CUDA events: medians with spread over repeated samples, warm-up first.

A sample is ``calls`` back-to-back calls between two CUDA events, divided by ``calls``;
``samples`` of them give the median and the 20th/80th percentiles. Two methods:

* ``graph`` (default): the ``calls`` are captured once into a CUDA graph and the graph is
  replayed, so the time is the kernels' alone, without the Python and dispatch overhead of
  the call (wsattn's validation, SDPA's backend selection). If capture fails (a call syncs
  with the host, or a library refuses capture) the row falls back to ``eager`` and says so.
* ``eager``: the calls are launched from Python; host overhead shows where a call's host
  time exceeds its GPU time.

No L2 flush between calls: every benchmark shape's inputs exceed the H200's 50 MB L2
(prefill q, k, v 64 MB each; decode K/V 0.5-2 GB; copy 1 GiB; matmul 128 MB per operand),
so consecutive calls do not find their inputs in L2 and rotating inputs would change
nothing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

METHODS = ("graph", "eager")


@dataclass(frozen=True)
class Timing:
    median_ms: float
    q20_ms: float
    q80_ms: float
    reps: int  # samples
    method: str = "eager"
    calls: int = 1  # calls per sample


def summarize(times_ms, method: str = "eager", calls: int = 1) -> Timing:
    """Median and the 20th/80th percentiles (linear interpolation) of a list of times."""
    times = sorted(float(t) for t in times_ms)
    if not times:
        raise ValueError("no timings to summarize")

    def quantile(q):
        pos = q * (len(times) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(times) - 1)
        return times[lo] + (times[hi] - times[lo]) * (pos - lo)

    return Timing(statistics.median(times), quantile(0.2), quantile(0.8), len(times), method, calls)


def _events_ms(torch, launch, n) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class _RngGuard:
    """Keeps the device's default CUDA generator usable after a failed graph capture.

    torch.cuda.graph marks the generator as capturing and unmarks it only once the capture
    ends cleanly; when the captured code breaks the capture (a host sync, say), every later
    torch.randn on that device fails with "Offset increment outside graph capture
    encountered unexpectedly" (seen on torch 2.11: one failed capture broke every later
    bench row's inputs). restore() puts a copy of the state from before the capture back."""

    def __init__(self, torch):
        self.default = torch.cuda.default_generators[torch.cuda.current_device()]
        self.saved = torch.Generator(device=self.default.device)
        self.saved.set_state(self.default.get_state())

    def restore(self):
        self.default.graphsafe_set_state(self.saved.graphsafe_get_state())


def capture(fn, calls: int):
    """(graph, None): ``calls`` back-to-back calls of fn captured in one CUDA graph; or
    (None, why) where fn cannot be captured (a host sync, a library refusing capture),
    with the process left as it was before the attempt. A failed torch.cuda.graph leaves
    two things behind: the device's generator marked as capturing (see _RngGuard) and
    its capture stream as the current stream (its exit raises before it leaves the stream
    context), so every later launch of the thread would go to that side stream."""
    import torch
    rng = _RngGuard(torch)
    stream = torch.cuda.current_stream()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as e:
        torch.cuda.set_stream(stream)
        rng.restore()
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    return graph, None


class Sampler:
    """One function made ready to time (warmed up, captured): each call of the sampler is
    one sample, ms a call. ``method`` and ``calls`` as in :class:`Timing`."""

    def __init__(self, launch, launches: int, calls: int, method: str):
        self.launch, self.launches, self.calls, self.method = launch, launches, calls, method

    def __call__(self) -> float:
        import torch
        return _events_ms(torch, self.launch, self.launches) / self.calls


def cuda_timer(warmup_ms: float = 25, rep_ms: float = 100, method: str = "graph",
               samples: int = 20):
    """A timer(fn) -> Timing for CUDA work. The timer also has ``prepare(fn)`` (a
    :class:`Sampler`) and ``samples``, which :func:`time_interleaved` uses to time several
    functions in alternating rounds."""
    import torch

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    def prepare(fn) -> Sampler:
        # warm-up on a side stream, as graph capture wants (cuBLAS/cuDNN set up workspaces)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        estimate = max(_events_ms(torch, fn, 5) / 5, 1e-3)
        calls = max(1, min(1000, round(rep_ms / samples / estimate)))
        launch, used = fn, "eager"
        if method == "graph":
            graph, why = capture(fn, calls)
            if graph is not None:
                launch, used = graph.replay, "graph"
            else:  # not capturable: time it eagerly and say why
                used = f"eager (graph capture failed: {why})"
        per_launch = calls if used == "graph" else 1
        warm = max(1, round(warmup_ms / (estimate * per_launch)))
        _events_ms(torch, launch, warm)
        return Sampler(launch, calls // per_launch, calls, used)

    def timer(fn) -> Timing:
        sample = prepare(fn)
        return summarize([sample() for _ in range(samples)], sample.method, sample.calls)

    timer.prepare, timer.samples = prepare, samples
    return timer


def time_interleaved(timer, fns) -> list:
    """Time several functions in ``timer.samples`` rounds, one sample of each a round, the
    order rotated by one each round; for each function (Timing, its samples in round order,
    the host time (Unix seconds) at the end of each sample, to line them up with a clock
    log) or the exception that stopped it (while preparing or sampling; the others go on).

    Why rounds: on the H200 a row's samples are often bimodal (q80 / q20 of 1.06 and more
    in a fifth of the chunked rows, two clusters up to ~11 % apart: clock states or the
    launch, not yet told apart), so columns timed one after the other, 100 ms each, can
    each catch a different mix, and two columns of the same kernel in one process
    differed by up to 15 %. Sample i of every function comes from round i, so a ratio of
    two functions can be taken per round (paired) and its median read: drift slower than
    a round cancels. The ladder's profile gate interleaves its kernel and baseline the
    same way (``evidence/profile.py``)."""
    prepare, rounds = timer.prepare, timer.samples  # a timer without them is a bug: raise
    out: list = [None] * len(fns)
    ready = {}
    for i, fn in enumerate(fns):
        try:
            ready[i] = prepare(fn)
        except Exception as e:
            out[i] = e
    times = {i: [] for i in ready}
    stamps = {i: [] for i in ready}
    for r in range(rounds):
        live = list(ready)
        if not live:
            break
        k = r % len(live)
        for i in live[k:] + live[:k]:
            try:
                times[i].append(ready[i]())
                stamps[i].append(time.time())
            except Exception as e:
                out[i] = e
                del ready[i]
    for i, sample in ready.items():
        out[i] = (summarize(times[i], sample.method, sample.calls), times[i], stamps[i])
    return out


def _sync(device):
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device):
    """Free what a finished case held: Python garbage, then the CUDA caching allocator's
    unused blocks (so the next case's sizes do not stack on this one's)."""
    import gc

    import torch
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
