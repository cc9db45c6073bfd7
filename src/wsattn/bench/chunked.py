"""`wsattn bench chunked`: chunked prefill, one chunk of new queries per sequence against
keys already in a paged KV cache, against the same attention with the keys contiguous
(the target: >= 0.95x the contiguous attention, chunk 2048, prefix 0-32k, page 16 and 64).

Shapes: bf16, Hq 32, Hkv 8, D 128 and 64, one chunk of 2048 queries per sequence
(``--chunked-chunk``), B = 8 sequences (16k chunk tokens a batch; ``--chunked-batch``), a
prefix of P in {0, 2k, 8k, 32k} keys before the chunk. Each sequence has P + 2048 keys,
the chunk's own K/V included (appended before the call, as a serving engine does). Causal, bottom-right
aligned: query i of a chunk sees the prefix and chunk keys 0..i.

Columns (``impl``):

* ``wsattn`` / ``wsattn-contiguous``: :func:`wsattn.attention_paged` /
  :func:`wsattn.attention_varlen` as a user calls them (``impl="auto"``, ``gather`` left
  to the dispatcher), the default paths side by side; ``wsattn``'s ``ratio_contiguous``
  is against ``wsattn-contiguous``.
* ``triton-paged``: :func:`wsattn.attention_paged` (``impl="triton"``, ``gather=False``:
  the kernel that reads the cache in place) over a cache of pages of 16 or of 64
  tokens, one row per page size (the case id names it). Each
  sequence's pages are a random permutation of the cache's pages (seeded per case), so
  the kernel reads scattered pages as it would in a serving engine, not consecutive ones.
* ``triton-contiguous``: :func:`wsattn.attention_varlen` (``impl="triton"``) on the same
  queries and the same keys stored contiguously, packed with ``cu_seqlens_k``: the
  issue's reference point.
* ``gluon-contiguous``: :func:`wsattn.attention_varlen` with ``impl="gluon"`` (the sm_90
  warp-specialized kernel's varlen build); "not available" with the dispatcher's reason
  off sm_90.
* ``gluon-one-consumer-contiguous``: the same call on the Gluon kernel's one-consumer
  build (``prefill_gluon.ONE_CONSUMER``: 64-row tiles, several CTAs an SM) whatever the
  length rule picks, asked for by name: ``gluon-contiguous[one_consumer]`` below.
* ``gluon-paged[SPEC]`` / ``gluon-contiguous[SPEC]`` (``--chunked-gluon-settings SPEC``):
  the Gluon kernel's paged build in place / varlen build on the contiguous keys, as
  ``prefill_gluon.settings_for`` makes it with the SPEC's overrides (``FIELD=VALUE,...``,
  or ``default`` / ``one_consumer``: the two builds the length rules choose between),
  whatever the rules pick, so two builds of a route are timed side by side; the paged
  one's ``ratio_contiguous`` is against the contiguous one of the same SPEC.
* ``triton-gather`` / ``gluon-gather``: :func:`wsattn.attention_paged` with ``gather=True``
  and ``impl="triton"`` / ``"gluon"``: each sequence's keys copied out of the same paged
  cache into a packed buffer (one launch, ``kernels/paged_gather.py``), then that
  backend's varlen kernel; timed with the copy. Their ``ratio_contiguous`` is against the
  same backend's contiguous column ("the same attention with a contiguous prefix").
* ``wsattn-append``: the ``wsattn`` call with the chunk's own keys and values given as
  ``k_new`` / ``v_new`` (the serving call: the append into the cache, one launch, timed
  with the attention; the rows it writes hold those values already, so every call
  writes the same bits); ``ratio_contiguous`` against ``wsattn-contiguous``, which has
  no append to do.
* ``gluon-paged``: :func:`wsattn.attention_paged` with ``impl="gluon"``, ``gather=False``
  (the Gluon kernel's paged build, ``prefill_gluon.prefill_paged``: K/V read from the
  cache's pages by TMA in place, no copy), "not available" with the dispatcher's reason
  off sm_90 or for a page size it does not take; its ``ratio_contiguous`` is against
  ``gluon-contiguous``.
* ``flashinfer-paged``: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (backend
  "auto", NHD layout, causal: bottom-right aligned as ours) on the same paged cache and
  page table, planned outside the timing; "not available" where flashinfer does not
  import or its wheel lacks the module (JIT off, as in :mod:`wsattn.bench.peers`).

Every column's output is checked before it is timed: the first and the last sequence of
the batch against a float64 reference computed from the contiguous keys (so a page
table built wrong fails too), within ``wsattn.testing.TOL``; the checked call's outputs
are NaN-poisoned (the API takes no ``out``; ``WSATTN_POISON`` fills the kernel's own
allocation), so an element never written fails. A failed check is recorded, not timed.

Causal by default (what serving engines send); ``--chunked-masks full`` (or both) adds the
same shapes without a mask, rows with ``causal`` False and ids ending ``-full-<dtype>``.

Per row: FLOPs = 4 x D x Hq x the (query, key) pairs each chunk attends, where query i of
a chunk sees P + i + 1 keys (the causal triangle only over the chunk's diagonal block;
without a mask all P + chunk);
TFLOP/s of the median time; ``frac_matmul`` = that over the bf16 matmul ceiling measured
in the same run; on paged rows ``ratio_contiguous`` = the contiguous column's time / the
paged row's time for the same shape, paired by round (the columns of a shape that pass
their check are timed together in alternating rounds, and the ratio is the median over
the rounds of one round's two samples; each row keeps its samples, ``samples_ms``), and the
issue's target (0.95) as met / missed, never asserted. Time is a CUDA-graph replay
(``wsattn.bench.timing.cuda_timer``, ``time_interleaved``); the calls give
``max_seqlen_q`` and pass no ``validate``, so no host read happens in them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from dataclasses import dataclass

import torch

from .cases import DTYPES, tflops
from .timing import _sync, release
from .gemv import write
from .runners import NotAvailable, parse_gluon_settings
from .report import fmt, paired_ratio, status_text, target_text, timing_fields

PREFIXES = (0, 2048, 8192, 32768)
MASKS = ("causal",)
MASKS_ALL = ("causal", "full")
PAGES = (16, 64)
DIMS = (128, 64)
CHUNK = 2048
BATCH = 8  # chunks of 2048: 16k chunk tokens a batch, as the prefill benchmark
HQ, HKV = 32, 8
IMPLS = ("wsattn", "wsattn-append", "triton-paged", "triton-gather", "gluon-gather",
         "gluon-paged", "wsattn-contiguous", "triton-contiguous", "gluon-contiguous",
         "flashinfer-paged", "gluon-one-consumer-contiguous")
# asked for by name only: one build of the Gluon kernel beside the rule's own columns
BY_NAME = ("gluon-one-consumer-contiguous",)
DEFAULT_IMPLS = tuple(i for i in IMPLS if i not in BY_NAME)


def is_wsattn(impl: str) -> bool:
    """Whether a column is wsattn's own (its failure exits 1): every column but the
    flashinfer peer, the Gluon ones and the [SPEC] variants included."""
    return not impl.startswith("flashinfer")

TARGET_RATIO = 0.95  # the issue's: paged time >= 0.95x as fast as contiguous

ROW_FIELDS = ("op", "impl", "case", "layout", "page_size", "dtype", "causal", "B", "chunk",
              "prefix", "Sk", "Hq", "Hkv", "D", "flops", "status", "reason", "note",
              "rel_err", "tol", "check_passed", "check_slice", "median_ms", "q20_ms",
              "q80_ms", "reps", "calls", "timing", "samples_ms", "samples_t", "tflops",
              "matmul_tflops", "frac_matmul", "ratio_contiguous", "target_ratio", "target_met")


@dataclass(frozen=True)
class ChunkedCase:
    """B sequences, each a chunk of ``chunk`` new queries after ``prefix`` cached keys;
    ``page`` is the cache's page size, or None for contiguous keys."""
    prefix: int
    D: int
    page: int | None
    B: int = BATCH
    chunk: int = CHUNK
    Hq: int = HQ
    Hkv: int = HKV
    dtype: str = "bf16"
    op: str = "chunked"
    causal: bool = True  # bottom-right aligned; False: every query sees every key

    @property
    def layout(self) -> str:
        return "contiguous" if self.page is None else f"page{self.page}"

    @property
    def id(self) -> str:
        mask = "" if self.causal else "-full"
        return (f"chunked-B{self.B}-C{self.chunk}-P{self.prefix}-H{self.Hq}-HKV{self.Hkv}-"
                f"D{self.D}-{self.layout}{mask}-{self.dtype}")

    @property
    def shape(self) -> tuple:
        """What the paged and contiguous cases of one comparison share."""
        return (self.prefix, self.D, self.B, self.chunk, self.Hq, self.Hkv, self.dtype,
                self.causal)

    @property
    def seqlen_k(self) -> int:
        return self.prefix + self.chunk

    def pairs(self) -> int:
        """(query, key) pairs one sequence attends: query i sees prefix + i + 1 keys
        (causal), else all prefix + chunk."""
        c = self.chunk
        if not self.causal:
            return c * (self.prefix + c)
        return c * self.prefix + c * (c + 1) // 2

    def flops(self) -> int:
        """4 x D x Hq per pair (QK^T and PV, 2 FLOPs a multiply-add), over the batch."""
        return 4 * self.D * self.Hq * self.B * self.pairs()


