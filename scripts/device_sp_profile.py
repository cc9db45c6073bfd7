"""Where the time of the sequence-parallel paths goes (device helper, not part of CI).

Run on a multi-GPU device machine:
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/device_sp_profile.py

For each path (overlapped and gather-then-attend prefill at one S, decode at one context,
and the decode step's pieces) it prints, on rank 0: the host time to enqueue one call
(no sync), the device time per call (events), and the same replayed from a CUDA graph
where the path allows it; then torch.profiler's top kernels by device time, so launch
overhead, host syncs and slow kernels can be told apart.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import wsattn
import wsattn.sp as sp
from wsattn.sp.decode import StateExchange, pack_state, partial_decode
from wsattn.sp.sharding import shard


def timed(fn, reps=20):
    """(host ms to enqueue one call, device ms per call) over reps calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / reps
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) / reps


def graphed(fn, reps=20):
    """Device ms per call replayed from a CUDA graph of `reps` calls, or the error."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / reps
    except Exception as e:  # noqa: BLE001 - reported
        return f"graph failed: {type(e).__name__}: {str(e)[:120]}"


def profile(name, fn, rank, rows=18):
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    if rank == 0:
        print(f"\n=== profile {name} (3 calls) ===")
        print(p.key_averages().table(sort_by="device_time_total", row_limit=rows,
                                     max_name_column_width=60))


def report(rank, name, fn, graph=True):
    host, dev = timed(fn)
    g = graphed(fn) if graph else "-"
    if rank == 0:
        gs = f"{g:.4f}" if isinstance(g, float) else g
        print(f"{name:44s} host {host:8.4f} ms/call  device {dev:8.4f} ms/call  graph {gs}",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--L", type=int, default=1 << 18)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(1)

    # ---- prefill
    S, Hq, Hkv, D = args.S, 32, 8, 128
    q, k, v = (torch.randn(1, S, h, D, generator=g, device=dev, dtype=torch.bfloat16)
               for h in (Hq, Hkv, Hkv))
    qs, ks, vs = (shard(t, W, rank, 1, True) for t in (q, k, v))
    paths = {
        "single_gpu attention": lambda: wsattn.attention(q, k, v, True, return_lse=True),
        "gather_then_attend": lambda: sp.prefill(qs, ks, vs, True, check=False),
        "overlapped p2p": lambda: sp.prefill_overlapped(qs, ks, vs, True, check=False),
        "overlapped symm": lambda: sp.prefill_overlapped(qs, ks, vs, True, check=False,
                                                         transport="symm"),
        "local attention only (Q shard x K shard)": lambda: wsattn.attention(
            qs, ks, vs, False, return_lse=True),
    }
    if rank == 0:
        print(f"prefill S={S} W={W} (bf16, Hq {Hq}, Hkv {Hkv}, D {D}, zig-zag)")
    for name, fn in paths.items():
        report(rank, name, fn, graph=name != "overlapped p2p")
    if not args.no_profile:
        profile(f"overlapped p2p S={S}", paths["overlapped p2p"], rank)
        profile(f"gather_then_attend S={S}", paths["gather_then_attend"], rank, rows=10)

    # ---- decode
    L, page = args.L, 64
    n = L // W
    qd = torch.randn(1, Hq, D, generator=g, device=dev, dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, L, Hkv, D, generator=g, device=dev, dtype=torch.bfloat16)
              for _ in range(2))
    lens = torch.tensor([L], dtype=torch.int32, device=dev)
    kp = kc[0, rank * n:(rank + 1) * n].reshape(n // page, page, Hkv, D).contiguous()
    vp = vc[0, rank * n:(rank + 1) * n].reshape(n // page, page, Hkv, D).contiguous()
    table = torch.arange(n // page, dtype=torch.int32, device=dev).view(1, -1)
    local = torch.tensor([n], dtype=torch.int32, device=dev)
    ex = StateExchange.get(dist.group.WORLD, (1, Hq, D + 1), dev, "auto")
    ex_ag = StateExchange.get(dist.group.WORLD, (1, Hq, D + 1), dev, "allgather")
    o_part, l_part, empty = partial_decode(qd, kp, vp, local, table, None, "auto", None, False)
    states = torch.stack([pack_state(o_part, l_part, empty)] * W)
    if rank == 0:
        print(f"\ndecode L={L} W={W} (bf16, B 1, page {page}); exchange={ex.method}")
    paths = {
        "single_gpu decode (contiguous, L)": lambda: wsattn.decode(qd, kc, vc, lens, validate=False),
        "single_gpu decode (contiguous, L/W)": lambda: wsattn.decode(
            qd, kc[:, :n], vc[:, :n], local, validate=False),
        "local paged decode (L/W) + lse": lambda: wsattn.decode(
            qd, kp, vp, local, table, return_lse=True, validate=False),
        "partial_decode (clamp, clone table, decode)": lambda: partial_decode(
            qd, kp, vp, local, table, None, "auto", None, False),
        "pack_state": lambda: pack_state(o_part, l_part, empty),
        f"exchange+merge ({ex.method})": lambda: ex.merge(o_part, l_part, local),
        "exchange+merge (allgather)": lambda: ex_ag.merge(o_part, l_part, local),
        "merge_states": lambda: wsattn.merge_states(states[..., :D], states[..., D]),
        "sp.decode (whole step)": lambda: sp.decode(qd, kp, vp, local, table, check=False),
    }
    for name, fn in paths.items():
        report(rank, name, fn)
    if not args.no_profile:
        profile(f"sp.decode L={L}", paths["sp.decode (whole step)"], rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
