"""Host time of one eager call of the public entry points, on the GPU.

    python3 -m wsattn.bench.host [--json PATH] [--calls 200] [--profile]

Each entry is called `--calls` times back to back after a warm-up, with
torch.cuda.synchronize() before and after the whole loop and none inside it. `host_us` is
the time.perf_counter() span of the Python calls divided by their number: what the host
spends enqueueing one call (validation, dispatch, Triton's launcher). `wall_us` runs to the
synchronize after the loop; where it is close to `host_us` the loop was host bound, which is
what these shapes are chosen for (the device finishes a call before the next is enqueued),
so the figure is the host's and not the GPU's. A call that reads a tensor on the host
(`validate=True`) synchronizes inside the call, so its host time includes the wait.

The decode rows are the serving shape B=8, Hq 32 / Hkv 8 / D 128, L 4096, contiguous and
paged (pages of 16); the varlen row packs 8 sequences of 256-1024 tokens, causal, with the
max lengths given. Each is timed with the default arguments and with `validate=True`.
Rows are stamped like `wsattn bench`'s and written only where --json says.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

import wsattn

NO_GPU = ("python -m wsattn.bench.host times eager calls on a CUDA GPU, and this machine has "
          "none visible to torch.")


def per_call_us(fn, calls: int, sync=None, warmup: int = 5) -> tuple[float, float]:
    """(host us, wall us) per call over `calls` back-to-back calls of fn after a warm-up."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls


def entries(device, dtype=torch.bfloat16, B=8, L=4096, Hq=32, Hkv=8, D=128, page=16,
            varlen_lens=(256, 1024, 512, 768, 300, 1000, 640, 900)) -> dict:
    """name -> (shape fields for the row, a zero-argument call). Small sizes on CPU let a
    test run every call through the reference."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    qd = randn(B, Hq, D)
    kc, vc = randn(B, L, Hkv, D), randn(B, L, Hkv, D)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    n_pages = B * (L // page)
    kp, vp = randn(n_pages, page, Hkv, D), randn(n_pages, page, Hkv, D)
    perm = torch.randperm(n_pages, device=device, generator=g)
    table = perm.view(B, L // page).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(varlen_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    T, maxlen = int(cu[-1]), max(varlen_lens)
    qv, kv, vv = randn(T, Hq, D), randn(T, Hkv, D), randn(T, Hkv, D)
    q, k, v = randn(1, 256, Hq, D), randn(1, 256, Hkv, D), randn(1, 256, Hkv, D)
    o, lse = randn(2, 16, Hq, D).float(), randn(2, 16, Hq).float()
    decode_shape = {"B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D}
    varlen_shape = {"B": len(varlen_lens), "T": T, "Hq": Hq, "Hkv": Hkv, "D": D, "causal": True}
    out = {}
    for validate in (None, True):
        kw = {} if validate is None else {"validate": True}
        tag = "default" if validate is None else "validate=True"
        out[f"decode contiguous, {tag}"] = (
            {**decode_shape, "layout": "contiguous", "validate": tag},
            lambda kw=kw: wsattn.decode(qd, kc, vc, lens, **kw))
        out[f"decode paged{page}, {tag}"] = (
            {**decode_shape, "layout": f"paged{page}", "validate": tag},
            lambda kw=kw: wsattn.decode(qd, kp, vp, lens, table, **kw))
        out[f"attention_varlen causal, {tag}"] = (
            {**varlen_shape, "validate": tag},
            lambda kw=kw: wsattn.attention_varlen(qv, kv, vv, cu, cu, maxlen, maxlen, True, **kw))
    out["attention causal (auto)"] = (
        {"B": 1, "S": 256, "Hq": Hq, "Hkv": Hkv, "D": D, "causal": True},
        lambda: wsattn.attention(q, k, v, True))
    out["merge_states"] = ({"P": 2, "N": 16 * Hq, "D": D}, lambda: wsattn.merge_states(o, lse))
    out["torch.add (floor of one launch)"] = ({}, lambda: torch.add(o, o))
    return out


def measure(calls: int = 200, device="cuda") -> list[dict]:
    """One row per entry: the shape, host_us and wall_us per call."""
    from .env import stamp

    st = stamp(device)
    rows = []
    for name, (shape, fn) in entries(torch.device(device)).items():
        host, wall = per_call_us(fn, calls)
        rows.append({**st, "bench": "host", "call": name, **shape, "calls": calls,
                     "host_us": round(host, 1), "wall_us": round(wall, 1)})
        print(f"{name:40s} host {host:8.1f} us/call   wall {wall:8.1f} us/call", flush=True)
    return rows


def profile(fn, calls: int = 100, top: int = 22) -> None:
    """cProfile's top functions by own time over `calls` calls: where the host time goes."""
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wsattn.bench.host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="write the rows there (default: no file)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per entry")
    ap.add_argument("--profile", action="store_true",
                    help="then cProfile the default decode and varlen calls")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    rows = measure(args.calls)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"rows written to {path}")
    if args.profile:
        calls = entries(torch.device("cuda"))
        for name in ("decode contiguous, default", "decode paged16, default",
                     "attention_varlen causal, default"):
            print(f"\n=== {name}: 100 calls ===")
            profile(calls[name][1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