def chunked_cases(prefixes=PREFIXES, pages=PAGES, dims=DIMS, batch: int = BATCH,
                  chunk: int = CHUNK, dtype: str = "bf16", hq: int = HQ,
                  hkv: int = HKV, masks=MASKS) -> list[ChunkedCase]:
    """Per (mask, D, prefix): the contiguous case, then one paged case per page size.
    masks: "causal" (the serving case, bottom-right aligned) and / or "full"."""
    for m in masks:
        if m not in MASKS_ALL:
            raise ValueError(f"mask must be one of {MASKS_ALL}, got {m!r}")
    for name, values, low in (("prefix", prefixes, 0), ("page", pages, 1), ("dim", dims, 1)):
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    for name, v in (("batch", batch), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return [ChunkedCase(p, d, page, batch, chunk, hq, hkv, dtype, causal=m == "causal")
            for m in masks for d in dims for p in prefixes for page in (None, *pages)]


def case_impls(case: ChunkedCase, impls) -> list[str]:
    """The columns a case runs: triton-paged on paged cases, the contiguous ones on the
    contiguous case (a SPEC column by its name before the bracket)."""
    if case.page is None:
        return [i for i in impls if i.split("[")[0].endswith("-contiguous")]
    return [i for i in impls if i.split("[")[0].endswith(("-paged", "-gather"))
            or i in ("wsattn", "wsattn-append")]


def _spec_of(impl: str) -> str:
    # "gluon-paged[CONSUMERS=1,BLOCK_N=64]" -> "CONSUMERS=1,BLOCK_N=64"
    return impl[impl.index("[") + 1:-1]


def gluon_overrides(spec: str, head_dim: int) -> dict:
    """A --chunked-gluon-settings SPEC as settings_for overrides at this head dim:
    "default" (none: the default build), "one_consumer" (prefill_gluon.ONE_CONSUMER of
    the head dim), else FIELD=VALUE[,...] (ValueError naming what is wrong)."""
    if spec == "default":
        return {}
    if spec == "one_consumer":
        from wsattn.kernels.prefill_gluon import ONE_CONSUMER
        return dict(ONE_CONSUMER[head_dim])
    if "=" not in spec:
        raise ValueError(f"--chunked-gluon-settings: each SPEC is FIELD=VALUE[,FIELD=VALUE...], "
                         f"default or one_consumer, got {spec!r}")
    return parse_gluon_settings(spec, "--chunked-gluon-settings")


def parse_settings(spec: str):
    """'BLOCK_M,BLOCK_N,num_warps,num_stages[,use_tma]' -> a PagedPrefillSettings
    (ValueError naming what is wrong)."""
    from wsattn.kernels.prefill_paged import PagedPrefillSettings
    parts = spec.split(",")
    if len(parts) not in (4, 5) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--chunked-settings: each SPEC is BLOCK_M,BLOCK_N,num_warps,"
                         f"num_stages[,use_tma] (ints; use_tma 0 or 1), got {spec!r}")
    v = [int(p) for p in parts]
    if any(x <= 0 for x in v[:4]) or any(x & (x - 1) for x in v[:3]) or \
            (len(v) == 5 and v[4] not in (0, 1)):
        raise ValueError(f"--chunked-settings {spec!r}: BLOCK_M, BLOCK_N, num_warps powers "
                         "of two, num_stages >= 1, use_tma 0 or 1")
    return PagedPrefillSettings(*v[:4], use_tma=len(v) == 5 and v[4] == 1)


