"""GPU check of the Triton prefill at FACTS.md's benchmark shapes: correctness, then time.

Run on the GPU machine (torch + triton only):
    PYTHONPATH=src python tests/gpu_prefill_check.py --out "$OUT/prefill_triton.json"

Per shape (bf16, 16k tokens, hidden 2048, B = 16384 / N, H = 2048 / D) and causal: checks
impl="triton" against the float64 reference on two heads, then times it (median and
spread of CUDA-event timings) next to SDPA's cuDNN and flash backends in the same process,
with the default settings and with warp_specialize=True (non-causal). Writes JSON rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess

import torch
import triton

from wsattn import reference
from wsattn.kernels import prefill_triton
from wsattn.target import target_of

SHAPES = [(128, 1024), (128, 4096), (128, 16384), (64, 4096), (256, 4096)]


def _time(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times), min(times), max(times)


def _sdpa(q, k, v, causal, backend):
    from torch.nn.attention import sdpa_kernel
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="prefill_triton.json")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend
    target = target_of(torch.device("cuda"))
    stamp = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
             "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                      text=True).stdout.strip()}
    rows = []
    for D, N in SHAPES:
        B, H = 16384 // N, 2048 // D
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = 1 / math.sqrt(D)
        for causal in (False, True):
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            variants = {"default": prefill_triton.default_settings(target, D, q.dtype, causal)}
            if not causal and target.has_tma:
                variants["warp_specialized"] = prefill_triton.default_settings(
                    target, D, q.dtype, False, warp_specialize=True)
            for name, s in variants.items():
                out, lse = prefill_triton.prefill(q, k, v, None, None, 0, 0, causal, scale, s)
                ref, ref_lse = reference.attention(q[:1, :, :2], k[:1, :, :2], v[:1, :, :2],
                                                   causal, scale)
                err = ((out[:1, :, :2].double() - ref).norm() / ref.norm()).item()
                lse_err = (lse[:1, :2].double() - ref_lse).abs().max().item()
                med, lo, hi = _time(lambda: prefill_triton.prefill(
                    q, k, v, None, None, 0, 0, causal, scale, s), args.reps)
                rows.append({**stamp, "impl": f"triton-{name}", "D": D, "N": N, "B": B, "H": H,
                             "causal": causal, "settings": dataclasses.asdict(s), "rel_err": err, "lse_max_abs_err": lse_err,
                             "us_median": med, "us_min": lo, "us_max": hi,
                             "tflops": flops / med / 1e6, "ok": err < 2e-2 and lse_err < 5e-3})
                print(rows[-1]["impl"], D, N, causal, f"err {err:.2e}", f"{med:.0f} us",
                      f"{rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                try:
                    med, lo, hi = _time(lambda: _sdpa(q, k, v, causal, backend), args.reps)
                except RuntimeError as e:  # a backend that declines the shape
                    print(backend.name, D, N, causal, "unavailable:", str(e)[:80])
                    continue
                rows.append({**stamp, "impl": f"sdpa-{backend.name.lower()}", "D": D, "N": N,
                             "B": B, "H": H, "causal": causal, "us_median": med, "us_min": lo,
                             "us_max": hi, "tflops": flops / med / 1e6})
                print(rows[-1]["impl"], D, N, causal, f"{med:.0f} us",
                      f"{rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
        del q, k, v
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
