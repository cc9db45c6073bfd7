"""Skinny GEMMs of a decode step ("GEMV", M = 1..64 rows), one Triton kernel.

    y[M, NOUT] = epilogue(x[M, K] @ W[N, K]^T)

W is row-major [N, K] (a weight as nn.Linear stores it), x the step's activations. A
decode step at small batch reads every weight byte once and does almost no arithmetic
with it, so the kernel is written for reading W at the copy rate: each program owns
BLOCK_N output columns (BLOCK_N rows of W) and streams those rows once, K-contiguous
16-byte loads, num_stages tiles in flight, for all M rows of x at once (M <= 64 fits
one program's accumulator). x is tiny and is re-read by every program from L2.

Constexpr switches on the one kernel (never copies):
    NORM      FlashNorm: the RMSNorm weight g was folded into W's columns beforehand
              (W' = W diag(g), wsattn.models.flashnorm), so RMSNorm(x) @ W^T =
              rsqrt(mean(x^2) + eps) * (x @ W'^T): the kernel scales output row m by
              1/rms(x[m]), computed from the x tiles it streams anyway.
    RESIDUAL  y = residual + (...): the residual adds after o_proj and down_proj;
              out may be the residual tensor itself (in-place update of the stream).
    SILU_MUL  W holds the gate rows then the up rows ([2F, K]); column n of the [M, F]
              output is silu(x . W[n]) * (x . W[F + n]).
    USE_DOT   tl.dot (M padded to 16, W as the MMA's M operand: "swap AB", so a 16..128
              row W tile is the wide side) or, for M <= 4, an FMA reduction per row. At
              one row the FMA path folds every tile into an elementwise fp32 tile and
              reduces over K once after the loop (stream_w's ROW_FOLD).
    SPLIT_K   where the output has too few columns to give every SM a program (k/v
              projections, N = 512), the K range is split; each split writes fp32
              partials and a second kernel (_splitk_finish_kernel) adds them in a fixed
              order: deterministic, no float atomics.
    PDL       programmatic dependent launch (sm_90+): see the comment in _gemv_kernel.

No bias: the only biased projections of the supported families (Qwen2 q/k/v) go
through the fused QKV kernel (qkv_rope.py), so gemv takes none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..target import Target, target_of
from ..testing import DTYPES, dtype_name
from ._alloc import empty
from ._intmath import cdiv, next_pow2
from ._overlap import check_distinct, overlaps, same_view
from ._precision import F32_DOT, check_eps


@triton.jit
def accumulate(acc_g, acc_u, ss, wg, wu, x_ptr, xoff, m_live, stride_xm, M, k, k_live,
               BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr,
               GATE_UP: tl.constexpr, GATHER: tl.constexpr):
    """Fold one K tile into the accumulators; written once for this module's GEMV and the
    grouped MoE projections (moe.py), whose rows of x are gathered.

    acc_g / acc_u [BLOCK_N, BLOCK_M] fp32 (gate / up; acc_u unused without GATE_UP),
    ss [BLOCK_M] fp32 running sum of x^2 per row, wg / wu [BLOCK_N, BLOCK_K] W tiles,
    k [BLOCK_K] the tile's K indices, k_live [BLOCK_K] k inside this program's range;
    xoff [BLOCK_M] element offsets of the rows of x and m_live [BLOCK_M] which rows hold
    data. Rows are m * stride_xm for m < M unless GATHER (then only xoff / m_live say).
    The sum of squares is accumulated here, next to the dot products, because it needs
    exactly the x tile the dot products already loaded: the norm costs no extra read.
    """
    mi = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    if USE_DOT:
        x = tl.load(x_ptr + xoff[:, None] + k[None, :],
                    mask=m_live[:, None] & k_live[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        xt = tl.trans(x)  # [BLOCK_K, BLOCK_M]
        acc_g = tl.dot(wg, xt, acc_g, input_precision=F32_DOT)  # [BLOCK_N, BLOCK_M]
        if GATE_UP:
            acc_u = tl.dot(wu, xt, acc_u, input_precision=F32_DOT)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
    else:
        # M <= 4: one row at a time, each a [BLOCK_N, BLOCK_K] multiply reduced over K,
        # dropped into column m of the accumulator (no 3-D tile, no layout conversion)
        for m in tl.static_range(BLOCK_M):
            if GATHER:
                # the row's offset and liveness as scalars: a <= 4-element reduction a tile
                om = tl.sum(tl.where(mi == m, xoff, 0), axis=0)
                lm = tl.sum(tl.where(mi == m, m_live.to(tl.int32), 0), axis=0) > 0
            else:
                om = m * stride_xm
                lm = m < M
            xm = tl.load(x_ptr + om + k, mask=k_live & lm, other=0.0).to(tl.float32)  # [BLOCK_K]
            col = (mi == m)[None, :]  # [1, BLOCK_M]
            g = tl.sum(wg.to(tl.float32) * xm[None, :], axis=1)  # [BLOCK_N]
            acc_g += tl.where(col, g[:, None], 0.0)
            if GATE_UP:
                u = tl.sum(wu.to(tl.float32) * xm[None, :], axis=1)
                acc_u += tl.where(col, u[:, None], 0.0)
            if NORM:
                ss += tl.where(mi == m, tl.sum(xm * xm, axis=0), 0.0)
    return acc_g, acc_u, ss


@triton.jit
def fold_row(part_g, part_u, sq, wg, wu, x_ptr, k, k_live, NORM: tl.constexpr,
             GATE_UP: tl.constexpr):
    """One K tile of a one-row GEMV into elementwise fp32 partials: part_g / part_u
    [BLOCK_N, BLOCK_K] += W tile * x[k], sq [BLOCK_K] += x[k]^2; the caller reduces over K
    after its loop. Every element of a thread's tile has its own accumulator, so a tile is
    loads, converts and independent FMAs: no cross-lane reduction on the loop's path."""
    xm = tl.load(x_ptr + k, mask=k_live, other=0.0).to(tl.float32)  # [BLOCK_K]
    part_g += wg.to(tl.float32) * xm[None, :]
    if GATE_UP:
        part_u += wu.to(tl.float32) * xm[None, :]
    if NORM:
        sq += xm * xm
    return part_g, part_u, sq


