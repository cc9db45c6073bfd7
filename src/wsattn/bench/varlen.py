"""`wsattn bench varlen`: packed variable-length prefill against equal-length batches of
the same work and against the FlashAttention-2 varlen path inside torch (the targets:
varlen >= 0.95x the equal-length throughput, and >= 1.4x torch's FA2 varlen).

The pack: sequence lengths drawn with a fixed seed (``--varlen-seed``, default 0) from a
log-uniform distribution over [64, 8192] (``--varlen-dist uniform`` for uniform;
``--varlen-lengths LO HI``) until 16384 tokens (``--varlen-tokens``); the draw that would
end the pack is cut to fit, and one that would leave fewer than LO tokens is shortened
so that the last sequence still has LO. Log-uniform by default because serving traffic
is mostly short prompts with a long tail: uniform over [64, 8192] gives a pack of about
four sequences, which tests little of the packing. Prefill: q_len = kv_len per
sequence. Every row stores the lengths, the seed and the distribution.

Shapes (one pack, all of them): heads ``mha`` (hidden 2048: H = 2048 / D, as ``wsattn
bench prefill``) and ``gqa`` (Hq 32, Hkv 8, as the Llama-3 models), D 128 and 64, causal
(bottom-right aligned, per sequence) and full; bf16 (``--dtype``).

The equal-length comparison: a batch of B sequences of N tokens with the pack's work per
token, N_eq = sum(len^2) / sum(len) rounded to the nearest multiple of 64 (halves up,
at least 64), and about its token count, B = 16384 // N_eq. Each column runs both
(``layout`` "varlen" and "equal"); FLOPs = 4 x D x Hq x sum(len^2) for the pack and
4 x D x Hq x B x N^2 for the batch, halved when causal (the convention of ``wsattn bench
prefill`` and FlashAttention's benchmarks), TFLOP/s = FLOPs / median time, and the
varlen row's ``ratio_equal`` = its TFLOP/s / the same column's equal-length TFLOP/s.

Columns (``impl``):

* ``wsattn`` (impl "auto"), ``wsattn-triton``, ``wsattn-gluon``: :func:`wsattn.attention_varlen`
  for the pack (``max_seqlen`` given, no ``validate``: no host read in the timed call; the
  checked call validates), :func:`wsattn.attention` for the batch; the ``wsattn`` rows
  note the backend "auto" chose. Where the Gluon kernel refuses a call (ValueError: a
  varlen path it lacks, a GPU other than sm_90) the row is 'not available' with the
  dispatcher's reason; any other failure of these is a failure of the run (exit 1).
* ``wsattn-gluon-plain``: the Gluon kernel with ``compact_varlen=False`` (the plain grid:
  every sequence padded to the longest, the CTAs past a sequence's end exiting at once;
  what packs too large for the tile table take), called through
  ``prefill_gluon.prefill_varlen``; its equal-length row is ``wsattn-gluon``'s call (the
  setting is varlen-only), so its ``ratio_equal`` against ``wsattn-gluon``'s is the A/B
  of the grid alone.
* ``wsattn-gluon-packorder``: the Gluon kernel with ``varlen_longest_first=False`` (the
  tile table's sequences in pack order, where the default lists them longest first), the
  same way: the A/B of the tile order alone.
* ``wsattn-gluon-unbounded``: the Gluon kernel with ``varlen_bounded_v=False`` (the V of
  a key tile that ends past its sequence loaded through the pack-wide descriptor, where
  the default bounds it by a descriptor of the sequence's own rows), the same way: the A/B
  of that setting's cost.
* ``wsattn-gluon-one-consumer``: the Gluon kernel's one-consumer build for packs
  (``prefill_gluon.ONE_CONSUMER``: 64-row tiles, two or three CTAs an SM), for the pack
  through ``prefill_gluon.prefill_varlen`` and for the batch through
  ``prefill_gluon.prefill``, both with those settings; ``wsattn-gluon-multi-consumer``
  the same with the default settings (two or three consumer warpgroups, one CTA an SM),
  whichever build the launchers' length rules would pick: the two builds side by side,
  against ``wsattn-triton``, on packs of short sequences.
* ``torch-fa2``: ``torch.ops.aten._flash_attention_forward`` (torch's FlashAttention-2),
  with cu_seqlens for the pack, dense [B, N, H, D] for the batch; GQA native. The op
  allocates its output itself, so its checked call is made right after a NaN buffer of
  the output's size was freed into an emptied caching allocator, which then hands that
  buffer to the op: an element it does not write stays NaN (best effort: the allocator
  decides).
* ``flashinfer-fa3`` / ``flashinfer-fa2``: FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper``
  with that backend, indptr = cu_seqlens, planned outside the timing (the batch through
  :class:`wsattn.bench.peers.FlashInferPrefillRunner`).
* ``fa4``: FlashAttention-4's SM90 varlen kernels from the AOT wheel
  (``varlen_d128_{full,causal}``: bf16, D 128, MHA; GQA cases get K/V repeated to the query
  heads, noted in the row; the batch through :class:`wsattn.bench.peers.Fa4Runner`).

The peers are 'not available' with the reason where their wheel does not import or
carries no kernel for the case (:mod:`wsattn.bench.peers`).

Every output is checked before it is timed: for the pack, the first, the shortest, the
longest and the last sequence, every head, against float64 (``wsattn.reference``); for
the batch, the slice :func:`wsattn.bench.runners.check_output` compares. Within
``wsattn.testing.TOL``, with the checked call's outputs NaN-poisoned. A failed check is
recorded, not timed. Time is a CUDA-graph replay (``wsattn.bench.timing.cuda_timer``).
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from dataclasses import dataclass

import torch

from .cases import DTYPES, HIDDEN, PrefillCase, tflops
from .chunked import poisoned
from .gemv import write
from .runners import (NotAvailable, Prepared, multi_consumer_build, one_consumer_build,
                      settings_build)
from .report import fmt, status_text, target_text, throughput_ratio, timing_fields
from .timing import _sync, release

TOKENS = 16384
LENGTHS = (64, 8192)
DISTS = ("loguniform", "uniform")
SEED = 0
DIMS = (128, 64)
HEADS = {"mha": None, "gqa": (32, 8)}  # mha: HIDDEN // D query and key heads
MASKS = ("causal", "full")
EQ_MULTIPLE = 64  # N_eq is a whole number of 64-token tiles, as the prefill shapes
LAYOUTS = ("varlen", "equal")
IMPLS = ("wsattn", "wsattn-triton", "wsattn-gluon", "wsattn-gluon-plain",
         "wsattn-gluon-packorder", "wsattn-gluon-unbounded", "wsattn-gluon-one-consumer",
         "wsattn-gluon-multi-consumer", "torch-fa2", "flashinfer-fa3", "flashinfer-fa2", "fa4")
BACKENDS = {"wsattn": "auto", "wsattn-triton": "triton", "wsattn-gluon": "gluon",
            "wsattn-gluon-plain": "gluon", "wsattn-gluon-packorder": "gluon",
            "wsattn-gluon-unbounded": "gluon", "wsattn-gluon-one-consumer": "gluon",
            "wsattn-gluon-multi-consumer": "gluon"}


# the Gluon columns that call prefill_varlen with settings of their own: each a function
# of the head dim and mask (the one-consumer build's depend on the head dim)
GLUON_SETTINGS = {"wsattn-gluon-plain": settings_build({"compact_varlen": False}),
                  "wsattn-gluon-packorder": settings_build({"varlen_longest_first": False}),
                  "wsattn-gluon-unbounded": settings_build({"varlen_bounded_v": False}),
                  "wsattn-gluon-one-consumer": one_consumer_build,
                  "wsattn-gluon-multi-consumer": multi_consumer_build}
# of those, the builds (not varlen-only settings): their batch runs prefill_gluon.prefill
# with the same settings
BUILD_COLUMNS = ("wsattn-gluon-one-consumer", "wsattn-gluon-multi-consumer")
WSATTN_IMPLS = tuple(BACKENDS)  # a failure of these exits 1
TARGET_EQUAL = 0.95  # varlen TFLOP/s >= 0.95x the equal-length batch's, same column
TARGET_TORCH_FA2 = 1.4  # varlen TFLOP/s >= 1.4x torch's FA2 varlen

ROW_FIELDS = ("op", "impl", "case", "layout", "dtype", "causal", "heads", "Hq", "Hkv", "D",
              "tokens", "B", "N", "total_tokens", "num_seqs", "max_len", "lengths", "seed",
              "dist", "len_lo", "len_hi", "N_eq", "B_eq", "flops", "status", "reason", "note",
              "rel_err", "tol", "check_passed", "check_slice", "median_ms", "q20_ms",
              "q80_ms", "reps", "calls", "timing", "samples_ms", "samples_t", "tflops",
              "matmul_tflops", "frac_matmul", "ratio_equal", "ratio_torch_fa2", "target_equal",
              "target_equal_met", "target_torch_fa2", "target_torch_fa2_met")


def gluon_settings(impl: str, head_dim: int, causal: bool):
    """The GluonSettings a GLUON_SETTINGS column launches prefill_varlen with."""
    return GLUON_SETTINGS[impl](head_dim, causal)


# --------------------------------------------------------------------------- the pack

@dataclass(frozen=True)
class Pack:
    """Sequence lengths packed back to back, and how they were drawn."""
    lengths: tuple
    seed: int
    dist: str
    lo: int
    hi: int

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    def sum_sq(self) -> int:
        """sum(len^2): the (query, key) pairs of the pack without a mask."""
        return sum(n * n for n in self.lengths)

    @property
    def n_eq(self) -> int:
        """The equal-length batch's N: sum(len^2) / sum(len), to the nearest multiple of
        EQ_MULTIPLE (halves up), at least EQ_MULTIPLE."""
        tiles = math.floor(self.sum_sq() / self.total / EQ_MULTIPLE + 0.5)
        return EQ_MULTIPLE * max(1, tiles)

    @property
    def b_eq(self) -> int:
        """The equal-length batch's B: as many N_eq sequences as the pack's tokens hold."""
        return max(1, self.total // self.n_eq)

    def offsets(self) -> list[int]:
        """cu_seqlens as a list: 0, len0, len0 + len1, ..., total."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def checked(self) -> list[int]:
        """The sequences checked against float64: first, shortest, longest, last."""
        n = self.lengths
        return sorted({0, n.index(min(n)), n.index(max(n)), len(n) - 1})


