"""Split-KV decode ("flash decoding") over a contiguous or paged KV cache, in Triton.

One program handles one (sequence b, KV head h, split s): all T new tokens times all
GROUP = Hq / Hkv query heads of KV head h form one [T * GROUP, D] query tile (padded to
BLOCK_M >= 16 rows for tl.dot), so each K/V row is read from memory exactly once. The
program walks its contiguous share of the sequence BLOCK_N keys at a time with an
online softmax. With more than one split each program writes a partial (o, lse) in fp32
to a workspace and ``_combine_kernel`` merges the splits with merge.py's helper; with
one split the decode kernel writes the output itself and nothing else runs.

Paging is one constexpr switch: a K/V tile is BLOCK_N rows gathered row by row through
block_table (page of key j = block_table[b, j // PAGE_SIZE]), so any page size >= 1
works, including one that does not divide the sequence length or BLOCK_N.

Split boundaries are computed in the kernel from seqlens[b] (each split gets a
BLOCK_N-aligned share of the real length), and the number of splits is chosen on the
host from the cache capacity, never from seqlens: no host read of device data, so the
launch is CUDA-graph friendly.

PDL (programmatic dependent launch, sm_90+; the PDL constexpr, off by default): both
kernels wait (``gdc_wait``) before their first load, since everything they read is the
previous kernel's (q and this token's K/V from the fused QKV kernel, the workspace from
the decode kernel) or may be, and release their dependents right after the wait, so the
next kernel (the O-projection GEMV) can take free SM slots and start loading its weights
while the attention streams. See ``_decode_kernel`` for why this early release is safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..target import Target, UnsupportedTargetError, target_of
from ..testing import DTYPES, dtype_name
from ._alloc import empty
from ._intmath import cdiv, next_pow2
from ._precision import F32_DOT
from .merge import merge_finish, merge_parts

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, seqlens_ptr, bt_ptr, out_ptr, lse_ptr,
                   ws_o_ptr, ws_lse_ptr, qk_scale, HQ,
                   stride_qb, stride_qt, stride_qh,
                   stride_kb, stride_kl, stride_kh,
                   stride_vb, stride_vl, stride_vh,
                   stride_btb,
                   T: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BT_CHUNK: tl.constexpr = 0,
                   PDL: tl.constexpr = False):
    # stride_kb / stride_vb step a sequence (contiguous cache) or a page (paged cache).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    if PDL:
        # Every load below waits: q and this token's K/V are the fused QKV kernel's
        # output. seqlens and the block table are host copies made before the step, but
        # reading them after the wait too costs one dependent load's latency and keeps
        # the rule simple: nothing this grid reads is read before the wait.
        tl.extra.cuda.gdc_wait()
        # Release the next kernel now. Safe because every kernel of the step reads only
        # weights before its own gdc_wait and writes nothing there, and that wait returns
        # only once this whole grid has completed and its writes are visible: the next
        # kernel can neither see our output early nor overwrite an input we have yet to
        # read. (The signal counts once every program has sent it or exited, so a
        # multi-wave grid releases the next kernel in its last wave.)
        tl.extra.cuda.gdc_launch_dependents()

    r = tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows: token t = r // GROUP, head h*GROUP + r % GROUP
    t = r // GROUP
    head = h * GROUP + r % GROUP
    row_live = r < T * GROUP
    d = tl.arange(0, D)  # [D]
    q_rows = b.to(tl.int64) * stride_qb + t * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_live[:, None], other=0.0)  # [BLOCK_M, D]

    seqlen = tl.load(seqlens_ptr + b)
    # this split's BLOCK_N-aligned share [lo, hi) of the keys; empty (lo >= hi) when the
    # sequence is too short to give every split a tile
    tiles_per_split = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS)
    lo = s * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seqlen)
    last_key = seqlen - T + t  # [BLOCK_M] causal among the new tokens: t sees keys j <= last_key

    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running denominator
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if BT_CHUNK > 0:
        # The split's block-table entries, read once: the K/V addresses in the loop then
        # depend on registers only, not on a load of the same iteration (which keeps the
        # pipeliner from running the K/V loads far ahead; notes/decode_triton.md).
        first_page = lo // PAGE_SIZE
        pidx = first_page + tl.arange(0, BT_CHUNK)  # [BT_CHUNK]
        bt_row = tl.load(bt_ptr + b * stride_btb + pidx, mask=pidx * PAGE_SIZE < hi, other=0)
    for start in range(lo, hi, BLOCK_N):  # software-pipelined num_stages deep
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        kv_live = n < hi
        if PAGED and PAGE_SIZE % BLOCK_N == 0:
            # tiles start BLOCK_N-aligned, so a tile lies inside one page: one page index
            # and rows contiguous as in the contiguous cache (the compiler sees
            # base + arange * stride and keeps its wide, pipelined loads)
            page = tl.load(bt_ptr + b * stride_btb + start // PAGE_SIZE).to(tl.int64)
            in_page = (start % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N]
            k_rows = page * stride_kb + in_page * stride_kl  # [BLOCK_N]
            v_rows = page * stride_vb + in_page * stride_vl
        elif PAGED:  # a tile spans pages: gather its rows through the block table
            if BT_CHUNK > 0:  # from the entries read before the loop (clamped past hi)
                slot = tl.minimum(n // PAGE_SIZE - first_page, BT_CHUNK - 1)
                page = tl.gather(bt_row, slot, axis=0)  # [BLOCK_N]
            else:
                page = tl.load(bt_ptr + b * stride_btb + n // PAGE_SIZE, mask=kv_live, other=0)  # [BLOCK_N]
            in_page = (n % PAGE_SIZE).to(tl.int64)
            k_rows = page.to(tl.int64) * stride_kb + in_page * stride_kl  # [BLOCK_N]
            v_rows = page.to(tl.int64) * stride_vb + in_page * stride_vl
        else:
            k_rows = b.to(tl.int64) * stride_kb + n.to(tl.int64) * stride_kl  # [BLOCK_N]
            v_rows = b.to(tl.int64) * stride_vb + n.to(tl.int64) * stride_vl
        k = tl.load(k_head + k_rows[:, None] + d[None, :], mask=kv_live[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_head + v_rows[:, None] + d[None, :], mask=kv_live[:, None], other=0.0)  # [BLOCK_N, D]

        # [BLOCK_M, BLOCK_N], log2 units
        qk = tl.dot(q, tl.trans(k), input_precision=F32_DOT) * qk_scale
        sees = (n[None, :] <= last_key[:, None]) & kv_live[None, :]
        qk = tl.where(sees, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
        # a row that has seen no key yet (causal, or a padded row) keeps m = -inf:
        # shift by 0 there so no -inf - -inf NaN forms
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision=F32_DOT)  # [BLOCK_M, D]
        m_i = m_new

    # (acc, m, l) is a merge state whose max is in log2 units; in natural units it is m*ln2
    o, lse = merge_finish(acc, m_i * 0.6931471805599453, l_i)  # [BLOCK_M, D], [BLOCK_M]
    rows = (b * T + t).to(tl.int64) * HQ + head  # [BLOCK_M] row of [B, T, Hq]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + rows[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_live[:, None])
        tl.store(lse_ptr + rows, lse, mask=row_live)
    else:
        ws_rows = rows * NUM_SPLITS + s  # [BLOCK_M] row of the [B*T*Hq, NUM_SPLITS] workspace
        tl.store(ws_o_ptr + ws_rows[:, None] * D + d[None, :], o, mask=row_live[:, None])
        tl.store(ws_lse_ptr + ws_rows, lse, mask=row_live)


@triton.jit
def _combine_kernel(ws_o_ptr, ws_lse_ptr, out_ptr, lse_ptr,
                    D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    # one program: one row of [B*T*Hq] (its NUM_SPLITS partials are contiguous), BLOCK_D
    # columns. Small programs, many of them (with B = 1 there are only Hq rows to merge).
    # The splits come BLOCK_S at a time as one [BLOCK_S, BLOCK_D] tile, so a block's loads
    # are all in flight at once, and merge by reductions over the tile (merge_parts)
    # rather than a chain of one-split steps; the build is the same size at any count.
    if PDL:
        tl.extra.cuda.gdc_wait()  # the workspace is the decode kernel's output
        tl.extra.cuda.gdc_launch_dependents()  # same rule as in _decode_kernel
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    zero = tl.arange(0, 1)  # [1] the helpers' row axis
    sb = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    ws_row = row.to(tl.int64) * NUM_SPLITS
    acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    # blocks in the fixed order s = 0, BLOCK_S, ...: deterministic
    for s0 in tl.range(0, NUM_SPLITS, BLOCK_S):
        live = s0 + sb < NUM_SPLITS
        parts = ws_row + s0 + sb  # [BLOCK_S] workspace rows of this block's splits
        lse_b = tl.load(ws_lse_ptr + parts, mask=live, other=float("-inf"))
        o_b = tl.load(ws_o_ptr + parts[:, None] * D + cols[None, :], mask=live[:, None],
                      other=0.0)  # [BLOCK_S, BLOCK_D]
        acc, m, den = merge_parts(acc, m, den, o_b, lse_b)
    out, lse = merge_finish(acc, m, den)
    tl.store(out_ptr + row.to(tl.int64) * D + cols[None, :], out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row + zero, lse, mask=tl.program_id(1) == 0)


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class DecodeSettings:
    """Launch settings of the decode kernel (see default_settings for how they are chosen).

    BLOCK_N: keys per tile; num_warps / num_stages: as in triton; num_splits: splits of
    each sequence (>= 1; 1 means no workspace and no combine launch). bt_preload: a paged
    cache whose pages are shorter than a tile reads each split's block-table entries once
    before the loop (at most BT_PRELOAD_MAX of them) instead of per tile; default_settings
    turns it on where it applies on sm_90 (measured there: notes/decode_triton.md).
    """
    BLOCK_N: int
    num_warps: int
    num_stages: int
    num_splits: int
    bt_preload: bool = False


# Auto splitting fills one wave of resident programs once B * Hkv alone cannot fill the
# GPU, and gives each split at least MIN_SPLIT_TILES tiles so that the pipeline's
# prologue and the combine stay small next to the streaming.
MIN_SPLIT_TILES = 8
MAX_SPLITS = 128
STAGE_BYTES = 32 * 1024  # K + V bytes per pipeline stage
# Programs resident on one SM with the default settings (shared memory: ~105 KB a program
# on sm_90/sm_100 of 228 KB, ~70 KB on sm_80 of 164 KB). The splits stop at one wave of
# them: a second wave only starts as programs of the first end, and paged programs keep
# few bytes in flight (their loads wait on the block table). H200: B=8 L=65536 page 16
# ran 0.80x contiguous with 9 splits (576 programs = 264 + 264 + 48) and 0.97x with 4
# (one wave), 0.95x with 16; Llama-3.1-8B heads B=8 L=4096 pages of 64, 38 us with 4
# splits (256 programs) against 42 with 8 (264 + 248) (notes/decode_triton.md).
RESIDENT_PER_SM = 2
FEW_PROGRAMS = 4  # see auto_splits: B * Hkv at most a quarter of the SMs
WIDE_BATCH_BLOCK_N = 64  # keys a tile on sm_90 once B * Hkv fills two waves (default_settings)


def auto_splits(batch: int, kv_heads: int, capacity: int, block_n: int, num_sms: int) -> int:
    """Splits per sequence from the shape and the SM count only (never from seqlens).

    capacity is what a sequence can hold (L_max, or max_pages * page_size): the split
    count must be fixed before the launch without reading seqlens on the host. Inside
    the kernel each split takes an equal share of the real length.
    """
    programs = max(1, batch * kv_heads)  # an empty batch launches nothing; any count will do
    if programs >= 2 * num_sms:
        return 1  # two waves of whole sequences: splitting would only add the combine
    tiles = cdiv(capacity, block_n)
    used = lambda n: cdiv(tiles, cdiv(tiles, n))  # noqa: E731
    # Few programs (B * Hkv <= num_sms / FEW_PROGRAMS): the launch is latency-bound, not
    # bandwidth-bound, so one program per SM however few tiles each gets beats long
    # splits. H200, Hkv 8 paged 16: B=1 L=4096 D64 16.0 -> 9.2 us with 16 splits of 2
    # tiles instead of 4 of 8; L=1024 13.8 -> 6.2 us with 8 splits of one tile instead of
    # 1 (notes/decode_triton.md). Long contexts keep the one-wave rule below where it asks
    # for more splits (B=1 L=32768 D64: 32 splits 25.7 us, 16 splits 29).
    # Tiles per split rounded down, so a capacity just past a multiple (4096 keys + a
    # few new tokens) gives 17 splits of 2 tiles, not 11 of 3. Never more splits than one
    # program an SM, though: with 4 KV heads at B=1 and ~4k keys the rounding gave one
    # tile a split (65 splits), and the combine over that many partials cost more than
    # the shorter splits saved (H200, Hq 32 Hkv 4 D128 L4096, us contiguous / paged 16:
    # 64 splits 10.8 / 11.3, 33 splits 9.1 / 10.0; notes/decode_triton.md).
    floor = 1
    if programs * FEW_PROGRAMS <= num_sms:
        floor = min(cdiv(tiles, max(1, tiles // (num_sms // programs))),
                    cdiv(num_sms, programs), MAX_SPLITS)
    most = max(1, capacity // (MIN_SPLIT_TILES * block_n))
    splits = max(1, min(RESIDENT_PER_SM * num_sms // programs, most, MAX_SPLITS))
    # the kernel gives each split cdiv(tiles, splits) tiles; `used` drops the splits a
    # full-length sequence would leave empty (4160 keys in 64-key tiles, 16 wanted: 5
    # tiles each fill only 13)
    return max(used(splits), floor)


# Pure in its arguments and asked on every decode step: cached (it was ~15 us of host time).
@functools.lru_cache(maxsize=4096)
def default_settings(target: Target, *, batch: int, kv_heads: int, head_dim: int,
                     capacity: int, dtype: torch.dtype, paged: bool = False,
                     query_rows: int = 4, num_splits: int = 0,
                     page_size: int = 0) -> DecodeSettings:
    """Settings from (target, shape, dtype); query_rows = T * Hq / Hkv, the rows of a
    program's query tile; num_splits 0 = auto (see auto_splits); page_size of a paged
    cache (0: unknown), which decides bt_preload on sm_90."""
    if target.backend == "interpreter":
        # small tiles, so that short test sequences still cross several tiles and splits
        block_n, warps, stages = 16, 4, 1
    else:
        elem = torch.empty((), dtype=dtype).element_size()
        # One stage of K + V tiles is STAGE_BYTES. Contiguous, Triton 3.6 keeps
        # num_stages - 1 K/V buffers (3 at 4 stages). Paged, the K/V loads wait on the
        # block-table load, and the pipeliner keeps fewer buffers for the same count: 1 at
        # 4 stages, 2 at 5-6, 3 at 7-8 (sm_90 TTGIR). On H200 paged decode at 5 stages ran
        # 0.76-0.92x the contiguous cache, at 7 stages 0.94-1.0x
        # (notes/decode_triton.md): 7 it is, 105 KB, still two
        # programs per SM on sm_90/sm_100 (228 KB); sm_80 (164 KB) gets 2 buffers (5
        # stages paged), consumer parts (~100 KB) 2 stages.
        block_n = max(16, min(128, STAGE_BYTES // (2 * head_dim * elem)))
        if target.cc == 90 and batch * kv_heads >= 2 * target.num_sms:
            # Two waves of whole sequences (no split): half-width tiles halve each
            # program's ring, so more programs stay resident. H200, D64 B=64 Hkv=8 L=1024,
            # two runs: 64-key tiles 4-5 % faster contiguous, 10-12 % paged 16; at B=1-8,
            # where the sequences are split, 128 stayed ahead or even
            # (notes/decode_triton.md).
            block_n = min(block_n, WIDE_BATCH_BLOCK_N)
        # 8 warps once the [BLOCK_M, D] fp32 accumulator passes 64 registers a thread
        warps = 8 if _block_m(query_rows, 1) * head_dim > 64 * 128 else 4
        if target.cc >= 120:
            stages = 2
        else:
            stages = (7 if paged else 4) if target.cc >= 90 else (5 if paged else 3)
    splits = num_splits or auto_splits(batch, kv_heads, capacity, block_n, target.num_sms)
    s = DecodeSettings(BLOCK_N=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
    if paged and target.cc == 90 and page_size:
        # Pages shorter than a tile, few enough per split to preload the block table: the
        # K/V loads no longer wait on a table load, and at 4 stages the pipeliner keeps 3
        # K/V buffers as for the contiguous cache. H200, B=1 L=131072 page 16 (64 splits,
        # 256 entries): 0.944 -> 0.971x the contiguous cache (notes/decode_triton.md). Where
        # the table does not fit BT_PRELOAD_MAX (B=8/64 here) 7 stages stay: 4 stages
        # without the preload ran 0.71x.
        pre = replace(s, bt_preload=True, num_stages=4)
        if bt_chunk(pre, capacity, page_size):
            s = pre
    return s


BT_PRELOAD_MAX = 256  # block-table entries a program keeps in registers (1-2 per thread)


def bt_chunk(settings: DecodeSettings, capacity: int, page_size: int) -> int:
    """The BT_CHUNK constexpr: how many block-table entries (a power of two) cover one
    split's keys, or 0 where the preload is off, does not apply (pages of whole tiles
    read one entry per tile already) or would not fit BT_PRELOAD_MAX."""
    if not settings.bt_preload or page_size % settings.BLOCK_N == 0:
        return 0
    tiles = cdiv(cdiv(capacity, settings.BLOCK_N), settings.num_splits)
    # a split starts BLOCK_N-aligned, so its keys can straddle one more page
    pages = cdiv(tiles * settings.BLOCK_N, page_size) + 1
    chunk = next_pow2(pages)
    return chunk if chunk <= BT_PRELOAD_MAX else 0


def _block_m(T: int, group: int) -> int:
    return max(16, next_pow2(T * group))


COMBINE_BLOCK_D = 32  # one warp a program
COMBINE_BLOCK_S = 64  # splits a combine tile takes ([64, 32] fp32: 64 registers a thread)


def combine_block_s(splits: int) -> int:
    """Splits the combine merges a tile at a time: all of them up to COMBINE_BLOCK_S."""
    return min(next_pow2(max(1, splits)), COMBINE_BLOCK_S)


# --------------------------------------------------------------------------- launcher


def decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits, settings=None,
           *, pdl=False):
    """Decode attention of T new tokens per sequence against a KV cache (validated by api.py).

    Args:
        q: [B, T, Hq, D] fp16 / bf16 / fp32, last dimension contiguous.
        k_cache, v_cache: contiguous [B, L_max, Hkv, D], or paged
            [num_pages, page_size, Hkv, D] with block_table; last dimension contiguous.
        seqlens: int32 [B], keys per sequence including the T new ones; token t sees
            keys j <= seqlens[b] - T + t.
        block_table: int32 [B, max_pages] page indices, or None for a contiguous cache.
        sm_scale: softmax scale.
        num_splits: splits per sequence, 0 = auto (from B, Hkv, the cache capacity and
            the SM count; seqlens are never read on the host).
        settings: a DecodeSettings to override default_settings (its num_splits wins).
        pdl: programmatic dependent launch (CUDA sm_90+ only; False by default): both
            launches go out with PDL and wait for the previous kernel inside, and release
            the next kernel early. Every kernel launched after this one with PDL must read
            only weights before its own griddepcontrol.wait (the engine's kernels do).

    Returns:
        (out [B, T, Hq, D] in q's dtype, lse [B, T, Hq] float32, natural log; a row that
        sees no key gets out 0 and lse -inf).

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
        >>> kc = vc = torch.randn(2, 100, 2, 64, dtype=torch.float16)
        >>> out, lse = decode(q, kc, vc, torch.tensor([100, 37], dtype=torch.int32), None, 0.125, 0)
    """
    if pdl not in (True, False):
        raise ValueError(f"pdl must be True or False, got {pdl!r}")
    if pdl:
        target = target_of(q.device)
        if target.backend != "cuda" or target.cc < 90:
            # griddepcontrol is sm_90+ PTX, and the interpreter has no inline assembly
            raise UnsupportedTargetError(f"pdl=True needs CUDA sm_90 or later, got "
                                         f"{target.name}")
    B, T, HQ, D = q.shape
    HKV = k_cache.shape[2]
    group = HQ // HKV
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    if settings is None:
        settings = default_settings(target_of(q.device), batch=B, kv_heads=HKV, head_dim=D,
                                    capacity=capacity, dtype=q.dtype, paged=paged,
                                    query_rows=T * group, num_splits=num_splits,
                                    page_size=page_size if paged else 0)
    elif num_splits:
        settings = replace(settings, num_splits=num_splits)
    # a split past the cache's last key tile would be empty: the same result (an empty part
    # leaves the merge bit-identical), fewer programs and fewer kernel builds
    tiles = max(1, cdiv(capacity, settings.BLOCK_N))
    if settings.num_splits > tiles:
        settings = replace(settings, num_splits=tiles)
    splits = settings.num_splits

    out = empty((B, T, HQ, D), q.dtype, q.device)
    lse = empty((B, T, HQ), torch.float32, q.device)
    if B == 0:
        return out, lse
    if splits > 1:
        ws_o = torch.empty((B * T * HQ, splits, D), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((B * T * HQ, splits), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel (the NUM_SPLITS == 1 branch compiles away)
        ws_o, ws_lse = out, lse
    bt = block_table if paged else seqlens  # any int32 pointer when not paged
    # PDL off passes nothing: the default launch (and build) stays as it was
    launch = {"PDL": True, "launch_pdl": True} if pdl else {}
    _decode_kernel[(B, HKV, splits)](
        q, k_cache, v_cache, seqlens, bt, out, lse, ws_o, ws_lse,
        sm_scale * LOG2E, HQ,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        T=T, GROUP=group, D=D, BLOCK_M=_block_m(T, group), BLOCK_N=settings.BLOCK_N,
        NUM_SPLITS=splits, PAGED=paged, PAGE_SIZE=page_size,
        BT_CHUNK=bt_chunk(settings, capacity, page_size) if paged else 0,
        num_warps=settings.num_warps, num_stages=settings.num_stages, **launch)
    if splits > 1:
        block_d = min(COMBINE_BLOCK_D, D)
        _combine_kernel[(B * T * HQ, D // block_d)](
            ws_o, ws_lse, out, lse, D=D, NUM_SPLITS=splits, BLOCK_D=block_d,
            BLOCK_S=combine_block_s(splits), num_warps=1, **launch)
    return out, lse


# --------------------------------------------------------------------------- compile specs



def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16", paged: bool = False,
                 settings: DecodeSettings | None = None, *, T: int = 1, group: int = 4,
                 page_size: int = 16, num_sms: int = 132, kernel: str = "decode",
                 pdl: bool = False) -> dict:
    """What ``triton.compile`` needs to build a decode kernel for compute capability cc.

    kernel="decode" gives the main split-KV kernel, kernel="combine" the split combine.
    pdl=True builds the PDL variant (constexpr PDL, option launch_pdl); pdl=False leaves
    both out, exactly the default build.
    Settings default to default_settings for a single-token B=1, Hkv=8, L=131072 call
    on a GPU with num_sms SMs (so NUM_SPLITS > 1 and the workspace path is compiled).

    Returns a dict:
        "fn":         the @triton.jit kernel,
        "signature":  {argument name: Triton type}, every argument in order; pointers
                      "*bf16" / "*fp32" / "*i32", integers "i32", the scale "fp32",
                      constexpr arguments "constexpr",
        "constexprs": {argument name: value} for the constexpr arguments,
        "attrs":      {(argument index,): [["tt.divisibility", 16]]} for the pointers and
                      the [.., D] strides, as a real launch specializes them (without it
                      the compiler cannot prove alignment and emits 2-byte loads),
        "options":    {"num_warps": ..., "num_stages": ...}.
    Use: ``triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
    attrs=s["attrs"]), target=GPUTarget("cuda", cc, 32), options=s["options"])``.
    """
    t = dtype_name(dtype)  # Triton's type string is the same name
    if settings is None:
        target = Target("cuda", cc, num_sms)
        settings = default_settings(target, batch=1, kv_heads=8, head_dim=head_dim,
                                    capacity=131072, dtype=DTYPES[dtype], paged=paged,
                                    query_rows=T * group, page_size=page_size if paged else 0)
    if kernel == "combine":
        sig = {"ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "out_ptr": f"*{t}", "lse_ptr": "*fp32",
               "D": "constexpr", "NUM_SPLITS": "constexpr", "BLOCK_D": "constexpr",
               "BLOCK_S": "constexpr"}
        const = {"D": head_dim, "NUM_SPLITS": settings.num_splits,
                 "BLOCK_D": min(COMBINE_BLOCK_D, head_dim),
                 "BLOCK_S": combine_block_s(settings.num_splits)}
        options = {"num_warps": 1}
        if pdl:
            sig["PDL"] = "constexpr"
            const["PDL"] = True
            options["launch_pdl"] = True
        return {"fn": _combine_kernel, "signature": sig, "constexprs": const,
                "attrs": _aligned(_combine_kernel, _COMBINE_ALIGNED), "options": options}
    if kernel != "decode":
        raise ValueError(f"kernel must be 'decode' or 'combine', got {kernel!r}")
    sig = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "seqlens_ptr": "*i32",
           "bt_ptr": "*i32", "out_ptr": f"*{t}", "lse_ptr": "*fp32", "ws_o_ptr": "*fp32",
           "ws_lse_ptr": "*fp32", "qk_scale": "fp32", "HQ": "i32"}
    for name in ("stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kl", "stride_kh",
                 "stride_vb", "stride_vl", "stride_vh", "stride_btb"):
        sig[name] = "i32"
    const = {"T": T, "GROUP": group, "D": head_dim, "BLOCK_M": _block_m(T, group),
             "BLOCK_N": settings.BLOCK_N, "NUM_SPLITS": settings.num_splits, "PAGED": paged,
             "PAGE_SIZE": page_size if paged else 1,
             "BT_CHUNK": bt_chunk(settings, 131072, page_size) if paged else 0}
    options = {"num_warps": settings.num_warps, "num_stages": settings.num_stages}
    if pdl:
        const["PDL"] = True
        options["launch_pdl"] = True
    sig.update({name: "constexpr" for name in const})
    return {"fn": _decode_kernel, "signature": sig, "constexprs": const,
            "attrs": _aligned(_decode_kernel, _DECODE_ALIGNED), "options": options}


# What a real launch sees as 16-divisible (Triton specializes such arguments): every
# tensor pointer (torch allocations are 256-byte aligned) and the strides of the
# [.., D] tensors. stride_btb (max_pages) and the sizes are left unknown.
_DECODE_ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "seqlens_ptr", "bt_ptr", "out_ptr", "lse_ptr",
                   "ws_o_ptr", "ws_lse_ptr", "stride_qb", "stride_qt", "stride_qh", "stride_kb",
                   "stride_kl", "stride_kh", "stride_vb", "stride_vl", "stride_vh")
_COMBINE_ALIGNED = ("ws_o_ptr", "ws_lse_ptr", "out_ptr", "lse_ptr")


def _aligned(fn, names):
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}
