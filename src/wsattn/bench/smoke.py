"""A CPU smoke run of the wsattn kernels through the Triton interpreter, at small sizes.

    python -m wsattn.bench.smoke

Runs attention, attention_varlen, decode (contiguous and paged) and merge_states with
impl="triton" on CPU tensors, fp16 and fp32 (the interpreter's bf16 dot is wrong), and
compares each with the float64 reference: relative error ||out - ref|| / ||ref|| against
the test suite's tolerances, LSE by max absolute error. Exit status 0 when all pass.

Triton 3.6 reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel (through
``triton.knobs.runtime.interpret``, which looks at the environment on each access), so it
must be set before the kernel modules are imported; it is set here before anything
imports triton, and checked after.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("WSATTN_POISON", "1")  # outputs start as NaN: an unwritten element fails

import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import wsattn  # noqa: E402
from wsattn import reference  # noqa: E402

from wsattn.testing import LSE_TOL, TOL, lse_err, rel_err  # noqa: E402

DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


def _randn(g, dtype, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def cases():
    """(name, dtype, function returning ((out, lse), (ref_out, ref_lse)))"""
    g = torch.Generator().manual_seed(0)

    def attention(B, Sq, Sk, H, HKV, D, causal):
        def run(dtype):
            q = _randn(g, dtype, B, Sq, H, D)
            k, v = _randn(g, dtype, B, Sk, HKV, D), _randn(g, dtype, B, Sk, HKV, D)
            got = wsattn.attention(q, k, v, causal=causal, return_lse=True, impl="triton")
            return got, reference.attention(q, k, v, causal)
        return (f"attention B{B}-Sq{Sq}-Sk{Sk}-H{H}-HKV{HKV}-D{D}-"
                f"{'causal' if causal else 'full'}", run)

    def varlen(lens_q, lens_k, H, HKV, D, causal):
        def run(dtype):
            cq = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32)
            ck = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32)
            q = _randn(g, dtype, sum(lens_q), H, D)
            k, v = _randn(g, dtype, sum(lens_k), HKV, D), _randn(g, dtype, sum(lens_k), HKV, D)
            got = wsattn.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True,
                                          impl="triton")
            return got, reference.attention_varlen(q, k, v, cq, ck, causal)
        return f"attention_varlen q{lens_q}-k{lens_k}-H{H}-HKV{HKV}-D{D}-causal", run

    def decode(lens, T, H, HKV, D, page):
        def run(dtype):
            B, L = len(lens), max(lens)
            q = _randn(g, dtype, B, T, H, D) if T > 1 else _randn(g, dtype, B, H, D)
            seqlens = torch.tensor(lens, dtype=torch.int32)
            if page is None:
                shape, bt = (B, L, HKV, D), None
            else:
                per_seq = -(-L // page)
                shape = (B * per_seq, page, HKV, D)
                bt = torch.randperm(B * per_seq, generator=g).view(B, per_seq).to(torch.int32)
            kc, vc = _randn(g, dtype, *shape), _randn(g, dtype, *shape)
            got = wsattn.decode(q, kc, vc, seqlens, bt, return_lse=True, impl="triton")
            return got, reference.decode(q, kc, vc, seqlens, bt)
        layout = "contiguous" if page is None else f"page{page}"
        return f"decode seqlens{lens}-T{T}-H{H}-HKV{HKV}-D{D}-{layout}", run

    def merge(P, N, D):
        def run(dtype):
            o = _randn(g, dtype, P, N, D)
            s = torch.randn(P, N, generator=g) * 3
            s[0, 1] = s[2, 1] = -math.inf  # parts that saw no key
            s[:, 2] = -math.inf  # a row every part saw nothing of: (0, -inf), never NaN
            got = wsattn.merge_states(o, s, impl="triton")
            return got, reference.merge_states(o, s)
        return f"merge_states P{P}-N{N}-D{D} (with empty parts)", run

    return [
        attention(2, 17, 17, 4, 2, 64, False),
        attention(1, 127, 127, 8, 2, 64, True),
        attention(1, 33, 100, 4, 1, 64, True),  # chunked prefill: q_len < kv_len
        varlen([5, 17, 1], [5, 30, 9], 4, 2, 64, True),
        decode([37, 100], 1, 8, 2, 64, None),
        decode([37, 100], 1, 8, 2, 64, 16),
        decode([20, 50], 3, 8, 1, 64, 16),  # 3 query tokens, GQA 8:1
        merge(3, 10, 64),
    ]


def main(argv=None) -> int:
    import argparse

    import numpy as np
    import triton

    parser = argparse.ArgumentParser(prog="python -m wsattn.bench.smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", metavar="TEXT",
                        help="run only the cases whose name contains TEXT")
    args = parser.parse_args(argv)

    if not triton.knobs.runtime.interpret:
        print("smoke: TRITON_INTERPRET=1 did not take effect", file=sys.stderr)
        return 2
    print(f"wsattn smoke run: Triton {triton.__version__} interpreter on CPU, "
          f"torch {torch.__version__}")
    from .._triton_compat import patch_interpreter_device_calls, patch_interpreter_for_numpy_2_4

    patch_interpreter_device_calls()
    if patch_interpreter_for_numpy_2_4():
        print(f"(numpy {np.__version__}: Triton 3.6's interpreter patched to index scalars the "
              "way numpy >= 1.25 asks for, triton-lang/triton#9171)")
    failures = 0
    selected = [(n, r) for n, r in cases() if not args.only or args.only in n]
    if not selected:
        print(f"smoke: no case name contains {args.only!r}", file=sys.stderr)
        return 2
    for name, run in selected:
        for dname, dtype in DTYPES.items():
            t0 = time.perf_counter()
            try:
                (out, lse), (ref, ref_lse) = run(dtype)
            except Exception as e:  # report every case, not only the first broken one
                failures += 1
                msg = str(e).strip().splitlines()
                why = f"{type(e).__name__}: {msg[0] if msg else ''}"
                print(f"FAIL  {name:<58} {dname}  {why}"[:240])
                continue
            err, lerr = rel_err(out, ref), lse_err(lse, ref_lse)
            ok = err <= TOL[dname] and lerr <= LSE_TOL[dname]
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'}  {name:<58} {dname}  rel err {err:.2e} "
                  f"(tol {TOL[dname]:.0e})  lse err {lerr:.1e}  {time.perf_counter() - t0:5.1f} s")
    print(f"{'all passed' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
