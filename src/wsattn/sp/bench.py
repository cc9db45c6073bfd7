"""The sequence-parallel benchmark: ``torchrun --nproc-per-node 2 -m wsattn.sp.bench`` or
``torchrun --nproc-per-node 2 -m wsattn.cli bench sp``.

What it measures, each figure beside its baselines from the same run:

* prefill, causal, Hq 32 / Hkv 8 / D 128, B = 1, S from 2048 to 131072: one GPU over the
  whole sequence; gather-then-attend (sp.prefill); overlapped (sp.prefill_overlapped,
  "overlapped" = the p2p transport, "overlapped_symm" = symmetric-memory pulls);
  the gather alone (the same all-gather of the K/V shards). Derived: throughput
  (tokens/s), speedup over one GPU, hidden = (T_gather_then_attend - T_overlapped) /
  T_gather.
* state exchange + merge of [B=16, Hq=32, D+1=129] fp32 states: NCCL all-gather then
  merge_states vs the fused symmetric-memory kernel, eager and replayed from a CUDA graph.
* decode at batch B (default 1) and global context L (default 1M): one GPU over the whole
  cache vs sp.decode over a 1/W shard each (ratio to one GPU), and at B = 1
  sp.invariant_decode's cost beside them. For the 4/8-GPU matrix:
  ``--sp-batches 1 16 64 --sp-contexts 131072 1048576 4194304``.

Every SP output is checked before it is timed against the single-GPU kernel on the same
inputs (itself tested against the float64 reference). Rows are JSON, stamped (GPU,
driver, versions, commit, date, world size), written by rank 0 where --json says (no file
without it). From the command line it needs CUDA GPUs (exit status 2 without them);
``main(args)`` also runs on gloo at toy sizes, which the CPU tests use to check the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import wsattn

SEQLENS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
QUICK_SEQLENS = (2048, 8192, 32768)
DECODE_CONTEXT = 1 << 20


def add_arguments(group) -> None:
    """The sp options, added to ``wsattn bench``'s parser (names start with --sp-, so they
    never collide with the common --quick, --dtype, --json, --warmup-ms, --rep-ms)."""
    group.add_argument("--sp-what", nargs="+", choices=("prefill", "exchange", "decode"),
                       default=["prefill", "exchange", "decode"], help="which SP measurements")
    group.add_argument("--sp-seqlens", type=int, nargs="+", metavar="S",
                       help=f"prefill sequence lengths (default {' '.join(map(str, SEQLENS))}; "
                            f"--quick: {' '.join(map(str, QUICK_SEQLENS))})")
    group.add_argument("--sp-contexts", type=int, nargs="+", metavar="L",
                       help=f"decode global context lengths (default {DECODE_CONTEXT}; "
                            f"--quick: 262144)")
    group.add_argument("--sp-batches", type=int, nargs="+", metavar="B",
                       help="decode batch sizes (default 1); shapes whose global cache does not "
                            "fit one GPU are reported as skipped")
    group.add_argument("--sp-no-zigzag", action="store_true", help="contiguous shards")
    group.add_argument("--sp-reps", type=int, default=10, help="timed repetitions (median)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m wsattn.sp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small subset of the shapes")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--json", metavar="PATH", help="where rank 0 writes the rows")
    add_arguments(p.add_argument_group("sp"))
    return p


# --------------------------------------------------------------------------- plumbing

def _init():
    """Initialise the process group from torchrun's environment (if not done yet)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python -m`: a group of one
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev, reps=10, inner=None, graph=False):
    """Median ms per call of fn over `reps` samples, each a loop of `inner` calls, the
    slowest rank's figure (every rank must call it: it ends in an all-reduce)."""
    fn()  # warm-up: compile, allocate, rendezvous
    _sync(dev)
    if inner is None:  # aim at about 20 ms per sample
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        one = max(time.perf_counter() - t0, 1e-6)
        inner = max(1, min(200, int(0.02 / one)))
        t = torch.tensor([inner], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)  # every rank runs the same count
        inner = int(t.item())
    run = fn
    if graph and dev.type == "cuda":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        _sync(dev)
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        run, inner_calls = g.replay, inner
    else:
        inner_calls = inner

    samples = []
    for _ in range(reps):
        _sync(dev)
        dist.barrier()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            if graph:
                run()
            else:
                for _ in range(inner_calls):
                    run()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) / inner_calls)
        else:
            t0 = time.perf_counter()
            for _ in range(inner_calls):
                run()
            samples.append((time.perf_counter() - t0) * 1e3 / inner_calls)
    med = torch.tensor([statistics.median(samples), min(samples), max(samples)],
                       dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    m, lo, hi = med.tolist()
    return {"median_ms": m, "min_ms": lo, "max_ms": hi, "calls_per_sample": inner_calls,
            "samples": reps, "timing": "graph" if graph else "eager"}


def _rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    if torch.isnan(a).any():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- prefill

def bench_prefill(S, dtype, dev, rank, W, zigzag, reps, row):
    from .comm import all_gather_flat
    from .prefill import prefill
    from .overlap import prefill_overlapped
    from .sharding import shard
    B, Hq, Hkv, D = 1, 32, 8, 128
    if dev.type == "cpu":
        Hq, Hkv, D = 4, 1, 64
    g = torch.Generator(device=dev).manual_seed(S)  # the same global tensors on every rank
    q, k, v = (torch.randn(B, S, h, D, generator=g, device=dev).to(dtype) for h in (Hq, Hkv, Hkv))
    impl = "auto" if dev.type == "cuda" else "reference"
    ref, ref_lse = wsattn.attention(q, k, v, True, return_lse=True, impl=impl)
    qs, ks, vs = (shard(t, W, rank, 1, zigzag) for t in (q, k, v))
    ref_s, ref_lse_s = shard(ref, W, rank, 1, zigzag), shard(ref_lse, W, rank, 2, zigzag)
    flops = 4 * B * S * S * Hq * D / 2
    rows = []
    modes = {
        "gather_then_attend": lambda: prefill(qs, ks, vs, True, group=None, zigzag=zigzag,
                                              impl=impl, check=False),
        "overlapped": lambda: prefill_overlapped(qs, ks, vs, True, group=None, zigzag=zigzag,
                                                 impl=impl, check=False, transport="p2p"),
    }
    if dev.type == "cuda" and W > 1:
        modes["overlapped_symm"] = lambda: prefill_overlapped(
            qs, ks, vs, True, group=None, zigzag=zigzag, impl=impl, check=False, transport="symm")
    checked = {}
    for mode, fn in modes.items():  # every output checked once, before any timing
        try:
            out, lse = fn()
        except Exception as e:  # noqa: BLE001 - a transport that cannot run here is a row
            rows.append(row(what="prefill", mode=mode, S=S, status="failed", reason=repr(e)[:300]))
            continue
        err = max(_rel_err(out, ref_s), _rel_err(lse, ref_lse_s))
        ok = torch.tensor([1.0 if err <= 2e-2 else 0.0], device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:  # every rank skips the timing together
            rows.append(row(what="prefill", mode=mode, S=S, status="wrong", rel_err=err))
            continue
        checked[mode] = err
    send = torch.stack([ks, vs])
    # Eager timings include the host's work per call (Python, launches): at S <= 8192 the
    # SP paths are host bound there. Graph replays show the device time, what a serving
    # loop that captures its steps pays. NCCL's batched send/recv (the "overlapped" p2p
    # transport) is not captured: it is timed eager only.
    for graph in ((False, True) if dev.type == "cuda" else (False,)):
        timing = "graph" if graph else "eager"
        single = time_ms(lambda: wsattn.attention(q, k, v, True, return_lse=True, impl=impl),
                         dev, reps, graph=graph)
        rows.append(row(what="prefill", mode="single_gpu", S=S, **single))
        times = {}
        for mode, err in checked.items():
            if graph and mode == "overlapped":
                continue
            try:
                t = time_ms(modes[mode], dev, reps, graph=graph)
            except Exception as e:  # noqa: BLE001 - a capture that fails is a row
                rows.append(row(what="prefill", mode=mode, S=S, status="failed", timing=timing,
                                reason=repr(e)[:300]))
                continue
            times[mode] = t["median_ms"]
            rows.append(row(what="prefill", mode=mode, S=S, status="ok", rel_err=err, **t,
                            speedup_vs_single=single["median_ms"] / t["median_ms"],
                            tokens_per_s=B * S / (t["median_ms"] * 1e-3),
                            tflops=flops / (t["median_ms"] * 1e-3) / 1e12))
        gather = time_ms(lambda: all_gather_flat(send, W, None), dev, reps, graph=graph)
        rows.append(row(what="prefill", mode="gather_only", S=S, bytes_per_rank=send.numel() *
                        send.element_size(), **gather))
        for mode in ("overlapped", "overlapped_symm"):
            if "gather_then_attend" in times and mode in times and W > 1:
                hidden = (times["gather_then_attend"] - times[mode]) / gather["median_ms"]
                rows.append(row(what="prefill", mode="hidden_fraction", of=mode, S=S,
                                timing=timing, hidden=hidden,
                                overlapped_vs_gather_then_attend=times["gather_then_attend"] /
                                times[mode]))
    return rows


# --------------------------------------------------------------------------- exchange

def bench_exchange(dev, rank, W, reps, row):
    """Exchange + merge of [B=16, Hq=32, D+1=129] fp32 states: what a decode step pays
    after its local kernel, by each method, eager and replayed from a CUDA graph."""
    from .decode import StateExchange
    B, Hq, D = 16, 32, 128
    shape = (B, Hq, D + 1)
    g = torch.Generator(device=dev).manual_seed(1234)  # the same on every rank
    outs = torch.randn(W, B, Hq, D, generator=g, device=dev)
    lses = torch.randn(W, B, Hq, generator=g, device=dev) * 3
    lens = torch.full((B,), 7, dtype=torch.int32, device=dev)
    want, want_lse = wsattn.merge_states(outs, lses, impl="reference")
    rows = []
    for method in ("allgather", "symm"):
        try:
            ex = StateExchange.get(dist.group.WORLD, shape, dev, method)
        except Exception as e:  # noqa: BLE001 - reported as a row
            rows.append(row(what="exchange", mode=method, status="unavailable", reason=str(e)))
            continue
        fn = lambda: ex.merge(outs[rank], lses[rank], lens)  # noqa: E731
        got, got_lse = fn()
        _sync(dev)
        err = max(_rel_err(got, want), _rel_err(got_lse, want_lse))
        if err > 1e-5:
            rows.append(row(what="exchange", mode=method, status="wrong", rel_err=err))
            continue
        for graph in ((False, True) if dev.type == "cuda" else (False,)):
            try:
                t = time_ms(fn, dev, reps, graph=graph)
            except Exception as e:  # noqa: BLE001
                rows.append(row(what="exchange", mode=method, status="failed",
                                timing="graph" if graph else "eager", reason=repr(e)[:300]))
                continue
            rows.append(row(what="exchange", mode=method, status="ok", B=B, Hq=Hq, D=D,
                            bytes_per_rank=B * Hq * (D + 1) * 4, includes="exchange+merge",
                            us=t["median_ms"] * 1e3, **t))
    return rows


# --------------------------------------------------------------------------- decode

def _fits(nbytes: int, dev) -> bool:
    """Whether every rank has nbytes free (a collective: every rank gets the same answer)."""
    if dev.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(dev)
    ok = torch.tensor([1.0 if nbytes <= 0.85 * free else 0.0], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok.item() == 1.0


def bench_decode(L, dtype, dev, rank, W, reps, row, B=1):
    """One decode step at batch B, global context L: one GPU over the whole cache, sp.decode
    over a 1/W shard each, and (B = 1) sp.invariant_decode; each checked against the one-GPU
    kernel first. A shape whose global cache does not fit one GPU is a 'skipped' row: the
    one-GPU baseline and the check both need it."""
    from .decode import decode
    from .invariant import invariant_decode
    Hq, Hkv, D, page, T = 32, 8, 128, 64, 4096
    if dev.type == "cpu":
        Hq, Hkv, D, page, T = 4, 1, 64, 16, 64
    L = -(-L // (T * W)) * T * W  # whole position blocks on every rank
    cache_bytes = 2 * B * L * Hkv * D * dtype.itemsize
    invariant = B == 1
    need = cache_bytes * (1 + (2 if invariant else 1) / W)  # the global cache + the shards
    if not _fits(need, dev):
        return [row(what="decode", mode="sp_decode", L=L, B=B, status="skipped",
                    reason=f"the global K/V cache ({cache_bytes / 2**30:.1f} GiB) and its shards "
                           f"do not fit one GPU, which the baseline and the check need")]
    impl = "auto" if dev.type == "cuda" else "reference"
    g = torch.Generator(device=dev).manual_seed(L + B)  # the same global tensors on every rank
    q = torch.randn(B, Hq, D, generator=g, device=dev).to(dtype)
    k, v = (torch.randn(B, L, Hkv, D, generator=g, device=dev).to(dtype) for _ in range(2))
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    ref = wsattn.decode(q, k, v, lens, impl=impl)
    # This rank's shard: positions [r L/W, (r+1) L/W) of every sequence as pages of one
    # pool, sequence b in pages [b n/page, (b+1) n/page).
    n = L // W
    kp = k[:, rank * n:(rank + 1) * n].reshape(B * n // page, page, Hkv, D).contiguous()
    vp = v[:, rank * n:(rank + 1) * n].reshape(B * n // page, page, Hkv, D).contiguous()
    table = torch.arange(B * n // page, dtype=torch.int32, device=dev).view(B, -1)
    local = torch.full((B,), n, dtype=torch.int32, device=dev)
    modes = {"sp_decode": lambda: decode(q, kp, vp, local, table, impl=impl, check=False)}
    n_blocks = L // T
    if invariant:
        # Invariant layout: global position block j = i*W + r (T tokens) in local slot i.
        nb_loc = n_blocks // W
        kb = torch.cat([k[0, (i * W + rank) * T:(i * W + rank + 1) * T] for i in range(nb_loc)])
        vb = torch.cat([v[0, (i * W + rank) * T:(i * W + rank + 1) * T] for i in range(nb_loc)])
        kb = kb.reshape(-1, page, Hkv, D)
        vb = vb.reshape(-1, page, Hkv, D)
        btable = torch.arange(nb_loc * T // page, dtype=torch.int32,
                              device=dev).view(1, nb_loc, -1)
        blens = torch.full((1, nb_loc), T, dtype=torch.int32, device=dev)
        modes["sp_invariant_decode"] = lambda: invariant_decode(q, kb, vb, blens, btable,
                                                                n_blocks, impl=impl, check=False)
    rows = []
    checked = {}
    for mode, fn in modes.items():
        err = _rel_err(fn(), ref)
        if err > 2e-2:
            rows.append(row(what="decode", mode=mode, L=L, B=B, status="wrong", rel_err=err))
            continue
        checked[mode] = err
    # eager (host work per step included) and replayed from a CUDA graph (a serving loop)
    for graph in ((False, True) if dev.type == "cuda" else (False,)):
        single = time_ms(lambda: wsattn.decode(q, k, v, lens, impl=impl, validate=False), dev,
                         reps, graph=graph)
        rows.append(row(what="decode", mode="single_gpu", L=L, B=B, **single,
                        bytes_per_s=cache_bytes / (single["median_ms"] * 1e-3)))
        for mode, err in checked.items():
            t = time_ms(modes[mode], dev, reps, graph=graph)
            rows.append(row(what="decode", mode=mode, L=L, B=B, status="ok", rel_err=err, **t,
                            ratio_to_single=t["median_ms"] / single["median_ms"],
                            n_blocks=n_blocks if "invariant" in mode else None))
    return rows


# --------------------------------------------------------------------------- main

def main(args) -> int:
    """Run the SP benchmark on every rank; rank 0 prints a table and writes the JSON."""
    rank, W, dev = _init()
    from wsattn.bench.env import stamp
    st = stamp(dev if dev.type == "cuda" else None)
    st["world_size"] = W
    st["backend"] = str(dist.get_backend())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[getattr(args, "dtype", "bf16")]
    if dev.type == "cpu":
        dtype = torch.float32
    quick = getattr(args, "quick", False)
    what = getattr(args, "sp_what", None) or ["prefill", "exchange", "decode"]
    seqlens = getattr(args, "sp_seqlens", None) or (QUICK_SEQLENS if quick else SEQLENS)
    if dev.type == "cpu":
        seqlens = [s for s in seqlens if s <= 512] or [64 * W]
    contexts = getattr(args, "sp_contexts", None) or [(1 << 18) if quick else DECODE_CONTEXT]
    if dev.type == "cpu":
        contexts = sorted({min(c, 1024 * W) for c in contexts})
    batches = getattr(args, "sp_batches", None) or [1]
    zigzag = not getattr(args, "sp_no_zigzag", False)
    reps = getattr(args, "sp_reps", 10)

    def row(**fields):
        return {**st, "bench": "sp", "dtype": str(dtype).replace("torch.", ""),
                "zigzag": zigzag, **{k: v for k, v in fields.items() if v is not None}}

    path = getattr(args, "json", None) if rank == 0 else None
    if path:
        os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)

    rows = []

    def flush(complete=False):
        # Rewritten after every shape, so a run cut short by a time limit keeps what it
        # measured; the last row says whether the run finished.
        if path:
            with open(path, "w") as f:
                json.dump(rows + [row(what="run", mode="status", complete=complete)], f, indent=1)

    if "prefill" in what:
        for S in seqlens:
            if S % (2 * W):
                continue
            rows += bench_prefill(S, dtype, dev, rank, W, zigzag, reps, row)
            _report_progress(rank, rows[-1])
            flush()
    if "exchange" in what:
        rows += bench_exchange(dev, rank, W, reps, row)
        flush()
    if "decode" in what:
        for B in batches:
            for L in contexts:
                rows += bench_decode(L, dtype, dev, rank, W, reps, row, B=B)
                _report_progress(rank, rows[-1])
                flush()
    flush(complete=True)
    if rank == 0:
        print(format_rows(rows))
        if path:
            print(f"wrote {len(rows)} rows to {path}")
    dist.barrier()
    return 0 if all(r.get("status", "ok") in ("ok", "unavailable") for r in rows) else 1


def _report_progress(rank, last):
    if rank == 0:
        print(f"  sp {last.get('what')} {last.get('mode')} S={last.get('S')} done",
              file=sys.stderr, flush=True)


def format_rows(rows) -> str:
    cols = ("what", "mode", "timing", "S", "L", "status", "median_ms", "us", "speedup_vs_single",
            "tflops", "hidden", "ratio_to_single", "rel_err")
    lines = [" ".join(f"{c:>18}" for c in cols)]  # wide, but read once per run
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:>18.4g}" if isinstance(v, float) else f"{str(v):>18}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


NO_GPUS = ("python -m wsattn.sp.bench needs CUDA GPUs (one process per GPU: torchrun "
           "--nproc-per-node N -m wsattn.sp.bench), and this machine has none visible to torch. "
           "The CPU tests run its plumbing on gloo (tests/test_sp_gloo.py).")


def cli(argv=None) -> int:
    """The command line: refuses to start without CUDA GPUs, like `wsattn bench`."""
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPUS, file=sys.stderr)
        return 2
    return main(args)


if __name__ == "__main__":
    sys.exit(cli())
