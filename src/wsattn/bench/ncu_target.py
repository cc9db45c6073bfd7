"""The program that Nsight Compute profiles: one prefill launch of one implementation.

    ncu --nvtx --nvtx-include "prof/" --set full ... \
        python3 -m wsattn.bench.ncu_target {gluon,triton,cudnn} [--n 4096] [--d 128] [--causal]

(`scripts/device.sh ncu` runs it so.) Builds bf16 inputs of the bench's shapes (B * N = 16k
tokens, H * D = 2048), checks the output against SDPA's math backend in float32 once, warms
up three calls, then runs one more inside an NVTX range "prof", which `--nvtx-include prof/`
selects, so only that launch is profiled whatever else (random fills, the check) launched.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import wsattn


def main():
    ap = argparse.ArgumentParser(prog="python3 -m wsattn.bench.ncu_target")
    ap.add_argument("impl", choices=["gluon", "triton", "cudnn"])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    B, H = 16384 // a.n, 2048 // a.d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, a.n, H, a.d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    if a.impl == "cudnn":
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal).transpose(1, 2)
    else:
        def run():
            return wsattn.attention(q, k, v, a.causal, impl=a.impl)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)),
                                         is_causal=a.causal).transpose(1, 2)
    err = ((run().float() - ref).norm() / ref.norm()).item()
    print(f"{a.impl} B{B} N{a.n} H{H} D{a.d} causal={a.causal}: rel err {err:.2e}")
    assert err < 2e-2, err
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    run()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
