"""Host cost of one call of each public entry point (device helper, not part of CI).

    python3 scripts/device_host_overhead.py [--profile]

Small shapes, so the device finishes long before the host has enqueued the next call:
the time per call is then what the host spends (Python, validation, dispatch, Triton's
launcher). With --profile, cProfile's top functions for each entry point.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import wsattn


def per_call_us(fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    q, k, v = (torch.randn(1, 256, h, 128, device=dev, dtype=bf) for h in (32, 8, 8))
    qd = torch.randn(1, 32, 128, device=dev, dtype=bf)
    kc, vc = (torch.randn(1, 1024, 8, 128, device=dev, dtype=bf) for _ in range(2))
    kp, vp = (torch.randn(16, 64, 8, 128, device=dev, dtype=bf) for _ in range(2))
    lens = torch.tensor([1024], dtype=torch.int32, device=dev)
    table = torch.arange(16, dtype=torch.int32, device=dev).view(1, -1)
    o = torch.randn(2, 16, 32, 128, device=dev)
    lse = torch.randn(2, 16, 32, device=dev)
    entries = {
        "attention gluon causal lse": lambda: wsattn.attention(q, k, v, True, return_lse=True,
                                                               impl="gluon"),
        "attention triton causal lse": lambda: wsattn.attention(q, k, v, True, return_lse=True,
                                                                impl="triton"),
        "attention auto causal": lambda: wsattn.attention(q, k, v, True),
        "decode contiguous validate=False": lambda: wsattn.decode(qd, kc, vc, lens, validate=False),
        "decode contiguous validate=True": lambda: wsattn.decode(qd, kc, vc, lens),
        "decode paged validate=False": lambda: wsattn.decode(qd, kp, vp, lens, table,
                                                             validate=False),
        "merge_states": lambda: wsattn.merge_states(o, lse),
        "torch.add (floor of a launch)": lambda: torch.add(o, o),
    }
    for name, fn in entries.items():
        print(f"{name:36s} {per_call_us(fn):9.1f} us/call (host)", flush=True)
    if args.profile:
        for name in ("attention gluon causal lse", "attention triton causal lse",
                     "decode contiguous validate=False", "merge_states"):
            fn = entries[name]
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(100):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            print(f"\n=== {name}: 100 calls ===")
            pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