def _int_at_least(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def draw_pack(total: int = TOKENS, seed: int = SEED, dist: str = "loguniform",
              lo: int = LENGTHS[0], hi: int = LENGTHS[1]) -> Pack:
    """Lengths in [lo, hi] drawn from ``dist`` with Python's ``random.Random(seed)`` (the same
    on every machine) until they sum to ``total``: a draw that would reach the total or
    leave fewer than lo tokens ends the pack with what is left when that fits in hi, else
    is shortened to leave exactly lo for the last sequence."""
    _int_at_least("lengths lo", lo, 1)
    _int_at_least("lengths hi", hi, 2 * lo)  # room to shorten a draw and still leave lo
    _int_at_least("tokens", total, lo)
    _int_at_least("seed", seed, 0)
    if dist not in DISTS:
        raise ValueError(f"dist must be one of {DISTS}, got {dist!r}")
    rng = random.Random(seed)

    def draw() -> int:
        if dist == "uniform":
            return rng.randint(lo, hi)
        x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        return min(hi, max(lo, round(x)))

    lengths, left = [], total
    while left:
        n = draw()
        if left - n < lo:
            if left <= hi:
                lengths.append(left)  # the last sequence, cut to fit
                break
            n = left - lo
        lengths.append(n)
        left -= n
    return Pack(tuple(lengths), seed, dist, lo, hi)


# --------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class VarlenCase:
    """One shape over the pack; its equal-length twin is :meth:`equal`."""
    pack: Pack
    heads: str  # "mha", "gqa", or a test's own label
    Hq: int
    Hkv: int
    D: int
    causal: bool
    dtype: str = "bf16"
    op: str = "varlen"

    @property
    def id(self) -> str:
        p = self.pack
        dist = {"loguniform": "log", "uniform": "uni"}.get(p.dist, p.dist)
        return (f"varlen-T{p.total}-{dist}{p.lo}-{p.hi}-s{p.seed}-H{self.Hq}-HKV{self.Hkv}-"
                f"D{self.D}-{'causal' if self.causal else 'full'}-{self.dtype}")

    def equal(self) -> PrefillCase:
        return PrefillCase(self.pack.b_eq, self.pack.n_eq, self.Hq, self.Hkv, self.D,
                           self.causal, self.dtype)

    def flops(self, layout: str = "varlen") -> float:
        """4 x D x Hq per (query, key) pair (QK^T and PV), halved when causal."""
        if layout == "equal":
            return self.equal().flops()
        f = 4.0 * self.D * self.Hq * self.pack.sum_sq()
        return f / 2 if self.causal else f


def varlen_cases(pack: Pack, dims=DIMS, heads=tuple(HEADS), masks=MASKS,
                 dtype: str = "bf16") -> list[VarlenCase]:
    """Per heads, D and mask, in that order."""
    from wsattn.api import KERNEL_HEAD_DIMS

    for d in dims:
        if isinstance(d, bool) or d not in KERNEL_HEAD_DIMS:
            raise ValueError(f"dim must be one of the kernels' head dims {KERNEL_HEAD_DIMS}, "
                             f"got {d!r}")
    for h in heads:
        if h not in HEADS:
            raise ValueError(f"heads must be among {tuple(HEADS)}, got {h!r}")
    for m in masks:
        if m not in MASKS:
            raise ValueError(f"mask must be among {MASKS}, got {m!r}")
    cases = []
    for h in heads:
        for d in dims:
            hq, hkv = HEADS[h] or (HIDDEN // d, HIDDEN // d)
            cases += [VarlenCase(pack, h, hq, hkv, d, m == "causal", dtype) for m in masks]
    return cases


# --------------------------------------------------------------------------- rows

def make_row(stamp: dict, case: VarlenCase, impl: str, layout: str, status: str, *,
             reason=None, note=None, rel_err=None, tol=None, check_slice=None, timing=None,
             samples=None, stamps=None, matmul_tflops=None) -> dict:
    """One row; every row has the keys of ROW_FIELDS (None where they do not apply).
    samples: the timing's samples in round order (``samples_ms``, paired by add_ratios)."""
    p, eq = case.pack, case.equal()
    varlen = layout == "varlen"
    row = dict(stamp)
    row.update({k: None for k in ROW_FIELDS})
    row.update(op=case.op, impl=impl, case=case.id, layout=layout, dtype=case.dtype,
               causal=case.causal, heads=case.heads, Hq=case.Hq, Hkv=case.Hkv, D=case.D,
               tokens=p.total if varlen else eq.B * eq.N, B=p.num_seqs if varlen else eq.B,
               N=None if varlen else eq.N, total_tokens=p.total, num_seqs=p.num_seqs,
               max_len=p.max_len, lengths=list(p.lengths), seed=p.seed, dist=p.dist,
               len_lo=p.lo, len_hi=p.hi, N_eq=eq.N, B_eq=eq.B, flops=case.flops(layout),
               status=status, reason=reason, note=note, rel_err=rel_err, tol=tol,
               check_passed=None if rel_err is None else rel_err <= tol,
               check_slice=check_slice, matmul_tflops=matmul_tflops)
    if varlen and impl in WSATTN_IMPLS:
        row.update(target_equal=TARGET_EQUAL, target_torch_fa2=TARGET_TORCH_FA2)
    if timing is not None:
        row.update(timing_fields(timing, samples, stamps),
                   tflops=tflops(row["flops"], timing.median_ms))
        if matmul_tflops:
            row["frac_matmul"] = row["tflops"] / matmul_tflops
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """On the timed rows, in place: ratio_equal (a varlen row's TFLOP/s over the same
    column's equal-length row), ratio_torch_fa2 (over torch-fa2's, same case and layout),
    each paired by round where both rows were timed in one loop
    (``report.throughput_ratio``), and the targets met / missed on the wsattn varlen
    rows."""
    ok = {(r["case"], r["impl"], r["layout"]): r for r in rows
          if r.get("op") == "varlen" and r["status"] == "ok" and r["tflops"]}
    for (case, impl, layout), r in ok.items():
        fa2 = ok.get((case, "torch-fa2", layout))
        if fa2 is not None and impl != "torch-fa2":
            r["ratio_torch_fa2"] = throughput_ratio(r, fa2, "tflops")
        eq = ok.get((case, impl, "equal"))
        if layout == "varlen" and eq is not None:
            r["ratio_equal"] = throughput_ratio(r, eq, "tflops")
        if r["target_equal"] is not None and r["ratio_equal"] is not None:
            r["target_equal_met"] = "met" if r["ratio_equal"] >= TARGET_EQUAL else "missed"
        if r["target_torch_fa2"] is not None and r["ratio_torch_fa2"] is not None:
            r["target_torch_fa2_met"] = ("met" if r["ratio_torch_fa2"] >= TARGET_TORCH_FA2
                                         else "missed")
    return rows


# --------------------------------------------------------------------------- inputs

@dataclass
class Inputs:
    """The pack's tensors: q [T, Hq, D], k, v [T, Hkv, D] packed; cu int32 [n + 1] on the
    same device; scale."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu: torch.Tensor
    scale: float


def make_inputs(case: VarlenCase, device) -> Inputs:
    """Random tensors of the case's shape, seeded by the shape (the causal and full cases
    of one shape see the same numbers)."""
    dt = DTYPES[case.dtype]
    seed = zlib.crc32(repr((case.pack, case.Hq, case.Hkv, case.D, case.dtype)).encode())
    g = torch.Generator(device=device).manual_seed(seed)
    T = case.pack.total

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dt)

    cu = torch.tensor(case.pack.offsets(), dtype=torch.int32, device=device)
    return Inputs(randn(T, case.Hq, case.D), randn(T, case.Hkv, case.D),
                  randn(T, case.Hkv, case.D), cu, case.D ** -0.5)


def reference_rows(case: VarlenCase, inp: Inputs) -> torch.Tensor:
    """float64 outputs of the checked sequences, concatenated in their order, every head."""
    from wsattn import reference

    off = case.pack.offsets()
    outs = []
    for i in case.pack.checked():
        a, e = off[i], off[i + 1]
        cu = torch.tensor([0, e - a], dtype=torch.int32, device=inp.q.device)
        out, _ = reference.attention_varlen(inp.q[a:e], inp.k[a:e], inp.v[a:e], cu, cu,
                                            case.causal, inp.scale)
        outs.append(out)
    return torch.cat(outs)


def checked_rows(case: VarlenCase, out: torch.Tensor) -> torch.Tensor:
    off = case.pack.offsets()
    return torch.cat([out[off[i]:off[i + 1]] for i in case.pack.checked()])


def check_slice(case: VarlenCase) -> str:
    n = case.pack.lengths
    picked = case.pack.checked()
    return (f"sequences {picked} of {len(n)} (lengths {[n[i] for i in picked]}), "
            f"all {case.Hq} heads")


# --------------------------------------------------------------------------- columns

def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _wsattn(case: VarlenCase, impl: str, layout: str, inp) -> Prepared:
    import wsattn
    from wsattn import dispatch

    backend = BACKENDS[impl]
    if layout == "varlen":
        m = case.pack.max_len
        call_info = dispatch.Call("prefill_varlen", inp.q.device, inp.q.dtype, case.D,
                                  case.causal)

        def call(validate=None):
            return wsattn.attention_varlen(inp.q, inp.k, inp.v, inp.cu, inp.cu, max_seqlen_q=m,
                                           max_seqlen_k=m, causal=case.causal,
                                           sm_scale=inp.scale, impl=backend, validate=validate)

        if impl in GLUON_SETTINGS:
            from wsattn.kernels import prefill_gluon as pg
            settings = gluon_settings(impl, case.D, case.causal)
            checked_api = call  # validates the inputs once, outside the timing

            def call(validate=None):
                if validate:
                    checked_api(validate=True)
                return pg.prefill_varlen(inp.q, inp.k, inp.v, inp.cu, inp.cu, m, m,
                                         case.causal, inp.scale, settings=settings)[0]

        def checked():
            return call(validate=True)  # a host read is fine outside the timing
    else:
        eq = case.equal()
        call_info = dispatch.Call("prefill", inp.q.device, inp.q.dtype, case.D, case.causal,
                                  eq.N, eq.N)

        def call():
            return wsattn.attention(inp.q, inp.k, inp.v, case.causal, inp.scale, impl=backend)

        if impl in BUILD_COLUMNS:  # a build of the fixed-length kernel too
            from wsattn.kernels import prefill_gluon as pg
            settings = gluon_settings(impl, case.D, case.causal)
            api_call = call

            def call():
                return pg.prefill(inp.q, inp.k, inp.v, case.causal, inp.scale,
                                  settings=settings)[0]

            def checked():
                api_call()  # validates the batch once, outside the timing
                return call()
        else:
            checked = call

    def first():
        try:
            return checked()
        except ValueError as e:
            if impl == "wsattn-gluon" or impl in GLUON_SETTINGS:  # the kernel's refusal
                raise NotAvailable(str(e)) from e
            raise

    note = f"auto -> {dispatch.resolve('auto', call_info)}" if backend == "auto" else None
    return Prepared(first, call, note=note)


def fa2_op():
    """torch's FlashAttention-2 forward, or NotAvailable (a build without it)."""
    try:
        return torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError) as e:
        raise NotAvailable(f"torch {torch.__version__} has no aten::_flash_attention_forward: "
                           f"{e}") from e