# --------------------------------------------------------------------------- rows

def make_row(stamp: dict, case: ChunkedCase, impl: str, status: str, *, reason=None,
             note=None, rel_err=None, tol=None, check_slice=None, timing=None,
             samples=None, stamps=None, matmul_tflops=None) -> dict:
    """One row; every row has the keys of ROW_FIELDS (None where they do not apply).
    samples: the timing's samples in round order (``samples_ms``), which add_ratios pairs
    with the contiguous column's."""
    row = dict(stamp)
    row.update({k: None for k in ROW_FIELDS})
    row.update(op=case.op, impl=impl, case=case.id, layout=case.layout, page_size=case.page,
               dtype=case.dtype, causal=case.causal, B=case.B, chunk=case.chunk, prefix=case.prefix,
               Sk=case.seqlen_k, Hq=case.Hq, Hkv=case.Hkv, D=case.D, flops=case.flops(),
               status=status, reason=reason, note=note, rel_err=rel_err, tol=tol,
               check_passed=None if rel_err is None else rel_err <= tol,
               check_slice=check_slice, matmul_tflops=matmul_tflops,
               target_ratio=TARGET_RATIO if case.page is not None else None)
    if timing is not None:
        row.update(timing_fields(timing, samples, stamps),
                   tflops=tflops(case.flops(), timing.median_ms))
        if matmul_tflops:
            row["frac_matmul"] = row["tflops"] / matmul_tflops
    return row


