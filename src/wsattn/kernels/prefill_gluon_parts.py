"""Gluon partitions of the sm_90 warp-specialized prefill (see prefill_gluon.py).

One CTA owns BLOCK_M = CONSUMERS * 64 query rows of one (batch, head), CONSUMERS = 1 to 3.
Partitions:
  - CONSUMERS consumer warpgroups of 4 warps: warpgroup 0 is the default partition, the
    others are workers; each owns its own 64 rows of Q: QK^T and PV as async wgmma with
    the accumulators in registers, online softmax in between;
  - a 1-warp producer worker that TMA-loads Q once and K/V tiles into a STAGES-deep
    shared-memory ring (k_ready / v_ready / kv_empty mbarriers) and gives up registers.
All consumers walk the same K/V tiles, so each ring slot is freed (kv_empty, count
CONSUMERS) once every consumer has finished its PV on it. Three consumers (192 rows, as
FlashAttention-3 does for head dim 64) give the tensor cores a third warpgroup's GEMMs to
run while the other two do softmax; registers allow it at D = 64 only.

VARLEN (constexpr) packs sequences along the token axis: the descriptors are [1, T, H * D]
and a tile's coordinates start at its sequence's offset (cu_seqlens, read in the kernel).
TMA zero fill then only happens at the end of the whole pack, so a box that runs past its
sequence reads the next one's rows: those keys are masked like keys past Sk (the tile that
straddles the end always takes the masked path), and the O rows of a box that straddles
the end leave by a masked register store, never by a TMA store into the next sequence.
VARLEN == COMPACT takes each CTA's (sequence, head, row block) from a table the launcher
builds on the device (prefill_gluon.varlen_tile_table): the grid then holds the real
tiles and at most one spare a sequence and head, instead of every sequence padded to the
longest, whose surplus CTAs each took an SM's whole shared memory to do nothing.

PERSISTENT (constexpr, fixed length only) launches at most one CTA per SM; each walks
the tiles pid, pid + grid, ... of one order (_persistent_walk, _persistent_tile: the
longest causal row blocks first, the heads of a GQA group side by side, in sections
whose K/V fit L2). The producer and the consumers call the same two helpers, and count
the ring index, the Q barriers' phase and the ping-pong turns over all the CTA's tiles.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .varlen_tiles import CODE_BASE

ROWS_PER_WG = 64  # query rows per consumer warpgroup (a warpgroup's wgmma has M = 64)
WG_M = gl.constexpr(ROWS_PER_WG)
VARLEN_COMPACT = 2  # the VARLEN constexpr's value for the tile-table grid (1: the plain one)
COMPACT = gl.constexpr(VARLEN_COMPACT)
TILE_CODE = gl.constexpr(CODE_BASE)  # the table's head * TILE_CODE + row block


@gluon.jit
def _key_tiles(row0, row_end, Sq, Sk, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_full, n_total) for query rows [row0, row_end): key tiles [0, n_full) need no mask,
    [n_full, n_total) do.

    Causal is bottom-right aligned: row i sees keys j <= i + Sk - Sq, so the rows need keys
    < row_end + Sk - Sq, all unmasked up to row0 + Sk - Sq.
    """
    if CAUSAL:
        shift = Sk - Sq
        n_total = gl.cdiv(gl.minimum(Sk, row_end + shift), BLOCK_N)
        n_full = gl.minimum(Sk // BLOCK_N, (row0 + shift + 1) // BLOCK_N)
    else:
        n_total = gl.cdiv(Sk, BLOCK_N)
        n_full = Sk // BLOCK_N
    return n_full, n_total


@gluon.jit
def _tile_counts(start_m, Sq, Sk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """(n_full, n_total) for a CTA's rows: the tiles its producer loads."""
    m0 = start_m * BLOCK_M
    return _key_tiles(m0, m0 + BLOCK_M, Sq, Sk, BLOCK_N, CAUSAL)


@gluon.jit
def _wg_tile_counts(m_row0, Sq, Sk, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_full, n_total) for one warpgroup's rows [m_row0, m_row0 + 64): the tiles it needs,
    which can be fewer than its CTA's (_tile_counts). Causal: the CTA's last tiles lie past
    the diagonal of its first warpgroups' rows; any mask: a warpgroup whose rows all lie at
    or past Sq (the last, partial row block) needs none. (0, 0) then."""
    end = gl.minimum(m_row0 + WG_M, Sq)  # one past this warpgroup's last real row
    n_full, n_total = _key_tiles(m_row0, end, Sq, Sk, BLOCK_N, CAUSAL)
    if m_row0 >= Sq:
        n_total = 0
        n_full = 0
    return n_full, n_total


@gluon.jit
def _row_block(rank, n_m, CAUSAL: gl.constexpr):
    """The rank-th row block a schedule takes: causal from the last (most keys) down."""
    if CAUSAL:
        start_m = n_m - 1 - rank
    else:
        start_m = rank
    return start_m


@gluon.jit
def _tile_coords(t, n_m, Hq, CAUSAL: gl.constexpr):
    """Tile t -> (start_m, b, h). Row blocks vary fastest, so CTAs running at the same time
    share a head's K/V in L2; causal walks them from the last (most keys) to the first."""
    bh = t // n_m
    return _row_block(t % n_m, n_m, CAUSAL), bh // Hq, bh % Hq


@gluon.jit
def _tile(pid, n_m, Sq, Sk, Hq, cu_q, cu_k, tiles, CAUSAL: gl.constexpr,
          VARLEN: gl.constexpr, PAGE: gl.constexpr = 0):
    """The one schedule every partition reads: program pid -> (start_m, off_b, off_h, q0,
    k0, q_len, kv_len). off_b is the descriptors' leading coordinate, q0 / k0 the row of
    the sequence's first query / key in them, q_len / kv_len its lengths. Fixed length:
    (b, 0, 0, Sq, Sk). VARLEN: one [1, T, H * D] pack, so off_b = 0 and the rows come from
    cu_q / cu_k; the grid covers the longest sequence (see attn_fwd_kernel). VARLEN ==
    COMPACT: the tile comes from the launcher's table (tiles: int32 [2, grid], the
    sequence, or -1 past the last real tile, then head * CODE_BASE + row block), so the grid
    holds the real tiles and at most one spare a sequence and head (q_len 0 on a spare).
    PAGE (the paged build): cu_k holds each sequence's key count, not the running sum (its
    keys are found through the block table, so k0 is 0 and no prefix sum is launched)."""
    if VARLEN == COMPACT:
        b = gl.load(tiles + pid)
        code = gl.load(tiles + gl.num_programs(0) + pid)
        live = b >= 0
        b = gl.maximum(b, 0)
        start_m = code % TILE_CODE
        off_h = code // TILE_CODE
        q0 = gl.load(cu_q + b)
        q_len = gl.where(live, gl.load(cu_q + b + 1) - q0, 0)
        k0, kv_len = _keys(cu_k, b, PAGE)
        return start_m, 0, off_h, q0, k0, q_len, kv_len
    start_m, b, off_h = _tile_coords(pid, n_m, Hq, CAUSAL)
    if VARLEN:
        q0 = gl.load(cu_q + b)
        q_len = gl.load(cu_q + b + 1) - q0
        k0, kv_len = _keys(cu_k, b, PAGE)
        off_b = 0
    else:
        q0 = 0
        k0 = 0
        q_len = Sq
        kv_len = Sk
        off_b = b
    return start_m, off_b, off_h, q0, k0, q_len, kv_len


@gluon.jit
def _keys(cu_k, b, PAGE: gl.constexpr):
    """(k0, kv_len) of sequence b: from the running key counts cu_k, or (PAGE) from its
    key count cu_k[b] with k0 = 0."""
    if PAGE:
        k0 = 0
        kv_len = gl.load(cu_k + b)
    else:
        k0 = gl.load(cu_k + b)
        kv_len = gl.load(cu_k + b + 1) - k0
    return k0, kv_len


@gluon.jit
def _tile_seq(pid, n_m, Hq, tiles, CAUSAL: gl.constexpr, VARLEN: gl.constexpr):
    """The sequence of program pid's tile in a varlen build (the paged build reads its
    block-table row by it); _tile's rows come from the same entry."""
    if VARLEN == COMPACT:
        b = gl.maximum(gl.load(tiles + pid), 0)
    else:
        start_m, b, off_h = _tile_coords(pid, n_m, Hq, CAUSAL)
    return b


@gluon.jit
def _persistent_walk(num_tiles):
    """(first, stride, count): a persistent CTA takes the count tiles first, first + stride,
    ... below num_tiles of _persistent_tile's order. The producer and every consumer walk
    this one sequence, so they agree on each tile and its K/V count, and on every barrier
    phase they count."""
    first = gl.program_id(0)
    stride = gl.num_programs(0)
    return first, stride, (num_tiles - first + stride - 1) // stride


@gluon.jit
def _persistent_tile(t, n_m, n_bh, section, Sq, Sk, Hq, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The persistent schedule: tile t -> (start_m, b, h, n_full, n_total), the key-tile
    counts as _tile_counts gives them.

    The n_bh = B * Hq (batch, head) pairs, bh = b * Hq + h, are cut into sections of
    `section` pairs (the launcher sizes one section's K/V to stay in L2, a multiple of
    GROUP so that a GQA group never straddles two; the last section may be shorter).
    Within a section the row block varies slowest, causal from the last row block (the
    most key tiles) down, so the longest tiles start first, and the head fastest, so
    consecutive tiles, which run at the same time on neighbouring CTAs, share a KV head.
    Plain integer arithmetic (tests/test_prefill_gluon.py runs this body in Python)."""
    per_section = section * n_m
    sec = t // per_section
    first_bh = sec * section
    size = gl.minimum(section, n_bh - first_bh)  # (batch, head) pairs in this section
    i = t - sec * per_section
    m_rank = i // size
    bh = first_bh + i - m_rank * size
    start_m = _row_block(m_rank, n_m, CAUSAL)
    n_full, n_total = _tile_counts(start_m, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)
    return start_m, bh // Hq, bh % Hq, n_full, n_total


@gluon.jit
def _store_rows(o_ptr, out, row0, n_rows, row_stride, col0, layout: gl.constexpr,
                D: gl.constexpr):
    """out [WG_M, D] (registers, layout) to rows [row0, row0 + n_rows) of o, columns
    [col0, col0 + D): a row-masked store for a box that runs past its sequence's end, whose
    last rows belong to the next sequence (a TMA store would overwrite them)."""
    r = gl.arange(0, WG_M, layout=gl.SliceLayout(1, layout))  # [WG_M]
    c = gl.arange(0, D, layout=gl.SliceLayout(0, layout))  # [D]
    base = o_ptr + (row0.to(gl.int64) * row_stride + col0)  # the box's first element
    offs = gl.expand_dims(r * row_stride, 1) + gl.expand_dims(c, 0)  # [WG_M, D]
    keep = gl.expand_dims(r < n_rows, 1) & gl.expand_dims(c < D, 0)  # [WG_M, D]
    gl.store(base + offs, out, mask=keep)


@gluon.jit
def _release_tiles(j_lo, j_hi, r0, pp0, v_ready, kv_empty, turn_mine, turn_other,
                   STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """The barrier duties of a warpgroup for tiles [j_lo, j_hi) it does not compute (see
    _wg_tile_counts): release each ring slot once its data has landed (so an arrival is
    never counted towards an earlier round of the slot), and with PINGPONG pass on the
    turns its steps would have taken (step j's turn before tile j + 1, as in _step), so
    the other warpgroups' round-robin and the producer go on as if it had computed them.
    r0 is key tile 0's index in the ring and pp0 the turns taken before this query tile,
    both counted over every query tile this CTA has taken (0 for the first)."""
    if j_lo == 0 and j_hi > 0:  # tile 0 belongs to the prologue, which takes no turn
        mbarrier.wait(v_ready.index(r0 % STAGES), (r0 // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(r0 % STAGES))
    for j in range(gl.maximum(j_lo, 1), j_hi):
        if PINGPONG:  # the turn of step j - 1
            mbarrier.wait(turn_mine, (pp0 + j - 1) & 1)
            mbarrier.arrive(turn_other)
        r = r0 + j
        mbarrier.wait(v_ready.index(r % STAGES), (r // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(r % STAGES))


@gluon.jit
def _mask_tile(s, j, rows, Sq, Sk, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """S tile j with the keys past Sk (and, CAUSAL, after each row's diagonal, bottom-right
    aligned) set to -inf."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = gl.expand_dims(cols < Sk, 0)
    if CAUSAL:
        keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + (Sk - Sq), 1))
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def _softmax_tile(s, j, rows, m_i, l_i, Sq, Sk, qk_scale, s_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, j_mask,
                  MASK_RT: gl.constexpr):
    """Online-softmax step on one S tile [WG_M, BLOCK_N] (fp32, raw q.k).

    m_i is kept in the log2 domain (scaled by qk_scale = sm_scale * log2 e). Returns the
    unnormalized probabilities p, the factor alpha that rescales everything accumulated
    before this tile, and the new (m_i, l_i). MASK is constexpr so the compare/select
    compiles away on the tiles that need none. MASK_RT (with MASK off): the mask is
    applied at run time from tile j_mask on, so one loop body serves both kinds of tile.
    """
    if MASK:
        s = _mask_tile(s, j, rows, Sq, Sk, s_layout, BLOCK_N, CAUSAL)
    elif MASK_RT:
        if j >= j_mask:
            s = _mask_tile(s, j, rows, Sq, Sk, s_layout, BLOCK_N, CAUSAL)
    m_tile = gl.max(s, axis=1)
    m_new = gl.maximum(m_i, m_tile * qk_scale)  # [WG_M]
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))  # [WG_M, BLOCK_N]
    alpha = gl.exp2(m_i - m_new)  # [WG_M]
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _pack_p(p, dtype: gl.constexpr, p_layout: gl.constexpr, PACK_P: gl.constexpr):
    """P (fp32, the QK^T accumulator's layout) to the PV wgmma's register A operand.

    PACK_P: one cvt.rn.{bf16,f16}x2 a register pair. The accumulator keeps two adjacent
    columns of a row in one thread, which is the A fragment's pairing, so each pair packs
    in place. `p.to(dtype)` (PACK_P=False) emits one cvt a value; ptxas packs those pairs
    with F2FP but half of them with their halves swapped, then fixes each with a PRMT
    (16-32 a step in SASS). Same rounding (rn), so the same bits."""
    if not PACK_P:
        return gl.convert_layout(p.to(dtype), p_layout)
    if dtype == gl.bfloat16:
        h = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p],
                                      dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        h = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p],
                                      dtype=gl.float16, is_pure=True, pack=2)
    return gl.convert_layout(h, p_layout)