def _nan_into_allocator(shape, dtype, device) -> None:
    """Free a NaN buffer of this shape into an emptied caching allocator, so that the next
    allocation of that size (the op's output) reuses it."""
    if torch.device(device).type != "cuda":
        return
    torch.cuda.empty_cache()
    torch.full(shape, float("nan"), dtype=dtype, device=device)


def _torch_fa2(case: VarlenCase, layout: str, inp) -> Prepared:
    op = fa2_op()
    if layout == "varlen":
        m = case.pack.max_len
        q, k, v, cu = inp.q, inp.k, inp.v, inp.cu

        def call():
            return op(q, k, v, cu, cu, m, m, 0.0, case.causal, False, scale=inp.scale)[0]
    else:
        q, k, v, n = inp.q, inp.k, inp.v, case.equal().N

        def call():
            return op(q, k, v, None, None, n, n, 0.0, case.causal, False, scale=inp.scale)[0]

    def first():
        _nan_into_allocator(q.shape, q.dtype, q.device)
        try:
            return call()
        except (RuntimeError, NotImplementedError) as e:  # no kernel for this device / shape
            raise NotAvailable(f"torch-fa2: {(str(e).splitlines() or [''])[0][:240]}") from e

    return Prepared(first, call, note=f"torch {torch.__version__}")


