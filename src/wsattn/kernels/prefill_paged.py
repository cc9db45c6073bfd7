"""Chunked prefill against a paged KV cache ("prefill with paged KV"), in Triton.

A packed chunk of new queries q [Tq, Hq, D] (sequence b owns rows cu_seqlens_q[b] to
cu_seqlens_q[b+1]) attends to the keys of its sequence, which all live in a paged
cache [num_pages, page_size, Hkv, D]: key j of sequence b is row j % page_size of page
block_table[b, j // page_size], for j < seqlens_k[b]. The chunk's own K/V are already
in the cache (the caller appended them), so causal masking is bottom-right aligned per
sequence: query i of a chunk of Lq rows sees keys j <= seqlens_k[b] - Lq + i.

Grid: (query tiles, Hq). The query tiles of all sequences are numbered one after the
other (sequence b owns cdiv(Lq_b, BLOCK_M) of them, an empty chunk none); the launcher
turns cu_seqlens_q into those tile offsets with torch ops on the device (no host read,
so a launch can be captured in a CUDA graph) and launches an upper bound of programs;
each program finds its sequence by counting the offsets at or below its tile, and the
surplus programs exit at once. K/V by pointer loads: each tile of BLOCK_N keys is
gathered row by row through the block table, or, when pages hold whole tiles
(PAGE_SIZE % BLOCK_N == 0), read as one page's contiguous rows. The ``use_tma`` switch
(off by default, not yet measured) reads such a tile with one TMA load from a
descriptor over the cache's rows of the KV head, at row page * PAGE_SIZE + offset, as
FlashAttention-3 reads a paged cache on sm_90. Online softmax in fp32 with exp2 (the
scale folded into log2(e)); LSE natural log, fp32.

Reads top to bottom: jit kernels, settings, launcher, ``prefill_paged``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..target import Target, target_of
from ..testing import DTYPES, dtype_name
from ._alloc import empty, ensure_descriptor_allocator
from ._rebuild import rebuild
from ._precision import F32_DOT
from ._softmax import _max_combine, _softmax_step, _sum_combine  # noqa: F401 (_JIT_NAMES)
from ._intmath import cdiv
from .prefill_triton import tile_family

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- jit kernels

@triton.jit
def _kv_rows(bt_row, start_n, offs_n, seqlen_k, stride_kp, stride_ks,
             BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets [BLOCK_N] (int64) of keys start_n + [0, BLOCK_N) in the cache."""
    if PAGE_SIZE % BLOCK_N == 0:
        # tiles start BLOCK_N-aligned, so a tile lies inside one page: one table entry and
        # contiguous rows, which the compiler sees as base + arange * stride
        page = tl.load(bt_row + start_n // PAGE_SIZE).to(tl.int64)
        in_page = (start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N]
    else:  # a tile spans pages: one table entry per key (masked past the keys)
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < seqlen_k,
                       other=0).to(tl.int64)  # [BLOCK_N]
        in_page = (offs_n % PAGE_SIZE).to(tl.int64)
    return page * stride_kp + in_page * stride_ks