def _shape_key(row) -> tuple:
    return tuple(row[k] for k in ("prefix", "D", "B", "chunk", "Hq", "Hkv", "dtype", "causal"))


def add_ratios(rows: list[dict]) -> list[dict]:
    """ratio_contiguous (the contiguous column's time / this row's, same shape, paired by
    round where both were timed in one loop: ``paired_ratio``; the column of the row's
    backend: gluon-contiguous for the gluon columns, wsattn-contiguous for wsattn,
    triton-contiguous for wsattn's Triton columns; none for the flashinfer peer, which has no
    contiguous column of its own) and the target's met / missed on the timed paged rows,
    in place."""
    base = {(r["impl"], _shape_key(r)): r for r in rows if r.get("op") == "chunked"
            and r["impl"].split("[")[0].endswith("-contiguous") and r["status"] == "ok"}
    for r in rows:
        if r.get("op") != "chunked" or r["page_size"] is None or r["status"] != "ok":
            continue
        if r["impl"].startswith("flashinfer"):
            continue  # a peer: no contiguous column of its own to set it against
        backend = "wsattn" if r["impl"] in ("wsattn", "wsattn-append") else \
            "gluon" if r["impl"].startswith("gluon-") else "triton"
        # a gluon-paged[SPEC] column against gluon-contiguous[SPEC] (the same build)
        spec = f"[{_spec_of(r['impl'])}]" if r["impl"].startswith("gluon-paged[") else ""
        ref = base.get((f"{backend}-contiguous{spec}", _shape_key(r)))
        if ref is not None:
            r["ratio_contiguous"] = paired_ratio(ref, r)
            r["target_met"] = "met" if r["ratio_contiguous"] >= TARGET_RATIO else "missed"
    return rows


# --------------------------------------------------------------------------- GPU work

