"""Gluon partitions of the sm_90 warp-specialized prefill (see prefill_gluon.py).

One CTA owns BLOCK_M = CONSUMERS * 64 query rows of one (batch, head), CONSUMERS = 2 or 3.
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

ROWS_PER_WG = 64  # query rows per consumer warpgroup (a warpgroup's wgmma has M = 64)
WG_M = gl.constexpr(ROWS_PER_WG)


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


# Named hardware barriers for ping-pong turns (PP_NAMED): bar.sync / bar.arrive on barrier
# NAMED_BAR0 + warpgroup, 256 threads (the waiting warpgroup's 128 + the passing one's 128).
# Triton 3.6 uses barriers 0-2 for its own partition syncs; 8.. are free. ptxas moves a plain
# bar.sync / bar.arrive freely among ALU instructions (seen in SASS: both rose into the row
# max, ahead of every exponential), and a mov through the asm is copy-propagated away. So,
# as in _PV_WAIT_AFTER_L, the barrier is predicated on the two values a thread passes
# through (always true: no arithmetic result is the signalling-NaN pattern 0x7f800001):
# it cannot issue before they exist, and the branch ptxas makes of it is a block boundary
# the exponentials stay behind (the row max goes through the wait, the row sum through the
# pass).
NAMED_BAR0 = gl.constexpr(8)
_BAR_SYNC = gl.constexpr("{ .reg .pred ok; setp.ne.b32 ok, $4, 0x7f800001; "
                         "setp.ne.and.b32 ok, $5, 0x7f800001, ok; @ok bar.sync $2, 256; "
                         "mov.b32 $0, $4; mov.b32 $1, $5; }")
_BAR_ARRIVE = gl.constexpr("{ .reg .pred ok; setp.ne.b32 ok, $4, 0x7f800001; "
                           "setp.ne.and.b32 ok, $5, 0x7f800001, ok; @ok bar.arrive $2, 256; "
                           "mov.b32 $0, $4; mov.b32 $1, $5; }")


@gluon.jit
def _named_bar(bar_id, x, ARRIVE: gl.constexpr):
    """x unchanged, after bar.sync (ARRIVE=False) or bar.arrive on barrier bar_id (an int32
    tensor of x's shape and layout, two elements a thread)."""
    if ARRIVE:
        asm: gl.constexpr = _BAR_ARRIVE
    else:
        asm: gl.constexpr = _BAR_SYNC
    return gl.inline_asm_elementwise(asm, "=r,=r,r,r,r,r", [bar_id, x], dtype=gl.float32,
                                     is_pure=False, pack=2)


@gluon.jit
def _turn_wait(x, turn_mine, pp, PP_NAMED: gl.constexpr):
    """Wait for this warpgroup's ping-pong turn number pp; returns x (see _named_bar), or
    a throw-away value where x is None (a turn that carries nothing).

    PP_NAMED: turn_mine is (barrier ids, a zeroed fp32 row in shared memory). x comes back
    plus a zero loaded from that row after the bar.sync: a shared-memory load cannot rise
    above a bar.sync, so what is computed from x (the exponentials) cannot either."""
    if PP_NAMED:
        if x is None:
            x = turn_mine[0].to(gl.float32)
        x = _named_bar(turn_mine[0], x, False)
        x = x + turn_mine[1].load(x.type.layout)
    else:
        mbarrier.wait(turn_mine, pp & 1)
        if x is None:
            x = 0.0
    return x


@gluon.jit
def _turn_pass(x, turn_other, PP_NAMED: gl.constexpr):
    """Hand the turn to the next warpgroup; returns x (see _named_bar; None as in
    _turn_wait)."""
    if PP_NAMED:
        if x is None:
            x = turn_other.to(gl.float32)
        x = _named_bar(turn_other, x, True)
    else:
        mbarrier.arrive(turn_other)
        if x is None:
            x = 0.0
    return x


@gluon.jit
def _release_tiles(j_lo, j_hi, r0, pp0, v_ready, kv_empty, turn_mine, turn_other,
                   STAGES: gl.constexpr, PINGPONG: gl.constexpr, PP_NAMED: gl.constexpr):
    """The barrier duties of a warpgroup for tiles [j_lo, j_hi) it does not compute (see
    _wg_tile_counts): release each ring slot once its data has landed (so an arrival is
    never counted towards an earlier round of the slot), and with PINGPONG pass on the
    turns its steps would have taken (step j's turn before tile j + 1, as in _step), so
    the other warpgroups' round-robin and the producer go on as if it had computed them."""
    if j_lo == 0 and j_hi > 0:  # tile 0 belongs to the prologue, which takes no turn
        mbarrier.wait(v_ready.index(r0 % STAGES), (r0 // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(r0 % STAGES))
    for j in range(gl.maximum(j_lo, 1), j_hi):
        if PINGPONG:  # the turn of step j - 1, wherever the step takes it (PP_SOFTMAX)
            x = _turn_wait(None, turn_mine, pp0 + j - 1, PP_NAMED)
            _turn_pass(x, turn_other, PP_NAMED)
        r = r0 + j
        mbarrier.wait(v_ready.index(r % STAGES), (r // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(r % STAGES))


@gluon.jit
def _row_reduce_pairs(x, BLOCK_N: gl.constexpr, MAX: gl.constexpr):
    """Row max (MAX) or sum of x [WG_M, BLOCK_N] with half the serial chain: a thread holds
    its columns in adjacent pairs (wgmma accumulator layout), so reshaping to
    [WG_M, BLOCK_N / 2, 2] and splitting moves no data; the pairs combine in parallel and
    only BLOCK_N / 2 / 4 of them chain per thread (gl.max / gl.sum fold a thread's 32
    values one after the other: 32 dependent FMNMX or FADD per row at BLOCK_N = 128)."""
    even, odd = gl.split(gl.reshape(x, [WG_M, BLOCK_N // 2, 2]))
    if MAX:
        r = gl.max(gl.maximum(even, odd), axis=1)
    else:
        r = gl.sum(even + odd, axis=1)
    # back to the row layout of x's own reductions: the same distribution, no data moves
    return gl.convert_layout(r, gl.SliceLayout(1, x.type.layout))


@gluon.jit
def _softmax_tile(s, j, rows, m_i, l_i, Sq, Sk, qk_scale, s_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                  turn_mine=None, turn_other=None, pp=0, TURN: gl.constexpr = False,
                  PP_NAMED: gl.constexpr = False, PAIR_REDUCE: gl.constexpr = False):
    """Online-softmax step on one S tile [WG_M, BLOCK_N] (fp32, raw q.k).

    m_i is kept in the log2 domain (scaled by qk_scale = sm_scale * log2 e). Returns the
    unnormalized probabilities p, the factor alpha that rescales everything accumulated
    before this tile, and the new (m_i, l_i). MASK is constexpr so the compare/select
    compiles away on the tiles that need none. TURN (ping-pong turns at the softmax,
    PP_SOFTMAX): the exponentials run inside this warpgroup's turn pp, after the row max,
    so the consumer warpgroups' exponentials never compete for the SFU and issue slots
    while the tensor cores run the other warpgroups' GEMMs.
    """
    if MASK:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < Sk, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + (Sk - Sq), 1))
        s = gl.where(keep, s, -float("inf"))
    if PAIR_REDUCE:
        m_tile = _row_reduce_pairs(s, BLOCK_N, True)
    else:
        m_tile = gl.max(s, axis=1)
    m_new = gl.maximum(m_i, m_tile * qk_scale)  # [WG_M]
    if TURN:
        m_new = _turn_wait(m_new, turn_mine, pp, PP_NAMED)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))  # [WG_M, BLOCK_N]
    alpha = gl.exp2(m_i - m_new)  # [WG_M]
    if PAIR_REDUCE:
        l_i = l_i * alpha + _row_reduce_pairs(p, BLOCK_N, False)
    else:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    if TURN:
        l_i = _turn_pass(l_i, turn_other, PP_NAMED)
    return p, alpha, m_new, l_i


# Inline PTX for PIN_PV_WAIT: a `wgmma.wait_group 0` predicated on the two row sums a thread
# holds. The predicate is always true (no arithmetic result has the signalling-NaN bits
# 0x7f800001), but ptxas cannot know that, so the wait (a branch in SASS) has to follow the
# last exponential that feeds l_i; the plain wait that follows it cannot be hoisted above it.
_PV_WAIT_AFTER_L = gl.constexpr("{ .reg .pred ok; setp.ne.b32 ok, $2, 0x7f800001; "
                                 "setp.ne.and.b32 ok, $3, 0x7f800001, ok; "
                                 "@ok wgmma.wait_group.sync.aligned 0; "
                                 "mov.b32 $0, $2; mov.b32 $1, $3; }")


@gluon.jit
def _pin_pv_wait(l_i):
    """Wait for all wgmma of this warpgroup, but only once l_i (so every exponential of the
    tile) has been computed; returns l_i unchanged. Without it ptxas moves the wait for PV(j)
    (WARPGROUP.DEPBAR.LE gsb0, 0x0) up to the row max, ahead of every MUFU.EX2, because the
    wait has no operands that tie it to the softmax (notes/prefill_gluon.md)."""
    return gl.inline_asm_elementwise(_PV_WAIT_AFTER_L, "=r,=r,r,r", [l_i], dtype=gl.float32,
                                     is_pure=False, pack=2)


@gluon.jit
def _step(j, r, pp, q, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_mine, turn_other,
          p_op, m_i, l_i, acc, rows, Sq, Sk, qk_scale, s_layout: gl.constexpr,
          p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
          CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
          PIN_PV_WAIT: gl.constexpr, PP_SOFTMAX: gl.constexpr, PP_NAMED: gl.constexpr,
          PAIR_REDUCE: gl.constexpr):
    """One iteration: PV of tile j (its P already in registers) and QK^T of tile j + 1 are
    issued back to back, then the softmax of tile j + 1 runs while PV(j) is still on the
    tensor cores (OVERLAP). With PINGPONG the consumer warpgroups take turns (round-robin)
    issuing their GEMMs, so one's softmax runs under the others' GEMMs, or with PP_SOFTMAX
    running their exponentials (see _softmax_tile); PP_NAMED passes the turns through named
    hardware barriers instead of mbarriers. r is tile j's index in the
    shared-memory ring, counted over all the tiles this CTA has consumed (persistent); pp
    counts the ping-pong turns taken so far (one per step). PIN_PV_WAIT keeps the wait for
    PV(j) after the exponentials in SASS (see _pin_pv_wait)."""
    s_cur = r % STAGES
    nxt = j + 1
    s_nxt = (r + 1) % STAGES
    GEMM_TURNS: gl.constexpr = PINGPONG and not PP_SOFTMAX
    if GEMM_TURNS:
        _turn_wait(None, turn_mine, pp, PP_NAMED)
    mbarrier.wait(k_ready.index(s_nxt), ((r + 1) // STAGES) & 1)
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index(s_nxt).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
    if not OVERLAP:
        s_tok = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.wait(v_ready.index(s_cur), (r // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(s_cur), acc, is_async=True)
    if GEMM_TURNS:
        _turn_pass(None, turn_other, PP_NAMED)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))  # QK^T(j+1) done; PV(j) may still run
    p, alpha, m_i, l_i = _softmax_tile(s, nxt, rows, m_i, l_i, Sq, Sk, qk_scale, s_layout,
                                       BLOCK_N, MASK, CAUSAL, turn_mine, turn_other, pp,
                                       PINGPONG and PP_SOFTMAX, PP_NAMED, PAIR_REDUCE)
    # P(j + 1) is packed before waiting for PV(j), which still reads P(j) from registers.
    p_nxt = gl.convert_layout(p.to(q.dtype), p_layout)
    if PIN_PV_WAIT:
        l_i = _pin_pv_wait(l_i)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(s_cur))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return p_nxt, m_i, l_i, acc


@gluon.jit
def _consume_tiles(j_lo, j_hi, r0, pp0, q, k_smem, v_smem, k_ready, v_ready, kv_empty,
                   turn_mine, turn_other, p_op, m_i, l_i, acc, rows, Sq, Sk, qk_scale,
                   s_layout: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                   OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, UNROLL: gl.constexpr,
                   PIN_PV_WAIT: gl.constexpr, PP_SOFTMAX: gl.constexpr, PP_NAMED: gl.constexpr,
                   PAIR_REDUCE: gl.constexpr):
    """Iterations j in [j_lo, j_hi), unrolled by two (UNROLL) so that P(j) and P(j + 1) can
    live in two register sets: with one loop-carried set, ptxas packs P(j + 1) into the
    registers the in-flight PV(j) still reads and so waits for PV(j) before the softmax
    (SASS: WARPGROUP.DEPBAR.LE 0 ahead of every MUFU.EX2). ptxas may still merge the two
    sets (it does in the 3-stage D=128 build; notes/prefill_gluon.md)."""
    n_pairs = (j_hi - j_lo) // 2 if UNROLL else 0
    for i in range(n_pairs):
        j = j_lo + 2 * i
        p_b, m_i, l_i, acc = _step(j, r0 + j, pp0 + j, q, k_smem, v_smem, k_ready, v_ready,
                                   kv_empty, turn_mine, turn_other, p_op, m_i, l_i, acc, rows,
                                   Sq, Sk, qk_scale, s_layout, p_layout, BLOCK_N, STAGES, MASK,
                                   CAUSAL, OVERLAP, PINGPONG, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                                   PAIR_REDUCE)
        p_op, m_i, l_i, acc = _step(j + 1, r0 + j + 1, pp0 + j + 1, q, k_smem, v_smem,
                                    k_ready, v_ready, kv_empty, turn_mine, turn_other, p_b, m_i,
                                    l_i, acc, rows, Sq, Sk, qk_scale, s_layout, p_layout,
                                    BLOCK_N, STAGES, MASK, CAUSAL, OVERLAP, PINGPONG,
                                    PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED, PAIR_REDUCE)
    for j in range(j_lo + 2 * n_pairs, j_hi):  # the odd one out, or all without UNROLL
        p_op, m_i, l_i, acc = _step(j, r0 + j, pp0 + j, q, k_smem, v_smem, k_ready, v_ready,
                                    kv_empty, turn_mine, turn_other, p_op, m_i, l_i, acc, rows,
                                    Sq, Sk, qk_scale, s_layout, p_layout, BLOCK_N, STAGES, MASK,
                                    CAUSAL, OVERLAP, PINGPONG, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                                    PAIR_REDUCE)
    return p_op, m_i, l_i, acc


@gluon.jit
def _tile_coords(t, n_m, Hq, CAUSAL: gl.constexpr):
    """Tile t -> (start_m, b, h). Row blocks vary fastest, so CTAs running at the same time
    share a head's K/V in L2; causal walks them from the last (most keys) to the first."""
    m_idx = t % n_m
    bh = t // n_m
    if CAUSAL:
        start_m = n_m - 1 - m_idx
    else:
        start_m = m_idx
    return start_m, bh // Hq, bh % Hq


@gluon.jit
def _consume_q_tile(t, r0, tile_i, WG: gl.constexpr, q, q_smem, k2, v2, q_bar, q_empty,
                    k_ready, v_ready, kv_empty, turn_mine, turn_other, o_desc, o_ptr, lse_ptr,
                    n_m, Sq, Sk, Hq, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                    p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, UNROLL: gl.constexpr,
                    PIN_PV_WAIT: gl.constexpr, PP_SOFTMAX: gl.constexpr, PP_NAMED: gl.constexpr,
                    PAIR_REDUCE: gl.constexpr, O_DIRECT: gl.constexpr,
                    WG_TILES: gl.constexpr):
    """Tile t (this CTA's tile_i-th, its K/V from ring index r0 on); returns its K/V count.

    WG_TILES: each warpgroup computes only the K/V tiles its own rows need
    (_wg_tile_counts) and just releases the rest; otherwise all walk the CTA's tiles.

    O_DIRECT stores O from registers to global memory and gives Q's buffer back as soon as
    the last QK^T has completed, so the producer loads the next tile's Q during this tile's
    last PV and epilogue (persistent launches); otherwise O goes out by TMA through the Q
    buffer, which is released only once that store has read it."""
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    start_m, off_b, off_h = _tile_coords(t, n_m, Hq, CAUSAL)
    m_row0 = start_m * BLOCK_M + WG * WG_M
    rows = m_row0 + gl.arange(0, WG_M, layout=row_layout)  # [WG_M]
    n_full, n_total = _tile_counts(start_m, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)  # tiles loaded
    if WG_TILES:
        n_mine_full, n_mine = _wg_tile_counts(m_row0, Sq, Sk, BLOCK_N, CAUSAL)  # computed here
    else:
        n_mine_full = n_full
        n_mine = n_total
    # Waited even where nothing is computed: q_bar(i) means every warpgroup released Q of
    # tile i - 1, so an arrival on q_empty below always counts towards this tile.
    mbarrier.wait(q_bar, tile_i & 1)
    if n_mine > 0:
        _compute_q_tile(r0, r0 - tile_i, n_mine_full, n_mine, off_b, off_h, m_row0, rows, q,
                        q_smem, k2, v2, q_empty, k_ready, v_ready, kv_empty, turn_mine,
                        turn_other, o_desc, o_ptr, lse_ptr, Sq, Sk, Hq, qk_scale, s_layout,
                        o_layout, p_layout, BLOCK_N, D, STAGES, CAUSAL, OVERLAP, PINGPONG,
                        UNROLL, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED, PAIR_REDUCE, O_DIRECT)
    else:
        mbarrier.arrive(q_empty)  # rows all past Sq: this warpgroup reads no Q
    _release_tiles(n_mine, n_total, r0, r0 - tile_i, v_ready, kv_empty, turn_mine, turn_other,
                   STAGES, PINGPONG, PP_NAMED)
    return n_total


@gluon.jit
def _compute_q_tile(r0, pp0, n_mine_full, n_mine, off_b, off_h, m_row0, rows, q, q_smem, k2,
                    v2, q_empty, k_ready, v_ready, kv_empty, turn_mine, turn_other, o_desc,
                    o_ptr, lse_ptr, Sq, Sk, Hq, qk_scale, s_layout: gl.constexpr,
                    o_layout: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, UNROLL: gl.constexpr,
                    PIN_PV_WAIT: gl.constexpr, PP_SOFTMAX: gl.constexpr, PP_NAMED: gl.constexpr,
                    PAIR_REDUCE: gl.constexpr, O_DIRECT: gl.constexpr):
    """This warpgroup's tiles [0, n_mine) (n_mine >= 1; tiles [0, n_mine_full) unmasked),
    O and LSE stored, Q released. pp0 counts the ping-pong turns taken before this tile."""
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
                                       BLOCK_N, True, CAUSAL, None, None, 0, False, False,
                                       PAIR_REDUCE)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = gl.zeros([WG_M, D], gl.float32, o_layout)

    # Steady state: softmax of tile j + 1 unmasked while j + 1 < n_mine_full, masked after.
    split = gl.maximum(n_mine_full - 1, 0)
    p_op, m_i, l_i, acc = _consume_tiles(0, split, r0, pp0, q, k2, v2, k_ready, v_ready,
                                         kv_empty, turn_mine, turn_other, p_op, m_i, l_i,
                                         acc, rows, Sq, Sk, qk_scale, s_layout, p_layout,
                                         BLOCK_N, STAGES, False, CAUSAL, OVERLAP, PINGPONG,
                                         UNROLL, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED, PAIR_REDUCE)
    p_op, m_i, l_i, acc = _consume_tiles(split, n_mine - 1, r0, pp0, q, k2, v2, k_ready,
                                         v_ready, kv_empty, turn_mine, turn_other, p_op, m_i,
                                         l_i, acc, rows, Sq, Sk, qk_scale, s_layout,
                                         p_layout, BLOCK_N, STAGES, True, CAUSAL, OVERLAP,
                                         PINGPONG, False, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                                         PAIR_REDUCE)
    if O_DIRECT:
        mbarrier.arrive(q_empty)  # every QK^T of this tile has completed: Q is not read again

    # Epilogue: PV of the last tile.
    r_last = r0 + n_mine - 1
    s_last = r_last % STAGES
    mbarrier.wait(v_ready.index(s_last), (r_last // STAGES) & 1)
    acc = warpgroup_mma(p_op, v2.index(s_last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(s_last))

    # O = acc / l, written through this warpgroup's own Q buffer (Q is no longer read).
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    if O_DIRECT:
        # O is [B, Sq, Hq, D] contiguous; rows past Sq belong to no one (masked).
        o_rows = m_row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        o_off = ((off_b * Sq + o_rows).to(gl.int64) * Hq + off_h) * D
        gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(o_cols, 0), out,
                 mask=gl.expand_dims(o_rows < Sq, 1))
    else:
        q.store(out)
        fence_async_shared()  # so the TMA engine sees the register-to-shared stores
        tma.async_copy_shared_to_global(o_desc, [off_b, m_row0, off_h * D], q_smem)
    # LSE in natural log: ln(l) + m / log2(e) with m in the log2 domain.
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + ((off_b * Hq + off_h) * Sq + rows).to(gl.int64), lse,
             mask=rows < Sq)
    if not O_DIRECT:
        tma.store_wait(0)
        mbarrier.arrive(q_empty)  # the producer may load the next tile's Q into q_smem


@gluon.jit
def _read_tile(tile_smem):
    """The tile index the producer published in shared memory (DYNAMIC schedule)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.max(tile_smem.load(layout), axis=0)


@gluon.jit
def _publish_tile(tile_smem, t):
    """Write tile index t for the consumers; the q_bar arrive that follows releases it."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    tile_smem.store(gl.full([1], t, gl.int32, layout))


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
              kv_empty, turn_bars, turn_zero, tile_smem, o_desc, o_ptr, lse_ptr, n_m, num_tiles,
              Sq, Sk, Hq, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
              PINGPONG: gl.constexpr, UNROLL: gl.constexpr, PERSISTENT: gl.constexpr,
              PIN_PV_WAIT: gl.constexpr, PP_SOFTMAX: gl.constexpr, PP_NAMED: gl.constexpr,
              PAIR_REDUCE: gl.constexpr, CONSUMERS: gl.constexpr, DYNAMIC: gl.constexpr,
              O_DIRECT: gl.constexpr, WG_TILES: gl.constexpr):
    """One consumer warpgroup: rows [start_m * BLOCK_M + WG * 64, + 64) of each tile this
    CTA takes: one tile per CTA, or (PERSISTENT) tiles pid, pid + grid, ..., or (DYNAMIC)
    the tiles the producer claims from a global counter and publishes in tile_smem.
    With PINGPONG the warpgroups take GEMM turns round-robin (0, 1, ..., CONSUMERS - 1)."""
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
    if PP_NAMED:  # barrier ids, as int32 tensors of the row-vector layout (see _named_bar)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        turn_mine = (gl.full([WG_M], NAMED_BAR0 + WG, gl.int32, row_layout),
                     turn_zero.index(WG))
        turn_other = gl.full([WG_M], NAMED_BAR0 + (WG + 1) % CONSUMERS, gl.int32, row_layout)
        if PINGPONG and WG == CONSUMERS - 1:
            _turn_pass(None, turn_other, PP_NAMED)  # warpgroup 0 takes the first turn
    else:
        turn_mine = turn_bars.index(WG)
        turn_other = turn_bars.index((WG + 1) % CONSUMERS)

    if DYNAMIC:
        r0 = 0  # ring index of the current tile's first K/V tile
        tile_i = 0
        mbarrier.wait(q_bar, 0)
        t = _read_tile(tile_smem)
        while t < num_tiles:
            r0 += _consume_q_tile(t, r0, tile_i, WG, q, q_smem, k2, v2, q_bar, q_empty,
                                  k_ready, v_ready, kv_empty, turn_mine, turn_other, o_desc,
                                  o_ptr, lse_ptr, n_m, Sq, Sk, Hq, qk_scale, s_layout,
                                  o_layout, p_layout, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                                  OVERLAP, PINGPONG, UNROLL, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                                  PAIR_REDUCE, O_DIRECT, WG_TILES)
            tile_i += 1
            # The producer's next q_bar phase carries the next tile, or one past the end.
            mbarrier.wait(q_bar, tile_i & 1)
            t = _read_tile(tile_smem)
    elif PERSISTENT:
        r0 = 0
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        for t in range(pid, num_tiles, n_prog):
            r0 += _consume_q_tile(t, r0, (t - pid) // n_prog, WG, q, q_smem, k2, v2, q_bar,
                                  q_empty, k_ready, v_ready, kv_empty, turn_mine, turn_other,
                                  o_desc, o_ptr, lse_ptr, n_m, Sq, Sk, Hq, qk_scale, s_layout,
                                  o_layout, p_layout, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                                  OVERLAP, PINGPONG, UNROLL, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                                  PAIR_REDUCE, O_DIRECT, WG_TILES)
    else:  # one tile per CTA: no tile loop, nothing carried across tiles
        _consume_q_tile(gl.program_id(0), 0, 0, WG, q, q_smem, k2, v2, q_bar, q_empty, k_ready,
                        v_ready, kv_empty, turn_mine, turn_other, o_desc, o_ptr, lse_ptr, n_m,
                        Sq, Sk, Hq, qk_scale, s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N,
                        D, STAGES, CAUSAL, OVERLAP, PINGPONG, UNROLL, PIN_PV_WAIT, PP_SOFTMAX,
                        PP_NAMED, PAIR_REDUCE, O_DIRECT, WG_TILES)


@gluon.jit
def _produce_q_tile(t, r0, tile_i, q_desc, k_desc, v_desc, q_bufs, k_smem, v_smem,
                    q_bar, q_empty, k_ready, v_ready, kv_empty, tile_smem, n_m, Sq, Sk, Hq,
                    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    CONSUMERS: gl.constexpr, DYNAMIC: gl.constexpr):
    """Loads for tile t: Q once (one 64-row box per consumer into q_bufs[i], all on one
    barrier, once every consumer is done with the previous tile's Q buffer), then K and V
    through the ring from r0 on. DYNAMIC: t is published in tile_smem before the Q load,
    whose barrier tells the consumers (they read it after q_bar)."""
    start_m, off_b, off_h = _tile_coords(t, n_m, Hq, CAUSAL)
    off_hkv = off_h // GROUP
    m0 = start_m * BLOCK_M
    # A fresh barrier's "previous phase" counts as complete, so the first waits pass.
    mbarrier.wait(q_empty, (tile_i & 1) ^ 1)
    if DYNAMIC:
        # Every consumer has read the previous index (they read it before releasing Q).
        _publish_tile(tile_smem, t)
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, m0, off_h * D], q_bar, q_bufs[0])
    for i in gl.static_range(1, CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [off_b, m0 + i * WG_M, off_h * D], q_bar,
                                        q_bufs[i])
    n_full, n_total = _tile_counts(start_m, Sq, Sk, BLOCK_M, BLOCK_N, CAUSAL)
    for j in range(n_total):
        r = r0 + j
        s = r % STAGES
        mbarrier.wait(kv_empty.index(s), ((r // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, j * BLOCK_N, off_hkv * D],
                                        k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, j * BLOCK_N, off_hkv * D],
                                        v_ready.index(s), v_smem.index(s))
    return n_total


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_smem, v_smem, q_bar, q_empty,
              k_ready, v_ready, kv_empty, tile_smem, tile_counter, n_m, num_tiles, Sq, Sk, Hq,
              GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr, DYNAMIC: gl.constexpr):
    """The TMA producer warp: the loads of each tile the CTA takes, in the consumers' order.

    DYNAMIC: after its first tile (pid) a CTA claims the next one from a global counter
    (zeroed by the launcher), so CTAs that drew short causal tiles take more of them; the
    tiles keep the non-persistent order (row blocks of a head together, the longest first),
    the order the hardware block scheduler would have dealt them in."""
    if DYNAMIC:
        r0 = 0
        tile_i = 0
        n_prog = gl.num_programs(0)
        t = gl.program_id(0)
        while t < num_tiles:
            r0 += _produce_q_tile(t, r0, tile_i, q_desc, k_desc, v_desc, q_bufs, k_smem,
                                  v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, tile_smem,
                                  n_m, Sq, Sk, Hq, GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                                  CONSUMERS, DYNAMIC)
            tile_i += 1
            # Claimed once this tile's loads are issued: STAGES tiles before the consumers
            # release Q, so the atomic's latency is off the critical path.
            t = n_prog + gl.atomic_add(tile_counter, 1)
        # No tile left: one more q_bar phase, with no bytes, carries the end to the consumers.
        mbarrier.wait(q_empty, (tile_i & 1) ^ 1)
        _publish_tile(tile_smem, t)
        mbarrier.arrive(q_bar)
    elif PERSISTENT:
        r0 = 0
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        for t in range(pid, num_tiles, n_prog):
            r0 += _produce_q_tile(t, r0, (t - pid) // n_prog, q_desc, k_desc, v_desc, q_bufs,
                                  k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                                  tile_smem, n_m, Sq, Sk, Hq, GROUP, BLOCK_M, BLOCK_N, D,
                                  STAGES, CAUSAL, CONSUMERS, DYNAMIC)
    else:
        _produce_q_tile(gl.program_id(0), 0, 0, q_desc, k_desc, v_desc, q_bufs, k_smem, v_smem,
                        q_bar, q_empty, k_ready, v_ready, kv_empty, tile_smem, n_m, Sq, Sk, Hq,
                        GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL, CONSUMERS, DYNAMIC)


@gluon.jit
def attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, lse_ptr, tile_counter, B, Sq, Sk,
                    Hq, qk_scale, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, UNROLL: gl.constexpr,
                    PERSISTENT: gl.constexpr, PIN_PV_WAIT: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    CONSUMERS: gl.constexpr = 2, DYNAMIC: gl.constexpr = False,
                    O_DIRECT: gl.constexpr = False, WG_TILES: gl.constexpr = True,
                    PP_SOFTMAX: gl.constexpr = False, PP_NAMED: gl.constexpr = False,
                    PAIR_REDUCE: gl.constexpr = False):
    """1-D grid over tiles (row block, batch, head): one tile per CTA, or fewer CTAs than
    tiles (persistent), each striding over them. q/o descriptors are [B, Sq, Hq * D] with
    box [1, 64, D]; k/v are [B, Sk, Hkv * D] with box [1, BLOCK_N, D]; GROUP = Hq // Hkv.
    CONSUMERS (2 or 3) consumer warpgroups of 64 rows each: BLOCK_M = 64 * CONSUMERS.
    o_ptr is O itself ([B, Sq, Hq, D] contiguous) for O_DIRECT; tile_counter an int32 zero
    for DYNAMIC (a persistent launch that claims tiles from it)."""
    gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "two or three consumer warpgroups")
    gl.static_assert(BLOCK_M == CONSUMERS * WG_M, "consumer warpgroups of 64 rows each")
    gl.static_assert(PERSISTENT or not DYNAMIC, "DYNAMIC is a persistent schedule")
    dtype: gl.constexpr = q_desc.dtype
    n_m = gl.cdiv(Sq, BLOCK_M)
    num_tiles = n_m * B * Hq

    q0_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    q1_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    tile_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if PP_NAMED:  # one zeroed fp32 row per consumer (see _turn_wait)
        turn_zero = gl.allocate_shared_memory(gl.float32, [CONSUMERS, WG_M],
                                              gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(CONSUMERS):
            turn_zero.index(i).store(gl.zeros([WG_M], gl.float32, gl.BlockedLayout(
                [1], [32], [gl.num_warps()], [0])))
    else:
        turn_zero = tile_smem  # not read
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=CONSUMERS)  # every consumer warpgroup is done with its Q
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer releases a slot
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(turn_bars.index(i), count=1)
    if PINGPONG and not PP_NAMED:
        mbarrier.arrive(turn_bars.index(0))  # warpgroup 0 takes the first turn

    # The argument lists are spelled out per partition: a tuple built once and joined with
    # `+` loses its constexpr members in Triton 3.6's frontend (D, BLOCK_N... become run-time
    # values and the consumers' layouts fail to build), so it cannot be shared.
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q0_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, turn_zero, tile_smem, o_desc, o_ptr, lse_ptr, n_m,
                         num_tiles, Sq, Sk, Hq, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         OVERLAP, PINGPONG, UNROLL, PERSISTENT, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                         PAIR_REDUCE, CONSUMERS, DYNAMIC, O_DIRECT, WG_TILES)),
            (_consumer, (1, q1_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, turn_zero, tile_smem, o_desc, o_ptr, lse_ptr, n_m,
                         num_tiles, Sq, Sk, Hq, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         OVERLAP, PINGPONG, UNROLL, PERSISTENT, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                         PAIR_REDUCE, CONSUMERS, DYNAMIC, O_DIRECT, WG_TILES)),
            (_producer, (q_desc, k_desc, v_desc, (q0_smem, q1_smem), k_smem, v_smem, q_bar,
                         q_empty, k_ready, v_ready, kv_empty, tile_smem, tile_counter, n_m,
                         num_tiles, Sq, Sk, Hq, GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PERSISTENT, CONSUMERS, DYNAMIC)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        q2_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        gl.warp_specialize([
            (_consumer, (0, q0_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, turn_zero, tile_smem, o_desc, o_ptr, lse_ptr, n_m,
                         num_tiles, Sq, Sk, Hq, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         OVERLAP, PINGPONG, UNROLL, PERSISTENT, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                         PAIR_REDUCE, CONSUMERS, DYNAMIC, O_DIRECT, WG_TILES)),
            (_consumer, (1, q1_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, turn_zero, tile_smem, o_desc, o_ptr, lse_ptr, n_m,
                         num_tiles, Sq, Sk, Hq, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         OVERLAP, PINGPONG, UNROLL, PERSISTENT, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                         PAIR_REDUCE, CONSUMERS, DYNAMIC, O_DIRECT, WG_TILES)),
            (_consumer, (2, q2_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                         kv_empty, turn_bars, turn_zero, tile_smem, o_desc, o_ptr, lse_ptr, n_m,
                         num_tiles, Sq, Sk, Hq, qk_scale, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         OVERLAP, PINGPONG, UNROLL, PERSISTENT, PIN_PV_WAIT, PP_SOFTMAX, PP_NAMED,
                         PAIR_REDUCE, CONSUMERS, DYNAMIC, O_DIRECT, WG_TILES)),
            (_producer, (q_desc, k_desc, v_desc, (q0_smem, q1_smem, q2_smem), k_smem, v_smem,
                         q_bar, q_empty, k_ready, v_ready, kv_empty, tile_smem, tile_counter,
                         n_m, num_tiles, Sq, Sk, Hq, GROUP, BLOCK_M, BLOCK_N, D, STAGES, CAUSAL,
                         PERSISTENT, CONSUMERS, DYNAMIC)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
