"""Where one MoE layer's time goes: a torch.profiler trace of CUDA-graph replays of
wsattn.kernels.moe.moe at `wsattn bench moe` shapes, per kernel (calls, GPU us per layer)
and the GPU idle time between kernels, next to the touched-weight floor.

    PYTHONPATH=src python3 scripts/device_moe_profile.py [--models qwen3-30b-a3b] [--batch 1 8] [--pdl]

Each replay runs REPLAYS layer calls, each on its own weight copy (so the weights stream
from HBM, as in the benchmark); the figures are per layer call. GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch

from wsattn.bench import moe as bm
from wsattn.bench.ceilings import copy_bandwidth
from wsattn.bench.step import gpu_summary, per_step, profile_summary
from wsattn.bench.timing import cuda_timer
from wsattn.kernels import moe as kmoe

REPLAYS = 16


def profile_case(case, pdl: bool, tbps: float) -> dict:
    c = case.cfg
    x, router_w, w_gate_up, w_down = bm._inputs(case, "cuda")
    ids = kmoe.route(x, router_w, top_k=c.top_k, renormalize=c.norm_topk)[1]
    hit = bm.distinct_experts(ids)
    copies = [(router_w.clone(), w_gate_up.clone(), w_down.clone())
              for _ in range(min(REPLAYS, case.copies(hit)))]
    out = torch.empty_like(x)

    def calls():
        for i in range(REPLAYS):
            rw, wgu, wd = copies[i % len(copies)]
            kmoe.moe(x, rw, wgu, wd, top_k=c.top_k, renormalize=c.norm_topk, out=out, pdl=pdl)

    calls()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    summary = profile_summary(torch, "cuda", graph.replay)
    per = per_step(summary, gpu_summary([]), REPLAYS)
    floor_us = case.touched_bytes(hit) / (tbps * 1e12) * 1e6
    return {"case": case.id, "pdl": pdl, "experts_hit": hit, "floor_us": round(floor_us, 2),
            "span_us_per_layer": round(summary["span_us"] / REPLAYS, 2),
            "idle_us_per_layer": round((summary["span_us"] - summary["busy_us"]) / REPLAYS, 2),
            "kernels_per_layer": per["kernels_per_step"],
            "kernels_by_time": per["kernels_by_time"], "gaps_by_pair": per["gaps_by_pair"][:6],
            "replays": REPLAYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--pdl", action="store_true")
    p.add_argument("--json", help="write the rows there")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("device_moe_profile.py needs a CUDA GPU")
    tbps = copy_bandwidth(cuda_timer(), "cuda").value
    rows = [profile_case(case, a.pdl, tbps) for case in bm.moe_cases(a.models, a.batch)]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