@triton.jit
def _stream_tile(acc_g, acc_u, ss, wg, wu, x_ptr, xoff, m_live, stride_xm, M, k, k_live,
                 BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr,
                 SILU_MUL: tl.constexpr, ROW_FOLD: tl.constexpr):
    """stream_w's step for one W tile: the row fold's elementwise partials, or accumulate."""
    if ROW_FOLD:
        return fold_row(acc_g, acc_u, ss, wg, wu, x_ptr, k, k_live, NORM, SILU_MUL)
    return accumulate(acc_g, acc_u, ss, wg, wu, x_ptr, xoff, m_live, stride_xm, M, k, k_live,
                      BLOCK_M, USE_DOT, NORM, SILU_MUL, False)


@triton.jit
def _finish(gate, up, ss, K, eps, res_ptr, out_ptr, res_offs, out_offs, mask,
            NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr):
    """The epilogue, shared by the one-pass kernel and the split-K finish: any tile
    orientation; gate / up fp32 tiles, ss fp32 sums of x^2 broadcastable to them."""
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)
        gate = gate * rstd
        if SILU_MUL:
            up = up * rstd
    if SILU_MUL:
        y = gate * tl.sigmoid(gate) * up
    else:
        y = gate
    if RESIDUAL:
        # read and written by the same program, element for element: safe in place
        y += tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def stream_w(x_ptr, w_ptr, n, n_live, pid_k, M, NOUT, K, stride_xm, stride_wn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr,
             SILU_MUL: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
             PDL_LATE: tl.constexpr):
    """Stream W rows n [BLOCK_N] (up rows at NOUT + n with SILU_MUL) over split pid_k's
    share of K against all M rows of x; returns the fp32 accumulators (gate, up)
    [BLOCK_N, BLOCK_M] and x's sums of squares ss [BLOCK_M] over that share. Written once
    for this module's kernel and qkv_rope's GEMV with the RoPE epilogue, whose columns n
    are not contiguous. PDL: the wait and the release are in here (comments below)."""
    mi = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    kk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    # One row of x on the FMA path: the products stay elementwise in a [BLOCK_N, BLOCK_K]
    # fp32 tile across the K loop and are reduced over K once, after it, instead of a row
    # reduction (a warp's shuffle tree) every tile, which sat on the loop's critical path
    # with one program of four warps an SM (H200: 1B down 14.0 -> 11.2 us,
    # notes/decode_step.md).
    ROW_FOLD: tl.constexpr = (not USE_DOT) and BLOCK_M == 1
    # this split's BLOCK_K-aligned share [k_lo, k_hi) of K (all of K when SPLIT_K == 1)
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = pid_k * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per_split * BLOCK_K, K)
    g_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    u_rows = w_ptr + (n + NOUT).to(tl.int64)[:, None] * stride_wn  # up rows F + n (SILU_MUL)

    if ROW_FOLD:
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)

    # The first tile is peeled off the loop so that its W loads can be issued before
    # the PDL wait: weights are never written during a step, so they do not depend on
    # the previous kernel; x (and the residual) do.
    k = k_lo + kk
    k_live = k < k_hi
    wmask = n_live[:, None] & k_live[None, :]
    wg = tl.load(g_rows + k[None, :], mask=wmask, other=0.0)  # [BLOCK_N, BLOCK_K]
    wu = wg
    if SILU_MUL:
        wu = tl.load(u_rows + k[None, :], mask=wmask, other=0.0)
    if PDL:
        # Wait for the previous kernel (and, through its own wait, every earlier one) to
        # finish and flush its writes: nothing below may read x or the residual sooner.
        tl.extra.cuda.gdc_wait()
        # Let the next kernel launch now. Correct this early because every kernel of the
        # step follows one rule: before its own gdc_wait it reads only weights and writes
        # nothing, and its gdc_wait returns only when this whole grid has completed and
        # its writes are visible. So the next kernel can neither see our output early nor
        # overwrite an input we have yet to read; launching it early only lets its
        # programs take free SM slots and start their weight loads while our last
        # programs stream. (The signal counts once every program of the grid has sent
        # it or exited, so a multi-wave grid releases the next kernel in its last wave.)
        if not PDL_LATE:
            tl.extra.cuda.gdc_launch_dependents()
    xoff = mi * stride_xm  # [BLOCK_M] rows of x: contiguous here, gathered in moe.py
    m_live = mi < M
    acc_g, acc_u, ss = _stream_tile(acc_g, acc_u, ss, wg, wu, x_ptr, xoff, m_live, stride_xm,
                                    M, k, k_live, BLOCK_M, USE_DOT, NORM, SILU_MUL, ROW_FOLD)
    # STAGES asked of the loop itself: Triton pipelines only loads that feed a tl.dot
    # unless told, and the FMA path has none (its loads stayed synchronous, sm_90 PTX)
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        k_live = k < k_hi
        wmask = n_live[:, None] & k_live[None, :]
        wg = tl.load(g_rows + k[None, :], mask=wmask, other=0.0)
        wu = wg
        if SILU_MUL:
            wu = tl.load(u_rows + k[None, :], mask=wmask, other=0.0)
        acc_g, acc_u, ss = _stream_tile(acc_g, acc_u, ss, wg, wu, x_ptr, xoff, m_live,
                                        stride_xm, M, k, k_live, BLOCK_M, USE_DOT, NORM,
                                        SILU_MUL, ROW_FOLD)
    if PDL and PDL_LATE:
        # the weights are streamed: the next kernel's programs now find the SMs this grid
        # is leaving, not slots freed one by one while its last wave still streams
        tl.extra.cuda.gdc_launch_dependents()
    if ROW_FOLD:
        acc_g = tl.sum(acc_g, axis=1)[:, None]  # [BLOCK_N, 1]
        acc_u = tl.sum(acc_u, axis=1)[:, None]
        ss = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.sum(ss, axis=0)  # [1]
    return acc_g, acc_u, ss


