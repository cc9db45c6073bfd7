"""Does one persistent launch for a dense layer's o / gate-up / down beat the three GEMV
launches at one row? (notes/decode_step.md, "What next" item 1.)

For each model shape: the persistent Gluon kernel (wsattn.kernels.mlp_gluon) checked
against a float64 reference that rounds h and act where the kernels do, NaN-poisoned
output, bit-identical reruns; then timed side by side with the three-launch chain
(gemv o + residual, gate/up + FlashNorm + SiLU, down + residual; PDL on) as CUDA graphs of
L layers with distinct weights (every weight from HBM), and the copy ceiling of the same
process.

    PYTHONPATH=src python3 scripts/device_mlp_persistent.py [--out DIR] [--check-only]

GPU only (sm_90). Writes mlp_persistent.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from wsattn.kernels import gemv as G
from wsattn.kernels import mlp_gluon as MG

SHAPES = {  # name: (QD, H, F, layers timed)
    "llama-3.2-1b": (2048, 2048, 8192, 16),
    "llama-3.1-8b": (4096, 4096, 14336, 8),
}
EPS = 1e-5


def weights(QD, H, F, dev, dtype=torch.bfloat16):
    g = lambda *s: (torch.randn(*s, device=dev) / s[-1] ** 0.5).to(dtype)
    return g(H, QD), g(2 * F, H), g(H, F)


def reference(attn, res, wo, wgu, wd):
    """float64, h and act rounded to bf16 where the kernels round them."""
    d = torch.float64
    h = (res.to(d) + attn.to(d) @ wo.to(d).T).to(res.dtype).to(d)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    gu = (h @ wgu.to(d).T) * r
    F = wgu.shape[0] // 2
    g, u = gu[:, :F], gu[:, F:]
    act = (g * torch.sigmoid(g) * u).to(res.dtype).to(d)
    return h + act @ wd.to(d).T


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def chain(attn, res, wo, wgu, wd, act_buf, pdl=True):
    """The step's three launches, in place on res."""
    G.gemv(attn, wo, residual=res, out=res, pdl=pdl)
    G.gemv(res, wgu, norm_eps=EPS, silu_mul=True, out=act_buf, pdl=pdl)
    G.gemv(act_buf, wd, residual=res, out=res, pdl=pdl)


def time_graph(fn, reps=50, warm=10):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def copy_tbps(dev):
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_graph(lambda: dst.copy_(src), reps=20, warm=3)
    return 2 * n / (t * 1e-6) / 1e12


# (BN, BK) of a ring slot, ring depth (None: as deep as shared memory allows; 3 x 32 KB
# leaves room for two CTAs an SM, so the next launch's ring can start under this one)
VARIANTS = ((128, 128, None), (64, 256, None), (32, 256, None), (128, 128, 3), (32, 256, 6))


def check(name, QD, H, F, dev, coop):
    torch.manual_seed(0)
    wo, wgu, wd = weights(QD, H, F, dev)
    attn = torch.randn(1, QD, device=dev).to(torch.bfloat16)
    res = torch.randn(1, H, device=dev).to(torch.bfloat16)
    ref = reference(attn, res, wo, wgu, wd)
    ws = MG.MlpWorkspace(QD, H, F, torch.bfloat16, dev)
    r3 = res.clone()
    act = torch.empty(1, F, device=dev, dtype=torch.bfloat16)
    chain(attn, r3, wo, wgu, wd, act)
    rows = []
    for (bn, bk, st), sync in [(v, 0) for v in VARIANTS] + [(v, 1) for v in VARIANTS[:3]]:
        kw = dict(out=None, ws=ws, cooperative=coop, bn=bn, bk=bk, stages=st, sync=sync,
                  base_relaxed=sync == 1)
        out = torch.full_like(res, float("nan"))
        MG.mlp_one_row(attn, res, wo, wgu, wd, EPS, **{**kw, "out": out})
        torch.cuda.synchronize()
        same = True
        for _ in range(20):
            o2 = torch.full_like(res, float("nan"))
            MG.mlp_one_row(attn, res, wo, wgu, wd, EPS, **{**kw, "out": o2})
            same &= bool(torch.equal(o2, out))
        r2 = res.clone()  # in place (out = res), as the step calls it
        MG.mlp_one_row(attn, r2, wo, wgu, wd, EPS, **{**kw, "out": r2})
        row = {"model": name, "bn": bn, "bk": bk, "sync": sync, "plan": MG.plan(QD, H, F, ws.ts.shape[0], bn, bk, st),
               "rel_err": rel(out, ref), "finite": bool(torch.isfinite(out).all()),
               "reruns_identical": same, "in_place_identical": bool(torch.equal(r2, out)),
               "chain_rel_err": rel(r3, ref)}
        print(row, flush=True)
        rows.append(row)
    return rows


