"""A decode step's attention input in one launch: QKV projection, FlashNorm scale, bias,
QK-norm, rotary embedding, q written out and k/v appended to the (paged) KV cache.

For M rows x (one new token each; several rows may belong to one sequence):

    qkv = x @ Wqkv^T                        Wqkv [(Hq + 2 Hkv) * D, K]: q heads, k heads, v heads
    qkv *= 1 / rms(x)                       NORM: the input RMSNorm folded into Wqkv (FlashNorm)
    qkv += bqkv                             BIAS (Qwen2)
    q, k = rmsnorm_D(q) * q_norm, ...       QK_NORM (Qwen3), over each head's D values
    q, k = rope(q, pos), rope(k, pos)       transformers' convention: rotate_half over (i, i + D/2)
    q_out[m] = q;  cache[slot(m)] = k, v    slot: position pos[m] of sequence b(m)

Program decomposition: program (h, s, mb) owns head h of the Hq + 2 Hkv output heads
(D rows of Wqkv), the s-th of SPLIT_K slices of K and the mb-th block of BLOCK_M rows.
A head is computed as two halves, rows [0, D/2) and [D/2, D), in two accumulators, so
rotate_half pairs (i, i + D/2) sit in the same registers of the same program and the
per-head norm sees the whole head. Each Wqkv element is read once per row block (once
in all for M <= 64), 16 bytes at a time along K.

With SPLIT_K > 1 (to fill the GPU when Hq + 2 Hkv heads are fewer than the SMs) each
program stores its partial [BLOCK_M, D] sums and x's partial sum of squares in an fp32
workspace and bumps a per-(head, row block) counter; the last of the SPLIT_K programs to
arrive adds the partials in the fixed order s = 0..SPLIT_K-1 (so the result does not
depend on arrival order: replays are bitwise equal), runs the epilogue and resets the
counter to 0 for the next launch. The workspace and counters are either the caller's
(``workspace=``, a :class:`QkvRopeWorkspace` from :func:`qkv_rope_workspace`: what a
CUDA graph captures should own its buffers) or cached per device and grown on demand
(``_workspace``; concurrent launches on different streams of one device must not
overlap, and a captured graph must not outlive a growth of it).

PDL (sm_90+): the first Wqkv tile is loaded before ``gdc_wait`` (weights do not depend
on the previous kernel; x and positions do), and dependents are released right after the
wait, since their own ``gdc_wait`` waits for this grid to finish anyway. The second
launches below (``_norm_rope_append_kernel``, ``_rope_finish_kernel``) read the positions,
sequence indices, block table and inv_freq and form cos / sin and the cache slots before
their wait (``_rope_prep``): their predecessor is the projection, which writes none of
those and releases them only after its own wait, so whatever wrote them is done.

Two more paths, chosen by :func:`default_settings` on sm_90 (where each measured faster
than this kernel) or by ``settings``:

* the two-launch path (``TwoLaunchSettings``; always for OLMoE's QK-norm over the whole
  projection, which no head's program sees): ``gemv`` projects x with the FlashNorm scale
  into x's dtype, then ``_norm_rope_append_kernel`` runs one program per (row, head) for
  the bias, the QK-norm, RoPE, the q store and the append;
* the GEMV-epilogue path (``GemvRopeSettings``; per-head QK-norm only where a program
  holds whole heads, no QK-norm over the whole projection): ``_gemv_rope_kernel`` streams
  Wqkv as gemv does, each program's columns chosen as rotate_half pairs of one head, and
  runs the two-launch path's epilogue on its own tile (``_rope_finish_kernel`` does it
  after a split-K projection): one launch, the two-launch path's bits without QK-norm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..rope import rope_inv_freq  # noqa: F401  (part of this module's API)
from ..target import Target, UnsupportedTargetError, target_of
from ..testing import DTYPES, dtype_name
from ._alloc import empty
from ._intmath import cdiv, next_pow2
from ._overlap import check_caches, check_distinct, overlaps
from ._precision import F32_DOT, check_eps
from . import gemv as _gemv
from .gemv import GemvSettings, accumulate, gemv, store_partials, stream_w, sum_partials


@triton.jit
def _fence_acq_rel():
    # every thread's partial stores ordered before the counter bump (and the last
    # program's loads after it), as the CUDA threadFenceReduction pattern does
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _tile(acc_lo, acc_hi, ss, x_ptr, rows, row_live, stride_xm, M, k0, k_hi, w_lo_t, w_hi_t,
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
          USE_DOT: tl.constexpr):
    kk = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    if USE_DOT:
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_live[:, None],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        # "swap AB": the weight tile is the MMA's wide M operand, x^T its narrow N side
        xt = tl.trans(x)  # [BLOCK_K, BLOCK_M]
        acc_lo = tl.dot(w_lo_t, xt, acc_lo, input_precision=F32_DOT)  # [D/2, BLOCK_M]
        acc_hi = tl.dot(w_hi_t, xt, acc_hi, input_precision=F32_DOT)
        if NORM:  # FlashNorm: x's sum of squares accumulates as x streams
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)  # [BLOCK_M]
    else:
        # a few rows in one row block from row 0 (the launcher's rule): the GEMV's per-row
        # FMA reduction, the two halves as its gate and up tiles; no padding of M to 16
        acc_lo, acc_hi, ss = accumulate(acc_lo, acc_hi, ss, w_lo_t, w_hi_t, x_ptr,
                                        rows * stride_xm, row_live, stride_xm, M, kk,
                                        kk < k_hi, BLOCK_M, False, NORM, True, False)
    return acc_lo, acc_hi, ss


@triton.jit
def _rope_prep(h, j, rows, row_live, inv_freq_ptr, pos_ptr, seq_ptr, bt_ptr, stride_kb,
               stride_kl, stride_kh, stride_vb, stride_vl, stride_vh, stride_btb,
               HQ: tl.constexpr, HKV: tl.constexpr, PAGED: tl.constexpr,
               PAGE_SIZE: tl.constexpr, SEQ_INDEX: tl.constexpr):
    # The part of head h's epilogue that reads only the position side (positions, sequence
    # indices, the block table, inv_freq), none of the projection, so a kernel whose
    # projection comes from its predecessor can form it before its PDL wait: the rotary
    # cos / sin [BLOCK_M, P] of columns j (q and k heads; zeros, never read, for a v head)
    # and each row's cache slot [BLOCK_M] for head h, an int64 element offset from kc_ptr
    # (k heads) or vc_ptr (v heads; zeros, never read, for a q head). A q head's q_out row
    # stays in _epilogue: an offset that came out of this branch would lose what the
    # compiler knows of its alignment, and with it the q store's 16-byte vectors. The slot
    # comes first: its page-table load waits on the position load, and the cos / sin
    # arithmetic then covers its latency.
    pos = tl.load(pos_ptr + rows, mask=row_live, other=0)  # [BLOCK_M] int32
    if h < HQ:
        slot = tl.zeros([rows.shape[0]], dtype=tl.int64)
    else:
        if SEQ_INDEX:
            b = tl.load(seq_ptr + rows, mask=row_live, other=0)  # [BLOCK_M]
        else:
            b = rows
        if PAGED:
            page = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + pos // PAGE_SIZE,
                           mask=row_live, other=0).to(tl.int64)  # [BLOCK_M]
            off = (pos % PAGE_SIZE).to(tl.int64)
        else:
            page = b.to(tl.int64)
            off = pos.to(tl.int64)
        if h < HQ + HKV:
            slot = page * stride_kb + off * stride_kl + (h - HQ) * stride_kh
        else:
            slot = page * stride_vb + off * stride_vl + (h - HQ - HKV) * stride_vh
    if h < HQ + HKV:
        # the angle as transformers forms it: an fp32 product of position and frequency
        ang = pos.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + j)[None, :]  # [BLOCK_M, P]
        c = tl.cos(ang)
        sn = tl.sin(ang)
    else:
        c = tl.zeros([rows.shape[0], j.shape[0]], dtype=tl.float32)
        sn = c
    return c, sn, slot


@triton.jit
def _epilogue(h, j, acc_lo, acc_hi, ss, c, sn, slot, rows, row_live, K, norm_eps, qk_eps,
              b_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr, stride_qm, stride_qh,
              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              NORM: tl.constexpr, BIAS: tl.constexpr, QK_NORM: tl.constexpr):
    # Head h's columns j and HALF + j (the rotate_half pairs; j [P] within the half head,
    # all D/2 of them where QK_NORM, which needs the whole head) for rows [BLOCK_M]:
    # acc_lo / acc_hi [BLOCK_M, P] fp32 -> scale, bias, QK-norm, RoPE, q store or append,
    # with c, sn, slot from _rope_prep for the same h, j and rows.
    HALF: tl.constexpr = D // 2
    if NORM:
        r = 1.0 / tl.sqrt(ss / K + norm_eps)  # [BLOCK_M]
        acc_lo = acc_lo * r[:, None]
        acc_hi = acc_hi * r[:, None]
    if BIAS:
        acc_lo += tl.load(b_ptr + h * D + j).to(tl.float32)[None, :]
        acc_hi += tl.load(b_ptr + h * D + HALF + j).to(tl.float32)[None, :]
    if h < HQ + HKV:  # a q or k head: QK-norm, then RoPE
        if QK_NORM:
            if h < HQ:
                g_lo = tl.load(qn_ptr + j).to(tl.float32)
                g_hi = tl.load(qn_ptr + HALF + j).to(tl.float32)
            else:
                g_lo = tl.load(kn_ptr + j).to(tl.float32)
                g_hi = tl.load(kn_ptr + HALF + j).to(tl.float32)
            hss = tl.sum(acc_lo * acc_lo, 1) + tl.sum(acc_hi * acc_hi, 1)  # [BLOCK_M]
            hr = 1.0 / tl.sqrt(hss / D + qk_eps)
            acc_lo = acc_lo * hr[:, None] * g_lo[None, :]
            acc_hi = acc_hi * hr[:, None] * g_hi[None, :]
        # The rotation with its contraction spelled out. Left to the compiler, which of the
        # two products fuses into the FMA follows the surrounding code, and the kernels
        # sharing this epilogue, whose paths must agree bit for bit, rounded differently
        # (notes/decode_step.md).
        lo = tl.fma(acc_lo, c, acc_hi * -sn)  # the product rounded once, as -(acc_hi * sn)
        hi = tl.fma(acc_hi, c, acc_lo * sn)
    else:
        lo = acc_lo
        hi = acc_hi
    if h < HQ:
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm + h * stride_qh
        tl.store(q_rows + j[None, :], lo.to(q_ptr.dtype.element_ty), mask=row_live[:, None])
        tl.store(q_rows + HALF + j[None, :], hi.to(q_ptr.dtype.element_ty),
                 mask=row_live[:, None])
    else:
        if h < HQ + HKV:
            dst = kc_ptr + slot  # [BLOCK_M]
        else:
            dst = vc_ptr + slot
        tl.store(dst[:, None] + j[None, :], lo.to(kc_ptr.dtype.element_ty),
                 mask=row_live[:, None])
        tl.store(dst[:, None] + HALF + j[None, :], hi.to(kc_ptr.dtype.element_ty),
                 mask=row_live[:, None])


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, qn_ptr, kn_ptr, inv_freq_ptr, pos_ptr, seq_ptr,
                     q_ptr, kc_ptr, vc_ptr, bt_ptr, ws_ptr, ss_ws_ptr, count_ptr,
                     M, K, SPLIT_TILES, norm_eps, qk_eps,
                     stride_xm, stride_wn, stride_qm, stride_qh,
                     stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                     stride_btb,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     NORM: tl.constexpr, BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                     PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SEQ_INDEX: tl.constexpr,
                     PDL: tl.constexpr, FENCE: tl.constexpr, STAGES: tl.constexpr,
                     USE_DOT: tl.constexpr = True):
    # SPLIT_TILES: BLOCK_K tiles of K per split (so every split starts BLOCK_K-aligned and
    # the compiler can prove 16-byte alignment); the last split may be shorter or empty. stride_kb / stride_vb step a page (paged) or a sequence (contiguous).
    HALF: tl.constexpr = D // 2
    h = tl.program_id(0)
    s = tl.program_id(1)
    mb = tl.program_id(2)
    j = tl.arange(0, HALF)  # [D/2]
    kk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_live = rows < M
    # row bases only: a [D/2, BLOCK_K] tile of 64-bit pointers held across the loop would
    # cost 128 registers a thread at 4 warps
    w_lo = w_ptr + (h * D + j).to(tl.int64)[:, None] * stride_wn  # [D/2, 1]
    w_hi = w_lo + HALF * stride_wn
    k_lo = s * SPLIT_TILES * BLOCK_K
    k_hi = tl.minimum(k_lo + SPLIT_TILES * BLOCK_K, K)

    acc_lo = tl.zeros([HALF, BLOCK_M], dtype=tl.float32)  # transposed while streaming
    acc_hi = tl.zeros([HALF, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    # The first tile is peeled off the loop so that, with PDL, its weight loads are in
    # flight before the wait: weights do not depend on the previous kernel, x does.
    first = k_lo < k_hi  # an empty last split reads nothing
    w_lo_t = tl.load(w_lo + (k_lo + kk)[None, :], mask=first, other=0.0)  # [D/2, BLOCK_K]
    w_hi_t = tl.load(w_hi + (k_lo + kk)[None, :], mask=first, other=0.0)
    if PDL:
        # From here on this grid reads the previous kernel's outputs (x, positions) and
        # writes. Dependents may launch at once: their own gdc_wait waits for this whole
        # grid, so they only start loading their weights early.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc_lo, acc_hi, ss = _tile(acc_lo, acc_hi, ss, x_ptr, rows, row_live & first, stride_xm, M,
                               k_lo, k_hi, w_lo_t, w_hi_t, BLOCK_M, BLOCK_K, NORM, USE_DOT)
    # tl.range with num_stages: Triton 3.6 does not pipeline this loop unless asked (the
    # weight tiles went through registers, no cp.async in the sm_90 PTX, and spilled)
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        w_lo_t = tl.load(w_lo + (k0 + kk)[None, :])  # [D/2, BLOCK_K]
        w_hi_t = tl.load(w_hi + (k0 + kk)[None, :])
        acc_lo, acc_hi, ss = _tile(acc_lo, acc_hi, ss, x_ptr, rows, row_live, stride_xm, M,
                                   k0, k_hi, w_lo_t, w_hi_t, BLOCK_M, BLOCK_K, NORM, USE_DOT)
    acc_lo = tl.trans(acc_lo)  # [BLOCK_M, D/2]
    acc_hi = tl.trans(acc_hi)

    if SPLIT_K == 1:
        # The position side after the loop: cos / sin held across it would cost its
        # registers, and the wait before the loop guards the positions, which the launch
        # before this one may have written.
        c, sn, slot = _rope_prep(h, j, rows, row_live, inv_freq_ptr, pos_ptr, seq_ptr, bt_ptr,
                                 stride_kb, stride_kl, stride_kh, stride_vb, stride_vl,
                                 stride_vh, stride_btb, HQ, HKV, PAGED, PAGE_SIZE, SEQ_INDEX)
        _epilogue(h, j, acc_lo, acc_hi, ss, c, sn, slot, rows, row_live, K, norm_eps, qk_eps,
                  b_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr, stride_qm, stride_qh, HQ, HKV,
                  D, NORM, BIAS, QK_NORM)
    else:
        r = tl.arange(0, BLOCK_M)
        tile = h * tl.num_programs(2) + mb  # this (head, row block)'s counter
        ws_tile = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * D)  # [SPLIT_K, BLOCK_M, D]
        ss_tile = ss_ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M)  # [SPLIT_K, BLOCK_M]
        part = ws_tile + s * (BLOCK_M * D) + r[:, None] * D + j[None, :]  # [BLOCK_M, D/2]
        tl.store(part, acc_lo)
        tl.store(part + HALF, acc_hi)
        if NORM:
            tl.store(ss_tile + s * BLOCK_M + r, ss)
        if FENCE:
            _fence_acq_rel()
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of this tile's splits: reduce, finish
            if FENCE:
                _fence_acq_rel()
            acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
            acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for t in tl.static_range(SPLIT_K):  # fixed order: bitwise-reproducible
                part = ws_tile + t * (BLOCK_M * D) + r[:, None] * D + j[None, :]
                acc_lo += tl.load(part, cache_modifier=".cg")
                acc_hi += tl.load(part + HALF, cache_modifier=".cg")
                if NORM:
                    ss += tl.load(ss_tile + t * BLOCK_M + r, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
            c, sn, slot = _rope_prep(h, j, rows, row_live, inv_freq_ptr, pos_ptr, seq_ptr,
                                     bt_ptr, stride_kb, stride_kl, stride_kh, stride_vb,
                                     stride_vl, stride_vh, stride_btb, HQ, HKV, PAGED,
                                     PAGE_SIZE, SEQ_INDEX)
            _epilogue(h, j, acc_lo, acc_hi, ss, c, sn, slot, rows, row_live, K, norm_eps,
                      qk_eps, b_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr, stride_qm,
                      stride_qh, HQ, HKV, D, NORM, BIAS, QK_NORM)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class QkvRopeSettings:
    """Launch settings: BLOCK_K (K per tile, a power of two dividing K), split_k (slices of
    K per head, >= 1; 1 means no workspace and no counters), num_warps, num_stages;
    use_dot: tl.dot with the rows padded to 16 (the default), else the GEMV's per-row FMA
    reduction over one block of the M <= FMA_MAX_ROWS rows (no padding)."""
    BLOCK_K: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = True

    def __post_init__(self):
        for name in ("BLOCK_K", "split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"QkvRopeSettings.{name} must be a positive int, got {value!r}")
        for name in ("BLOCK_K", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"QkvRopeSettings.{name} must be a power of two, got {value}")
        if self.BLOCK_K < 16:
            raise ValueError(f"QkvRopeSettings.BLOCK_K must be >= 16 (tl.dot's minimum, and "
                             f"x's K is a multiple of 16), got {self.BLOCK_K}")
        if self.split_k > MAX_SPLIT_K:
            raise ValueError(f"QkvRopeSettings.split_k must be <= {MAX_SPLIT_K}, got "
                             f"{self.split_k}")
        if not isinstance(self.use_dot, bool):
            raise ValueError(f"QkvRopeSettings.use_dot must be a bool, got {self.use_dot!r}")


@dataclass(frozen=True)
class TwoLaunchSettings:
    """The two-launch path for any family: ``gemv`` projects x (FlashNorm scale in its
    epilogue, rounded to x's dtype), then one kernel of (row, head) programs applies the
    bias, the QK-norm and RoPE and appends to the cache. OLMoE's whole-projection norm
    always takes it; elsewhere it is the A/B against the fused one-launch kernel.
    gemv: the projection's GemvSettings (None: gemv's defaults)."""
    gemv: GemvSettings | None = None


@dataclass(frozen=True)
class GemvRopeSettings:
    """The GEMV-epilogue path: gemv's stream of Wqkv with each program's columns chosen as
    rotate_half pairs of one head, and the bias, RoPE, the q store and the append in its
    epilogue: one launch, or gemv's two where the settings split K (the finish does the
    epilogue then). Per-head QK-norm (Qwen3) needs a whole head's sum of squares: taken
    where a program holds whole heads, i.e. where K is split (each finish program holds
    one head) or BLOCK_N equals the head dim, and refused by name elsewhere; OLMoE's norm
    over the whole projection is refused. gemv: the
    projection's GemvSettings (None: gemv's defaults, BLOCK_N capped at the head dim); its
    BLOCK_N must divide the head dim."""
    gemv: GemvSettings | None = None


MAX_BLOCK_M = 64  # rows per program; more rows take more row blocks (Wqkv read per block)
MAX_SPLIT_K = 16
MIN_SPLIT_TILES = 4  # K tiles per split at least, so the pipeline's prologue stays small
PROGRAMS_PER_SM = 2


FMA_MAX_ROWS = 8  # the FMA path's single row block (its loop is unrolled per row)


@triton.jit
def _norm_rope_append_kernel(qkv_ptr, b_ptr, qn_ptr, kn_ptr, inv_freq_ptr, pos_ptr, seq_ptr,
                             q_ptr, kc_ptr, vc_ptr, bt_ptr, M, qk_eps, stride_xm, stride_qm,
                             stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl,
                             stride_vh, stride_btb, HQ: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, WHOLE: tl.constexpr,
                             BIAS: tl.constexpr, QK_NORM: tl.constexpr, PAGED: tl.constexpr,
                             PAGE_SIZE: tl.constexpr, SEQ_INDEX: tl.constexpr,
                             PDL: tl.constexpr, QW: tl.constexpr, KW: tl.constexpr):
    # The second launch of the two-launch path: grid (cdiv(M, BLOCK_M), HQ + 2 * HKV), one
    # head of BLOCK_M projected rows [(Hq + 2*Hkv) * D] (gemv's output, FlashNorm scale
    # applied) a program -> bias (BIAS), per-head RMSNorm (QK_NORM) or RMSNorm over the
    # whole q or the whole k projection (WHOLE, OLMoE), then _epilogue's RoPE, q store and
    # cache append. Under WHOLE each q (k) head's program sums the squares of the whole
    # q (k) row itself, from the projection in L2 (Hq * D values a row), so no program
    # waits on another and the heads' epilogues run side by side; one program walking
    # every head in turn chained 48 epilogues' latencies (~0.13 ms a call at the OLMoE
    # shape in the ladder). QW, KW: Hq * D and Hkv * D rounded up to powers of two.
    HALF: tl.constexpr = D // 2
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_live = rows < M
    live = row_live[:, None]
    j = tl.arange(0, HALF)  # [D/2]
    # Before the wait: the position side reads nothing of the projection, only positions,
    # sequence indices and the block table (copied in, or written by kernels at least two
    # launches back) and the constant inv_freq. Under PDL this grid launches once every
    # program of its predecessor (the projection) has released it, which each does after
    # its own gdc_wait, so every kernel before that one has completed and its writes are
    # visible: the loads and the cos / sin overlap the projection's tail.
    c, sn, slot = _rope_prep(h, j, rows, row_live, inv_freq_ptr, pos_ptr, seq_ptr, bt_ptr,
                             stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                             stride_btb, HQ, HKV, PAGED, PAGE_SIZE, SEQ_INDEX)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the rows come from the projection before
        tl.extra.cuda.gdc_launch_dependents()
    base = qkv_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    lo = tl.load(base + h * D + j[None, :], mask=live, other=0.0).to(tl.float32)
    hi = tl.load(base + h * D + HALF + j[None, :], mask=live, other=0.0).to(tl.float32)
    if WHOLE:
        if h < HQ:
            cq = tl.arange(0, QW)
            whole = tl.load(base + cq[None, :], mask=live & (cq < HQ * D)[None, :],
                            other=0.0).to(tl.float32)  # [BLOCK_M, QW]: the whole q row
            r = 1.0 / tl.sqrt(tl.sum(whole * whole, 1) / (HQ * D) + qk_eps)  # [BLOCK_M]
            lo = lo * r[:, None] * tl.load(qn_ptr + h * D + j).to(tl.float32)[None, :]
            hi = hi * r[:, None] * tl.load(qn_ptr + h * D + HALF + j).to(tl.float32)[None, :]
        elif h < HQ + HKV:
            ck = tl.arange(0, KW)
            whole = tl.load(base + HQ * D + ck[None, :], mask=live & (ck < HKV * D)[None, :],
                            other=0.0).to(tl.float32)  # [BLOCK_M, KW]: the whole k row
            r = 1.0 / tl.sqrt(tl.sum(whole * whole, 1) / (HKV * D) + qk_eps)
            g = kn_ptr + (h - HQ) * D
            lo = lo * r[:, None] * tl.load(g + j).to(tl.float32)[None, :]
            hi = hi * r[:, None] * tl.load(g + HALF + j).to(tl.float32)[None, :]
    zero = tl.zeros([BLOCK_M], dtype=tl.float32)
    _epilogue(h, j, lo, hi, zero, c, sn, slot, rows, row_live, 1, 0.0, qk_eps, b_ptr, qn_ptr,
              kn_ptr, q_ptr, kc_ptr, vc_ptr, stride_qm, stride_qh, HQ=HQ, HKV=HKV, D=D,
              NORM=False, BIAS=BIAS, QK_NORM=QK_NORM)


@triton.jit
def _gemv_scale(lo, hi, ss, K, eps, q_ptr, NORM: tl.constexpr):
    # The GEMV-epilogue path's projection as the two-launch path's gemv leaves it, for its
    # one-pass kernel and its split-K finish: lo / hi [BLOCK_M, P] fp32 sums, ss [BLOCK_M]
    # x's sums of squares -> gemv's FlashNorm scale and its rounding into x's dtype, so
    # that _epilogue then does the epilogue kernel's arithmetic step for step and the
    # paths agree.
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)[:, None]  # as gemv's _finish forms it
        lo = lo * rstd
        hi = hi * rstd
    lo = lo.to(q_ptr.dtype.element_ty).to(tl.float32)
    hi = hi.to(q_ptr.dtype.element_ty).to(tl.float32)
    return lo, hi


@triton.jit
def _gemv_rope_kernel(x_ptr, w_ptr, b_ptr, qn_ptr, kn_ptr, inv_freq_ptr, pos_ptr, seq_ptr,
                      q_ptr, kc_ptr, vc_ptr, bt_ptr, ws_ptr, ss_ptr, M, K, eps, qk_eps,
                      stride_xm, stride_wn, stride_qm, stride_qh, stride_kb, stride_kl,
                      stride_kh, stride_vb, stride_vl, stride_vh, stride_btb,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr,
                      BIAS: tl.constexpr, QK_NORM: tl.constexpr, PAGED: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, SEQ_INDEX: tl.constexpr, PDL: tl.constexpr,
                      STAGES: tl.constexpr, PDL_LATE: tl.constexpr):
    # The GEMV-epilogue path: grid ((HQ + 2 HKV) * D / BLOCK_N, SPLIT_K), gemv's stream of
    # W rows, but a program's BLOCK_N rows are P = BLOCK_N / 2 rotate_half pairs of one
    # head (BLOCK_N <= D): tile rows [0, P) are its columns c0 + i, rows [P, 2P) columns
    # D/2 + c0 + i. Both halves of every pair sit in one program, so RoPE needs no other
    # program and the projection, bias, RoPE, the q store and the append are one launch
    # (with SPLIT_K > 1 the partials go to gemv's workspace and _rope_finish_kernel does
    # the epilogue). W is read as by gemv: 16-byte loads along K, any row order. QK_NORM
    # needs the whole head's sum of squares: unsplit only with BLOCK_N == D.
    P: tl.constexpr = BLOCK_N // 2
    HALF: tl.constexpr = D // 2
    NOUT: tl.constexpr = (HQ + 2 * HKV) * D
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = pid_n // (HALF // P)
    c0 = (pid_n % (HALF // P)) * P
    r = tl.arange(0, BLOCK_N)
    n = h * D + c0 + r % P + (r // P) * HALF  # [BLOCK_N] the W rows (output columns)
    n_live = n < NOUT
    acc, _, ss = stream_w(x_ptr, w_ptr, n, n_live, pid_k, M, NOUT, K, stride_xm, stride_wn,
                          BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, NORM, False, PDL,
                          STAGES, PDL_LATE)
    if SPLIT_K == 1:
        tl.static_assert(P == HALF or not QK_NORM, "QK-norm unsplit needs BLOCK_N == D")
        # [BLOCK_N, BLOCK_M] -> the halves [P, BLOCK_M] (row r of the tile is (r // P, r % P))
        lo, hi = tl.split(tl.permute(tl.reshape(acc, [2, P, BLOCK_M]), [1, 2, 0]))
        lo, hi = _gemv_scale(tl.trans(lo), tl.trans(hi), ss, K, eps, q_ptr, NORM)
        # The position side after the weight loop, not before the wait as the finish forms
        # it: the launch before this one may have written the positions, and cos / sin held
        # across the loop would cost its registers.
        j = c0 + tl.arange(0, P)
        rows = tl.arange(0, BLOCK_M)
        row_live = rows < M
        c, sn, slot = _rope_prep(h, j, rows, row_live, inv_freq_ptr, pos_ptr, seq_ptr, bt_ptr,
                                 stride_kb, stride_kl, stride_kh, stride_vb, stride_vl,
                                 stride_vh, stride_btb, HQ, HKV, PAGED, PAGE_SIZE, SEQ_INDEX)
        _epilogue(h, j, lo, hi, tl.zeros_like(ss), c, sn, slot, rows, row_live, 1, 0.0, qk_eps,
                  b_ptr, qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr, stride_qm, stride_qh, HQ, HKV,
                  D, False, BIAS, QK_NORM)
    else:
        mi = tl.arange(0, BLOCK_M)
        mask = n_live[:, None] & (mi < M)[None, :]
        store_partials(ws_ptr, ss_ptr, acc, acc, ss, n, mask, pid_n, pid_k, M, NOUT, BLOCK_M,
                       NORM, False)


@triton.jit
def _rope_finish_kernel(ws_ptr, ss_ptr, b_ptr, qn_ptr, kn_ptr, inv_freq_ptr, pos_ptr, seq_ptr,
                        q_ptr, kc_ptr, vc_ptr, bt_ptr, M, K, eps, qk_eps, stride_qm, stride_qh,
                        stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                        stride_btb, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, P: tl.constexpr, SPLIT_K: tl.constexpr,
                        NORM: tl.constexpr, BIAS: tl.constexpr, QK_NORM: tl.constexpr,
                        PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SEQ_INDEX: tl.constexpr,
                        PDL: tl.constexpr):
    # The split-K GEMV's second launch on the GEMV-epilogue path, in place of gemv's
    # _splitk_finish_kernel: grid ((HQ + 2 HKV) * D / (2 P), cdiv(M, BLOCK_M)), P pairs of
    # one head and a block of rows a program (P = D/2, the whole head, with QK_NORM), the
    # splits added in gemv's fixed order, then _gemv_scale and _epilogue.
    HALF: tl.constexpr = D // 2
    NOUT: tl.constexpr = (HQ + 2 * HKV) * D
    pid = tl.program_id(0)
    h = pid // (HALF // P)
    j = (pid % (HALF // P)) * P + tl.arange(0, P)  # [P]
    m0 = tl.program_id(1) * BLOCK_M
    mi = m0 + tl.arange(0, BLOCK_M)
    row_live = mi < M
    # Before the wait, as in _norm_rope_append_kernel: the position side reads only what
    # copies and kernels at least two launches back wrote (the projection's launch before
    # this one writes the partials alone), complete once every program of that launch,
    # each past its own gdc_wait, has released this grid.
    c, sn, slot = _rope_prep(h, j, mi, row_live, inv_freq_ptr, pos_ptr, seq_ptr, bt_ptr,
                             stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
                             stride_btb, HQ, HKV, PAGED, PAGE_SIZE, SEQ_INDEX)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the partials come from the launch before
        tl.extra.cuda.gdc_launch_dependents()
    mask = row_live[:, None] & (j < HALF)[None, :]  # [BLOCK_M, P]
    lo, _, ss = sum_partials(ws_ptr, ss_ptr, m0, h * D + j, mask, M, NOUT, BLOCK_M, P,
                             SPLIT_K, NORM, False)
    hi, _, _ = sum_partials(ws_ptr, ss_ptr, m0, h * D + HALF + j, mask, M, NOUT, BLOCK_M, P,
                            SPLIT_K, False, False)
    lo, hi = _gemv_scale(lo, hi, ss, K, eps, q_ptr, NORM)
    _epilogue(h, j, lo, hi, tl.zeros_like(ss), c, sn, slot, mi, row_live, 1, 0.0, qk_eps, b_ptr,
              qn_ptr, kn_ptr, q_ptr, kc_ptr, vc_ptr, stride_qm, stride_qh, HQ, HKV, D, False,
              BIAS, QK_NORM)


# rows a program of the two-launch path's second kernel takes, and its warps: one row, so
# that the whole-row sum of squares ([BLOCK_M, next_pow2(Hq * D)] fp32) stays in registers
# and decode's few rows spread over M x heads programs; two warps, the setting without
# spills at the OLMoE and Llama-1B head shapes compiled for sm_90 (69 registers; four warps
# spilled 4 bytes at D 64, two rows 24-28 at one or two warps)
EPILOGUE_BLOCK_M = 1
EPILOGUE_WARPS = 2


def _block_m(m: int, head_dim: int, use_dot: bool = True) -> int:
    if not use_dot:
        return next_pow2(max(m, 1))
    # at D = 256, 64 rows of the two fp32 half-head accumulators spilled on sm_90: 32 rows
    return max(16, min(MAX_BLOCK_M if head_dim <= 128 else 32, next_pow2(m)))


def _largest_pow2_dividing(n: int, cap: int) -> int:
    b = 16
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


@functools.lru_cache(maxsize=1024)
def default_settings(target: Target, *, rows: int, hidden: int, heads: int, head_dim: int,
                     dtype: torch.dtype, qk_norm: bool = False
                     ) -> QkvRopeSettings | TwoLaunchSettings | GemvRopeSettings:
    """The path and settings a call without ``settings`` takes, from (target, shape,
    dtype): rows = M, hidden = K, heads = Hq + 2 Hkv; qk_norm: per-head QK-norm (Qwen3).

    sm_90: the GEMV-epilogue path (:class:`GemvRopeSettings`), one launch where the
    two-launch path takes two (two where that takes three), unless its projection grid has
    more than GEMV_ROPE_MAX_PROGRAMS_PER_SM programs an SM, or the model has per-head
    QK-norm and the projection does not split K (then no program holds a whole head); the
    two-launch path there. H200 decode step, ms/token GEMV-epilogue / two-launch side by side
    (notes/decode_step.md): Llama-3.2-1B B1 1.023 / 1.030 (192 programs), B8 1.286 / 1.295,
    B64 ctx 1k 1.900 / 1.924; Llama-3.1-8B B8 5.747 / 5.747 (192 programs); Llama-3.1-8B
    B1 4.481 / 4.397 (384 programs: there decode's programs, released early and resident
    beside the projection with ~105 KB of shared memory each, plausibly leave room for
    fewer projection programs than its one wave needs; not profiled). The two-launch path
    against the fused kernel, side by side with PDL off (wsattn bench gemv
    --kernels qkv_rope --qkv-settings gemv; notes/decode_step.md), it beat the fused
    kernel at every measured shape: Llama-3.2-1B (K 2048, 48 heads of 64) 10.0 -> 9.5,
    13.1 -> 10.5, 21.0 -> 16.6 us at 1, 8, 64 rows; Llama-3.1-8B and Qwen3-8B (K 4096,
    48 heads of 128) 20.3 -> 18.2, 26.4 -> 20.1, 39.8 -> 27.8 us. The fused kernel's
    split-K programs each see one head and a slice of K, and pay the cross-program sum and
    its counters; gemv's tiles stream Wqkv nearer the copy ceiling and the (row, head)
    epilogue kernel costs 2-3 us. Elsewhere (not measured) the fused kernel,
    :func:`fused_settings`."""
    if target.backend == "cuda" and target.cc == 90:
        g = gemv_rope_settings(target, rows, hidden, heads, head_dim, dtype)
        if qk_norm and g.split_k == 1:
            return TwoLaunchSettings()  # no program would hold a whole head
        programs = heads * head_dim // g.BLOCK_N * g.split_k
        if programs > GEMV_ROPE_MAX_PROGRAMS_PER_SM * target.num_sms:
            return TwoLaunchSettings()
        return GemvRopeSettings()
    return fused_settings(target, rows=rows, hidden=hidden, heads=heads, head_dim=head_dim,
                          dtype=dtype)


GEMV_ROPE_MAX_PROGRAMS_PER_SM = 2  # see default_settings


@functools.lru_cache(maxsize=1024)
def fused_settings(target: Target, *, rows: int, hidden: int, heads: int, head_dim: int,
                   dtype: torch.dtype) -> QkvRopeSettings:
    """The fused one-launch kernel's settings from (target, shape, dtype): rows = M,
    hidden = K, heads = Hq + 2 Hkv."""
    if target.backend == "interpreter":
        # small tiles, so that tiny test shapes still cross several tiles
        return QkvRopeSettings(BLOCK_K=_largest_pow2_dividing(hidden, 32), split_k=1,
                               num_warps=4, num_stages=1)
    elem = torch.empty((), dtype=dtype).element_size()
    # One row: the FMA reduction (no padding of M to the MMA's 16). H200, Llama-3.2-1B
    # qkv (K 2048, 48 heads of 64) at BLOCK_K 128, split 4: 16.7 -> 9.9 us. At 8 rows it
    # ran 36 us against 17 with tl.dot (notes/decode_step.md), so only M = 1 takes it.
    fma = rows == 1 and target.cc >= 90
    # A stage holds the two [D/2, BLOCK_K] weight halves, 16 KB: 4 stages + the x tiles
    # are 90-115 KB of shared memory (two programs an SM on sm_90), and 8 warps keep the
    # M = 64 build at 210 registers without spills (4 warps with 32 KB stages spilled).
    block_k = _largest_pow2_dividing(hidden, max(16, (16 * 1024) // (head_dim * elem)))
    block_m = _block_m(rows, head_dim, use_dot=not fma)
    programs = heads * cdiv(rows, block_m)
    tiles = hidden // block_k
    split = cdiv(PROGRAMS_PER_SM * target.num_sms, programs)
    split = max(1, min(split, MAX_SPLIT_K, tiles // MIN_SPLIT_TILES))
    warps = 8
    stages = 4 if target.cc >= 90 else 3
    if not fma and head_dim <= 64 and block_m <= 16 and target.cc >= 90:
        # Half heads of 32 rows: narrower K tiles, deeper pipeline, 8 splits. H200,
        # Llama-3.2-1B qkv at 2, 4 and 8 rows: 17.0 -> 13.1 us (the same settings at head
        # dim 128, Llama-3.1-8B, ran 26.5 against 24.6: they stay as above there).
        block_k, warps, stages = _largest_pow2_dividing(hidden, 64), 4, 6
        split = max(1, min(8, (hidden // block_k) // MIN_SPLIT_TILES))
    return QkvRopeSettings(BLOCK_K=block_k, split_k=split, num_warps=warps, num_stages=stages,
                           use_dot=not fma)


# --------------------------------------------------------------------------- host helpers


class QkvRopeWorkspace(NamedTuple):
    """Split-K scratch of :func:`qkv_rope_append` (see :func:`qkv_rope_workspace`).

    partials: fp32 [>= heads * row_blocks * split_k * BLOCK_M * D], each split's partial
        sums; ss: fp32 [>= heads * row_blocks * split_k * BLOCK_M], x's partial sums of
        squares; counters: int32 [>= heads * row_blocks], zero before the first launch
        (every launch leaves them at 0: the last program of a tile resets its counter,
        so CUDA-graph replays need no reset). All on the launch's device. Not to be
        shared by launches that may run at the same time (other streams).
    """
    partials: torch.Tensor
    ss: torch.Tensor
    counters: torch.Tensor


def workspace_size(rows: int, q_heads: int, kv_heads: int, head_dim: int,
                   settings) -> tuple[int, int, int]:
    """(partials, ss, counters) element counts one launch of ``rows`` rows with these
    settings needs; (0, 0, 0) when settings.split_k is 1 or the settings are
    TwoLaunchSettings or GemvRopeSettings (no workspace is read)."""
    if (isinstance(settings, (TwoLaunchSettings, GemvRopeSettings)) or settings.split_k <= 1
            or rows <= 0):
        return 0, 0, 0
    block_m = _block_m(rows, head_dim, settings.use_dot)
    tiles = (q_heads + 2 * kv_heads) * cdiv(rows, block_m)
    return (tiles * settings.split_k * block_m * head_dim, tiles * settings.split_k * block_m,
            tiles)


def qkv_rope_workspace(device, rows: int, q_heads: int, kv_heads: int, head_dim: int,
                       settings: QkvRopeSettings | None = None, *, hidden: int | None = None,
                       dtype: torch.dtype | None = None) -> QkvRopeWorkspace:
    """A workspace for every :func:`qkv_rope_append` call of 1..``rows`` rows on ``device``
    at this shape (Hq = q_heads, Hkv = kv_heads, D = head_dim), with ``settings``, or,
    when settings is None, with default_settings for K = ``hidden`` and x's ``dtype``
    (both required then). The sizes are the largest :func:`workspace_size` over those
    row counts (at least one element each, so the tensors are never empty); counters
    are zeroed. Allocate it before a CUDA graph capture and pass it to every launch the
    graph captures."""
    device = torch.device(device)
    for name, value in (("rows", rows), ("q_heads", q_heads), ("kv_heads", kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim not in HEAD_DIMS or isinstance(head_dim, bool):
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
    if settings is None and (isinstance(hidden, bool) or not isinstance(hidden, int)
                             or hidden < 16 or hidden % 16):
        raise ValueError(f"hidden must be a positive multiple of 16 (x's K) when settings is "
                         f"None, got {hidden!r}")
    if settings is None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES} (x's) when settings is None, got "
                         f"{dtype!r}")
    if settings is None:
        if hidden is None or dtype is None:
            raise ValueError("qkv_rope_workspace: give settings, or hidden and dtype for the "
                             "default settings")
        target = target_of(device)
        heads = q_heads + 2 * kv_heads
        pick = lambda m: default_settings(target, rows=m, hidden=hidden, heads=heads,  # noqa: E731
                                          head_dim=head_dim, dtype=dtype)
    elif not isinstance(settings, _SETTINGS):
        raise ValueError(f"settings must be a {_SETTINGS_NAMES}, got {type(settings).__name__}")
    else:
        pick = lambda m: settings  # noqa: E731
    need = [workspace_size(m, q_heads, kv_heads, head_dim, pick(m)) for m in range(1, rows + 1)]
    floats, ss_floats, counters = (max(1, *col) for col in zip(*need))
    return QkvRopeWorkspace(torch.empty(floats, dtype=torch.float32, device=device),
                            torch.empty(ss_floats, dtype=torch.float32, device=device),
                            torch.zeros(counters, dtype=torch.int32, device=device))


def _check_workspace(ws, device, need):
    if not isinstance(ws, QkvRopeWorkspace):
        raise ValueError(f"workspace must be a QkvRopeWorkspace (qkv_rope_workspace), got "
                         f"{type(ws).__name__}")
    for name, t, dtype, n in zip(QkvRopeWorkspace._fields, ws, (torch.float32, torch.float32,
                                                                torch.int32), need):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device \
                or not t.is_contiguous():
            raise ValueError(f"workspace.{name} must be a contiguous {dtype} tensor on "
                             f"{device}, got {getattr(t, 'dtype', type(t).__name__)} on "
                             f"{getattr(t, 'device', None)}")
        if t.numel() < n:
            raise ValueError(f"workspace.{name} holds {t.numel()} elements; this launch needs "
                             f"{n} (workspace_size; size it with qkv_rope_workspace for the "
                             "largest row count)")


# Eager callers' split-K workspace and counters, per device, grown on demand. The
# counters start at 0 and every launch leaves them at 0, so a CUDA graph can replay
# launches; but growing it frees what a captured graph reads, so captured code should
# pass its own workspace.
_WORKSPACES: dict = {}


def _workspace(device, floats: int, ss_floats: int, counters: int):
    key = (device.type, device.index)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < floats or ws[1].numel() < ss_floats \
            or ws[2].numel() < counters:
        old = ws or (torch.empty(0), torch.empty(0), torch.empty(0))
        ws = (torch.empty(max(floats, old[0].numel()), dtype=torch.float32, device=device),
              torch.empty(max(ss_floats, old[1].numel(), 1), dtype=torch.float32, device=device),
              torch.zeros(max(counters, old[2].numel()), dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


# --------------------------------------------------------------------------- launcher

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128, 256)


def _tensor(name, t, ndim, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (where x is)")
    if t.requires_grad:
        raise ValueError(f"{name} requires grad; this kernel has no backward")


def _check(x, wqkv, bqkv, q_norm, k_norm, norm_eps, qk_eps, inv_freq, positions, k_cache,
           v_cache, block_table, seq_index, q_out, pdl, qk_norm_whole=False):
    """Validates everything host metadata can show; returns (Hq, Hkv, D)."""
    _tensor("x", x, 2, _DTYPES)
    dev, dt = x.device, x.dtype
    M, K = x.shape
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dimension")
    if K == 0 or K % 16:
        raise ValueError(f"x: hidden size {K} must be a positive multiple of 16")
    _tensor("k_cache", k_cache, 4, (dt,), dev)
    _tensor("v_cache", v_cache, 4, (dt,), dev)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
                         f"{tuple(k_cache.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(3) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    check_caches(k_cache, v_cache, "two rows would be appended to one address",
                 ": each row's key and value are written to both")
    HKV, D = k_cache.shape[2], k_cache.shape[3]
    if D not in HEAD_DIMS:
        raise ValueError(f"k_cache: head dim {D} is not supported (one of {HEAD_DIMS})")
    if HKV < 1:
        raise ValueError("k_cache: needs at least one KV head")
    _tensor("wqkv", wqkv, 2, (dt,), dev)
    if wqkv.stride(1) != 1:
        raise ValueError("wqkv must have a contiguous last dimension")
    N = wqkv.shape[0]
    if wqkv.shape[1] != K:
        raise ValueError(f"wqkv must be [(Hq + 2*Hkv)*D, K] with K = {K} (x's hidden size), "
                         f"got {tuple(wqkv.shape)}")
    if N % D or N // D <= 2 * HKV or (N // D - 2 * HKV) % HKV:
        raise ValueError(f"wqkv: {N} rows are not (Hq + 2*Hkv)*D with D = {D}, Hkv = {HKV} "
                         "(from k_cache) and Hq a positive multiple of Hkv")
    HQ = N // D - 2 * HKV
    if bqkv is not None:
        _tensor("bqkv", bqkv, 1, _DTYPES, dev)
        if bqkv.shape[0] != N or bqkv.stride(0) != 1:
            raise ValueError(f"bqkv must be a contiguous [{N}] (wqkv's rows), got "
                             f"{tuple(bqkv.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together (QK-norm) or not at all")
    if not isinstance(qk_norm_whole, bool):
        raise ValueError(f"qk_norm_whole must be a bool, got {qk_norm_whole!r}")
    if qk_norm_whole and q_norm is None:
        raise ValueError("qk_norm_whole=True needs q_norm and k_norm (the whole q and k "
                         "projections' RMSNorm weights)")
    if qk_norm_whole and bqkv is not None:
        raise ValueError("qk_norm_whole=True takes no bqkv (no model has a QKV bias before a "
                         "whole-projection QK-norm)")
    if q_norm is not None:
        want = ((HQ * D, "Hq * D: the whole q projection"), (HKV * D, "Hkv * D: the whole k "
                "projection")) if qk_norm_whole else ((D, "head dim"), (D, "head dim"))
        for (name, g), (n, what) in zip((("q_norm", q_norm), ("k_norm", k_norm)), want):
            _tensor(name, g, 1, _DTYPES, dev)
            if g.shape[0] != n or g.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous [{n}] ({what}), got "
                                 f"{tuple(g.shape)}")
        if qk_eps is None:
            raise ValueError("qk_eps (the QK-norm's epsilon) is needed with q_norm/k_norm")
        check_eps("qk_eps", qk_eps, ValueError)
    elif qk_eps is not None:
        raise ValueError("qk_eps given without q_norm/k_norm")
    if norm_eps is not None:
        check_eps("norm_eps", norm_eps, ValueError)
    _tensor("inv_freq", inv_freq, 1, (torch.float32,), dev)
    if inv_freq.shape[0] != D // 2 or inv_freq.stride(0) != 1:
        raise ValueError(f"inv_freq must be a contiguous fp32 [{D // 2}] (head dim / 2), got "
                         f"{tuple(inv_freq.shape)}")
    _tensor("positions", positions, 1, (torch.int32,), dev)
    if positions.shape[0] != M or positions.stride(0) != 1:
        raise ValueError(f"positions must be a contiguous int32 [{M}] (x's rows), got "
                         f"{tuple(positions.shape)}")
    if seq_index is not None:
        _tensor("seq_index", seq_index, 1, (torch.int32,), dev)
        if seq_index.shape[0] != M or seq_index.stride(0) != 1:
            raise ValueError(f"seq_index must be a contiguous int32 [{M}] (x's rows), got "
                             f"{tuple(seq_index.shape)}")
    if block_table is not None:
        _tensor("block_table", block_table, 2, (torch.int32,), dev)
        if block_table.stride(1) != 1:
            raise ValueError("block_table must have a contiguous last dimension")
        batch, capacity = block_table.shape[0], block_table.shape[1] * k_cache.shape[1]
    else:
        batch, capacity = k_cache.shape[0], k_cache.shape[1]
    if seq_index is None and M > batch:
        raise ValueError(f"x has {M} rows, one per sequence without seq_index, but the cache "
                         f"holds {batch} sequences ({'block_table' if block_table is not None else 'k_cache'})")
    if q_out is not None:
        _tensor("q_out", q_out, 3, (dt,), dev)
        if tuple(q_out.shape) != (M, HQ, D) or q_out.stride(2) != 1:
            raise ValueError(f"q_out must be [{M}, {HQ}, {D}] with a contiguous last dimension, "
                             f"got {tuple(q_out.shape)}")
        check_distinct("q_out", q_out)
        for name, t in (("x", x), ("wqkv", wqkv), ("k_cache", k_cache), ("v_cache", v_cache)):
            if overlaps(q_out, t):
                raise ValueError(f"q_out must not overlap {name}: other programs still read "
                                 "or write it")
    if pdl is not None and not isinstance(pdl, bool):
        raise ValueError(f"pdl must be None, True or False, got {pdl!r}")
    if dev.type == "cpu":  # index values cost no synchronisation here: check them
        if M and (positions.min() < 0 or positions.max() >= capacity):
            raise ValueError(f"positions must lie in [0, {capacity}) (the cache's capacity), "
                             f"got [{int(positions.min())}, {int(positions.max())}]")
        if seq_index is not None and M and (seq_index.min() < 0 or seq_index.max() >= batch):
            raise ValueError(f"seq_index must lie in [0, {batch}) (sequences in the cache)")
        if block_table is not None and block_table.numel() and (
                block_table.min() < 0 or block_table.max() >= k_cache.shape[0]):
            raise ValueError(f"block_table entries must lie in [0, {k_cache.shape[0]}) "
                             "(k_cache's pages)")
    return HQ, HKV, D


def qkv_rope_append(x, wqkv, *, bqkv=None, q_norm=None, k_norm=None, norm_eps=None,
                    qk_eps=None, inv_freq, positions, k_cache, v_cache, block_table=None,
                    seq_index=None, q_out=None, pdl=None, settings=None, workspace=None,
                    qk_norm_whole=False):
    """Projects M rows to q, k, v, applies FlashNorm / bias / QK-norm / RoPE, writes q and
    appends k, v to the KV cache, in one kernel launch.

    Args:
        x: [M, K] fp16 / bf16 / fp32, last dimension contiguous; one new token per row.
        wqkv: [(Hq + 2*Hkv) * D, K] in x's dtype: the rows of the q heads, then k, then v.
            With norm_eps, the input RMSNorm's weight must already be folded in
            (W' = W diag(g)).
        bqkv: optional [(Hq + 2*Hkv) * D] bias (Qwen2), added after the norm scale.
        q_norm, k_norm: optional [D] RMSNorm weights applied to each q / k head before
            RoPE (Qwen3), with qk_eps; with qk_norm_whole, [Hq * D] and [Hkv * D] weights
            of one RMSNorm over the whole q and the whole k projection (OLMoE).
        norm_eps: None (x used as is) or the input RMSNorm's eps: the output is scaled by
            1 / sqrt(mean(x^2) + eps) per row (FlashNorm).
        inv_freq: fp32 [D / 2], from rope_inv_freq (Llama-3 scaling included); RoPE as in
            transformers: rotate_half over (i, i + D/2), cos/sin of cat(freqs, freqs), the
            angle the fp32 product position * inv_freq.
        positions: int32 [M], each row's position in its sequence (the cache slot written).
        k_cache, v_cache: paged [num_pages, page_size, Hkv, D] with block_table, or
            contiguous [B, L, Hkv, D] without; x's dtype; last dimension contiguous.
        block_table: int32 [B, max_pages]; row m writes page block_table[b, pos // page_size],
            offset pos % page_size.
        seq_index: int32 [M], the sequence b of each row (several tokens of a sequence);
            None: row m is sequence m.
        q_out: optional [M, Hq, D] output (x's dtype); allocated when None.
        pdl: programmatic dependent launch; None: on for CUDA sm_90+, off elsewhere.
        settings: None for :func:`default_settings` (on sm_90 the GEMV-epilogue path or,
            where its rule says so, the two-launch path; the fused kernel elsewhere); a
            QkvRopeSettings for the fused one-launch kernel with these settings;
            TwoLaunchSettings for the two-launch path (the projection by gemv, then a
            (row, head) kernel for bias, QK-norm, RoPE and the append);
            GemvRopeSettings for the GEMV-epilogue path (gemv's kernel with bias, RoPE,
            the q store and the append in its epilogue; per-head QK-norm only where a
            program holds whole heads). Workspace unused by the last two.
        workspace: a :class:`QkvRopeWorkspace` (from :func:`qkv_rope_workspace`) for the
            split-K partials and counters, checked to be large enough for this launch
            (too small: ValueError naming it); None uses a per-device cached one, grown
            on demand (eager use; code captured in a CUDA graph should own its workspace).
        qk_norm_whole: the QK-norm spans the whole projection (OLMoE). Its sum of squares
            runs over every head of a row, which one program of the fused kernel does not
            see, so this runs as two launches: the projection by :func:`gemv.gemv`
            (FlashNorm scale included) into the model dtype, then one kernel for the
            norm, RoPE, the q store and the append: the TwoLaunchSettings path, whose
            settings.gemv applies when given; QkvRopeSettings and workspace are unused.

    Returns:
        q_out [M, Hq, D]. k_cache / v_cache are written in place at the rows' slots only;
        attention can run right after with seqlens = positions + 1 (wsattn.decode).

    Index values (positions, seq_index, block_table) are checked on CPU tensors only (no
    host synchronisation on CUDA): out-of-range values there are the caller's contract.

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> x = torch.randn(2, 64, dtype=torch.float16)
        >>> w = torch.randn((4 + 2 * 2) * 64, 64, dtype=torch.float16) / 8
        >>> kc = torch.zeros(8, 16, 2, 64, dtype=torch.float16); vc = torch.zeros_like(kc)
        >>> bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        >>> q = qkv_rope_append(x, w, norm_eps=1e-5, inv_freq=rope_inv_freq(64, 10000.0),
        ...                     positions=torch.tensor([5, 16], dtype=torch.int32),
        ...                     k_cache=kc, v_cache=vc, block_table=bt)
    """
    HQ, HKV, D = _check(x, wqkv, bqkv, q_norm, k_norm, norm_eps, qk_eps, inv_freq, positions,
                        k_cache, v_cache, block_table, seq_index, q_out, pdl, qk_norm_whole)
    M, K = x.shape
    heads = HQ + 2 * HKV
    target = target_of(x.device)
    if target.backend == "interpreter":
        from .._triton_compat import patch_interpreter
        patch_interpreter()
    if pdl is None:
        pdl = target.backend == "cuda" and target.cc >= 90
    elif pdl and not (target.backend == "cuda" and target.cc >= 90):
        raise UnsupportedTargetError(f"pdl=True needs CUDA sm_90 or later, got {target.name}")
    if settings is None and not qk_norm_whole:
        settings = default_settings(target, rows=M, hidden=K, heads=heads, head_dim=D,
                                    dtype=x.dtype, qk_norm=q_norm is not None)
    if isinstance(settings, GemvRopeSettings):
        if qk_norm_whole:
            raise ValueError("settings: GemvRopeSettings takes no QK-norm over the whole "
                             "projection (qk_norm_whole): no program sees a whole q or k row; "
                             "use TwoLaunchSettings")
        return _gemv_rope_append(x, wqkv, bqkv, q_norm, k_norm, norm_eps, qk_eps, inv_freq,
                                 positions, k_cache, v_cache, block_table, seq_index, q_out,
                                 bool(pdl), HQ, HKV, D, settings.gemv, target)
    if qk_norm_whole or isinstance(settings, TwoLaunchSettings):
        return _two_launch_append(x, wqkv, bqkv, q_norm, k_norm, norm_eps, qk_eps, inv_freq,
                                  positions, k_cache, v_cache, block_table, seq_index, q_out,
                                  bool(pdl), HQ, HKV, D, qk_norm_whole,
                                  settings.gemv if isinstance(settings, TwoLaunchSettings)
                                  else None)
    if not isinstance(settings, QkvRopeSettings):
        raise ValueError(f"settings must be a {_SETTINGS_NAMES}, got {type(settings).__name__}")
    elif target.backend == "interpreter" and x.dtype == torch.bfloat16:
        raise ValueError("x: the fused QKV + RoPE kernel does not run bfloat16 in the Triton "
                         "interpreter (its tl.dot multiplies bf16 as raw bits); use fp16 / "
                         "fp32 there, or a GPU")
    elif K % settings.BLOCK_K or settings.split_k < 1:
        raise ValueError(f"settings: BLOCK_K {settings.BLOCK_K} must divide K = {K} and "
                         f"split_k {settings.split_k} be >= 1")
    elif not settings.use_dot and M > FMA_MAX_ROWS:
        raise ValueError(f"settings.use_dot=False takes at most {FMA_MAX_ROWS} rows (one "
                         f"row block), got x with {M}")
    need = workspace_size(M, HQ, HKV, D, settings)
    if workspace is not None:
        _check_workspace(workspace, x.device, need)
    if q_out is None:
        q_out = empty((M, HQ, D), x.dtype, x.device)
    if M == 0:
        return q_out
    block_m = _block_m(M, D, settings.use_dot)
    mblocks = cdiv(M, block_m)
    split = settings.split_k
    tiles = K // settings.BLOCK_K
    split_tiles = cdiv(tiles, split)
    if split > 1:
        ws, ss_ws, count = workspace if workspace is not None else _workspace(x.device, *need)
    else:  # unused (the SPLIT_K == 1 branch compiles away)
        ws = ss_ws = inv_freq
        count = positions
    paged = block_table is not None
    dummy = inv_freq  # for pointers a switched-off variant never reads
    _qkv_rope_kernel[(heads, split, mblocks)](
        x, wqkv, bqkv if bqkv is not None else dummy,
        q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy,
        inv_freq, positions, seq_index if seq_index is not None else positions,
        q_out, k_cache, v_cache, block_table if paged else positions, ws, ss_ws, count,
        M, K, split_tiles, float(norm_eps or 0.0), float(qk_eps or 0.0),
        x.stride(0), wqkv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        HQ=HQ, HKV=HKV, D=D, BLOCK_M=block_m, BLOCK_K=settings.BLOCK_K, SPLIT_K=split,
        NORM=norm_eps is not None, BIAS=bqkv is not None, QK_NORM=q_norm is not None,
        PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        SEQ_INDEX=seq_index is not None, PDL=bool(pdl),
        FENCE=split > 1 and target.backend == "cuda", STAGES=settings.num_stages,
        USE_DOT=settings.use_dot, num_warps=settings.num_warps, num_stages=settings.num_stages,
        **({"launch_pdl": True} if pdl else {}))
    return q_out


def _two_launch_append(x, wqkv, bqkv, q_norm, k_norm, norm_eps, qk_eps, inv_freq, positions,
                       k_cache, v_cache, block_table, seq_index, q_out, pdl, HQ, HKV, D,
                       whole, gemv_settings):
    """qkv_rope_append's two-launch path (inputs checked there): gemv, then the kernel."""
    M = x.shape[0]
    if q_out is None:
        q_out = empty((M, HQ, D), x.dtype, x.device)
    if M == 0:
        return q_out
    # the early release is the one measured here (the epilogue kernel is small and waits
    # on every gemv column anyway)
    qkv = gemv(x, wqkv, norm_eps=norm_eps, pdl=pdl, settings=gemv_settings,
               pdl_late=False)  # [M, (HQ + 2 * HKV) * D]
    paged = block_table is not None
    dummy = inv_freq  # for pointers a switched-off variant never reads
    _norm_rope_append_kernel[(cdiv(M, EPILOGUE_BLOCK_M), HQ + 2 * HKV)](
        qkv, bqkv if bqkv is not None else dummy, q_norm if q_norm is not None else dummy,
        k_norm if k_norm is not None else dummy, inv_freq, positions,
        seq_index if seq_index is not None else positions, q_out, k_cache, v_cache,
        block_table if paged else positions, M, float(qk_eps or 0.0), qkv.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0, HQ=HQ, HKV=HKV, D=D,
        BLOCK_M=EPILOGUE_BLOCK_M, WHOLE=bool(whole), BIAS=bqkv is not None,
        QK_NORM=q_norm is not None and not whole, PAGED=paged,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, SEQ_INDEX=seq_index is not None, PDL=pdl,
        QW=next_pow2(HQ * D), KW=next_pow2(HKV * D), num_warps=EPILOGUE_WARPS,
        **({"launch_pdl": True} if pdl else {}))
    return q_out


FINISH_PAIRS = 32  # the GEMV-epilogue path's split-K finish: rotate_half pairs a program


def _finish_pairs(D: int, qk_norm: bool) -> int:
    """rotate_half pairs a program of the split-K finish takes: the whole head (D / 2)
    with QK-norm, whose sum of squares spans it; else up to FINISH_PAIRS."""
    return D // 2 if qk_norm else min(FINISH_PAIRS, D // 2)


def _finish_warps(M: int, pairs: int) -> int:
    # two [rows, pairs] fp32 halves and RoPE's temporaries: at 64 rows x 64 pairs (QK-norm,
    # D 128) 4 warps spilled on sm_90 (255 registers), 8 do not (205)
    return 8 if next_pow2(M) * pairs >= 64 * 64 else 4


_SETTINGS = (QkvRopeSettings, TwoLaunchSettings, GemvRopeSettings)
_SETTINGS_NAMES = "QkvRopeSettings, TwoLaunchSettings or GemvRopeSettings"


def gemv_rope_settings(target: Target, M: int, K: int, heads: int, D: int, dtype: torch.dtype,
                       given: GemvSettings | None = None) -> GemvSettings:
    """The GEMV-epilogue path's projection settings: ``given``, checked, or gemv's
    default for the [heads * D, K] projection with BLOCK_N capped at D (a program's
    columns must be whole rotate_half pairs of one head)."""
    if given is None:
        return _default_gemv_rope_settings(target, M, K, heads, D, dtype)
    if not isinstance(given, GemvSettings):
        raise ValueError(f"settings.gemv must be a GemvSettings or None, got "
                         f"{type(given).__name__}")
    if given.BLOCK_N < 2 or D % given.BLOCK_N:
        raise ValueError(f"settings.gemv.BLOCK_N {given.BLOCK_N} must divide the head dim "
                         f"{D} (a program holds whole rotate_half pairs of one head)")
    return given


@functools.lru_cache(maxsize=1024)
def _default_gemv_rope_settings(target: Target, M: int, K: int, heads: int, D: int,
                                dtype: torch.dtype) -> GemvSettings:
    # asked on every call of the path (and by default_settings): cached as gemv's own is
    s = _gemv.default_settings(target, M=M, N=heads * D, K=K, dtype=dtype, deep=False)
    return replace(s, BLOCK_N=min(s.BLOCK_N, D))


def _gemv_rope_append(x, wqkv, bqkv, q_norm, k_norm, norm_eps, qk_eps, inv_freq, positions,
                      k_cache, v_cache, block_table, seq_index, q_out, pdl, HQ, HKV, D,
                      gemv_settings, target):
    """qkv_rope_append's GEMV-epilogue path (inputs checked there)."""
    M, K = x.shape
    if M > _gemv.MAX_M:
        raise ValueError(f"x has {M} rows; the GEMV-epilogue path takes 1..{_gemv.MAX_M} "
                         f"(more is a GEMM: QkvRopeSettings)")
    if target.backend == "interpreter" and x.dtype == torch.bfloat16:
        raise ValueError("x: the GEMV-epilogue path does not run bfloat16 in the Triton "
                         "interpreter (its tl.dot multiplies bf16 as raw bits); use fp16 / "
                         "fp32 there, or TwoLaunchSettings")
    if q_out is None:
        q_out = empty((M, HQ, D), x.dtype, x.device)
    if M == 0:
        return q_out
    heads = HQ + 2 * HKV
    s = gemv_rope_settings(target, M, K, heads, D, x.dtype, gemv_settings)
    if not s.use_dot and M > _gemv.FMA_SETTINGS_MAX_M:
        raise ValueError(f"settings.gemv.use_dot=False takes M <= {_gemv.FMA_SETTINGS_MAX_M}, "
                         f"got x with {M} rows")
    split = _gemv.launch_split(K, s)
    qk_norm = q_norm is not None
    if qk_norm and split == 1 and s.BLOCK_N != D:
        raise ValueError(f"settings: the GEMV-epilogue path takes QK-norm (q_norm / k_norm) "
                         f"only where a program holds whole heads: K split, or BLOCK_N equal "
                         f"to the head dim {D}; got BLOCK_N {s.BLOCK_N}, K unsplit")
    N = heads * D
    ws, ss = _gemv.split_workspace(split, M, N, x.device, inv_freq)
    paged = block_table is not None
    dummy = inv_freq  # for pointers a switched-off variant never reads
    common = (bqkv if bqkv is not None else dummy, q_norm if qk_norm else dummy,
              k_norm if qk_norm else dummy, inv_freq, positions,
              seq_index if seq_index is not None else positions, q_out, k_cache, v_cache,
              block_table if paged else positions)
    strides = (q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
               block_table.stride(0) if paged else 0)
    flags = dict(HQ=HQ, HKV=HKV, D=D, NORM=norm_eps is not None, BIAS=bqkv is not None,
                 QK_NORM=qk_norm, PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
                 SEQ_INDEX=seq_index is not None, PDL=pdl)
    eps, qeps = float(norm_eps or 0.0), float(qk_eps or 0.0)
    launch = {"launch_pdl": True} if pdl else {}
    # The early release at every row count, as the two-launch path's projection takes it:
    # decode's programs are then resident when the projection ends. H200 step, the release
    # by rows (late below 8, as gemv's other GEMVs) against the two-launch path: 1B B1
    # 1.048 vs 1.032 ms/token, 8B B1 4.453 vs 4.406 (notes/decode_step.md), as the late
    # release had cost the two-launch path's projection before.
    _gemv_rope_kernel[(N // s.BLOCK_N, split)](
        x, wqkv, *common, ws, ss, M, K, eps, qeps, x.stride(0), wqkv.stride(0), *strides,
        BLOCK_M=_gemv.block_m(M, s.use_dot), BLOCK_N=s.BLOCK_N, BLOCK_K=s.BLOCK_K,
        SPLIT_K=split, USE_DOT=s.use_dot, STAGES=s.num_stages,
        PDL_LATE=False, **flags, num_warps=s.num_warps,
        num_stages=s.num_stages, **launch)
    if split > 1:
        pairs = _finish_pairs(D, qk_norm)
        bm = _gemv.finish_block_m(M)
        _rope_finish_kernel[(N // (2 * pairs), cdiv(M, bm))](
            ws, ss, *common, M, K, eps, qeps, *strides, BLOCK_M=bm, P=pairs,
            SPLIT_K=split, **flags, num_warps=_finish_warps(bm, pairs), **launch)
    return q_out


# --------------------------------------------------------------------------- compile specs



def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16", *, rows: int = 1,
                 hidden: int = 4096, q_heads: int = 32, kv_heads: int = 8, norm: bool = True,
                 bias: bool = False, qk_norm: bool = False, paged: bool = True,
                 page_size: int = 16, seq_index: bool = False, pdl: bool = False,
                 settings=None, num_sms: int = 132, qk_norm_whole: bool = False,
                 fused: bool = False, finish: bool = False) -> dict:
    """What ``triton.compile`` needs to build the kernel for compute capability cc, by
    default at the Llama-3.1-8B shape (K 4096, Hq 32, Hkv 8, D 128), one row, paged.
    settings None: what default_settings picks for cc (on sm_90 the GEMV-epilogue path
    or the two-launch path, by its rule); fused: the fused kernel with
    fused_settings instead. qk_norm_whole or settings TwoLaunchSettings: the two-launch
    path's second kernel (_norm_rope_append_kernel; the projection before it is gemv's
    kernel). GemvRopeSettings: _gemv_rope_kernel (finish: its split-K finish instead).

    Returns {"fn", "signature", "constexprs", "attrs", "options"} as
    decode_triton.compile_spec does; use ``triton.compile(ASTSource(s["fn"],
    s["signature"], constexprs=s["constexprs"], attrs=s["attrs"]),
    target=GPUTarget("cuda", cc, 32), options=s["options"])``.
    """
    t = dtype_name(dtype)  # Triton's type string is the same name
    heads = q_heads + 2 * kv_heads
    if settings is None and not qk_norm_whole:
        pick = fused_settings if fused else default_settings
        kw = {} if fused else {"qk_norm": qk_norm}
        settings = pick(Target("cuda", cc, num_sms), rows=rows, hidden=hidden, heads=heads,
                        head_dim=head_dim, dtype=DTYPES[dtype], **kw)
    if isinstance(settings, GemvRopeSettings):
        g = gemv_rope_settings(Target("cuda", cc, num_sms), rows, hidden, heads, head_dim,
                               DTYPES[dtype], settings.gemv)
        return _gemv_rope_compile_spec(t, g, rows, head_dim, q_heads, kv_heads, norm, bias,
                                       qk_norm, paged, page_size, seq_index, pdl, finish)
    if qk_norm_whole or isinstance(settings, TwoLaunchSettings):
        return _epilogue_compile_spec(t, head_dim, q_heads, kv_heads, paged, page_size,
                                      seq_index, pdl, qk_norm_whole, bias,
                                      qk_norm and not qk_norm_whole)
    sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "b_ptr": f"*{t}", "qn_ptr": f"*{t}",
           "kn_ptr": f"*{t}", "inv_freq_ptr": "*fp32", "pos_ptr": "*i32", "seq_ptr": "*i32",
           "q_ptr": f"*{t}", "kc_ptr": f"*{t}", "vc_ptr": f"*{t}", "bt_ptr": "*i32",
           "ws_ptr": "*fp32", "ss_ws_ptr": "*fp32", "count_ptr": "*i32",
           "M": "i32", "K": "i32", "SPLIT_TILES": "i32", "norm_eps": "fp32", "qk_eps": "fp32"}
    for name in ("stride_xm", "stride_wn", "stride_qm", "stride_qh", "stride_kb", "stride_kl",
                 "stride_kh", "stride_vb", "stride_vl", "stride_vh", "stride_btb"):
        sig[name] = "i32"
    const = {"HQ": q_heads, "HKV": kv_heads, "D": head_dim,
             "BLOCK_M": _block_m(rows, head_dim, settings.use_dot),
             "BLOCK_K": settings.BLOCK_K, "SPLIT_K": settings.split_k, "NORM": norm,
             "BIAS": bias, "QK_NORM": qk_norm, "PAGED": paged,
             "PAGE_SIZE": page_size if paged else 1, "SEQ_INDEX": seq_index, "PDL": pdl,
             "FENCE": settings.split_k > 1, "STAGES": settings.num_stages,
             "USE_DOT": settings.use_dot}
    sig.update({name: "constexpr" for name in const})
    attrs = {(_qkv_rope_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in _ALIGNED}
    return {"fn": _qkv_rope_kernel, "signature": sig, "constexprs": const, "attrs": attrs,
            "options": {"num_warps": settings.num_warps, "num_stages": settings.num_stages,
                        "launch_pdl": pdl}}


# What a real launch sees as 16-divisible: every tensor pointer and the strides of the
# [.., D] / [.., K] tensors (K % 16 == 0 is required; D is 64/128/256). M, SPLIT_TILES and
# stride_btb are left unknown.
_ALIGNED = ("x_ptr", "w_ptr", "b_ptr", "qn_ptr", "kn_ptr", "inv_freq_ptr", "pos_ptr",
            "seq_ptr", "q_ptr", "kc_ptr", "vc_ptr", "bt_ptr", "ws_ptr", "ss_ws_ptr",
            "count_ptr", "K", "stride_xm", "stride_wn", "stride_qm", "stride_qh", "stride_kb",
            "stride_kl", "stride_kh", "stride_vb", "stride_vl", "stride_vh")


def _gemv_rope_compile_spec(t, g, rows, head_dim, q_heads, kv_heads, norm, bias, qk_norm,
                            paged, page_size, seq_index, pdl, finish):
    fn = _rope_finish_kernel if finish else _gemv_rope_kernel
    sig = {"ws_ptr": "*fp32", "ss_ptr": "*fp32"} if finish else {"x_ptr": f"*{t}",
                                                                  "w_ptr": f"*{t}"}
    sig.update({"b_ptr": f"*{t}", "qn_ptr": f"*{t}", "kn_ptr": f"*{t}",
                "inv_freq_ptr": "*fp32", "pos_ptr": "*i32",
                "seq_ptr": "*i32", "q_ptr": f"*{t}", "kc_ptr": f"*{t}", "vc_ptr": f"*{t}",
                "bt_ptr": "*i32"})
    if not finish:
        sig.update({"ws_ptr": "*fp32", "ss_ptr": "*fp32"})
    sig.update({"M": "i32", "K": "i32", "eps": "fp32", "qk_eps": "fp32"})
    if not finish:
        sig.update({"stride_xm": "i32", "stride_wn": "i32"})
    for name in ("stride_qm", "stride_qh", "stride_kb", "stride_kl", "stride_kh", "stride_vb",
                 "stride_vl", "stride_vh", "stride_btb"):
        sig[name] = "i32"
    const = {"HQ": q_heads, "HKV": kv_heads, "D": head_dim, "NORM": norm, "BIAS": bias,
             "QK_NORM": qk_norm, "PAGED": paged, "PAGE_SIZE": page_size if paged else 1,
             "SEQ_INDEX": seq_index, "PDL": pdl}
    if finish:
        pairs = _finish_pairs(head_dim, qk_norm)
        bm = _gemv.finish_block_m(rows)
        const.update(BLOCK_M=bm, P=pairs, SPLIT_K=max(2, g.split_k))
        options = {"num_warps": _finish_warps(bm, pairs), "launch_pdl": pdl}
    else:
        const.update(BLOCK_M=_gemv.block_m(rows, g.use_dot), BLOCK_N=g.BLOCK_N,
                     BLOCK_K=g.BLOCK_K, SPLIT_K=g.split_k, USE_DOT=g.use_dot,
                     STAGES=g.num_stages, PDL_LATE=False)
        options = {"num_warps": g.num_warps, "num_stages": g.num_stages, "launch_pdl": pdl}
    sig.update({name: "constexpr" for name in const})
    names = fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n in ("K", "stride_xm", "stride_wn", "stride_qm",
                                              "stride_qh", "stride_kb", "stride_kl",
                                              "stride_kh", "stride_vb", "stride_vl",
                                              "stride_vh")}
    return {"fn": fn, "signature": sig, "constexprs": const, "attrs": attrs,
            "options": options}


def _epilogue_compile_spec(t, head_dim, q_heads, kv_heads, paged, page_size, seq_index, pdl,
                           whole, bias, qk_norm):
    sig = {"qkv_ptr": f"*{t}", "b_ptr": f"*{t}", "qn_ptr": f"*{t}", "kn_ptr": f"*{t}", "inv_freq_ptr": "*fp32",
           "pos_ptr": "*i32", "seq_ptr": "*i32", "q_ptr": f"*{t}", "kc_ptr": f"*{t}",
           "vc_ptr": f"*{t}", "bt_ptr": "*i32", "M": "i32", "qk_eps": "fp32"}
    for name in ("stride_xm", "stride_qm", "stride_qh", "stride_kb", "stride_kl", "stride_kh",
                 "stride_vb", "stride_vl", "stride_vh", "stride_btb"):
        sig[name] = "i32"
    const = {"HQ": q_heads, "HKV": kv_heads, "D": head_dim, "BLOCK_M": EPILOGUE_BLOCK_M,
             "WHOLE": whole, "BIAS": bias, "QK_NORM": qk_norm, "PAGED": paged, "PAGE_SIZE": page_size if paged else 1, "SEQ_INDEX": seq_index,
             "PDL": pdl, "QW": next_pow2(q_heads * head_dim),
             "KW": next_pow2(kv_heads * head_dim)}
    sig.update({name: "constexpr" for name in const})
    names = _norm_rope_append_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n in ("stride_xm", "stride_qm", "stride_qh", "stride_kb",
                                              "stride_kl", "stride_kh", "stride_vb",
                                              "stride_vl", "stride_vh")}
    return {"fn": _norm_rope_append_kernel, "signature": sig, "constexprs": const,
            "attrs": attrs, "options": {"num_warps": EPILOGUE_WARPS, "launch_pdl": pdl}}