@triton.jit
def store_partials(ws_ptr, ss_ptr, acc_g, acc_u, ss, n, mask, pid_n, pid_k, M, NOUT,
                   BLOCK_M: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr):
    """Split pid_k's fp32 partials of columns n: ws [SPLIT_K, M, NW] with NW = N rows of
    W (up at F + n); the x^2 sums ss [SPLIT_K, M] once per split, from column block 0."""
    mi = tl.arange(0, BLOCK_M)
    NW = NOUT
    if SILU_MUL:
        NW = NOUT * 2
    ws = ws_ptr + pid_k.to(tl.int64) * M * NW + mi[None, :] * NW + n[:, None]
    tl.store(ws, acc_g, mask=mask)
    if SILU_MUL:
        tl.store(ws + NOUT, acc_u, mask=mask)
    if NORM:
        tl.store(ss_ptr + pid_k * M + mi, ss, mask=(mi < M) & (pid_n == 0))


@triton.jit
def sum_partials(ws_ptr, ss_ptr, m0, n, mask, M, NOUT, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, NORM: tl.constexpr,
                 SILU_MUL: tl.constexpr):
    """store_partials' sums for columns n [BLOCK_N], rows m0 .. m0 + BLOCK_M - 1: (gate,
    up) [BLOCK_M, BLOCK_N] and ss [BLOCK_M], the splits added in the fixed order
    s = 0..SPLIT_K-1, so reruns are bit-identical."""
    mi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    NW = NOUT
    if SILU_MUL:
        NW = NOUT * 2
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ws = ws_ptr + s * M * NW + mi[:, None] * NW + n[None, :]
        gate += tl.load(ws, mask=mask, other=0.0)
        if SILU_MUL:
            up += tl.load(ws + NOUT, mask=mask, other=0.0)
        if NORM:
            ss += tl.load(ss_ptr + s * M + mi, mask=mi < M, other=0.0)
    return gate, up, ss


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, res_ptr, out_ptr, ws_ptr, ss_ptr,
                 M, NOUT, K, eps,
                 stride_xm, stride_wn, stride_rm, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr,
                 RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
                 STAGES: tl.constexpr = 1, PDL_LATE: tl.constexpr = False):
    # grid (cdiv(NOUT, BLOCK_N), SPLIT_K). NOUT = N, or F = N / 2 with SILU_MUL.
    # PDL_LATE: release the next kernel after the K loop instead of right after the wait
    # (where each pays: gemv's PDL_LATE_BELOW_M).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = W rows
    n_live = n < NOUT
    mi = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    acc_g, acc_u, ss = stream_w(x_ptr, w_ptr, n, n_live, pid_k, M, NOUT, K, stride_xm,
                                stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, NORM,
                                SILU_MUL, PDL, STAGES, PDL_LATE)
    mask = n_live[:, None] & (mi < M)[None, :]  # [BLOCK_N, BLOCK_M]
    if SPLIT_K == 1:
        _finish(acc_g, acc_u, ss[None, :], K, eps, res_ptr, out_ptr,
                mi[None, :] * stride_rm + n[:, None], mi[None, :] * stride_om + n[:, None],
                mask, NORM, RESIDUAL, SILU_MUL)
    else:
        store_partials(ws_ptr, ss_ptr, acc_g, acc_u, ss, n, mask, pid_n, pid_k, M, NOUT,
                       BLOCK_M, NORM, SILU_MUL)


@triton.jit
def _splitk_finish_kernel(ws_ptr, ss_ptr, res_ptr, out_ptr, M, NOUT, K, eps,
                          stride_rm, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SPLIT_K: tl.constexpr, NORM: tl.constexpr,
                          RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr):
    # one program: BLOCK_M rows (the row block program_id(1)) x BLOCK_N output columns
    if PDL:
        tl.extra.cuda.gdc_wait()  # everything this kernel reads comes from earlier kernels
        tl.extra.cuda.gdc_launch_dependents()  # same rule as in _gemv_kernel
    m0 = tl.program_id(1) * BLOCK_M
    mi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask = (mi < M)[:, None] & (n < NOUT)[None, :]  # [BLOCK_M, BLOCK_N]
    gate, up, ss = sum_partials(ws_ptr, ss_ptr, m0, n, mask, M, NOUT, BLOCK_M, BLOCK_N,
                                SPLIT_K, NORM, SILU_MUL)
    _finish(gate, up, ss[:, None], K, eps, res_ptr, out_ptr,
            mi[:, None] * stride_rm + n[None, :], mi[:, None] * stride_om + n[None, :],
            mask, NORM, RESIDUAL, SILU_MUL)


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class GemvSettings:
    """Launch settings of the GEMV kernel (see default_settings for how they are chosen).

    BLOCK_N: output columns (W rows; with silu_mul, gate and up rows each) per program.
    BLOCK_K: K elements per tile (256 bytes of a W row for the dot path: one 16-byte
    load per thread per row slice). split_k: K splits (1 = one pass, no workspace).
    use_dot: tl.dot with M padded to >= 16, else the FMA reduction (M <= FMA_MAX_M).
    num_warps / num_stages: as in triton.
    """
    BLOCK_N: int
    BLOCK_K: int
    split_k: int
    use_dot: bool
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K", "split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GemvSettings.{name} must be a positive int, got {value!r}")
        for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"GemvSettings.{name} must be a power of two, got {value}")
        if self.use_dot and (self.BLOCK_N < 16 or self.BLOCK_K < 16):
            raise ValueError("GemvSettings with use_dot need BLOCK_N and BLOCK_K >= 16 "
                             f"(tl.dot's minimum), got {self.BLOCK_N}, {self.BLOCK_K}")
        if self.split_k > MAX_SPLIT_K:
            raise ValueError(f"GemvSettings.split_k must be <= {MAX_SPLIT_K}, got {self.split_k}")