@gluon.jit
def _step(j, r, pp, q, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_mine, turn_other, p_op, m_i,
          l_i, acc, rows, Sq, Sk, qk_scale, s_layout: gl.constexpr, p_layout: gl.constexpr,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
          CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, PACK_P: gl.constexpr, j_mask,
          MASK_RT: gl.constexpr):
    """One iteration: PV of tile j (its P already in registers) and QK^T of tile j + 1 are
    issued back to back, then the softmax of tile j + 1 runs while PV(j) is still on the
    tensor cores. With PINGPONG the consumer warpgroups take turns (round-robin, turn j
    in step j) issuing their GEMMs, so one's softmax runs under the others' GEMMs. r is key
    tile j's index in the ring and pp the turn of this step, both counted over every query
    tile the CTA has taken (j itself for its first).

    ptxas still places the wait for PV(j) ahead of the exponentials (it has no operand that
    ties it to them); moving it after them measured slower (notes/prefill_gluon.md)."""
    s_cur = r % STAGES
    nxt = j + 1
    r_nxt = r + 1
    s_nxt = r_nxt % STAGES
    if PINGPONG:
        mbarrier.wait(turn_mine, pp & 1)
    mbarrier.wait(k_ready.index(s_nxt), (r_nxt // STAGES) & 1)
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index(s_nxt).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
    mbarrier.wait(v_ready.index(s_cur), (r // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(s_cur), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_other)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))  # QK^T(j+1) done; PV(j) may still run
    p, alpha, m_i, l_i = _softmax_tile(s, nxt, rows, m_i, l_i, Sq, Sk, qk_scale, s_layout,
                                       BLOCK_N, MASK, CAUSAL, j_mask, MASK_RT)
    # P(j + 1) is packed before waiting for PV(j), which still reads P(j) from registers.
    p_nxt = _pack_p(p, q.dtype, p_layout, PACK_P)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(s_cur))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return p_nxt, m_i, l_i, acc


@gluon.jit
def _consume_tiles(j_lo, j_hi, r0, pp0, q, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_mine,
                   turn_other, p_op, m_i, l_i, acc, rows, Sq, Sk, qk_scale,
                   s_layout: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                   PINGPONG: gl.constexpr, UNROLL: gl.constexpr, PACK_P: gl.constexpr,
                   j_mask, MASK_RT: gl.constexpr):
    """Iterations j in [j_lo, j_hi), unrolled by two (UNROLL) so that P(j) and P(j + 1) can
    live in two register sets: with one loop-carried set, ptxas packs P(j + 1) into the
    registers the in-flight PV(j) still reads and so waits for PV(j) before the softmax.
    ptxas may still merge the two sets (it does in the 3-stage D=128 build); what UNROLL
    gives is measured in notes/prefill_gluon.md. r0, pp0: as in _release_tiles."""
    n_pairs = (j_hi - j_lo) // 2 if UNROLL else 0
    for i in range(n_pairs):
        j = j_lo + 2 * i
        p_b, m_i, l_i, acc = _step(j, r0 + j, pp0 + j, q, k_smem, v_smem, k_ready, v_ready,
                                   kv_empty, turn_mine, turn_other, p_op, m_i, l_i, acc, rows, Sq,
                                   Sk, qk_scale, s_layout, p_layout, BLOCK_N, STAGES, MASK,
                                   CAUSAL, PINGPONG, PACK_P, j_mask, MASK_RT)
        p_op, m_i, l_i, acc = _step(j + 1, r0 + j + 1, pp0 + j + 1, q, k_smem, v_smem, k_ready,
                                    v_ready, kv_empty, turn_mine, turn_other, p_b, m_i, l_i, acc,
                                    rows, Sq, Sk, qk_scale, s_layout, p_layout, BLOCK_N, STAGES,
                                    MASK, CAUSAL, PINGPONG, PACK_P, j_mask, MASK_RT)
    for j in range(j_lo + 2 * n_pairs, j_hi):  # the odd one out, or all without UNROLL
        p_op, m_i, l_i, acc = _step(j, r0 + j, pp0 + j, q, k_smem, v_smem, k_ready, v_ready,
                                    kv_empty, turn_mine, turn_other, p_op, m_i, l_i, acc, rows,
                                    Sq, Sk, qk_scale, s_layout, p_layout, BLOCK_N, STAGES, MASK,
                                    CAUSAL, PINGPONG, PACK_P, j_mask, MASK_RT)
    return p_op, m_i, l_i, acc


@gluon.jit
def _compute_q_tile(r0, pp0, n_mine_full, n_mine, off_b, off_h, q0, m_row0, rows, q, q_smem, k2, v2,
                    q_empty, k_ready, v_ready, kv_empty, turn_mine, turn_other, o_desc, o_ptr,
                    lse_ptr, lse_stride, Sq, Sk, Hq, qk_scale, s_layout: gl.constexpr,
                    o_layout: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    PINGPONG: gl.constexpr, UNROLL: gl.constexpr, VARLEN: gl.constexpr,
                    PACK_P: gl.constexpr, ONE_LOOP: gl.constexpr, ZERO_V_TAIL: gl.constexpr):
    """This warpgroup's tiles [0, n_mine) (n_mine >= 1; tiles [0, n_mine_full) unmasked),
    O and LSE stored, Q released. Sq, Sk are this sequence's lengths; rows count from its
    first query (row q0 of the descriptors); lse_stride is the LSE's row length (the
    kernel's Sq). r0, pp0: as in _release_tiles. ONE_LOOP: the masked tiles run in the
    unmasked tiles' loop body with the mask applied at run time, one copy of the step's
    code instead of two (faster at D64 causal; notes/prefill_gluon.md). ZERO_V_TAIL: the
    last V tile's rows past the Sk keys (the next sequence's, loaded by the pack-wide
    descriptor) are set to 0 before its PV, so that a non-finite value there cannot turn
    0 * v into NaN; a tile that ends past the keys is always the warpgroup's last."""
    dtype: gl.constexpr = q_smem.dtype
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # Prologue: S(0) and its softmax (always masked: one tile, maybe the diagonal).
    mbarrier.wait(k_ready.index(r0 % STAGES), (r0 // STAGES) & 1)
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k2.index(r0 % STAGES).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    m_i = gl.full([WG_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([WG_M], gl.float32, row_layout)
    p, alpha, m_i, l_i = _softmax_tile(s, 0, rows, m_i, l_i, Sq, Sk, qk_scale, s_layout,
                                       BLOCK_N, True, CAUSAL, 0, False)
    p_op = _pack_p(p, dtype, p_layout, PACK_P)
    acc = gl.zeros([WG_M, D], gl.float32, o_layout)

    # Steady state: softmax of tile j + 1 unmasked while j + 1 < n_mine_full, masked after
    # (ONE_LOOP: every step in the first loop, masked at run time from n_mine_full on).
    if ONE_LOOP:
        split = n_mine - 1
    else:
        split = gl.maximum(n_mine_full - 1, 0)
    p_op, m_i, l_i, acc = _consume_tiles(0, split, r0, pp0, q, k2, v2, k_ready, v_ready,
                                         kv_empty, turn_mine, turn_other, p_op, m_i, l_i, acc,
                                         rows, Sq, Sk, qk_scale, s_layout, p_layout, BLOCK_N,
                                         STAGES, False, CAUSAL, PINGPONG, UNROLL, PACK_P,
                                         n_mine_full, ONE_LOOP)
    if not ONE_LOOP:
        p_op, m_i, l_i, acc = _consume_tiles(split, n_mine - 1, r0, pp0, q, k2, v2, k_ready,
                                             v_ready, kv_empty, turn_mine, turn_other, p_op, m_i,
                                             l_i, acc, rows, Sq, Sk, qk_scale, s_layout, p_layout,
                                             BLOCK_N, STAGES, True, CAUSAL, PINGPONG, False,
                                             PACK_P, 0, False)

    # Epilogue: PV of the last tile.
    r_last = r0 + n_mine - 1
    s_last = r_last % STAGES
    mbarrier.wait(v_ready.index(s_last), (r_last // STAGES) & 1)
    if ZERO_V_TAIL:
        tail = Sk - (n_mine - 1) * BLOCK_N  # keys of the last tile inside the sequence
        if tail < BLOCK_N:
            _zero_rows_from(v2.index(s_last), tail, BLOCK_N, D)
    acc = warpgroup_mma(p_op, v2.index(s_last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(s_last))

    # O = acc / l, written through this warpgroup's own Q buffer (Q is no longer read), or
    # (VARLEN, a box past the sequence's end) from registers with a row mask.
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    if VARLEN:
        if m_row0 + WG_M <= Sq:
            _store_o_box(out, q, q_smem, o_desc, off_b, q0 + m_row0, off_h * D)
        else:
            _store_rows(o_ptr, out, q0 + m_row0, Sq - m_row0, Hq * D, off_h * D, o_layout, D)
    else:  # the descriptor clips the box at each batch element's Sq
        _store_o_box(out, q, q_smem, o_desc, off_b, m_row0, off_h * D)
    # LSE in natural log: ln(l) + m / log2(e) with m in the log2 domain.
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + _lse_offsets(off_b, off_h, q0, rows, Hq, lse_stride), lse,
             mask=rows < Sq)
    tma.store_wait(0)
    mbarrier.arrive(q_empty)  # the O store has read the Q buffer


@gluon.jit
def _zero_rows_from(buf, first, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """Rows [first, BLOCK_N) of the [BLOCK_N, D] shared tile buf set to 0 by the calling
    warpgroup (a select, so NaN and Inf go too), fenced for the async proxy that the next
    wgmma reads it through."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tile = buf.load(layout)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    buf.store(gl.where(gl.expand_dims(r < first, 1), tile, gl.zeros_like(tile)))
    fence_async_shared()
    gl.thread_barrier()  # every thread's rows stored before the warpgroup's wgmma


@gluon.jit
def _store_o_box(out, q, q_smem, o_desc, off_b, row, col):
    """out [WG_M, D] to the o box at (off_b, row, col) by TMA, through this warpgroup's Q
    buffer (Q is no longer read); the caller waits for the store (tma.store_wait)."""
    q.store(out)
    fence_async_shared()  # so the TMA engine sees the register-to-shared stores
    tma.async_copy_shared_to_global(o_desc, [off_b, row, col], q_smem)


@gluon.jit
def _store_unseen_rows(o_ptr, lse_ptr, lse_stride, off_b, off_h, q0, m_row0, rows, Sq, Hq,
                       dtype: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       D: gl.constexpr):
    """VARLEN, a sequence with no keys (kv_len 0): its rows see nothing, so O is 0 and LSE
    -inf (the reference's and the Triton kernel's convention)."""
    zeros = gl.zeros([WG_M, D], dtype, o_layout)
    _store_rows(o_ptr, zeros, q0 + m_row0, Sq - m_row0, Hq * D, off_h * D, o_layout, D)
    lse = gl.full([WG_M], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + _lse_offsets(off_b, off_h, q0, rows, Hq, lse_stride), lse,
             mask=rows < Sq)


@gluon.jit
def _lse_offsets(off_b, off_h, q0, rows, Hq, lse_stride):
    """LSE offsets of a sequence's rows: lse is [B, Hq, Sq] (fixed) or [Hq, Tq] (VARLEN,
    off_b = 0, rows from q0). Computed where stored, so nothing 64-bit is held across the
    key loop."""
    return ((off_b * Hq + off_h) * lse_stride + q0 + rows).to(gl.int64)


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
              kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq, Sk, Tq,
              Hq, n_bh, section, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr, UNROLL: gl.constexpr, CONSUMERS: gl.constexpr,
              WG_TILES: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr,
              PACK_P: gl.constexpr, ONE_LOOP: gl.constexpr, PAGE: gl.constexpr,
              BOUNDED_V: gl.constexpr):
    """One consumer warpgroup: rows [start_m * BLOCK_M + WG * 64, + 64) of the CTA's tile,
    or (PERSISTENT) of each tile the schedule gives the CTA (_persistent_tile).

    WG_TILES: each warpgroup computes only the K/V tiles its own rows need
    (_wg_tile_counts) and just releases the rest; otherwise all walk the CTA's tiles.
    With PINGPONG the warpgroups take GEMM turns round-robin (0, 1, ..., CONSUMERS - 1).
    BOUNDED_V or PAGE with one consumer (VARLEN): the consumer zeroes the rows of its last
    V tile past the sequence's keys itself (_compute_q_tile), the producer loading that
    tile through the pack-wide descriptor (PAGE: the cache's)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    flat_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_M, D], dtype)
    flat_kv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)

    # The TMA boxes are [1, rows, D]; the leading 1 changes no byte, so view them as 2-D.
    q = q_smem._reinterpret(dtype, [WG_M, D], flat_q)  # [WG_M, D]
    k2 = k_smem._reinterpret(dtype, [STAGES, BLOCK_N, D], flat_kv)  # [STAGES, BLOCK_N, D]
    v2 = v_smem._reinterpret(dtype, [STAGES, BLOCK_N, D], flat_kv)
    turn_mine = turn_bars.index(WG)
    turn_other = turn_bars.index((WG + 1) % CONSUMERS)

    if PERSISTENT:  # fixed length only (attn_fwd_kernel asserts it)
        first, stride, count = _persistent_walk(n_m * n_bh)
        r0 = 0  # the ring index of the current tile's first K/V tile
        for i in range(count):
            start_m, off_b, off_h, n_full, n_total = _persistent_tile(
                first + i * stride, n_m, n_bh, section, Sq, Sk, Hq, BLOCK_M, BLOCK_N, CAUSAL)
            _consume_q_tile(WG, start_m, off_b, off_h, 0, Sq, Sk, n_full, n_total, r0, i, q,
                            q_smem, k2, v2, q_bar, q_empty, k_ready, v_ready, kv_empty,
                            turn_mine, turn_other, o_desc, o_ptr, lse_ptr, Sq, Hq, qk_scale,
                            s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                            PINGPONG, UNROLL, WG_TILES, VARLEN, PACK_P, ONE_LOOP, False)
            r0 += n_total
    else:
        start_m, off_b, off_h, q0, k0, q_len, kv_len = _tile(gl.program_id(0), n_m, Sq, Sk, Hq,
                                                             cu_q, cu_k, tiles, CAUSAL,
                                                             VARLEN, PAGE)
        if VARLEN:  # the LSE's row length: [Hq, Tq] or [B, Hq, Sq]
            lse_stride = Tq
        else:
            lse_stride = Sq
        n_full, n_total = _tile_counts(start_m, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)
        _consume_q_tile(WG, start_m, off_b, off_h, q0, q_len, kv_len, n_full, n_total, 0, 0, q,
                        q_smem, k2, v2, q_bar, q_empty, k_ready, v_ready, kv_empty, turn_mine,
                        turn_other, o_desc, o_ptr, lse_ptr, lse_stride, Hq, qk_scale, s_layout,
                        o_layout, p_layout, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL, PINGPONG,
                        UNROLL, WG_TILES, VARLEN, PACK_P, ONE_LOOP,
                        VARLEN and (BOUNDED_V or PAGE > 0) and CONSUMERS == 1)


@gluon.jit
def _consume_q_tile(WG: gl.constexpr, start_m, off_b, off_h, q0, q_len, kv_len, n_full,
                    n_total, r0, tile_i, q, q_smem, k2, v2, q_bar, q_empty, k_ready, v_ready,
                    kv_empty, turn_mine, turn_other, o_desc, o_ptr, lse_ptr, lse_stride, Hq,
                    qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                    p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    PINGPONG: gl.constexpr, UNROLL: gl.constexpr, WG_TILES: gl.constexpr,
                    VARLEN: gl.constexpr, PACK_P: gl.constexpr, ONE_LOOP: gl.constexpr,
                    ZERO_V_TAIL: gl.constexpr):
    """This warpgroup's part of one query tile (row block start_m of (off_b, off_h), the
    CTA's tile_i-th; its n_total K/V tiles, the first n_full unmasked, from ring index r0).

    Q protocol across tiles: q_bar completes once per tile (phase tile_i & 1) and q_empty
    once every warpgroup has handed its Q buffer back, after its O store has read it; the
    producer loads tile i + 1's Q only then, so that load never overwrites O of tile i.
    Every step takes one ping-pong turn and each tile has one step fewer than K/V tiles,
    so the turns taken before this tile are r0 - tile_i."""
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    m_row0 = start_m * BLOCK_M + WG * WG_M
    rows = m_row0 + gl.arange(0, WG_M, layout=row_layout)  # [WG_M]
    if WG_TILES:
        n_mine_full, n_mine = _wg_tile_counts(m_row0, q_len, kv_len, BLOCK_N, CAUSAL)  # computed
    else:
        n_mine_full = n_full
        n_mine = n_total
    # Waited even where nothing is computed: q_bar of tile i means every warpgroup released
    # Q of tile i - 1, so the q_empty arrival below always counts towards this tile.
    mbarrier.wait(q_bar, tile_i & 1)
    if n_mine > 0:
        _compute_q_tile(r0, r0 - tile_i, n_mine_full, n_mine, off_b, off_h, q0, m_row0, rows, q,
                        q_smem, k2, v2, q_empty, k_ready, v_ready, kv_empty, turn_mine,
                        turn_other, o_desc, o_ptr, lse_ptr, lse_stride, q_len, kv_len, Hq,
                        qk_scale, s_layout, o_layout, p_layout, BLOCK_N, D, STAGES, CAUSAL,
                        PINGPONG, UNROLL, VARLEN, PACK_P, ONE_LOOP, ZERO_V_TAIL)
    else:
        mbarrier.arrive(q_empty)  # rows all past Sq, or (VARLEN) no keys: no Q read
        if VARLEN:
            if m_row0 < q_len:  # real rows of a sequence with no keys
                _store_unseen_rows(o_ptr, lse_ptr, lse_stride, off_b, off_h, q0, m_row0, rows,
                                   q_len, Hq, dtype, s_layout, o_layout, D)
    _release_tiles(n_mine, n_total, r0, r0 - tile_i, v_ready, kv_empty, turn_mine, turn_other,
                   STAGES, PINGPONG)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_smem, v_smem, q_bar, q_empty,
              k_ready, v_ready, kv_empty, cu_q, cu_k, tiles, n_m, Sq, Sk, Hq, n_bh, section,
              v_rows, block_table, bt_stride, bt_width, page_stride, GROUP: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              CONSUMERS: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr,
              BOUNDED_V: gl.constexpr, PAGE: gl.constexpr):
    """The TMA producer warp: for the CTA's tile, or (PERSISTENT) each tile of the same
    schedule the consumers walk, Q once (one 64-row box per consumer into q_bufs[i], all on
    one barrier), then the tile's K and V through the ring, in the consumers' order (the
    tile count from the same _tile / _persistent_tile and _tile_counts the consumers read).
    BOUNDED_V (varlen): see _produce_q_tile. PAGE (varlen, the paged build): K/V through
    the block table, see _load_paged_kv."""
    if PERSISTENT:
        first, stride, count = _persistent_walk(n_m * n_bh)
        r0 = 0
        for i in range(count):
            start_m, off_b, off_h, n_full, n_total = _persistent_tile(
                first + i * stride, n_m, n_bh, section, Sq, Sk, Hq, BLOCK_M, BLOCK_N, CAUSAL)
            _produce_q_tile(start_m, off_b, off_h, 0, 0, Sk, n_total, r0, i,
                            q_desc, k_desc, v_desc, q_bufs, k_smem, v_smem, q_bar, q_empty,
                            k_ready, v_ready, kv_empty, None, 0, None, 0, 0, GROUP, BLOCK_M,
                            BLOCK_N, D, STAGES, CONSUMERS, True, False, 0)
            r0 += n_total
    else:
        start_m, off_b, off_h, q0, k0, q_len, kv_len = _tile(gl.program_id(0), n_m, Sq, Sk, Hq,
                                                             cu_q, cu_k, tiles, CAUSAL,
                                                             VARLEN, PAGE)
        n_full, n_total = _tile_counts(start_m, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)
        if PAGE:
            bt_row = block_table + _tile_seq(gl.program_id(0), n_m, Hq, tiles, CAUSAL,
                                             VARLEN).to(gl.int64) * bt_stride
        else:
            bt_row = block_table
        _produce_q_tile(start_m, off_b, off_h, q0, k0, kv_len, n_total, 0, 0, q_desc, k_desc,
                        v_desc, q_bufs, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                        kv_empty, v_rows, (Hq // GROUP) * D, bt_row, bt_width, page_stride, GROUP,
                        BLOCK_M, BLOCK_N, D, STAGES, CONSUMERS, False, BOUNDED_V, PAGE)


@gluon.jit
def _produce_q_tile(start_m, off_b, off_h, q0, k0, kv_len, n_total, r0, tile_i, q_desc, k_desc,
                    v_desc, q_bufs, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                    v_rows, v_row_len, bt_row, bt_width, page_stride, GROUP: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                    KV_FIRST: gl.constexpr, BOUNDED_V: gl.constexpr, PAGE: gl.constexpr):
    """The loads of one query tile (the CTA's tile_i-th; K/V from ring index r0 on).

    Q waits for q_empty: every warpgroup has handed back its Q buffer, whose O store of the
    previous tile has completed (see _consume_q_tile). KV_FIRST (persistent) issues K/V
    tile 0 before that wait, so the ring refills while the consumers run the previous
    tile's epilogue; its slot waits only on kv_empty, which the consumers release without
    the new Q, so nothing can wait on itself.

    BOUNDED_V (varlen): the pack-wide V descriptor would fill a key tile that ends past
    the sequence with the next sequence's rows, whose probabilities are 0 but whose values
    a NaN or Inf turns into NaN through 0 * v. So with several consumers a tile that ends
    past the sequence's kv_len keys loads V through a descriptor made here over the
    sequence's own rows (v_rows, the packed [Tk, Hkv * D] values, from row k0), whose
    bounds TMA zero-fills past; the one consumer of a one-consumer build zeroes those rows
    itself (_zero_rows_from; the build as measured and tested, notes/prefill_gluon.md,
    "Packs on the one-consumer build"). K needs none: its scores are masked by a select.

    PAGE (the paged build): K/V from the cache through the sequence's block-table row
    bt_row (_load_paged_kv; with one consumer, its V tail zeroed by the consumer as
    above)."""
    off_hkv = off_h // GROUP
    m0 = q0 + start_m * BLOCK_M
    j0 = 0
    if PAGE:
        # the first key tile's table words, read before the wait below: bounded by the
        # row's width, not by kv_len, the load waits on the sequence index alone, not on
        # the key count, so the table is not one more global round trip before the
        # tile's first TMA (the contiguous build's first K load waits on cu_k alone)
        pages0 = _table_words(bt_row, 0, bt_width, BLOCK_N, PAGE)
    if KV_FIRST:
        if n_total > 0:
            _load_kv(r0, k0, off_b, off_hkv, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
                     kv_empty, BLOCK_N, D, STAGES)
            j0 = 1
    # On a fresh barrier the wait for the "previous phase" passes at once (the first tile).
    mbarrier.wait(q_empty, (tile_i & 1) ^ 1)
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, m0, off_h * D], q_bar, q_bufs[0])
    for i in gl.static_range(1, CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [off_b, m0 + i * WG_M, off_h * D], q_bar,
                                        q_bufs[i])
    if PAGE:
        _load_paged_kv(r0, n_total, kv_len, off_hkv, bt_row, pages0, k_desc, v_desc, v_rows,
                       page_stride, v_row_len, k_smem, v_smem, k_ready, v_ready, kv_empty,
                       BLOCK_N, D, STAGES, PAGE, CONSUMERS == 1)
    elif BOUNDED_V and CONSUMERS > 1:  # (one consumer zeroes V's tail rows itself)
        n_inside = gl.minimum(n_total, kv_len // BLOCK_N)  # tiles that end inside the keys
        for j in range(j0, n_inside):
            _load_kv(r0 + j, k0 + j * BLOCK_N, off_b, off_hkv, k_desc, v_desc, k_smem, v_smem,
                     k_ready, v_ready, kv_empty, BLOCK_N, D, STAGES)
        if n_inside < n_total:  # the one tile past the keys: the last, partial one
            # K first, then the tensor map, then V: making the map (a global write and the
            # proxy fence) then overlaps K's load and the consumers' QK^T, which matters
            # where this tile is the sequence's only one and nothing else hides it
            s = _claim_slot(r0 + n_inside, kv_empty, k_ready, v_ready,
                            k_desc.block_type.nbytes, STAGES)
            tma.async_copy_global_to_shared(k_desc, [off_b, k0 + n_inside * BLOCK_N,
                                                     off_hkv * D], k_ready.index(s),
                                            k_smem.index(s))
            v_own = _rows_descriptor(v_rows + k0.to(gl.int64) * v_row_len, kv_len, v_row_len,
                                     v_desc)
            tma.async_copy_global_to_shared(v_own, [0, n_inside * BLOCK_N, off_hkv * D],
                                            v_ready.index(s), v_smem.index(s))
    else:
        for j in range(j0, n_total):
            _load_kv(r0 + j, k0 + j * BLOCK_N, off_b, off_hkv, k_desc, v_desc, k_smem, v_smem,
                     k_ready, v_ready, kv_empty, BLOCK_N, D, STAGES)


@gluon.jit
def _rows_descriptor(base, rows, row_len, like):
    """A tensor map made on the device over `rows` rows of row_len elements from base,
    shaped [1, rows, row_len] with `like`'s box and layout: TMA fills zeros past the rows
    (the bounded V of BOUNDED_V and of the paged build's last page)."""
    return tma.make_tensor_descriptor(base, shape=[1, rows, row_len],
                                      strides=[rows.to(gl.int64) * row_len, row_len, 1],
                                      block_shape=like.block_type.shape, layout=like.layout)


@gluon.jit
def _claim_slot(r, kv_empty, k_ready, v_ready, nbytes, STAGES: gl.constexpr):
    """Ring index r's slot once every consumer has released its previous round, with
    both ready barriers expecting nbytes: the slot's index."""
    s = r % STAGES
    mbarrier.wait(kv_empty.index(s), ((r // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(s), nbytes)
    mbarrier.expect(v_ready.index(s), nbytes)
    return s


@gluon.jit
def _table_words(bt_row, j, n_words, BLOCK_N: gl.constexpr, PAGE: gl.constexpr):
    """Key tile j's table words, one a box of min(PAGE, BLOCK_N) rows: the page of its
    first key, 0 (not read) for a box past the row's first n_words words."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    SLICES: gl.constexpr = BLOCK_N // BOX
    idx_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    keys = j * BLOCK_N + gl.arange(0, SLICES, layout=idx_layout) * BOX
    return gl.load(bt_row + keys // PAGE, mask=keys // PAGE < n_words, other=0)


@gluon.jit
def _load_paged_kv(r0, n_total, kv_len, off_hkv, bt_row, pages0, k_desc, v_desc, v_cache,
                   page_stride, row_len, k_smem, v_smem, k_ready, v_ready, kv_empty,
                   BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                   PAGE: gl.constexpr, ZERO_V: gl.constexpr):
    """The n_total key tiles of a sequence whose keys sit in a paged cache: key j is row
    j % PAGE of page bt_row[j // PAGE]. k_desc / v_desc describe the cache as
    [num_pages, PAGE, Hkv * D] with a box of BOX = min(PAGE, BLOCK_N) rows, so a tile is
    BLOCK_N / BOX boxes, each into its rows of the ring slot (the slot's swizzle repeats
    every 8 rows, and BOX is a multiple of 8). A tile's table words are one vector load:
    tile 0's (pages0) read by the caller, each next tile's issued after the current
    tile's copies, before the next slot's wait, so it overlaps the consumers' release.

    The tile that reaches past kv_len: rows of the last page past the keys hold whatever
    the cache holds there (NaN, say), and 0 * NaN would reach P V, so its V comes through
    a descriptor made here over the last page alone with the valid row count as its bound
    (TMA fills zeros past it, and the whole box of a slice past the last page is outside
    it); K's rows there may hold anything (their scores are replaced by the mask), so a
    slice past the last page re-reads the last page. ZERO_V (one consumer): V comes as K
    does, through v_desc, and the consumer zeroes its rows past the keys itself
    (_zero_rows_from), as _produce_q_tile says. No table word past the sequence's pages is
    read but tile 0's, which are bounded by the row's width (their values are used only
    for boxes of the sequence's keys)."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    SLICES: gl.constexpr = BLOCK_N // BOX
    TILE_BYTES: gl.constexpr = BLOCK_N * D * k_desc.dtype.primitive_bitwidth // 8
    idx_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slice_i = gl.arange(0, SLICES, layout=idx_layout)
    col = off_hkv * D
    n_whole = gl.minimum(n_total, kv_len // BLOCK_N)  # tiles of valid keys only
    n_pages = (kv_len + PAGE - 1) // PAGE  # the sequence's pages: its words in the row
    pages = pages0
    for j in range(n_whole):
        s = _claim_slot(r0 + j, kv_empty, k_ready, v_ready, TILE_BYTES, STAGES)
        for p in gl.static_range(SLICES):
            page = gl.sum(gl.where(slice_i == p, pages, 0), axis=0)
            row = (j * BLOCK_N + p * BOX) % PAGE
            tma.async_copy_global_to_shared(k_desc, [page, row, col], k_ready.index(s),
                                            k_smem.index(s).slice(p * BOX, BOX, dim=1))
            tma.async_copy_global_to_shared(v_desc, [page, row, col], v_ready.index(s),
                                            v_smem.index(s).slice(p * BOX, BOX, dim=1))
        pages = _table_words(bt_row, j + 1, n_pages, BLOCK_N, PAGE)
    if n_whole < n_total:  # the one tile past the keys: the last, partial one
        last = (kv_len - 1) // PAGE  # the sequence's last page in its table row
        last_page = gl.load(bt_row + last)
        valid = kv_len - last * PAGE  # its rows holding keys, 1..PAGE
        if ZERO_V:  # the cache's own V: the consumer zeroes the rows past the keys
            v_src = v_desc
            v_page = last_page
            v_past = 0
        else:  # the last page alone, bounded at its valid rows
            v_src = _rows_descriptor(v_cache + last_page.to(gl.int64) * page_stride, valid,
                                     row_len, v_desc)
            v_page = 0
            v_past = valid
        j = n_whole  # its words are in pages (only those of whole boxes of keys are used)
        s = _claim_slot(r0 + j, kv_empty, k_ready, v_ready, TILE_BYTES, STAGES)
        for p in gl.static_range(SLICES):
            key = j * BLOCK_N + p * BOX
            k_dst = k_smem.index(s).slice(p * BOX, BOX, dim=1)
            v_dst = v_smem.index(s).slice(p * BOX, BOX, dim=1)
            if key + BOX <= kv_len:  # a whole slice of keys
                page = gl.sum(gl.where(slice_i == p, pages, 0), axis=0)
                tma.async_copy_global_to_shared(k_desc, [page, key % PAGE, col],
                                                k_ready.index(s), k_dst)
                tma.async_copy_global_to_shared(v_desc, [page, key % PAGE, col],
                                                v_ready.index(s), v_dst)
            elif key < kv_len:  # the slice holding the last key, inside the last page
                tma.async_copy_global_to_shared(k_desc, [last_page, key % PAGE, col],
                                                k_ready.index(s), k_dst)
                tma.async_copy_global_to_shared(v_src, [v_page, key % PAGE, col],
                                                v_ready.index(s), v_dst)
            else:  # past the last page: any K rows; V zeros (wholly outside the bounded
                # map, or zeroed by the consumer with ZERO_V)
                tma.async_copy_global_to_shared(k_desc, [last_page, 0, col],
                                                k_ready.index(s), k_dst)
                tma.async_copy_global_to_shared(v_src, [v_page, v_past, col],
                                                v_ready.index(s), v_dst)


@gluon.jit
def _load_kv(r, row, off_b, off_hkv, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
             kv_empty, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """K and V rows [row, row + BLOCK_N) of KV head off_hkv into ring index r, once every
    consumer has released that slot's previous round."""
    s = r % STAGES
    mbarrier.wait(kv_empty.index(s), ((r // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, row, off_hkv * D], k_ready.index(s),
                                    k_smem.index(s))
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [off_b, row, off_hkv * D], v_ready.index(s),
                                    v_smem.index(s))


# Tq and max_q (VARLEN only) vary with every pack: not specialized on (a value of 1 or a
# multiple of 16 would each be another build), nor are the cu_seqlens on their alignment
# (a view such as cu_seqlens[i:] is a valid argument and only read a word at a time).
@gluon.jit(do_not_specialize=["Tq", "max_q"], do_not_specialize_on_alignment=["cu_q", "cu_k"])
def attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, Sq, Sk, Hq, qk_scale, o_ptr, cu_q,
                    cu_k, Tq, max_q, n_bh, section, tiles, v_rows, block_table, bt_stride,
                    bt_width, page_stride, GROUP: gl.constexpr,
                    BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, UNROLL: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    CONSUMERS: gl.constexpr = 2, WG_TILES: gl.constexpr = True,
                    VARLEN: gl.constexpr = False, PERSISTENT: gl.constexpr = False,
                    BOUNDED_V: gl.constexpr = False, PAGE: gl.constexpr = 0,
                    PACK_P: gl.constexpr = True, ONE_LOOP: gl.constexpr = False):
    """1-D grid over tiles (row block, batch, head), one tile per CTA. q/o descriptors are
    [B, Sq, Hq * D] with box [1, 64, D]; k/v are [B, Sk, Hkv * D] with box [1, BLOCK_N, D];
    GROUP = Hq // Hkv. CONSUMERS (1 to 3) consumer warpgroups of 64 rows each:
    BLOCK_M = 64 * CONSUMERS. lse is [B, Hq, Sq]. Fixed length passes None for o_ptr, cu_q,
    cu_k, Tq, max_q.

    VARLEN: q/o are [1, Tq, Hq * D], k/v [1, Tk, Hkv * D], lse [Hq, Tq]; cu_q / cu_k
    (int32 [batch + 1]) give each sequence's rows, the batch index counts sequences, max_q
    bounds the longest sequence (the grid's row blocks), o_ptr is o's base (rows of Hq * D
    elements) for the masked stores; Sq, Sk are unused (0). VARLEN == COMPACT: tiles is
    the launcher's int32 [2, grid] tile table (see _tile), else None.

    PERSISTENT (fixed length only): a grid of at most one CTA per SM, each walking the
    tiles of _persistent_tile's order (n_bh = B * Hq pairs in sections of `section`,
    see there) with every barrier phase counted across its tiles; None for both
    otherwise.

    BOUNDED_V (varlen only): v_rows is v's base pointer (packed [Tk, Hkv * D]), from which
    the producer makes a descriptor of the sequence's own rows for a key tile that ends
    past them (_produce_q_tile); None otherwise.

    PAGE (varlen only; 0 otherwise): the paged build, keys from a paged cache. k/v are the
    caches as [num_pages, PAGE, Hkv * D] with a box of min(PAGE, BLOCK_N) rows, cu_k each
    sequence's key count (seqlens_k, int32 [batch]; see _keys), block_table int32
    [batch, bt_width] with row stride bt_stride, v_rows the V cache's base and page_stride
    its elements a page (for the last page's bounded descriptor, see _load_paged_kv); None
    for the four otherwise."""
    gl.static_assert(CONSUMERS >= 1 and CONSUMERS <= 3, "one to three consumer warpgroups")
    gl.static_assert(CONSUMERS > 1 or not PINGPONG, "ping-pong needs two consumers")
    gl.static_assert(BLOCK_M == CONSUMERS * WG_M, "consumer warpgroups of 64 rows each")
    gl.static_assert(not (PERSISTENT and VARLEN), "the persistent schedule is fixed-length only")
    gl.static_assert(not (BOUNDED_V and PERSISTENT), "BOUNDED_V is a varlen build")
    dtype: gl.constexpr = q_desc.dtype
    if VARLEN:
        n_m = gl.cdiv(max_q, BLOCK_M)
        # The grid covers the longest sequence: a row block past this sequence's end has
        # nothing to do and leaves before any barrier or copy exists, so no partition can
        # wait on another (the partitions read the same _tile, and would agree on zero work).
        start_m, off_b, off_h, q0, k0, q_len, kv_len = _tile(gl.program_id(0), n_m, Sq, Sk, Hq,
                                                             cu_q, cu_k, tiles, CAUSAL,
                                                             VARLEN, PAGE)
        if start_m * BLOCK_M >= q_len:
            return
    else:
        n_m = gl.cdiv(Sq, BLOCK_M)

    q0_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    if CONSUMERS > 1:
        q1_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    # [STAGES, 1, BLOCK_N, D]: the descriptors' box (the paged build's may be fewer rows,
    # a tile then being several boxes; the layout's swizzle is the same)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=CONSUMERS)  # every consumer warpgroup is done with its Q
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer releases a slot
    if PINGPONG:
        # Only a build that takes turns initialises them. Unused, the buffer is dead to the
        # shared-memory allocator, which may place a producer's tensor-map template on the
        # same bytes; an initialised mbarrier whose memory is written without
        # mbarrier.inval is undefined in PTX, and on the H200 the V copy through that map
        # faulted ("misaligned address") with several CTAs an SM.
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(turn_bars.index(i), count=1)
        mbarrier.arrive(turn_bars.index(0))  # warpgroup 0 takes the first turn

    # The argument lists are spelled out per partition: a tuple built once and joined with
    # `+` loses its constexpr members in Triton 3.6's frontend (D, BLOCK_N... become run-time
    # values and the consumers' layouts fail to build), so it cannot be shared.
    if CONSUMERS == 1:
        # One consumer: the default partition takes what the producer leaves of the
        # launch's maxnreg (two or three CTAs an SM: GluonSettings.ctas_per_sm).
        gl.warp_specialize([
            (_consumer, (0, q0_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Tq, Hq, n_bh, section, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PINGPONG, UNROLL, CONSUMERS, WG_TILES, VARLEN, PERSISTENT,
                         PACK_P, ONE_LOOP, PAGE, BOUNDED_V)),
            (_producer, (q_desc, k_desc, v_desc, (q0_smem, ), k_smem, v_smem, q_bar,
                         q_empty, k_ready, v_ready, kv_empty, cu_q, cu_k, tiles, n_m, Sq, Sk, Hq,
                         n_bh, section, v_rows, block_table, bt_stride, bt_width, page_stride,
                         GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL, CONSUMERS, VARLEN,
                         PERSISTENT, BOUNDED_V, PAGE)),
        ], [1], [PRODUCER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q0_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Tq, Hq, n_bh, section, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PINGPONG, UNROLL, CONSUMERS, WG_TILES, VARLEN, PERSISTENT,
                         PACK_P, ONE_LOOP, PAGE, BOUNDED_V)),
            (_consumer, (1, q1_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Tq, Hq, n_bh, section, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PINGPONG, UNROLL, CONSUMERS, WG_TILES, VARLEN, PERSISTENT,
                         PACK_P, ONE_LOOP, PAGE, BOUNDED_V)),
            (_producer, (q_desc, k_desc, v_desc, (q0_smem, q1_smem), k_smem, v_smem, q_bar,
                         q_empty, k_ready, v_ready, kv_empty, cu_q, cu_k, tiles, n_m, Sq, Sk, Hq,
                         n_bh, section, v_rows, block_table, bt_stride, bt_width, page_stride,
                         GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL, CONSUMERS, VARLEN,
                         PERSISTENT, BOUNDED_V, PAGE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        q2_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        gl.warp_specialize([
            (_consumer, (0, q0_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Tq, Hq, n_bh, section, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PINGPONG, UNROLL, CONSUMERS, WG_TILES, VARLEN, PERSISTENT,
                         PACK_P, ONE_LOOP, PAGE, BOUNDED_V)),
            (_consumer, (1, q1_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Tq, Hq, n_bh, section, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PINGPONG, UNROLL, CONSUMERS, WG_TILES, VARLEN, PERSISTENT,
                         PACK_P, ONE_LOOP, PAGE, BOUNDED_V)),
            (_consumer, (2, q2_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, o_desc, o_ptr, lse_ptr, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Tq, Hq, n_bh, section, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PINGPONG, UNROLL, CONSUMERS, WG_TILES, VARLEN, PERSISTENT,
                         PACK_P, ONE_LOOP, PAGE, BOUNDED_V)),
            (_producer, (q_desc, k_desc, v_desc, (q0_smem, q1_smem, q2_smem), k_smem, v_smem,
                         q_bar, q_empty, k_ready, v_ready, kv_empty, cu_q, cu_k, tiles, n_m, Sq,
                         Sk, Hq, n_bh, section, v_rows, block_table, bt_stride, bt_width,
                         page_stride, GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL, CONSUMERS,
                         VARLEN, PERSISTENT, BOUNDED_V, PAGE)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