def phases(ws, G):
    """Per-CTA %globaltimer stamps of one launch -> median phase lengths (us)."""
    t = ws.ts[:G].double().cpu() / 1e3
    d = lambda a, b: float((t[:, b] - t[:, a]).median())
    return {"start_spread": float(t[:, 0].max() - t[:, 0].min()),
            "ring_issue": d(0, 8), "gdc_wait": d(8, 9), "base_read": d(9, 1), "p0": d(1, 2), "barrier1": d(2, 3), "p1": d(3, 4),
            "barrier2": d(4, 5), "p2": d(5, 6), "p3": d(6, 7), "cta_total": d(0, 7),
            "launch_span": float(t[:, 7].max() - t[:, 0].min())}


def bench(name, QD, H, F, L, dev, coop):
    torch.manual_seed(1)
    ls = [weights(QD, H, F, dev) for _ in range(L)]
    attn = torch.randn(1, QD, device=dev).to(torch.bfloat16)
    res = torch.randn(1, H, device=dev).to(torch.bfloat16)
    act = torch.empty(1, F, device=dev, dtype=torch.bfloat16)
    ws = MG.MlpWorkspace(QD, H, F, torch.bfloat16, dev)
    G_ = ws.ts.shape[0]

    def persistent(pdl=True, **kw):
        def run():
            for wo, wgu, wd in ls:
                MG.mlp_one_row(attn, res, wo, wgu, wd, EPS, out=res, ws=ws, pdl=pdl,
                               cooperative=coop, **kw)
        return run

    def three(pdl):
        def run():
            for wo, wgu, wd in ls:
                chain(attn, res, wo, wgu, wd, act, pdl=pdl)
        return run

    nbytes = sum(t.numel() * t.element_size() for w in ls for t in w)
    row = {"model": name, "layers": L, "weight_bytes_per_layer": nbytes // L, "us_per_layer": {}}
    cols = [("chain_pdl", three(True)), ("chain_nopdl", three(False))]
    for bn, bk, st in VARIANTS:
        name = f"persistent_{bn}x{bk}x{st or 'max'}"
        cols.append((name, persistent(bn=bn, bk=bk, stages=st)))
        for sync in (1, 2, 3):
            cols.append((f"{name}_sync{sync}_relaxedbase",
                         persistent(bn=bn, bk=bk, stages=st, sync=sync, base_relaxed=True)))
    cols.append(("chain_pdl_again", three(True)))
    for label, fn in cols:
        t = time_graph(fn)
        row["us_per_layer"][label] = t / L
    row["tbps"] = {k: nbytes / L / (v * 1e-6) / 1e12 for k, v in row["us_per_layer"].items()}
    row["phases"] = {}
    for bn, bk, st in VARIANTS:
        for sync, relaxed in ((0, False), (1, True)):
            for pdl in (True, False):
                wo, wgu, wd = ls[0]
                for _ in range(3):
                    MG.mlp_one_row(attn, res, wo, wgu, wd, EPS, out=res, ws=ws,
                                   cooperative=coop, bn=bn, bk=bk, stages=st, timing=True, sync=sync,
                                   base_relaxed=relaxed, pdl=pdl)
                torch.cuda.synchronize()
                row["phases"][f"{bn}x{bk}x{st or 'max'}_sync{sync}_pdl{int(pdl)}"] = phases(ws, G_)
    print(json.dumps(row, indent=1), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--no-coop", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    coop = not a.no_coop
    res = {"device": torch.cuda.get_device_name(dev), "cooperative": coop,
           "commit": os.environ.get("WSATTN_COMMIT", "?"), "checks": [], "timings": []}
    for name, (QD, H, F, L) in SHAPES.items():
        res["checks"].extend(check(name, QD, H, F, dev, coop))
    if not a.check_only:
        res["copy_tbps"] = copy_tbps(dev)
        for name, (QD, H, F, L) in SHAPES.items():
            res["timings"].append(bench(name, QD, H, F, L, dev, coop))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "mlp_persistent.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
