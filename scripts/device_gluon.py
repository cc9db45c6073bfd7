"""Device-side check and timing of the Gluon sm_90 prefill kernel.

Run on an H200 from the repository root:
    PYTHONPATH=$PWD/src python3 scripts/device_gluon.py [--out DIR] [--variants a,b] [--skip-stress]

Steps, each appended to DIR/gluon_dev.json as soon as it finishes (a hang still leaves
what was done):
  1. numerics of the default settings against the float64 reference (fp16/bf16, odd S,
     q_len < kv_len causal, GQA 8:1, NaN-poisoned outputs), LSE too;
  2. stress: thousands of launches, every output bit-identical to the first;
  3. every variant (settings overrides) checked on the timing shapes against SDPA, then
     timed beside SDPA cuDNN and the project's Triton kernel: by default as `wsattn bench`
     times (CUDA-graph replay, L2 warm; --timing graph), or with triton.testing.do_bench
     (--timing do_bench: L2 cleared before each call). The two can order builds
     differently: the one-consumer build at D64 non-causal N = 1024 ran 3-5 % ahead of the
     persistent walk under do_bench and ~3 % behind it in the bench
     (notes/prefill_gluon.md), so a default is decided on the bench's timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

os.environ["WSATTN_POISON"] = "1"  # outputs start as NaN: an unwritten element shows

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from wsattn import reference  # noqa: E402
from wsattn.kernels import prefill_gluon as pg  # noqa: E402

# Settings overrides to compare; a "D" key limits a variant to one head dim.
VARIANTS = {
    "default": {},
    "pingpong": {"PINGPONG": True},
    "plain": {"UNROLL": False},  # no step pairs (one P register set)
    "unroll": {"UNROLL": True, "D": 128},  # step pairs (the D128 default without a mask)
    "plain_s3": {"UNROLL": False, "STAGES": 3, "BLOCK_N": 128, "D": 128},
    "bn64_s4": {"UNROLL": True, "STAGES": 4, "BLOCK_N": 64, "D": 128},
    "plain_s4": {"UNROLL": False, "STAGES": 4, "BLOCK_N": 128, "D": 64},
    # two consumer warpgroups (128-row tiles) at D=64, where the default has three
    "c2": {"CONSUMERS": 2, "D": 64},
    "c3_pingpong": {"CONSUMERS": 3, "PINGPONG": True, "D": 64},
    # 64-key tiles: registers for UNROLL's two P sets (no spills; the 128-key c3 + UNROLL
    # spills 1 KB), 8 stages = the same ring bytes as 4 x 128 keys.
    "c3_bn64": {"CONSUMERS": 3, "BLOCK_N": 64, "STAGES": 8, "UNROLL": True, "D": 64},
    # every warpgroup walks all of its CTA's K/V tiles
    "no_wg_tiles": {"WG_TILES": False},
    # one CTA per SM walking the tiles longest-first (settings_for turns UNROLL off with it)
    "persistent": {"persistent": True},
    # the same with UNROLL kept at D128: ptxas spills 28-32 B a tile, does the pair pay?
    "persistent_unroll": {"persistent": True, "UNROLL": True, "D": 128},
    # head sections of the persistent order: one for the whole problem (best balance in
    # the CPU model), one GQA group each (fewest heads' K/V live in L2)
    "persistent_one_section": {"persistent": True, "l2_section_bytes": 2 ** 62},
    "persistent_group_sections": {"persistent": True, "l2_section_bytes": 1},
    # P to bf16 by one cvt a value (ptxas packs the pairs with PRMT half swaps)
    "unpacked": {"PACK_P": False},
    # the masked tiles in the unmasked loop's body (one copy of the step's code a consumer)
    "one_loop": {"ONE_LOOP": True},
    # one consumer warpgroup (64-row tiles), two CTAs an SM (maxnreg 128), a ring that
    # fits half the SM's shared memory: 3 x 64 keys at D128, 3 x 128 or 4 x 64 at D64
    "c1": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "UNROLL": False, "ONE_LOOP": False,
           "D": 128},
    "c1_unroll": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "UNROLL": True,
                  "ONE_LOOP": False, "D": 128},
    "c1_d64": {"CONSUMERS": 1, "BLOCK_N": 128, "STAGES": 3, "UNROLL": False, "ONE_LOOP": False,
               "D": 64},
    "c1_d64_bn64": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 4, "UNROLL": False,
                    "ONE_LOOP": False, "D": 64},
    # the same at three CTAs an SM (maxnreg 80: the consumer 136 registers)
    # (128-key tiles do not build at maxnreg 80: ptxas C7602)
    "c1x3": {"CONSUMERS": 1, "ctas_per_sm": 3, "CONSUMER_REGS": 136, "BLOCK_N": 64,
             "STAGES": 2, "UNROLL": False, "ONE_LOOP": False, "D": 64},
    "c1x3_s3": {"CONSUMERS": 1, "ctas_per_sm": 3, "CONSUMER_REGS": 136, "BLOCK_N": 64,
                "STAGES": 3, "UNROLL": False, "ONE_LOOP": False, "D": 64},
    "c1x3_s4": {"CONSUMERS": 1, "ctas_per_sm": 3, "CONSUMER_REGS": 136, "BLOCK_N": 64,
                "STAGES": 4, "UNROLL": False, "ONE_LOOP": False, "D": 64},
}


def overrides(name, D):
    """The settings overrides of a variant for head dim D, or None where it does not apply."""
    over = dict(VARIANTS[name])
    only = over.pop("D", None)
    return None if only is not None and only != D else over

NUMERIC_CASES = [  # B, Sq, Sk, Hq, Hkv, D, causal, dtype
    (1, 1, 1, 2, 1, 64, False, torch.float16),
    (2, 17, 17, 4, 2, 64, True, torch.bfloat16),
    (2, 127, 127, 8, 2, 64, False, torch.bfloat16),
    (2, 127, 127, 8, 2, 64, True, torch.float16),
    (1, 300, 300, 8, 1, 128, True, torch.bfloat16),
    (1, 300, 300, 8, 1, 128, False, torch.float16),
    (2, 17, 300, 4, 4, 128, True, torch.bfloat16),
    (1, 1, 257, 8, 1, 128, True, torch.float16),
    (1, 384, 1000, 8, 8, 64, True, torch.bfloat16),
    (2, 1000, 1000, 4, 4, 128, False, torch.bfloat16),
    (1, 2048, 2048, 16, 2, 128, True, torch.bfloat16),
    (1, 2048, 2048, 16, 16, 64, True, torch.float16),
    # D=64 around the 192-row tile of the 3-consumer build (and the 128-row one)
    (1, 300, 300, 8, 1, 64, False, torch.bfloat16),
    (2, 193, 193, 4, 2, 64, True, torch.float16),
    (1, 17, 300, 4, 4, 64, True, torch.bfloat16),
    (2, 1000, 1000, 4, 4, 64, False, torch.bfloat16),
    # more tiles than SMs
    (4, 1000, 1000, 32, 8, 128, False, torch.bfloat16),
    (3, 777, 777, 32, 4, 64, True, torch.float16),
]
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def case_id(B, Sq, Sk, Hq, Hkv, D, causal, dtype):
    dt = "bf16" if dtype == torch.bfloat16 else "fp16"
    return f"B{B}-Sq{Sq}-Sk{Sk}-H{Hq}-HKV{Hkv}-D{D}-{'causal' if causal else 'full'}-{dt}"


class Log:
    def __init__(self, path):
        self.path, self.rows = path, []

    def add(self, row):
        self.rows.append(row)
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)
        print(json.dumps(row), flush=True)


def stamp():
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return None
    return {"kind": "stamp", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": (os.environ.get("WSATTN_COMMIT")
                       or run(["git", "rev-parse", "--short", "HEAD"])),
            "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])}


def numerics(log, name):
    for c in NUMERIC_CASES:
        B, Sq, Sk, Hq, Hkv, D, causal, dtype = c
        settings_overrides = overrides(name, D)
        if settings_overrides is None:
            continue
        g = torch.Generator(device="cuda").manual_seed(hash(c) % 2**31)
        q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
        scale = 1 / math.sqrt(D)
        row = {"kind": "numerics", "variant": name, "case": case_id(*c)}
        try:
            s = pg.settings_for(D, causal, **settings_overrides)
            out, lse = pg.prefill(q, k, v, causal, scale, settings=s)
            torch.cuda.synchronize()
            ref, ref_lse = reference.attention(q, k, v, causal, scale)
            err = rel_err(out, ref)
            fin = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse.double())[fin].abs().max().item()
            lse_tol = LSE_TOL[dtype] * max(1.0, ref_lse[fin].abs().max().item())
            row.update(err=err, lse_err=lse_err,
                       nan=bool(torch.isnan(out).any() or torch.isnan(lse).any()),
                       ok=err <= TOL[dtype] and lse_err <= lse_tol)
        except Exception as e:  # record and go on: one failure must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        log.add(row)


def stress(log, name="default", launches=2000, D=128):
    D = VARIANTS[name].get("D", D)  # a variant limited to one head dim is stressed there
    B, S, H, HKV = 2, 1000, 32, 8  # 384-512 tiles: more than SMs
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16)
    for causal in (False, True):
        s = pg.settings_for(D, causal, **overrides(name, D))
        t0 = time.time()
        first, first_lse = pg.prefill(q, k, v, causal, 1 / math.sqrt(D), settings=s)
        same = 0
        for _ in range(launches):
            out, lse = pg.prefill(q, k, v, causal, 1 / math.sqrt(D), settings=s)
            same += int(torch.equal(out, first) and torch.equal(lse, first_lse))
        torch.cuda.synchronize()
        log.add({"kind": "stress", "variant": name,
                 "case": case_id(B, S, S, H, HKV, D, causal, torch.bfloat16),
                 "launches": launches, "bit_identical": same, "seconds": round(time.time() - t0, 2),
                 "ok": same == launches})


def timing_cases(ns, ds):
    for D in ds:
        for causal in (False, True):
            for N in ns:
                yield 16384 // N, N, 2048 // D, D, causal


def timing(log, variants, ns=(4096, 8192, 16384), ds=(128, 64), method="graph"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from wsattn.bench.timing import cuda_timer
    if method == "graph":
        timer = cuda_timer(method="graph")

        def measure(fn):
            return timer(fn).median_ms
    else:
        def measure(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
    try:
        from wsattn.kernels import prefill_triton
    except Exception as e:  # the Triton kernel is another issue's file
        prefill_triton = None
        log.add({"kind": "note", "text": f"no Triton kernel: {type(e).__name__}: {e}"})
    for B, N, H, D, causal in timing_cases(ns, ds):
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = 1 / math.sqrt(D)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, N, D] views of BSHD

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, scale=scale)
        ref = cudnn().transpose(1, 2)
        impls = {"cudnn": cudnn}
        if prefill_triton is not None:
            impls["triton"] = lambda: prefill_triton.prefill(q, k, v, None, None, 0, 0, causal, scale)[0]
        for name in variants:
            over = overrides(name, D)
            if over is None:
                continue
            s = pg.settings_for(D, causal, **over)
            impls[f"gluon:{name}"] = (lambda s=s: pg.prefill(q, k, v, causal, scale, settings=s)[0])
        for name, fn in impls.items():
            row = {"kind": "timing", "impl": name, "B": B, "N": N, "H": H, "D": D, "causal": causal,
                   "timing": method}
            try:
                out = fn()
                out = out.transpose(1, 2) if name == "cudnn" else out
                row["err_vs_cudnn"] = rel_err(out, ref)
                ms = measure(fn)
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:
                msg = str(e)
                row.update(error=f"{type(e).__name__}: {msg[:200]} ... {msg[-600:]}")
            log.add(row)


def table(rows):
    t = [r for r in rows if r.get("kind") == "timing" and "tflops" in r]
    base = {(r["N"], r["D"], r["causal"]): r["tflops"] for r in t if r["impl"] == "cudnn"}
    lines = [f"{'impl':<18}{'D':>4}{'N':>7}{'causal':>7}{'TFLOP/s':>9}{'x cuDNN':>9}{'err':>10}"]
    for r in t:
        b = base.get((r["N"], r["D"], r["causal"]))
        lines.append(f"{r['impl']:<18}{r['D']:>4}{r['N']:>7}{str(r['causal']):>7}{r['tflops']:>9.1f}"
                     f"{(r['tflops'] / b if b else float('nan')):>9.3f}{r.get('err_vs_cudnn', 0):>10.2e}")
    bad = [r for r in rows if r.get("ok") is False]
    lines.append(f"numerics/stress failures: {len(bad)}")
    for r in bad[:20]:
        lines.append("  FAIL " + json.dumps(r))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--numerics-variants", default="default")
    ap.add_argument("--stress-variants", default="default")
    ap.add_argument("--launches", type=int, default=2000, help="stress launches per case")
    ap.add_argument("--stress-ds", default="128", help="head dims to stress a variant at")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--ns", default="4096,8192,16384", help="sequence lengths to time")
    ap.add_argument("--ds", default="128,64", help="head dims to time")
    ap.add_argument("--timing", choices=("graph", "do_bench"), default="graph",
                    help="graph: CUDA-graph replay as `wsattn bench` (default); do_bench: "
                         "triton.testing.do_bench, L2 cleared before each call")
    args = ap.parse_args()
    log = Log(os.path.join(args.out, "gluon_dev.json"))
    log.add(stamp())
    for name in args.numerics_variants.split(","):
        if name:
            numerics(log, name)
    for name in args.stress_variants.split(","):
        for d in ([] if not name else sorted({VARIANTS[name].get("D", int(d))
                                               for d in args.stress_ds.split(",")})):
            stress(log, name, args.launches, d)
    if not args.skip_timing:
        timing(log, [n for n in args.variants.split(",") if n],
               tuple(int(n) for n in args.ns.split(",")), tuple(int(d) for d in args.ds.split(",")),
               args.timing)
    print(table(log.rows))
    return 0 if all(r.get("ok", True) for r in log.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