def _flashinfer(case: VarlenCase, backend: str, inp) -> Prepared:
    """The pack through BatchPrefillWithRaggedKVCacheWrapper, indptr = cu_seqlens."""
    from .peers import FLASHINFER_MODULE, WORKSPACE_BYTES, _flashinfer_call, import_peer

    fi = import_peer(FLASHINFER_MODULE)
    what = f"batch ragged prefill ({backend})"
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=inp.q.device)
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
    dt = DTYPES[case.dtype]
    _flashinfer_call(what, wrapper.plan, qo_indptr=inp.cu, kv_indptr=inp.cu,
                     num_qo_heads=case.Hq, num_kv_heads=case.Hkv, head_dim_qk=case.D,
                     causal=case.causal, sm_scale=inp.scale, q_data_type=dt, kv_data_type=dt)
    out = _nan_like(inp.q)

    def call():
        return wrapper.run(inp.q, inp.k, inp.v, out=out)

    return Prepared(lambda: _flashinfer_call(what, call), call,
                    note=f"flashinfer {getattr(fi, '__version__', '?')}")


def fa4_varlen_kernel(case: VarlenCase) -> str:
    return f"varlen_d{case.D}_{'causal' if case.causal else 'full'}"


def _fa4(case: VarlenCase, inp) -> Prepared:
    """The pack through the FA4 AOT varlen kernel, after the checks Fa4Runner makes."""
    from .peers import _dtype_name, fa4_wheel

    fa4, manifest = fa4_wheel(_dtype_name(case), inp.q.device)
    kernels = manifest.get("kernels", {})
    name = fa4_varlen_kernel(case)
    if name not in kernels:
        raise NotAvailable(f"the FA4 AOT wheel has no kernel {name} "
                           f"(it carries {', '.join(sorted(kernels)) or 'none'})")
    notes = [f"flash-attn-4 {manifest.get('flash_attn_4', '?')} AOT"]
    k, v = inp.k, inp.v
    if case.Hq != case.Hkv:
        group = case.Hq // case.Hkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        notes.append(f"K/V repeated to {case.Hq} heads (the FA4 AOT varlen kernels are MHA only)")
    out = _nan_like(inp.q)

    def call():
        return fa4.forward(name, inp.q, k, v, out, inp.scale, cu_seqlens_q=inp.cu,
                           cu_seqlens_k=inp.cu)

    return Prepared(call, call, note="; ".join(notes))