@triton.jit
def _paged_inner(acc, l_i, m_i, q, k_src, v_src, bt_row, lo, hi, offs_m, seqlen_k, diag,
                 qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tiles [lo, hi) into the running (acc, l_i, m_i); m_i in log2 units. MASK: apply
    the key bound (and the causal mask when CAUSAL); the caller sets it only on the last
    / diagonal tiles, so the bulk of the loop loads and computes without masks. k_src /
    v_src: this KV head's base pointers, or (USE_TMA) TMA descriptors over the cache's
    [num_pages * PAGE_SIZE, D] rows of this head, a tile being one page's BLOCK_N rows."""
    offs_d = tl.arange(0, D)  # [D]
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        if USE_TMA:
            # start_n < seqlen_k, so the entry is the sequence's; rows past seqlen_k in
            # the page are masked below (K by the score mask, V zeroed)
            page = tl.load(bt_row + start_n // PAGE_SIZE)
            row = page * PAGE_SIZE + start_n % PAGE_SIZE
            k = k_src.load([row, 0])  # [BLOCK_N, D]
        else:
            k_rows = _kv_rows(bt_row, start_n, offs_n, seqlen_k, stride_kp, stride_ks,
                              BLOCK_N, PAGE_SIZE)  # [BLOCK_N]
            if MASK:  # past seqlen_k: other sequences' pages, or no page at all
                k = tl.load(k_src + k_rows[:, None] + offs_d[None, :],
                            mask=offs_n[:, None] < seqlen_k, other=0.0)  # [BLOCK_N, D]
            else:
                k = tl.load(k_src + k_rows[:, None] + offs_d[None, :])  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=F32_DOT)  # [BLOCK_M, BLOCK_N] fp32
        p, m_new, l_i, acc = _softmax_step(s, m_i, l_i, acc, offs_m, offs_n, seqlen_k, diag,
                                           qk_scale, MASK, CAUSAL)
        if USE_TMA:
            v = v_src.load([row, 0])  # [BLOCK_N, D]
            if MASK:  # p is 0 there, but 0 * a NaN or inf left in the page is not
                v = tl.where(offs_n[:, None] < seqlen_k, v, 0.0)
        else:
            v_rows = _kv_rows(bt_row, start_n, offs_n, seqlen_k, stride_vp, stride_vs,
                              BLOCK_N, PAGE_SIZE)
            if MASK:
                v = tl.load(v_src + v_rows[:, None] + offs_d[None, :],
                            mask=offs_n[:, None] < seqlen_k, other=0.0)  # [BLOCK_N, D]
            else:
                v = tl.load(v_src + v_rows[:, None] + offs_d[None, :])  # [BLOCK_N, D]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=F32_DOT)  # [BLOCK_M, D]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_paged_fwd(Q, K, V, O, LSE, CU_Q, TILE_CU, SEQLENS_K, BT, B, NUM_ROWS, sm_scale,
                       stride_qt, stride_qh,
                       stride_kp, stride_ks, stride_kh,
                       stride_vp, stride_vs, stride_vh,
                       stride_ot, stride_oh,
                       stride_lh, stride_btb,
                       GROUP: tl.constexpr, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                       USE_TMA: tl.constexpr):
    """Grid (query tiles, Hq). q/out [Tq, Hq, D], lse [Hq, Tq]; TILE_CU int32 [B + 1]:
    the first query tile of each sequence (TILE_CU[B] = the number of tiles). NUM_ROWS
    (USE_TMA): num_pages * PAGE_SIZE, the rows of the cache the descriptors span."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    # This tile's sequence: the number of sequences whose tiles all come before it. The
    # counts of BLOCK_B offsets at a time are independent loads, not a chain of
    # dependent ones as in a binary search.
    b = tile * 0  # an int32 tensor from the start: its type must not change in the loop
    for c in tl.range(0, B, BLOCK_B):
        idx = c + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        ends = tl.load(TILE_CU + 1 + idx, mask=idx < B, other=2147483647)
        b += tl.reduce((ends <= tile).to(tl.int32), 0, _sum_combine)
    if b >= B:  # surplus program: the grid is an upper bound of the tiles
        return
    m0 = (tile - tl.load(TILE_CU + b)) * BLOCK_M
    q_start = tl.load(CU_Q + b).to(tl.int64)
    seqlen_q = tl.load(CU_Q + b + 1) - q_start.to(tl.int32)
    seqlen_k = tl.load(SEQLENS_K + b)
    hk = h // GROUP  # GQA: GROUP query heads share one KV head
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, D)  # [D]
    row_ok = offs_m < seqlen_q
    q_rows = (q_start + offs_m) * stride_qt + h * stride_qh  # [BLOCK_M] int64
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)  # [BLOCK_M, D]
    if USE_TMA:  # pages of whole tiles, rows contiguous across pages (the launcher's check)
        k_src = tl.make_tensor_descriptor(K + hk * stride_kh, shape=[NUM_ROWS, D],
                                          strides=[stride_ks, 1], block_shape=[BLOCK_N, D])
        v_src = tl.make_tensor_descriptor(V + hk * stride_vh, shape=[NUM_ROWS, D],
                                          strides=[stride_vs, 1], block_shape=[BLOCK_N, D])
    else:
        k_src = K + hk * stride_kh
        v_src = V + hk * stride_vh
    bt_row = BT + b.to(tl.int64) * stride_btb

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp(x * scale) = exp2(x * qk_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, tl.float32)
    diag = seqlen_k - seqlen_q
    if CAUSAL:
        # Every row of the tile sees keys [0, m0 + diag + 1): whole key tiles of that need
        # no mask; the rest, up to the last row's horizon, is the diagonal. Key tiles past
        # it are never visited. (max 0: a caller's seqlens_k < Lq, refused when values are
        # validated, leaves early rows without keys rather than reading before key 0.)
        n_full = tl.maximum(((m0 + diag + 1) // BLOCK_N) * BLOCK_N, 0)
        n_end = tl.minimum(m0 + BLOCK_M + diag, seqlen_k)
    else:
        n_full = (seqlen_k // BLOCK_N) * BLOCK_N
        n_end = seqlen_k
    n_full = tl.minimum(n_full, tl.maximum(n_end, 0))
    acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, k_src, v_src, bt_row, 0, n_full, offs_m,
                                 seqlen_k, diag, qk_scale, stride_kp, stride_ks, stride_vp,
                                 stride_vs, D, BLOCK_N, PAGE_SIZE, False, CAUSAL, USE_TMA)
    acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, k_src, v_src, bt_row, n_full, n_end,
                                 offs_m, seqlen_k, diag, qk_scale, stride_kp, stride_ks,
                                 stride_vp, stride_vs, D, BLOCK_N, PAGE_SIZE, True, CAUSAL,
                                 USE_TMA)

    # A row that saw no key (seqlens_k 0) gives out 0 and lse -inf, not 0/0.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = (acc / l_safe[:, None]).to(O.dtype.element_ty)  # [BLOCK_M, D]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=row_ok)
    o_rows = (q_start + offs_m) * stride_ot + h * stride_oh  # [BLOCK_M] int64
    tl.store(O + o_rows[:, None] + offs_d[None, :], out, mask=row_ok[:, None])


_JIT_NAMES = ("_max_combine", "_sum_combine", "_softmax_step", "_kv_rows", "_paged_inner", "_prefill_paged_fwd")


def _kernel(interpret: bool):
    """``_prefill_paged_fwd`` built for the interpreter or for the compiler, whatever the
    process (why and how: ``_rebuild``)."""
    return rebuild(globals(), _JIT_NAMES, "_prefill_paged_fwd", interpret)


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class PagedPrefillSettings:
    """Launch settings of the paged prefill kernel (see ``default_settings``). use_tma:
    K/V tiles by TMA from the page's rows (sm_90+, pages holding whole BLOCK_N tiles,
    cache rows contiguous across pages); off by default: on the H200 it gained 2-6 % at
    prefixes of 2k-32k and lost 3 % at none, and its GPU tests and sanitizer gate have not
    completed with it on (notes/prefill_triton.md)."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim, 2-byte dtypes. Not yet swept on