@dataclass
class Inputs:
    """One shape's tensors: q [B*chunk, Hq, D] packed; k, v [B*Sk, Hkv, D] contiguous;
    cu_q, cu_k int32 [B+1]; seqlens_k int32 [B]; scale."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    seqlens_k: torch.Tensor
    scale: float


def make_inputs(case: ChunkedCase, device) -> Inputs:
    """Random queries and keys of the case's shape (seeded by the shape, so the paged and
    contiguous cases of one comparison see the same numbers)."""
    dt = DTYPES[case.dtype]
    seed = zlib.crc32(repr(case.shape[:-1]).encode())  # both masks see the same numbers
    g = torch.Generator(device=device).manual_seed(seed)
    Sk, B = case.seqlen_k, case.B

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dt)

    q = randn(B * case.chunk, case.Hq, case.D)
    k = randn(B * Sk, case.Hkv, case.D)
    v = randn(B * Sk, case.Hkv, case.D)
    ar = torch.arange(B + 1, dtype=torch.int32, device=device)
    return Inputs(q, k, v, ar * case.chunk, ar * Sk,
                  torch.full((B,), Sk, dtype=torch.int32, device=device),
                  case.D ** -0.5)


def paged_cache(case: ChunkedCase, inp: Inputs):
    """(k_cache, v_cache [num_pages, page, Hkv, D], block_table int32 [B, pages_per_seq])
    holding inp.k / inp.v: each sequence's pages scattered through the cache by a random
    permutation (seeded per case); rows past a sequence's keys in its last page are
    zero and never read."""
    page, B, Sk = case.page, case.B, case.seqlen_k
    per_seq = -(-Sk // page)
    num_pages = B * per_seq
    device = inp.k.device
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(case.id.encode()))
    table = torch.randperm(num_pages, generator=g).view(B, per_seq).to(torch.int32)
    table = table.to(device)
    kc = torch.zeros(num_pages, page, case.Hkv, case.D, dtype=inp.k.dtype, device=device)
    vc = torch.zeros_like(kc)
    pad = per_seq * page - Sk
    for src, dst in ((inp.k, kc), (inp.v, vc)):
        seq = src.view(B, Sk, case.Hkv, case.D)
        if pad:
            seq = torch.nn.functional.pad(seq, (0, 0, 0, 0, 0, pad))
        dst[table.reshape(-1).long()] = seq.reshape(num_pages, page, case.Hkv, case.D)
    return kc, vc, table


def check_sequences(case: ChunkedCase) -> list[int]:
    """The sequences checked against float64: the first and the last."""
    return sorted({0, case.B - 1})


def reference_rows(case: ChunkedCase, inp: Inputs) -> torch.Tensor:
    """float64 outputs of the checked sequences, stacked in their order
    [len(check_sequences) * chunk, Hq, D], from the contiguous keys."""
    from wsattn import reference

    C, Sk = case.chunk, case.seqlen_k
    one = torch.tensor([0, C], dtype=torch.int32)
    onek = torch.tensor([0, Sk], dtype=torch.int32)
    outs = []
    for b in check_sequences(case):
        out, _ = reference.attention_varlen(inp.q[b * C:(b + 1) * C], inp.k[b * Sk:(b + 1) * Sk],
                                            inp.v[b * Sk:(b + 1) * Sk], one.to(inp.q.device),
                                            onek.to(inp.q.device), case.causal, inp.scale)
        outs.append(out)
    return torch.cat(outs)


def checked_rows(case: ChunkedCase, out: torch.Tensor) -> torch.Tensor:
    C = case.chunk
    return torch.cat([out[b * C:(b + 1) * C] for b in check_sequences(case)])


def flashinfer_plan(case: ChunkedCase, inp: Inputs, table) -> dict:
    """Arguments of BatchPrefillWithPagedKVCacheWrapper.plan for the case's page table:
    sequence b owns pages table[b], its last page holding Sk - (pages - 1) * page keys."""
    B, per_seq = table.shape
    device = inp.q.device
    indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * per_seq
    last = torch.full((B,), case.seqlen_k - (per_seq - 1) * case.page, dtype=torch.int32,
                      device=device)
    dtype = DTYPES[case.dtype]
    return dict(qo_indptr=inp.cu_q, paged_kv_indptr=indptr,
                paged_kv_indices=table.reshape(-1).contiguous(), paged_kv_last_page_len=last,
                num_qo_heads=case.Hq, num_kv_heads=case.Hkv, head_dim_qk=case.D,
                page_size=case.page, causal=case.causal, sm_scale=inp.scale, q_data_type=dtype,
                kv_data_type=dtype)


def _flashinfer(case: ChunkedCase, inp: Inputs, cache):
    from .peers import FLASHINFER_MODULE, WORKSPACE_BYTES, _flashinfer_call, import_peer

    fi = import_peer(FLASHINFER_MODULE)
    kc, vc, table = cache
    what = "batch paged prefill"
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=inp.q.device)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    _flashinfer_call(what, wrapper.plan, **flashinfer_plan(case, inp, table))
    out = torch.full_like(inp.q, float("nan"))  # fails the check wherever it is not written

    def call():
        return wrapper.run(inp.q, (kc, vc), out=out)

    return (lambda: _flashinfer_call(what, call)), call, \
        f"flashinfer {getattr(fi, '__version__', '?')}"


def _call(case: ChunkedCase, impl: str, inp: Inputs, cache):
    """(first: the checked call, fn: the timed call, note), or NotAvailable."""
    import wsattn
    from wsattn import dispatch

    def varlen_backend():  # the varlen kernel a column runs, or why it cannot here
        backend = impl.split("-")[0]
        why = dispatch.reason(backend, dispatch.Call("prefill_varlen", inp.q.device,
                                                     inp.q.dtype, case.D, case.causal))
        if why is not None:
            raise NotAvailable(why)
        return backend

    if impl in ("wsattn", "wsattn-append", "triton-paged", "triton-gather", "gluon-gather",
                "gluon-paged"):
        # the default route (with the chunk's own K/V to append, for wsattn-append); in
        # place (the Triton paged kernel or the Gluon paged build); or the keys gathered
        # for a varlen kernel
        kc, vc, table = cache
        new_kv = {}
        if impl in ("wsattn", "wsattn-append"):
            backend, gather = "auto", None
            if impl == "wsattn-append":
                # each sequence's last `chunk` keys, packed as q is (copied outside the timing)
                rows = (inp.cu_k[:-1, None].long() + (case.seqlen_k - case.chunk)
                        + torch.arange(case.chunk, device=inp.k.device)).reshape(-1)
                new_kv = dict(k_new=inp.k[rows].contiguous(), v_new=inp.v[rows].contiguous())
        elif impl == "gluon-paged":
            backend, gather = "gluon", False
            why = dispatch.reason("gluon", dispatch.Call(
                "prefill_paged", inp.q.device, inp.q.dtype, case.D, case.causal,
                page_size=case.page, tma_pages=True))  # the bench's caches are packed
            if why is not None:
                raise NotAvailable(why)
        else:
            gather = impl.endswith("-gather")
            backend = varlen_backend() if gather else "triton"

        def call():
            return wsattn.attention_paged(inp.q, kc, vc, inp.cu_q, inp.seqlens_k, table,
                                          max_seqlen_q=case.chunk, causal=case.causal,
                                          sm_scale=inp.scale, impl=backend, gather=gather,
                                          **new_kv)
        return call, call, None
    if impl.startswith("triton-paged["):  # the kernel with exactly these settings
        from wsattn.kernels.prefill_paged import prefill_paged
        kc, vc, table = cache
        settings = parse_settings(_spec_of(impl))

        def call():
            return prefill_paged(inp.q, kc, vc, inp.cu_q, inp.seqlens_k, table, case.chunk,
                                 case.causal, inp.scale, settings=settings)[0]
        return call, call, None
    if impl.startswith(("gluon-paged[", "gluon-contiguous[")):
        return _gluon_build_call(case, impl, inp, cache, varlen_backend)
    if impl == "flashinfer-paged":
        return _flashinfer(case, inp, cache)
    if impl in ("wsattn-contiguous", "triton-contiguous", "gluon-contiguous"):
        backend = "auto" if impl == "wsattn-contiguous" else varlen_backend()

        def call():
            return wsattn.attention_varlen(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k,
                                           max_seqlen_q=case.chunk, max_seqlen_k=case.seqlen_k,
                                           causal=case.causal, sm_scale=inp.scale, impl=backend)
        return call, call, None
    if impl == "gluon-one-consumer-contiguous":  # gluon-contiguous[one_consumer] by name
        return _gluon_build_call(case, "gluon-contiguous[one_consumer]", inp, cache,
                                 varlen_backend)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _gluon_build_call(case: ChunkedCase, impl: str, inp: Inputs, cache, varlen_backend):
    """A --chunked-gluon-settings column: the Gluon kernel's paged build (in place) or
    varlen build (contiguous keys) made by prefill_gluon.settings_for with the SPEC's
    overrides, whatever the length rules pick; the checked call goes through the API's
    validation first. NotAvailable off sm_90, where the build does not exist at this head
    dim, or (paged) where it cannot box this page size."""
    from wsattn.api import check_attention_paged, check_attention_varlen
    from wsattn.kernels import prefill_gluon as pg
    varlen_backend()  # "gluon": not available off sm_90, with the dispatcher's reason
    try:
        settings = pg.settings_for(case.D, case.causal,
                                   **gluon_overrides(_spec_of(impl), case.D))
    except ValueError as e:
        raise NotAvailable(f"settings {_spec_of(impl)}: {e}") from None
    if impl.startswith("gluon-paged["):
        if not pg.paged_supported(case.page, settings.BLOCK_N):
            raise NotAvailable(f"page_size {case.page}: the paged build boxes pages that tile "
                               f"or are tiled by BLOCK_N={settings.BLOCK_N}")
        kc, vc, table = cache

        def call():
            return pg.prefill_paged(inp.q, kc, vc, inp.cu_q, inp.seqlens_k, table, case.chunk,
                                    case.causal, inp.scale, settings=settings)[0]

        def first():
            check_attention_paged(inp.q, kc, vc, inp.cu_q, inp.seqlens_k, table,
                                  max_seqlen_q=case.chunk, causal=case.causal, sm_scale=inp.scale,
                                  impl="gluon", gather=False)
            return call()
    else:
        def call():
            return pg.prefill_varlen(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, case.chunk,
                                     case.seqlen_k, case.causal, inp.scale,
                                     settings=settings)[0]

        def first():
            check_attention_varlen(inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k,
                                   max_seqlen_q=case.chunk, max_seqlen_k=case.seqlen_k,
                                   causal=case.causal, sm_scale=inp.scale, impl="gluon")
            return call()
    return first, call, f"settings: {settings}"


@contextlib.contextmanager
def poisoned():
    """Kernel outputs NaN-filled before the kernel writes them (the checked call only)."""
    old = os.environ.get("WSATTN_POISON")
    os.environ["WSATTN_POISON"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WSATTN_POISON", None)
        else:
            os.environ["WSATTN_POISON"] = old


def run_shape(cases: list[ChunkedCase], impls, timer, stamp, device,
              matmul_tflops=None) -> list[dict]:
    """Rows of every column of the cases of one shape (same inputs, different layouts):
    check each against float64, then time the columns that passed together, in
    alternating rounds (``timing.time_interleaved``), so that a paged column and its
    contiguous peer are sampled over the same stretch of time. A column's failure is its
    row, never the run's."""
    from wsattn.testing import TOL, rel_err

    from .suite import Pending, _short, time_rows

    assert len({c.shape for c in cases}) == 1, "run_shape takes the cases of one shape"
    todo = [(c, i) for c in cases for i in case_impls(c, impls)]
    try:
        inp = make_inputs(cases[0], device)
        ref = reference_rows(cases[0], inp)
    except Exception as e:  # out of memory on a smaller GPU, say
        return [make_row(stamp, c, i, "error", reason="inputs: " + _short(e)) for c, i in todo]
    where = f"sequences {check_sequences(cases[0])} of {cases[0].B}"
    tol = TOL[cases[0].dtype]
    common = dict(matmul_tflops=matmul_tflops, check_slice=where)
    slots: list = []  # finished rows, or Pending columns to time together
    caches = {}
    for case, impl in todo:
        try:
            if case.page is not None and case not in caches:
                caches[case] = paged_cache(case, inp)
            first, fn, note = _call(case, impl, inp, caches.get(case))
            with poisoned():
                out = first()
            _sync(device)
            err = rel_err(checked_rows(case, out), ref)
            del out
        except NotAvailable as e:
            slots.append(make_row(stamp, case, impl, "not available", reason=str(e)[:300],
                                  **common))
            continue
        except Exception as e:  # a broken column must not stop the benchmark
            slots.append(make_row(stamp, case, impl, "error", reason=_short(e), **common))
            continue
        if not err <= tol:
            slots.append(make_row(stamp, case, impl, "failed", rel_err=err, tol=tol,
                                  reason=f"relative error {err:.3e} > {tol:.1e}; not timed",
                                  note=note, **common))
            continue
        slots.append(Pending.of(fn, make_row, stamp=stamp, case=case, impl=impl, rel_err=err,
                                tol=tol, note=note, **common))
    rows = time_rows(slots, timer)
    del caches, inp, ref, slots
    release(device)
    return rows


