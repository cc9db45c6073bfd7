"""Device experiment: Triton prefill launch settings against cuDNN, side by side.

Times a few PrefillSettings per case in one run, each output checked against a float32 SDPA
computation on a slice first, and prints x cuDNN per variant (16k tokens a batch, 2048 / D
heads, bf16). The built-in variants are the ones that decided the tile table
(notes/prefill_triton.md); --variant adds or replaces them.
Usage on the GPU machine: PYTHONPATH=src python3 scripts/device_prefill_sweep.py [--json P]
  [--ds 64] [--ns 1024] [--causal causal|full|both]
  [--variant NAME=BLOCK_M,BLOCK_N,num_warps,num_stages[,use_tma[,host_desc]] ...]
  (with --variant, only "default" and the named variants run)
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
    ap.add_argument("--ds", default="128,64", help="head dims (of 128, 64)")
    ap.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC",
                    help="BLOCK_M,BLOCK_N,num_warps,num_stages[,use_tma[,host_desc]] "
                         "(0/1 flags; default 1, 1)")
    args = ap.parse_args()
    ds = [int(d) for d in args.ds.split(",")]
    if any(d not in VARIANTS for d in ds):
        ap.error(f"--ds takes head dims of {sorted(VARIANTS)}, got {args.ds}")
    if args.variant:
        named = {}
        for item in args.variant:
            name, _, spec = item.partition("=")
            fields = [int(f) for f in spec.split(",")] if spec else []
            if not name or not 4 <= len(fields) <= 6:
                ap.error(f"--variant takes NAME=BLOCK_M,BLOCK_N,num_warps,num_stages"
                         f"[,use_tma[,host_desc]], got {item!r}")
            fields += [1, 1][len(fields) - 4:]
            named[name] = tuple(fields[:4]) + tuple(bool(f) for f in fields[4:])
        for d in ds:
            VARIANTS[d] = {"default": None, **named}
    causals = {"both": (False, True), "causal": (True,), "full": (False,)}[args.causal]
    target = target_of(torch.device("cuda"))
    rows = []
    for D in ds:
        variants = VARIANTS[D]
        for N in (int(n) for n in args.ns.split(",")):
            B, H = 16384 // N, 2048 // D
            q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            for causal in causals:
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
                    s = (pt.default_settings(target, D, q.dtype, causal, N) if tiles is None
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