# a GPU: chosen so that ptxas (-v, bf16, causal, pages of 16 and 64) reports no spills.
# Eight warps throughout: at 4 warps sm_90 D64 needed 254 registers, and sm_80 D64/D128,
# sm_90 D256 and sm_120 D128 spilled; BLOCK_N 32 at D128 on sm_80/sm_120 for the same
# reason. Shared memory is about (BLOCK_M + 2 * (num_stages - 1) * BLOCK_N) * D * 2 bytes.
_TILES = {
    "big": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)},   # sm_90, sm_100
    "sm80": {64: (128, 64, 8, 3), 128: (128, 32, 8, 2), 256: (64, 32, 8, 2)},
    "small": {64: (128, 64, 8, 2), 128: (128, 32, 8, 2), 256: (64, 32, 8, 2)},  # sm_120
}
# Small tiles in the interpreter, so that short test chunks cross several query and key
# tiles; BLOCK_N 32 makes pages of 16 take the gather path and pages of 64 the one-page one.
_INTERPRETER = PagedPrefillSettings(16, 32, 4, 1)
BLOCK_B = 128  # tile offsets a program reads per step while finding its sequence


def default_settings(target: Target, head_dim: int, dtype: torch.dtype) -> PagedPrefillSettings:
    """Launch settings for (target, head dim, dtype); fp32 halves BLOCK_N (twice the
    bytes per tile) and keeps at most 2 stages. Raises UnsupportedTargetError below sm_80."""
    if target.backend == "interpreter":
        return _INTERPRETER
    family = tile_family(target, head_dim, "paged prefill")
    bm, bn, warps, stages = _TILES[family][head_dim]
    if dtype == torch.float32:
        bn = max(16, bn // 2)
        # fp32 D256 on sm_120 at 2 stages asks for 102912 bytes of its 101376
        stages = 1 if family == "small" and head_dim == 256 else min(stages, 2)
    return PagedPrefillSettings(bm, bn, warps, stages)


# --------------------------------------------------------------------------- launcher

def _tile_offsets(cu_seqlens_q, block_m: int):
    """int32 [B + 1]: the first query tile of each sequence, with torch ops on the device
    (no host read)."""
    lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    tiles = torch.div(lens + (block_m - 1), block_m, rounding_mode="floor")
    out = torch.zeros_like(cu_seqlens_q)
    torch.cumsum(tiles, 0, out=out[1:])
    return out


def num_tiles_bound(total_q: int, batch: int, block_m: int, max_seqlen_q: int | None) -> int:
    """An upper bound of the query tiles, from host metadata only: each sequence adds at
    most one partial tile to the packed rows' count; with max_seqlen_q known, no sequence
    has more than cdiv(max_seqlen_q, BLOCK_M)."""
    bound = cdiv(total_q, block_m) + batch
    if max_seqlen_q is not None:
        bound = min(bound, batch * cdiv(max_seqlen_q, block_m))
    return bound


def _launch(q, k_cache, v_cache, out, lse, cu_q, seqlens_k, block_table, max_q, causal,
            sm_scale, s: PagedPrefillSettings, interpret: bool):
    Tq, Hq, D = q.shape
    B = cu_q.numel() - 1
    grid = (num_tiles_bound(Tq, B, s.BLOCK_M, max_q), Hq)
    if grid[0] == 0:
        return
    tile_cu = _tile_offsets(cu_q, s.BLOCK_M)
    if s.use_tma and not interpret:
        ensure_descriptor_allocator()
    num_rows = k_cache.shape[0] * k_cache.shape[1]
    _kernel(interpret)[grid](
        q, k_cache, v_cache, out, lse, cu_q, tile_cu, seqlens_k, block_table, B, num_rows,
        sm_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), block_table.stride(0),
        GROUP=Hq // k_cache.shape[2], D=D, BLOCK_M=s.BLOCK_M, BLOCK_N=s.BLOCK_N,
        BLOCK_B=BLOCK_B, PAGE_SIZE=k_cache.shape[1], CAUSAL=causal, USE_TMA=s.use_tma,
        num_warps=s.num_warps, num_stages=s.num_stages)