def group_by_shape(cases: list[ChunkedCase]) -> list[list[ChunkedCase]]:
    groups: dict[tuple, list[ChunkedCase]] = {}
    for c in cases:
        groups.setdefault(c.shape, []).append(c)
    return list(groups.values())


# --------------------------------------------------------------------------- report

def format_table(rows: list[dict]) -> str:
    lines = [f"ceiling {r['impl']}: {r['tflops']:.1f} TFLOP/s ({r['case']})"
             for r in rows if r["op"] == "ceiling" and r.get("tflops")]
    head = (f"{'case':<46} {'impl':<18} {'ms':>8} {'TFLOP/s':>8} {'of mm':>6} "
            f"{'x contig':>8} {'target':>11} {'rel err':>8}  status")
    lines += ["", head, "-" * len(head)]
    for r in (r for r in rows if r["op"] == "chunked"):
        target = target_text(r["target_ratio"], r["target_met"])
        status = status_text(r)
        lines.append(
            f"{r['case']:<46} {r['impl']:<18} {fmt(r['median_ms'], '.3f'):>8} "
            f"{fmt(r['tflops'], '.1f'):>8} {fmt(r['frac_matmul'], '.3f'):>6} "
            f"{fmt(r['ratio_contiguous'], '.3f'):>8} {target:>11} {fmt(r['rel_err'], '.1e'):>8}  "
            f"{status[:120]}")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path):
    """TFLOP/s against the prefix length per column and layout, one panel per head dim;
    the matmul ceiling dashed."""
    from .plot import MISSING, pyplot, save
    plt = pyplot()
    if plt is None:
        return None, MISSING
    ok = [r for r in rows if r["op"] == "chunked" and r["status"] == "ok" and r["tflops"]]
    if not ok:
        return None, "no timed rows to plot"
    dims = sorted({r["D"] for r in ok}, reverse=True)
    lines = sorted({(r["impl"], r["layout"]) for r in ok})
    fig, axes = plt.subplots(1, len(dims), figsize=(5.5 * len(dims), 3.8), squeeze=False)
    for ax, D in zip(axes.flat, dims):
        for impl, layout in lines:
            pts = sorted((r["prefix"], r["tflops"]) for r in ok
                         if (r["D"], r["impl"], r["layout"]) == (D, impl, layout))
            if pts:
                label = impl if layout == "contiguous" else f"{impl} {layout}"
                ax.plot(*zip(*pts), marker="o", label=label)
        mm = next((r["matmul_tflops"] for r in ok if r["matmul_tflops"]), None)
        if mm:
            ax.axhline(mm, linestyle="--", color="grey", linewidth=1, label="matmul ceiling")
        ax.set_xscale("symlog", base=2, linthresh=1024)
        ax.set_xlabel("prefix (keys before the chunk)")
        ax.set_ylabel("TFLOP/s")
        masks = "/".join(sorted({"causal" if r["causal"] else "full" for r in ok
                                 if r["D"] == D}))
        ax.set_title(f"D{D}, chunk {ok[0]['chunk']}, B {ok[0]['B']}, {masks}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    s = rows[0]
    return save(fig, axes, len(dims),
                f"wsattn bench chunked - {s.get('gpu')} - {s.get('commit')} - {s.get('date')}",
                path)


def main(args) -> int:
    """Run the chunked-prefill benchmark (a CUDA GPU is checked for by the caller)."""
    from tqdm import tqdm

    from . import ceilings as ceil_mod
    from .report import exit_status
    from .env import stamp as make_stamp
    from .timing import cuda_timer

    device = torch.device("cuda", torch.cuda.current_device())
    stamp = make_stamp(device)
    timer = cuda_timer(args.warmup_ms, args.rep_ms, args.timing)
    try:
        cases = chunked_cases(args.chunked_prefix, args.chunked_pages, args.chunked_dims,
                              args.chunked_batch, chunk=args.chunked_chunk, dtype=args.dtype,
                              masks=args.chunked_masks)
    except ValueError as e:
        print(f"wsattn bench chunked: {e}", file=sys.stderr)
        return 2
    impls = list(args.chunked_impl)
    try:  # extra columns: the paged kernel with exactly these settings; Gluon builds
        impls += [f"triton-paged[{spec}]" for spec in (args.chunked_settings or [])
                  if parse_settings(spec)]
        for spec in args.chunked_gluon_settings or []:
            gluon_overrides(spec, 128)
            impls += [f"gluon-paged[{spec}]", f"gluon-contiguous[{spec}]"]
    except ValueError as e:
        print(f"wsattn bench chunked: {e}", file=sys.stderr)
        return 2
    groups = group_by_shape(cases)
    print(f"wsattn bench chunked on {stamp['gpu']}, torch {stamp['torch']}, triton "
          f"{stamp['triton']}, commit {stamp['commit']}: {len(groups)} shapes x {impls}",
          file=sys.stderr)
    rows, mm = ceil_mod.matmul_ceiling_rows(timer, device, stamp)
    for group in tqdm(groups, desc="wsattn bench chunked", file=sys.stderr, dynamic_ncols=True):
        rows += run_shape(group, impls, timer, stamp, device, mm)
    add_ratios(rows)
    print(format_table(rows))
    write(rows, stamp, args, plot_rows)
    return exit_status(rows, is_wsattn)


def add_arguments(group) -> None:
    group.add_argument("--chunked-prefix", nargs="+", type=int, default=list(PREFIXES),
                       metavar="P", help="chunked: keys before the chunk (default "
                                         f"{' '.join(map(str, PREFIXES))})")
    group.add_argument("--chunked-pages", nargs="+", type=int, default=list(PAGES),
                       metavar="PAGE", help="chunked: page sizes of the paged rows (default "
                                            f"{' '.join(map(str, PAGES))})")
    group.add_argument("--chunked-dims", nargs="+", type=int, default=list(DIMS), metavar="D",
                       help=f"chunked: head dims (default {' '.join(map(str, DIMS))})")
    group.add_argument("--chunked-impl", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                       metavar="IMPL", help=f"chunked: columns (default: "
                                            f"{' '.join(DEFAULT_IMPLS)}; by name only: "
                                            f"{' '.join(BY_NAME)})")
    group.add_argument("--chunked-chunk", type=int, default=CHUNK, metavar="C",
                       help=f"chunked: new queries a sequence (default {CHUNK}, the target's)")
    group.add_argument("--chunked-settings", nargs="+", default=None, metavar="SPEC",
                       help="chunked: extra columns triton-paged[SPEC] on the paged rows, the "
                            "paged kernel with SPEC = BLOCK_M,BLOCK_N,num_warps,num_stages"
                            "[,use_tma] (wsattn.kernels.prefill_paged.PagedPrefillSettings)")
    group.add_argument("--chunked-gluon-settings", nargs="+", default=None, metavar="SPEC",
                       help="chunked: extra columns gluon-paged[SPEC] (paged rows) and "
                            "gluon-contiguous[SPEC] (contiguous rows), the Gluon kernel's "
                            "build that prefill_gluon.settings_for makes with these overrides "
                            "whatever the length rules pick; SPEC = FIELD=VALUE[,FIELD=VALUE"
                            "...], or default / one_consumer (the two builds the rules choose "
                            "between, per head dim)")
    group.add_argument("--chunked-masks", nargs="+", choices=MASKS_ALL, default=list(MASKS),
                       metavar="MASK", help="chunked: causal (bottom-right aligned, the "
                                            "serving case and the default) and / or full")
    group.add_argument("--chunked-batch", type=int, default=BATCH, metavar="B",
                       help=f"chunked: sequences, one chunk of --chunked-chunk queries each "
                            f"(default {BATCH}: {BATCH * CHUNK // 1024}k chunk tokens)")
