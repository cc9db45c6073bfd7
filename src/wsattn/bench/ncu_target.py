"""The program that Nsight Compute profiles: one call of one implementation.

    ncu --nvtx --nvtx-include "prof/" --set full ... \
        python3 -m wsattn.bench.ncu_target {gluon,triton,cudnn} [--n 4096] [--d 128] [--causal]
    ... python3 -m wsattn.bench.ncu_target chunked:COLUMN [--d 64] [--prefix 0] [--page 64]

(`scripts/device.sh ncu` runs it so.) Fixed length: bf16 inputs of the prefill bench's
shapes (B * N = 16k tokens, H * D = 2048), the output checked against SDPA's math backend in
float32 once. ``chunked:COLUMN``: one column of `wsattn bench chunked` (e.g.
``chunked:gluon-paged``, ``chunked:gluon-contiguous``, ``chunked:wsattn``) on that bench's
shape (8 chunks of 2048 queries after a prefix, GQA 32/8, causal), built and checked
against float64 by the bench's own code, so the profiled call is the timed one. Then three
warm-up calls and one more inside an NVTX range "prof", which `--nvtx-include prof/`
selects, so only that call's launches are profiled (a chunked call's tile table, gather
and attention each appear) whatever else (random fills, the check) launched.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import wsattn
from wsattn.bench import chunked

FIXED = ("gluon", "triton", "cudnn")
CHUNKED = "chunked:"


def chunked_case(column: str, d: int, prefix: int, page: int, batch: int,
                 chunk: int) -> chunked.ChunkedCase:
    """The bench's case a ``chunked:COLUMN`` target runs: paged at ``page`` unless the
    column reads contiguous keys. Raises ValueError for a column the bench does not have."""
    if column not in chunked.IMPLS:
        raise ValueError(f"chunked column must be one of {chunked.IMPLS}, got {column!r}")
    contiguous = column.endswith("-contiguous")
    return chunked.ChunkedCase(prefix, d, None if contiguous else page, B=batch, chunk=chunk)


def _fixed(a):
    """(run, its relative error against SDPA's math in float32, a label): one fixed-length
    call."""
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
    return run, err, f"{a.impl} B{B} N{a.n} H{H} D{a.d} causal={a.causal}"


def _chunked(a):
    """(run, its relative error against float64, the case id): one `wsattn bench chunked`
    column, built and checked as the bench does."""
    case = chunked_case(a.impl[len(CHUNKED):], a.d, a.prefix, a.page, a.batch, a.chunk)
    inp = chunked.make_inputs(case, torch.device("cuda"))
    cache = None if case.page is None else chunked.paged_cache(case, inp)
    first, run, _ = chunked._call(case, a.impl[len(CHUNKED):], inp, cache)
    ref = chunked.reference_rows(case, inp)
    got = chunked.checked_rows(case, first()).double()
    err = ((got - ref).norm() / ref.norm()).item()
    return run, err, case.id


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m wsattn.bench.ncu_target")
    ap.add_argument("impl", help=f"one of {FIXED} (fixed length), or {CHUNKED}COLUMN, a "
                                 f"column of `wsattn bench chunked` ({', '.join(chunked.IMPLS)})")
    ap.add_argument("--n", type=int, default=4096, help="fixed length: tokens a sequence")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true", help="fixed length (chunked: always)")
    ap.add_argument("--prefix", type=int, default=0, help="chunked: cached keys a sequence")
    ap.add_argument("--page", type=int, default=64, help="chunked: the cache's page size")
    ap.add_argument("--batch", type=int, default=chunked.BATCH, help="chunked: sequences")
    ap.add_argument("--chunk", type=int, default=chunked.CHUNK, help="chunked: new queries")
    a = ap.parse_args(argv)
    if a.impl.startswith(CHUNKED):
        run, err, what = _chunked(a)
    elif a.impl in FIXED:
        run, err, what = _fixed(a)
    else:
        ap.error(f"impl must be one of {FIXED} or {CHUNKED}COLUMN, got {a.impl!r}")
    print(f"{what}: rel err {err:.2e}")
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