def prepare(case: VarlenCase, impl: str, layout: str, inp) -> Prepared:
    """A column's checked and timed calls for one layout: ``inp`` is this module's
    :class:`Inputs` for "varlen", :class:`wsattn.bench.runners.Inputs` of
    ``case.equal()`` for "equal". Raises NotAvailable where the column cannot run."""
    from .peers import Fa4Runner, FlashInferPrefillRunner

    if impl in BACKENDS:
        return _wsattn(case, impl, layout, inp)
    if impl == "torch-fa2":
        return _torch_fa2(case, layout, inp)
    if impl in ("flashinfer-fa3", "flashinfer-fa2"):
        backend = impl.split("-")[1]
        if layout == "equal":
            return FlashInferPrefillRunner(backend).prepare(case.equal(), inp)
        return _flashinfer(case, backend, inp)
    if impl == "fa4":
        return Fa4Runner().prepare(case.equal(), inp) if layout == "equal" else _fa4(case, inp)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# --------------------------------------------------------------------------- running

def run_case(case: VarlenCase, impls, timer, stamp, device, matmul_tflops=None) -> list[dict]:
    """Rows of every column on the pack and on the equal-length batch: check against
    float64, then time the columns that passed together in alternating rounds
    (``suite.time_rows``). A column's failure is its row, never the run's."""
    from wsattn.testing import TOL, rel_err

    from .runners import check_output, make_inputs as make_batch
    from .suite import Pending, _short, time_rows

    todo = [(i, layout) for i in impls for layout in LAYOUTS]
    try:
        inputs = {"varlen": make_inputs(case, device),
                  "equal": make_batch(case.equal(), device,
                                      seed=zlib.crc32(case.id.encode()) & 0x7FFFFFFF)}
        ref = reference_rows(case, inputs["varlen"])
    except Exception as e:  # out of memory on a smaller GPU, say
        return [make_row(stamp, case, i, layout, "error", reason="inputs: " + _short(e),
                         matmul_tflops=matmul_tflops) for i, layout in todo]
    tol, slots = TOL[case.dtype], []  # finished rows, or Pending columns to time together
    for impl, layout in todo:
        inp = inputs[layout]
        where = check_slice(case) if layout == "varlen" else None
        common = dict(matmul_tflops=matmul_tflops, check_slice=where)
        try:
            prepared = prepare(case, impl, layout, inp)
            with poisoned():
                out = prepared.first()
            _sync(device)
            out = prepared.canon(out)
            if layout == "varlen":
                err = rel_err(checked_rows(case, out), ref)
            else:
                check = check_output(inp, out)
                err, common["check_slice"] = check.rel_err, check.where
            del out
        except NotAvailable as e:
            slots.append(make_row(stamp, case, impl, layout, "not available",
                                  reason=str(e)[:300], **common))
            continue
        except Exception as e:  # a broken column must not stop the benchmark
            slots.append(make_row(stamp, case, impl, layout, "error", reason=_short(e),
                                  **common))
            continue
        if not err <= tol:
            slots.append(make_row(stamp, case, impl, layout, "failed", rel_err=err, tol=tol,
                                  reason=f"relative error {err:.3e} > {tol:.1e}; not timed",
                                  note=prepared.note, **common))
            continue
        slots.append(Pending.of(prepared.fn, make_row, stamp=stamp, case=case, impl=impl,
                                layout=layout, rel_err=err, tol=tol, note=prepared.note,
                                **common))
    rows = time_rows(slots, timer)
    del slots
    del inputs, ref
    release(device)
    return rows


