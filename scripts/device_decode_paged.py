"""Device experiment: paged decode settings against the contiguous cache (same run).

Prints one line per (shape, variant): median us from CUDA-graph replay, ratio to contiguous,
and the relative error against a float32 torch computation (checked before timing).
Usage on the GPU machine: PYTHONPATH=src python3 scripts/device_decode_paged.py [--json P]
"""

import argparse
import json
from dataclasses import replace

import torch
import triton

from wsattn.kernels import decode_triton as dt
from wsattn.target import target_of


def to_paged(cache, page, gen, order="random"):
    """The cache cut into pages placed at random (the bench's layout) or in order (pages
    of a sequence adjacent: the contiguous layout seen through a block table)."""
    B, L, H, D = cache.shape
    n = B * (L // page)
    perm = (torch.randperm(n, device=cache.device, generator=gen) if order == "random"
            else torch.arange(n, device=cache.device))
    pages = torch.empty(n, page, H, D, dtype=cache.dtype, device=cache.device)
    pages[perm] = cache.reshape(n, page, H, D)
    return pages, perm.view(B, L // page).to(torch.int32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="64x8192,1x131072", help="BxL,...")
    ap.add_argument("--splits", default="", help="extra num_splits values to try (paged 16)")
    args = ap.parse_args()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B, L in (tuple(map(int, x.split("x"))) for x in args.shapes.split(",")):
        Hq, Hkv, D = 32, 8, 128
        q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        scale = D ** -0.5
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
            enable_gqa=True).transpose(1, 2)
        base = dt.default_settings(target_of(q.device), batch=B, kv_heads=Hkv, head_dim=D,
                                   capacity=L, dtype=q.dtype, paged=False, query_rows=Hq // Hkv)
        variants = [("contiguous", None, base)]
        for page in (16, 64):
            pb = dt.default_settings(target_of(q.device), batch=B, kv_heads=Hkv, head_dim=D,
                                     capacity=L, dtype=q.dtype, paged=True, query_rows=Hq // Hkv)
            variants.append((f"page{page}-default", page, pb))
            # Triton 3.6 keeps 2 K/V buffers for paged loads at 5-6 stages, 3 (as the
            # contiguous cache at 4) from 7 on (sm_90 TTGIR; 105 KB, 2 programs per SM)
            for stages in (5, 7, 8):
                variants.append((f"page{page}-stages{stages}", page, replace(pb, num_stages=stages)))
            if page == 16:
                variants.append(("page16-inorder-stages7", (16, "inorder"), replace(pb, num_stages=7)))
                variants.append(("page16-BN32-stages7", 16, replace(pb, BLOCK_N=32, num_stages=7)))
                variants.append(("page16-BN16-stages8", 16, replace(pb, BLOCK_N=16, num_stages=8)))
                # the split's block-table entries read once (bt_preload): at 4 stages the
                # pipeliner keeps 3 K/V buffers like the contiguous cache (sm_90 TTGIR)
                for stages in (4, 5):
                    variants.append((f"page16-preload-stages{stages}", 16,
                                     replace(pb, num_stages=stages, bt_preload=True)))
                for n in filter(None, args.splits.split(",")):
                    for stages in (5, 7):
                        variants.append((f"page16-splits{n}-stages{stages}", 16,
                                         replace(pb, num_splits=int(n), num_stages=stages)))
        contiguous_us = None
        for name, page, s in variants:
            if page is None:
                kc, vc, table = k, v, None
            else:
                page, order = page if isinstance(page, tuple) else (page, "random")
                kc, table = to_paged(k, page, torch.Generator(device="cuda").manual_seed(1), order)
                vc, _ = to_paged(v, page, torch.Generator(device="cuda").manual_seed(1), order)
            fn = lambda: dt.decode(q, kc, vc, seqlens, table, scale, 0, settings=s)
            try:
                out, _ = fn()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise RuntimeError(f"relative error {err:.2e}")
                us = triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3
            except Exception as e:  # a variant that does not build or is wrong is reported
                print(f"B{B}-L{L} {name:24s} FAILED {type(e).__name__}: {str(e)[:200]}")
                rows.append({"B": B, "L": L, "variant": name, "error": str(e)[:500]})
                continue
            contiguous_us = us if name == "contiguous" else contiguous_us
            tbps = 2 * B * L * Hkv * D * 2 / (us * 1e-6) / 1e12
            print(f"B{B}-L{L} {name:24s} {us:8.1f} us {tbps:5.2f} TB/s  x contiguous "
                  f"{contiguous_us / us:5.3f}  err {err:.1e}  {s}")
            rows.append({"B": B, "L": L, "variant": name, "us": us, "tbps": tbps,
                         "x_contiguous": contiguous_us / us, "rel_err": err, "settings": str(s)})
        del k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
