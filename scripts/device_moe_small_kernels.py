"""The MoE step's two small single-purpose kernels, the top-k router (`_route_kernel`, one
program a token) and the grouping (`_group_kernel`, one program), at num_warps 1 / 2 / 4 / 8
side by side: GPU time per launch from a profiled CUDA-graph replay of REPS launches, each
variant's output checked against the default build's first (ids and grouping bitwise,
routing weights within fp32 rounding).

    PYTHONPATH=src python3 scripts/device_moe_small_kernels.py [--out DIR]

Why: at B1 a Qwen3-30B-A3B layer spent 4.1 us in the router's top-k and 6.0 us grouping
(`benchmarks/results/moe_profile_H200_2026-12-01_4c3d5e7.txt`) for 128 logits and 8
pairs: latency, not bandwidth. With 4 warps every one of the top-k loop's reductions
crosses warps through shared memory and a barrier; one warp reduces 128 values with
shuffles alone. Prediction: route 4.1 -> ~2 us at one warp; the grouping's passes are
[CHUNK, BLOCK_E] one-hot tiles, so fewer warps may cost there instead. GPU only.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from wsattn.bench.step import profile_summary
from wsattn.kernels import moe as M
from wsattn.kernels._intmath import next_pow2

REPS = 64
WARPS = (1, 2, 4, 8)
# (name, T, E, top_k): Qwen3-30B-A3B at B 1 / 8 / 64, Mixtral-8x7B at B 1 / 8
SHAPES = (("qwen3-30b-a3b", 1, 128, 8), ("qwen3-30b-a3b", 8, 128, 8),
          ("qwen3-30b-a3b", 64, 128, 8), ("mixtral-8x7b", 1, 8, 2), ("mixtral-8x7b", 8, 8, 2))


def kernel_us(launch, name) -> float:
    """GPU time of one launch: a graph of REPS launches, profiled, averaged."""
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    summary = profile_summary(torch, "cuda", graph.replay)
    rows = [(n, us) for key, (n, us) in summary["by_name"].items() if key.startswith(name)]
    if len(rows) != 1:
        raise RuntimeError(f"expected one {name} entry in the trace, got {summary['by_name']}")
    n, us = rows[0]
    return us / n


def route_case(T, E, k, warps):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g) * 3
    wts = torch.empty(T, k, device="cuda")
    ids = torch.empty(T, k, dtype=torch.int32, device="cuda")

    def launch():
        M._route_kernel[(T,)](logits, wts, ids, E, TOP_K=k, BLOCK_E=max(16, next_pow2(E)),
                              BLOCK_TK=next_pow2(k), RENORM=True, SIGMOID=False, PDL=False,
                              num_warps=warps)
    launch()
    torch.cuda.synchronize()
    return launch, (wts.clone(), ids.clone())


def group_case(T, E, k, warps):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().cuda()
    block = M.default_block(T, k, E)
    nb = M.blocks_max(T, k, E, block)
    rows = nb * block
    out = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (rows, E + 1, E, nb, 1)]

    def launch():
        M._group_kernel[(1,)](ids, *out, T * k, E, rows, nb, BLOCK=block,
                              BLOCK_E=max(16, next_pow2(E)), CHUNK=M.GROUP_CHUNK,
                              TAIL=M.GROUP_TAIL, PDL=False, num_warps=warps)
    launch()
    torch.cuda.synchronize()
    return launch, tuple(t.clone() for t in out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for model, T, E, k in SHAPES:
        for kernel, make, name in (("route", route_case, "_route_kernel"),
                                   ("group", group_case, "_group_kernel")):
            base = None
            default = M.ROUTE_NUM_WARPS if kernel == "route" else M.GROUP_NUM_WARPS
            for warps in (default,) + tuple(w for w in WARPS if w != default):  # default first
                launch, out = make(T, E, k, warps)
                if base is None:
                    base = out
                    ok = True
                elif kernel == "route":
                    ok = torch.equal(out[1], base[1]) and torch.allclose(out[0], base[0],
                                                                         rtol=1e-6, atol=0)
                else:
                    ok = all(torch.equal(a, b) for a, b in zip(out, base))
                us = kernel_us(launch, name) if ok else None
                row = {"model": model, "T": T, "E": E, "top_k": k, "kernel": kernel,
                       "num_warps": warps, "default": warps == default, "matches_default": ok,
                       "us": us}
                rows.append(row)
                print(json.dumps(row), flush=True)
    path = os.path.join(args.out, "moe_small_kernels.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