MAX_M = 64  # rows one program's accumulator holds; more is a GEMM
FMA_MAX_M = 4  # up to here the FMA reduction: tl.dot would pad M to 16 (4x the work)
# ... except on sm_90 / sm_100, where the dot path is the default from two rows but keeps
# the FMA reduction at two rows for the shapes the dot rule would split K (QKV, o, down),
# and one row takes the FMA path's row fold at every shape (_one_row_settings). H200,
# Llama-3.2-1B / 3.1-8B shapes, the FMA default against the dot rule side by side
# (notes/decode_step.md): at M = 4 the dot rule won every GEMV (1B gate/up
# 49.4 -> 19.9 us, LM head 322 -> 128; 8B gate/up 132.5 -> 61.5, LM head 669 -> 244); at
# M = 2 it won the wide ones it runs unsplit (gate/up, LM head) by 17-34 % and lost the
# narrow split-K ones (8B QKV, o, down by 0.8-1.2 us; 1B o, down by 0.9-1.4; 1B QKV even);
# at M = 1 likewise before the row fold (1B gate/up 20.8 -> 19.7, LM head 137.7 -> 124.9;
# 8B gate/up even, LM head 264.5 -> 243.0; split QKV / o / down 1.5-2.2x slower on the dot
# path), which the row fold turned (default_settings).
FMA_SPLIT_MAX_M_SM90 = 2
ONE_ROW_BLOCK_N = 16  # W rows a program streams at one row on sm_90 / sm_100 (_one_row_settings)
DOT_WIDE_MAX_M = 32  # padded rows up to which the dot path takes DOT_WIDE_BLOCK_N columns
DOT_WIDE_BLOCK_N = 64
FMA_SETTINGS_MAX_M = 16  # the most rows explicit FMA settings take (the loop is unrolled per row)
MAX_SPLIT_K = 16  # the finish kernel unrolls its splits
MIN_SPLIT_TILES = 4  # K tiles per split at least, so the pipeline's prologue stays small
SPLIT_BELOW = 0.75  # split K when the column blocks fill fewer SMs than this fraction
ROW_BYTES = 256  # bytes of one W row a tile covers: 16 threads x 16-byte loads
FMA_TILE_ELEMS = 4096  # W elements of an FMA tile (16-bit; half for fp32)
# With PDL, a GEMV of fewer rows than this releases the next kernel after its weight stream
# (pdl_late), larger ones right after their wait. H200, the decode step in one CUDA graph,
# release off / early / late side by side (notes/decode_step.md): at B1 ctx 4096 early
# cost 9 % at Llama-3.1-8B (4.471 / 4.892 / 4.389 ms) and late gained 1.8-2.3 % (1B 1.106 /
# 1.105 / 1.080); at B8 early was best (1B ctx 1k 1.218 / 1.148 / 1.176, 8B ctx 4k 5.772 /
# 5.655 / 5.670), at B64 even (8B 8.505 early, 8.559 late). Between 1 and 8 rows late, which
# beat no PDL at both ends.
PDL_LATE_BELOW_M = 8
STAGE_BUDGET = 96 * 1024  # shared memory for the pipeline's stages, per program
MAX_STAGES = 6
# The 64-column dot tiles (3..DOT_WIDE_MAX_M rows) when their programs fit one wave at one
# program an SM (default_settings' deep rule): stages up to this much shared memory (8
# stages of 20 KB at 16 padded rows, 6 of 24 KB at 32; ~180 KB a program with Triton's own
# scratch; sm_90 and sm_100 have 228 KB; measured on sm_90 only). Measured at 8 rows alone
# and in the B8 and B32 steps (notes/decode_step.md).
DEEP_STAGE_BUDGET = 160 * 1024
DEEP_MAX_STAGES = 8


def block_m(M: int, use_dot: bool) -> int:
    """Rows of the accumulator: M padded to a power of two (to >= 16 for tl.dot)."""
    return max(16, next_pow2(M)) if use_dot else next_pow2(M)


def _stage_bytes(block_n: int, block_k: int, M: int, use_dot: bool, silu_mul: bool,
                 elem: int) -> int:
    """Shared memory of one pipeline stage: a K tile of the program's W rows (gate and up
    with silu_mul) and of its block_m rows of x."""
    return ((2 if silu_mul else 1) * block_n + block_m(M, use_dot)) * block_k * elem