def tma_unsupported(target: Target, k_cache, v_cache, settings: PagedPrefillSettings):
    """None when settings.use_tma can run on these caches, else why not."""
    page = k_cache.shape[1]
    if target.backend != "interpreter" and target.cc < 90:
        return f"use_tma needs sm_90 or later (TMA), got {target.name}"
    if page % settings.BLOCK_N:
        return (f"use_tma needs pages of whole tiles: page_size {page} is not a multiple "
                f"of BLOCK_N {settings.BLOCK_N}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        rows_contiguous = c.stride(0) == page * c.stride(1) and c.stride(3) == 1
        aligned = (c.stride(1) * c.element_size()) % 16 == 0 and c.data_ptr() % 16 == 0 \
            and (c.stride(2) * c.element_size()) % 16 == 0
        if not (rows_contiguous and aligned):
            return (f"use_tma needs {name}'s rows contiguous across pages (stride(0) == "
                    f"page_size * stride(1)) and 16-byte aligned rows and heads")
    return None


def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16", causal: bool = True,
                 page_size: int = 16, settings: PagedPrefillSettings | None = None,
                 group: int = 4) -> dict:
    """What ``triton.compile`` needs to build this kernel for compute capability cc, no
    GPU needed: {"fn", "signature", "constexprs", "attrs", "options", "settings"}, as
    ``prefill_triton.compile_spec`` (use ``ASTSource(fn, signature, constexprs, attrs)``
    and ``triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)``).
    Settings default to ``default_settings(Target("cuda", cc, 132), head_dim, dtype)``."""
    ty = dtype_name(dtype)
    s = settings or default_settings(Target("cuda", cc, 132), head_dim, DTYPES[ty])
    fn = _kernel(False)
    ptr = "*" + ty
    signature = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "LSE": "*fp32", "CU_Q": "*i32",
                 "TILE_CU": "*i32", "SEQLENS_K": "*i32", "BT": "*i32", "B": "i32",
                 "NUM_ROWS": "i32", "sm_scale": "fp32"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    signature.update({n: "i32" for n in strides})
    constexprs = {"GROUP": group, "D": head_dim, "BLOCK_M": s.BLOCK_M, "BLOCK_N": s.BLOCK_N,
                  "BLOCK_B": BLOCK_B, "PAGE_SIZE": page_size, "CAUSAL": causal,
                  "USE_TMA": s.use_tma}
    signature.update({n: "constexpr" for n in constexprs})
    # A launch specializes 16-byte aligned pointers and ints divisible by 16: every tensor
    # pointer and the strides of the [.., D] tensors; stride_lh (Tq) and stride_btb
    # (max_pages) are left unknown.
    aligned = ["Q", "K", "V", "O", "LSE", "CU_Q", "TILE_CU", "SEQLENS_K", "BT",
               *(n for n in strides if n not in ("stride_lh", "stride_btb"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": signature, "constexprs": constexprs,
            "options": {"num_warps": s.num_warps, "num_stages": s.num_stages},
            "attrs": attrs, "settings": s}


# --------------------------------------------------------------------------- entry point

def prefill_paged(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q,
                  causal, sm_scale, settings: PagedPrefillSettings | None = None):
    """Chunked prefill over a paged KV cache (inputs validated by ``wsattn.api``).

    Args:
        q: [Tq, Hq, D] packed queries, fp16 / bf16 / fp32, last dim contiguous; D in
           (64, 128, 256).
        k_cache, v_cache: [num_pages, page_size, Hkv, D], last dim contiguous; Hq a
           multiple of Hkv (query head h reads KV head h // (Hq // Hkv)).
        cu_seqlens_q: int32 [B + 1] contiguous offsets of each sequence's queries.
        seqlens_k: int32 [B] contiguous, keys per sequence (the chunk's own included).
        block_table: int32 [B, max_pages], last dim contiguous, page indices.
        max_seqlen_q: the longest chunk or an upper bound, or None (grid from Tq and B).
        causal: bottom-right aligned, query i of a chunk of Lq rows sees keys
           j <= seqlens_k[b] - Lq + i.
        sm_scale: softmax scale.
        settings: overrides ``default_settings`` for the device.

    Returns:
        (out [Tq, Hq, D] in q's dtype, lse fp32 natural-log [Hq, Tq]); a query that sees
        no key gets out 0 and lse -inf.

    Example (CPU, TRITON_INTERPRET=1):
        >>> q = torch.randn(5, 4, 64, dtype=torch.float16)
        >>> kc = vc = torch.randn(3, 16, 2, 64, dtype=torch.float16)
        >>> cu = torch.tensor([0, 5], dtype=torch.int32)
        >>> lens = torch.tensor([40], dtype=torch.int32)
        >>> bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
        >>> out, lse = prefill_paged(q, kc, vc, cu, lens, bt, None, True, 0.125)
        >>> out.shape, lse.shape
        (torch.Size([5, 4, 64]), torch.Size([4, 5]))
    """
    target = target_of(q.device)
    s = settings or default_settings(target, q.shape[-1], q.dtype)
    if s.use_tma:
        why = tma_unsupported(target, k_cache, v_cache, s)
        if why is not None:
            raise ValueError(f"settings: {why}")
    Tq, Hq = q.shape[0], q.shape[1]
    out = empty(q.shape, q.dtype, q.device)
    lse = empty((Hq, Tq), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    if target.backend == "interpreter":
        _launch(q, k_cache, v_cache, out, lse, cu_seqlens_q, seqlens_k, block_table,
                max_seqlen_q, causal, sm_scale, s, interpret=True)
    else:
        with torch.cuda.device(q.device):
            _launch(q, k_cache, v_cache, out, lse, cu_seqlens_q, seqlens_k, block_table,
                    max_seqlen_q, causal, sm_scale, s, interpret=False)
    return out, lse
