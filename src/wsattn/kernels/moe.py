"""Mixture-of-experts decode: routing, grouping by expert, grouped expert FFN, combine.

For T = 1..64 tokens x [T, H], E experts of FFN width F, top-k routing:

    route      logits = x @ router_w^T (fp32, FlashNorm scale optional), softmax or
               sigmoid, top-k (optionally DeepSeek-V3's: a selection bias and groups),
               optional renormalisation, a scale       -> weights [T, k], ids [T, k]
    group      a counting sort of the T*k (token, slot) pairs by expert, each expert's
               rows padded to a multiple of `block`           -> Grouping
    gate_up    per touched expert: act = silu(x_e @ Wg_e^T) * (x_e @ Wu_e^T)
    down       per pair: y[p] = weight[p] * (act[p] @ Wd_e^T), written by pair (fp32)
    combine    out[t] = residual[t] + sum over slots j of y[t*k + j], in slot order

Everything runs on the device with static shapes (no host read of a routing result), so
a step with it can be captured in one CUDA graph: the grouping's sizes are upper bounds
(rows_max = blocks_max * block), the number of blocks actually used is a device tensor,
and programs of blocks past it exit at once.

Decode reads each touched expert's weights once and does little arithmetic with them,
so the grouped kernels are the dense GEMV (gemv.py) per expert: a program owns BLOCK_N
weight rows of one expert and streams them once for the block's `block` rows of
activations; FMA reduction for blocks of <= 4 rows, tl.dot with the weight tile as the
MMA's M operand ("swap AB") for blocks of >= 16. Only touched experts' weights are read:
a block belongs to exactly one expert, and experts with no pair own no block.

Determinism: no float atomics anywhere. The grouping is a stable counting sort in one
launch (pairs of an expert in ascending token order; each of its programs counts every
pair itself, integer counts, and writes its own pairs' rows), every output element is
written by one program, and the combine adds a token's k pair results in slot order, so
two runs on the same inputs are bit-identical.

Tie and NaN rule of the router (torch.topk leaves the order of equal values unspecified:
on the CPU it returned indices [2, 4, 1] for three equal probabilities): the chosen
experts are those of ``torch.sort(scores, descending=True, stable=True)[:, :k]``: the
higher score first, equal scores by lower expert index, NaN above every number. The
kernels compare the fp32 logits, whose order softmax and sigmoid keep (scores rounded
to fp32 could tie where the logits do not). A NaN (or +inf) logit makes every softmax
probability of its token NaN, so that token gets ids 0..k-1 and NaN weights, and its
MoE output is NaN: the NaN propagates, nothing is dropped.

DeepSeek-V3 / dots.llm1 routing (transformers' DeepseekV3TopkRouter, Dots1TopkRouter),
sigmoid scoring only: score_bias (e_score_correction_bias) and groups / topk_groups
(n_group, topk_group) change what is chosen, scale (routed_scaling_factor) multiplies the
chosen weights after the renormalisation, which under sigmoid divides by (sum + 1e-20) as
transformers does. With a bias or groups the selection keys are sigmoid(logit) +
score_bias[e] in fp32 (the scores transformers compares, so the ties of their rounding
count), while the weights stay the unbiased sigmoid(logit). Groups: the experts split
into `groups` contiguous groups; a group's score is the sum of its two largest keys (a
duplicated max counts twice, as torch's .topk(2).sum()), the topk_groups best groups are
kept (equal scores: the lower group first) and the top_k are chosen among their experts
by the tie rule above. NaN there: a NaN logit's key is NaN, ranked above every number,
so its group scores +inf and ranks first (NaN-holding groups by lower index), the NaN
expert is chosen first and its NaN weight (all of them, renormalised) propagates to
the token's output, as under plain sigmoid. Without a bias and groups == 1 the keys are
the logits as above and the group step is compiled away (constexpr switches); scale is
a runtime argument (one multiply).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..target import Target, target_of
from ..testing import DTYPES, dtype_name
from ._alloc import empty
from ._overlap import check_distinct, overlaps, same_view
from ._intmath import cdiv, next_pow2
from ._precision import FP32_MAX, FP32_TINY, check_eps
from .gemv import accumulate


# --------------------------------------------------------------------------- kernels

# Router rows a program of the router-logits kernel takes: 4 rows of H = 2048 is 16 KB,
# 32 programs for 128 experts at T = 1 (one SM's bandwidth was the whole router's time).
ROUTER_BLOCK_E = 4
# Warps of the top-k kernel (one program a token) and of a grouping program.
# H200, side by side (scripts/device_moe_small_kernels.py): top-k over 128 experts 4.1 us at
# 4 warps, 2.3 at 1 (T 1 / 8 / 64: one warp's reductions need no shared memory or barrier),
# even over 8 experts. The grouping's histograms, scan and gather are warp-wide too: at one
# warp none of them crosses warps. Its programs of one warp took 1.9 us at T 8 and 3.1 at
# T 64 (128 experts), where one 4-warp program, a pass of block-wide reductions after
# another, took 5.7 and 24.3 (notes/moe.md).
ROUTE_NUM_WARPS = 1
GROUP_NUM_WARPS = 1


def _router_block_h(H: int) -> int:
    # up to [4, 2048] fp32 products (64 a thread at 4 warps): at H <= 2048 the whole slice
    # of the router weight is the tile loaded before the PDL wait, so after it only x's
    # load and the products remain (at 1024 the second half's load came after the wait)
    return max(16, min(next_pow2(H), 2048))


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, logits_ptr, H, E, eps, stride_xt, stride_we,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                          PDL: tl.constexpr):
    # grid (cdiv(E, BLOCK_E), T): BLOCK_E router rows against one token's x, so the router
    # weight streams through many SMs at once (one program a token, reading all of it,
    # took 32 us at the Qwen3-30B-A3B shape on the H200: one SM's worth of bandwidth)
    t = tl.program_id(1)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_live = e < E
    hh = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    rows = w_ptr + e.to(tl.int64)[:, None] * stride_we  # [BLOCK_E, 1]
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    ss = tl.zeros([BLOCK_H], dtype=tl.float32)
    # the router weight is never written during a step: its first tile may load before
    # the PDL wait; x is the previous kernel's output and loads after it
    w = tl.load(rows + hh[None, :], mask=e_live[:, None] & (hh < H)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the rule of gemv.py's _gemv_kernel
    xv = tl.load(x_ptr + t * stride_xt + hh, mask=hh < H, other=0.0).to(tl.float32)
    acc += w.to(tl.float32) * xv[None, :]
    ss += xv * xv
    for h0 in range(BLOCK_H, H, BLOCK_H):
        h = h0 + hh
        w = tl.load(rows + h[None, :], mask=e_live[:, None] & (h < H)[None, :], other=0.0)
        xv = tl.load(x_ptr + t * stride_xt + h, mask=h < H, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
        ss += xv * xv  # unused without NORM: compiled away
    logits = tl.sum(acc, axis=1)  # [BLOCK_E] fp32, never rounded to the model dtype
    if NORM:
        logits = logits * tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
    tl.store(logits_ptr + t * E + e, logits, mask=e_live)


@triton.jit
def _route_keys(logits, bias, e, e_live, E, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, BLOCK_E: tl.constexpr):
    """Selection keys of one token's fp32 logits [BLOCK_E] (e: the lanes' expert indices,
    e_live: the real experts), and their max. Shared by both top-k forms, so the group
    step is written once.

    Plain (no bias, no groups): softmax and sigmoid keep the logits' order, so the logits
    are the keys (comparing scores instead would add ties made by rounding them).
    BIAS or GROUPS > 1 (sigmoid only, DeepSeek-V3): the key is sigmoid(logit) + bias[e]
    in fp32, as transformers compares them (the bias changes the order, and a group's
    score sums scores, not logits); bias is the [BLOCK_E] e_score_correction_bias (any
    value without BIAS). TOPK_GROUPS < GROUPS: experts outside the TOPK_GROUPS groups of
    the highest scores (a group's score: the sum of its two largest keys; equal scores:
    the lower group first) get the key -inf, below every kept one (unless a bias of -inf
    ties them), and top_k <= TOPK_GROUPS * (E // GROUPS) leaves enough kept experts.

    NaN above every number (a NaN key becomes +inf, so the group holding it scores +inf
    and ranks first), padding below. Softmax: a NaN or +inf logit makes every probability
    NaN, so then every key is equal (ids 0..k-1 by the tie rule)."""
    if BIAS or GROUPS > 1:
        key = tl.sigmoid(logits)
        if BIAS:
            key = key + bias
    else:
        key = logits
    key = tl.where(key != key, float("inf"), key)
    key = tl.where(e_live, key, float("-inf"))
    if TOPK_GROUPS < GROUPS:
        # the group step on a [BLOCK_G, BLOCK_GS] tile of the keys, row g holding group g's
        # (gathered: E // GROUPS need not be a power of two, so no plain reshape), 2 *
        # BLOCK_E elements at any GROUPS; a [BLOCK_G, BLOCK_E] tile of masked rows spilled
        # at E 256 in 128 groups
        BLOCK_G: tl.constexpr = triton.next_power_of_2(GROUPS)
        BLOCK_GS: tl.constexpr = 2 * BLOCK_E // BLOCK_G  # >= E // GROUPS
        gs = E // GROUPS
        i = tl.arange(0, BLOCK_G * BLOCK_GS)
        gi = i // BLOCK_GS
        ji = i % BLOCK_GS
        real = (gi < GROUPS) & (ji < gs)
        kg = tl.gather(key, tl.where(real, gi * gs + ji, 0), 0)
        kg = tl.reshape(tl.where(real, kg, float("-inf")), [BLOCK_G, BLOCK_GS])
        j = tl.arange(0, BLOCK_GS)
        m1 = tl.max(kg, axis=1)  # [BLOCK_G]
        # the second largest: the max without one lane of the max (the lowest), so a
        # duplicated max counts twice as in torch's .topk(2).sum()
        i1 = tl.min(tl.where(kg == m1[:, None], j[None, :], BLOCK_GS), axis=1)
        m2 = tl.max(tl.where(j[None, :] == i1[:, None], float("-inf"), kg), axis=1)
        score = m1 + m2
        # NaN only as +inf + -inf (a NaN key, a bias of -inf): the group holds a NaN
        score = tl.where(score != score, float("inf"), score)
        # the TOPK_GROUPS best groups, a round of max a group (equal scores: the lower
        # index), as _route_kernel's top-k: a [BLOCK_G, BLOCK_G] rank spilled at 128 groups
        g = tl.arange(0, BLOCK_G)
        left = g < GROUPS
        kept = g < 0
        for _ in range(TOPK_GROUPS):
            sg = tl.where(left, score, float("-inf"))
            best = tl.min(tl.where(left & (sg == tl.max(sg, axis=0)), g, BLOCK_G), axis=0)
            kept = kept | (g == best)
            left = left & (g != best)
        # back to the experts' lanes (padding lanes, already -inf, read any group)
        keep = tl.gather(kept.to(tl.int32), tl.minimum(e // gs, BLOCK_G - 1), 0)
        key = tl.where(keep != 0, key, float("-inf"))
    m = tl.max(key, axis=0)
    if not SIGMOID:
        key = tl.where(m == float("inf"), tl.where(e_live, 0.0, float("-inf")), key)
    return key, m


@triton.jit
def _add6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5


@triton.jit
def _slot_sums(rank, slot, e, x, TOP_K: tl.constexpr):
    """One reduction over the lanes: (lanes of rank slot, lanes of rank < TOP_K, the
    slot's lane index, its x, the sum of x over rank < TOP_K, the sum of x)."""
    hit = rank == slot
    top = rank < TOP_K
    return tl.reduce((hit.to(tl.int32), top.to(tl.int32), tl.where(hit, e, 0),
                      tl.where(hit, x, 0.0), tl.where(top, x, 0.0), x), 0, _add6)


@triton.jit
def _slot_route(logits_ptr, bias_ptr, wts_ptr, ids_ptr, slot, E, scale, write,
                TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                SIGMOID: tl.constexpr, BIAS: tl.constexpr, GROUPS: tl.constexpr,
                TOPK_GROUPS: tl.constexpr):
    """The expert in top-k slot `slot` of one token, from its E fp32 logits, for a grouped
    program that needs only its own slot (moe_gate_up(..., route=)): every expert's rank
    counted at once over a [BLOCK_E, BLOCK_E] comparison of the keys (_route_keys),
    instead of top-k rounds of reductions. With `write`, also stores the slot's id and
    routing weight (times scale) for the down projection and combine that follow."""
    e = tl.arange(0, BLOCK_E)
    e_live = e < E
    logits = tl.load(logits_ptr + e, mask=e_live, other=0.0)
    bias = logits  # unread without BIAS
    if BIAS:
        bias = tl.load(bias_ptr + e, mask=e_live, other=0.0)
    key, m = _route_keys(logits, bias, e, e_live, E, SIGMOID, BIAS, GROUPS,
                         TOPK_GROUPS, BLOCK_E)
    if SIGMOID:
        # the unbiased scores: the bias only chooses
        x = tl.where(e_live, tl.sigmoid(logits), 0.0)
    else:
        x = tl.where(e_live, tl.exp(logits - m), 0.0)  # the softmax's numerators
    # rank[f] = lanes with a greater key, summed over axis 0: Triton lays the tile's lanes
    # along axis 1 across the threads, so this sum stays within each thread (over axis 1
    # it is a warp reduction a row)
    rank = tl.sum(tl.where(key[:, None] > key[None, :], 1, 0), axis=0)  # [BLOCK_E]
    n_hit, n_top, expert, x_hit, x_top, x_all = _slot_sums(rank, slot, e, x, TOP_K)
    if (n_hit != 1) | (n_top != TOP_K):
        # equal keys at or around this slot: the tie rule (the lower index first) adds
        # each lane's equal-keyed lanes of lower index; every rank is then distinct
        rank += tl.sum(tl.where((key[:, None] == key[None, :]) & (e[:, None] < e[None, :]),
                                1, 0), axis=0)
        n_hit, n_top, expert, x_hit, x_top, x_all = _slot_sums(rank, slot, e, x, TOP_K)
    if write:
        if RENORM:
            if SIGMOID:
                w = x_hit / (x_top + 1e-20)  # transformers' guard against a zero sum
            else:
                w = x_hit / x_top
        elif SIGMOID:
            w = x_hit
        else:
            w = x_hit / x_all
        if not SIGMOID:
            w = tl.where(m == float("inf"), float("nan"), w)  # every probability NaN
        tl.store(wts_ptr + slot, w * scale)
        tl.store(ids_ptr + slot, expert)
    return expert


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, wts_ptr, ids_ptr, E, scale, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr, RENORM: tl.constexpr,
                  SIGMOID: tl.constexpr, PDL: tl.constexpr, BIAS: tl.constexpr,
                  GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr):
    # grid (T,): one token's E fp32 logits (E <= 256) -> its top-k ids and weights
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_live = e < E
    bias = tl.zeros([BLOCK_E], dtype=tl.float32)  # unread without BIAS
    if BIAS:
        # a weight of the model, never written during a step: loads before the PDL wait
        bias = tl.load(bias_ptr + e, mask=e_live, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the logits come from the kernel before
        tl.extra.cuda.gdc_launch_dependents()
    logits = tl.load(logits_ptr + t * E + e, mask=e_live, other=0.0)
    key, m = _route_keys(logits, bias, e, e_live, E, SIGMOID, BIAS, GROUPS,
                         TOPK_GROUPS, BLOCK_E)
    if SIGMOID:
        p = tl.sigmoid(logits)  # the unbiased scores: the bias only chooses
    else:
        ex = tl.exp(tl.where(e_live, logits, float("-inf")) - m)
        p = ex / tl.sum(ex, axis=0)  # a NaN or +inf logit makes the sum, so every p, NaN
    kk = tl.arange(0, BLOCK_TK)  # [BLOCK_TK]
    sel_w = tl.zeros([BLOCK_TK], dtype=tl.float32)
    sel_i = tl.zeros([BLOCK_TK], dtype=tl.int32)
    avail = e >= 0  # lanes not chosen yet (keys span every float, so no key can mark them)
    for j in tl.static_range(TOP_K):
        kj = tl.where(avail, key, float("-inf"))
        best = tl.max(kj, axis=0)
        # the lower index of ties
        idx = tl.min(tl.where(avail & (kj == best), e, BLOCK_E), axis=0)
        pj = tl.sum(tl.where(e == idx, p, 0.0), axis=0)
        sel_w = tl.where(kk == j, pj, sel_w)
        sel_i = tl.where(kk == j, idx, sel_i)
        avail = avail & (e != idx)
    if RENORM:
        total = tl.sum(tl.where(kk < TOP_K, sel_w, 0.0), axis=0)
        if SIGMOID:
            total = total + 1e-20  # transformers' guard against a zero sum
        sel_w = sel_w / total
    tl.store(wts_ptr + t * TOP_K + kk, sel_w * scale, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, sel_i, mask=kk < TOP_K)


@triton.jit
def _group_kernel(ids_ptr, pairs_ptr, offs_ptr, counts_ptr, eob_ptr, nact_ptr,
                  P, E, ROWS, NB,
                  BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                  PAIRS: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr):
    # grid (cdiv(P, PAIRS),) of one warp each (_group_launch). Every program counts all
    # P = T*k pairs by expert itself, so programs share nothing and none waits for another;
    # then it places its own PAIRS pairs, one a lane. Nothing is reduced across lanes per
    # pair or per block: a [pairs, experts] one-hot summed over the experts costs a shuffle
    # tree for each pair (and across warps a barrier), which is what the one-program form
    # of four such passes spent its 5.7 us on at T = 8 (H200). What is left to cross lanes
    # is one scan and one sum over the experts and one gather.
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the ids come from the router kernel
        tl.extra.cuda.gdc_launch_dependents()
    c0 = pid * PAIRS  # this program's first pair
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_live = e < E
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # each expert's pairs before pair c0
    for q0 in range(0, P, BLOCK_P):
        q = q0 + tl.arange(0, BLOCK_P)  # [BLOCK_P]
        ids = tl.load(ids_ptr + q, mask=q < P, other=-1)
        live = (ids >= 0) & (ids < E)  # other ids join no expert
        # a warp histogram: a ballot per bit of the id and a popcount per bin. Triton ends
        # it with a shared-memory add into this program's own bins, at one warp each lane
        # into its own: no other program, no contention, integer sums (the same bits).
        counts += tl.histogram(ids, BLOCK_E, mask=live)
        before += tl.histogram(ids, BLOCK_E, mask=live & (q < c0))
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK  # [BLOCK_E]
    starts = tl.cumsum(padded, axis=0) - padded
    total = tl.sum(padded, axis=0)
    nact = total // BLOCK
    if pid == 0:  # the per-expert tables, which every program holds alike
        tl.store(offs_ptr + e, starts, mask=e_live)
        tl.store(counts_ptr + e, counts, mask=e_live)
        tl.store(offs_ptr + E, total)
        tl.store(nact_ptr, nact)
    # pair p goes to row starts[id] + (pairs of its expert before p): stable. The pairs
    # before this chunk are the second histogram; those in it, a [PAIRS, PAIRS] compare
    # whose pair axis stays inside each lane (the ids of the chunk are in every lane).
    j = tl.arange(0, PAIRS)  # [PAIRS]
    p = c0 + j
    idp = tl.load(ids_ptr + p, mask=p < P, other=-1)
    mine = (idp >= 0) & (idp < E)
    earlier = (idp[:, None] == idp[None, :]) & (j[:, None] < j[None, :])  # [q, p]
    rank = tl.sum(earlier.to(tl.int32), axis=0)  # [PAIRS]
    # one gather of two fields, each < 2**15: rows_max <= 64*256 + 256*63 (MAX_T, MAX_E)
    packed = (starts + before) * 32768 + (counts - before)
    got = tl.gather(packed, tl.where(mine, idp, 0), 0)
    row = (got >> 15) + rank
    left = (got & 32767) - rank  # pairs of its expert from p on
    tl.store(pairs_ptr + row, p, mask=mine)
    # written where they are known, so no search over experts: a block's expert by the
    # pair that opens it (expert starts are multiples of BLOCK), an expert's padding (the
    # rest of its last block) by its last pair
    tl.store(eob_ptr + row // BLOCK, idp, mask=mine & (row % BLOCK == 0))
    pad = row[:, None] + 1 + tl.arange(0, BLOCK)[None, :]  # [PAIRS, BLOCK]
    block_end = row // BLOCK * BLOCK + BLOCK
    tl.store(pairs_ptr + pad, tl.full([PAIRS, BLOCK], -1, tl.int32),
             mask=(mine & (left == 1))[:, None] & (pad < block_end[:, None]))
    # the rows and blocks past the active ones: -1, a slice of them a program
    rr = tl.arange(0, TAIL)  # [TAIL]
    stride = tl.num_programs(0) * TAIL
    for r0 in range(pid * TAIL, ROWS, stride):
        r = r0 + rr
        tl.store(pairs_ptr + r, tl.full([TAIL], -1, tl.int32), mask=(r >= total) & (r < ROWS))
    for b0 in range(pid * TAIL, NB, stride):
        b = b0 + rr
        tl.store(eob_ptr + b, tl.full([TAIL], -1, tl.int32), mask=(b >= nact) & (b < NB))


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, pairs_ptr, eob_ptr, nact_ptr, wts_ptr, out_ptr,
                    logits_ptr, bias_ptr, NOUT, K, E, eps, scale, stride_xt, stride_we,
                    stride_wn, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, GATE_UP: tl.constexpr,
                    NORM: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr = 1,
                    ROUTE: tl.constexpr = False, BLOCK_E: tl.constexpr = 16,
                    RENORM: tl.constexpr = False, SIGMOID: tl.constexpr = False,
                    BIAS: tl.constexpr = False, GROUPS: tl.constexpr = 1,
                    TOPK_GROUPS: tl.constexpr = 1):
    # grid (blocks_max, cdiv(NOUT, BLOCK_N)). One block of BLOCK_M grouped rows (one
    # expert), BLOCK_N output columns (weight rows of that expert).
    # GATE_UP: x = the tokens' hidden states gathered through the pairs, W = [E, 2F, H],
    #   out = act [rows, F] by grouped row: silu(gate) * up (FlashNorm scale with NORM).
    #   ROUTE (one token, one block a slot): block b's expert is the token's top-k slot b,
    #   selected here from the router logits (logits_ptr, E of them) instead of read from
    #   eob_ptr; the pid_n == 0 program writes it there and the slot's weight to wts_ptr
    #   (bias_ptr, scale, BIAS, GROUPS, TOPK_GROUPS: the DeepSeek-V3 routing, _route_keys).
    # else (down): x = act by grouped row, W = [E, H, F], out = per-pair results
    #   [T*k, H] fp32 by pair index, times the pair's routing weight.
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL:
        # Unlike a dense GEMV, even the weights wait: which expert's rows to read is the
        # grouping kernel's output. PDL still hides this grid's launch behind the last one.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if b >= tl.load(nact_ptr):
        return  # a block past the active ones: static grid, nothing to do
    if ROUTE:
        ex = _slot_route(logits_ptr, bias_ptr, wts_ptr, eob_ptr, b, E, scale, pid_n == 0,
                         TOP_K, BLOCK_E, RENORM, SIGMOID, BIAS, GROUPS,
                         TOPK_GROUPS).to(tl.int64)
    else:
        ex = tl.load(eob_ptr + b).to(tl.int64)
    mi = tl.arange(0, BLOCK_M)
    r = b * BLOCK_M + mi  # [BLOCK_M] grouped rows
    pair = tl.load(pairs_ptr + r)  # [BLOCK_M], -1 on padding rows
    m_live = pair >= 0
    if GATE_UP:
        xoff = tl.where(m_live, pair // TOP_K, 0).to(tl.int64) * stride_xt
    else:
        xoff = r.to(tl.int64) * stride_xt
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_live = n < NOUT
    wbase = w_ptr + ex * stride_we
    g_rows = wbase + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    u_rows = wbase + (n + NOUT).to(tl.int64)[:, None] * stride_wn  # up rows (GATE_UP)
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    # STAGES asked of the loop itself so the FMA path's weight loads are pipelined too
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        k_live = k < K
        wmask = n_live[:, None] & k_live[None, :]
        wg = tl.load(g_rows + k[None, :], mask=wmask, other=0.0)  # [BLOCK_N, BLOCK_K]
        wu = wg
        if GATE_UP:
            wu = tl.load(u_rows + k[None, :], mask=wmask, other=0.0)
        acc_g, acc_u, ss = accumulate(acc_g, acc_u, ss, wg, wu, x_ptr, xoff, m_live, 0, 0, k,
                                      k_live, BLOCK_M, USE_DOT, NORM, GATE_UP, True)
    mask = n_live[:, None] & m_live[None, :]  # [BLOCK_N, BLOCK_M]
    if GATE_UP:
        gate = acc_g
        up = acc_u
        if NORM:
            rstd = tl.rsqrt(ss / K + eps)[None, :]
            gate = gate * rstd
            up = up * rstd
        y = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + r.to(tl.int64)[None, :] * stride_ot + n[:, None],
                 y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        wt = tl.load(wts_ptr + pair, mask=m_live, other=0.0)  # [BLOCK_M] fp32
        y = acc_g * wt[None, :]
        tl.store(out_ptr + pair.to(tl.int64)[None, :] * stride_ot + n[:, None], y, mask=mask)


@triton.jit
def _combine_kernel(y_ptr, res_ptr, out_ptr, H, stride_yp, stride_rt, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, RESIDUAL: tl.constexpr,
                    PDL: tl.constexpr):
    # grid (T, cdiv(H, BLOCK_H)): out[t] = residual[t] + y[t*k] + ... + y[t*k + k-1],
    # in that order, fp32, one rounding
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < H
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if RESIDUAL:
        # read and written by the same program element for element: out may be residual
        acc += tl.load(res_ptr + t * stride_rt + h, mask=live, other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * stride_yp + h, mask=live,
                       other=0.0)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=live)


# --------------------------------------------------------------------------- settings

MAX_T = 64  # tokens a call takes; more is a prefill-sized grouped GEMM
MAX_E = 256  # router logits of one token held in one program's registers
FMA_BLOCKS = (1, 2, 4)  # grouping blocks served by the FMA reduction (no M padding)
DOT_BLOCKS = (16, 32, 64)  # grouping blocks served by tl.dot (its minimum is 16)
GROUP_PAIRS = 32  # pairs a grouping program places: one a lane of its warp
GROUP_CHUNK = 512  # ids a step of the grouping kernel's count loop reads (16 a lane)
GROUP_TAIL = 1024  # rows past the last expert's a store of the grouping kernel writes
COMBINE_BLOCK_H = 1024
# Up to COMBINE_NARROW_T tokens, the combine takes 128 columns a program at one warp (16
# programs a token at H 2048) instead of 1024 at four: at 1024 one token's combine ran on
# 2 SMs (Qwen3-30B-A3B B1: 2.8 us a layer of critical time against 1.3 for the decode
# split combine's 128 programs).
COMBINE_NARROW_T = 8
ROW_BYTES = 256  # bytes of a weight row a dot tile covers (as gemv.py)
FMA_TILE_ELEMS = 4096  # weight elements of an FMA tile (16-bit; half for fp32)
STAGE_BUDGET = 96 * 1024
MAX_STAGES = 6


@dataclass(frozen=True)
class MoeSettings:
    """Launch settings of the grouped expert kernels (see default_settings).

    block: rows of a grouping block = BLOCK_M of the grouped kernels; each expert's
    pairs are padded to a multiple of it. 1, 2, 4 use the FMA path, 16, 32, 64 tl.dot.
    BLOCK_N: weight rows (output columns) a program streams; BLOCK_K: K a tile.
    num_warps / num_stages: as in triton.
    """
    block: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_block(self.block, "MoeSettings.block")
        for name in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoeSettings.{name} must be a positive int, got {value!r}")
        for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"MoeSettings.{name} must be a power of two, got {value}")
        if self.use_dot and (self.BLOCK_N < 16 or self.BLOCK_K < 16):
            raise ValueError("MoeSettings with a tl.dot block (>= 16) need BLOCK_N and "
                             f"BLOCK_K >= 16, got {self.BLOCK_N}, {self.BLOCK_K}")

    @property
    def use_dot(self) -> bool:
        return self.block >= 16


def default_block(T: int, top_k: int, num_experts: int) -> int:
    """Rows a grouping block: 16 (tl.dot, the weight tile as the MMA's M side) while the
    pairs per expert stay about 16 or fewer, 32 above. Too small a block splits an expert
    over several blocks, whose programs read its weights again (from L2 if they run
    together); too large pads. The FMA blocks (1, 2, 4: no padding to 16) measured slower
    at every shape, so only explicit settings take them: H200, one layer, us, FMA default
    -> block 16 (BLOCK_N 64, BLOCK_K 128, 4 stages): Qwen3-30B-A3B B1 71.8 -> 66.3, B8
    235.7 -> 179.9, B32 484.8 -> 341.4; Mixtral-8x7B B1 230.3 -> 181.6, B8 932.3 -> 501.9
    (notes/moe.md)."""
    mean = T * top_k / num_experts
    return 16 if mean <= 16 else 32


@functools.lru_cache(maxsize=1024)
def default_settings(target: Target, *, T: int, top_k: int, num_experts: int,
                     dtype: torch.dtype, block: int | None = None) -> MoeSettings:
    """Settings from (target, T, top_k, E, dtype), for default_block's block unless one
    is given. The tiles follow gemv.py's memory-bound choices: 256 bytes of a weight row
    a dot tile, 8 KB of 16-bit weight an FMA tile, as many pipeline stages as fit 96 KB
    of shared memory."""
    if block is None:
        block = default_block(T, top_k, num_experts)
    if target.backend == "interpreter":
        # small tiles so that small test shapes cross several tiles and masks
        return MoeSettings(block=block, BLOCK_N=32 if block >= 16 else 16,
                           BLOCK_K=32, num_warps=4, num_stages=1)
    elem = torch.empty((), dtype=dtype).element_size()
    if block >= 16:
        block_n = 64
        block_k = ROW_BYTES // elem
    else:
        block_n = 32
        block_k = FMA_TILE_ELEMS * 2 // elem // block_n
    stage_bytes = (2 * block_n + block) * block_k * elem
    stages = max(2, min(MAX_STAGES, STAGE_BUDGET // stage_bytes))
    if block == 16 and 90 <= target.cc < 120 and elem == 2:
        # 4 stages of 37 KB (one program an SM of sm_90/sm_100's 228 KB): the measured
        # block-16 settings above (the budget rule gives 2; at Mixtral B32 they ran alike)
        stages = 4
    return MoeSettings(block=block, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                       num_stages=stages)


def _check_block(block, name="block"):
    if isinstance(block, bool) or not isinstance(block, int) \
            or block not in FMA_BLOCKS + DOT_BLOCKS:
        raise ValueError(f"{name} must be one of {FMA_BLOCKS + DOT_BLOCKS}, got {block!r}")


def blocks_max(T: int, top_k: int, num_experts: int, block: int) -> int:
    """Upper bound on the grouping's blocks: sum over the A <= min(E, T*k) touched
    experts of cdiv(count, block) <= (T*k + A*(block-1)) / block."""
    pairs = T * top_k
    return (pairs + min(num_experts, pairs) * (block - 1)) // block


class Grouping(NamedTuple):
    """The (token, slot) pairs of one step grouped by expert, all on the device.

    sorted_pairs: int32 [rows_max], rows_max = blocks_max * block: grouped row r holds
        pair p = t * top_k + j (token t's slot j), or -1 on a padding row. Expert e owns
        rows [expert_offsets[e], expert_offsets[e+1]), its pairs first, ascending token.
    expert_offsets: int32 [E + 1], padded start rows (expert_offsets[E] = rows used).
    expert_of_block: int32 [blocks_max], the expert of block b (rows b*block..), -1 past
        the active blocks.
    num_active_blocks: int32 [1], expert_offsets[E] / block.
    expert_counts: int32 [E], pairs per expert.
    block, top_k, num_experts: the Python ints it was built with.
    tokens: T, the tokens whose pairs it groups (the launchers check x, topk_weights,
        residual and out against it: a row past T would be read or written out of
        bounds).

    one_token_grouping's groupings (one token, no kernel) keep one block a slot in slot
    order instead of expert order and have no expert_offsets / expert_counts (None); the
    grouped kernels read only sorted_pairs, expert_of_block and num_active_blocks.
    """
    sorted_pairs: torch.Tensor
    expert_offsets: torch.Tensor
    expert_of_block: torch.Tensor
    num_active_blocks: torch.Tensor
    expert_counts: torch.Tensor
    block: int
    top_k: int
    num_experts: int
    tokens: int


# --------------------------------------------------------------------------- launchers

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SCORINGS = ("softmax", "sigmoid")


def _resolve_pdl(pdl, device):
    if pdl is not None and not isinstance(pdl, bool):
        raise TypeError(f"pdl must be None or a bool, got {pdl!r}")
    target = target_of(device)
    has_pdl = target.backend == "cuda" and target.cc >= 90
    if pdl and not has_pdl:
        raise ValueError(f"pdl=True needs a CUDA GPU of sm_90 or later; this call runs on "
                         f"{target.name}")
    if target.backend == "interpreter":
        from .._triton_compat import patch_interpreter
        patch_interpreter()
    return target, has_pdl if pdl is None else pdl


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    T, H = x.shape
    if not 1 <= T <= MAX_T:
        raise ValueError(f"x has T={T} tokens; the MoE decode kernels take 1..{MAX_T}")
    if H == 0 or x.stride(1) != 1:
        raise ValueError(f"x needs H >= 1 and a contiguous last dimension, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    return T, H


def _check_norm_eps(norm_eps):
    if norm_eps is not None:
        check_eps("norm_eps", norm_eps)


def _check_grouping(grouping, device):
    if not isinstance(grouping, Grouping):
        raise TypeError(f"grouping must be the Grouping that group() returns, got "
                        f"{type(grouping).__name__}")
    if grouping.sorted_pairs.device != device:
        raise ValueError(f"grouping must be on {device}, got {grouping.sorted_pairs.device}")


def route(x, router_w, *, top_k, renormalize, norm_eps=None, scoring="softmax",
          score_bias=None, groups=1, topk_groups=1, scale=1.0, pdl=None):
    """Router: scores of the E experts per token, the top_k of them, their weights.

    Args:
        x: [T, H] hidden states, 1 <= T <= 64, float16 / bfloat16 / float32, last
            dimension contiguous.
        router_w: [E, H] router weight (nn.Linear layout), x's dtype, E <= 256. With
            norm_eps, the RMSNorm weight folded into its columns (FlashNorm).
        top_k: experts per token, 1 <= top_k <= E (num_experts_per_tok).
        renormalize: divide the chosen weights by their sum (Qwen3 norm_topk_prob,
            Mixtral always, OLMoE per its config; DeepSeek-V3 / dots.llm1 norm_topk_prob,
            under sigmoid as transformers does: w / (sum + 1e-20)).
        norm_eps: None, or the RMSNorm epsilon: logits scaled by rsqrt(mean(x^2) + eps).
        scoring: "softmax" over the E fp32 logits, or "sigmoid" per logit.
        score_bias: None, or float32 [E] on x's device, contiguous: the DeepSeek-V3 /
            dots.llm1 router's e_score_correction_bias (scoring "sigmoid" only). It moves
            the choice only: experts are chosen by sigmoid(logit) + score_bias[e] (fp32),
            the chosen weights are the unbiased sigmoid(logit).
        groups, topk_groups: group-limited routing (config n_group, topk_group; 1, 1 =
            none). The E experts are split into `groups` contiguous groups of E // groups
            (>= 2); a group scores the sum of its two largest selection keys (a
            duplicated max counts twice), only the topk_groups best groups (equal scores:
            the lower group) keep their experts, and the top_k are chosen among those.
            groups > 1 needs scoring "sigmoid", E % groups == 0 and top_k <= topk_groups
            * (E // groups).
        scale: positive finite float multiplied into the chosen weights after the
            renormalisation (routed_scaling_factor).
        pdl: programmatic dependent launch (sm_90+); None = where available.

    Returns:
        (topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]), highest selection
        key first. Logits are accumulated and kept in fp32 (never rounded to x's dtype).
        Ties and NaN: see the module docstring (stable descending sort; a NaN logit
        gives its token ids 0..k-1 and NaN weights under softmax, and is chosen first
        with a NaN weight under sigmoid).

    Raises:
        ValueError / TypeError naming the argument, before any launch.

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> x = torch.randn(3, 64); rw = torch.randn(8, 64)
        >>> w, ids = route(x, rw, top_k=2, renormalize=True)   # [3, 2] each
        >>> b = torch.zeros(8)  # DeepSeek-V3 style: 4 groups of 2, the best 2 kept
        >>> w, ids = route(x, rw, top_k=2, renormalize=True, scoring="sigmoid",
        ...                score_bias=b, groups=4, topk_groups=2, scale=2.5)
    """
    x, router_w, logits, pdl = _router_logits(x, router_w, top_k, renormalize, norm_eps,
                                              scoring, pdl, score_bias, groups, topk_groups,
                                              scale)
    T, E = logits.shape
    wts = empty((T, top_k), torch.float32, x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    launch = {"launch_pdl": True} if pdl else {}
    _route_kernel[(T,)](
        logits, logits if score_bias is None else score_bias, wts, ids, E, float(scale),
        TOP_K=top_k, BLOCK_E=_route_block_e(E), BLOCK_TK=next_pow2(top_k),
        RENORM=renormalize, SIGMOID=scoring == "sigmoid", PDL=pdl,
        BIAS=score_bias is not None, GROUPS=groups, TOPK_GROUPS=topk_groups,
        num_warps=ROUTE_NUM_WARPS, **launch)
    return wts, ids


def _route_block_e(E: int) -> int:
    return max(16, next_pow2(E))


def _check_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_ds_routing(E, top_k, scoring, score_bias, groups, topk_groups, scale, device):
    """ValueError / TypeError naming the argument unless score_bias, groups, topk_groups
    and scale are a routing route() can run for E experts (see route)."""
    if score_bias is not None:
        if scoring != "sigmoid":
            raise ValueError(f"score_bias (e_score_correction_bias) needs scoring='sigmoid', "
                             f"got scoring={scoring!r}")
        if not isinstance(score_bias, torch.Tensor):
            raise TypeError(f"score_bias must be None or a torch.Tensor, got "
                            f"{type(score_bias).__name__}")
        if score_bias.dtype != torch.float32:
            raise TypeError(f"score_bias must be float32, got {score_bias.dtype}")
        if tuple(score_bias.shape) != (E,):
            raise ValueError(f"score_bias must be [E={E}], got {tuple(score_bias.shape)}")
        if score_bias.device != device:
            raise ValueError(f"score_bias must be on x's device {device}, got "
                             f"{score_bias.device}")
        if not score_bias.is_contiguous():
            raise ValueError("score_bias must be contiguous")
    _check_int("groups", groups)
    _check_int("topk_groups", topk_groups)
    if groups < 1 or E % groups:
        raise ValueError(f"groups must be a divisor of E={E} (>= 1), got {groups}")
    if groups > 1:
        if E // groups < 2:
            raise ValueError(f"groups={groups} leaves E // groups = {E // groups} expert a "
                             f"group; a group scores its two largest, so it needs >= 2")
        if scoring != "sigmoid":
            raise ValueError(f"groups > 1 (group-limited routing) needs scoring='sigmoid', "
                             f"got scoring={scoring!r}")
    if not 1 <= topk_groups <= groups:
        raise ValueError(f"topk_groups must be in 1..groups={groups}, got {topk_groups}")
    if top_k > topk_groups * (E // groups):
        raise ValueError(f"top_k={top_k} exceeds the experts of the kept groups: "
                         f"topk_groups * (E // groups) = {topk_groups * (E // groups)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not FP32_TINY <= scale <= FP32_MAX:
        # an fp32 kernel argument: past fp32's range it would be inf (or 0)
        raise ValueError(f"scale (routed_scaling_factor) must be a positive finite float in "
                         f"fp32's normal range [{FP32_TINY:.4e}, {FP32_MAX:.4e}], got {scale!r}")


def _check_router(x, router_w, top_k, renormalize, norm_eps, scoring, score_bias, groups,
                  topk_groups, scale):
    """route()'s checks (ValueError / TypeError naming the argument): (T, H, E)."""
    T, H = _check_x(x)
    if not isinstance(router_w, torch.Tensor) or router_w.dim() != 2:
        raise ValueError("router_w must be a [E, H] torch.Tensor")
    E = router_w.shape[0]
    if router_w.shape[1] != H:
        raise ValueError(f"router_w must be [E, H={H}], got {tuple(router_w.shape)}")
    if router_w.dtype != x.dtype:
        raise TypeError(f"router_w dtype must match x ({x.dtype}), got {router_w.dtype}")
    if router_w.device != x.device:
        raise ValueError(f"router_w must be on x's device {x.device}, got {router_w.device}")
    if router_w.stride(1) != 1:
        raise ValueError("router_w needs a contiguous last dimension")
    if not 1 <= E <= MAX_E:
        raise ValueError(f"router_w has E={E} experts; route takes 1..{MAX_E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in 1..E={E}, got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {renormalize!r}")
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring must be one of {_SCORINGS}, got {scoring!r}")
    _check_ds_routing(E, top_k, scoring, score_bias, groups, topk_groups, scale, x.device)
    _check_norm_eps(norm_eps)
    return T, H, E


def _router_logits(x, router_w, top_k, renormalize, norm_eps, scoring, pdl, score_bias=None,
                   groups=1, topk_groups=1, scale=1.0):
    """route()'s checks (_check_router), then the router-logits launch: (x, router_w as
    launched, logits fp32 [T, E], pdl resolved)."""
    T, H, E = _check_router(x, router_w, top_k, renormalize, norm_eps, scoring, score_bias,
                            groups, topk_groups, scale)
    target, pdl = _resolve_pdl(pdl, x.device)
    if target.backend == "interpreter" and x.dtype == torch.bfloat16:
        x, router_w = x.float(), router_w.float()  # numpy has no bf16 arithmetic
    logits = empty((T, E), torch.float32, x.device)
    launch = {"launch_pdl": True} if pdl else {}
    _router_logits_kernel[(cdiv(E, ROUTER_BLOCK_E), T)](
        x, router_w, logits, H, E, float(norm_eps or 0.0), x.stride(0), router_w.stride(0),
        BLOCK_E=ROUTER_BLOCK_E, BLOCK_H=_router_block_h(H), NORM=norm_eps is not None,
        PDL=pdl, num_warps=4, **launch)
    return x, router_w, logits, pdl


class LogitsRoute(NamedTuple):
    """route_logits' result: one token's router logits and the buffers its routing goes
    to. weights (float32 [1, top_k]) and ids (int32 [1, top_k]) hold nothing until the
    moe_gate_up call given this route (route=) has run: its programs select the top-k
    from logits and write them, as route() would have. score_bias, groups, topk_groups
    and scale: route()'s arguments of the same names (the defaults: none of them)."""
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    top_k: int
    renormalize: bool
    sigmoid: bool
    score_bias: torch.Tensor | None = None
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0


def route_logits(x, router_w, *, top_k, renormalize, norm_eps=None, scoring="softmax",
                 score_bias=None, groups=1, topk_groups=1, scale=1.0, pdl=None):
    """route() for one token without its top-k launch: only the router logits are
    computed here; the top-k selection runs inside the grouped gate/up launch, each
    program selecting its own slot's expert (moe_gate_up(..., route=)). One launch fewer a
    MoE layer at one token; the same experts, in the same order, as route() (the same
    keys, group step and tie rule) and the same weights up to the order of the
    renormalising sum.

    Args: as route(), with x [1, H] (one token); score_bias, groups, topk_groups and
        scale (e_score_correction_bias, n_group, topk_group, routed_scaling_factor) are
        checked here and carried in the LogitsRoute for moe_gate_up to apply.

    Returns:
        a LogitsRoute. Use: ``r = route_logits(...)``, ``g = one_token_grouping(r.ids, E,
        block, tables)``, ``act = moe_gate_up(x, w_gate_up, g, route=r)``, then
        ``moe_down_combine(act, w_down, g, r.weights, ...)``.
    """
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] != 1:
        raise ValueError(f"x must be [1, H] (one token) for route_logits, got {tuple(x.shape)}")
    x, router_w, logits, pdl = _router_logits(x, router_w, top_k, renormalize, norm_eps,
                                              scoring, pdl, score_bias, groups, topk_groups,
                                              scale)
    wts = empty((1, top_k), torch.float32, x.device)
    ids = torch.empty((1, top_k), dtype=torch.int32, device=x.device)
    return LogitsRoute(logits, wts, ids, top_k, renormalize, scoring == "sigmoid",
                       score_bias, groups, topk_groups, float(scale))


def _group_launch(T: int, top_k: int, num_experts: int, block: int):
    """(grid, constexprs) of _group_kernel from the static shape alone (a graph captures
    it): one program a GROUP_PAIRS pairs, the count loop's tile the pairs' power of two up
    to GROUP_CHUNK (a warp histogram's cost is its elements, masked or not), and the rows
    past the active ones split evenly over the programs."""
    P = T * top_k
    programs = cdiv(P, GROUP_PAIRS)
    rows = blocks_max(T, top_k, num_experts, block) * block
    const = {"BLOCK": block, "BLOCK_E": max(16, next_pow2(num_experts)),
             "BLOCK_P": min(GROUP_CHUNK, max(GROUP_PAIRS, next_pow2(P))),
             "PAIRS": GROUP_PAIRS,
             "TAIL": min(GROUP_TAIL, max(32, next_pow2(cdiv(rows, programs))))}
    return (programs,), const


def group(topk_ids, num_experts, block, *, pdl=None):
    """Group the (token, slot) pairs by expert on the device (stable counting sort).

    Args:
        topk_ids: int32 [T, top_k] expert ids in [0, num_experts) (route's output),
            contiguous, 1 <= T <= 64. Ids outside that range are not checked (that
            would need a host read): such a pair joins no expert, so moe_down_combine
            never writes its row and that token's combined output is undefined (route()
            never makes such ids; ids from elsewhere are the caller's to keep in range).
        num_experts: E >= top_k.
        block: rows a block (MoeSettings.block): each expert's rows padded to a multiple.
        pdl: as in route.

    Returns:
        a Grouping (static sizes: rows_max = blocks_max(T, k, E, block) * block).

    Example:
        >>> g = group(torch.tensor([[3, 0], [3, 1]], dtype=torch.int32), 4, 1)
        >>> g.sorted_pairs    # expert 0: pair 1; expert 1: pair 3; expert 3: pairs 0, 2
        tensor([1, 3, 0, 2], dtype=torch.int32)
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError("topk_ids must be a [T, top_k] torch.Tensor")
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids must be int32, got {topk_ids.dtype}")
    if not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous")
    T, k = topk_ids.shape
    if not 1 <= T <= MAX_T:
        raise ValueError(f"topk_ids has T={T} tokens; the MoE decode kernels take 1..{MAX_T}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) \
            or not 1 <= num_experts <= MAX_E:
        raise ValueError(f"num_experts must be an int in 1..{MAX_E}, got {num_experts!r}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"topk_ids has top_k={k} columns; needs 1..num_experts={num_experts}")
    _check_block(block)
    _, pdl = _resolve_pdl(pdl, topk_ids.device)
    dev, E = topk_ids.device, num_experts
    nb = blocks_max(T, k, E, block)
    rows = nb * block
    pairs = torch.empty(rows, dtype=torch.int32, device=dev)
    offs = torch.empty(E + 1, dtype=torch.int32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    eob = torch.empty(nb, dtype=torch.int32, device=dev)
    nact = torch.empty(1, dtype=torch.int32, device=dev)
    launch = {"launch_pdl": True} if pdl else {}
    grid, const = _group_launch(T, k, E, block)
    _group_kernel[grid](topk_ids, pairs, offs, counts, eob, nact, T * k, E, rows, nb,
                        PDL=pdl, num_warps=GROUP_NUM_WARPS, **const, **launch)
    return Grouping(pairs, offs, eob, nact, counts, block, k, E, T)


def one_token_tables(top_k, block, device):
    """The constant part of a one-token grouping (see one_token_grouping): sorted_pairs
    int32 [top_k * block] with slot j at row j * block and -1 elsewhere, and
    num_active_blocks int32 [1] = top_k. Made once (a host-to-device copy, so before any
    graph capture) and passed to every step's one_token_grouping."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    _check_block(block)
    pairs = torch.full((top_k, block), -1, dtype=torch.int32)
    pairs[:, 0] = torch.arange(top_k, dtype=torch.int32)
    return pairs.view(-1).to(device), torch.tensor([top_k], dtype=torch.int32, device=device)


def one_token_grouping(topk_ids, num_experts, block, tables):
    """group()'s result for a single token, with no kernel: a token's top-k experts are
    distinct, so every expert it touches has exactly one pair, and block j can simply be
    slot j's (expert topk_ids[0, j], its one pair in row 0). The grouped kernels then run
    what they run on group()'s result, blocks in slot order instead of expert order, and
    give the same bits (each output element is still one program's, and the combine adds
    by slot). What is saved is group()'s launch.

    Args:
        topk_ids: int32 [1, top_k] (route's output for one token), contiguous.
        num_experts, block: as in group().
        tables: one_token_tables(top_k, block, device)'s pair.

    Returns:
        a Grouping whose expert_of_block is topk_ids itself (a view, so a captured graph
        reads each step's ids) and whose expert_offsets / expert_counts are None.
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != 1:
        raise ValueError("topk_ids must be a [1, top_k] torch.Tensor (one token)")
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise TypeError(f"topk_ids must be contiguous int32, got {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) \
            or not k <= num_experts <= MAX_E:
        raise ValueError(f"num_experts must be an int in top_k={k}..{MAX_E}, got {num_experts!r}")
    _check_block(block)
    pairs, nact = tables
    if pairs.shape != (k * block,) or nact.shape != (1,) or pairs.device != topk_ids.device:
        raise ValueError(f"tables must be one_token_tables(top_k={k}, block={block}) on "
                         f"{topk_ids.device}")
    return Grouping(pairs, None, topk_ids.view(-1), nact, None, block, k, num_experts, 1)


def _check_experts(name, w, x, E, rows, cols):
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"{name} must be a [E, {rows}, {cols}] torch.Tensor")
    if w.dtype != x.dtype:
        raise TypeError(f"{name} dtype must match x ({x.dtype}), got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {w.device}")
    if w.shape[0] != E:
        raise ValueError(f"{name} has {w.shape[0]} experts, the grouping {E}")
    if w.stride(2) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")


def _check_settings(settings, grouping):
    if settings is None:
        return
    if not isinstance(settings, MoeSettings):
        raise TypeError(f"settings must be None or a MoeSettings, got {type(settings).__name__}")
    if settings.block != grouping.block:
        raise ValueError(f"settings.block={settings.block} differs from the grouping's "
                         f"block={grouping.block}")


_IMPLS = ("triton", "gluon")


def _check_impl(impl):
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")


def _gluon():
    # imported on use: the Gluon module imports this one (Grouping, the combine kernel)
    from . import moe_gluon
    return moe_gluon


def _refuse_gluon(x, pdl):
    """ValueError naming why impl='gluon' cannot take x (before any kernel runs)."""
    if pdl is not None and not isinstance(pdl, bool):
        raise TypeError(f"pdl must be None or a bool, got {pdl!r}")
    reason = _gluon().unsupported_reason(x.device, x.dtype)
    if reason is not None:
        raise ValueError(reason)


def _settings_for(settings, grouping, target, T, dtype):
    if settings is None:
        return default_settings(target, T=T, top_k=grouping.top_k,
                                num_experts=grouping.num_experts, dtype=dtype,
                                block=grouping.block)
    return settings


def moe_gate_up(x, w_gate_up, grouping, *, norm_eps=None, pdl=None, settings=None,
                impl="triton", route=None):
    """act = silu(x_t @ Wg_e^T) * (x_t @ Wu_e^T) for every grouped (token t, expert e) row.

    Args:
        x: [T, H] hidden states (as route); the token of grouped row r is
            grouping.sorted_pairs[r] // top_k.
        w_gate_up: [E, 2F, H], x's dtype, last dim contiguous: expert e's gate rows
            then its up rows (transformers' Qwen3-MoE / OLMoE gate_up_proj layout).
            With norm_eps, the RMSNorm weight folded into its columns.
        grouping: group()'s result for this step's ids.
        norm_eps: None or the RMSNorm epsilon (FlashNorm scale per token, in fp32).
        pdl, settings: as in route; settings.block must equal grouping.block.
        impl: "triton" (every target) or "gluon" (the sm_90 warp-specialized kernel of
            moe_gluon.py, fp16/bf16, contiguous weights; settings None or a
            moe_gluon.GluonMoeSettings; refused with a ValueError while
            moe_gluon.VERIFIED_ON_GPU is False, and on other targets). PDL does not
            apply to the Gluon launch (it is launched without it).
        route: None, or route_logits' LogitsRoute for this one token (impl "triton"):
            the grouping must then be one_token_grouping(route.ids, ...), whose blocks
            this launch assigns to experts itself (selecting each slot's from
            route.logits, with the route's score_bias, groups, topk_groups and scale as
            route() applies them) while writing route.ids and route.weights for the down
            projection and combine.

    Returns:
        act [rows_max, F] in x's dtype, by grouped row; padding rows are not written.
        Only touched experts' weights are read.
    """
    T, H = _check_x(x)
    _check_grouping(grouping, x.device)
    if T != grouping.tokens:
        raise ValueError(f"x has T={T} tokens; the grouping was made for "
                         f"{grouping.tokens} (its pairs would read rows past x)")
    E = grouping.num_experts
    _check_experts("w_gate_up", w_gate_up, x, E, "2F", f"H={H}")
    if w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2F, H={H}] with an even 2F, got "
                         f"{tuple(w_gate_up.shape)}")
    _check_norm_eps(norm_eps)
    _check_impl(impl)
    _check_route(route, grouping, x, impl)
    if impl == "gluon":
        _refuse_gluon(x, pdl)  # the Gluon launch itself takes no PDL
        return _gluon().gate_up(x, w_gate_up, grouping, norm_eps, settings)
    _check_settings(settings, grouping)
    target, pdl = _resolve_pdl(pdl, x.device)
    s = _settings_for(settings, grouping, target, T, x.dtype)
    F = w_gate_up.shape[1] // 2
    rows = grouping.sorted_pairs.shape[0]
    act = empty((rows, F), x.dtype, x.device)
    if target.backend == "interpreter" and x.dtype == torch.bfloat16:
        # the interpreter's tl.dot multiplies bf16 as raw bits: fp32, rounded once
        return act.copy_(moe_gate_up(x.float(), w_gate_up.float(), grouping,
                                     norm_eps=norm_eps, pdl=pdl, settings=settings,
                                     route=route))
    launch = {"launch_pdl": True} if pdl else {}
    logits, wts = (route.logits, route.weights) if route is not None else (act, act)
    bias = route.score_bias if route is not None and route.score_bias is not None else logits
    _grouped_kernel[(rows // s.block, cdiv(F, s.BLOCK_N))](
        x, w_gate_up, grouping.sorted_pairs, grouping.expert_of_block,
        grouping.num_active_blocks, wts, act, logits, bias, F, H, E, float(norm_eps or 0.0),
        float(route.scale) if route is not None else 1.0,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        TOP_K=grouping.top_k, BLOCK_M=s.block, BLOCK_N=s.BLOCK_N, BLOCK_K=s.BLOCK_K,
        USE_DOT=s.use_dot, GATE_UP=True, NORM=norm_eps is not None, PDL=pdl,
        STAGES=s.num_stages, ROUTE=route is not None, BLOCK_E=_route_block_e(E),
        RENORM=route is not None and route.renormalize,
        SIGMOID=route is not None and route.sigmoid,
        BIAS=route is not None and route.score_bias is not None,
        GROUPS=route.groups if route is not None else 1,
        TOPK_GROUPS=route.topk_groups if route is not None else 1,
        num_warps=s.num_warps, num_stages=s.num_stages, **launch)
    return act


def _check_route(route, grouping, x, impl):
    """ValueError / TypeError unless route is None or a LogitsRoute that this one-token
    grouping was made from (one_token_grouping(route.ids, ...))."""
    if route is None:
        return
    if not isinstance(route, LogitsRoute):
        raise TypeError(f"route must be None or route_logits' LogitsRoute, got "
                        f"{type(route).__name__}")
    if impl != "triton":
        raise ValueError(f"route= (the top-k inside the gate/up launch) runs on impl 'triton', "
                         f"not {impl!r}")
    if x.shape[0] != 1:
        raise ValueError(f"route= takes one token; x has T={x.shape[0]}")
    if route.logits.shape != (1, grouping.num_experts) or route.top_k != grouping.top_k:
        raise ValueError(f"route has logits {tuple(route.logits.shape)} and top_k="
                         f"{route.top_k}; the grouping has E={grouping.num_experts}, top_k="
                         f"{grouping.top_k}")
    k = route.top_k
    for name, t, shape in (("logits", route.logits, (1, grouping.num_experts)),
                           ("weights", route.weights, (1, k))):
        if t.dtype != torch.float32 or t.device != x.device or tuple(t.shape) != shape \
                or not t.is_contiguous():
            raise ValueError(f"route.{name} must be contiguous float32 {list(shape)} on x's "
                             f"device {x.device} (route_logits' buffer), got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if grouping.expert_offsets is not None or route.ids.device != x.device \
            or grouping.expert_of_block.data_ptr() != route.ids.data_ptr():
        raise ValueError("route= needs grouping = one_token_grouping(route.ids, ...): the "
                         "launch writes each block's expert there")
    _check_ds_routing(grouping.num_experts, route.top_k,
                      "sigmoid" if route.sigmoid else "softmax", route.score_bias,
                      route.groups, route.topk_groups, route.scale, x.device)


def moe_down_combine(act, w_down, grouping, topk_weights, out=None, *, residual=None,
                     pdl=None, settings=None, impl="triton"):
    """out[t] = residual[t] + sum_j topk_weights[t, j] * (act[row(t, j)] @ Wd_e^T).

    Args:
        act: moe_gate_up's [rows_max, F] result, by grouped row.
        w_down: [E, H, F], act's dtype, last dim contiguous (nn.Linear per expert).
        grouping: the Grouping act was computed with.
        topk_weights: float32 [T, top_k] (route's), contiguous, on act's device; T the
            grouping's tokens.
        out: None (allocate) or [T, H] in act's dtype, last dim contiguous, rows apart;
            may be residual itself (in-place update of the residual stream), and must
            not overlap it otherwise.
        residual: None or [T, H] in act's dtype, last dim contiguous.
        pdl, settings, impl: as in moe_gate_up (impl picks the down projection; the
            combine is the same Triton kernel either way).

    Returns:
        out [T, H]. The down projection writes fp32 per-pair results [T*k, H] (each
        element by one program); a second kernel adds a token's k results in slot order
        onto the residual in fp32 and rounds once: deterministic, no atomics.
    """
    if not isinstance(act, torch.Tensor) or act.dim() != 2:
        raise ValueError("act must be the [rows, F] tensor moe_gate_up returns")
    if act.dtype not in _DTYPES:
        raise TypeError(f"act dtype must be float16, bfloat16 or float32, got {act.dtype}")
    _check_grouping(grouping, act.device)
    rows, F = act.shape
    if rows != grouping.sorted_pairs.shape[0] or act.stride(1) != 1:
        raise ValueError(f"act must be [rows_max={grouping.sorted_pairs.shape[0]}, F] with a "
                         f"contiguous last dimension, got {tuple(act.shape)}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 2 \
            or topk_weights.shape[1] != grouping.top_k:
        raise ValueError(f"topk_weights must be [T, top_k={grouping.top_k}]")
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        raise TypeError("topk_weights must be contiguous float32 (route's output)")
    if topk_weights.device != act.device:
        raise ValueError(f"topk_weights must be on act's device {act.device}, got "
                         f"{topk_weights.device}")
    T = topk_weights.shape[0]
    if T != grouping.tokens:
        raise ValueError(f"topk_weights has T={T} tokens; the grouping was made for "
                         f"{grouping.tokens} (the down projection writes a row a pair)")
    E = grouping.num_experts
    _check_experts("w_down", w_down, act, E, "H", f"F={F}")
    if w_down.shape[2] != F:
        raise ValueError(f"w_down must be [E, H, F={F}], got {tuple(w_down.shape)}")
    H = w_down.shape[1]
    _check_out_residual(out, residual, T, H, act.dtype, act.device, "act")
    _check_impl(impl)
    if impl == "gluon":
        _refuse_gluon(act, pdl)
        y = _gluon().down(act, w_down, grouping, topk_weights, settings)
        target, pdl = _resolve_pdl(pdl, act.device)  # the combine's
        if out is None:
            out = empty((T, H), act.dtype, act.device)
        return _combine(y, out, residual, grouping, T, H, pdl)
    _check_settings(settings, grouping)
    target, pdl = _resolve_pdl(pdl, act.device)
    s = _settings_for(settings, grouping, target, T, act.dtype)
    if out is None:
        out = empty((T, H), act.dtype, act.device)
    if target.backend == "interpreter" and act.dtype == torch.bfloat16:
        y = moe_down_combine(act.float(), w_down.float(), grouping, topk_weights,
                             residual=None if residual is None else residual.float(),
                             pdl=pdl, settings=settings)
        return out.copy_(y)
    y = empty((T * grouping.top_k, H), torch.float32, act.device)
    launch = {"launch_pdl": True} if pdl else {}
    _grouped_kernel[(rows // s.block, cdiv(H, s.BLOCK_N))](
        act, w_down, grouping.sorted_pairs, grouping.expert_of_block,
        grouping.num_active_blocks, topk_weights, y, y, y, H, F, E, 0.0, 1.0,
        act.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        TOP_K=grouping.top_k, BLOCK_M=s.block, BLOCK_N=s.BLOCK_N, BLOCK_K=s.BLOCK_K,
        USE_DOT=s.use_dot, GATE_UP=False, NORM=False, PDL=pdl, STAGES=s.num_stages,
        num_warps=s.num_warps, num_stages=s.num_stages, **launch)
    return _combine(y, out, residual, grouping, T, H, pdl)


def _check_out_residual(out, residual, T, H, dtype, device, like):
    """out and residual: None or [T, H] of dtype on device, last dimension contiguous; out
    with no two rows on the same memory, and either residual itself or apart from it (the
    combine reads residual[t] and writes out[t] element for element, so a partial overlap
    would read rows already written)."""
    for name, t in (("residual", residual), ("out", out)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (T, H):
            raise ValueError(f"{name} must be a [T, H] = [{T}, {H}] tensor")
        if t.dtype != dtype:
            raise TypeError(f"{name} dtype must match {like} ({dtype}), got {t.dtype}")
        if t.device != device or t.stride(1) != 1:
            raise ValueError(f"{name} must be on {device} with a contiguous last dimension")
    if out is None:
        return
    check_distinct("out", out)
    if residual is not None and not same_view(out, residual) and overlaps(out, residual):
        raise ValueError("out must be residual itself or not overlap it")


def _combine(y, out, residual, grouping, T, H, pdl):
    """out[t] = residual[t] + y[t*k] + ... + y[t*k + k-1] (the per-pair fp32 rows)."""
    launch = {"launch_pdl": True} if pdl else {}
    res = residual if residual is not None else out
    block_h, warps = _combine_launch(T)
    _combine_kernel[(T, cdiv(H, block_h))](
        y, res, out, H, y.stride(0), res.stride(0), out.stride(0), TOP_K=grouping.top_k,
        BLOCK_H=block_h, RESIDUAL=residual is not None, PDL=pdl, num_warps=warps, **launch)
    return out


def _combine_launch(T: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of the combine for T tokens (COMBINE_NARROW_T)."""
    return (128, 1) if T <= COMBINE_NARROW_T else (COMBINE_BLOCK_H, 4)


def moe(x, router_w, w_gate_up, w_down, *, top_k, renormalize, norm_eps=None,
        scoring="softmax", score_bias=None, groups=1, topk_groups=1, scale=1.0,
        residual=None, out=None, pdl=None, settings=None, impl="triton"):
    """The whole MoE block for a decode step: route -> group -> gate_up -> down+combine.

    Shapes as in the four launchers: x [T, H], router_w [E, H], w_gate_up [E, 2F, H],
    w_down [E, H, F]; returns out [T, H] in x's dtype (residual added when given).
    The routing arguments are route()'s: top_k, renormalize, norm_eps, scoring, and the
    DeepSeek-V3 / dots.llm1 router's score_bias (e_score_correction_bias), groups and
    topk_groups (n_group, topk_group) and scale (routed_scaling_factor, applied to the
    routing weights, so to the routed experts' sum only).
    Six launches (route's two, group, gate_up, moe_down_combine's two), no host sync.
    impl="gluon" runs the grouped gate/up and down on the sm_90 Gluon kernel
    (moe_gate_up's impl; settings then a moe_gluon.GluonMoeSettings, its block the
    grouping's), refused before any launch where that kernel cannot run.

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> x = torch.randn(2, 64); rw = torch.randn(8, 64)
        >>> wgu = torch.randn(8, 2 * 32, 64) / 8; wd = torch.randn(8, 64, 32) / 6
        >>> y = moe(x, rw, wgu, wd, top_k=2, renormalize=True)   # [2, 64]
    """
    _check_impl(impl)
    if impl == "gluon" and isinstance(x, torch.Tensor):
        _refuse_gluon(x, pdl)  # before any kernel runs, route and group included
    # every argument before route's first launch: the launchers below check theirs only
    # after the kernels before them have run
    T, H, E = _check_router(x, router_w, top_k, renormalize, norm_eps, scoring, score_bias,
                            groups, topk_groups, scale)
    _check_experts("w_gate_up", w_gate_up, x, E, "2F", f"H={H}")
    if w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2 or not w_gate_up.shape[1]:
        raise ValueError(f"w_gate_up must be [E={E}, 2F, H={H}] with an even 2F > 0, got "
                         f"{tuple(w_gate_up.shape)}")
    F = w_gate_up.shape[1] // 2
    _check_experts("w_down", w_down, x, E, f"H={H}", f"F={F}")
    if tuple(w_down.shape[1:]) != (H, F):
        raise ValueError(f"w_down must be [E={E}, H={H}, F={F}] (x's H, w_gate_up's F), got "
                         f"{tuple(w_down.shape)}")
    _check_out_residual(out, residual, T, H, x.dtype, x.device, "x")
    if settings is not None:
        if impl == "gluon":
            _gluon()._check_call(x, w_gate_up, settings, True)
        elif not isinstance(settings, MoeSettings):
            raise TypeError(f"settings must be None or a MoeSettings, got "
                            f"{type(settings).__name__}")
    if pdl is not None and not isinstance(pdl, bool):
        raise TypeError(f"pdl must be None or a bool, got {pdl!r}")
    wts, ids = route(x, router_w, top_k=top_k, renormalize=renormalize, norm_eps=norm_eps,
                     scoring=scoring, score_bias=score_bias, groups=groups,
                     topk_groups=topk_groups, scale=scale, pdl=pdl)
    target = target_of(x.device)
    E = router_w.shape[0]
    if settings is not None and hasattr(settings, "block"):
        block = settings.block
    elif impl == "gluon":
        block = _gluon().default_block(x.shape[0], top_k, E)
    else:
        block = default_settings(target, T=x.shape[0], top_k=top_k, num_experts=E,
                                 dtype=x.dtype).block
    g = group(ids, E, block, pdl=pdl)
    act = moe_gate_up(x, w_gate_up, g, norm_eps=norm_eps, pdl=pdl, settings=settings,
                      impl=impl)
    return moe_down_combine(act, w_down, g, wts, out, residual=residual, pdl=pdl,
                            settings=settings, impl=impl)


# --------------------------------------------------------------------------- compile specs



def compile_spec(cc: int, kernel: str, *, T: int = 1, H: int = 2048, E: int = 128,
                 top_k: int = 8, F: int = 768, dtype: str = "bf16", pdl: bool = False,
                 norm: bool = False, residual: bool = False, renormalize: bool = True,
                 settings: MoeSettings | None = None, num_sms: int = 132,
                 route: bool = False, scoring: str = "softmax", score_bias: bool = False,
                 groups: int = 1, topk_groups: int = 1) -> dict:
    """What ``triton.compile`` needs to build one MoE kernel for compute capability cc.

    kernel: "router_logits", "route" (top-k of the logits), "group", "gate_up", "down" or
    "combine"; route: the gate/up build that selects its slot's expert itself (one token,
    moe_gate_up(..., route=)). scoring, score_bias (whether there is one), groups and
    topk_groups: the routing of the "route" build and of the route= gate/up build, as
    route()'s arguments (DeepSeek-V3: "sigmoid", True, 8, 4). Settings default to
    default_settings on a GPU with num_sms SMs. Returns {"fn", "signature",
    "constexprs", "attrs", "options"} as gemv.compile_spec does.
    """
    t = dtype_name(dtype)  # Triton's type string is the same name
    if settings is None:
        settings = default_settings(Target("cuda", cc, num_sms), T=T, top_k=top_k,
                                    num_experts=E, dtype=DTYPES[dtype])
    options = {"num_warps": 4}
    if pdl:
        options["launch_pdl"] = True
    if kernel == "router_logits":
        sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "logits_ptr": "*fp32", "H": "i32", "E": "i32",
               "eps": "fp32", "stride_xt": "i32", "stride_we": "i32"}
        const = {"BLOCK_E": ROUTER_BLOCK_E, "BLOCK_H": _router_block_h(H), "NORM": norm,
                 "PDL": pdl}
        fn, aligned = _router_logits_kernel, ("x_ptr", "w_ptr", "logits_ptr", "H",
                                              "stride_xt", "stride_we")
    elif kernel == "route":
        sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "wts_ptr": "*fp32",
               "ids_ptr": "*i32", "E": "i32", "scale": "fp32"}
        const = {"TOP_K": top_k, "BLOCK_E": max(16, next_pow2(E)),
                 "BLOCK_TK": next_pow2(top_k), "RENORM": renormalize,
                 "SIGMOID": scoring == "sigmoid", "PDL": pdl, "BIAS": score_bias,
                 "GROUPS": groups, "TOPK_GROUPS": topk_groups}
        fn, aligned = _route_kernel, ("logits_ptr", "wts_ptr", "ids_ptr")
        options = {**options, "num_warps": ROUTE_NUM_WARPS}
    elif kernel == "group":
        sig = {"ids_ptr": "*i32", "pairs_ptr": "*i32", "offs_ptr": "*i32", "counts_ptr": "*i32",
               "eob_ptr": "*i32", "nact_ptr": "*i32", "P": "i32", "E": "i32", "ROWS": "i32",
               "NB": "i32"}
        const = {**_group_launch(T, top_k, E, settings.block)[1], "PDL": pdl}
        fn, aligned = _group_kernel, ("ids_ptr", "pairs_ptr", "offs_ptr", "counts_ptr",
                                      "eob_ptr", "nact_ptr")
        options = {**options, "num_warps": GROUP_NUM_WARPS}
    elif kernel in ("gate_up", "down"):
        gate_up = kernel == "gate_up"
        routed = route and gate_up
        sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "pairs_ptr": "*i32", "eob_ptr": "*i32",
               "nact_ptr": "*i32",
               "wts_ptr": "*fp32" if not gate_up or routed else f"*{t}",
               "out_ptr": f"*{t}" if gate_up else "*fp32",
               "logits_ptr": "*fp32" if routed else ("*fp32" if not gate_up else f"*{t}"),
               "bias_ptr": "*fp32" if routed else ("*fp32" if not gate_up else f"*{t}"),
               "NOUT": "i32", "K": "i32", "E": "i32",
               "eps": "fp32", "scale": "fp32", "stride_xt": "i32", "stride_we": "i32",
               "stride_wn": "i32", "stride_ot": "i32"}
        const = {"TOP_K": top_k, "BLOCK_M": settings.block, "BLOCK_N": settings.BLOCK_N,
                 "BLOCK_K": settings.BLOCK_K, "USE_DOT": settings.use_dot,
                 "GATE_UP": gate_up, "NORM": norm and gate_up, "PDL": pdl,
                 "STAGES": settings.num_stages, "ROUTE": routed,
                 "BLOCK_E": _route_block_e(E), "RENORM": renormalize and routed,
                 "SIGMOID": scoring == "sigmoid" and routed,
                 "BIAS": score_bias and routed, "GROUPS": groups if routed else 1,
                 "TOPK_GROUPS": topk_groups if routed else 1}
        options = {**options, "num_warps": settings.num_warps,
                   "num_stages": settings.num_stages}
        fn, aligned = _grouped_kernel, ("x_ptr", "w_ptr", "pairs_ptr", "eob_ptr", "nact_ptr",
                                        "wts_ptr", "out_ptr", "logits_ptr", "NOUT", "K",
                                        "stride_xt",
                                        "stride_we", "stride_wn", "stride_ot")
    elif kernel == "combine":
        sig = {"y_ptr": "*fp32", "res_ptr": f"*{t}", "out_ptr": f"*{t}", "H": "i32",
               "stride_yp": "i32", "stride_rt": "i32", "stride_ot": "i32"}
        block_h, warps = _combine_launch(T)
        const = {"TOP_K": top_k, "BLOCK_H": block_h, "RESIDUAL": residual, "PDL": pdl}
        options["num_warps"] = warps
        fn, aligned = _combine_kernel, ("y_ptr", "res_ptr", "out_ptr", "H", "stride_yp",
                                        "stride_rt", "stride_ot")
    else:
        raise ValueError(f"kernel must be 'route', 'group', 'gate_up', 'down' or 'combine', "
                         f"got {kernel!r}")
    sig.update({name: "constexpr" for name in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": sig, "constexprs": const, "attrs": attrs, "options": options}