# --------------------------------------------------------------------------- report

def _target(r, which) -> str:
    return target_text(r[f"target_{which}"], r[f"target_{which}_met"], "g")


def format_table(rows: list[dict]) -> str:
    lines = [f"ceiling {r['impl']}: {r['tflops']:.1f} TFLOP/s ({r['case']})"
             for r in rows if r["op"] == "ceiling" and r.get("tflops")]
    packs = {(r["seed"], r["dist"], tuple(r["lengths"])): r for r in rows if r["op"] == "varlen"}
    for r in packs.values():
        lines.append(f"pack: {r['num_seqs']} sequences, {r['total_tokens']} tokens, lengths "
                     f"{r['dist']} in [{r['len_lo']}, {r['len_hi']}] seed {r['seed']}: "
                     f"{r['lengths']}; equal-length batch B {r['B_eq']} x N {r['N_eq']}")
    head = (f"{'case':<60} {'impl':<15} {'layout':<6} {'ms':>8} {'TFLOP/s':>8} {'x equal':>7} "
            f"{'x fa2':>6} {'target eq':>10} {'target fa2':>10} {'rel err':>8}  status")
    lines += ["", head, "-" * len(head)]
    for r in (r for r in rows if r["op"] == "varlen"):
        status = status_text(r)
        if r.get("timing") not in (None, "graph"):
            status += f" [timing: {r['timing']}]"
        lines.append(
            f"{r['case']:<60} {r['impl']:<15} {r['layout']:<6} {fmt(r['median_ms'], '.3f'):>8} "
            f"{fmt(r['tflops'], '.1f'):>8} {fmt(r['ratio_equal'], '.3f'):>7} "
            f"{fmt(r['ratio_torch_fa2'], '.2f'):>6} {_target(r, 'equal'):>10} "
            f"{_target(r, 'torch_fa2'):>10} {fmt(r['rel_err'], '.1e'):>8}  {status[:120]}")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path):
    """TFLOP/s per column, the pack (solid) beside the equal-length batch (hatched), one
    panel per (heads, D, mask); the matmul ceiling dashed."""
    from .plot import MISSING, pyplot, save
    plt = pyplot()
    if plt is None:
        return None, MISSING
    ok = [r for r in rows if r["op"] == "varlen" and r["status"] == "ok" and r["tflops"]]
    if not ok:
        return None, "no timed rows to plot"
    panels = sorted({(r["Hq"], r["Hkv"], r["D"], r["causal"]) for r in ok},
                    key=lambda p: (p[0] != p[1], -p[2], p[3]))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    impls += sorted({r["impl"] for r in ok} - set(impls))
    cols = min(len(panels), 4)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    width = 0.4
    for ax, (hq, hkv, D, causal) in zip(axes.flat, panels):
        sel = {(r["impl"], r["layout"]): r["tflops"] for r in ok
               if (r["Hq"], r["Hkv"], r["D"], r["causal"]) == (hq, hkv, D, causal)}
        for j, layout in enumerate(LAYOUTS):
            xs = [i + (j - 0.5) * width for i in range(len(impls))]
            ys = [sel.get((impl, layout), 0.0) for impl in impls]
            ax.bar(xs, ys, width, label=layout, hatch="//" if layout == "equal" else None,
                   alpha=0.85 if layout == "varlen" else 0.5)
        mm = next((r["matmul_tflops"] for r in ok if r["matmul_tflops"]), None)
        if mm:
            ax.axhline(mm, linestyle="--", color="grey", linewidth=1, label="matmul ceiling")
        ax.set_xticks(range(len(impls)))
        ax.set_xticklabels(impls, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"Hq{hq}/Hkv{hkv} D{D} {'causal' if causal else 'full'}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    s = ok[0]
    return save(fig, axes, len(panels),
                f"wsattn bench varlen - {s['total_tokens']} tokens, {s['num_seqs']} sequences "
                f"({s['dist']} {s['len_lo']}-{s['len_hi']}, seed {s['seed']}) vs B{s['B_eq']} x "
                f"N{s['N_eq']} - {rows[0].get('gpu')} - {rows[0].get('commit')} - "
                f"{rows[0].get('date')}", path)


# --------------------------------------------------------------------------- command line

def cases_from_args(args) -> list[VarlenCase]:
    """The cases the options ask for, or ValueError naming the option at fault."""
    lo, hi = args.varlen_lengths
    for name, value, low, why in (
            ("--varlen-lengths LO", lo, 1, "1"),
            ("--varlen-lengths HI", hi, 2 * lo, f"2 x LO = {2 * lo} (room to shorten a draw "
                                               "and still leave LO for the last sequence)"),
            ("--varlen-tokens", args.varlen_tokens, lo, f"LO = {lo}"),
            ("--varlen-seed", args.varlen_seed, 0, "0")):
        if value < low:
            raise ValueError(f"{name} must be >= {why}, got {value}")
    pack = draw_pack(args.varlen_tokens, args.varlen_seed, args.varlen_dist, lo, hi)
    try:
        return varlen_cases(pack, args.varlen_dims, args.varlen_heads, args.varlen_masks,
                            args.dtype)
    except ValueError as e:
        raise ValueError(f"--varlen-dims: {e}") from None  # heads and masks are choices


def args_error(args) -> str | None:
    """Why the varlen options cannot run, or None (checked before looking for a GPU)."""
    try:
        cases_from_args(args)
    except ValueError as e:
        return str(e)
    return None


def main(args) -> int:
    """Run the varlen benchmark (a CUDA GPU is checked for by the caller)."""
    from tqdm import tqdm

    from . import ceilings as ceil_mod
    from .env import stamp as make_stamp
    from .report import exit_status
    from .timing import cuda_timer

    try:
        cases = cases_from_args(args)
    except ValueError as e:
        print(f"wsattn bench varlen: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    stamp = make_stamp(device)
    timer = cuda_timer(args.warmup_ms, args.rep_ms, args.timing)
    impls = list(args.varlen_impl)
    pack = cases[0].pack
    print(f"wsattn bench varlen on {stamp['gpu']}, torch {stamp['torch']}, triton "
          f"{stamp['triton']}, commit {stamp['commit']}: {pack.num_seqs} sequences "
          f"({pack.dist}, seed {pack.seed}) {list(pack.lengths)}, equal-length B "
          f"{pack.b_eq} x N {pack.n_eq}; {len(cases)} shapes x {impls}", file=sys.stderr)
    rows, mm = ceil_mod.matmul_ceiling_rows(timer, device, stamp)
    for case in tqdm(cases, desc="wsattn bench varlen", file=sys.stderr, dynamic_ncols=True):
        rows += run_case(case, impls, timer, stamp, device, mm)
    add_ratios(rows)
    print(format_table(rows))
    write(rows, stamp, args, plot_rows)
    return exit_status(rows, WSATTN_IMPLS.__contains__)


def add_arguments(group) -> None:
    group.add_argument("--varlen-tokens", type=int, default=TOKENS, metavar="T",
                       help=f"varlen: tokens in the pack (default {TOKENS})")
    group.add_argument("--varlen-lengths", nargs=2, type=int, default=list(LENGTHS),
                       metavar=("LO", "HI"),
                       help=f"varlen: sequence lengths drawn in [LO, HI] (default "
                            f"{LENGTHS[0]} {LENGTHS[1]}; HI >= 2 LO)")
    group.add_argument("--varlen-dist", choices=DISTS, default=DISTS[0],
                       help="varlen: distribution of the lengths (default loguniform)")
    group.add_argument("--varlen-seed", type=int, default=SEED, metavar="SEED",
                       help=f"varlen: seed of the lengths (default {SEED})")
    group.add_argument("--varlen-dims", nargs="+", type=int, default=list(DIMS), metavar="D",
                       help=f"varlen: head dims (default {' '.join(map(str, DIMS))})")
    group.add_argument("--varlen-heads", nargs="+", choices=tuple(HEADS), default=list(HEADS),
                       metavar="HEADS",
                       help="varlen: mha (H = 2048 / D, as bench prefill) and/or gqa (Hq 32, "
                            "Hkv 8) (default both)")
    group.add_argument("--varlen-masks", nargs="+", choices=MASKS, default=list(MASKS),
                       metavar="MASK", help="varlen: causal and/or full (default both)")
    group.add_argument("--varlen-impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                       metavar="IMPL", help=f"varlen: columns (default all: {' '.join(IMPLS)})")