def _split_k(programs: int, K: int, block_k: int, num_sms: int) -> int:
    """K splits (a power of two, each >= MIN_SPLIT_TILES tiles, <= MAX_SPLIT_K) until the
    programs fill SPLIT_BELOW of the SMs."""
    split = 1
    most = min(MAX_SPLIT_K, max(1, cdiv(K, block_k) // MIN_SPLIT_TILES))
    while programs * split < SPLIT_BELOW * num_sms and split * 2 <= most:
        split *= 2
    return split


@functools.lru_cache(maxsize=1024)
def default_settings(target: Target, *, M: int, N: int, K: int, dtype: torch.dtype,
                     silu_mul: bool = False, deep: bool = True) -> GemvSettings:
    """Settings from (target, shape, dtype). N counts output columns (F with silu_mul).

    Memory-bound choices: BLOCK_N is the largest tile whose column blocks still give two
    programs per SM, but never below M (every program re-reads all of x from L2, so
    BLOCK_N >= M keeps that traffic at most the W traffic); where the blocks fill fewer
    than SPLIT_BELOW of the SMs, K is split (a power of two, each split >= MIN_SPLIT_TILES
    tiles) until they fill them. On sm_90/100 in 16 bits: one row on the FMA path (its row
    fold) at every shape; from two rows the dot path (the FMA reduction for the shapes it
    would split at M <= FMA_SPLIT_MAX_M_SM90), and where the rule would give it fewer than
    64 columns at M <= 32: 64 columns, K split, 3 stages, or from three rows with
    ``deep`` one wave of programs with up to DEEP_MAX_STAGES stages (measured). ``deep=False``
    keeps the three-stage split rule: the GEMV-epilogue QKV path's projection
    (qkv_rope.py), whose finish launch carries the epilogue, measured slower unsplit.
    """
    # 16-bit only: fp32 on the dot path would run TF32, and only bf16 was measured
    wide_dot = 90 <= target.cc < 120 and dtype != torch.float32
    if wide_dot and M == 1:
        # one row: the FMA path's row fold at every shape, 16 W rows of 512 bytes a tile,
        # six stages, K split by the rule. H200, against the dot rule (notes/decode_step.md):
        # 8B gate/up 61.5 -> 58.1 us, LM heads 125.3 -> 119.4 (1B) and 243.2 -> 237.6 (8B),
        # 1B gate/up even; the split shapes (QKV, o, down) were on it already
        return _one_row_settings(target, N, K, dtype)
    use_dot = wide_dot or M > FMA_MAX_M
    # two rows keep the rule they were measured with (the FMA reduction where it splits)
    deep = deep and M > FMA_SPLIT_MAX_M_SM90
    s = _settings(target, M, N, K, dtype, silu_mul, use_dot, deep)
    if wide_dot and s.use_dot and s.split_k > 1 and M <= FMA_SPLIT_MAX_M_SM90:
        s = _settings(target, M, N, K, dtype, silu_mul, False, False)
    return s


def _one_row_settings(target: Target, N: int, K: int, dtype: torch.dtype) -> GemvSettings:
    """default_settings' rule for one row in 16 bits on sm_90 / sm_100 (the row fold)."""
    elem = torch.empty((), dtype=dtype).element_size()
    block_k = FMA_TILE_ELEMS * 2 // elem // ONE_ROW_BLOCK_N
    split = _split_k(cdiv(N, ONE_ROW_BLOCK_N), K, block_k, target.num_sms)
    return GemvSettings(BLOCK_N=ONE_ROW_BLOCK_N, BLOCK_K=block_k, split_k=split, use_dot=False,
                        num_warps=4, num_stages=MAX_STAGES)


def _settings(target: Target, M: int, N: int, K: int, dtype: torch.dtype, silu_mul: bool,
              use_dot: bool, deep: bool) -> GemvSettings:
    """default_settings' rule for one path (use_dot)."""
    if target.backend == "interpreter":
        # small tiles, so that small test shapes cross several tiles, masks and blocks
        return GemvSettings(BLOCK_N=64, BLOCK_K=64, split_k=1, use_dot=use_dot,
                            num_warps=4, num_stages=1)
    elem = torch.empty((), dtype=dtype).element_size()
    if use_dot:
        # acc [BLOCK_N, BLOCK_M] fp32 at <= 64 registers a thread (128 threads)
        candidates = [bn for bn in (128, 64, 32, 16)
                      if max(16, next_pow2(M)) <= bn <= 64 * 128 // block_m(M, True)]
        block_ks = {bn: ROW_BYTES // elem for bn in candidates}
    else:
        # the FMA product [BLOCK_N, BLOCK_K] fp32 at 32 values a thread (BLOCK_M of
        # them one after another); 8 KB of 16-bit W a tile
        candidates = [32, 16]
        block_ks = {bn: FMA_TILE_ELEMS * 2 // elem // bn for bn in candidates}
    block_n = candidates[-1]
    for cand in candidates:
        if cdiv(N, cand) >= 2 * target.num_sms:
            block_n = cand
            break
    if silu_mul and not use_dot and target.cc >= 90:
        # gate and up rows: 16 + 16 rows of 512 bytes a tile, not 32 + 32 of 256. H200,
        # Llama-3.1-8B gate/up at M = 1 (F 14336, the rule above gave 32): 79.0 -> 62.0 us,
        # 0.71 -> 0.91 of the copy ceiling; Llama-3.2-1B (F 8192) already took 16
        # (notes/decode_step.md)
        block_n = 16
    if (use_dot and block_n < DOT_WIDE_BLOCK_N and block_m(M, True) <= DOT_WIDE_MAX_M
            and 90 <= target.cc < 120):
        # 64 columns a program, K split until the programs fill the SMs. Narrow dot tiles
        # (BLOCK_N 16, two programs an SM) ran at 0.17-0.40 of the copy ceiling on the
        # H200 at M = 8; BLOCK_N 64 with this split rule, 3 stages, at 0.35-0.80
        # (notes/decode_step.md, "GEMV settings at M = 8"). Wide shapes (the LM heads)
        # keep the 128-column tiles they already read at the ceiling with. sm_90 and
        # sm_100 only: 3 stages of 37 KB need their 228 KB (sm_80 and sm_120 keep the rule).
        block_k = ROW_BYTES // elem
        tiles = cdiv(N, DOT_WIDE_BLOCK_N)
        split = _split_k(tiles, K, block_k, target.num_sms)
        stages = 3
        if deep:
            # One wave at one program an SM, then the deepest pipeline that fits: what a
            # memory-bound program keeps in flight is its stages, and 2 of 3 tiles (40 KB)
            # were too few. Where the split would give more programs than SMs, and the
            # tiles alone fill half of them, the split goes. H200, M = 8, PDL off, us, the
            # rule before (split by the rule, 3 stages) -> this one, cuBLAS
            # (notes/decode_step.md): 8B down 36.0 -> 32.6 (split 2, 8 stages; 31.2), o 14.2
            # -> 13.3 (12.3), QKV 17.8 -> 17.0 (split 1; 15.4); Qwen3-30B-A3B QKV 10.8 ->
            # 10.1 (split 1; 7.8), o 9.4 -> 9.0 (split 4; 8.6); 1B down 14.1 -> 13.1 (split 4;
            # 12.6), o even; 1B QKV (48 tiles, 192 programs) keeps 3 stages: 8.4, where
            # split 2 and 6 stages took 9.1.
            if tiles * split > target.num_sms and 2 * tiles >= target.num_sms:
                split = 1
            if tiles * split <= target.num_sms:
                stage = _stage_bytes(DOT_WIDE_BLOCK_N, block_k, M, True, silu_mul, elem)
                stages = max(stages, min(DEEP_MAX_STAGES, DEEP_STAGE_BUDGET // stage))
        return GemvSettings(BLOCK_N=DOT_WIDE_BLOCK_N, BLOCK_K=block_k, split_k=split,
                            use_dot=True, num_warps=4, num_stages=stages)
    block_k = block_ks[block_n]
    split = _split_k(cdiv(N, block_n), K, block_k, target.num_sms)
    if use_dot and split == 1 and block_m(M, True) > DOT_WIDE_MAX_M and 90 <= target.cc < 120:
        # 33-64 rows, unsplit: one program an SM with deeper pipelines instead of two with
        # two stages each. H200 at M = 64, the rule below against these side by side
        # (notes/decode_step.md): 1B gate/up 28.8 -> 22.2 us and 8B 98.0 -> 69.8 with three
        # stages of BLOCK_K 128; the LM heads 211 -> 142 (1B) and 396 -> 274 (8B) with 128
        # columns, BLOCK_K 64, 8 warps, 4 stages (cuBLAS 145 / 283). The split shapes (QKV,
        # o, down) keep the rule: every deeper variant was slower there.
        if block_n >= 128:
            return GemvSettings(BLOCK_N=block_n, BLOCK_K=ROW_BYTES // 2 // elem, split_k=1,
                                use_dot=True, num_warps=8, num_stages=4)
        return GemvSettings(BLOCK_N=block_n, BLOCK_K=block_k, split_k=1, use_dot=True,
                            num_warps=4, num_stages=3)
    # Bytes in flight: (stages - 1) tiles a program. As many stages as fit
    # STAGE_BUDGET of shared memory (two programs an SM on sm_90's 228 KB), 2..MAX_STAGES.
    stage_bytes = _stage_bytes(block_n, block_k, M, use_dot, silu_mul, elem)
    budget = STAGE_BUDGET if target.cc < 120 else STAGE_BUDGET // 2  # ~100 KB parts
    if target.cc < 90:
        budget = budget * 3 // 4  # sm_80: 164 KB
    stages = max(2, min(MAX_STAGES, budget // stage_bytes))
    return GemvSettings(BLOCK_N=block_n, BLOCK_K=block_k, split_k=split, use_dot=use_dot,
                        num_warps=4, num_stages=stages)


# --------------------------------------------------------------------------- launcher

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_interpreter_patched = False


def _check(x, w, norm_eps, residual, silu_mul, out, pdl, settings):
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError("x and w must be torch.Tensors")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got shape {tuple(w.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"w dtype must match x ({x.dtype}), got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w must be on x's device {x.device}, got {w.device}")
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_M:
        raise ValueError(f"x has M={M} rows; gemv takes 1..{MAX_M} (more is a GEMM)")
    if w.shape[1] != K:
        raise ValueError(f"w must be [N, K={K}] (x is [{M}, {K}]), got {tuple(w.shape)}")
    if K == 0:
        raise ValueError("x and w must have K >= 1 columns")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a contiguous last dimension (stride 1), got "
                         f"x strides {x.stride()}, w strides {w.stride()}")
    if not isinstance(silu_mul, bool):
        raise TypeError(f"silu_mul must be a bool, got {silu_mul!r}")
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs w = [gate; up] with an even row count, got N={N}")
    nout = N // 2 if silu_mul else N
    if norm_eps is not None:
        check_eps("norm_eps", norm_eps)
    for name, t in (("residual", residual), ("out", out)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (M, nout):
            raise ValueError(f"{name} must be [M, {'F' if silu_mul else 'N'}] = [{M}, {nout}], "
                             f"got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} dtype must match x ({x.dtype}), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
        if M and nout and t.stride(1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, got strides {t.stride()}")
    if out is not None and M and nout:
        check_distinct("out", out)
        for name, t in (("x", x), ("w", w)):
            if overlaps(out, t):
                raise ValueError(f"out must not overlap {name}: other programs still read it")
        if residual is not None and overlaps(out, residual) and not same_view(out, residual):
            raise ValueError("out may be residual itself (in-place) but must not partly "
                             "overlap it")
    if pdl is not None and not isinstance(pdl, bool):
        raise TypeError(f"pdl must be None or a bool, got {pdl!r}")
    if settings is not None:
        if not isinstance(settings, GemvSettings):
            raise TypeError(f"settings must be None or a GemvSettings, got {type(settings).__name__}")
        if not settings.use_dot and M > FMA_SETTINGS_MAX_M:
            raise ValueError(f"settings.use_dot=False takes M <= {FMA_SETTINGS_MAX_M}, got M={M}")
    return M, N, K, nout


def gemv(x, w, *, norm_eps=None, residual=None, silu_mul=False, out=None, pdl=None,
         settings=None, pdl_late=None):
    """y = epilogue(x @ w^T) for a decode step's few rows, reading w once.

    Args:
        x: [M, K] activations, 1 <= M <= 64, float16 / bfloat16 (float32 for the
            interpreter), last dimension contiguous (rows may be strided).
        w: [N, K] weight, row-major as nn.Linear stores it, x's dtype, last dimension
            contiguous. With silu_mul, the gate rows then the up rows: [2F, K].
        norm_eps: None, or the RMSNorm epsilon: then w must have the norm weight folded
            into its columns (w = W diag(g)) and output row m is scaled by
            rsqrt(mean(x[m]^2) + norm_eps), computed in the kernel (FlashNorm).
        residual: None, or [M, NOUT] in x's dtype (last dim contiguous): added to the
            result in fp32 before the single rounding to x's dtype.
        silu_mul: output column n is silu(x . w[n]) * (x . w[F + n]); NOUT = F = N / 2.
            Otherwise NOUT = N.
        out: None (allocate), or [M, NOUT] in x's dtype to write into; out=residual
            updates the residual stream in place. Must not overlap x or w.
        pdl: programmatic dependent launch (sm_90+). None = on where available (CUDA
            sm_90+), off elsewhere. Every kernel launched after this one with PDL must
            call griddepcontrol.wait before reading this one's output.
        settings: a GemvSettings to override default_settings.
        pdl_late: with PDL, release the next kernel after the weight stream (the K loop)
            instead of right after the wait; None: when M < ``PDL_LATE_BELOW_M`` (where
            each measured faster in the decode step). The result is the same bit for bit.

    Returns:
        out [M, NOUT] in x's dtype. Accumulation is fp32; the norm scale, SiLU and the
        residual add are applied in fp32 to the accumulator.

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> x = torch.randn(3, 200, dtype=torch.float16)
        >>> w = torch.randn(2 * 80, 200, dtype=torch.float16) / 16
        >>> y = gemv(x, w, norm_eps=1e-5, silu_mul=True)   # [3, 80]
    """
    M, N, K, nout = _check(x, w, norm_eps, residual, silu_mul, out, pdl, settings)
    if pdl_late is None:
        pdl_late = M < PDL_LATE_BELOW_M
    elif not isinstance(pdl_late, bool):
        raise TypeError(f"pdl_late must be None or a bool, got {pdl_late!r}")
    target = target_of(x.device)
    has_pdl = target.backend == "cuda" and target.cc >= 90
    if pdl and not has_pdl:
        # griddepcontrol is sm_90+ PTX, and the interpreter has no inline assembly
        raise ValueError(f"pdl=True needs a CUDA GPU of sm_90 or later; this call runs on "
                         f"{target.name}")
    if pdl is None:
        pdl = has_pdl
    if out is None:
        out = empty((M, nout), x.dtype, x.device)
    if M == 0 or nout == 0:
        return out
    if target.backend == "interpreter":
        _interpreter_ready()
        if x.dtype == torch.bfloat16:
            # the interpreter's tl.dot multiplies bf16 as raw bits: run in fp32, round once
            y = gemv(x.float(), w.float(), norm_eps=norm_eps, silu_mul=silu_mul,
                     residual=None if residual is None else residual.float(), pdl=pdl,
                     settings=settings, pdl_late=pdl_late)
            return out.copy_(y)
    if settings is None:
        settings = default_settings(target, M=M, N=nout, K=K, dtype=x.dtype, silu_mul=silu_mul)
    split = launch_split(K, settings)
    ws, ss = split_workspace(split, M, N, x.device, out)
    bm = block_m(M, settings.use_dot)
    res = residual if residual is not None else out  # any pointer when unused
    eps = float(norm_eps) if norm_eps is not None else 0.0
    launch = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(cdiv(nout, settings.BLOCK_N), split)](
        x, w, res, out, ws, ss, M, nout, K, eps,
        x.stride(0), w.stride(0), res.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=settings.BLOCK_N, BLOCK_K=settings.BLOCK_K, SPLIT_K=split,
        USE_DOT=settings.use_dot, NORM=norm_eps is not None, RESIDUAL=residual is not None,
        SILU_MUL=silu_mul, PDL=pdl, STAGES=settings.num_stages, PDL_LATE=bool(pdl and pdl_late),
        num_warps=settings.num_warps, num_stages=settings.num_stages, **launch)
    if split > 1:
        bm = finish_block_m(M)
        _splitk_finish_kernel[(cdiv(nout, FINISH_BLOCK_N), cdiv(M, bm))](
            ws, ss, res, out, M, nout, K, eps, res.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=FINISH_BLOCK_N, SPLIT_K=split,
            NORM=norm_eps is not None, RESIDUAL=residual is not None, SILU_MUL=silu_mul,
            PDL=pdl, num_warps=4, **launch)
    return out


FINISH_BLOCK_N = 64  # split-K finish: columns per program (4 warps, <= 64 x 64 fp32 tile)
# ... and rows per program: a finish is a chain of dependent loads, adds and (qkv_rope's)
# sin / cos with nothing to hide its latency but other warps, so at 64 rows one program
# of all rows (32 elements a thread at 4 warps, one program an SM) ran ~6 us a call in the
# H200 step; row blocks of 16 give 4x the programs at 64 rows, 4 elements a thread.
FINISH_BLOCK_M = 16


def finish_block_m(M: int) -> int:
    """Rows a program of a split-K finish (gemv's, qkv_rope's) takes."""
    return min(next_pow2(M), FINISH_BLOCK_M)


def launch_split(K: int, settings: GemvSettings) -> int:
    """The K splits a launch of _gemv_kernel's stream runs with settings (gemv, qkv_rope's
    GEMV-epilogue path): a split past the last K tile would only add zeros, so none is."""
    tiles = cdiv(K, settings.BLOCK_K)
    return cdiv(tiles, cdiv(tiles, min(settings.split_k, tiles)))


def split_workspace(split: int, M: int, N: int, device, unused):
    """(ws, ss): the fp32 partials [split, M, N] and x^2 sums [split, M] of a split launch
    (store_partials / sum_partials); ``unused`` for both where split is 1 (the SPLIT_K == 1
    branch compiles away)."""
    if split == 1:
        return unused, unused
    return (torch.empty((split, M, N), dtype=torch.float32, device=device),
            torch.empty((split, M), dtype=torch.float32, device=device))


def _interpreter_ready():
    """Apply the library's Triton-interpreter work-arounds once (see _triton_compat)."""
    global _interpreter_patched
    if not _interpreter_patched:
        from .._triton_compat import patch_interpreter
        patch_interpreter()
        _interpreter_patched = True


# --------------------------------------------------------------------------- compile specs



def compile_spec(cc: int, *, M: int = 1, N: int = 2048, K: int = 2048, dtype: str = "bf16",
                 norm: bool = False, residual: bool = False, silu_mul: bool = False,
                 pdl: bool = False, settings: GemvSettings | None = None,
                 num_sms: int = 132, kernel: str = "gemv", pdl_late: bool = False) -> dict:
    """What ``triton.compile`` needs to build the GEMV kernel for compute capability cc.

    N counts output columns (F with silu_mul). kernel="gemv" gives the main kernel,
    kernel="finish" the split-K finish (for the settings' split_k). Settings default to
    default_settings for (M, N, K) on a GPU with num_sms SMs.

    Returns a dict with "fn", "signature" ({argument: Triton type}, constexprs typed
    "constexpr"), "constexprs", "attrs" (16-divisibility of the pointers, K and the row
    strides, as a real launch with aligned tensors specializes them) and "options".
    Use: ``triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
    attrs=s["attrs"]), target=GPUTarget("cuda", cc, 32), options=s["options"])``.
    """
    t = dtype_name(dtype)  # Triton's type string is the same name
    if settings is None:
        settings = default_settings(Target("cuda", cc, num_sms), M=M, N=N, K=K,
                                    dtype=DTYPES[dtype], silu_mul=silu_mul)
    options = {"num_warps": settings.num_warps, "num_stages": settings.num_stages}
    if pdl:
        options["launch_pdl"] = True
    flags = {"NORM": norm, "RESIDUAL": residual, "SILU_MUL": silu_mul, "PDL": pdl}
    if kernel == "finish":
        sig = {"ws_ptr": "*fp32", "ss_ptr": "*fp32", "res_ptr": f"*{t}", "out_ptr": f"*{t}",
               "M": "i32", "NOUT": "i32", "K": "i32", "eps": "fp32",
               "stride_rm": "i32", "stride_om": "i32"}
        const = {"BLOCK_M": finish_block_m(M), "BLOCK_N": FINISH_BLOCK_N,
                 "SPLIT_K": settings.split_k, **flags}
        fn, aligned = _splitk_finish_kernel, ("ws_ptr", "ss_ptr", "res_ptr", "out_ptr",
                                              "stride_rm", "stride_om")
        options["num_warps"] = 4
        options.pop("num_stages")
    elif kernel == "gemv":
        sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "res_ptr": f"*{t}", "out_ptr": f"*{t}",
               "ws_ptr": "*fp32", "ss_ptr": "*fp32", "M": "i32", "NOUT": "i32", "K": "i32",
               "eps": "fp32", "stride_xm": "i32", "stride_wn": "i32", "stride_rm": "i32",
               "stride_om": "i32"}
        const = {"BLOCK_M": block_m(M, settings.use_dot), "BLOCK_N": settings.BLOCK_N,
                 "BLOCK_K": settings.BLOCK_K, "SPLIT_K": settings.split_k,
                 "USE_DOT": settings.use_dot, **flags, "STAGES": settings.num_stages,
                 "PDL_LATE": pdl_late}
        fn, aligned = _gemv_kernel, ("x_ptr", "w_ptr", "res_ptr", "out_ptr", "ws_ptr", "ss_ptr",
                                     "K", "stride_xm", "stride_wn", "stride_rm", "stride_om")
    else:
        raise ValueError(f"kernel must be 'gemv' or 'finish', got {kernel!r}")
    sig.update({name: "constexpr" for name in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": sig, "constexprs": const, "attrs": attrs, "options": options}
