"""Two readings that decide whether a skinny GEMM of the decode step is held back by how
many SMs its grid fills, and what cuBLAS runs where it is faster.

1. `--moe`: the grouped MoE gate/up and down kernels at one token (Qwen3-30B-A3B shape:
   128 experts, H 2048, F 768) with top_k = 4 .. 22 distinct experts. At the default
   settings a one-token gate/up program owns 64 gate + 64 up rows of one expert, so the
   grid is top_k x 12 programs: 96 at top_k 8, on 132 SMs. If the time stays flat from 8
   to 11 experts (132 programs) the kernel is limited by the SMs it fills, not by HBM, and a
   grid that spreads the same bytes over every SM would be faster by up to 11/8; if it
   grows with the bytes, HBM is the limit and nothing is to be had there. Every launch of
   a timed graph reads other experts than the one before (weights from HBM, not L2).
   Output of the first launch checked against float64 first.
2. `--cublas`: the kernels cuBLAS runs for torch.matmul at the step's skinny shapes
   (name, grid, block, us), next to the library's gemv at its default settings.

    PYTHONPATH=src python3 scripts/device_fill_probe.py --moe --cublas [--out DIR]

GPU only. Prints a table and writes fill_probe.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from wsattn.bench.step import chrome_trace
from wsattn.kernels import gemv as G
from wsattn.kernels import moe as M
from wsattn.target import target_of

REPS = 48
H, F, E = 2048, 768, 128
SHAPES = {  # (N, K) of y = x @ W^T, W [N, K]
    "1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "1b-gate_up": (16384, 2048),
    "1b-down": (2048, 8192), "8b-qkv": (6144, 4096), "8b-o": (4096, 4096),
    "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
    "qwen3-30b-qkv": (5120, 2048), "qwen3-30b-o": (2048, 4096),
}


def graph_of(launches):
    for fn in launches[:2]:
        fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def kernels_in(trace) -> list[dict]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and e.get("ph", "X") == "X":
            a = e.get("args") or {}
            out.append({"name": e.get("name", "?"), "grid": a.get("grid"),
                        "block": a.get("block"), "us": float(e.get("dur", 0.0))})
    return out


def mean_us(trace, prefix: str, grid0=None) -> tuple[float, int, list]:
    ks = [k for k in kernels_in(trace) if k["name"].startswith(prefix)
          and (grid0 is None or k["grid"] == grid0)]
    if not ks:
        raise RuntimeError(f"no {prefix} kernel in the trace")
    return sum(k["us"] for k in ks) / len(ks), len(ks), ks[0]["grid"]


def moe_probe(dev) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    w_gu = (torch.randn(E, 2 * F, H, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    w_d = (torch.randn(E, H, F, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, H, device=dev, generator=g).to(torch.bfloat16)
    rows = []
    for k in (4, 6, 8, 10, 11, 12, 16, 22):
        block = M.default_block(1, k, E)
        # REPS launches, each on k distinct experts, consecutive launches disjoint
        sets = []
        start = 0
        for _ in range(REPS):
            ids = torch.arange(start, start + k, device=dev) % E
            start += k
            sets.append(ids.to(torch.int32).view(1, k))
        groupings = [M.group(ids, E, block) for ids in sets]
        wts = torch.full((1, k), 1.0 / k, device=dev)
        acts = [M.moe_gate_up(x, w_gu, gr, pdl=False) for gr in groupings]
        # numerics of the first launch against float64
        ids0 = sets[0][0].long()
        xf = x.double()[0]
        ref = []
        for e in ids0.tolist():
            gu = w_gu[e].double() @ xf
            ref.append(torch.nn.functional.silu(gu[:F]) * gu[F:])
        gr0 = groupings[0]
        # grouped rows: the one token's pair j sits in the row sorted_pairs == j
        sp = gr0.sorted_pairs.long()
        got = torch.stack([acts[0][(sp == j).nonzero()[0, 0]] for j in range(k)]).double()
        want = torch.stack(ref)
        err = float((got - want).norm() / want.norm())
        if not err < 2e-2:
            raise RuntimeError(f"gate/up at top_k {k}: relative error {err:.3g}")
        gate_up = graph_of([lambda gr=gr: M.moe_gate_up(x, w_gu, gr, pdl=False)
                            for gr in groupings])
        tr = chrome_trace(torch, dev, gate_up.replay)
        gu_us, _, grid = mean_us(tr, "_grouped_kernel")
        outs = [torch.zeros(1, H, device=dev, dtype=torch.bfloat16) for _ in groupings]
        down = graph_of([lambda a=a, gr=gr, o=o: M.moe_down_combine(a, w_d, gr, wts, o, pdl=False)
                         for a, gr, o in zip(acts, groupings, outs)])
        tr = chrome_trace(torch, dev, down.replay)
        d_us, _, dgrid = mean_us(tr, "_grouped_kernel")
        gu_mb = k * 2 * F * H * 2 / 1e6
        d_mb = k * H * F * 2 / 1e6
        # MB / us = TB/s
        row = {"top_k": k, "gate_up_grid": grid, "gate_up_us": gu_us,
               "gate_up_tbps": gu_mb / gu_us, "down_grid": dgrid, "down_us": d_us,
               "down_tbps": d_mb / d_us, "rel_err_gate_up": err}
        rows.append(row)
        print(f"moe top_k {k:2d}: gate/up grid {grid} {gu_us:6.2f} us {row['gate_up_tbps']:.2f} TB/s"
              f" | down grid {dgrid} {d_us:6.2f} us {row['down_tbps']:.2f} TB/s", flush=True)
    return rows


def cublas_probe(dev) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    target = target_of(torch.device(dev))
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(160e6 // (N * K * 2)) + 1)  # > L2 between reuses
        ws = [(torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
              for _ in range(copies)]
        for Mr in (1, 8, 16, 32, 64):
            x = torch.randn(Mr, K, device=dev, generator=g).to(torch.bfloat16)
            ref = (x.double() @ ws[0].double().T)
            y = x @ ws[0].T
            mine = G.gemv(x, ws[0], pdl=False)
            for what, out in (("cublas", y), ("gemv", mine)):
                err = float((out.double() - ref).norm() / ref.norm())
                if not err < 1e-2:
                    raise RuntimeError(f"{what} {name} M{Mr}: relative error {err:.3g}")
            seq = [ws[i % copies] for i in range(REPS)]
            peer = graph_of([lambda w=w: torch.matmul(x, w.T) for w in seq])
            tr = chrome_trace(torch, dev, peer.replay)
            ks = kernels_in(tr)
            names = {}
            for k in ks:
                key = (k["name"][:110], str(k["grid"]), str(k["block"]))
                n, us = names.get(key, (0, 0.0))
                names[key] = (n + 1, us + k["us"])
            ours = graph_of([lambda w=w: G.gemv(x, w, pdl=False) for w in seq])
            tr2 = chrome_trace(torch, dev, ours.replay)
            mine_us = sum(k["us"] for k in kernels_in(tr2)) / REPS
            s = G.default_settings(target, M=Mr, N=N, K=K, dtype=torch.bfloat16)
            for (kn, grid, block), (n, us) in names.items():
                row = {"shape": name, "M": Mr, "N": N, "K": K, "kernel": kn, "grid": grid,
                       "block": block, "per_call": n / REPS, "us": us / n,
                       "gemv_us_per_call": mine_us, "gemv_settings": str(s)}
                rows.append(row)
                print(f"{name:14s} M{Mr:2d}: cublas {us / n:6.2f} us x{n / REPS:.0f} grid {grid}"
                      f" block {block} {kn[:90]} | gemv {mine_us:6.2f} us", flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", action="store_true")
    p.add_argument("--cublas", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    dev = "cuda"
    result = {"gpu": torch.cuda.get_device_name(), "sms":
              torch.cuda.get_device_properties(0).multi_processor_count}
    if a.moe:
        result["moe"] = moe_probe(dev)
    if a.cublas:
        result["cublas"] = cublas_probe(dev)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fill_probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
