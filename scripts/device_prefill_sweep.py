"""Device experiment for the next session: Triton prefill launch settings against cuDNN.

Issue 2 wants >= 0.85x cuDNN at N >= 4096; bench run 2 (f758851) measured 0.68-0.81x with
the defaults. This times a few PrefillSettings per case in one run, each output checked
against a float32 SDPA computation on a slice first, and prints x cuDNN per variant.
Predictions to check (notes/prefill_triton.md): 3 stages at D=128 should help if the
loop is latency-bound (189 registers leave room for a third K/V stage in shared memory);
BLOCK_N=64 halves the S/P registers and may let ptxas overlap more.
Usage on the GPU machine: PYTHONPATH=src python3 scripts/device_prefill_sweep.py [--json P]
"""

import argparse
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from wsattn.kernels import prefill_triton as pt
from wsattn.target import target_of

VARIANTS = {  # name: PrefillSettings fields (BLOCK_M, BLOCK_N, num_warps, num_stages, use_tma,
    # host_desc); None = the defaults
    128: {"default": None, "s3": (128, 128, 8, 3, True), "bn64-s3": (128, 64, 8, 3, True),
          "w4-bn64-s3": (128, 64, 4, 3, True),
          "hd": (128, 128, 8, 2, True, True), "hd-s3": (128, 128, 8, 3, True, True),
          "hd-bn64-s3": (128, 64, 8, 3, True, True),
          "hd-bn64-s4": (128, 64, 8, 4, True, True),
          "hd-m64-bn64-s3": (64, 64, 4, 3, True, True),
          "pointers": (128, 128, 8, 2, False)},
    64: {"default": None, "hd": (128, 128, 8, 3, True, True),
         "hd-s4": (128, 128, 8, 4, True, True),
         "hd-bn64-s4": (128, 64, 8, 4, True, True),
         "w4-bn64-s3": (128, 64, 4, 3, True)},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ns", default="1024,4096,16384")
    args = ap.parse_args()
    target = target_of(torch.device("cuda"))
    rows = []
    for D, variants in VARIANTS.items():
        for N in (int(n) for n in args.ns.split(",")):
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            for causal in (False, True):
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                scale = D ** -0.5
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn_ms = triton.testing.do_bench_cudagraph(
                        lambda: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal), rep=200)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    qt[:1, :2].float(), kt[:1, :2].float(), vt[:1, :2].float(),
                    is_causal=causal).transpose(1, 2)
                for name, tiles in variants.items():
                    s = (pt.default_settings(target, D, q.dtype, causal) if tiles is None
                         else pt.PrefillSettings(*tiles))
                    fn = lambda: pt.prefill(q, k, v, None, None, 0, 0, causal, scale, s)
                    try:
                        out, _ = fn()
                        err = ((out[:1, :, :2].float() - ref).norm() / ref.norm()).item()
                        if not err < 2e-2:
                            raise RuntimeError(f"relative error {err:.2e}")
                        ms = triton.testing.do_bench_cudagraph(fn, rep=200)
                    except Exception as e:  # a variant that does not build or is wrong
                        print(f"D{D} N{N} {'causal' if causal else 'full':6s} {name:12s} "
                              f"FAILED {type(e).__name__}: {str(e)[:160]}")
                        rows.append({"D": D, "N": N, "causal": causal, "variant": name,
                                     "error": str(e)[:500]})
                        continue
                    tflops = flops / ms / 1e9
                    print(f"D{D} N{N} {'causal' if causal else 'full':6s} {name:12s} "
                          f"{tflops:6.1f} TFLOP/s  x cuDNN {cudnn_ms / ms:5.3f}  err {err:.1e}  {s}")
                    rows.append({"D": D, "N": N, "causal": causal, "variant": name,
                                 "tflops": tflops, "x_cudnn": cudnn_ms / ms, "rel_err": err,
                                 "settings": str(s)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
